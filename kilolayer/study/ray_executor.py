"""Run a study's points as Ray tasks, on one machine or a cluster (``kilolayer study ... --executor ray``).

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

Faults: a task whose training process or worker dies is retried (at most ``MAX_RETRIES`` times) and resumes
from the run's newest intact checkpoint; Ctrl-C on the driver cancels every task (each training process
saves a checkpoint and records ``interrupted``); re-running skips finished points and resumes the rest.

Ray is imported here only when this executor runs; ``import kilolayer`` never imports it.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from kilolayer.errors import ConfigError
from kilolayer.rundir import FINISHED, STATUSES, RunDir, analysis_file
from kilolayer.study.runner import Result, collect_all, run_analyses, stale_init, train_point
from kilolayer.study.spec import Point, StudySpec, expand

INSTALL_HINT = "pip install 'kilolayer[ray]'"
MAX_RETRIES = 3  # per task, for a dead worker, node or training process (Ray's own retries)
LOCK_WAIT_S = 300  # a retried point waits this long for the previous attempt's process to save and exit
CHECK_TIMEOUT_S = 300  # for every node to read the shared-storage token back (includes starting workers)
CANCEL_WAIT_S = 90  # after Ctrl-C, for the cancelled tasks' training processes to save and exit
PROBE_TIMEOUT_S = 10  # for --address HOST:PORT to accept a TCP connection (Ray's own connect retries for minutes)


class TrainingProcessDied(RuntimeError):
    """A point's training process was killed (no final status of its own) or interrupted by a signal it did
    not get from us: Ray retries the task, which resumes the run from its newest checkpoint."""


def import_ray(address: str | None = None):
    """The ``ray`` module, or one line naming the extra that installs it. Without ``address`` the Ray this
    process starts stays on loopback; no Ray this process touches sends usage statistics."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if address is None or is_loopback(address):
        # read when ray is imported: without it Ray swaps 127.0.0.1 for the machine's network address, both
        # for a Ray it starts and for the address it joins
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--executor ray: Ray is not installed; install it with {INSTALL_HINT}") from None
    return ray


def is_loopback(address: str) -> bool:
    """Whether ``address`` (``HOST:PORT``, ``ray://HOST:PORT``) names this machine's loopback interface."""
    import ipaddress

    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def preflight(address: str | None):
    """What can be refused before anything is written: Ray missing (one line naming the extra), and an
    ``--address`` that is malformed or where nothing accepts connections (checked here in seconds: Ray's
    own connect retries for minutes, deaf to Ctrl-C). Returns the ``ray`` module."""
    ray = import_ray(address)
    if address is not None:
        check_address(address)
    return ray


def check_address(address: str) -> None:
    """One line unless ``address`` is ``auto`` or a ``[ray://]HOST:PORT`` that accepts a TCP connection."""
    import socket

    if address.strip() == "auto":
        return
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"--address {address}: expected auto or HOST:PORT (the head's address that `ray start --head` "
            f"prints, port 6379 by default), or leave it out to start Ray on this machine"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as err:
        why = f"no answer within {PROBE_TIMEOUT_S}s" if isinstance(err, TimeoutError) else err.strerror or str(err)
        raise ConfigError(
            f"--address {address}: nothing accepts connections at {host}:{port} ({why}); is Ray running "
            f"there (ray start --head --port {port}), and is the address the one it printed?"
        ) from None


def connect(ray, address: str | None) -> None:
    """Join the cluster at ``address`` (``auto``, ``HOST:PORT``), or start a Ray instance on this machine, on
    127.0.0.1 only, when it is None."""
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR}  # task output lives in the points' logs
    try:
        if address is None:
            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as err:
        first = (str(err).strip().splitlines() or [err.__class__.__name__])[0]
        where = f"--address {address}" if address else "a local Ray instance"
        raise ConfigError(
            f"{where}: cannot connect to Ray ({first}); is it running, and if it uses token "
            f"authentication, is RAY_AUTH_MODE=token set here (with its token)?"
        ) from None


# ---------------------------------------------------------------- what runs on the nodes


def read_token(path: str) -> str | None:
    """Task: the token the driver wrote, as this node sees it (None if it cannot read it)."""
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _wait_unlocked(run_dir: Path, seconds: float) -> None:
    """A retried task may start while the previous attempt's training process (stopped by SIGTERM when its
    worker died) is still saving: wait for it to release the run's lock."""
    deadline = time.monotonic() + seconds
    while RunDir(run_dir).locked and time.monotonic() < deadline:
        time.sleep(0.5)


def train_task(point: Point, out: str, token_path: str, token: str, threads: int, nproc: int, cwd: str) -> dict:
    """Task: train one point (skipped if finished). Returns its status, seconds, whether it trained, the node
    and the runner's other lines for the driver to write; raises :class:`TrainingProcessDied` (Ray retries)
    when the training process was killed."""
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
        a = train_point(
            point,
            out_dir,
            log=lines.append,
            threads=threads,
            nproc=nproc,
            cwd=Path(cwd) if os.path.isdir(cwd) else None,
            env=env,
            remote=True,
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
    """Task: run a finished point's analyses (those not yet on disk). Returns the log lines."""
    import torch

    torch.set_num_threads(threads)
    lines: list[str] = []
    run_analyses(point, Path(out), log=lines.append)
    return lines


# ---------------------------------------------------------------- the driver


def check_shared(ray, out: Path, cpus: float, gpus: float) -> tuple[Path, str]:
    """Write a token under ``out`` and have every node that can run a point read it back; one line if any
    cannot. Returns (token path, token); the caller removes the file."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [
        n
        for n in ray.nodes()
        if n.get("Alive") and n["Resources"].get("CPU", 0) >= cpus and n["Resources"].get("GPU", 0) >= gpus
    ]
    if not nodes:
        have = ", ".join(
            f"{n['NodeManagerAddress']}: {n['Resources'].get('CPU', 0):g} CPU, {n['Resources'].get('GPU', 0):g} GPU"
            for n in ray.nodes()
            if n.get("Alive")
        )
        raise ConfigError(
            f"no Ray node has what one point asks for (--cpus-per-run {cpus:g}, --gpus-per-run "
            f"{gpus:g}); the nodes have {have or 'nothing'}"
        )
    token = secrets.token_hex(16)
    path = out / f".shared-check-{token[:12]}"
    path.write_text(token)
    reader = ray.remote(read_token)
    refs = [
        reader.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            str(path)
        )
        for n in nodes
    ]
    try:
        seen = ray.get(refs, timeout=CHECK_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        path.unlink(missing_ok=True)
        raise ConfigError(
            f"--out {out}: the Ray nodes did not report within {CHECK_TIMEOUT_S}s whether they see it "
            f"(is the cluster busy or its workers failing to start?)"
        ) from None
    for node, got in zip(nodes, seen):
        if got != token:
            path.unlink(missing_ok=True)
            raise ConfigError(not_shared(out, node["NodeManagerAddress"], path))
    return path, token


def not_shared(out: Path, ip: str, path: Path) -> str:
    return (
        f"--out {out} is not on a shared file system: a Ray task on node {ip} cannot read {path}, which "
        f"the driver wrote; give --out a directory that every node mounts at the same path"
    )


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


def _dependencies(spec: StudySpec, points: list[Point]) -> dict[str, set[str]]:
    """Which points each point waits for: its ``init_from`` point, and all of its ``after`` group when that
    is not the group it is initialised from (then the one source point is enough)."""
    groups = {g.name: g for g in spec.groups}
    members: dict[str, list[str]] = {}
    for p in points:
        members.setdefault(p.group, []).append(p.key)
    deps = {}
    for p in points:
        g = groups[p.group]
        need = {p.init_from_point} if p.init_from_point else set()
        if g.after is not None and g.after != g.init_from:
            need |= set(members.get(g.after, []))
        deps[p.key] = need
    return deps


def run_study_ray(
    spec: StudySpec,
    out: Path,
    address: str | None = None,
    cpus_per_run: float = 1,
    gpus_per_run: float = 0,
    nproc_per_run: int = 1,
    log=print,
) -> list[Result]:
    """Train every point of ``spec`` as a Ray task (see the module docstring), run analyses, return the
    results read back from ``out`` exactly as :func:`kilolayer.study.runner.run_study` does."""
    points = expand(spec)  # a bad spec is one line before any cluster is touched
    ray = preflight(address)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    root = out.resolve()  # tasks run elsewhere: they get the absolute path
    connect(ray, address)
    token_path = None
    try:
        token_path, token = check_shared(ray, root, cpus_per_run, gpus_per_run)
        res = ray.cluster_resources()
        log(
            f"[study] Ray: {len(ray.nodes())} node(s), {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU; "
            f"{len(points)} points, each {cpus_per_run:g} CPU, {gpus_per_run:g} GPU, {nproc_per_run} process(es)"
        )
        driver = _Driver(ray, spec, points, root, token_path, token, cpus_per_run, gpus_per_run, nproc_per_run, log)
        ran = driver.run()
    finally:
        if token_path is not None:
            token_path.unlink(missing_ok=True)
        ray.shutdown()
    return collect_all(points, out, ran)


class _Driver:
    """Submits each point when its dependencies are done and its analyses when it completed, books what
    comes back, shows progress; on any exit but success, cancels what is still out."""

    def __init__(self, ray, spec, points, root, token_path, token, cpus, gpus, nproc, log):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.ray, self.root, self.token_path, self.token, self.nproc = ray, root, token_path, token, nproc
        self.affinity = NodeAffinitySchedulingStrategy
        self.threads = max(1, int(cpus) // nproc)  # torch threads per training process
        self.trainer = ray.remote(train_task).options(
            num_cpus=cpus, num_gpus=gpus, max_retries=MAX_RETRIES, retry_exceptions=[TrainingProcessDied]
        )
        self.analyser = ray.remote(analysis_task)
        self.analysis_options = {"num_cpus": cpus, "max_retries": MAX_RETRIES}
        self.points = points
        self.by_key = {p.key: p for p in points}
        self.deps = _dependencies(spec, points)
        self.cwd = os.getcwd()  # relative paths in configs mean what they mean to the driver
        self.waiting = [p.key for p in points]
        self.pending: dict = {}  # ObjectRef -> ("train" | "analyse", key)
        self.submitted: dict = {}  # ObjectRef -> time.time() when submitted
        self.ended: set[str] = set()  # trained and analysed, or given up
        self.failed: set[str] = set()
        self.ran: set[str] = set()
        self.log = log
        self.progress = Progress(len(points), log)

    def run(self) -> set[str]:
        ray = self.ray
        try:
            self.submit_ready()
            while self.waiting or self.pending:
                self.show()
                if not self.pending:
                    break  # waiting points whose dependencies can never end: cannot happen (expand orders groups)
                done, _ = ray.wait(list(self.pending), num_returns=1, timeout=1.0)
                for ref in done:
                    kind, key = self.pending.pop(ref)
                    self.submitted.pop(ref)
                    try:
                        value = ray.get(ref)
                    except ray.exceptions.RayError as err:
                        value = err
                    if kind == "train":
                        self.trained(self.by_key[key], value)
                    else:
                        self.analysed(key, value)
                self.submit_ready()
            self.show()
        except BaseException:
            # Ctrl-C, or a refusal: cancel every task; each forwards the interrupt to its training process,
            # which saves a checkpoint and records ``interrupted``
            if self.pending:
                self.progress.say(f"[study] cancelling {len(self.pending)} task(s); re-run the same command to resume")
                for ref in self.pending:
                    ray.cancel(ref)
                _, left = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=CANCEL_WAIT_S)
                for ref in left:
                    ray.cancel(ref, force=True)  # kills the worker; its training process gets SIGTERM
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
        return RunDir(run_dir).state == "completed" and any(not analysis_file(run_dir, a).exists() for a in p.analyses)

    def submit_ready(self) -> None:
        while True:  # a point found finished may free the points that wait for it
            ready = [k for k in self.waiting if self.deps[k] <= self.ended]
            if not ready:
                return
            for key in ready:
                self.waiting.remove(key)
                self.submit(self.by_key[key])

    def submit(self, p: Point) -> None:
        # a point started from another checkpoint of its source than the chosen one: its task retrains it
        finished = RunDir(p.run_dir(self.root)).finished and stale_init(p, self.root) is None
        if finished and not self.analyses_missing(p):
            self.ended.add(p.key)  # a finished point: no task at all
        elif finished:
            self.analyse(p)
        else:
            ref = self.trainer.remote(
                p, str(self.root), str(self.token_path), self.token, self.threads, self.nproc, self.cwd
            )
            self.pending[ref] = ("train", p.key)
            self.submitted[ref] = time.time()

    def analyse(self, p: Point, node: str | None = None) -> None:
        options = dict(self.analysis_options)
        if node is not None:
            options["scheduling_strategy"] = self.affinity(node, soft=True)
        ref = self.analyser.options(**options).remote(p, str(self.root), self.threads)
        self.pending[ref] = ("analyse", p.key)
        self.submitted[ref] = time.time()

    def show(self) -> None:
        # a training task runs once its process has written the run's status (Ray does not say when a queued
        # task starts); an analysis task counts as running
        running = sum(
            1
            for ref, (kind, key) in self.pending.items()
            if kind == "analyse" or self.submitted[ref] <= RunDir(self.by_key[key].run_dir(self.root)).status_time
        )
        queued = len(self.waiting) + len(self.pending) - running
        self.progress.update(len(self.ended) - len(self.failed), running, queued, len(self.failed))

    def trained(self, p: Point, value) -> None:
        """Book one training task; submit the point's analyses next to its data."""
        if isinstance(value, dict) and value["status"] == "not_shared":
            raise ConfigError(not_shared(self.root, value["ip"], self.token_path))
        self.ran.add(p.key)
        if isinstance(value, BaseException):
            # Ray gave up (retries spent): record it unless the training process said why itself
            said = tuple(s for s in STATUSES if s != "running")  # a final status of the process's own
            RunDir(p.run_dir(self.root)).mark_failed(f"Ray task: {_error_line(value)}", keep=said)
            self.failed.add(p.key)
            self.ended.add(p.key)
            self.progress.say(f"[study] {p.key}: failed ({_error_line(value)})")
            return
        for line in value.get("log", ()):
            self.progress.say(line)
        if not value["trained"]:
            self.ran.discard(p.key)
        else:
            self.progress.say(f"[study] {p.key}: {value['status']} ({value['seconds']:.0f}s)")
        if value["status"] not in FINISHED:
            self.failed.add(p.key)
            self.ended.add(p.key)
        elif self.analyses_missing(p):
            self.analyse(p, node=value["node"])
        else:
            self.ended.add(p.key)

    def analysed(self, key: str, value) -> None:
        lines = value if isinstance(value, list) else [f"[study] analyses of {key} failed: {_error_line(value)}"]
        for line in lines:
            self.progress.say(line)
        self.ended.add(key)


def _error_line(err) -> str:
    """One line of an error: its last (a Ray error's is the exception itself, after the traceback)."""
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return (lines[-1].strip() if lines else err.__class__.__name__)[:300]
