"""The Ray executor: units of work as Ray tasks, on one machine or a cluster (``--executor ray``).

A study's points and a search's trials both run here through :func:`session` (Ray found, the cluster joined,
``--out`` checked to be one file system that every node sees) and :class:`RayPool` (tasks submitted with the
CPUs and GPUs they reserve, their results taken as they finish, all cancelled on Ctrl-C). What a task does is the
caller's: :mod:`kilolayer.study.ray_executor` (a point) and :mod:`kilolayer.study.search` (a trial).

Without ``--address`` the Ray this process starts stays on 127.0.0.1, and no Ray this process touches sends
usage statistics. Ray is imported only when this executor runs; ``import kilolayer`` never imports it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from kilolayer.errors import ConfigError

INSTALL_HINT = "pip install 'kilolayer[ray]'"
MAX_RETRIES = 3  # per task, for a dead worker, node or training process (Ray's own retries)
CHECK_TIMEOUT_S = 300  # for every node to read the shared-storage token back (includes starting workers)
CANCEL_WAIT_S = 90  # after Ctrl-C, for the cancelled tasks' training processes to save and exit
PROBE_TIMEOUT_S = 10  # for --address HOST:PORT to accept a TCP connection (Ray's own connect retries for minutes)


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
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR}  # task output lives in the units' logs
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


def read_token(path: str) -> str | None:
    """Task: the token the driver wrote, as this node sees it (None if it cannot read it)."""
    try:
        return Path(path).read_text()
    except OSError:
        return None


def check_shared(ray, out: Path, cpus: float, gpus: float) -> tuple[Path, str]:
    """Write a token under ``out`` and have every node that can run a unit read it back; one line if any
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


def error_line(err) -> str:
    """One line of an error: its last (a Ray error's is the exception itself, after the traceback)."""
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return (lines[-1].strip() if lines else err.__class__.__name__)[:300]


@dataclass
class Lost:
    """A unit Ray gave up on (its retries spent): the error's line."""

    reason: str


class RayPool:
    """Units of work as Ray tasks: ``submit(key, fn, *args)`` runs ``fn(*args)`` as a task that reserves
    ``cpus`` and ``gpus`` (Ray retries it :data:`MAX_RETRIES` times if its worker dies); :meth:`wait` gives
    (key, result) of those that ended, a :class:`Lost` where Ray gave up; :meth:`cancel` stops the rest."""

    in_process = False  # a unit runs in a Ray worker: it gets picklable arguments, not this process's objects

    def __init__(self, ray, cpus: float, gpus: float, token_path: Path, token: str):
        self.ray, self.cpus, self.gpus = ray, cpus, gpus
        self.token_path, self.token = token_path, token
        res = ray.cluster_resources()
        self.cluster = f"Ray: {len(ray.nodes())} node(s), {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU"
        slots = int(res.get("CPU", 0) // cpus)
        if gpus:
            slots = min(slots, int(res.get("GPU", 0) // gpus))
        self.slots = max(1, slots)  # units that can run at once
        self.threads = max(1, int(cpus))  # torch threads of a unit's process
        self.pending: dict = {}  # ObjectRef -> key
        self.submitted: dict = {}  # key -> time.time() when submitted
        self._remote: dict = {}

    @property
    def busy(self) -> int:
        return len(self.pending)

    def submit(self, key, fn, *args, **options) -> None:
        """``fn(*args)`` as a task (``options``: Ray's, over the pool's CPUs, GPUs and retries)."""
        if fn not in self._remote:
            self._remote[fn] = self.ray.remote(fn)
        opts = {"num_cpus": self.cpus, "num_gpus": self.gpus, "max_retries": MAX_RETRIES, **options}
        ref = self._remote[fn].options(**opts).remote(*args)
        self.pending[ref] = key
        self.submitted[key] = time.time()

    def wait(self, timeout: float = 1.0) -> list[tuple]:
        """(key, result or :class:`Lost`) of the tasks that ended within ``timeout`` seconds (at most one)."""
        done, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        ended = []
        for ref in done:
            key = self.pending.pop(ref)
            self.submitted.pop(key, None)
            try:
                ended.append((key, self.ray.get(ref)))
            except self.ray.exceptions.RayError as err:
                ended.append((key, Lost(error_line(err))))
        return ended

    def cancel(self) -> None:
        """Cancel every task still out: each is interrupted (a training process saves a checkpoint and records
        ``interrupted``); those still running after :data:`CANCEL_WAIT_S` have their workers killed."""
        refs = list(self.pending)
        for ref in refs:
            self.ray.cancel(ref)
        _, left = self.ray.wait(refs, num_returns=len(refs), timeout=CANCEL_WAIT_S)
        for ref in left:
            self.ray.cancel(ref, force=True)  # kills the worker; its training process gets SIGTERM
        self.pending.clear()


@contextlib.contextmanager
def session(address: str | None, out: Path, cpus: float, gpus: float):
    """A :class:`RayPool` on the cluster at ``address`` (None: a Ray started here, on loopback), once every node
    that could run a unit has shown that it sees ``out``; Ray is shut down on the way out."""
    ray = preflight(address)
    connect(ray, address)
    token_path = None
    try:
        token_path, token = check_shared(ray, out, cpus, gpus)
        yield RayPool(ray, cpus, gpus, token_path, token)
    finally:
        if token_path is not None:
            token_path.unlink(missing_ok=True)
        ray.shutdown()
