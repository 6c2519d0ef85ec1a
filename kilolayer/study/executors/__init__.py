"""Where a study's points and a search's trials train: one registry of executors, chosen by ``--executor``.

- ``local`` (default): this machine. A unit runs in this process, or with ``--jobs K`` K at once, each point in
  a ``kilolayer train`` process of its own forked from a fork server (:mod:`.local`, :mod:`.forked`).
- ``ray``: one Ray task per unit, on one machine or a cluster (:mod:`.cluster`).

Each gives a pool with one interface: ``slots`` (units at once), ``in_process`` (whether a unit may take this
process's objects, or gets picklable arguments), ``submit(key, fn, *args)``, ``wait()`` -> [(key, result)],
``busy`` and ``cancel()``. The study (:mod:`kilolayer.study.runner`, :mod:`kilolayer.study.ray_executor`) and
the search (:func:`kilolayer.study.search.pool.race`) schedule their units on it, so no result depends on which
executor ran them. :func:`from_args` reads and checks the options, which ``kilolayer study`` and ``kilolayer
search`` declare with the same function (:func:`kilolayer.study.cli.add_executor_options`, whose ``--threads``
is ``kilolayer train``'s).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from kilolayer.errors import ConfigError, KilolayerError
from kilolayer.registry import Registry


@dataclass(frozen=True)
class Kind:
    """A registered executor: its name and the options that belong to it alone."""

    name: str
    options: tuple[str, ...]


EXECUTORS: Registry[Kind] = Registry("--executor", "executor")
EXECUTORS.add("local", Kind("local", ("jobs",)))
EXECUTORS.add("ray", Kind("ray", ("address", "cpus_per_run", "gpus_per_run", "nproc_per_run")))

#: what each command trains as one unit, and whether it can train one in several processes (torchrun)
UNITS = {"study": ("point", True), "search": ("trial", False)}


def flag(option: str) -> str:
    return "--" + option.replace("_", "-")


@dataclass(frozen=True)
class Executor:
    """An executor and its options as the command line gave them, checked (:func:`from_args`)."""

    name: str = "local"
    jobs: int = 1
    threads: int | str | None = None  # train.threads of every unit's run (a count or auto); None: the default
    address: str | None = None
    cpus_per_run: float | None = None
    gpus_per_run: float | None = None
    nproc_per_run: int | None = None

    @property
    def nproc(self) -> int:
        return self.nproc_per_run or 1

    @property
    def cpus(self) -> float:
        """CPUs a Ray unit reserves (default: one per process)."""
        return self.cpus_per_run if self.cpus_per_run is not None else self.nproc

    @property
    def gpus(self) -> float:
        return self.gpus_per_run or 0

    @property
    def unit_threads(self) -> int | None:
        """The torch threads each unit's run trains at where this executor fixes them: a count given with
        ``--threads``, else on Ray the CPUs a unit reserves; None where the thread policy's default count decides,
        as it does for this process too (``auto`` follows the load: no count to match)."""
        if isinstance(self.threads, int):
            return self.threads
        if self.name == "ray" and self.threads is None:
            return max(1, int(self.cpus))
        return None

    @contextlib.contextmanager
    def pool(self, out: Path):
        """The pool that runs units for a study or search in ``out`` (for Ray: a directory every node sees)."""
        if self.name == "ray":
            from kilolayer.study.executors.cluster import session

            with session(self.address, Path(out).resolve(), self.cpus, self.gpus) as pool:
                yield pool
            return
        from kilolayer.study.executors.local import LocalPool

        pool = LocalPool(self.jobs)
        try:
            yield pool
        finally:
            pool.close()


def run_queue(pool, queue, unit) -> None:
    """Run ``unit(point)`` on ``pool`` for every point of ``queue`` (:class:`~kilolayer.study.spec.Queue`): each
    free slot takes the first point whose dependencies have ended, until every point has ended. On any exception
    (Ctrl-C, a unit's own) the units still out are cancelled before it is raised."""
    try:
        while len(queue) or pool.busy:
            for p in queue.take(max(0, pool.slots - pool.busy)):
                pool.submit(p.key, unit, p)
            if not pool.busy:  # points left whose dependencies can never end (expand orders groups: a bug)
                raise KilolayerError(f"{len(queue)} point(s) wait for points that are not in the study")
            for key, _ in pool.wait():
                queue.end(key)
    except BaseException:
        pool.cancel()
        raise


def from_args(args, command: str) -> Executor:
    """The executor ``kilolayer COMMAND`` was given (``study`` or ``search``), its options checked: an unknown
    executor, an option of another executor, or a value out of range is one line, before anything is written.
    For Ray, whether it is installed and ``--address`` answers are checked too."""
    kind = EXECUTORS.get(args.executor)
    unit, multiprocess = UNITS[command]
    given = {o: getattr(args, o, None) for k in EXECUTORS.values() for o in k.options}
    given = {o: v for o, v in given.items() if v is not None}
    foreign = [o for o in given if o not in kind.options]
    if "jobs" in foreign:
        raise ConfigError(
            f"--jobs: only with --executor local; Ray runs as many {unit}s at once as the cluster's CPUs and GPUs "
            "allow (size each with --cpus-per-run and --gpus-per-run)"
        )
    if foreign:
        owners = sorted({k.name for k in EXECUTORS.values() for o in foreign if o in k.options})
        raise ConfigError(f"{', '.join(map(flag, foreign))}: only with --executor {' or '.join(owners)}")
    if "nproc_per_run" in given and not multiprocess:
        raise ConfigError(f"--nproc-per-run: kilolayer {command} trains each {unit} in one process")
    jobs = given.get("jobs", 1)
    if jobs < 1:
        raise ConfigError(f"--jobs={jobs}: expected an integer >= 1")
    if jobs > 1 and command == "search":
        raise ConfigError(
            f"--jobs={jobs}: kilolayer search trains its trials one at a time on this machine (in this process, "
            "which judges each evaluation); --executor ray trains a rung's trials at once"
        )
    if given.get("nproc_per_run", 1) < 1:
        raise ConfigError(f"--nproc-per-run={args.nproc_per_run}: expected an integer >= 1")
    if not given.get("cpus_per_run", 1) >= 1:
        raise ConfigError(f"--cpus-per-run={args.cpus_per_run:g}: expected a number >= 1")
    if not given.get("gpus_per_run", 0) >= 0:
        raise ConfigError(f"--gpus-per-run={args.gpus_per_run:g}: expected a number >= 0")
    if "address" in given and not args.address.strip():
        raise ConfigError("--address: empty; give auto, HOST:PORT, or leave it out to start Ray on this machine")
    threads = getattr(args, "threads", None)
    if threads is not None:
        from kilolayer.config import load_config

        threads = load_config(None, [f"train.threads={threads}"]).train.threads  # kilolayer train's own check
    executor = Executor(kind.name, threads=threads, **given)
    if executor.name == "ray":
        from kilolayer.study.executors.cluster import preflight

        preflight(executor.address)  # Ray missing, a bad --address: one line before --out is touched
    return executor
