"""A study point initialised from another point's run (``init_from``) starts only from a completed source,
records which checkpoint of it it loaded, and is trained again when the source's chosen checkpoint moved."""

from __future__ import annotations

import pytest
from objective_helpers import tiny_decoder

from kilolayer import rundir
from kilolayer.config import load_config
from kilolayer.study.runner import run_study, train_point
from kilolayer.study.spec import StudySpec, expand
from kilolayer.train.run import train

MODEL = tiny_decoder()
DATA = {"name": "stdlib_bytes", "options": {"seq_len": 32, "max_bytes": 200_000, "eval_windows": 8}}
TRAIN = {"batch_size": 4, "lr": 1e-3, "log_every": 1, "eval_batches": 1, "peak_flops": 1e11}
SPEC = {
    "name": "pretrain_finetune",
    "groups": [
        {
            "name": "pre",
            "base": {
                "model": MODEL,
                "objective": {"name": "causal_lm"},
                "data": DATA,
                "train": {**TRAIN, "steps": 4, "eval_every": 2, "checkpoint_every": 2, "keep_checkpoints": 3},
            },
        },
        {
            "name": "ft",
            "init_from": "pre",
            "base": {
                "model": MODEL,
                "objective": {"name": "causal_lm"},
                "data": DATA,
                "train": {**TRAIN, "steps": 2, "lr": 5e-4, "eval_every": 2},
            },
        },
    ],
}


def with_train(config, **train_values):
    data = config.model_dump()
    return load_config({**data, "train": {**data["train"], **train_values}})


@pytest.mark.integration
@pytest.mark.slow
def test_finetuning_waits_for_a_completed_source_and_retrains_when_it_moved(tmp_path, forked_points):
    spec = StudySpec.model_validate(SPEC)
    pre, ft = expand(spec)
    assert ft.init_from_point == pre.key == "pre/seed=0"
    out = tmp_path / "study"
    src, dep = pre.run_dir(out), ft.run_dir(out)
    # the pretraining run was stopped halfway: an intact checkpoint at step 2, status interrupted
    train(with_train(pre.config, steps=2), src, quiet=True)
    rundir.write_status(src, "interrupted", 2, "interrupted by SIGTERM at step 2 (checkpoint step 2 saved)")

    # (a) the runner does not start the fine-tuning point from it; the reason names the source
    lines: list[str] = []
    attempt = train_point(ft, out, log=lines.append)
    assert (attempt.status, attempt.trained) == ("failed", False)
    reason = "not started: its init_from point pre/seed=0 is interrupted at step 2; it trains once that one completes"
    assert rundir.read_status(dep)["reason"] == reason
    assert lines == [f"[study] ft/seed=0: {reason}"]
    assert not (dep / rundir.CHECKPOINTS).exists() and not (dep / rundir.METRICS).exists()

    # (b) a plain `kilolayer train --set train.init_from=...` records the run and step it started from (here
    # the partial source's step 2)
    train(ft.config, dep, resume=True, quiet=True, sets=[f"train.init_from={src}"])
    st = rundir.read_status(dep)
    assert st["status"] == "completed"
    assert st["init_from"] == {"path": str(src.resolve()), "step": 2}

    # (c) a re-run resumes the source to completion (its chosen checkpoint is now step 4), sets the dependent run
    # started from step 2 aside and trains it again from step 4
    lines = []
    results = run_study(spec, out, log=lines.append)
    assert [(r.point.key, r.status, r.ran) for r in results] == [
        ("pre/seed=0", "completed", True),
        ("ft/seed=0", "completed", True),
    ]
    assert rundir.read_status(src)["step"] == 4
    assert rundir.read_status(dep)["init_from"] == {"path": str(src.resolve()), "step": 4}
    stale = dep.with_name("seed=0.stale-1")
    assert rundir.read_status(stale)["init_from"] == {"path": str(src.resolve()), "step": 2}
    assert (stale / rundir.CHECKPOINTS).is_dir()  # the old run is kept whole
    said = [ln for ln in lines if "again from scratch" in ln]
    assert said == [
        "[study] ft/seed=0: training again from scratch: it started from step 2 of pre/seed=0, whose chosen "
        "checkpoint is now step 4 (the old run is kept as seed=0.stale-1)"
    ]
    # nothing is stale any more: a further re-run trains nothing
    assert not any(r.ran for r in run_study(spec, out, log=lambda *_: None))


@pytest.mark.integration
@pytest.mark.slow
def test_a_diverged_source_is_no_pretraining(tmp_path):
    """A source that diverged is a result of its own, but not weights to fine-tune: the dependent point is
    recorded failed, naming it, on every run of the study."""
    spec = StudySpec.model_validate(SPEC)
    pre, ft = expand(spec)
    out = tmp_path / "study"
    train(with_train(pre.config, steps=2), pre.run_dir(out), quiet=True)
    rundir.write_status(pre.run_dir(out), "diverged", 2, "loss nan at step 2")
    for _ in range(2):
        results = run_study(spec, out, log=lambda *_: None)
        assert [(r.status, r.ran) for r in results] == [("diverged", False), ("failed", False)]
        assert results[1].reason.startswith("not started: its init_from point pre/seed=0 is diverged at step 2;")
    assert not (ft.run_dir(out) / rundir.CHECKPOINTS).exists()
