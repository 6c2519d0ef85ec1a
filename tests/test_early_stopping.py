"""Early stopping (train.patience): stops on a plateau, keeps the best checkpoint (load_run uses it), a resume
after the stop changes nothing, a resume before it continues bit for bit, bad values are one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from objective_helpers import tiny_lm

from kilolayer import rundir
from kilolayer.cli import main
from kilolayer.config import dump_yaml, load_config
from kilolayer.train.checkpoint import load_run, read_weights
from kilolayer.train.policies import early_stop_mode
from kilolayer.train.run import train

LM = tiny_lm(
    steps=40,
    batch_size=4,
    lr=1e-3,
    log_every=1,
    eval_every=3,
    eval_batches=2,
    keep_checkpoints=1,
    peak_flops=1e11,
)
# The eval loss falls at every evaluation here; told that higher is better, early stopping sees its first
# evaluation (step 3) as the best and none after it: with patience 3 it stops at step 12, exactly.
WORSENING = {**LM, "train": {**LM["train"], "patience": 3, "early_stop_mode": "max"}}


def cfg(base: dict = LM, **train) -> dict:
    return {**base, "train": {**base["train"], **train}}


def records(run: Path, split: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in rundir.read_metrics(run) if r["split"] == split]


def steps(run: Path) -> list[int]:
    return [rundir.checkpoint_step(p) for p in rundir.complete_checkpoints(run)]


def test_stops_on_a_plateau(tmp_path):
    """lr 1e-8: the loss does not move, so no evaluation after the first improves it by min_delta."""
    run = tmp_path / "run"
    result = train(cfg(lr=1e-8, patience=2, min_delta=0.01), run, quiet=True)
    assert result == {"status": "completed", "step": 9, "stopped_early": True, "best_step": 3}
    st = rundir.read_status(run)
    assert (st["status"], st["step"], st["stopped_early"], st["best_step"]) == ("completed", 9, True, 3)
    assert st["reason"].startswith("plateau: no improvement of loss by 0.01 in 2 evaluations; best ")
    assert st["early_stop_metric"] == "loss" and st["best"] == records(run, "eval")[0][1]
    assert [s for s, _ in records(run, "eval")] == [3, 6, 9] and records(run, "train")[-1][0] == 9
    assert steps(run) == [3, 9]  # the best and where it stopped


def test_the_step_budget_is_said_too(tmp_path):
    run = tmp_path / "run"
    result = train(cfg(steps=7, patience=5), run, quiet=True)
    assert result == {"status": "completed", "step": 7, "stopped_early": False, "best_step": 6}
    st = rundir.read_status(run)
    assert st["reason"] == "step budget" and st["stopped_early"] is False and st["best_step"] == 6


def test_keeps_the_best_checkpoint_and_load_run_uses_it(tmp_path, trained_run):
    run = shutil.copytree(trained_run(WORSENING), tmp_path / "run")
    st = rundir.read_status(run)
    assert (st["step"], st["best_step"], st["stopped_early"]) == (12, 3, True)
    # keep_checkpoints 1: the newest (12) and the best it names (3); 6 and 9 rotated away
    assert steps(run) == [3, 12]
    config, task = load_run(run)
    best = read_weights(rundir.checkpoint_dir(run, 3) / "model.safetensors")
    newest = read_weights(rundir.checkpoint_dir(run, 12) / "model.safetensors")
    loaded = task.state_dict()
    assert all(torch.equal(loaded[k], best[k]) for k in best)
    assert not all(torch.equal(best[k], newest[k]) for k in best)
    assert rundir.chosen_checkpoint(run, patience=3) == rundir.checkpoint_dir(run, 3)
    _, task = load_run(run, checkpoint=rundir.checkpoint_dir(run, 12))  # a caller may name one
    assert all(torch.equal(task.state_dict()[k], newest[k]) for k in newest)
    # without early stopping the newest stands for the run
    (run / "config.yaml").write_text(dump_yaml(load_config(cfg(WORSENING, patience=0))))
    _, task = load_run(run)
    assert all(torch.equal(task.state_dict()[k], newest[k]) for k in newest)


def test_a_damaged_best_checkpoint_falls_back_to_the_newest(tmp_path, capsys, trained_run):
    run = shutil.copytree(trained_run(WORSENING), tmp_path / "run")
    f = rundir.checkpoint_dir(run, 3) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    assert rundir.chosen_checkpoint(run, patience=3) == rundir.checkpoint_dir(run, 12)
    err = capsys.readouterr().err
    assert "step_00000003/model.safetensors: SHA-256 does not match" in err and "using the newest step_00000012" in err


def test_resume_after_the_stop_is_a_no_op(tmp_path):
    run = tmp_path / "run"
    first = train(WORSENING, run, quiet=True)
    metrics = (run / "metrics.jsonl").read_bytes()
    weights = {s: (rundir.checkpoint_dir(run, s) / "model.safetensors").read_bytes() for s in steps(run)}
    before = rundir.read_status(run)
    assert train(None, run, resume=True, quiet=True) == first
    after = rundir.read_status(run)
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert {s: (rundir.checkpoint_dir(run, s) / "model.safetensors").read_bytes() for s in steps(run)} == weights
    for key in ("status", "step", "reason", "stopped_early", "best_step", "best", "tokens"):
        assert after[key] == before[key], key
    # more steps do not undo a plateau; a larger patience continues it
    assert train(None, run, resume=True, quiet=True, sets=["train.steps=60"])["step"] == 12
    result = train(None, run, resume=True, quiet=True, sets=["train.patience=4"])
    assert result == {"status": "completed", "step": 15, "stopped_early": True, "best_step": 3}


@pytest.mark.parametrize("leg", [7, 9])
def test_resume_before_the_stop_equals_one_run(tmp_path, leg, trained_run):
    """The counter of evaluations without improvement is part of the checkpoint: a run stopped at step 7
    (off the evaluation grid, after one evaluation without improvement) or 9 (on it, after two) and resumed
    stops where the uninterrupted run stopped, with the same losses. Without the counter it would stop
    later. The first leg's own last evaluation (at 7) does not count for early stopping."""
    full, split = trained_run(WORSENING), tmp_path / "split"
    train(cfg(WORSENING, steps=leg), split, quiet=True)
    assert rundir.read_status(split)["stopped_early"] is False
    result = train(None, split, resume=True, quiet=True, sets=["train.steps=40"])
    assert result == {"status": "completed", "step": 12, "stopped_early": True, "best_step": 3}
    assert records(split, "train") == records(full, "train")
    assert [e for e in records(split, "eval") if e[0] % 3 == 0] == records(full, "eval")
    a, b = rundir.read_status(full), rundir.read_status(split)
    assert (a["reason"], a["best"]) == (b["reason"], b["best"])
    for s in (3, 12):
        assert (rundir.checkpoint_dir(full, s) / "model.safetensors").read_bytes() == (
            rundir.checkpoint_dir(split, s) / "model.safetensors"
        ).read_bytes()


def test_mode_inferred_from_the_metric():
    tc = load_config(cfg(patience=1)).train
    assert early_stop_mode(tc) == "min"
    for name in ("accuracy", "exact_match", "bleu", "chrf", "bleu_low", "chrf_high", "token_accuracy", "top1_accuracy"):
        assert early_stop_mode(tc.model_copy(update={"early_stop_metric": name})) == "max"
    assert early_stop_mode(tc.model_copy(update={"early_stop_metric": "loss_high"})) == "min"
    assert early_stop_mode(tc.model_copy(update={"early_stop_metric": "accuracy", "early_stop_mode": "min"})) == "min"


@pytest.mark.parametrize(
    "sets, needles",
    [
        (["train.patience=-1"], ["train.patience=-1", "greater than or equal to 0"]),
        (["train.min_delta=-0.1"], ["train.min_delta=-0.1"]),
        (["train.early_stop_mode=lower"], ["train.early_stop_mode='lower'", "'min' or 'max'"]),
        (["train.patience=2", "train.eval_every=0"], ["train.patience=2", "train.eval_every=0"]),
        (
            ["train.patience=2", "train.early_stop_metric=accuracy"],
            ["train.early_stop_metric='accuracy'", "not an evaluation metric of causal_lm", "bits_per_token, loss"],
        ),
    ],
)
def test_bad_values_are_one_line_and_leave_no_directory(tmp_path, capsys, sets, needles):
    config = tmp_path / "cfg.yaml"
    config.write_text(dump_yaml(load_config(LM)))
    out = tmp_path / "run"
    rc = main(["train", str(config), "--out", str(out), "--quiet", *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc != 0 and len(lines) == 1 and lines[0].startswith("kilolayer: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not out.exists()


def test_collect_reports_the_evaluation_of_the_checkpoint_that_stands_for_the_run(tmp_path):
    """One rule for weights and metrics: the evaluation a study reports for a run is the one at the step of
    the checkpoint analyses and train.init_from load (``chosen_checkpoint``), with early stopping the best,
    whether the run stopped early (40 steps: stops at 12) or ended at its step budget (10 steps: evaluations
    at 3, 6, 9 and 10, best 3): not its last evaluation (step 10) while its step-3 weights are analysed."""
    from kilolayer.study.runner import collect
    from kilolayer.study.spec import Point

    for steps, stopped_early, last in ((40, True, 12), (10, False, 10)):
        point = Point("early", f"steps={steps}", {}, load_config(cfg(WORSENING, steps=steps)))
        out = tmp_path / "study"
        run = point.run_dir(out)
        train(point.config, run, quiet=True)
        st = rundir.read_status(run)
        assert (st["stopped_early"], st["best_step"], st["step"]) == (stopped_early, 3, last)
        chosen = rundir.chosen_checkpoint(run, patience=3)
        result = collect(point, out)
        assert result.eval["step"] == rundir.checkpoint_step(chosen) == 3
        assert result.eval == next(e for e in result.evals if e["step"] == 3)
        assert result.evals[-1]["step"] == last and result.eval["loss"] > result.evals[-1]["loss"]
        assert result.eval["loss"] == st["best"]  # the best value early stopping found is the one reported


def test_collect_without_early_stopping_reports_the_last_evaluation(tmp_path):
    from kilolayer.study.runner import collect
    from kilolayer.study.spec import Point

    point = Point("plain", "p", {}, load_config(cfg(steps=7)))
    out = tmp_path / "study"
    train(point.config, point.run_dir(out), quiet=True)
    result = collect(point, out)
    assert [e["step"] for e in result.evals] == [3, 6, 7] and result.eval == result.evals[-1]
    assert rundir.checkpoint_step(rundir.chosen_checkpoint(point.run_dir(out))) == 7


def test_resume_with_another_metric_starts_early_stopping_over(tmp_path, capsys):
    """Leg 1 tracks ``loss`` for 6 steps (best at 6); leg 2 resumes on ``bits_per_token`` (loss / ln 2, so
    every value of it is above the best loss). Kept, loss's best would never be beaten: the run stopped at
    step 12 reporting loss's best at step 6. Reset (one warning line), the run goes exactly as one that
    tracked ``bits_per_token`` from the start (early stopping does not change training), as long as that one
    improved at step 9."""
    full, split = tmp_path / "full", tmp_path / "split"
    expected = train(cfg(patience=2, early_stop_metric="bits_per_token"), full, quiet=True)
    assert expected["best_step"] >= 9  # the comparison below needs an improvement after the reset
    train(cfg(steps=6, patience=2), split, quiet=True)
    assert rundir.read_status(split)["best_step"] == 6
    capsys.readouterr()
    sets = ["train.early_stop_metric=bits_per_token", "train.steps=40"]
    result = train(None, split, resume=True, quiet=True, sets=sets)
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "early_stop" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("kilolayer: warning: ")
    for needle in ("train.early_stop_metric='bits_per_token' (mode min)", "tracked 'loss' (mode min)", "step 6"):
        assert needle in warnings[0], (needle, warnings[0])
    assert "starts over" in warnings[0]
    assert result == expected
    a, b = rundir.read_status(full), rundir.read_status(split)
    assert (b["best"], b["reason"], b["early_stop_metric"]) == (a["best"], a["reason"], "bits_per_token")
    state = rundir.read_json(rundir.latest_checkpoint(split) / "state.json")["trainer"]
    assert (state["early_stop_metric"], state["early_stop_mode"], state["min_delta"]) == ("bits_per_token", "min", 0)


def test_resume_with_another_min_delta_keeps_the_best(tmp_path, capsys):
    """A changed min_delta applies from the resume on, and early stopping's best and count carry over: WORSENING
    split at step 9 (two evaluations without improvement) stops at 12 with its best at 3, as in one run."""
    full, split = tmp_path / "full", tmp_path / "split"
    expected = train(WORSENING, full, quiet=True)
    train(cfg(WORSENING, steps=9), split, quiet=True)
    capsys.readouterr()
    result = train(None, split, resume=True, quiet=True, sets=["train.steps=40", "train.min_delta=0.5"])
    assert "early_stop" not in capsys.readouterr().err
    assert result == expected == {"status": "completed", "step": 12, "stopped_early": True, "best_step": 3}
    assert rundir.read_status(split)["best"] == rundir.read_status(full)["best"]
    state = rundir.read_json(rundir.checkpoint_dir(split, 12) / "state.json")["trainer"]
    assert (state["early_stop_metric"], state["early_stop_mode"], state["min_delta"]) == ("loss", "max", 0.5)
