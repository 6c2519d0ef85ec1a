"""How long a study will take here: time a few steps of each distinct point and extrapolate.

``kilolayer study NAME --estimate [--jobs K]`` builds every distinct grid point (points that differ
only in their seed cost the same) in a scratch directory, with the thread count a ``--jobs K`` run
would give it, and measures its pieces on this machine:

* start-up: none where points fork from the fork server that imported kilolayer once
  (:mod:`kilolayer.study.executors.forked`, Linux); elsewhere a fresh process importing the trainer (measured once);
* set-up: building data, model and optimizer (``Run(...)``);
* one training step: the mean over ``probe_steps`` steps, after two warm-up steps;
* one evaluation, one checkpoint, one stability-diagnostics probe and each analysis.

A point's estimate is start-up + set-up + steps x step + (evaluations, checkpoints, diagnostics)
x their cost + analyses. The study's wall-clock estimate replays the runner's schedule: K slots, each free
slot taking the first point, in the spec's order, whose dependencies have ended. What it cannot see: a run that
diverges stops early, and a machine busy with other work is slower. The probes share one process, so they
run with glibc's default allocator (``train.hold_heap`` off: holding the heap cannot be undone within a
process); a point without activation checkpointing holds it in its real run, which saves the kernel's
page-fault time (about 3% of a step of a 24-layer, width-128 decoder here).
"""

from __future__ import annotations

import heapq
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kilolayer.config import Config, load_config
from kilolayer.errors import ConfigError, KilolayerError
from kilolayer.study.executors import forked
from kilolayer.study.runner import run_analysis, threads_per_job
from kilolayer.study.spec import Point, Queue, StudySpec, expand
from kilolayer.train import host
from kilolayer.train.run import shared_precision


@dataclass
class PointCost:
    """Measured seconds of one point's pieces, and the extrapolated total."""

    setup: float
    step: float
    evaluation: float
    checkpoint: float
    diagnostics: float
    analyses: float
    total: float = 0.0


def _count(steps: int, every: int) -> int:
    """How many times an every-N action fires in a run of ``steps`` (always once at the end)."""
    if steps <= 0:
        return 0
    return steps // every + (steps % every != 0) if every else 1


def diagnostic_steps(cfg: Config) -> int:
    tc = cfg.train
    if not tc.diagnostics_every or tc.steps <= 0:
        return 0
    last = min(tc.steps, tc.diagnostics_until) if tc.diagnostics_until else tc.steps
    return 1 + sum(1 for s in range(2, last + 1) if s % tc.diagnostics_every == 0)


def extrapolate(cfg: Config, cost: PointCost, startup: float) -> float:
    """Seconds a full run of ``cfg`` takes, from its measured pieces."""
    tc = cfg.train
    if tc.untrained:  # an untrained baseline: build, save once, analyse
        return startup + cost.setup + cost.checkpoint + cost.analyses
    return (
        startup
        + cost.setup
        + tc.steps * cost.step
        + _count(tc.steps, tc.eval_every) * cost.evaluation
        + _count(tc.steps, tc.checkpoint_every) * cost.checkpoint
        + diagnostic_steps(cfg) * cost.diagnostics
        + cost.analyses
    )


def _probe_config(cfg: Config, steps: int) -> Config:
    data = cfg.model_dump()
    data["train"].update(
        steps=steps,
        eval_every=0,
        checkpoint_every=0,
        log_every=1,
        init_from=None,
        freeze_backbone=False,
        diagnostics_until=1 if cfg.train.diagnostics_every else 0,
        # probes share this process, and a held heap cannot be let go: every probe measures glibc's default
        hold_heap=False,
    )
    return load_config(data)


def _step_seconds(run_dir: Path, skip: int) -> list[float]:
    from kilolayer.train.logging import read_metrics

    recs = [r for r in read_metrics(run_dir) if r.get("split") == "train" and "tokens_per_s" in r]
    out, prev = [], None
    for r in recs:
        if prev is not None and r["step"] > skip and r["tokens_per_s"] > 0:
            out.append((r["tokens"] - prev) / r["tokens_per_s"])
        prev = r["tokens"]
    return out


def probe(point: Point, probe_steps: int = 5) -> PointCost:
    """Measure one point's pieces (see the module docstring) in a scratch directory."""
    from kilolayer.train.run import Run

    warm = 2  # step 1 pays for lazy initialisation, step 2 for step 1's diagnostics
    untrained = point.config.train.untrained  # only built, saved and analysed
    cfg = _probe_config(point.config, 0 if untrained else warm + probe_steps)
    with tempfile.TemporaryDirectory(prefix="kilolayer-estimate-") as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        run = Run(cfg, run_dir, quiet=True)
        setup = time.perf_counter() - t0
        run.run()  # trains, then evaluates and saves once at the end
        steps = _step_seconds(run_dir, warm)
        step = statistics.fmean(steps) if steps else 0.0  # the mean: a full run pays its hiccups too
        evaluation = 0.0
        if not untrained:
            t0 = time.perf_counter()
            run.evaluate(cfg.train.steps)
            evaluation = time.perf_counter() - t0
        t0 = time.perf_counter()
        run.save(cfg.train.steps + 1)
        checkpoint = time.perf_counter() - t0
        diagnostics = 0.0
        if run.engine.probe_batch is not None:
            t0 = time.perf_counter()
            run.engine.diagnostics(cfg.train.steps, [], [])
            diagnostics = time.perf_counter() - t0
        t0 = time.perf_counter()
        for name in point.analyses:
            try:
                run_analysis(name, run_dir, point.analysis_data)
            except KilolayerError as err:
                raise ConfigError(
                    f"{point.key}: analysis {name} fails on this point's probe ({' '.join(str(err).split())}); "
                    "the study would train the point and then fail the analysis"
                ) from None
        spent = time.perf_counter() - t0
    return PointCost(setup, step, evaluation, checkpoint, diagnostics, spent)


def startup_seconds() -> float:
    """A fresh interpreter importing the trainer: what every study point pays before set-up."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import kilolayer.train.run"], check=True)
    return time.perf_counter() - t0


def _signature(p: Point) -> str:
    """Points equal up to their seed cost the same; the analyses run after training, and the data they read, are
    part of the cost."""
    data = p.config.model_dump()
    data["train"].pop("seed", None)
    data["train"].pop("init_from", None)
    data["analyses"] = {"names": sorted(p.analyses), "data": p.analysis_data}
    return json.dumps(data, sort_keys=True, default=str)


def schedule(queue: Queue, seconds: dict[str, float], jobs: int) -> float:
    """Wall-clock of the local runner's schedule (:func:`~kilolayer.study.executors.run_queue`): ``jobs`` slots,
    each free slot taking the first point of ``queue`` whose dependencies have ended; a point takes
    ``seconds[key]``. Points that end at the same time end together, as the pool reports them."""
    now, running, started = 0.0, [], itertools.count()  # running: (end time, start order, key)
    while len(queue) or running:
        for p in queue.take(max(0, jobs - len(running))):
            heapq.heappush(running, (now + seconds[p.key], next(started), p.key))
        if not running:
            raise KilolayerError(f"{len(queue)} point(s) wait for points that are not in the study")
        now = running[0][0]
        while running and running[0][0] == now:
            queue.end(heapq.heappop(running)[2])
    return now


def estimate(spec: StudySpec, jobs: int = 1, probe_steps: int = 5, log: Callable[[str], None] = print) -> dict:
    """Probe every distinct point of ``spec`` and return per-point and total estimates (seconds)."""
    points = expand(spec)
    threads = threads_per_job(jobs) or torch.get_num_threads()
    auto = [p.config for p in points if p.config.train.precision == "auto"]
    with host.torch_threads(threads):
        precision = shared_precision(auto)  # as the study decides it for all its points, at their thread count
        distinct = len({_signature(p) for p in points})
        log(
            f"[estimate] {distinct} distinct point(s) to probe (seeds of a point cost the same), each timed over "
            f"{probe_steps} steps after 2 warm-up steps, with {threads} thread(s)"
            + (f"; train.precision auto: {precision.value} ({precision.reason})" if precision else "")
        )
        startup = 0.0 if forked.available() else startup_seconds()
        costs: dict[str, PointCost] = {}
        for p in points:
            sig = _signature(p)
            if sig in costs:
                continue
            # set-up (data, tokenizer, model) can take minutes before the first step: say what is being probed
            log(f"[estimate] probing {p.key} ({len(costs) + 1}/{distinct}) ...")
            t0 = time.perf_counter()
            with host.precision_sharing(precision):
                c = probe(p, probe_steps)
            c.total = extrapolate(p.config, c, startup)
            costs[sig] = c
            rate = f"{c.step * 1000:.0f} ms/step" if c.step else "no training"
            log(f"[estimate] {p.key}: {rate}, {c.total / 60:.1f} min (probed in {time.perf_counter() - t0:.0f}s)")
    per_point = {p.key: costs[_signature(p)].total for p in points}
    groups = [[per_point[p.key] for p in points if p.group == g.name] for g in spec.groups]
    return {
        "study": spec.name,
        "jobs": jobs,
        "threads_per_point": threads,
        "probe_steps": probe_steps,
        "startup_seconds": startup,
        "points": {p.key: {"seconds": per_point[p.key], **asdict(costs[_signature(p)])} for p in points},
        "groups": {g.name: sum(c) for g, c in zip(spec.groups, groups)},
        "compute_seconds": sum(per_point.values()),
        "wall_seconds": schedule(Queue(spec, points), per_point, max(1, jobs)),
    }
