"""How many intra-op threads a computing process uses.

OpenMP starts one spinning thread per core, so two processes that each take every core slow each other
several-fold (docs/benchmarks.md, "Runs side by side"). The policy, first match wins:

1. a count given: ``train.threads`` / ``--threads``;
2. a resumed run keeps the count it recorded (float reductions are ordered by the thread count, so a resume is
   bit-exact only at the same count), unless a launcher's ``OMP_NUM_THREADS`` gives it fewer;
3. ``OMP_NUM_THREADS`` set in the environment (a launcher that shares the cores out, such as a study's
   executor or ``torchrun``, has decided);
4. otherwise the CPUs this process may use (its affinity, capped by a cgroup CPU quota) less those that other
   work keeps busy, at least one. Only this count is *adaptive*: a run re-checks it every :data:`CHECK_S`
   seconds from the CPU time the machine and the process spent since the last check, so two runs started
   together settle on sharing the cores. A count that changes changes float rounding: a run whose losses must
   be bit-reproducible gives its count.

On a GPU the policy stays out of the way (the device computes; torch's default serves data loading).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

#: seconds between two checks of an adaptive count
CHECK_S = 1.0
#: the most threads any count may ask for (torch takes a C int; no machine here has more cores)
MAX_THREADS = 1024


@dataclass(frozen=True)
class Threads:
    """A thread count and why it was chosen; ``adaptive``: the count may follow the machine's load."""

    count: int
    reason: str
    adaptive: bool = False


def choose(usable: int, busy: float) -> int:
    """Threads for a process that may use ``usable`` CPUs while other work keeps ``busy`` of them busy (in CPUs,
    rounded half up): what is left, at least one."""
    return max(1, min(usable, usable - math.floor(busy + 0.5)))


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> int | None:
    """The CPUs a cgroup CPU quota allows (v2's ``cpu.max`` of this process's own cgroup, else of the root; v1's
    ``cpu.cfs_quota_us``/``cpu.cfs_period_us``), rounded up; None without a quota or where it cannot be read."""
    places = []
    try:
        for line in own.read_text().splitlines():
            if line.startswith("0::"):
                places.append(root / line[3:].strip().lstrip("/"))
    except OSError:
        pass
    for place in (*places, root):
        try:
            quota, period = (place / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
        except (OSError, ValueError, ZeroDivisionError):
            continue
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else max(1, math.ceil(quota / period))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on (affinity), capped by a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_quota()
    return max(1, min(cpus, quota) if quota else cpus)


def _cpu_times(cpus: set[int] | None, stat: Path = Path("/proc/stat")) -> tuple[float, float] | None:
    """(busy, total) jiffies of ``cpus`` (every CPU if None) from ``/proc/stat``; None where it cannot be read."""
    busy = total = 0.0
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, *fields = line.split() or [""]
        if not (name.startswith("cpu") and name[3:].isdigit()) or len(fields) < 5:
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        try:
            values = [float(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        except ValueError:
            return None
        idle = values[3] + values[4]
        busy += sum(values) - idle
        total += sum(values)
    return (busy, total) if total else None


class LoadProbe:
    """How many CPUs other work keeps busy: the busy time of this process's CPUs since the previous reading,
    less this process's own CPU time over the same interval."""

    def __init__(self):
        try:
            self.cpus: set[int] | None = set(os.sched_getaffinity(0))
        except AttributeError:
            self.cpus = None
        self.count = len(self.cpus) if self.cpus else (os.cpu_count() or 1)
        self._last = self._read()

    def _read(self):
        times = os.times()
        return _cpu_times(self.cpus), times.user + times.system, time.monotonic()

    def busy(self) -> float | None:
        """CPUs other work kept busy since the previous call (or since the probe was made); None where the
        machine does not say (no ``/proc/stat``) or no time has passed."""
        (then, own_then, t_then), now = self._last, self._read()
        self._last = now
        machine, own, t = now
        if then is None or machine is None or t <= t_then:
            return None
        busy_j, total_j = machine[0] - then[0], machine[1] - then[1]
        if total_j <= 0:
            return None
        machine_cpus = self.count * busy_j / total_j  # busy CPUs of ours, averaged over the interval
        return max(0.0, machine_cpus - (own - own_then) / (t - t_then))


def other_work(probe: LoadProbe | None = None, wait_s: float = 0.2) -> float | None:
    """CPUs other work keeps busy now, measured over ``wait_s`` seconds while this process sleeps."""
    probe = probe or LoadProbe()
    time.sleep(wait_s)
    return probe.busy()


def env_count(value: str | None = None) -> tuple[int | None, str]:
    """``OMP_NUM_THREADS`` as a count (its first entry: OpenMP takes a list per nesting level), capped at
    :data:`MAX_THREADS`; (None, why) when it is unset or not a positive integer."""
    value = (os.environ.get("OMP_NUM_THREADS", "") if value is None else value).strip()
    first = value.split(",")[0].strip()
    if not value:
        return None, ""
    if not (first.isascii() and first.isdigit() and int(first) > 0):
        return None, f"OMP_NUM_THREADS={value!r} ignored: not a positive integer"
    return min(int(first), MAX_THREADS), "OMP_NUM_THREADS"


def policy(given: int | None = None, recorded: int | None = None, device: str = "cpu") -> Threads:
    """The thread count by the module's rule (``given``: ``train.threads``; ``recorded``: a resumed run's). A
    launcher's ``OMP_NUM_THREADS`` caps a recorded count: its share of the cores wins over bit-exactness."""
    if given:
        return Threads(min(given, MAX_THREADS), "train.threads")
    env, why = env_count()
    if recorded:
        if env is not None and env < recorded:
            return Threads(env, f"OMP_NUM_THREADS, below the {recorded} the run recorded (not a bit-exact resume)")
        return Threads(recorded, "the count the run recorded (a resume is bit-exact only at it)")
    if env is not None:
        return Threads(env, why)
    if device != "cpu":
        return Threads(torch.get_num_threads(), f"torch's default (the device, {device}, computes)")
    usable = usable_cpus()
    busy = other_work()
    note = f"; {why}" if why else ""
    if busy is None:
        return Threads(usable, f"{usable} usable CPUs (their load is unknown here){note}")
    count = choose(usable, busy)
    return Threads(count, f"{usable} usable CPUs, {busy:.1f} kept busy by other work{note}", adaptive=True)


class Adapter:
    """Re-checks an adaptive count every :data:`CHECK_S` seconds during a run (:meth:`check`, called once a
    step): when other work starts or stops, the count follows (:func:`choose`)."""

    def __init__(self, threads: Threads, clock=time.monotonic, probe: LoadProbe | None = None):
        self.threads, self.clock = threads, clock
        self.usable = usable_cpus()
        self.probe = probe or (LoadProbe() if threads.adaptive else None)
        self.next_check = clock() + CHECK_S

    @property
    def count(self) -> int:
        return self.threads.count

    def check(self) -> Threads | None:
        """The new choice if the count changed (and is applied), else None."""
        if self.probe is None or self.clock() < self.next_check:
            return None
        self.next_check = self.clock() + CHECK_S
        busy = self.probe.busy()
        if busy is None:
            return None
        count = choose(self.usable, busy)
        if count == self.threads.count:
            return None
        self.threads = Threads(count, f"{self.usable} usable CPUs, {busy:.1f} kept busy by other work", True)
        torch.set_num_threads(count)
        return self.threads
