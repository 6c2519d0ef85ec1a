"""The training engine: one step for every tool, the run's thread count, and the policies that end a run."""

from __future__ import annotations

import ast
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from objective_helpers import SMALL_PACKAGES, TINY_TEXT, WHOLE_TASKS, masked_task, ragged_task, tiny_lm

import kilolayer
from kilolayer import rundir
from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.data.base import with_sample_index
from kilolayer.doctor.measure import replay
from kilolayer.objectives import build_task
from kilolayer.objectives import mae as mae_module
from kilolayer.objectives import mlm as mlm_module
from kilolayer.train import engine as engine_module
from kilolayer.train.policies import DivergenceRule, EarlyStopping
from kilolayer.train.run import train

PACKAGE = Path(kilolayer.__file__).parent

MLM = {
    "model": {**TINY_TEXT, "layers": 2},
    "objective": {"name": "mlm"},
    "data": {"name": "stdlib_packages", "options": SMALL_PACKAGES},
}


def _train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in rundir.read_metrics(run) if r["split"] == "train"]


@pytest.mark.parametrize(
    "raw",
    [
        tiny_lm(steps=5, batch_size=4, lr=3e-3, log_every=1),
        tiny_lm(steps=5, batch_size=4, lr=3e-3, log_every=1, diagnostics_every=2, accumulate=2),
        {**MLM, "train": {"steps": 4, "batch_size": 8, "lr": 3e-3, "log_every": 1}},  # masks drawn each step
    ],
    ids=["lm", "lm-diagnostics-accumulate", "mlm"],
)
def test_the_doctors_replay_and_a_real_run_give_identical_losses(tmp_path, raw):
    config = load_config(raw)
    train(config, tmp_path / "run", quiet=True)
    replayed = replay(config, config.train.steps)
    assert replayed.losses() == _train_losses(tmp_path / "run")  # bit for bit: the same engine, the same step


def test_the_step_is_written_once_in_the_package():
    """Gradients are computed and applied in the engine only: every tool that trains drives it."""
    found = {"backward": set(), "optimizer.step": set()}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = path.relative_to(PACKAGE.parent).as_posix()
                if node.func.attr == "backward":
                    found["backward"].add(name)
                if node.func.attr == "step" and "optim" in ast.unparse(node.func.value):
                    found["optimizer.step"].add(name)
    assert found == {"backward": {"kilolayer/train/engine.py"}, "optimizer.step": {"kilolayer/train/engine.py"}}


def _halves(objective, batch: dict) -> tuple[dict, list[dict]]:
    """``batch`` prepared, and its two halves prepared with the same random draws."""
    halves = engine_module.split_batch(batch, 2)
    if objective.name == "mlm":
        generator = torch.Generator().manual_seed(0)
        inputs, targets = objective.corrupt(batch["tokens"], batch["padding_mask"], generator)
        drawn = [(i, *mlm_module.selected(t)) for i, t in zip(inputs.chunk(2), targets.chunk(2))]
        whole = {**batch, mlm_module.DRAWN: (inputs, *mlm_module.selected(targets))}
        return whole, [{**half, mlm_module.DRAWN: d} for half, d in zip(halves, drawn)]
    whole = objective.prepare(batch)
    if objective.name == "mae":  # one masking per sample
        masking = [t.chunk(2) for t in whole[mae_module.DRAWN]]
        return whole, [{**half, mae_module.DRAWN: tuple(t[i] for t in masking)} for i, half in enumerate(halves)]
    return whole, halves


RAGGED_SEED = 3  # a seed whose first batch's halves and quarters all hold different numbers of targets


@pytest.mark.parametrize("name", ["causal_lm", "seq2seq", "classification", "mlm", "mae"])
def test_a_batchs_loss_is_the_mean_of_its_halves_weighted_by_loss_weight(tmp_path, name):
    """``loss_weight`` is the count each objective's loss is a mean over (predicted non-padding positions, target
    tokens under label smoothing, samples, selected tokens, hidden patches), so that weighted by it the halves of
    a ragged batch average to the whole batch's loss: what the training step's normalisation rests on. (The
    contrastive loss is no mean over parts: a batch's pairs are each other's negatives.)"""
    raw = WHOLE_TASKS["mae"] if name == "mae" else ragged_task(name, tmp_path)
    config = load_config({**raw, "train": {"seed": RAGGED_SEED}})
    source = load_source(config)
    torch.manual_seed(0)
    task = build_task(config, source).eval()
    whole, halves = _halves(task.objective, source.train_batch(0, 8))
    with torch.no_grad():
        loss = float(task(whole)[0])
        parts = [(float(task(half)[0]), task.objective.loss_weight(half)) for half in halves]
    assert sum(w for _, w in parts) == task.objective.loss_weight(whole)
    assert sum(part * w for part, w in parts) / sum(w for _, w in parts) == pytest.approx(loss, rel=1e-6)
    assert name in ("classification", "mae") or parts[0][1] != parts[1][1]  # the halves weigh differently


@pytest.mark.parametrize("accumulate", [2, 4])
@pytest.mark.parametrize("name", ["seq2seq", "mlm", "mlm_masks", "mae_masks"])
def test_accumulated_micro_batches_give_the_whole_batchs_step(tmp_path, name, accumulate):
    """The micro-batches of a ragged batch hold different numbers of targets, yet accumulating them gives the
    step of the whole batch in one: its loss, the mean over all its targets, and that mean's gradient, to
    float rounding (each micro-batch weighted by its targets, not by 1/accumulate). Random masks (``*_masks``:
    BERT's masking, MAE's) are keyed by each sample's index in the run's sample stream, so a micro-batch's
    samples are masked as in the whole batch."""
    raw = masked_task(name.removesuffix("_masks"), tmp_path) if name.endswith("_masks") else ragged_task(name, tmp_path)

    def step(parts: int):
        train = {"batch_size": 8, "accumulate": parts, "clip": 0, "seed": RAGGED_SEED}
        engine = engine_module.Engine(load_config({**raw, "train": train}))
        loss = engine.train_step(1).loss
        grads = [p.grad.flatten() for p in engine.task.parameters() if p.grad is not None]
        return engine, loss, torch.cat(grads)

    _, loss, grad = step(1)
    engine, accumulated, accumulated_grad = step(accumulate)
    batch = with_sample_index(engine.source.train_batch(0, 8), 0, 8)
    micro = engine_module.split_batch(batch, accumulate)
    weights = [engine.objective.loss_weight(engine.objective.prepare(mb)) for mb in micro]
    assert name == "mae_masks" or len(set(weights)) > 1  # MAE hides the same number of patches in every sample
    assert accumulated == pytest.approx(loss, rel=1e-6)
    assert float((accumulated_grad - grad).norm() / grad.norm()) < 1e-6


def test_a_run_records_its_thread_count_and_a_resume_reuses_it(tmp_path, monkeypatch):
    seen = []
    step = engine_module.Engine.train_step

    def counting(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "train_step", counting)
    run = tmp_path / "run"
    raw = tiny_lm(steps=4, batch_size=4, log_every=1, checkpoint_every=2)
    train(raw, run, quiet=True, sets=["train.threads=2"])
    assert seen == [2] * 4 and rundir.read_status(run)["threads"] == 2
    assert torch.get_num_threads() == 1  # the caller's count is given back (the suite runs at one)
    seen.clear()
    train(None, run, resume=True, quiet=True, sets=["train.steps=6"])  # no count given: the recorded one
    assert seen == [2, 2] and rundir.read_status(run)["threads"] == 2
    seen.clear()
    train(None, run, resume=True, quiet=True, sets=["train.steps=7", "train.threads=1"])  # given: that one
    assert seen == [1] and rundir.read_status(run)["threads"] == 1


def _tc(**kw):
    base = dict(diverge_factor=10.0, diverge_increase=1.0, warmup=2, patience=2, early_stop_metric="loss")
    base.update(min_delta=0.0, early_stop_mode="auto")
    return SimpleNamespace(**{**base, **kw})


def test_the_divergence_rule_smooths_the_loss_and_waits_for_warm_up():
    rule = DivergenceRule(_tc())
    assert rule(1, 1.0) == "" and rule.running_min == pytest.approx(1.0)
    # EMA 0.9, bias-corrected: after 1.0 then 30.0 the smoothed loss is (0.09 * 1 + 0.1 * 30) / 0.19
    assert rule(2, 30.0) == "" and rule.ungated == 2  # above 10 x 1.0 and 1.0 + 1, but inside warm-up
    reason = rule(3, 30.0)
    smooth = (0.081 * 1 + 0.09 * 30 + 0.1 * 30) / 0.271
    assert reason == f"smoothed loss {smooth:.4g} at step 3 exceeds 10 x its running minimum 1"
    assert DivergenceRule(_tc())(1, math.nan) == "non-finite loss (nan) at step 1"
    restored = DivergenceRule(_tc())
    restored.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert restored.state_dict() == rule.state_dict()


def test_early_stopping_counts_evaluations_without_improvement():
    stop = EarlyStopping(_tc(min_delta=0.1))
    assert stop.track(1, {"loss": 2.0}) and stop.best == 2.0
    assert not stop.track(2, {"loss": 1.95})  # better by less than min_delta
    assert not stop.plateaued
    assert not stop.track(3, {"loss": math.nan})  # a non-finite value never improves
    assert (
        stop.plateaued and stop.reason() == "plateau: no improvement of loss by 0.1 in 2 evaluations; best 2 at step 1"
    )
    higher = EarlyStopping(_tc(early_stop_metric="accuracy"))
    assert higher.mode == "max" and higher.track(1, {"accuracy": 0.5}) and higher.track(2, {"accuracy": 0.6})


def test_early_stopping_starts_over_under_another_metric():
    saved = EarlyStopping(_tc()).state_dict() | {"best": 1.5, "best_step": 4, "bad_evals": 1}
    same = EarlyStopping(_tc())
    assert same.resume(saved, 8) == "" and (same.best, same.best_step, same.bad_evals) == (1.5, 4, 1)
    other = EarlyStopping(_tc(early_stop_metric="accuracy"))
    line = other.resume(saved, 8)
    assert "tracked 'loss' (mode min) until step 8" in line and "best 1.5 at step 4, 1 evaluations" in line
    assert (other.best, other.bad_evals) == (None, 0)


FIXTURE = Path(__file__).parent / "fixtures" / "two_step_run"


def test_a_run_directory_written_by_the_earlier_trainer_resumes_where_it_left_off(tmp_path):
    """``fixtures/two_step_run`` was written by the trainer of release commit 5ee3c92 (one thread): a tiny LM
    trained for 2 of its 4 steps. Resumed here, it trains steps 3 and 4 as that trainer's uninterrupted run did
    (``uninterrupted.json``; to float rounding, since another CPU reduces in another order) and exactly as this
    engine's own uninterrupted run does."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run, ignore=shutil.ignore_patterns("uninterrupted.json"))
    result = train(None, run, resume=True, quiet=True, sets=["train.steps=4"])
    assert result == {"status": "completed", "step": 4}
    resumed = [r for r in rundir.read_metrics(run) if r["step"] > 2]
    then = [r for r in json.loads((FIXTURE / "uninterrupted.json").read_text()) if r["step"] > 2]
    assert [(r["step"], r["split"]) for r in resumed] == [(r["step"], r["split"]) for r in then]
    for now, old in zip(resumed, then):
        for key in ("loss", "grad_norm", "update", "ln_input"):
            if key in old:
                assert now[key] == pytest.approx(old[key], rel=1e-5, abs=1e-7), (now["step"], key)
    whole = tmp_path / "whole"
    train(load_config(run / "config.yaml").model_dump(), whole, quiet=True)
    assert _train_losses(run) == _train_losses(whole)


@pytest.mark.parametrize("name", ["causal_lm", "mlm", "mae"])
def test_the_engine_trains_as_recorded(tmp_path, name):
    """``fixtures/earlier_trainer_losses.json``: for two micro-batches a step (one thread), the LM's losses as the
    trainer of release commit 5ee3c92 logged them, with dropout, whose draws must come in the same order; MLM's
    and MAE's as this engine logged them when their random masks became keyed by each sample's index in the
    run's sample stream (that trainer drew them per micro-batch from the global RNG, so they followed the
    division into micro-batches). To float rounding: another CPU reduces in another order, but another draw
    order or other masks move the losses by far more."""
    case = json.loads((FIXTURE.parent / "earlier_trainer_losses.json").read_text())[name]
    train(case["config"], tmp_path / "run", quiet=True)
    assert _train_losses(tmp_path / "run") == pytest.approx(case["losses"], rel=1e-5)


@pytest.mark.parametrize("value", ["4", True, -2, 10**12])
def test_a_recorded_thread_count_that_is_not_one_is_said_and_passed_over(tmp_path, capsys, value):
    (tmp_path / "status.json").write_text(json.dumps({"status": "interrupted", "threads": value}))
    from kilolayer.train.run import recorded_threads

    assert recorded_threads(tmp_path) is None
    assert f"threads={value!r} is not a thread count" in capsys.readouterr().err


def test_an_adaptive_count_is_not_reused_on_resume(tmp_path):
    from kilolayer.train.run import recorded_threads

    (tmp_path / "status.json").write_text(json.dumps({"threads": 2, "threads_adaptive": True}))
    assert recorded_threads(tmp_path) is None
    (tmp_path / "status.json").write_text(json.dumps({"threads": 2, "threads_adaptive": False}))
    assert recorded_threads(tmp_path) == 2


@pytest.mark.parametrize("value", [0, 2000, True, "2"])
def test_train_threads_outside_its_range_is_one_line(value):
    from kilolayer.errors import ConfigError

    with pytest.raises(ConfigError, match="train.threads") as err:
        load_config(tiny_lm(threads=value))
    assert "\n" not in str(err.value)
