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
from kilolayer.study.search.report import write_report
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
    return S.Settings(**{"params": PARAMS, "depths": (1, 3), "tolerance": 0.1, **kw})


def test_shapes_have_the_parameters_of_the_models_built_from_them():
    config = load_config("configs/digits_mae.yaml")
    found = S.shapes(config, 200_000, depths=(1, 16), tolerance=0.03)
    assert [s.layers for s in found] == list(range(1, 17))  # every depth in the range
    for s in found:
        built = sum(p.numel() for p in build_model(s.model).parameters())
        assert built == s.parameters
        assert s.deviation == pytest.approx(built / 200_000 - 1) and abs(s.deviation) <= 0.03
        assert 8 <= s.head_size <= 32 and s.model.width == s.head_size * s.model.heads
    assert found[3].model == config.model and found[3].parameters == 201_536  # the shipped 4 x 64 itself
    # where the config's head size (16) and FFN ratio (4) come within 3%, they are kept
    kept = [s.name for s in found if s.head_size == 16 and s.model.ffn == 4 * s.model.width]
    assert kept == ["1x128", "4x64", "7x48", "16x32"]
    assert found[0].flops_per_token < found[-1].flops_per_token  # deeper-narrower costs more per token here


def test_every_depth_is_offered_at_the_shape_closest_to_the_budget_with_its_deviation():
    """A 6+6-layer encoder-decoder of head size 16 at 150k parameters: one shape per depth 2..12 (head size 16 alone
    gives one within 3%), each the closest the widths, heads and FFN sizes allow, its deviation in the report."""
    config = load_config("configs/reverse_deepnorm.yaml")
    found = S.shapes(config, 150_000, depths=(2, 12), tolerance=0.03)
    assert [(s.model.layers, s.model.decoder_layers) for s in found] == [(d, d) for d in range(2, 13)]
    for s in found:
        assert s.parameters == sum(p.numel() for p in build_model(s.model).parameters())
        assert abs(s.deviation) <= 0.03 and s.deviation == pytest.approx(s.parameters / 150_000 - 1)
    shipped = {s.name: s for s in found}["5+5x32"]  # the config's head size and FFN ratio, 151,040 parameters
    assert (shipped.head_size, shipped.model.ffn, shipped.parameters) == (16, 128, 151_040)
    # the closest: no other width, head size (8..32) or FFN (half to twice the ratio's) at depth 12 comes closer
    deepest = found[-1]
    assert deepest.name == "12+12x20" and deepest.parameters == 149_584
    m = config.model
    for q in range(8, 33, 2):
        for h in (1, 2):
            held = 4 * q * h
            for ffn in (held, held // 2, 2 * held):
                other = S.count_parameters(S._shaped(m, 12, h, q, ffn))
                assert abs(other - 150_000) >= abs(deepest.parameters - 150_000) or abs(other / 150_000 - 1) <= 0.03

    # depths whose narrowest shape is already over the budget are left out, and said so
    small = S.shapes(config, 12_000, depths=(1, 12), tolerance=0.03)
    assert [s.layers for s in small] == list(range(1, 8))  # at 8 layers even 1 head of 8, FFN 16 has 12,672
    assert S.count_parameters(S.narrowest(m, 8)) == 12_672 > 12_000 * 1.03


def test_depths_parse_and_refuse_in_one_line():
    assert S.parse_depths("2..24") == (2, 24)
    for bad in ("24..2", "0..3", "3", "a..b"):
        with pytest.raises(ConfigError, match=r"--depths .*expected A\.\.B"):
            S.parse_depths(bad)


def test_a_rung_keeps_the_best_third_whatever_the_order():
    entries = [(0.5, "2x32|0.001", 0), (0.9, "1x48|0.001", 1), (0.7, "8x16|0.001", 2), (float("nan"), "4x24|0", 3)]
    assert S.promote(entries, 3, maximize=False) == ([0], [2, 1, 3])  # 4 // 3 = 1 kept; nan last
    assert S.promote(entries[::-1], 3, maximize=False) == ([0], [2, 1, 3])
    assert S.promote(entries[:2], 3, maximize=False) == ([0], [1])  # of fewer than eta, the best
    assert S.promote(entries[:3], 3, maximize=True) == ([1], [2, 0])
    assert S.promote([(0.5, "b", 0), (0.5, "a", 1)], 2, maximize=False) == ([1], [0])  # a tie: by name, not number


def _fake_race(tmp_path, monkeypatch, order, streams):
    """A search over ``order`` (shape names) whose evaluations are the constructed ``streams[shape](step)``; no
    training: {shape: (state, last step reported)} and the decisions."""
    import optuna

    s = settings()
    config = S.check_settings(tiny("train.steps=90", "train.eval_every=10"), s)
    found = {sh.name: sh for sh in S.shapes(config, PARAMS, (1, 3), 0.1)}
    kept = {name: found[name] for name in order}
    progress = {}

    def fake_train(cfg, run, resume, quiet, on_eval, resume_hint):
        name = S.shape_name(cfg.model)
        step = progress.get(run, 0)
        while step < cfg.train.steps:
            step += cfg.train.eval_every
            progress[run] = step
            if step < cfg.train.steps:
                halt = on_eval(step, {"loss": streams[name](step)})
                if halt:
                    raise run_module.Halted(halt)

    monkeypatch.setattr(run_module, "train", fake_train)
    monkeypatch.setattr("kilolayer.study.search.racer._steps_of", lambda run: progress.get(run, 0))
    monkeypatch.setattr(
        "kilolayer.study.search.racer._final_value", lambda run, metric: streams[run.name.split("-", 1)[1]](90)
    )
    tmp_path.mkdir(parents=True)
    study = S._open_study(optuna, tmp_path, config, s, 10, "minimize")
    S._enqueue(study, list(kept), None)
    racer = S._Racer(optuna, study, config, s, kept, tmp_path, lambda _: None)
    assert racer.rungs == [10, 30]
    assert S.race_here(racer, len(kept)) == ""
    trials = {t.params["shape"]: (t.state.name, t.last_step) for t in study.get_trials()}
    return trials, racer.decisions()


def test_the_race_does_not_depend_on_the_order_of_the_shapes(tmp_path, monkeypatch):
    import itertools

    # the shallowest shape is behind at the first rung; in-order halving let the first trial through unopposed
    streams = {
        "1x48": lambda step: 2.0 - step / 100,
        "2x32": lambda step: 1.5 - step / 100,
        "3x28": lambda step: 1.6 - step / 200,
    }
    results = []
    for i, order in enumerate(itertools.permutations(streams)):
        trials, decisions = _fake_race(tmp_path / str(i), monkeypatch, order, streams)
        results.append(trials)
        assert [d["step"] for d in decisions] == [10, 30]
    assert all(r == results[0] for r in results)
    assert results[0] == {"2x32": ("COMPLETE", 80), "1x48": ("PRUNED", 10), "3x28": ("PRUNED", 10)}


def test_a_search_races_shapes_in_run_directories_and_recommends_one(tmp_path):
    out = tmp_path / "s"
    search = S.run_search(tiny("train.eval_batches=4"), out, settings(), forecaster=trains, log=lambda _: None)
    assert [s.name for s in search.shapes] == ["1x48", "2x32", "3x28"]
    assert search.rungs == [3, 9]
    states = {t.shape.name: (t.state, t.step) for t in search.trials}
    # synchronous successive halving: all three reach step 3, the best third (one) goes on
    assert sorted(states.values()) == [("completed", 12), ("pruned", 3), ("pruned", 3)]
    winner = next(n for n, (state, _) in states.items() if state == "completed")
    values = search.decisions[0]["values"]
    assert [str(n) for n in search.decisions[0]["kept"]] == [min(values, key=values.get)]
    assert min(search.trials, key=lambda t: t.curve[0][1]).shape.name == winner
    for t in search.trials:
        st = rundir.read_status(t.run)
        if t.state == "completed":
            last = [r for r in rundir.read_metrics(t.run) if r["split"] == "eval"][-1]
            assert st["status"] == "completed" and t.value == pytest.approx(last["loss"])
        else:  # stopped at a rung with a checkpoint: an ordinary resumable run
            assert st["status"] == "interrupted"
            assert "pruned by kilolayer search: successive halving, rung 0" in st["reason"]
            assert "judged once every trial in the race had reached it" in t.reason
            assert rundir.latest_checkpoint(t.run).name == "step_00000003"
    assert search.comparison is None and load_config(search.best).model == search.ranked[0].shape.model
    md, html = write_report(search)
    text = md.read_text()
    assert f"**Recommended: {winner}**" in text and "**Only one trial completed**" in text
    assert "## Pre-screen" in text and "| race (the trials' steps) | 18 |" in text and "| full grid | 36 |" in text
    assert "| **total** (race + the pre-screen's other steps) | 18 |" in text  # the stub forecast replays nothing
    assert (out / "report_files" / "curves.png").is_file() and "data:image/png;base64" in html.read_text()


def test_the_top_two_are_compared_on_the_same_batches(tmp_path, monkeypatch):
    out = tmp_path / "s"
    s = settings(min_steps=11)  # no rung before the end: every trial completes
    search = S.run_search(tiny("train.eval_batches=4"), out, s, forecaster=trains, log=lambda _: None)
    assert [t.state for t in search.trials] == ["completed"] * 3
    c = search.comparison
    assert not c.tied and c.agrees and c.difference < -c.bound < 0
    text = write_report(search)[0].read_text()
    assert "It beats the runner-up" in text and "evaluation-batch noise, one seed" in text
    a, b = (t.run.name for t in search.ranked[:2])

    # the re-evaluation ranks them the other way: the report must not say "beats"
    opposite = {a: [0.6, 0.61, 0.62], b: [0.5, 0.5, 0.5]}
    monkeypatch.setattr("kilolayer.study.search.compare.per_batch_metric", lambda run, metric: opposite[run.name])
    search.comparison = S.compare_top(search.ranked, "loss")
    assert not search.comparison.agrees and not search.comparison.tied
    text = write_report(search)[0].read_text()
    assert "beats" not in text and "**The re-evaluation disagrees with the ranking**" in text

    # two finalists whose per-batch losses overlap: the report says so and picks neither
    batches = {a: [0.50, 0.52, 0.47], b: [0.51, 0.50, 0.49]}
    monkeypatch.setattr("kilolayer.study.search.compare.per_batch_metric", lambda run, metric: batches[run.name])
    search.comparison = S.compare_top(search.ranked, "loss")
    S._write_choice(search)
    assert search.comparison.tied and search.comparison.difference == pytest.approx(-0.01 / 3)
    top, second = (t.shape.name for t in search.ranked[:2])
    assert not (out / "best.yaml").exists() and (out / f"tied-{top}.yaml").is_file()
    assert (out / f"tied-{second}.yaml").is_file()
    assert "**Within noise: no pick.**" in write_report(search)[0].read_text()


def test_only_the_files_the_search_wrote_are_replaced(tmp_path):
    out = tmp_path / "s"
    s = settings(min_steps=11, depths=(1, 2))
    S.run_search(tiny(), out, s, forecaster=trains, log=lambda _: None)
    name = next(iter(rundir.read_json(out / S.CHOICE, {})))  # best.yaml, or a tied-*.yaml
    (out / "tied-mine.yaml").write_text("mine\n")  # a user's file
    (out / name).write_text((out / name).read_text() + "# edited\n")
    search = S.run_search(tiny(), out, s, forecaster=trains, log=lambda _: None)
    assert (out / "tied-mine.yaml").read_text() == "mine\n"
    assert (out / f"{name}.edited").read_text().endswith("# edited\n")
    assert "# edited" not in (out / name).read_text()
    assert any(f"kept as {name}.edited" in n for n in search.notes)
    search = S.run_search(tiny(), out, s, forecaster=trains, log=lambda _: None)  # its own file: just replaced
    assert not search.notes and (out / name).is_file()


def test_a_pruned_trial_continued_by_hand_shows_its_own_final_evaluation(tmp_path):
    out = tmp_path / "s"
    search = S.run_search(tiny(), out, settings(), forecaster=trains, log=lambda _: None)
    pruned = next(t for t in search.trials if t.state == "pruned")
    run_module.train(load_config(pruned.run / rundir.CONFIG), pruned.run, resume=True, quiet=True)
    search = S.run_search(tiny(), out, settings(), forecaster=trains, log=lambda _: None)
    again = next(t for t in search.trials if t.number == pruned.number)
    last = [r for r in rundir.read_metrics(again.run) if r["split"] == "eval"][-1]
    assert again.continued and again.step == 12 and again.value == pytest.approx(last["loss"])
    assert "continued outside the search" in again.reason
    assert "pruned, continued outside the search" in write_report(search)[0].read_text()


def test_a_stall_is_dropped_only_behind_a_shape_forecast_clearly_better(tmp_path):
    found = S.shapes(tiny(), PARAMS, (1, 3), 0.1)

    def near_chance(config):
        score = {"1x48": 0.92, "2x32": 0.93, "3x28": 0.88}[S.shape_name(config.model)]
        return ("stalls" if score > 0.9 else "trains"), f"{score} x chance", {"score": score, "steps": 5}

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    screens = S.prescreen(tiny(), found, tmp_path / "a", forecaster=near_chance, log=lambda _: None)
    assert all(sc.kept for sc in screens) and screens[0].note.startswith("raced")
    assert screens[0].steps == 5

    def one_clearly_better(config):
        score = {"1x48": 0.92, "2x32": 0.95, "3x28": 0.5}[S.shape_name(config.model)]
        return ("stalls" if score > 0.9 else "trains"), f"{score} x chance", {"score": score, "steps": 5}

    screens = S.prescreen(tiny(), found, tmp_path / "b", forecaster=one_clearly_better, log=lambda _: None)
    assert [sc.kept for sc in screens] == [False, False, True]
    search = S.run_search(tiny(), tmp_path / "c", settings(), forecaster=one_clearly_better, log=lambda _: None)
    assert any("left only 3x28 of the 3 shapes" in n for n in search.notes)


def test_a_pre_screened_diverging_shape_never_trains(tmp_path):
    out = tmp_path / "s"
    names = [s.name for s in S.shapes(tiny(), PARAMS, (1, 3), 0.1)]
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


def test_the_trials_start_from_the_pre_screens_replays_and_count_them_once(tmp_path):
    # first rung at step 9: the doctor replays each shape's first 8 steps (capped below the rung) and its trial
    # continues from them, reaching every evaluation the race judges with the losses of a trial trained from
    # scratch, bit for bit (same process, same thread count)
    s = settings(min_steps=9, keep_forecast_failures=True)
    assert S.forecast_steps(tiny(), s) == 8 and S.starts_from_prescreen(tiny(), s)
    search = S.run_search(tiny(), tmp_path / "reused", s, log=lambda _: None)
    scratch = S.run_search(tiny(), tmp_path / "scratch", s, forecaster=trains, log=lambda _: None)
    assert len(search.trials) == 3
    assert all(sc.steps == 8 + 1 for sc in search.screens)  # and one step of the DeepNorm twin
    for t, u in zip(search.trials, scratch.trials):
        assert t.shape == u.shape and t.from_prescreen == 8 and u.from_prescreen == 0
        assert (t.state, t.step, t.value) == (u.state, u.step, u.value)
        assert t.curve == [p for p in u.curve if p[0] > 8]  # the replay's steps have no evaluations of the run
        assert rundir.read_resume_history(t.run)[0]["step"] == 8
    assert not (tmp_path / "reused" / S.STARTS).exists() or not any((tmp_path / "reused" / S.STARTS).iterdir())
    c = search.compute()
    race = sum(t.step for t in search.trials)
    assert c["race"]["steps"] == race == scratch.compute()["race"]["steps"]
    assert c["prescreen"]["steps"] == 3 * 9 and c["reused"]["steps"] == 3 * 8
    assert c["extra"]["steps"] == 3 and c["total"]["steps"] == race + 3  # the twins' steps: all it adds
    flops = {sh.name: sh.step_flops(16) for sh in search.shapes}
    assert c["total"]["flops"] == pytest.approx(sum((t.step + 1) * flops[t.shape.name] for t in search.trials))
    text = write_report(search)[0].read_text()
    assert f"| **total** (race + the pre-screen's other steps) | {race + 3} |" in text
    assert "| of which the trials' first steps (in the race) | 24 |" in text

    # the forecast is read back on a re-run, and the finished search trains nothing again
    again = S.run_search(tiny(), tmp_path / "reused", s, log=lambda _: None)
    assert [(t.state, t.step, t.from_prescreen) for t in again.trials] == [
        (t.state, t.step, t.from_prescreen) for t in search.trials
    ]


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
    with pytest.raises(Interrupted, match="interrupted by SIGINT at step 9") as stopped:
        S.run_search(tiny(), out, s, forecaster=trains, log=lambda _: None)
    assert "continue with: re-run the same kilolayer search command" in str(stopped.value)
    assert "kilolayer train --resume" not in str(stopped.value)
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


def test_a_crashing_trial_is_recorded_failed_and_the_search_goes_on(tmp_path, monkeypatch, capsys):
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
    from kilolayer.study.cli import failed_trials

    assert failed_trials(search) == (
        f"1 of {len(search.ranked)} trials failed; their run directories: {search.ranked[-1].run} (each one's "
        "reason is in the report); re-running the search goes on"
    )
    # the command exits non-zero, its last line the failed trials (the search itself stands in for re-running it)
    import kilolayer.study.search as search_module
    import kilolayer.study.search.report as report_module

    monkeypatch.setattr(search_module, "run_search", lambda *a, **kw: search)
    monkeypatch.setattr(report_module, "write_report", lambda got: (tmp_path / "r.md", tmp_path / "r.html"))
    capsys.readouterr()
    assert main(["search", "configs/digits_mae.yaml", "--out", str(tmp_path / "s"), "--params", "28k"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == failed_trials(search)


def test_a_step_budget_stops_the_search_and_a_larger_one_continues_it(tmp_path):
    out = tmp_path / "s"
    s = settings(min_steps=11, budget_steps=15)
    search = S.run_search(tiny(), out, s, forecaster=trains, log=lambda _: None)
    assert search.stopped_by_budget == "the search's budget of 15 steps is spent"
    # every planned trial exists from the start (the set the race halves): the third has not started
    assert [t.state for t in sorted(search.trials, key=lambda t: t.number)] == ["completed", "unfinished", "unfinished"]
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
        S.run_search(tiny(), out, S.Settings(params=PARAMS, depths=(1, 3), tolerance=0.2), forecaster=trains)


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
    assert main([*base, "--params", "1e400"]) == 2
    assert "kilolayer: error: --params '1e400': expected a count" in capsys.readouterr().err
    tiny_model = ["--set", "model.width=32", "--set", "model.heads=2"]
    assert main([*base, "--params", "10", "--depths", "1..100000", *tiny_model]) == 2  # returns: depths capped
    err = capsys.readouterr().err
    assert "kilolayer: error: --params 10: even the narrowest shape at depth 1 (1x8, " in err
    assert "exceeds it by more than 3%; raise --params or --tolerance" in err
    assert main([*base, "--params", "10", "--tolerance", "0.0001", *tiny_model]) == 2
    assert "by more than 0.01%" in capsys.readouterr().err
    assert main([*base, "--params", "28k", "--depths", "1..2", "--tolerance", "0.1", "--metric", "accuracy"]) == 2
    assert "kilolayer: error: --metric accuracy: not an evaluation metric of mae" in capsys.readouterr().err
    assert main([*base, "--params", "10", "--depths", "2..4", "--set", "model.width=32", "--set", "model.heads=2"]) == 2
    assert "kilolayer: error: --params 10: even the narrowest shape at depth 2 (2x8, " in capsys.readouterr().err
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
    cmd += ["1..3", "--tolerance", "0.1", "--min-steps", "59", "--out", str(out), "--forecast-steps", "3"]
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
    s = S.Settings(PARAMS, (1, 3), 0.1, min_steps=59, forecast_steps=3, keep_forecast_failures=True)
    search = S.run_search(config, out, s, log=lambda _: None)
    assert (first / rundir.STATUS).stat().st_mtime_ns == finished  # never trained again
    assert rundir.read_resume_history(second)[-1]["step"] >= 3  # continued from its checkpoint
    assert sorted(t.state for t in search.trials) == ["completed"] * len(search.trials)
    assert len(search.trials) == 3


def test_the_time_plan_prices_the_pre_screen_and_each_rungs_legs():
    """tiny(): 12 steps, an evaluation every 3, rungs at 3 and 9, the pre-screen replaying 2 steps (below the
    first rung) that the trials continue. Three shapes whose costs are given; the race's later legs are priced as
    the costliest shape (the one that would go on is not known before), and so is the comparison at rung 0's cut
    (rung 1 and the end have one trial left: nothing to compare)."""
    s = settings()
    config = S.check_settings(tiny(), s)
    assert (S.rung_steps(config, s), S.forecast_steps(config, s), S.starts_from_prescreen(config, s)) == (
        [3, 9],
        2,
        True,
    )
    costs = [S.Cost(1.0, 0.1, 0.5), S.Cost(2.0, 0.3, 0.7), S.Cost(1.5, 0.2, 0.6)]
    replay_evals = 20 * 4 / 3  # 20 evaluations of 64 samples, 4 batches of 16, a forward pass each
    prescreen = sum(2 * c.setup + c.step * (2 + 1 + replay_evals) for c in costs)
    first = sum(c.setup + c.step * 1 + c.evaluation * 1 for c in costs)  # steps 3 - 2, the evaluation at 3
    costliest = costs[1]
    later = costliest.setup + 6 * costliest.step + 2 * costliest.evaluation  # 3 -> 9, evaluations at 6 and 9
    later += costliest.setup + 3 * costliest.step + 1 * costliest.evaluation  # 9 -> 12
    cut = sum(c.setup + c.evaluation for c in costs[1:])  # rung 0 prunes: two runs, the costliest, compared
    assert S.estimate_seconds(config, s, costs) == pytest.approx(prescreen + first + later + cut)


def test_the_time_plan_makes_the_trials_as_long_as_the_minutes_allow():
    s = settings()
    config = S.check_settings(tiny(), s)
    costs = [S.Cost(0.5, 0.01, 0.05), S.Cost(0.5, 0.02, 0.05), S.Cost(0.5, 0.04, 0.1)]

    def estimate(steps):
        return S.estimate_seconds(S.with_steps(config, steps), s, costs)

    for seconds in (10.0, 20.0, 40.0):
        steps, spent = S.plan_steps(config, s, costs, seconds)
        assert spent == estimate(steps) <= seconds < estimate(steps + 1)  # the longest trials that fit
        assert spent >= 0.97 * seconds  # and so the time is used
    assert S.plan_steps(config, s, costs, 10.0)[0] < S.plan_steps(config, s, costs, 40.0)[0]
    longer = S.with_steps(config, 120)  # ten times the config's 12 steps: evaluations and checkpoints keep count
    assert (longer.train.eval_every, longer.train.checkpoint_every, longer.train.warmup) == (30, 30, 2)


def test_a_search_given_minutes_trains_trials_of_the_planned_length(tmp_path):
    out = tmp_path / "s"
    s = settings(minutes=0.5)  # priced above what these trials take, so the budget's own stop never cuts them
    costs = {"1x48": S.Cost(0.5, 0.1, 0.1), "2x32": S.Cost(0.5, 0.15, 0.1), "3x28": S.Cost(0.5, 0.2, 0.1)}
    measured = []

    def measure(config):
        measured.append(config.train.steps)
        return costs[S.shape_name(config.model)]

    search = S.run_search(tiny(), out, s, forecaster=trains, measure=measure, log=lambda _: None)
    plan = search.plan
    assert measured == [12, 12, 12, 12] and plan.config_steps == 12  # a warm-up, then each shape
    assert plan.seconds == 30.0 - plan.probe_seconds and (plan.steps, plan.estimate) == S.plan_steps(
        S.check_settings(tiny(), settings()), s, list(costs.values()), plan.seconds
    )
    assert plan.steps > 12 and 0.97 * plan.seconds <= plan.estimate <= plan.seconds and plan.minutes == 0.5
    assert plan.total <= 30.0
    assert search.config.train.steps == plan.steps
    for t in search.trials:
        assert load_config(t.run / rundir.CONFIG).train.steps == plan.steps
    assert max(t.step for t in search.trials) == plan.steps
    text = write_report(search)[0].read_text()
    assert f"the trials' length was then set to {plan.steps:,} steps (the config's 12)" in text

    # a re-run keeps the plan whatever minutes it is given, and trains nothing again
    s.minutes = 5
    again = S.run_search(tiny(), out, s, forecaster=trains, measure=measure, log=lambda _: None)
    assert again.plan == plan and measured == [12, 12, 12, 12]
    assert [(t.state, t.step) for t in again.trials] == [(t.state, t.step) for t in search.trials]


class FakeClock:
    """``time.perf_counter`` plus seconds the test says were spent: work that "takes" minutes, run at once."""

    def __init__(self, monkeypatch):
        self.offset = 0.0
        real = S.time.perf_counter
        monkeypatch.setattr(S.time, "perf_counter", lambda: real() + self.offset)

    def spend(self, seconds: float) -> None:
        self.offset += seconds


def test_a_plan_that_cannot_fit_is_refused_in_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    out = tmp_path / "s"
    forecasts = []

    def forecaster(config):
        forecasts.append(config)
        return trains(config)

    slow = S.Cost(2.0, 0.5, 3.0)  # the shortest plan (12 steps, three shapes) is estimated at about 2 minutes
    s = settings(minutes=0.5)
    with pytest.raises(ConfigError) as err:
        S.run_search(tiny(), out, s, forecaster=forecaster, measure=lambda c: slow, log=lambda _: None)
    line = str(err.value)
    assert "\n" not in line and line.startswith("--minutes 0.5: the shortest plan needs about 1.")
    assert "a race of all 3 shapes with trials of 12 steps); give more minutes or narrow --depths" in line
    assert not forecasts and not out.exists()  # nothing forecast, trained or written

    # one depth: nothing to narrow; the command line refuses it with exit 2
    monkeypatch.setattr("kilolayer.study.search.plan.measure_cost", lambda c: slow)
    base = ["search", "configs/digits_mae.yaml", "--out", str(out), "--params", "28k", "--tolerance", "0.1"]
    assert main([*base, "--depths", "2..2", "--minutes", "0.1", *[f"--set={x}" for x in TINY]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kilolayer: error: --minutes 0.1: the shortest plan needs about ") and "\n" not in err
    assert err.endswith("a race of all 1 shape with trials of 12 steps); give more minutes")
    assert not out.exists()


def test_the_minutes_count_the_measurement_and_the_pre_screen(tmp_path, monkeypatch):
    """Measuring "takes" 10 s a shape and each forecast 100 s (a fake clock): the plan has what is left after the
    measurement, and the forecasts spend the rest, so the race stops before any trial trains."""
    clock = FakeClock(monkeypatch)
    out = tmp_path / "s"

    def measure(config):
        clock.spend(10.0)
        return S.Cost(0.01, 0.001, 0.01)

    def forecaster(config):
        clock.spend(100.0)
        return trains(config)

    s = settings(minutes=2.0)
    search = S.run_search(tiny(), out, s, forecaster=forecaster, measure=measure, log=lambda _: None)
    plan = search.plan
    assert plan.probe_seconds >= 40.0  # a warm-up and three shapes, and finding them
    assert plan.seconds == pytest.approx(120.0 - plan.probe_seconds) and plan.total <= 120.0
    assert "minutes is spent (planning, the pre-screen" in search.stopped_by_budget
    assert not (out / S.TRIALS).exists() and all(t.step == 0 for t in search.trials)  # nothing trained
    assert search.seconds_spent() >= 340.0  # and the report counts what was spent before the race
    assert S.seconds_outside_trials(out, {}) == pytest.approx(search.seconds_spent() - search.compare_seconds)
    text = write_report(search)[0].read_text()
    assert "Estimated in all: " in text and " min over the 2 minutes" in text


def test_the_warm_up_is_not_charged_to_the_first_shape():
    """The first measurement in a process pays what is paid once: it is thrown away, on the cheapest shape."""
    s = settings()
    config = S.check_settings(tiny(), s)
    found = S.shapes(config, s.params, s.depths, s.tolerance)
    calls = []

    def measure(cfg):
        calls.append(S.shape_name(cfg.model))
        return S.Cost(10.0, 1.0, 70.0) if len(calls) == 1 else S.Cost(0.1, 0.01, 0.5)

    costs = S.measure_costs(config, found, measure)
    assert calls[0] == min(found, key=lambda f: f.flops_per_token).name
    assert calls[1:] == [f.name for f in found]
    assert list(costs.values()) == [S.Cost(0.1, 0.01, 0.5)] * len(found)


@pytest.mark.parametrize(
    "executor, count",
    [
        ({"threads": 1}, 1),  # --threads 1: the trials' count
        ({"name": "ray", "cpus_per_run": 1.0}, 1),  # a Ray trial's process trains at the CPUs it reserves
        ({}, 2),  # the default: the policy's count, this process's own
    ],
)
def test_the_pre_screen_replays_at_the_thread_count_its_trials_train_at(tmp_path, monkeypatch, executor, count):
    """A trial starts from its shape's replay: both halves at one count, so that a trial's steps are one run's
    at the count it records."""
    import torch

    from kilolayer.study.executors import Executor

    seen = []

    def forecaster(config):
        seen.append(torch.get_num_threads())
        return "diverges", "stub"

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        S.run_search(tiny(), tmp_path / "s", settings(), forecaster=forecaster, executor=Executor(**executor))
        assert set(seen) == {count} and len(seen) == 3  # every shape's replay
        assert torch.get_num_threads() == 2  # restored after
    finally:
        torch.set_num_threads(before)
