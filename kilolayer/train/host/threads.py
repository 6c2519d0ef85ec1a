"""How many intra-op threads a training process uses: one count, fixed for the whole run.

Float reductions are ordered by the thread count, so a run's numbers follow its count: the same config, seed,
software and count give the same losses bit for bit. The rule, first match wins:

1. ``train.threads`` / ``--threads``: a count, or ``auto`` (below);
2. a resumed run keeps the count it recorded (a resume is bit-exact only at it), unless a launcher's
   ``OMP_NUM_THREADS`` gives it fewer;
3. ``OMP_NUM_THREADS`` set in the environment (a launcher that shares the cores out, such as a study's
   ``--jobs K`` or ``torchrun``, has decided);
4. on a GPU, torch's default (the device computes; the threads serve data loading);
5. otherwise every usable CPU (:func:`usable_cpus`: this process's affinity, capped by a cgroup CPU quota;
   logical CPUs, so a core's hardware threads each count, where PyTorch's own default counts physical cores):
   the same count for the same command on the same machine, whatever else runs.

``auto`` is the one count that follows the machine's load: the usable CPUs less those other work keeps busy, and
at most an even share of them among the CPU runs at ``auto`` training on this machine on the same CPUs (their
marks, below), re-checked at the first step and then every :data:`CHECK_S` seconds (:class:`Adapter`). Two
``auto`` runs with nothing else computing split the cores evenly, started together or one after the other; a run
at a fixed count beside them is other work, and they share what it leaves (not always evenly). Its losses
depend on when the load changed: such a run says in its first line that it is not bit-reproducible.

OpenMP spins one thread per core, so two processes that each take every core slow each other several-fold
(docs/benchmarks.md, "Runs side by side"). Every CPU training process marks itself while it trains
(:class:`Training`), and a run at the default count (or resumed at its recorded one) that finds another one
training on its CPUs says so in one line with the choice that avoids the slowdown (:func:`crowded`).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from kilolayer.config import MAX_THREADS

#: seconds between two checks of an ``auto`` count
CHECK_S = 1.0
#: the value of ``train.threads`` / ``--threads`` that asks for the load-following count
AUTO = "auto"
#: where each training process on this machine holds a locked file while it trains (shared by its users)
TRAINING_DIR = Path(tempfile.gettempdir()) / "kilolayer-training"

#: how a count was chosen (:attr:`Threads.source`)
GIVEN, RECORDED, ENVIRONMENT, DEVICE, DEFAULT = "given", "recorded", "environment", "device", "default"


@dataclass(frozen=True)
class Threads:
    """A thread count, why it was chosen, and how (``source``: one of the rule's steps, or ``auto``);
    ``adaptive``: the count follows the machine's load, so the run's numbers are not bit-reproducible."""

    count: int
    reason: str
    adaptive: bool = False
    source: str = GIVEN
    recorded: int | None = None  # a resumed run's recorded count this one differs from (not a bit-exact resume)

    def line(self) -> str:
        """The run's first line: the count and why (an ``auto`` count adds that it is not bit-reproducible)."""
        head = f"kilolayer: {self.count} thread{'s' * (self.count != 1)} ({self.reason})"
        if self.adaptive:
            head += "; it follows the machine's load, so the losses are not bit-reproducible (give a count for that)"
        return head


def choose(usable: int, busy: float, following: int = 0) -> int:
    """Threads for a process that may use ``usable`` CPUs while other work keeps ``busy`` of them busy (in CPUs,
    rounded half up): what is left, at least one, and at most an even share among this process and ``following``
    other load-following runs (each would otherwise keep what it took first, however unevenly)."""
    return max(1, min(usable, usable - math.floor(busy + 0.5), usable // (following + 1)))


#: the cgroup file system, and the file that names this process's own cgroup
CGROUP_ROOT, OWN_CGROUP = Path("/sys/fs/cgroup"), Path("/proc/self/cgroup")


def cgroup_quota(root: Path | None = None, own: Path | None = None) -> int | None:
    """The CPUs a cgroup CPU quota allows, rounded up: v2's ``cpu.max``, the smallest along the path from this
    process's own cgroup up to the root (a container's quota may sit on its parent, the pod), else v1's
    ``cpu.cfs_quota_us``/``cpu.cfs_period_us``; None without a quota or where none can be read."""
    root, own = root or CGROUP_ROOT, own or OWN_CGROUP
    places = [root]
    try:
        for line in own.read_text().splitlines():
            if line.startswith("0::"):
                place = root / line[3:].strip().lstrip("/")
                places = [place, *(p for p in place.parents if p == root or root in p.parents)]
    except OSError:
        pass
    quotas, found = [], False
    for place in places:
        try:
            quota, period = (place / "cpu.max").read_text().split()[:2]
            found = True
            if quota != "max":
                quotas.append(max(1, math.ceil(int(quota) / int(period))))
        except (OSError, ValueError, ZeroDivisionError):
            continue
    if found:
        return min(quotas, default=None)
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else max(1, math.ceil(quota / period))
    except (OSError, ValueError, ZeroDivisionError):
        return None


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's intra-op thread count set to ``n`` inside (None: left as it is), restored after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def usable_cpus() -> int:
    """The CPUs this process may run on (affinity; logical CPUs, so each hardware thread of a core counts, where
    PyTorch's own default counts physical cores), capped by a cgroup CPU quota: the default count."""
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


def policy(given: int | str | None = None, recorded: int | None = None, device: str = "cpu") -> Threads:
    """The thread count by the module's rule (``given``: ``train.threads``, a count or ``auto``; ``recorded``: a
    resumed run's). A launcher's ``OMP_NUM_THREADS`` caps a recorded count: its share of the cores wins over
    bit-exactness."""
    if given == AUTO:
        return auto()
    if given:
        return Threads(min(int(given), MAX_THREADS), "train.threads", source=GIVEN)
    env, why = env_count()
    if recorded:
        if env is not None and env < recorded:
            reason = f"OMP_NUM_THREADS, below the {recorded} the run recorded (not a bit-exact resume)"
            return Threads(env, reason, source=ENVIRONMENT, recorded=recorded)
        reason = "the count the run recorded (a resume is bit-exact only at it)"
        usable = usable_cpus()
        if device == "cpu" and recorded > usable:
            reason += f"; more than the {usable} usable CPU{'s' * (usable != 1)} here, which it oversubscribes"
        return Threads(recorded, reason, source=RECORDED)
    if env is not None:
        return Threads(env, why, source=ENVIRONMENT)
    if device != "cpu":
        return Threads(torch.get_num_threads(), f"torch's default (the device, {device}, computes)", source=DEVICE)
    usable = usable_cpus()
    note = f"; {why}" if why else ""
    return Threads(usable, f"every usable CPU: {usable} by affinity and CPU quota{note}", source=DEFAULT)


def auto() -> Threads:
    """``train.threads: auto``: the usable CPUs less those other work keeps busy now (all of them where the load
    cannot be read), at most an even share among the ``auto`` runs training here (:func:`choose`), to be followed
    during the run by an :class:`Adapter`."""
    usable = usable_cpus()
    busy, following = other_work(), len(others_training(following=True))
    if busy is None:
        count = choose(usable, 0.0, following)
        why = f"{AUTO}: {usable} usable CPUs, their load unknown here{_following_words(following)}"
        return Threads(count, why, adaptive=True, source=AUTO)
    return Threads(choose(usable, busy, following), _auto_reason(usable, busy, following), adaptive=True, source=AUTO)


def _auto_reason(usable: int, busy: float, following: int = 0) -> str:
    return f"{AUTO}: {usable} usable CPUs, {busy:.1f} kept busy by other work{_following_words(following)}"


def _following_words(following: int) -> str:
    if not following:
        return ""
    return f", shared with {following} other {AUTO} run{'s' * (following != 1)}"


# ---------------------------------------------------------------- other training processes on this machine


class Training:
    """This process's mark, while it trains, that a kilolayer run computes on this machine: a file in
    :data:`TRAINING_DIR` that it holds an ``flock`` on. The kernel drops the lock with the process, so a killed
    run leaves no live mark. Where the folder cannot be written there is no mark (and no neighbour is seen).
    ``following``: the run's count is ``auto`` (its mark says so: such runs share the cores evenly)."""

    def __init__(self, where: Path | None = None, following: bool = False):
        self.where = where or TRAINING_DIR
        self.following = following
        self.fd: int | None = None
        self.path: Path | None = None

    def __enter__(self) -> Training:
        with contextlib.suppress(OSError):
            self.fd, self.path = _mark(self.where, FOLLOWING if self.following else "")
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(self.fd)
            self.fd = None


#: the tag in the mark of a run whose count is ``auto``
FOLLOWING = ".auto"


def _mark(where: Path, tag: str = "") -> tuple[int, Path]:
    import fcntl

    try:
        where.mkdir()
        os.chmod(where, 0o1777)  # every user's runs mark themselves here; none can remove another's mark
    except FileExistsError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".lock", dir=where)  # a dot file: not yet a mark
    try:
        os.fchmod(fd, 0o644)  # others open it to test the lock
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = where / f"{os.getpid()}-{uuid.uuid4().hex[:8]}{tag}.lock"
        os.rename(tmp, path)  # a mark appears already locked, so no one takes it for a dead run's
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd, path


def others_training(where: Path | None = None, following: bool = False) -> list[int]:
    """The PIDs of the other kilolayer CPU runs training on this machine now (their marks are locked) that may run
    on one of this process's CPUs (a run pinned to other CPUs takes none of ours); if ``following``, only those at
    ``auto``. A dead run's mark is removed on the way."""
    import fcntl

    where = where or TRAINING_DIR
    try:
        marks = sorted(where.glob("[!.]*.lock"))
    except OSError:
        return []
    pids = []
    for path in marks:
        if following and not path.name.endswith(f"{FOLLOWING}.lock"):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            pid = path.name.split("-")[0]
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and pid.isdigit() and int(pid) != os.getpid():
                if _shares_cpus(int(pid)):
                    pids.append(int(pid))
        else:
            with contextlib.suppress(OSError):
                path.unlink()  # its process has ended
        finally:
            os.close(fd)
    return pids


def _shares_cpus(pid: int) -> bool:
    """Whether process ``pid`` may run on one of this process's CPUs (True where either affinity cannot be read)."""
    try:
        return bool(os.sched_getaffinity(pid) & os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return True


def crowded(threads: Threads | None, others: list[int] | None = None, usable: int | None = None) -> str:
    """The line a run at the default count, or resumed at the count it recorded, says when other kilolayer runs
    (``others``, PIDs; default: those :func:`others_training` finds) train on its CPUs too and the cores cannot
    give each its count: which choice avoids the slowdown, and what it costs. "" otherwise."""
    if threads is None or threads.source not in (DEFAULT, RECORDED):
        return ""
    others = others_training() if others is None else others
    if not others:
        return ""
    share = max(1, (usable or usable_cpus()) // (len(others) + 1))
    if threads.count <= share:
        return ""
    who = "another kilolayer run is" if len(others) == 1 else f"{len(others)} other kilolayer runs are"
    pids = ", ".join(str(p) for p in others[:4]) + (", ..." if len(others) > 4 else "")
    slows = f"{who} training on this machine (PID {pids}) and every run at {threads.count} threads slows the others"
    if threads.source == RECORDED:
        return (
            f"{slows}: this resume keeps the {threads.count} threads the run recorded, to stay bit-exact; resume "
            f"with --threads {share} to share the cores instead (its losses then differ in their last bits)"
        )
    return (
        f"{slows}: give --threads {share} (train.threads: {share}) to share the cores and stay bit-reproducible, "
        f"or train.threads: {AUTO} to follow the load (not bit-reproducible)"
    )


# ---------------------------------------------------------------- auto: following the load during a run


class Adapter:
    """Re-checks an ``auto`` count at the first step and then every :data:`CHECK_S` seconds (:meth:`check`, called
    once a step; the first reading covers the run's set-up, when a run started beside it may have begun): when
    other work or another ``auto`` run starts or stops, the count follows (:func:`choose`). Any other count
    stays. ``following``: how many other ``auto`` runs train here now (default: their marks)."""

    def __init__(self, threads: Threads, clock=time.monotonic, probe: LoadProbe | None = None, following=None):
        self.threads, self.clock = threads, clock
        self.usable = usable_cpus()
        self.probe = probe or (LoadProbe() if threads.adaptive else None)
        self.following = following or (lambda: len(others_training(following=True)))
        self.next_check = clock()

    @property
    def count(self) -> int:
        return self.threads.count

    def check(self) -> Threads | None:
        """The new choice if the count changed (and is applied), else None."""
        if self.probe is None or self.clock() < self.next_check:
            return None
        self.next_check = self.clock() + CHECK_S
        busy, following = self.probe.busy(), self.following()
        if busy is None:  # the load unread (too short an interval, or no /proc/stat): only the share may lower it
            count = min(self.threads.count, choose(self.usable, 0.0, following))
            why = f"{AUTO}: {self.usable} usable CPUs, their load unknown here{_following_words(following)}"
        else:
            count = choose(self.usable, busy, following)
            why = _auto_reason(self.usable, busy, following)
        if count == self.threads.count:
            return None
        self.threads = Threads(count, why, adaptive=True, source=AUTO)
        torch.set_num_threads(count)
        return self.threads
