"""Run a study's points as Ray tasks, on one machine or a cluster (``kilolayer study ... --executor ray``), on
the Ray executor's pool (:mod:`kilolayer.study.executors.cluster`, the same as a search's trials use).

Each point is one Ray task that runs the same ``kilolayer train CONFIG --out RUN --resume --quiet`` as the
local executor (under ``torchrun --standalone --nproc-per-node N`` with ``nproc``), on whichever node Ray
places it, with the CPUs and GPUs asked for. A point waits only for what it needs: the point it is
initialised from (``init_from``), and every point of its ``after`` group when that is another group. A
completed point's analyses run as a task of their own, on the node that trained it when it has room. The
driver schedules, shows progress and at the end reads the run directories back with the same
:func:`~kilolayer.study.runner.collect_all` as the local executor, so nothing in the report depends on the
executor.

``--out`` must be one shared file system, mounted at the same path on every node: the driver writes a token
there and every node that could run a point must read it back before the grid starts.

Faults: a task whose training process or worker dies is retried (Ray's retries, at most
:data:`~kilolayer.study.executors.cluster.MAX_RETRIES`) and resumes from the run's newest intact checkpoint;
Ctrl-C on the driver cancels every task (each training process saves a checkpoint and records
``interrupted``); re-running skips finished points and resumes the rest.

Ray is imported here only when this executor runs; ``import kilolayer`` never imports it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from kilolayer.errors import ConfigError
from kilolayer.rundir import FINISHED, STATUSES, RunDir
from kilolayer.study.analyses import analysis_current, record_failure
from kilolayer.study.executors import Executor
from kilolayer.study.executors.cluster import Lost, RayPool, not_shared, read_token
from kilolayer.study.runner import Result, collect_all, run_analyses, stale_init, study_precision, train_point
from kilolayer.study.spec import Point, Queue, StudySpec, expand
from kilolayer.train import host

LOCK_WAIT_S = 300  # a retried point waits this long for the previous attempt's process to save and exit


class TrainingProcessDied(RuntimeError):
    """A point's training process was killed (no final status of its own) or interrupted by a signal it did
    not get from us: Ray retries the task, which resumes the run from its newest checkpoint."""


# ---------------------------------------------------------------- what runs on the nodes


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _wait_unlocked(run_dir: Path, seconds: float) -> None:
    """A retried task may start while the previous attempt's training process (stopped by SIGTERM when its
    worker died) is still saving: wait for it to release the run's lock."""
    deadline = time.monotonic() + seconds
    while RunDir(run_dir).locked and time.monotonic() < deadline:
        time.sleep(0.5)


def train_task(
    point: Point,
    out: str,
    token_path: str,
    token: str,
    threads: int,
    nproc: int,
    cwd: str,
    train_threads=None,
    precision: host.Precision | None = None,
) -> dict:
    """Task: train one point (skipped if finished). Returns its status, seconds, whether it trained, the node
    and the runner's other lines for the driver to write; raises :class:`TrainingProcessDied` (Ray retries)
    when the training process was killed. ``precision``: what ``auto`` decides, the driver's decision for every
    point of the study."""
    import ray

    context = ray.get_runtime_context()
    node = context.get_node_id()
    if read_token(token_path) != token:
        return {"status": "not_shared", "node": node, "ip": _node_ip()}
    out_dir = Path(out)
    # Ray workers ignore SIGINT, and ray.cancel interrupts a running task by simulating one: take it as
    # KeyboardInterrupt while the task runs, which train_point forwards to the training process
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _wait_unlocked(point.run_dir(out_dir), LOCK_WAIT_S)
        # a point uses the GPUs it reserved, and none without (Ray leaves them all visible then)
        env = {} if context.get_accelerator_ids().get("GPU") else {"CUDA_VISIBLE_DEVICES": ""}
        lines: list[str] = []
        with host.precision_sharing(precision):
            a = train_point(
                point,
                out_dir,
                log=lines.append,
                threads=threads,
                nproc=nproc,
                cwd=Path(cwd) if os.path.isdir(cwd) else None,
                env=env,
                remote=True,
                train_threads=train_threads,
            )
    finally:
        signal.signal(signal.SIGINT, previous)
    if a.trained and a.status not in FINISHED and (a.crashed or a.status == "interrupted"):
        reason = RunDir(point.run_dir(out_dir)).status.get("reason", "")
        raise TrainingProcessDied(f"{point.key}: {a.status} ({reason}); the retry resumes it")
    # what the runner said besides its start and end lines, which the driver writes itself (a run set aside to
    # train again from scratch, a source it waits for)
    routine = (f"[study] train {point.key}", f"[study] {point.key}: {a.status} (")
    said = [line for line in lines if not line.startswith(routine)]
    return {"status": a.status, "seconds": a.seconds, "trained": a.trained, "node": node, "log": said}


def analysis_task(point: Point, out: str, threads: int) -> list[str]:
    """Task: run a finished point's analyses (those not yet on disk), at ``threads`` torch threads. Returns the log
    lines."""
    lines: list[str] = []
    with host.torch_threads(threads):
        run_analyses(point, Path(out), log=lines.append)
    return lines


# ---------------------------------------------------------------- the driver


class Progress:
    """Points done / running / queued / failed on the driver: a rich bar on a terminal, plain lines otherwise
    (one each time a count changes)."""

    def __init__(self, total: int, log=print):
        self.total, self.log = total, log
        self.counts: tuple | None = None
        self.bar = None
        if log is print and sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import (
                Progress as RichProgress,
            )

            self.bar = RichProgress(
                TextColumn("points done"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=total)

    def say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line)
        else:
            self.log(line)

    def update(self, done: int, running: int, queued: int, failed: int) -> None:
        counts = (done, running, queued, failed)
        if counts == self.counts:
            return
        self.counts = counts
        text = f"{running} running, {queued} queued, {failed} failed"
        if self.bar is not None:
            self.bar.update(self.task, completed=done, description=text)
        else:
            self.log(f"[study] {done}/{self.total} points done, {text}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_study_ray(spec: StudySpec, out: Path, executor: Executor, log=print) -> list[Result]:
    """Train every point of ``spec`` as a Ray task on ``executor``'s cluster (see the module docstring), run
    analyses, return the results read back from ``out`` exactly as :func:`kilolayer.study.runner.run_study`
    does."""
    points = expand(spec)  # a bad spec is one line before any cluster is touched
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with executor.pool(out) as pool:
        log(
            f"[study] {pool.cluster}; {len(points)} points, each {executor.cpus:g} CPU, {executor.gpus:g} GPU, "
            f"{executor.nproc} process(es)"
        )
        ran = _Driver(pool, spec, points, out.resolve(), executor, log).run()
    return collect_all(points, out, ran)


def _shared_precision(points: list[Point], root: Path, threads: int) -> host.Precision | None:
    """``auto`` decided here, at each training process's thread count, once for every point
    (:func:`kilolayer.study.runner.study_precision`)."""
    with host.torch_threads(threads):
        return study_precision(points, root)


class _Driver:
    """Submits each point when its dependencies are done and its analyses when it completed, books what
    comes back, shows progress; on any exit but success, cancels what is still out."""

    def __init__(self, pool: RayPool, spec, points, root, executor: Executor, log):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.pool, self.root, self.nproc, self.train_threads = pool, root, executor.nproc, executor.threads
        self.affinity = NodeAffinitySchedulingStrategy
        self.threads = max(1, int(executor.cpus) // executor.nproc)  # torch threads per training process
        self.precision = _shared_precision(points, root, self.threads)
        self.points = points
        self.by_key = {p.key: p for p in points}
        self.cwd = os.getcwd()  # relative paths in configs mean what they mean to the driver
        self.queue = Queue(spec, points)  # its ``ended``: trained and analysed, or given up
        self.failed: set[str] = set()
        self.ran: set[str] = set()
        self.log = log
        self.progress = Progress(len(points), log)

    def run(self) -> set[str]:
        pool = self.pool
        try:
            self.submit_ready()
            while len(self.queue) or pool.busy:
                self.show()
                if not pool.busy:
                    break  # waiting points whose dependencies can never end: cannot happen (expand orders groups)
                for (kind, key), value in pool.wait(timeout=1.0):
                    if kind == "train":
                        self.trained(self.by_key[key], value)
                    else:
                        self.analysed(key, value)
                self.submit_ready()
            self.show()
        except BaseException:
            # Ctrl-C, or a refusal: cancel every task; each forwards the interrupt to its training process,
            # which saves a checkpoint and records ``interrupted``
            if pool.busy:
                self.progress.say(f"[study] cancelling {pool.busy} task(s); re-run the same command to resume")
                pool.cancel()
            raise
        finally:
            self.progress.close()
        self.log(
            f"[study] {len(self.points)} points: {len(self.points) - len(self.failed)} finished "
            f"({len(self.ran - self.failed)} trained now), {len(self.failed)} failed"
        )
        return self.ran

    def analyses_missing(self, p: Point) -> bool:
        run_dir = p.run_dir(self.root)
        return RunDir(run_dir).state == "completed" and any(
            not analysis_current(a, run_dir, p.analysis_data) for a in p.analyses
        )

    def submit_ready(self) -> None:
        while ready := self.queue.take():  # a point found finished may free the points that wait for it
            for p in ready:
                self.submit(p)

    def submit(self, p: Point) -> None:
        # a point started from another checkpoint of its source than the chosen one: its task retrains it
        finished = RunDir(p.run_dir(self.root)).finished and stale_init(p, self.root) is None
        if finished and not self.analyses_missing(p):
            self.queue.end(p.key)  # a finished point: no task at all
        elif finished:
            self.analyse(p)
        else:
            pool = self.pool
            args = (p, str(self.root), str(pool.token_path), pool.token, self.threads, self.nproc, self.cwd)
            pool.submit(
                ("train", p.key),
                train_task,
                *args,
                self.train_threads,
                self.precision,
                retry_exceptions=[TrainingProcessDied],
            )

    def analyse(self, p: Point, node: str | None = None) -> None:
        options = {"num_gpus": 0}
        if node is not None:
            options["scheduling_strategy"] = self.affinity(node, soft=True)
        self.pool.submit(("analyse", p.key), analysis_task, p, str(self.root), self.threads, **options)

    def show(self) -> None:
        # a training task runs once its process has written the run's status (Ray does not say when a queued
        # task starts); an analysis task counts as running
        running = sum(
            1
            for (kind, key), since in self.pool.submitted.items()
            if kind == "analyse" or since <= RunDir(self.by_key[key].run_dir(self.root)).status_time
        )
        queued = len(self.queue) + self.pool.busy - running
        self.progress.update(len(self.queue.ended) - len(self.failed), running, queued, len(self.failed))

    def trained(self, p: Point, value) -> None:
        """Book one training task; submit the point's analyses next to its data."""
        if isinstance(value, dict) and value["status"] == "not_shared":
            raise ConfigError(not_shared(self.root, value["ip"], self.pool.token_path))
        self.ran.add(p.key)
        if isinstance(value, Lost):
            # Ray gave up (retries spent): record it unless the training process said why itself
            said = tuple(s for s in STATUSES if s != "running")  # a final status of the process's own
            RunDir(p.run_dir(self.root)).mark_failed(f"Ray task: {value.reason}", keep=said)
            self.failed.add(p.key)
            self.queue.end(p.key)
            self.progress.say(f"[study] {p.key}: failed ({value.reason})")
            return
        for line in value.get("log", ()):
            self.progress.say(line)
        if not value["trained"]:
            self.ran.discard(p.key)
        else:
            self.progress.say(f"[study] {p.key}: {value['status']} ({value['seconds']:.0f}s)")
        if value["status"] not in FINISHED:
            self.failed.add(p.key)
            self.queue.end(p.key)
        elif self.analyses_missing(p):
            self.analyse(p, node=value["node"])
        else:
            self.queue.end(p.key)

    def analysed(self, key: str, value) -> None:
        lines = value
        if isinstance(value, Lost):  # the task itself was lost: each analysis it left undone failed for that reason
            p = self.by_key[key]
            run_dir = p.run_dir(self.root)
            lines = [
                f"[study] {name} of {key} failed: {record_failure(name, run_dir, f'Ray task: {value.reason}')}"
                for name in p.analyses
                if not analysis_current(name, run_dir, p.analysis_data)
            ]
        for line in lines:
            self.progress.say(line)
        self.queue.end(key)
