"""The time plan for ``--minutes``: each shape's cost measured on this machine (:func:`measure_costs`), and the
longest trials whose pre-screen and race fit in the minutes (:func:`time_plan`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kilolayer import rundir
from kilolayer.config import Config, load_config
from kilolayer.errors import ConfigError
from kilolayer.study.search.directory import PLAN
from kilolayer.study.search.screen import forecast_steps, starts_from_prescreen
from kilolayer.study.search.settings import Settings, rung_steps
from kilolayer.study.search.shape import Shape, trial_config


@dataclass
class Plan:
    """The trial length chosen to spend ``--minutes`` (``minutes``): ``steps`` (train.steps of every trial;
    evaluations and checkpoints keep their number per trial), from each shape's measured :class:`Cost`
    (``costs``), with the seconds the pre-screen and race are estimated to take (``estimate``) of those left to
    them (``seconds``: the minutes less ``probe_seconds``, what the search had spent when the plan was made:
    finding the shapes and measuring their costs). ``probe_seconds + estimate`` is at most the minutes: a
    search whose shortest plan does not fit is refused (:func:`plan_steps`)."""

    steps: int
    config_steps: int
    seconds: float
    estimate: float
    costs: dict[str, list[float]]
    probe_seconds: float = 0.0
    minutes: float = 0.0

    @property
    def total(self) -> float:
        """Seconds the whole search was estimated to take: what it had spent when planning, and the estimate."""
        return self.probe_seconds + self.estimate

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Cost:
    """Seconds one shape's trial pays here: ``setup`` (data, model and optimizer, paid again by each resume at a
    rung), one training ``step`` and one ``evaluation`` (``train.eval_batches`` batches)."""

    setup: float
    step: float
    evaluation: float


def measure_cost(config: Config) -> Cost:
    """:class:`Cost` of ``config`` on this machine, in memory: the engine built, one warm-up step (lazy
    initialisation), the mean of two steps, one evaluation batch (times train.eval_batches; an untrained model
    decodes to the longest output, so a sequence-to-sequence evaluation is priced high). Writes nothing; the
    global random state is left as it was."""
    import torch

    from kilolayer.doctor.measure import _in_memory
    from kilolayer.train.distributed import Dist
    from kilolayer.train.engine import Engine

    device = "cuda" if config.train.device != "cpu" and torch.cuda.is_available() else "cpu"

    def now() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    with torch.random.fork_rng(devices=[]):
        t0 = now()
        engine = Engine(_in_memory(config), Dist(device=torch.device(device)))
        engine.train_step(1)
        t1 = now()
        for step in (2, 3):
            engine.train_step(step)
        t2 = now()
        engine.evaluate(1)
        t3 = now()
    step = (t2 - t1) / 2
    return Cost(setup=max(0.0, t1 - t0 - step), step=step, evaluation=(t3 - t2) * config.train.eval_batches)


def measure_costs(config: Config, found: list[Shape], measure: Callable[[Config], Cost] | None = None) -> dict:
    """Each shape's :class:`Cost` (``measure``, default :func:`measure_cost`), by name, after one measurement
    thrown away: the first one in a process also pays what is paid once (imports, the data's first batches, the
    thread pool, the allocator's first blocks: set-up 3.3 s and evaluation 28 s against 0.08 s and 3.2 s when
    the same shape is measured again), which would otherwise be charged to the first shape. The warm-up
    measures the shape with the fewest FLOPs per token, the cheapest to measure."""
    measure = measure or measure_cost
    lr = config.train.lr
    measure(trial_config(config, min(found, key=lambda s: s.flops_per_token), lr))
    return {s.name: measure(trial_config(config, s, lr)) for s in found}


def with_steps(config: Config, steps: int) -> Config:
    """``config`` trained for ``steps`` steps, with as many evaluations and checkpoints as it has over its own
    train.steps (the warm-up is kept: it is a property of the optimisation, not of the run's length)."""
    tc = config.train
    if steps == tc.steps:
        return config

    def scaled(every: int) -> int:
        return max(1, round(every * steps / tc.steps)) if every else 0

    train = {**tc.model_dump(), "steps": steps, "eval_every": scaled(tc.eval_every)}
    train["checkpoint_every"] = scaled(tc.checkpoint_every)
    return load_config({**config.model_dump(), "train": train})


# the replay's evaluation loss on 64 samples, about every k // 20 steps: a forward pass, about a third of a step
REPLAY_EVALUATIONS = 20
FORWARD_COST = 1 / 3


def estimate_seconds(config: Config, settings: Settings, costs: list[Cost]) -> float:
    """Seconds the pre-screen and race of shapes that cost ``costs`` should take with ``config``'s train.steps:
    every shape replayed by the pre-screen (set-up, its steps, one step of a DeepNorm twin, the replay's
    evaluations) and trained to the first rung (from the replay's last step when the trials start from it), then
    at each rung the best 1/eta trained to the next, priced as the costliest shapes (which go on is not known
    before). Each leg of a trial pays its set-up, its steps and its evaluations. Each rung that prunes compares
    the last trial kept with the best one pruned, and the top two are compared at the end (:func:`compare_runs`:
    each of the two runs set up and evaluated), priced as the costliest shapes too."""
    tc, eta, every = config.train, settings.reduction_factor, config.train.eval_every
    replayed = forecast_steps(config, settings)
    replay_evals = REPLAY_EVALUATIONS * math.ceil(64 / tc.batch_size) * FORWARD_COST
    total = sum(2 * c.setup + c.step * (replayed + 1 + replay_evals) for c in costs)  # the pre-screen, its twin
    alive, start = len(costs), replayed if starts_from_prescreen(config, settings) else 0
    costliest = sorted(costs, key=lambda c: c.step, reverse=True)

    def compared(n: int) -> float:  # two runs compared: each set up and evaluated
        return sum(c.setup + c.evaluation for c in costliest[:2]) if n >= 2 else 0.0

    for i, end in enumerate([*rung_steps(config, settings), tc.steps]):
        evals = end // every - start // every if every else int(end == tc.steps)
        legs = costs if i == 0 else costliest[:alive]
        total += sum(c.setup + c.step * (end - start) + c.evaluation * evals for c in legs)
        if end < tc.steps:
            total += compared(alive) if max(alive // eta, 1) < alive else 0.0  # the rung's cut, where it prunes
        start, alive = end, max(alive // eta, 1)
    return total + compared(alive)  # the top two, where two complete


def shortest_steps(config: Config) -> int:
    """The shortest trial length a time plan gives: the warm-up plus 10 steps (at most train.steps)."""
    return max(2, min(config.train.steps, config.train.warmup + 10))


class PlanDoesNotFit(ConfigError):
    """Even the shortest trials' pre-screen and race are estimated to take longer than the time left."""

    def __init__(self, steps: int, estimate: float):
        super().__init__(f"the shortest plan (trials of {steps:,} steps) is estimated at {estimate:.0f} s")
        self.steps, self.estimate = steps, estimate


def plan_steps(config: Config, settings: Settings, costs: list[Cost], seconds: float) -> tuple[int, float]:
    """The longest trial length (train.steps, at least :func:`shortest_steps`) whose pre-screen and race
    (:func:`estimate_seconds`) fit in ``seconds``, and that estimate. :class:`PlanDoesNotFit` when even the
    shortest does not: a search that would overrun its minutes, or be stopped before any trial completes, is
    better not started."""
    floor = shortest_steps(config)

    def cost(steps: int) -> float:
        return estimate_seconds(with_steps(config, steps), settings, costs)

    lo, hi = floor, max(floor, 100 * config.train.steps)
    if cost(lo) > seconds:
        raise PlanDoesNotFit(lo, cost(lo))
    while lo < hi:  # the longest that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= seconds else (lo, mid - 1)
    return lo, cost(lo)


def saved_plan(out: Path) -> Plan | None:
    """The :class:`Plan` a run of the search at ``out`` made (``plan.json``), if any."""
    saved = rundir.read_json(out / PLAN, None) if out.is_dir() else None
    return Plan(**saved) if saved else None


def time_plan(
    config: Config, settings: Settings, found: list[Shape], measure=None, started: float | None = None
) -> Plan:
    """The :class:`Plan` for ``--minutes``: each shape's :class:`Cost` measured (:func:`measure_costs`), then
    :func:`plan_steps` on what is left of the minutes, counted from ``started`` (``time.perf_counter()`` when
    the search started; default now). Writes nothing. When even the shortest plan does not fit, one line
    (:class:`~kilolayer.errors.ConfigError`) that says how long it needs."""
    started = time.perf_counter() if started is None else started
    costs = measure_costs(config, found, measure)
    probe = time.perf_counter() - started
    budget = settings.minutes * 60 - probe
    try:
        steps, estimate = plan_steps(config, settings, list(costs.values()), budget)
    except PlanDoesNotFit as err:
        n = len(found)
        narrow = " or narrow --depths" if n > 1 else ""
        raise ConfigError(
            f"--minutes {settings.minutes:g}: the shortest plan needs about {(probe + err.estimate) / 60:.1f} min "
            f"({probe:.0f} s spent finding and measuring the shapes, then the pre-screen and a race of all {n} "
            f"shape{'s' * (n != 1)} with trials of {err.steps:,} steps); give more minutes{narrow}"
        ) from None
    costs_saved = {k: list(asdict(c).values()) for k, c in costs.items()}
    return Plan(steps, config.train.steps, budget, estimate, costs_saved, probe, settings.minutes)
