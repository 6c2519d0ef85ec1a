"""One home for executors: ``kilolayer study`` and ``kilolayer search`` take ``--executor`` and its options from
one registry and one declaration (``--threads`` is ``kilolayer train``'s), refuse the same mistakes with the same
line, and schedule their units on the same pools; a search's config is read as a study group's base is."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import yaml
from helpers import ROOT

from kilolayer.cli import build_parser, main
from kilolayer.config import load_config
from kilolayer.errors import ConfigError
from kilolayer.study import executors
from kilolayer.study.executors.local import LocalPool

EXECUTOR_OPTIONS = {
    "--executor",
    "--jobs",
    "--threads",
    "--address",
    "--cpus-per-run",
    "--gpus-per-run",
    "--nproc-per-run",
}


def subparser(name: str):
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices[name]


def options(name: str) -> dict[str, object]:
    return {s: a for a in subparser(name)._actions for s in a.option_strings}


def test_study_and_search_declare_the_same_executor_options():
    study, search = options("study"), options("search")
    assert EXECUTOR_OPTIONS <= set(study) and EXECUTOR_OPTIONS <= set(search)
    for flag in EXECUTOR_OPTIONS:  # one declaration: same type, default and metavar in both commands
        a, b = study[flag], search[flag]
        assert (a.type, a.default, a.metavar) == (b.type, b.default, b.metavar), flag
    assert study["--executor"].metavar == "|".join(executors.EXECUTORS) == "local|ray"
    # --threads is kilolayer train's option: the same values, the same meaning (train.threads)
    train = options("train")["--threads"]
    assert (train.type, train.metavar) == (study["--threads"].type, study["--threads"].metavar) == (None, "N|auto")


def parsed(*argv: str):
    return build_parser().parse_args(list(argv))


def test_study_and_search_get_their_executor_from_one_registry(monkeypatch):
    seen = []
    monkeypatch.setattr(executors.EXECUTORS, "get", lambda name: seen.append(name) or executors.Kind(name, ("jobs",)))
    study = executors.from_args(parsed("study", "quick", "--out", "o", "--jobs", "2"), "study")
    search = executors.from_args(parsed("search", "c.yaml", "--params", "1k", "--out", "o"), "search")
    assert seen == ["local", "local"]
    assert study == executors.Executor("local", jobs=2) and search == executors.Executor("local")


def spec_file(tmp_path):
    path = tmp_path / "s.yaml"
    base = {"model": {"layers": 1, "width": 16, "heads": 2}, "train": {"steps": 2}}
    path.write_text(yaml.safe_dump({"name": "s", "groups": [{"name": "g", "base": base}]}))
    return str(path)


@pytest.mark.parametrize(
    "args, line",
    [
        (["--executor", "forked"], "--executor='forked': unknown executor; allowed: local, ray"),
        (["--address", "127.0.0.1:1"], "--address: only with --executor ray"),
        (["--executor", "ray", "--jobs", "2"], "--jobs: only with --executor local"),
        (["--executor", "ray", "--cpus-per-run", "0.5"], "--cpus-per-run=0.5: expected a number >= 1"),
        (["--jobs", "0"], "--jobs=0: expected an integer >= 1"),
        (["--threads", "0"], "train.threads=0: expected a thread count from 1 to"),
    ],
)
def test_a_bad_executor_option_is_the_same_line_from_study_and_search(tmp_path, capsys, args, line):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"layers": 1, "width": 16, "heads": 2}}))
    lines = []
    for argv in (
        ["study", spec_file(tmp_path), "--out", str(tmp_path / "study")],
        ["search", str(config), "--params", "5k", "--out", str(tmp_path / "search")],
    ):
        assert main([*argv, *args]) == 2
        lines.append(capsys.readouterr().err.strip().splitlines())
    assert len(lines[0]) == 1 and lines[0][0].startswith(f"kilolayer: error: {line}")
    assert lines[1] == [lines[0][0].replace("points", "trials")]  # the same line, naming the command's unit
    assert not (tmp_path / "study").exists() and not (tmp_path / "search").exists()


def test_train_study_and_search_check_threads_alike(tmp_path, capsys):
    """``--threads`` means train.threads for every command: the same check, the same one line."""
    config = str(ROOT / "configs" / "digits_mae.yaml")
    assert main(["train", config, "--out", str(tmp_path / "run"), "--threads", "many"]) == 2
    train = capsys.readouterr().err.strip()
    with pytest.raises(ConfigError) as err:
        executors.from_args(parsed("study", "quick", "--out", "o", "--threads", "many"), "study")
    assert train == f"kilolayer: error: {err.value}"
    assert executors.from_args(parsed("study", "quick", "--out", "o", "--threads", "3"), "study").threads == 3
    assert executors.from_args(parsed("search", "c", "--params", "1", "--out", "o", "--threads", "auto"), "search")


@pytest.mark.parametrize(
    "args, line",
    [
        (["--jobs", "2"], "--jobs=2: kilolayer search trains its trials one at a time on this machine"),
        (["--executor", "ray", "--nproc-per-run", "2"], "--nproc-per-run: kilolayer search trains each trial in one"),
    ],
)
def test_search_refuses_what_its_trials_cannot_do_in_one_line(args, line):
    with pytest.raises(ConfigError, match=f"^{line}"):
        executors.from_args(parsed("search", "c.yaml", "--params", "1k", "--out", "o", *args), "search")


def test_a_study_point_trains_with_the_threads_given():
    from kilolayer.study.runner import train_command
    from kilolayer.study.spec import Point

    point = Point("g", "base", {}, load_config(ROOT / "configs" / "digits_mae.yaml"))
    assert train_command(point, Path("out"), threads=3)[-2:] == ["--threads", "3"]
    assert "--threads" not in train_command(point, Path("out"))


def _queue(n: int):
    """A queue of ``n`` one-group points (``g/seed=0`` ...) that wait for nothing."""
    from kilolayer.study.spec import Queue, StudySpec, expand

    base = {"model": {"layers": 1, "width": 16, "heads": 2}, "train": {"steps": 2}}
    spec = StudySpec(name="s", groups=[{"name": "g", "base": base, "seeds": list(range(n))}])
    return Queue(spec, expand(spec))


def test_the_local_pool_runs_one_unit_here_or_k_at_once():
    main_thread = threading.get_ident()
    one = LocalPool(1)
    one.submit("a", threading.get_ident)
    assert one.in_process and one.busy == 1 and one.wait() == [("a", main_thread)]  # ran as it was submitted

    two, started = LocalPool(2), []

    def unit(point):
        started.append(point.key)
        deadline = time.monotonic() + 30
        while len(started) < 2:  # both run at once
            assert time.monotonic() < deadline, "the second unit never started beside the first"
            time.sleep(0.01)

    queue = _queue(2)
    executors.run_queue(two, queue, unit)
    assert sorted(started) == ["g/seed=0", "g/seed=1"] and queue.ended == set(started) and two.busy == 0
    two.close()


def test_a_unit_that_raises_cancels_the_rest_and_raises():
    pool, ran = LocalPool(2), []

    def unit(point):
        if point.key == "g/seed=0":
            raise ValueError("boom")
        time.sleep(0.2)
        ran.append(point.key)

    with pytest.raises(ValueError, match="boom"):
        executors.run_queue(pool, _queue(6), unit)
    # the one beside it ended, or was cancelled before it started; those not taken never ran
    assert pool.busy == 0 and ran in ([], ["g/seed=1"]), ran
    pool.close()


def test_run_queue_starts_each_point_once_what_it_waits_for_has_ended():
    """On two slots, with the pre-training point of seed 1 slow: each point starts after every point it waits
    for has ended, and the fine-tuning point of seed 0 does not wait for seed 1's pre-training."""
    from kilolayer.study.spec import Queue, StudySpec, expand

    base = {"model": {"layers": 1, "width": 16, "heads": 2}, "train": {"steps": 2}}
    spec = StudySpec(
        name="s",
        groups=[
            {"name": "pre", "base": base, "seeds": [0, 1]},
            {"name": "ft", "base": base, "init_from": "pre", "seeds": [0, 1]},
            {"name": "after", "base": base, "after": "pre"},
            {"name": "free", "base": base},
        ],
    )
    queue, times = Queue(spec, expand(spec)), {}

    def unit(point):
        start = time.monotonic()
        time.sleep(0.5 if point.key == "pre/seed=1" else 0.05)
        times[point.key] = (start, time.monotonic())

    pool = LocalPool(2)
    executors.run_queue(pool, queue, unit)
    pool.close()
    assert len(times) == 6 and len(queue) == 0
    for key, need in queue.deps.items():
        assert all(times[key][0] >= times[n][1] for n in need), (key, need)
    assert times["ft/seed=0"][1] < times["pre/seed=1"][1] and times["free/seed=0"][1] < times["pre/seed=1"][1]


def test_a_search_config_reads_as_a_study_groups_base(tmp_path):
    """One reader: a search's CONFIG + --set is the config a spec group gets from ``base: CONFIG`` + ``set``."""
    from helpers import ROOT

    from kilolayer.study.spec import expand, load_spec

    (tmp_path / "specs").mkdir()
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "digits_mae.yaml"
    config.write_text((ROOT / "configs" / "digits_mae.yaml").read_text())
    spec = tmp_path / "specs" / "spec.yaml"
    group = {"name": "g", "base": "../configs/digits_mae.yaml", "set": {"train.steps": 7}}
    spec.write_text(yaml.safe_dump({"name": "same", "groups": [group]}))
    (point,) = expand(load_spec(spec, ["train.lr=0.002"]))
    search = load_config(config, ["train.steps=7", "train.lr=0.002", "train.seed=0"])
    assert point.config == search
