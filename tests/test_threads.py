"""The thread policy: the default count from constructed affinity and quota, fixed for a run whatever the load;
precedence; ``auto`` following a constructed load and saying it is not bit-reproducible; resume; other runs seen
on the machine; and, as subprocesses, a killed and resumed default run and two default runs started at
different loads giving the same losses bit for bit."""

from __future__ import annotations

import ast
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from itertools import cycle
from pathlib import Path

import pytest
import torch
from objective_helpers import tiny_lm

from kilolayer import rundir
from kilolayer.cli import main
from kilolayer.config import load_config
from kilolayer.errors import ConfigError
from kilolayer.train import engine as engine_module
from kilolayer.train.checkpoint import complete_checkpoints
from kilolayer.train.host import threads as T
from kilolayer.train.run import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("usable", "busy", "count"),
    [
        (2, 0.0, 2),  # an idle machine: every usable CPU
        (2, 0.4, 2),  # daemons' noise rounds away
        (2, 0.5, 1),  # half a CPU busy rounds up: leave it
        (2, 1.0, 1),  # another one-thread run
        (2, 2.0, 1),  # another run on both cores: still one, never zero
        (2, 7.5, 1),
        (16, 3.2, 13),
        (16, -1.0, 16),  # never more than usable
        (1, 0.0, 1),
    ],
)
def test_the_count_is_the_usable_cpus_less_the_busy_ones_and_at_least_one(usable, busy, count):
    assert T.choose(usable, busy) == count


@pytest.mark.parametrize(
    "usable, busy, following, count",
    [
        (2, 0.0, 1, 1),  # two auto runs on two cores: one each, even before either sees the other's load
        (16, 0.0, 1, 8),  # a run alone at 16 makes room for one started after it: 8 each, not 15 and 1
        (16, 8.0, 1, 8),  # the settled split: each sees the other's 8
        (16, 12.0, 1, 4),  # other work beside them still comes first
        (16, 0.0, 3, 4),
        (3, 0.0, 1, 1),  # an odd core is left over, never over-committed
        (1, 0.0, 5, 1),
    ],
)
def test_auto_runs_share_the_cores_evenly_whenever_they_started(usable, busy, following, count):
    assert T.choose(usable, busy, following) == count


def test_a_cgroup_quota_caps_the_cpus(tmp_path):
    none = tmp_path / "no_self_cgroup"
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert T.cgroup_quota(tmp_path, none) == 2  # 1.5 CPUs: rounded up
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert T.cgroup_quota(tmp_path, none) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert T.cgroup_quota(tmp_path, none) == 4
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert T.cgroup_quota(tmp_path, none) is None
    assert T.cgroup_quota(tmp_path / "missing", none) is None


def test_cpu_times_read_only_the_cpus_of_this_process(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  50 0 50 100 0 0 0 0 0 0\n"
        "cpu0 10 0 10 80 0 0 0 0 0 0\n"  # 20 busy of 100
        "cpu1 40 0 40 20 0 0 0 0 0 0\n"  # 80 busy of 100
        "intr 12345\n"
    )
    assert T._cpu_times({1}, stat) == (80.0, 100.0)
    assert T._cpu_times(None, stat) == (100.0, 200.0)
    assert T._cpu_times({0}, tmp_path / "missing") is None


#: with one usable CPU a load cannot move any count, so the load tests would pass proving nothing
NEEDS_TWO_CPUS = pytest.mark.skipif(T.usable_cpus() < 2, reason="one usable CPU: the load cannot change a count")


class FakeProbe:
    def __init__(self, readings):
        self.readings = list(readings)

    def busy(self):
        return self.readings.pop(0)


def test_an_adaptive_count_follows_other_work_at_each_check(monkeypatch):
    monkeypatch.setattr(T, "usable_cpus", lambda: 2)
    applied = []
    monkeypatch.setattr(torch, "set_num_threads", applied.append)
    now = [0.0]
    probe = FakeProbe([0.0, 1.0, 1.0, 0.1])
    adapter = T.Adapter(T.Threads(2, "idle", adaptive=True), clock=lambda: now[0], probe=probe, following=lambda: 0)
    assert adapter.check() is None and probe.readings == [1.0, 1.0, 0.1]  # the first step checks: still idle
    assert adapter.check() is None and len(probe.readings) == 3  # not yet time
    now[0] += T.CHECK_S
    assert adapter.check().count == 1 and applied == [1]  # another run started: share the cores
    now[0] += T.CHECK_S
    assert adapter.check() is None and adapter.count == 1  # it still runs
    now[0] += T.CHECK_S
    changed = adapter.check()
    assert changed.count == 2 and applied == [1, 2] and "0.1 kept busy" in changed.reason  # it ended


def test_an_auto_run_makes_room_for_one_started_after_it(monkeypatch):
    """16 cores: a run alone at 16; another auto run marks itself and takes 16 // 2 = 8 (16 are busy, so the load
    alone would give it 1); at its next check the first sees the second's mark and goes to 8, not 15."""
    monkeypatch.setattr(T, "usable_cpus", lambda: 16)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    now, following = [0.0], [0]
    first = T.Adapter(T.Threads(16, "idle", adaptive=True), lambda: now[0], FakeProbe([0.0, 1.0]), lambda: following[0])
    assert first.check() is None and first.count == 16
    following[0] = 1  # the second run's mark appears; it is still starting (one CPU busy)
    now[0] += T.CHECK_S
    changed = first.check()
    assert changed.count == 8 and "1.0 kept busy by other work, shared with 1 other auto run" in changed.reason


def test_auto_starts_at_its_share_beside_other_auto_runs(tmp_path, monkeypatch):
    where = tmp_path / "marks"
    monkeypatch.setattr(T, "TRAINING_DIR", where)
    monkeypatch.setattr(T, "usable_cpus", lambda: 4)
    monkeypatch.setattr(T, "other_work", lambda: 0.0)
    with T.Training(where, following=True) as mine:  # this run's own mark does not count
        assert mine.path.name.endswith(".auto.lock")
        assert T.auto().count == 4
        fixed = _live_mark(where, 4242)  # a run at a fixed count: its load counts, its mark does not
        try:
            assert T.auto().count == 4 and T.others_training(where, following=True) == []
            os.rename(where / "4242-abcdef12.lock", where / "4242-abcdef12.auto.lock")
            assert T.others_training(where, following=True) == [4242] and T.others_training(where) == [4242]
            assert T.auto() == T.Threads(
                2,
                "auto: 4 usable CPUs, 0.0 kept busy by other work, shared with 1 other auto run",
                adaptive=True,
                source=T.AUTO,
            )
            # a run pinned to other CPUs than this one's takes none of ours
            monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 1} if pid == 0 else {2, 3})
            assert T.others_training(where, following=True) == [] and T.others_training(where) == []
        finally:
            os.close(fixed)


def test_an_unread_load_lowers_an_auto_count_only_to_its_share(monkeypatch):
    monkeypatch.setattr(T, "usable_cpus", lambda: 8)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    now, following = [0.0], [0]
    adapter = T.Adapter(T.Threads(4, "", adaptive=True), lambda: now[0], FakeProbe([None, None]), lambda: following[0])
    assert adapter.check() is None and adapter.count == 4  # no load read: never raised on a guess
    following[0], now[0] = 3, T.CHECK_S
    changed = adapter.check()
    assert changed.count == 2 and "their load unknown here, shared with 3 other auto runs" in changed.reason


def test_an_auto_run_is_marked_as_one_before_its_count_is_chosen(tmp_path, counted, monkeypatch):
    where = tmp_path / "marks"
    monkeypatch.setattr(T, "TRAINING_DIR", where)
    seen = []
    monkeypatch.setattr(T, "other_work", lambda: seen.append(sorted(p.name for p in where.iterdir())) or 0.0)
    train(RUN, tmp_path / "run", choose_threads=True, sets=["train.threads=auto", "train.steps=1"])
    assert len(seen) == 1 and len(seen[0]) == 1  # its own mark, there when the count was chosen
    assert seen[0][0].startswith(f"{os.getpid()}-") and seen[0][0].endswith(".auto.lock")
    assert list(where.iterdir()) == []  # gone with the run


def test_a_count_other_than_auto_never_adapts(monkeypatch):
    monkeypatch.setattr(T, "usable_cpus", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    now = [0.0]
    for threads in (T.policy(given=3), T.policy(recorded=2), T.policy()):
        adapter = T.Adapter(threads, clock=lambda: now[0])
        now[0] += 10 * T.CHECK_S
        assert adapter.check() is None and adapter.count == threads.count and not threads.adaptive


def test_the_policy_takes_a_given_count_then_a_recorded_one_then_the_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert T.policy(given=1, recorded=2) == T.Threads(1, "train.threads", source=T.GIVEN)
    assert T.policy(recorded=2).count == 2 and T.policy(recorded=2).source == T.RECORDED
    assert T.policy() == T.Threads(3, "OMP_NUM_THREADS", source=T.ENVIRONMENT)
    capped = T.policy(recorded=4)  # a launcher's share caps a recorded count
    assert capped.count == 3 and "below the 4 the run recorded" in capped.reason and capped.recorded == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(T, "usable_cpus", lambda: 4)
    monkeypatch.setattr(T, "other_work", lambda: 1.2)
    monkeypatch.setattr(T, "TRAINING_DIR", Path(os.devnull) / "none")  # no marks, no neighbours
    assert T.policy() == T.Threads(4, "every usable CPU: 4 by affinity and CPU quota", source=T.DEFAULT)
    assert T.policy(device="cuda").source == T.DEVICE
    auto = T.policy(given="auto", recorded=2)  # auto wins over a recorded count, and follows the load
    assert auto == T.Threads(3, "auto: 4 usable CPUs, 1.2 kept busy by other work", adaptive=True, source=T.AUTO)
    monkeypatch.setattr(T, "other_work", lambda: None)
    assert T.policy(given="auto") == T.Threads(4, "auto: 4 usable CPUs, their load unknown here", True, T.AUTO)


def test_the_default_count_is_every_usable_core_by_affinity_and_cgroup_quota(tmp_path, monkeypatch):
    """Eight CPUs in the affinity mask; a cgroup v2 quota of 2.5 CPUs allows 3; a v1 quota of 1.5 allows 2; no
    quota leaves the eight; two CPUs in the mask under a quota of 3 leave two. The load is never read."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(T, "other_work", lambda *a: pytest.fail("the default count read the machine's load"))
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: set(range(8)))
    own = tmp_path / "self_cgroup"
    own.write_text("0::/job\n")
    (tmp_path / "job").mkdir()
    monkeypatch.setattr(T, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(T, "OWN_CGROUP", own)
    (tmp_path / "job" / "cpu.max").write_text("250000 100000\n")
    assert T.policy() == T.Threads(3, "every usable CPU: 3 by affinity and CPU quota", source=T.DEFAULT)
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "cpu.max").unlink(missing_ok=True)
    assert T.policy().count == 8
    (tmp_path / "job" / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert T.policy().count == 2
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 5})
    assert T.policy().count == 2


def test_the_load_probe_leaves_out_this_processs_own_cpu_time(monkeypatch):
    """Over 2 s the two CPUs were 75% busy (3 CPU-seconds); this process used 2 of them: other work kept 0.5
    CPUs busy."""
    readings = iter([((100.0, 400.0), 10.0, 50.0), ((250.0, 600.0), 12.0, 52.0)])
    monkeypatch.setattr(T.LoadProbe, "_read", lambda self: next(readings))
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 1})
    probe = T.LoadProbe()
    assert probe.busy() == pytest.approx(2 * 150 / 200 - 2.0 / 2.0)


@pytest.mark.parametrize(
    ("value", "count"),
    [
        ("3", 3),
        ("4,2", 4),
        (" 2 ", 2),
        ("99999", T.MAX_THREADS),
        ("0", None),
        ("abc", None),
        ("2.5", None),
        ("-2", None),
    ],
)
def test_omp_num_threads_is_read_as_openmp_reads_it_or_named_as_ignored(value, count):
    got, why = T.env_count(value)
    assert got == count
    assert why == ("OMP_NUM_THREADS" if count else f"OMP_NUM_THREADS={value!r} ignored: not a positive integer")
    assert T.env_count("\u0663") == (None, "OMP_NUM_THREADS='\u0663' ignored: not a positive integer")  # not ASCII


def test_unexpected_proc_and_cgroup_contents_read_as_unknown(tmp_path):
    stat = tmp_path / "stat"
    for text in ("cpu0 1 2 3\n", "\n", "cpufreq 1 2 3 4 5 6\n", "cpu0 1 x 3 4 5 6 7 8\n"):
        stat.write_text(text)
        assert T._cpu_times(None, stat) is None, text
    (tmp_path / "cpu.max").write_text("100000 0\n")
    assert T.cgroup_quota(tmp_path, tmp_path / "none") is None


def test_the_quota_of_this_processs_own_cgroup_counts(tmp_path):
    own = tmp_path / "self_cgroup"
    own.write_text("0::/user.slice/job\n")
    (tmp_path / "user.slice" / "job").mkdir(parents=True)
    (tmp_path / "user.slice" / "job" / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert T.cgroup_quota(tmp_path, own) == 3
    # a quota on the parent (a pod's) over a container without one: the parent's
    (tmp_path / "user.slice" / "job" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "user.slice" / "cpu.max").write_text("200000 100000\n")
    assert T.cgroup_quota(tmp_path, own) == 2
    # both: the smaller
    (tmp_path / "user.slice" / "job" / "cpu.max").write_text("100000 100000\n")
    assert T.cgroup_quota(tmp_path, own) == 1


# ---------------------------------------------------------------- runs (in-process)

RUN = tiny_lm(steps=6, batch_size=4, log_every=1, checkpoint_every=3, peak_flops=1e12)


@pytest.fixture
def counted(monkeypatch):
    """The thread count each training step ran at; two usable CPUs, no launcher's OMP_NUM_THREADS, and a load
    reader that says other work keeps 0, 2, 0, 2, ... CPUs busy, re-read at every step."""
    seen = []
    step = engine_module.Engine.train_step

    def counting(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "train_step", counting)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(T, "usable_cpus", lambda: 2)
    monkeypatch.setattr(T, "other_work", lambda: 2.0)  # busy when the run starts
    loads = cycle([0.0, 2.0])
    monkeypatch.setattr(T.LoadProbe, "busy", lambda self: next(loads))
    monkeypatch.setattr(T, "CHECK_S", 0.0)
    monkeypatch.setattr(T, "TRAINING_DIR", Path(os.devnull) / "none")  # no marks, no neighbours
    return seen


def _records(run: Path) -> list[dict]:
    return [r for r in rundir.read_metrics(run) if r.get("split") == "train"]


def test_the_default_count_stays_fixed_for_the_whole_run_while_the_load_changes(tmp_path, counted, capsys):
    run = tmp_path / "run"
    train(RUN, run, choose_threads=True)
    assert counted == [2] * 6
    assert [r["threads"] for r in _records(run)] == [2] * 6
    st = rundir.read_status(run)
    assert (st["threads"], st["threads_adaptive"]) == (2, False)
    first = capsys.readouterr().err.splitlines()[0]
    assert first == "kilolayer: 2 threads (every usable CPU: 2 by affinity and CPU quota)"


def test_auto_follows_the_load_and_says_first_that_it_is_not_bit_reproducible(tmp_path, counted, capsys):
    run = tmp_path / "run"
    train(RUN, run, choose_threads=True, sets=["train.threads=auto"])
    # busy at the start: 1 thread; then each step's check reads 0, 2, 0, ... busy CPUs
    assert counted == [1, 2, 1, 2, 1, 2]
    assert [r["threads"] for r in _records(run)] == [2, 1, 2, 1, 2, 1]  # each record after its step's check
    assert rundir.read_status(run)["threads_adaptive"] is True
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("kilolayer: 1 thread (auto: 2 usable CPUs, 2.0 kept busy by other work)")
    assert "not bit-reproducible" in first
    assert "not bit-reproducible" not in T.policy(given=2).line()


def test_a_quiet_auto_run_still_says_it_is_not_bit_reproducible(tmp_path, counted, capsys):
    train(RUN, tmp_path / "run", choose_threads=True, quiet=True, sets=["train.threads=auto", "train.steps=1"])
    assert capsys.readouterr().err.strip() == (
        "kilolayer: warning: train.threads: auto follows the machine's load, so this run's losses are not "
        "bit-reproducible (give a count for that)"
    )
    train(RUN, tmp_path / "fixed", choose_threads=True, quiet=True, sets=["train.steps=1"])
    assert capsys.readouterr().err == ""


def test_a_resume_reuses_the_recorded_default_count_on_a_machine_that_changed(tmp_path, counted, monkeypatch):
    run = tmp_path / "run"
    train(RUN, run, choose_threads=True, quiet=True, sets=["train.steps=3"])
    assert counted == [2, 2, 2] and rundir.read_status(run)["threads"] == 2
    monkeypatch.setattr(T, "usable_cpus", lambda: 1)  # the same command would now take one core
    counted.clear()
    train(None, run, resume=True, choose_threads=True, quiet=True, sets=["train.steps=6"])
    assert counted == [2, 2, 2]
    st = rundir.read_status(run)
    assert (st["threads"], st["threads_reason"]) == (
        2,
        "the count the run recorded (a resume is bit-exact only at it); more than the 1 usable CPU here, which it "
        "oversubscribes",
    )
    counted.clear()
    fresh = tmp_path / "fresh"
    train(RUN, fresh, choose_threads=True, quiet=True)
    assert counted == [1] * 6  # a new run takes the cores it has now


def test_a_resume_a_launcher_gives_fewer_threads_says_so_even_when_quiet(tmp_path, counted, monkeypatch, capsys):
    """A study at a larger --jobs shares the cores out: its share wins over the recorded count, and the point's
    log says that this resume is not bit-exact."""
    run = tmp_path / "run"
    train(RUN, run, choose_threads=True, quiet=True, sets=["train.steps=3"])
    capsys.readouterr()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    counted.clear()
    train(None, run, resume=True, choose_threads=True, quiet=True, sets=["train.steps=6"])
    assert counted == [1, 1, 1]
    assert capsys.readouterr().err.strip() == (
        "kilolayer: warning: resumed at 1 thread (OMP_NUM_THREADS), not at the 2 this run recorded: its numbers "
        "differ from an uninterrupted run's in the last bits"
    )


def test_a_resumed_auto_run_follows_the_load_again(tmp_path, counted):
    run = tmp_path / "run"
    train(RUN, run, choose_threads=True, quiet=True, sets=["train.steps=3", "train.threads=auto"])
    counted.clear()
    train(None, run, resume=True, choose_threads=True, quiet=True, sets=["train.steps=6"])
    assert counted[0] == 1 and set(counted) == {1, 2}  # started busy, then followed the load
    assert rundir.read_status(run)["threads_adaptive"] is True


# ---------------------------------------------------------------- other runs on the machine


def _live_mark(where: Path, pid: int) -> int:
    """A mark as a training process with ``pid`` holds it: the file, locked through a descriptor of its own."""
    where.mkdir(exist_ok=True)
    fd = os.open(where / f"{pid}-abcdef12.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_marks_show_the_other_runs_training_and_a_dead_runs_mark_goes(tmp_path):
    where = tmp_path / "marks"
    fd = _live_mark(where, 4242)
    (where / "977-00000000.lock").write_text("")  # its process has ended: nothing holds the lock
    try:
        with T.Training(where) as mine:
            assert mine.path is not None and mine.path.name.startswith(f"{os.getpid()}-")
            assert T.others_training(where) == [4242]  # not this process's own mark
        assert not (where / "977-00000000.lock").exists() and not mine.path.exists()
    finally:
        os.close(fd)
    assert T.others_training(where) == []
    assert T.others_training(tmp_path / "missing") == []
    with T.Training(tmp_path / "file" / "under"):  # a folder that cannot be made: no mark, no error
        pass


def test_a_default_run_names_the_choice_that_avoids_sharing_the_cores():
    every = T.Threads(2, "every usable CPU", source=T.DEFAULT)
    line = T.crowded(every, [4242], usable=2)
    assert "another kilolayer run is training on this machine (PID 4242)" in line
    assert "--threads 1 (train.threads: 1)" in line and "train.threads: auto" in line
    assert "--threads 2 " in T.crowded(T.Threads(8, "", source=T.DEFAULT), [1, 2, 3], usable=8)
    assert T.crowded(every, [], usable=2) == ""
    assert T.crowded(T.Threads(1, "", source=T.DEFAULT), [4242], usable=2) == ""  # one core each already
    for source in (T.GIVEN, T.ENVIRONMENT, T.AUTO):
        assert T.crowded(T.Threads(2, "", source=source), [4242], usable=2) == ""


def test_a_resume_at_its_recorded_count_beside_another_run_names_the_cost_of_sharing():
    line = T.crowded(T.Threads(2, "", source=T.RECORDED), [4242], usable=2)
    assert line.startswith("another kilolayer run is training on this machine (PID 4242)")
    assert "keeps the 2 threads the run recorded, to stay bit-exact" in line
    assert "--threads 1 to share the cores instead (its losses then differ in their last bits)" in line


def test_a_resume_on_a_machine_with_fewer_cpus_says_it_oversubscribes_them(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(T, "usable_cpus", lambda: 4)
    resumed = T.policy(recorded=64)
    assert resumed.count == 64 and resumed.source == T.RECORDED
    assert resumed.reason.endswith("; more than the 4 usable CPUs here, which it oversubscribes")
    assert T.policy(recorded=4).reason == "the count the run recorded (a resume is bit-exact only at it)"


def test_runs_pinned_to_other_cpus_are_not_neighbours(tmp_path, monkeypatch):
    """A run whose affinity shares none of this process's CPUs takes none of its cores: neither the default's
    line nor auto's share counts it."""
    where = tmp_path / "marks"
    fd = _live_mark(where, 4242)
    try:
        assert T.others_training(where) == [4242]
        monkeypatch.setattr(T, "_shares_cpus", lambda pid: False)
        assert T.others_training(where) == [] and T.others_training(where, following=True) == []
    finally:
        os.close(fd)


def test_a_default_run_beside_another_says_so_in_its_second_line(tmp_path, counted, monkeypatch, capsys):
    where = tmp_path / "marks"
    monkeypatch.setattr(T, "TRAINING_DIR", where)
    fd = _live_mark(where, 4242)
    try:
        train(RUN, tmp_path / "run", choose_threads=True, sets=["train.steps=1"])
    finally:
        os.close(fd)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("kilolayer: 2 threads (every usable CPU")
    assert lines[1].startswith("kilolayer: warning: another kilolayer run is training on this machine (PID 4242)")
    assert "--threads 1" in lines[1]
    assert counted == [2]  # said, not changed: the count stays the default's
    assert list(where.iterdir()) == [where / "4242-abcdef12.lock"]  # the run's own mark went with it


def test_a_study_gives_each_point_a_fixed_count_from_jobs(monkeypatch):
    """``--jobs K`` hands each point usable // K threads through OMP_NUM_THREADS, which its run takes as fixed
    (and says nothing of its neighbours: the launcher has shared the cores); one job leaves the default."""
    from kilolayer.study import runner

    monkeypatch.setattr(runner, "usable_cpus", lambda: 4)
    assert [runner.threads_per_job(k) for k in (1, 2, 3, 8)] == [None, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", str(runner.threads_per_job(2)))
    point = T.policy()
    assert (point.count, point.adaptive, point.source) == (2, False, T.ENVIRONMENT)
    assert T.crowded(point, [4242], usable=4) == ""


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("value", ["foo", 0, 2.5, "2"])
def test_a_thread_count_that_is_neither_a_count_nor_auto_is_one_line(value):
    with pytest.raises(ConfigError) as err:
        load_config(tiny_lm(threads=value))
    assert str(err.value) == f"train.threads={value!r}: expected a thread count from 1 to 1024, or auto"
    assert load_config(tiny_lm(threads="auto")).train.threads == "auto"


def test_threads_foo_on_the_command_line_is_one_line(tmp_path, capsys):
    config = str(ROOT / "configs" / "reverse_deepnorm.yaml")
    code = main(["train", config, "--out", str(tmp_path / "run"), "--threads", "foo"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err
    assert err.endswith("train.threads='foo': expected a thread count from 1 to 1024, or auto")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- subprocesses: kill, resume, other load

CONFIG = ROOT / "configs" / "reverse_deepnorm.yaml"
# a smaller copy of the shipped reversal config whose losses still change with the thread count (5 of 24 differ
# between 1 and 2 threads)
SMALL = {"model.layers": 2, "model.decoder_layers": 2, "model.width": 32, "model.ffn": 128, "train.batch_size": 16}
SMALL.update({"train.steps": 24, "train.checkpoint_every": 4, "train.log_every": 1, "train.eval_every": 0})
SMALL["train.eval_batches"] = 1  # the final evaluation: the losses compared are the training steps'
SETS = [arg for key, value in {**SMALL, "train.peak_flops": 1e12}.items() for arg in ("--set", f"{key}={value}")]


def _default_env() -> dict:
    """The environment of a user's shell: no launcher's OMP_NUM_THREADS, so the default count applies. OpenMP's
    threads sleep rather than spin while they wait: on a machine as busy as these tests make it, spinning threads
    take the cores their partners need (twice the CPU time a run); the wait policy changes no result."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return {**env, "OMP_WAIT_POLICY": "PASSIVE"}


def _train(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kilolayer", "train", str(CONFIG), "--out", str(out), "--quiet", *SETS, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=_default_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]


class Load:
    """A process that keeps one CPU busy, started and stopped at will."""

    def __init__(self):
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def load():
    spinner = Load()
    yield spinner
    spinner.stop()


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in _records(run)]


@pytest.fixture(scope="module")
def busy_start(tmp_path_factory):
    """A default run started on a busy machine, the load stopping halfway (after its third checkpoint)."""
    run, spinner = tmp_path_factory.mktemp("busy_start") / "run", Load()
    spinner.start()
    try:
        proc = _train(run)
        while len(complete_checkpoints(run)) < 3 and proc.poll() is None:
            time.sleep(0.01)
    finally:
        spinner.stop()
    _finish(proc)
    return run


@pytest.mark.integration
@NEEDS_TWO_CPUS
def test_a_killed_and_resumed_default_run_gives_the_uninterrupted_runs_losses_under_a_changing_load(
    tmp_path, load, busy_start
):
    usable = T.usable_cpus()
    full, killed = busy_start, tmp_path / "killed"
    proc = _train(killed)  # this one starts on an idle machine; the load starts halfway, and it is killed
    while not complete_checkpoints(killed) and proc.poll() is None:
        time.sleep(0.01)
    load.start()
    while len(complete_checkpoints(killed)) < 2 and proc.poll() is None:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert rundir.read_status(killed)["status"] == "running"  # killed mid-run: no final status
    load.stop()
    _finish(_train(killed, "--resume"))  # resumed on an idle machine
    assert len(_losses(full)) == 24
    assert _losses(killed) == _losses(full)  # bit for bit: floats compared exactly
    for run in (full, killed):
        st = rundir.read_status(run)
        assert (st["status"], st["threads"], st["threads_adaptive"]) == ("completed", usable, False)
        assert {r["threads"] for r in _records(run)} == {usable}
    (resumed,) = json.loads((killed / rundir.RESUME).read_text())  # one resume, from a checkpoint mid-run
    assert resumed["step"] % 4 == 0 and 8 <= resumed["step"] < 24


@pytest.mark.integration
@NEEDS_TWO_CPUS
def test_two_default_runs_started_at_different_loads_give_the_same_losses(tmp_path, busy_start):
    busy, idle = busy_start, tmp_path / "idle"
    _finish(_train(idle))
    assert len(_losses(busy)) == 24 and _losses(busy) == _losses(idle)
    assert rundir.read_status(busy)["threads"] == rundir.read_status(idle)["threads"] == T.usable_cpus()


def test_the_thread_count_is_set_in_the_host_package_only():
    """Every command, executor and analysis that computes sets torch's thread count through the host package's
    one context (``host.torch_threads``, which restores it), never with ``torch.set_num_threads`` of its own."""
    package = Path(T.__file__).parents[3] / "kilolayer"
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "set_num_threads":
                    found.add(path.relative_to(package.parent).as_posix())
    assert found == {"kilolayer/train/host/threads.py"}
