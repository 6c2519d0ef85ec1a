"""The local executor: units of work on this machine.

With one job a unit runs in this process as it is submitted, so it can take this process's own objects (a
search's trial reports each evaluation to the race as it trains). With K jobs, K units run at once in threads of
this process; each must start a process of its own to train (a study's point: ``kilolayer train`` forked from
the fork server, :mod:`kilolayer.study.executors.forked`), so a crash, a kill or a thread count stays with it.
"""

from __future__ import annotations

import concurrent.futures as cf


class LocalPool:
    """``submit(key, fn, *args)`` runs ``fn(*args)`` here (``jobs`` at once); :meth:`wait` gives (key, result) of
    those that ended; an exception a unit raises is raised there. :meth:`cancel` drops the units not started and
    waits for the rest (their training processes got the terminal's Ctrl-C too, and save their step)."""

    in_process = True  # a unit may take this process's objects

    def __init__(self, jobs: int = 1):
        self.slots = jobs
        self._threads = cf.ThreadPoolExecutor(max_workers=jobs) if jobs > 1 else None
        self._futures: dict = {}  # Future -> key
        self._ended: list[tuple] = []  # (key, result) of units run as they were submitted

    @property
    def busy(self) -> int:
        return len(self._futures) + len(self._ended)

    def submit(self, key, fn, *args) -> None:
        if self._threads is None:
            self._ended.append((key, fn(*args)))
        else:
            self._futures[self._threads.submit(fn, *args)] = key

    def wait(self, timeout: float | None = None) -> list[tuple]:
        if self._ended:
            ended, self._ended = self._ended, []
            return ended
        done, _ = cf.wait(list(self._futures), timeout, return_when=cf.FIRST_COMPLETED)
        return [(self._futures.pop(f), f.result()) for f in done]

    def cancel(self) -> None:
        for f in self._futures:
            f.cancel()
        cf.wait(list(self._futures))
        self._futures.clear()
        self._ended.clear()

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown()
