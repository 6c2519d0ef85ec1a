"""``kilolayer search``: parameter-matched shapes, the doctor's pre-screen, Optuna's successive halving over
trials that are ordinary run directories, and a search that continues where it was interrupted."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("optuna")

from kilolayer import build_model, rundir
from kilolayer.cli import main
from kilolayer.config import load_config
from kilolayer.errors import ConfigError
from kilolayer.study import search as S
from kilolayer.study.search_report import write_report
from kilolayer.train import run as run_module
from kilolayer.train.signals import Interrupted

# MAE on the bundled digits, shrunk: a trial trains 12 steps in about half a second
TINY = [
    "model.layers=2",
    "model.width=32",
    "model.heads=2",
    "model.ffn=128",
    "train.steps=12",
    "train.eval_every=3",
    "train.eval_batches=2",
    "train.batch_size=16",
    "train.warmup=2",
    "train.checkpoint_every=3",
    "train.log_every=3",
]
PARAMS = 28_000


def tiny(*sets):
    return load_config("configs/digits_mae.yaml", [*TINY, *sets])


def trains(config):
    return "trains", "stub forecast"


def settings(**kw):
    return S.Settings(**{"params": PARAMS, "depths": (1, 8), "tolerance": 0.1, **kw})


def test_shapes_have_the_parameters_of_the_models_built_from_them():
    config = load_config("configs/digits_mae.yaml")
    found = S.shapes(config, 200_000, depths=(1, 16), tolerance=0.03)
    assert [s.name for s in found] == ["1x128", "4x64", "7x48", "16x32"]
    for s in found:
        built = sum(p.numel() for p in build_model(s.model).parameters())
        assert built == s.parameters
        assert abs(built - 200_000) <= 0.03 * 200_000
        assert s.model.width == 16 * s.model.heads  # the config's head size (64 / 4) held
        assert s.model.ffn == 4 * s.model.width  # and its FFN ratio
    assert found[1].parameters == 201_536  # the shipped 4 x 64 itself
    assert found[0].flops_per_token < found[-1].flops_per_token  # deeper-narrower costs more per token here


def test_depths_parse_and_refuse_in_one_line():
    assert S.parse_depths("2..24") == (2, 24)
    for bad in ("24..2", "0..3", "3", "a..b"):
        with pytest.raises(ConfigError, match=r"--depths .*expected A\.\.B"):
            S.parse_depths(bad)


def test_the_scheduler_prunes_a_trial_whose_metric_is_clearly_worse(tmp_path):
    import optuna

    config = tiny("train.steps=90", "train.eval_every=10")
    s = settings()
    config = S.check_settings(config, s)
    rung = S.first_rung(config, s)
    assert rung == 10  # 90 / 3^2
    study = S._open_study(optuna, tmp_path, config, s, rung, "minimize")
    racer = S._Racer(optuna, study, config, s, {}, tmp_path, print)
    stopped = {}
    streams = {"good": [1.0, 0.8, 0.6, 0.5, 0.45], "worse": [1.0, 0.85, 0.7, 0.6, 0.55], "bad": [3.0, 2.9, 2.8]}
    for name, stream in streams.items():
        trial = study.ask()
        for i, value in enumerate(stream):
            step = 10 * (i + 1)
            trial.report(value, step)
            if trial.should_prune():
                stopped[name] = (step, racer.prune_reason(trial, step, value))
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                break
        else:
            study.tell(trial, stream[-1])
    assert "good" not in stopped
    # 0.6 at step 30 against the good trial's 0.6 goes on at rung 0 (its 1.0 at step 10 ties); rung 1 needs the best
    assert stopped["worse"][0] == 30
    assert stopped["bad"][0] == 10
    assert "rung 0 (step >= 10): loss 3 at step 10" in stopped["bad"][1]
    assert "cut-off 1" in stopped["bad"][1]


def test_a_search_races_shapes_in_run_directories_and_recommends_one(tmp_path, monkeypatch):
    out = tmp_path / "s"
    search = S.run_search(tiny("train.eval_batches=4"), out, settings(), forecaster=trains, log=lambda _: None)
    assert [s.name for s in search.shapes] == ["1x48", "2x32", "8x16"]
    states = {t.shape.name: (t.state, t.step) for t in search.trials}
    # the deep-narrow 8x16 is behind both at the first rung (step 3) and stops there
    assert states == {"1x48": ("completed", 12), "2x32": ("completed", 12), "8x16": ("pruned", 3)}
    for t in search.trials:
        st = rundir.read_status(t.run)
        if t.state == "completed":
            last = [r for r in rundir.read_metrics(t.run) if r["split"] == "eval"][-1]
            assert st["status"] == "completed" and t.value == pytest.approx(last["loss"])
        else:  # stopped at a rung with a checkpoint: an ordinary resumable run
            assert st["status"] == "interrupted" and "successive halving, rung 0" in st["reason"]
            assert rundir.latest_checkpoint(t.run).name == "step_00000003"
    c = search.comparison
    assert [t.shape.name for t in search.ranked[:2]] == ["2x32", "1x48"]
    assert not c.tied and c.difference < -c.bound < 0  # 2x32's loss is lower on the same evaluation batches
    assert load_config(search.best).model == search.ranked[0].shape.model
    md, html = write_report(search)
    text = md.read_text()
    assert "**Recommended: 2x32**" in text and "## Pre-screen" in text and "| optimizer steps | 27 | 36 | 75% |" in text
    assert (out / "report_files" / "curves.png").is_file() and "data:image/png;base64" in html.read_text()

    # two finalists whose per-batch losses overlap: the report says so and picks neither
    batches = {"000-1x48": [0.50, 0.52, 0.47], "001-2x32": [0.51, 0.50, 0.49]}
    monkeypatch.setattr(S, "per_batch_metric", lambda run, metric: batches[run.name])
    search.comparison = S.compare_top(search.ranked, "loss")
    S._write_choice(search)
    assert search.comparison.tied and search.comparison.difference == pytest.approx(0.01 / 3)
    assert (
        not (out / "best.yaml").exists() and (out / "tied-2x32.yaml").is_file() and (out / "tied-1x48.yaml").is_file()
    )
    assert "**Within noise: no pick.**" in write_report(search)[0].read_text()


def test_a_pre_screened_diverging_shape_never_trains(tmp_path):
    out = tmp_path / "s"
    names = [s.name for s in S.shapes(tiny(), PARAMS, (1, 8), 0.1)]
    doomed = names[-1]

    def forecaster(config):
        if S.shape_name(config.model) == doomed:
            return "diverges", "the replay diverged: non-finite loss (nan) at step 3"
        return "trains", "stub forecast"

    search = S.run_search(tiny(), out, settings(), forecaster=forecaster, log=lambda _: None)
    screen = {sc.shape: sc for sc in search.screens}
    assert not screen[doomed].kept and screen[doomed].verdict == "diverges"
    assert all(screen[n].kept for n in names[:-1])
    assert doomed not in {t.shape.name for t in search.trials}
    assert not any(doomed in p.name for p in (out / "trials").iterdir())
    text = write_report(search)[0].read_text()
    assert f"| {doomed} |" in text and "**dropped** | the replay diverged: non-finite loss (nan) at step 3" in text


def test_the_doctor_drops_every_shape_of_a_config_that_diverges(tmp_path):
    # lr 30 with Post-LN: the doctor's replay meets the divergence rule within its first steps
    config = tiny("train.lr=30", "model.scheme=post_ln")
    search = S.run_search(config, tmp_path / "s", settings(forecast_steps=6, depths=(1, 2)), log=lambda _: None)
    assert search.screens and all(sc.verdict in S.DROPPED and not sc.kept for sc in search.screens)
    assert search.trials == [] and not (tmp_path / "s" / "trials").exists()
    assert "none was trained" in search.notes[0]


def test_an_interrupted_search_continues_without_training_a_finished_trial_again(tmp_path, monkeypatch):
    out = tmp_path / "s"
    real_train = run_module.train
    calls = []

    def interrupted_in_the_second_trial(config, run, **kw):
        calls.append(run.name)
        if len(calls) == 2:
            hook = kw["on_eval"]

            def on_eval(step, metrics):
                if step == 9:  # Ctrl-C in the second trial: it stops after step 9 with a checkpoint
                    os.kill(os.getpid(), signal.SIGINT)
                return hook(step, metrics)

            kw = {**kw, "on_eval": on_eval}
        return real_train(config, run, **kw)

    monkeypatch.setattr(run_module, "train", interrupted_in_the_second_trial)
    s = settings(min_steps=11)  # the first rung at the last step: no trial is pruned
    with pytest.raises(Interrupted, match="interrupted by SIGINT at step 9"):
        S.run_search(tiny(), out, s, forecaster=trains, log=lambda _: None)
    first, second = (out / "trials" / name for name in calls)
    assert rundir.read_status(first)["status"] == "completed"
    assert rundir.read_status(second)["status"] == "interrupted"
    finished = (first / rundir.STATUS).stat().st_mtime_ns

    trained = []

    def recording(config, run, **kw):
        trained.append(run.name)
        return real_train(config, run, **kw)

    monkeypatch.setattr(run_module, "train", recording)
    search = S.run_search(tiny(), out, s, forecaster=trains, log=lambda _: None)
    assert first.name not in trained  # finished: read back, never trained again
    assert trained[0] == second.name  # the interrupted trial continues first, in its own run directory
    assert (first / rundir.STATUS).stat().st_mtime_ns == finished
    assert rundir.read_resume_history(second)[-1]["step"] == 9  # from the checkpoint it saved when stopped
    assert sorted(t.state for t in search.trials) == ["completed"] * len(search.shapes)
    assert len({t.number for t in search.trials}) == len(search.shapes)


def test_a_crashing_trial_is_recorded_failed_and_the_search_goes_on(tmp_path, monkeypatch):
    real_train = run_module.train

    def crash_first(config, run, **kw):
        if run.name.startswith("000-"):
            raise RuntimeError("out of memory (simulated)")
        return real_train(config, run, **kw)

    monkeypatch.setattr(run_module, "train", crash_first)
    search = S.run_search(tiny(), tmp_path / "s", settings(min_steps=11), forecaster=trains, log=print)
    states = {t.number: (t.state, t.reason) for t in search.trials}
    assert states[0] == ("failed", "RuntimeError: out of memory (simulated)")
    assert all(state == "completed" for n, (state, _) in states.items() if n)
    assert search.ranked[-1].number == 0


def test_a_step_budget_stops_the_search_and_a_larger_one_continues_it(tmp_path):
    out = tmp_path / "s"
    s = settings(min_steps=11, budget_steps=15)
    search = S.run_search(tiny(), out, s, forecaster=trains, log=lambda _: None)
    assert search.stopped_by_budget == "the search's budget of 15 steps is spent"
    assert [t.state for t in sorted(search.trials, key=lambda t: t.number)] == ["completed", "unfinished"]
    assert sum(t.step for t in search.trials) == 15
    s.budget_steps = None
    search = S.run_search(tiny(), out, s, forecaster=trains, log=lambda _: None)
    assert all(t.state == "completed" and t.step == 12 for t in search.trials)


def test_two_searches_cannot_write_one_directory(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    with rundir.RunLock(out, S.LOCK, "kilolayer search"):
        with pytest.raises(rundir.RunLocked, match="another kilolayer search"):
            S.run_search(tiny(), out, settings(), forecaster=trains, log=lambda _: None)


def test_a_search_with_other_settings_is_refused_in_its_directory(tmp_path):
    out = tmp_path / "s"
    S.run_search(tiny(), out, settings(budget_steps=1), forecaster=trains, log=lambda _: None)
    with pytest.raises(ConfigError, match=r"other settings \(tolerance differ\)"):
        S.run_search(tiny(), out, S.Settings(params=PARAMS, depths=(1, 8), tolerance=0.2), forecaster=trains)


def test_the_learning_rate_is_searched_log_uniformly_around_the_configs(tmp_path):
    s = settings(lr_factor=4.0, trials=4, depths=(1, 2))
    search = S.run_search(tiny("train.steps=3", "train.eval_every=3"), tmp_path / "s", s, forecaster=trains)
    lrs = [t.lr for t in sorted(search.trials, key=lambda t: t.number)]
    n = len(search.shapes)
    assert len(lrs) == 4 and lrs[:n] == [1e-3] * n  # each shape first at the config's lr
    assert all(2.5e-4 <= lr <= 4e-3 for lr in lrs) and len(set(lrs[n:])) == 4 - n


def test_search_errors_are_one_line(tmp_path, capsys):
    base = ["search", "configs/digits_mae.yaml", "--out", str(tmp_path / "s")]
    assert main([*base, "--params", "26k", "--depths", "9..3"]) == 2
    assert "kilolayer: error: --depths '9..3': expected A..B" in capsys.readouterr().err
    assert main([*base, "--params", "26k", "--trials", "3"]) == 2
    assert "kilolayer: error: --trials: only with --search-lr" in capsys.readouterr().err
    assert main([*base, "--params", "lots"]) == 2
    assert "kilolayer: error: --params 'lots': expected a count" in capsys.readouterr().err
    assert main([*base, "--params", "10", "--depths", "1..4", "--set", "model.width=32", "--set", "model.heads=2"]) == 2
    assert "kilolayer: error: --params 10: no shape of head size 16 at depths 1..4" in capsys.readouterr().err
    assert main([*base, "--params", "26k", "--address", "127.0.0.1:6379", "--cpus-per-run", "2"]) == 2
    assert "kilolayer: error: --address, --cpus-per-run: only with --executor ray" in capsys.readouterr().err
    assert main([*base, "--params", "26k", "--executor", "ray", "--cpus-per-run", "0.5"]) == 2
    assert "kilolayer: error: --cpus-per-run=0.5: expected a number >= 1" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # nothing written for a refused search


@pytest.mark.integration
def test_a_killed_search_continues_where_it_stopped(tmp_path):
    import subprocess
    import sys
    import time

    from helpers import ROOT

    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "kilolayer", "search", "configs/digits_mae.yaml", "--params", "28k", "--depths"]
    cmd += ["1..8", "--tolerance", "0.1", "--min-steps", "59", "--out", str(out), "--forecast-steps", "3"]
    cmd += ["--keep-forecast-failures", *[f"--set={s}" for s in [*TINY, "train.steps=60"]]]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        runs = sorted((out / "trials").glob("001-*")) if (out / "trials").is_dir() else []
        if runs and rundir.latest_checkpoint(runs[0]) is not None:
            second = runs[0]
            break
        time.sleep(0.05)
    proc.kill()  # kill -9 in the second trial: no status written, the Optuna trial left running
    proc.wait()
    assert second is not None
    first = next((out / "trials").glob("000-*"))
    assert rundir.read_status(first)["status"] == "completed"
    finished = (first / rundir.STATUS).stat().st_mtime_ns
    config = load_config("configs/digits_mae.yaml", [*TINY, "train.steps=60"])
    s = S.Settings(PARAMS, (1, 8), 0.1, min_steps=59, forecast_steps=3, keep_forecast_failures=True)
    search = S.run_search(config, out, s, log=lambda _: None)
    assert (first / rundir.STATUS).stat().st_mtime_ns == finished  # never trained again
    assert rundir.read_resume_history(second)[-1]["step"] >= 3  # continued from its checkpoint
    assert sorted(t.state for t in search.trials) == ["completed"] * len(search.trials)
    assert len(search.trials) == 3


def test_a_rung_is_judged_in_trial_order_not_in_the_order_values_arrive(tmp_path, monkeypatch):
    import optuna

    from kilolayer.train import signals

    s = settings()
    config = S.check_settings(tiny("train.steps=90", "train.eval_every=10"), s)
    study = S._open_study(optuna, tmp_path, config, s, 10, "minimize")
    racer = S._Racer(optuna, study, config, s, {}, tmp_path, print)
    first, second = study.ask(), study.ask()  # two trials running at once
    assert racer.wait_for_earlier(first, 10) == ""  # nothing before it: never waits
    assert racer.wait_for_earlier(second, 9) == ""  # not at a rung yet
    monkeypatch.setattr(signals, "stop_requested", lambda: True)
    assert racer.wait_for_earlier(second, 10) == "stopped by a signal while waiting at a rung for earlier trials"
    # the later trial reports its rung first (as a faster trial on another worker would)
    second.report(0.5, 10)
    assert not second.should_prune()
    # the earlier trial competes only with itself at rung 0, as if it had run alone before the other: promoted,
    # where Optuna's own pruner (every trial that has reached the rung by now) would stop it (0.9 > 0.5)
    first.report(0.9, 10)
    assert not first.should_prune()
    assert "best 1 of the 1 trials" in racer.prune_reason(first, 10, 0.9)
    plain = optuna.pruners.SuccessiveHalvingPruner(min_resource=10, reduction_factor=3, min_early_stopping_rate=0)
    third = study.ask()
    third.report(0.9, 10)
    assert plain.prune(study, study._storage.get_trial(third._trial_id))  # 0.9 against 0.5 and 0.9: stopped
