"""Training processes forked from one that has imported kilolayer once.

Each local study point trains in a process of its own, so a crash, a kill or a process-wide setting (the held
heap, the thread count) stays with its point. A fresh interpreter pays for importing torch and kilolayer
every time; a point instead starts as a fork of multiprocessing's fork server, which imports them once.
What a fresh process guarantees still holds: the point has its own PID, log, environment, working directory
and exit code (``kilolayer train``'s); it gets SIGTERM when the fork server dies, and the fork server exits
when the driver dies, however it died, so no point trains on as an orphan; Ctrl-C reaches it through the
terminal's process group (the fork server itself ignores it). What a library reads once when it loads (glibc's
``MALLOC_*`` settings, OpenMP's ``OMP_PROC_BIND``) comes from the driver's environment, where the fork server
started; the point's own environment is in place before ``kilolayer`` runs.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from multiprocessing import forkserver
from pathlib import Path

#: what the fork server imports once, for every point it forks (by name: the command line sits above the study);
#: torch._dynamo because a run's memory check builds its model on the meta device, whose first init op imports it
#: (about 2 CPU-seconds a point)
PRELOAD = ["kilolayer.cli", "torch._dynamo"]


def available() -> bool:
    """Forking from a fork server with the parent-death signal (Linux), from a driver that is kilolayer's own
    command: multiprocessing prepares each forked process by importing the driver's main script again, which
    a user's script may not survive (an unguarded call of the runner would run again in every point)."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    script = Path(getattr(main, "__file__", "") or "").name
    return sys.platform.startswith("linux") and (spec_name == "kilolayer.__main__" or script == "kilolayer")


def _point(argv: list[str], env: dict, logfile: str, cwd: str | None, server: int) -> None:
    """The forked point: die with the fork server, write to the point's log, then run ``kilolayer ARGV`` as
    ``python -m kilolayer ARGV`` would (its exit code is the point's)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != server:  # the fork server died before the line above took effect
        os._exit(143)
    # the fork server exits when the driver's end of its "alive" pipe closes; a point holding a copy would keep
    # it (and so the point) alive past the driver's death
    alive = forkserver._forkserver._forkserver_alive_fd
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    fd = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = ["kilolayer", *argv]
    runpy.run_module("kilolayer", run_name="__main__", alter_sys=True)  # what `python -m kilolayer ARGV` runs


class ForkedPoint:
    """``kilolayer ARGV`` forked from the fork server, with the part of :class:`subprocess.Popen`'s interface that
    the study runner uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``)."""

    def __init__(self, argv: list[str], logfile: Path, env: dict, cwd: Path | None = None):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        forkserver.ensure_running()
        server = forkserver._forkserver._forkserver_pid
        args = (list(argv), dict(env), str(logfile), str(cwd) if cwd is not None else None, server)
        self._process = context.Process(target=_point, args=args, name="kilolayer-point")
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"kilolayer point {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self._process.kill()
