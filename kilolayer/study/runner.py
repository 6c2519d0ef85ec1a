"""Run a study: every point is a ``kilolayer train`` process of its own, K at a time (locally forked from a
process that has imported kilolayer once: :mod:`kilolayer.study.executors.forked`).

Finished points (completed or diverged: both are results) are skipped on a
re-run, unless the config a point was launched with differs from its config now
(a changed spec re-run into the same folder): that run is kept beside it as
``<run>.stale-<n>`` and the point trains again from scratch. Failed, interrupted
or unfinished ones are resumed (``--resume``) from their newest intact
checkpoint. The training process records its own status; the runner writes one
only when the process could not (killed, or stopped before it started
training), or when it did not start a point.

A point initialised from another point's run (``init_from``) starts only once
that source point has completed (until then it is recorded ``failed``, with the
reason, and a re-run trains it); one whose recorded start (status.json
``init_from.step``) is no longer the source's chosen checkpoint is trained again
from scratch, its old run directory kept beside it as ``<run>.stale-<n>``.

This module is what a study runs on every executor (:mod:`kilolayer.study.executors`): how one
point is trained (:func:`train_point`), analysed (:func:`run_analyses`) and read back
(:func:`collect_all`), and the study on the local executor's pool (:func:`run_study`);
``kilolayer.study.ray_executor`` runs the same functions as Ray tasks.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kilolayer import rundir
from kilolayer.config import config_changes, dump_yaml, load_config
from kilolayer.errors import KilolayerError
from kilolayer.record import RunRecord
from kilolayer.rundir import RunDir
from kilolayer.study.analyses import analysis_current, record_failure, run_analysis
from kilolayer.study.executors import forked, run_queue
from kilolayer.study.executors.local import LocalPool
from kilolayer.study.spec import Point, Queue, StudySpec, expand
from kilolayer.train import host
from kilolayer.train.host import usable_cpus
from kilolayer.train.run import SPEED_OPTIONS, recorded_precision, shared_precision, trained_as_asked


@dataclass(kw_only=True)
class Result(RunRecord):
    """What one point produced: the record of its run directory (:class:`kilolayer.record.RunRecord`), with the
    point, the command that trains it and whether this invocation trained it."""

    point: Point
    command: str = ""
    ran: bool = False  # trained in this invocation

    def __post_init__(self):
        if self.config is None:  # judged by the point's config, as it was trained (None: its config.yaml)
            self.config = self.point.config


def train_command(point: Point, out: Path, nproc: int = 1, threads: int | str | None = None) -> list[str]:
    """``python -m kilolayer train CONFIG --out RUN --resume --quiet [--threads N]``; with ``nproc`` > 1 the
    same module under ``torchrun --standalone --nproc-per-node nproc`` (standalone: a free rendezvous port, so
    several points can share a node)."""
    cfg = out / "configs" / point.group / f"{point.name}.yaml"
    train = ["kilolayer", "train", str(cfg), "--out", str(point.run_dir(out)), "--resume", "--quiet"]
    if threads is not None:
        train += ["--threads", str(threads)]
    if nproc > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            *train,
        ]
    return [sys.executable, "-m", *train]


def shell_command(point: Point, out: Path, threads: int | str | None = None) -> str:
    """The command as a user would type it (to rerun a point by hand, or send it to a cluster). A point that asks
    for ``auto`` and has trained names the precision its run recorded: the study decided it once for the runs it
    compares, and a run started by hand elsewhere would decide for itself."""
    cmd = ["kilolayer", *train_command(point, out, threads=threads)[3:]]
    auto = point.config is not None and point.config.train.precision == "auto"
    recorded = recorded_precision(point.run_dir(out)) if auto else None
    if recorded is not None:
        cmd += ["--set", f"train.precision={recorded.value}"]
    return shlex.join(cmd)


def source_dir(point: Point, out: Path) -> Path | None:
    """The run directory of the point that ``point`` is initialised from (absolute); None without one."""
    if not point.init_from_point:
        return None
    group, name = point.init_from_point.split("/")
    return (Path(out) / "runs" / group / name).resolve()


def source_not_ready(point: Point, out: Path) -> str | None:
    """Why ``point`` may not start yet: the point it is initialised from has not completed (a partial,
    failed or diverged run's weights are no pretraining). None when it may, or has no source."""
    src = source_dir(point, out)
    if src is None:
        return None
    source = RunDir(src)
    status = source.state
    if status == "completed":
        return None
    what = f"{status} at step {source.step}" if status else "not run"
    return f"not started: its init_from point {point.init_from_point} is {what}; it trains once that one completes"


def stale_init(point: Point, out: Path) -> str | None:
    """Why ``point``'s run must train again from scratch: it started from a checkpoint of its source point
    (status.json ``init_from.step``) other than the one that stands for the source now (e.g. a partial run
    that has since completed). None otherwise, or when the run records no start."""
    src = source_dir(point, out)
    if src is None:
        return None
    used = RunDir(point.run_dir(out)).init_from
    if used is None:
        return None
    from kilolayer.train.init_from import pretrained_checkpoint

    try:
        now = rundir.checkpoint_step(pretrained_checkpoint(src).parent)
    except KilolayerError:
        return None  # the source has no usable checkpoint: training it says so
    if used["step"] == now:
        return None
    return f"it started from step {used['step']} of {point.init_from_point}, whose chosen checkpoint is now step {now}"


def changed_config(point: Point, out: Path) -> str | None:
    """Why ``point``'s finished run is not its result any more: the config it was launched with
    (``OUT/configs/GROUP/NAME.yaml``) differs from the point's now (a study whose spec changed, re-run into
    the same folder). None when they agree, the run has not finished, or no launch config is recorded.
    ``train.init_from`` is left out: where a source run lies is :func:`stale_init`'s question. A changed
    ``train.precision`` counts only where the run trained at another precision than the point asks for here
    (:func:`~kilolayer.train.run.trained_as_asked`); the model's speed options
    (:data:`~kilolayer.train.run.SPEED_OPTIONS`) never do."""
    path = Path(out) / "configs" / point.group / f"{point.name}.yaml"
    if not path.is_file() or not RunDir(point.run_dir(out)).finished:
        return None
    try:
        launched = load_config(path)
    except (KilolayerError, OSError, ValueError):
        return None  # a launch config this version cannot read: nothing to compare
    changes = {k: v for k, v in config_changes(launched, point.config).items() if k != "train.init_from"}
    if "train.precision" in changes and trained_as_asked(point.run_dir(out), point.config):
        del changes["train.precision"]
    for section, key in SPEED_OPTIONS:
        changes.pop(f"{section}.{key}", None)  # a run keeps its own
    if not changes:
        return None
    shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in list(changes.items())[:3])
    more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
    return f"its config changed since it ran ({shown}{more})"


def _set_aside(run_dir: Path) -> Path:
    """Move a run directory to ``<run>.stale-<n>`` (the first free n); nothing in it is lost."""
    n = 1
    while (target := run_dir.with_name(f"{run_dir.name}.stale-{n}")).exists():
        n += 1
    with rundir.RunLock(run_dir):
        run_dir.rename(target)
    return target


def _record_not_started(run_dir: Path, reason: str) -> None:
    """Record ``failed`` with ``reason`` for a point the runner did not start (a re-run tries it again)."""
    RunDir(run_dir).mark_failed(reason)


def _materialise(point: Point, out: Path) -> None:
    cfg = point.config
    src = source_dir(point, out)
    if src is not None:
        cfg = load_config({**cfg.model_dump(), "train": {**cfg.train.model_dump(), "init_from": str(src)}})
        point.config = cfg
    path = out / "configs" / point.group / f"{point.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dump_yaml(cfg)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


# Every training process is started through a tiny exec shim (the PID stays the child's; not preexec_fn,
# which is unsafe in a threaded parent such as a Ray worker or the runner's thread pool). On Linux it has the
# child get SIGTERM when its parent dies, however the parent died (SIGTERM, kill -9): the child saves a
# checkpoint and records ``interrupted`` instead of training on as an orphan that holds the run's lock (the
# next run of the study resumes it). A child of a Ray worker also inherits the worker's blocked signals
# (SIGINT and SIGTERM among them), which would never reach it: the shim unblocks them.
_REMOTE_SHIM = (
    "import ctypes, os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, []); "
    "sys.platform.startswith('linux') and ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or os._exit(143); os.execv(sys.argv[2], sys.argv[2:])"
)


def _wait(proc: subprocess.Popen, forward_interrupt: bool = False) -> int:
    """The child's exit code. On Ctrl-C the child (same process group) got SIGINT too: give it time to save
    a checkpoint and record ``interrupted`` before giving up on it. With ``forward_interrupt`` (a child
    outside the terminal's process group, e.g. under a Ray worker whose task is cancelled) the child is sent
    that SIGINT here, and the wait polls so that the interrupt is seen at all."""
    try:
        if not forward_interrupt:
            return proc.wait()
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
    except KeyboardInterrupt:
        if forward_interrupt and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def _record_crash(run_dir: Path, returncode: int, logfile: Path) -> None:
    """The child ended without a final status of its own (killed, or refused before training started):
    record ``failed`` with its exit code and last log line, unless another training process holds the run."""
    reason = (logfile.read_text().strip().splitlines() or ["no output"])[-1][:300]
    RunDir(run_dir).mark_failed(f"exit code {returncode}: {reason}")


def _record_seconds(run_dir: Path, total: float) -> None:
    """Record ``total``, the run's training time over all its attempts, as status.json ``seconds``, unless
    another process holds the run (its status is its own). A training process carries the field into every
    status it writes (:class:`kilolayer.rundir.Lifecycle`), so a resumed run keeps its earlier attempts' time;
    an attempt whose driver was killed outright records none, so the figure is a lower bound."""
    RunDir(run_dir).record_seconds(total)


@dataclass
class Attempt:
    """One call of :func:`train_point`: the point's status afterwards, and how the training process ended."""

    status: str
    seconds: float
    trained: bool  # a training process ran (False: the point had already finished)
    returncode: int = 0
    crashed: bool = False  # the process left no final status of its own; the runner recorded ``failed``


def train_point(
    point: Point,
    out: Path,
    log=print,
    threads: int | None = None,
    nproc: int = 1,
    cwd: Path | None = None,
    env: dict | None = None,
    remote: bool = False,
    train_threads: int | str | None = None,
) -> Attempt:
    """Train one point unless it already finished, in a subprocess (``nproc`` > 1: under torchrun) with
    ``threads`` torch threads per process (``train_threads``, ``--threads``: the run's train.threads instead)
    and ``env`` added to its environment. ``remote``: the child is not
    in the driver's terminal process group (a Ray worker's child): forward an interrupt to it, and stop it
    when its parent dies. A point initialised from another's run waits for that run to complete, and trains
    again from scratch when it started from another checkpoint of it than the chosen one now."""
    run_dir = point.run_dir(out)
    run = RunDir(run_dir)
    waiting = source_not_ready(point, out)
    stale = (stale_init(point, out) or changed_config(point, out)) if waiting is None else None
    if stale is not None:
        try:
            moved = _set_aside(run_dir)
        except rundir.RunLocked as err:
            log(f"[study] {point.key}: not retrained ({stale}): {err}")
            return Attempt(run.state or "failed", run.seconds, False)
        log(f"[study] {point.key}: training again from scratch: {stale} (the old run is kept as {moved.name})")
    if run.finished:
        return Attempt(run.state, run.seconds, False)
    if waiting is not None:
        _record_not_started(run_dir, waiting)
        log(f"[study] {point.key}: {waiting}")
        return Attempt("failed", 0.0, False)
    earlier = run.seconds  # what earlier attempts at this run took (none: 0)
    _materialise(point, out)
    logfile = out / "logs" / point.group / f"{point.name}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(f"[study] train {point.key}")
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if threads:
        # K concurrent points share the cores instead of each taking them all
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = train_command(point, out, nproc, train_threads)
    launched = time.time()
    with open(logfile, "a") as fh:
        if nproc == 1 and not remote and forked.available():  # no interpreter start-up to pay
            proc = forked.ForkedPoint(cmd[3:], logfile, env, cwd)
        else:
            if os.name == "posix":
                cmd = [sys.executable, "-c", _REMOTE_SHIM, str(os.getpid()), *cmd]
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            returncode = _wait(proc, forward_interrupt=remote)
        except KeyboardInterrupt:  # Ctrl-C, or a cancelled Ray task: the child has stopped and saved its step
            if run.status.get("pid") == proc.pid:
                _record_seconds(run_dir, earlier + time.perf_counter() - t0)
            raise
    seconds = time.perf_counter() - t0
    st = run.status
    # the child's own final status names its PID (under torchrun: rank 0's, so it must at least be newer than
    # the launch); anything else (none, an older one, "running") is stale
    own = st.get("pid") == proc.pid or (nproc > 1 and run.status_time >= launched)
    crashed = returncode != 0 and (not own or st.get("status") == "running")
    if crashed:
        _record_crash(run_dir, returncode, logfile)
    status = run.state or "failed"
    if own or crashed:  # not a child refused because another process holds the run
        _record_seconds(run_dir, earlier + seconds)
    log(f"[study] {point.key}: {status} ({seconds:.0f}s)")
    return Attempt(status, seconds, True, returncode, crashed)


def run_point(
    point: Point, out: Path, log=print, threads: int | None = None, train_threads: int | str | None = None
) -> tuple[str, float, bool]:
    """Train one point unless it already finished. Returns (status, seconds, trained now)."""
    a = train_point(point, out, log, threads, train_threads=train_threads)
    return a.status, a.seconds, a.trained


def run_analyses(point: Point, out: Path, log=print) -> None:
    """The point's analyses on its completed run, each unless its result is current
    (:func:`~kilolayer.study.analyses.analysis_current`). An analysis that raises fails for this point alone: why
    is written beside its result (:func:`~kilolayer.study.analyses.record_failure`) and said in a line."""
    run_dir = point.run_dir(out)
    if RunDir(run_dir).state != "completed":
        return
    for name in point.analyses:
        try:
            if analysis_current(name, run_dir, point.analysis_data):
                continue
            run_analysis(name, run_dir, point.analysis_data)
        except Exception as err:  # any analysis's error, its bugs too: the study's other points and report go on
            log(f"[study] {name} of {point.key} failed: {record_failure(name, run_dir, err)}")
        else:
            log(f"[study] {name} of {point.key}")


def collect(point: Point, out: Path) -> Result:
    """The point's result, read back from its run directory (:meth:`kilolayer.record.RunRecord.read`)."""
    return Result.read(point.run_dir(out), point=point, command=shell_command(point, out))


def threads_per_job(jobs: int) -> int | None:
    """Torch threads for each of ``jobs`` concurrent points (they share the CPUs this process may use); None for
    one job (the point's own thread policy)."""
    return max(1, usable_cpus() // jobs) if jobs > 1 else None


def collect_all(points: list[Point], out: Path, ran: set[str]) -> list[Result]:
    """Every point's result, read back from its run directory (``ran``: the keys trained in this invocation)."""
    results = [collect(p, out) for p in points]
    for r in results:
        r.ran = r.point.key in ran
    return results


def study_precision(points: list[Point], out: Path) -> host.Precision | None:
    """What ``auto`` decides for every point of a study whose runs lie under ``out``, once, on this machine
    (:func:`kilolayer.train.run.shared_precision`); None where no point asks for it."""
    auto = [p for p in points if p.config.train.precision == "auto"]
    return shared_precision([p.config for p in auto], [p.run_dir(out) for p in auto])


def run_study(spec: StudySpec, out: Path, jobs: int = 1, log=print, threads: int | str | None = None) -> list[Result]:
    """Train every point on the local executor, ``jobs`` at a time in the spec's order: a free slot takes the first
    point whose dependencies have ended (its ``init_from`` point, its ``after`` group: :class:`Queue`).
    ``threads``: each run's train.threads, default the CPUs shared among the jobs. Runs the analyses (in this
    process, beside the points still training, at a point's share of the CPUs) and returns the results."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    points = expand(spec)
    share = threads_per_job(jobs)
    ran: set[str] = set()
    lock = threading.Lock()

    def say(line: str) -> None:  # one whole line at a time from the pool's threads
        with lock:
            log(line)

    def one(p: Point) -> None:
        status, _, trained = run_point(p, out, say, threads=share, train_threads=threads)
        if trained:
            ran.add(p.key)
        run_analyses(p, out, say)

    with host.torch_threads(share):
        pool = LocalPool(jobs)
        try:
            # auto decided once, at the runs' thread count, for every point: the points compared share a precision
            with host.precision_sharing(study_precision(points, out)):
                run_queue(pool, Queue(spec, points), one)
        finally:
            pool.close()
    return collect_all(points, out, ran)
