"""One run record: the doctor, the study's evidence (what its claims and report read) and the record itself agree on
whether a run learned, stalled or diverged, for constructed run directories whose chance level is cached (no data
is loaded): a learned run, a stalled one, one whose data has no chance level (NaN), an early-stopped run whose
newest evaluation is worse than its standing one, and a diverged run."""

from __future__ import annotations

import json
import math

import pytest

from kilolayer import rundir
from kilolayer.analysis.chance import METHOD
from kilolayer.config import dump_yaml, load_config
from kilolayer.doctor import diagnose, outcome
from kilolayer.files import write_atomic
from kilolayer.record import RunRecord
from kilolayer.study.runner import collect
from kilolayer.study.spec import Point
from kilolayer.verdicts.evidence import failed, learned

CONFIG = {
    "model": {"arch": "decoder", "scheme": "pre_ln", "layers": 2, "width": 16, "heads": 2, "ffn": 32},
    "objective": {"name": "causal_lm"},
    "data": {"name": "synthetic", "task": "copy"},
    "train": {"steps": 20, "batch_size": 8, "eval_every": 10},
}
CHANCE = 2.4


def constructed_run(out, name, evals, chance=CHANCE, status="completed", best=None):
    """A study point's run directory: ``evals`` at steps 10, 20, ...; its cached chance level ``chance``; with
    ``best``, checkpoints at every evaluated step, the newest naming ``best`` as the best step early stopping found
    (``train.patience`` 2)."""
    config = load_config({**CONFIG, "train": {**CONFIG["train"], "patience": 2 if best else 0}})
    path = out / "runs" / "g" / name
    path.mkdir(parents=True)
    write_atomic(path / rundir.CONFIG, dump_yaml(config))
    lines = [{"step": 5, "split": "train", "loss": 3.0, "lr": 1e-3}]
    lines += [{"step": 10 * (i + 1), "split": "eval", "loss": loss} for i, loss in enumerate(evals)]
    write_atomic(path / rundir.METRICS, "".join(rundir.metrics_line(r) for r in lines))
    rundir.write_status(path, status, 10 * len(evals), "" if status == "completed" else "non-finite loss")
    cache = rundir.analysis_file(path, "chance")
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"loss": chance, "method": METHOD}))  # NaN as JSON's NaN literal
    if best is not None:
        for i in range(len(evals)):
            ckpt = rundir.checkpoint_dir(path, 10 * (i + 1))
            ckpt.mkdir(parents=True)
            (ckpt / "state.json").write_text(json.dumps({"trainer": {"best_step": best}}))
            (ckpt / rundir.COMPLETE).write_text("")
    return Point("g", name, {}, config)


CASES = {
    # name: (evaluation losses, chance, status, best step, learned, the doctor's outcome)
    "learned": ((2.0, 1.5), CHANCE, "completed", None, True, "trains"),
    "stalled": ((2.4, 2.3), CHANCE, "completed", None, False, "stalls"),
    "nan_chance": ((2.0, 1.5), math.nan, "completed", None, None, None),
    "early_stopped": ((1.5, 2.3), CHANCE, "completed", 10, True, "trains"),
    "diverged": ((2.0,), CHANCE, "diverged", None, False, "diverges"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_doctor_evidence_and_record_agree_on_learned_and_stalled(tmp_path, name):
    evals, chance, status, best, want_learned, want_outcome = CASES[name]
    point = constructed_run(tmp_path, name, evals, chance, status, best)
    run = point.run_dir(tmp_path)

    record = RunRecord.read(run, read_only=True)
    assert record.learned() is want_learned and record.outcome() == want_outcome
    want_failed = None if want_learned is None else (status == "diverged" or not want_learned)
    assert record.failed() is want_failed

    # the doctor: its outcome, and its diagnosis's chance finding
    assert outcome(run, point.config).label == want_outcome
    d = diagnose(run, replay_steps=0, smoothness_samples=0)
    assert d.outcome["label"] == want_outcome
    codes = {f.code for f in d.findings}
    assert ("learned_nothing" in codes or "never_below_chance" in codes) is (name == "stalled")

    # the study's evidence, which its claims and report read, on the result the study collects
    result = collect(point, tmp_path)
    assert learned(result, tmp_path) is want_learned and failed(result, tmp_path) is want_failed


def test_the_standing_evaluation_is_the_one_every_reader_judges(tmp_path):
    """Under early stopping the standing evaluation is the best step's (step 10 at 1.5 nats), not the newest (2.3
    nats, above 0.9 x chance): the doctor's outcome quotes the loss the verdicts read."""
    point = constructed_run(tmp_path, "early", (1.5, 2.3), best=10)
    run = point.run_dir(tmp_path)
    record = RunRecord.read(run)
    assert record.eval == {"step": 10, "split": "eval", "loss": 1.5} and record.checkpoint_step() == 10
    o = outcome(run, point.config)
    assert o.final_loss == 1.5 and o.chance == CHANCE and "0.62 x chance" in o.why


def test_a_nan_chance_level_is_said_as_no_outcome(tmp_path):
    point = constructed_run(tmp_path, "nan", (2.0, 1.5), chance=math.nan)
    o = outcome(point.run_dir(tmp_path), point.config)
    assert o.label is None and "no chance level" in o.why
    d = diagnose(point.run_dir(tmp_path), replay_steps=0, smoothness_samples=0)
    assert d.measurements.eval_loss["final_eval"] == 1.5 and math.isnan(d.measurements.eval_loss["chance"])


def test_the_doctor_reads_the_chance_cache_but_never_writes_it(tmp_path):
    point = constructed_run(tmp_path, "r", (2.0, 1.5))
    run = point.run_dir(tmp_path)
    cache = rundir.analysis_file(run, "chance")
    cache.write_text(json.dumps({"loss": CHANCE, "method": METHOD - 1}))  # another method's value: not used
    levels = {"computed": 0}

    def compute(run_dir, config, write=True):
        levels["computed"] += 1
        assert write is False
        return {"loss": 3.0, "method": METHOD}

    record = RunRecord.read(run, read_only=True)
    assert record.chance_level(compute=compute) == {"loss": 3.0, "method": METHOD}
    assert record.chance_level(compute=compute)["loss"] == 3.0 and levels["computed"] == 1  # read once
    assert json.loads(cache.read_text())["method"] == METHOD - 1
