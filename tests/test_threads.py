"""The thread policy: counts from constructed affinity, quota and load; precedence; adapting during a run."""

from __future__ import annotations

import pytest
import torch

from kilolayer.train import threads as T


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
    adapter = T.Adapter(T.Threads(2, "idle", adaptive=True), clock=lambda: now[0], probe=FakeProbe([1.0, 1.0, 0.1]))
    assert adapter.check() is None  # not yet time
    now[0] += T.CHECK_S
    assert adapter.check().count == 1 and applied == [1]  # another run started: share the cores
    now[0] += T.CHECK_S
    assert adapter.check() is None and adapter.count == 1  # it still runs
    now[0] += T.CHECK_S
    changed = adapter.check()
    assert changed.count == 2 and applied == [1, 2] and "0.1 kept busy" in changed.reason  # it ended


def test_a_given_or_recorded_count_never_adapts(monkeypatch):
    now = [0.0]
    for threads in (T.policy(given=3), T.policy(recorded=2)):
        adapter = T.Adapter(threads, clock=lambda: now[0])
        now[0] += 10 * T.CHECK_S
        assert adapter.check() is None and adapter.count == threads.count and not threads.adaptive


def test_the_policy_takes_a_given_count_then_a_recorded_one_then_the_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert T.policy(given=1, recorded=2) == T.Threads(1, "train.threads")
    assert T.policy(recorded=2).count == 2 and "recorded" in T.policy(recorded=2).reason
    assert T.policy() == T.Threads(3, "OMP_NUM_THREADS")
    capped = T.policy(recorded=4)  # a launcher's share caps a recorded count
    assert capped.count == 3 and "below the 4 the run recorded" in capped.reason
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(T, "usable_cpus", lambda: 4)
    monkeypatch.setattr(T, "other_work", lambda: 1.2)
    assert T.policy() == T.Threads(3, "4 usable CPUs, 1.2 kept busy by other work", adaptive=True)
    assert not T.policy(device="cuda").adaptive
    monkeypatch.setattr(T, "other_work", lambda: None)
    assert T.policy() == T.Threads(4, "4 usable CPUs (their load is unknown here)")


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
