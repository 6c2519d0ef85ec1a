"""How ``kilolayer train`` stops on SIGINT and SIGTERM: at the next step boundary, with a checkpoint."""

from __future__ import annotations

import os
import signal
import threading
import time

from kilolayer.errors import KilolayerError


class Interrupted(KilolayerError):
    """SIGINT or SIGTERM stopped training; the exit code is 128 + the signal number (130, 143)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class StopSignals:
    """SIGINT and SIGTERM: during set-up they stop at once; once the loop runs (``armed``), the first asks it to
    stop at the next step boundary (with a checkpoint) and a second one stops at once. Two kinds of SIGTERM
    repeat the first request rather than make a second: one within :data:`ECHO_S` of it (Linux sends the
    parent-death signal once per exiting thread of the parent), and one that finds the process orphaned since
    (the parent's death, delivered late). Installed only in the main thread (where Python allows it)."""

    #: seconds within which a repeated SIGTERM counts as the same request
    ECHO_S = 2.0

    def __init__(self):
        self.signum = 0
        self.armed = False
        self.first_at = 0.0
        self.parent = os.getppid()
        self._previous: dict = {}

    def install(self) -> StopSignals:
        global _installed
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
            _installed = self
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.armed:
            raise Interrupted(f"interrupted by {name} before training started", signum)
        if self.signum:
            soon = time.monotonic() - self.first_at < self.ECHO_S
            echo = signum == self.signum == signal.SIGTERM and (soon or os.getppid() != self.parent)
            if echo:
                return
            raise Interrupted(f"stopped at once by a second {name}; the newest complete checkpoint is kept", signum)
        self.signum = signum
        self.first_at = time.monotonic()

    def restore(self) -> None:
        global _installed
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        if _installed is self:
            _installed = None


_installed: StopSignals | None = None  # the handlers in place, if training installed them


def stop_requested() -> bool:
    """Whether a SIGINT or SIGTERM has asked the training in this process to stop (for a caller's ``on_eval``
    that waits, and must give way to it)."""
    return _installed is not None and bool(_installed.signum)
