"""``kilolayer search``: the best depth and width for a config's objective at a parameter budget.

Bamboo's advice as a tool: a Transformer's best shape depends on its training objective, so search it per
objective instead of inheriting 12 x 768. From the user's config (objective, data, training settings):

1. :func:`shapes`: one shape per depth in a range, at the width, heads and FFN closest to the parameter budget
   (:func:`closest_shape`), each with its deviation from it and its FLOPs per token; with ``--minutes``, the
   trials' length planned to spend them (:func:`time_plan`);
2. :func:`prescreen`: each shape forecast by the doctor (:func:`kilolayer.doctor.forecast`); those forecast to
   diverge, or to stall while another shape is forecast clearly better, are dropped with its reason, unless
   kept on purpose. The forecast's replay of the shape's first steps ends below the first rung
   (:func:`forecast_steps`) and is saved, and the shape's trial at the config's lr starts from it
   (:meth:`_Racer.start`): the race does not train those steps again;
3. :func:`run_search`: the rest raced by successive halving judged synchronously over the fixed set of
   planned trials (:class:`_Racer`): every trial still in the race trains to a rung and pauses there with a
   checkpoint; once all of them have reached it (or diverged, failed, or finished early), the best
   max(n // eta, 1) go on and the rest are pruned (:func:`promote`, the arithmetic of Optuna's
   SuccessiveHalvingPruner; ties go by shape name, never by trial order), so the recommendation does not depend
   on the order of the shapes. The rungs are the first rung times eta^i (:func:`rung_steps`). Optionally the
   learning rate is searched jointly (log-uniform around the config's, drawn up front by Optuna's TPE sampler).
   The trials, their reported evaluations and states live in Optuna's storage; the rung decisions are recorded
   in the study. Each trial is an ordinary run directory trained by :func:`kilolayer.train.run.train`, which
   reports every evaluation; a pruned trial stays at its rung's checkpoint (status ``interrupted``: resumable,
   and diagnosable by ``kilolayer doctor``). :func:`race` runs a rung's trials on an executor's pool
   (:mod:`kilolayer.study.executors`, the study's): one after another in this process (local), or at once as
   Ray tasks (:func:`trial_task`), with the same leaderboard.

The search lives in its directory: ``search.json`` (its settings), ``prescreen.json`` (the forecasts),
``starts/`` (the replays the trials start from, until they do), ``optuna.journal`` (Optuna's journal storage:
every trial, its state and reported values) and ``trials/``. A re-run continues it: finished trials are read
back, a trial left running by an interruption continues from its newest checkpoint, and the rest start. One
search at a time writes a directory (``search.lock``).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from kilolayer import rundir
from kilolayer.config import Config, ModelConfig, load_config
from kilolayer.errors import ConfigError, DivergedError, KilolayerError
from kilolayer.nn.budget import count_parameters, training_flops
from kilolayer.study.executors import Executor
from kilolayer.train.policies import early_stop_mode

SETTINGS = "search.json"
PRESCREEN = "prescreen.json"
JOURNAL = "optuna.journal"
LOCK = "search.lock"
TRIALS = "trials"
CHOICE = "choice.json"  # the config files the search wrote (name: sha256), the only ones it replaces
PLAN = "plan.json"  # the trial length --minutes chose, kept for re-runs
STARTS = "starts"  # the pre-screen's replays saved as checkpoints, one folder per trial config (its hash)
DROPPED = ("diverges", "stalls")  # forecast verdicts the pre-screen drops


# ---------------------------------------------------------------- the shapes


@dataclass(frozen=True)
class Shape:
    """One parameter-matched model: its name (``LAYERSxWIDTH``), config, parameters, training FLOPs per token, and
    its parameters' deviation from the budget (``parameters / budget - 1``)."""

    name: str
    model: ModelConfig
    parameters: int
    flops_per_token: float
    deviation: float = 0.0

    @property
    def layers(self) -> int:
        return self.model.layers

    @property
    def head_size(self) -> int:
        return self.model.width // self.model.heads

    def step_flops(self, batch_size: int) -> float:
        """Model FLOPs of one training step at the model's full length (:func:`kilolayer.nn.budget.training_flops`)."""
        return training_flops(self.model) * batch_size


def shape_name(model: ModelConfig) -> str:
    if model.arch == "encoder_decoder":
        return f"{model.layers}+{model.decoder_layers}x{model.width}"
    return f"{model.layers}x{model.width}"


MAX_WIDTH = 8192


def default_depths(model: ModelConfig) -> tuple[int, int]:
    """The depth range without ``--depths``: half to twice the config's depth."""
    return max(1, model.layers // 2), 2 * model.layers


def _shaped(m: ModelConfig, layers: int, heads: int, head_size: int, ffn: int) -> ModelConfig:
    data = m.model_dump()
    data.update(layers=layers, width=heads * head_size, heads=heads, ffn=max(1, ffn))
    if m.arch == "encoder_decoder":  # the config's decoder-to-encoder ratio
        data["decoder_layers"] = max(1, round(layers * m.decoder_layers / m.layers))
    return ModelConfig.model_validate(data)


def _head_sizes(m: ModelConfig) -> range:
    """Half to twice the config's head size, in steps of an eighth of it."""
    head = m.width // m.heads
    step = max(1, head // 8)
    return range(max(step, head // 2 // step * step), 2 * head + 1, step)


def narrowest(m: ModelConfig, layers: int) -> ModelConfig:
    """The smallest model :func:`closest_shape` considers at ``layers``: one head of the smallest head size, half
    the FFN ratio."""
    q = _head_sizes(m)[0]
    return _shaped(m, layers, 1, q, max(1, round(m.ffn / m.width * q) // 2))


def closest_shape(m: ModelConfig, layers: int, params: int, tolerance: float) -> ModelConfig:
    """The model like ``m`` at ``layers`` whose width, heads and FFN bring it closest to ``params``: of the shapes
    within ``tolerance``, the one least changed from the config's head size and FFN ratio (the sum of the two
    factors' |ln|), then the smallest deviation; with none within ``tolerance``, the closest one. Head sizes range
    over half to twice the config's (in steps of an eighth of it) and widths are heads x head size; the FFN is
    the config's ratio, or, where that does not come within ``tolerance``, the size that comes closest (half to
    twice the ratio's)."""
    head = m.width // m.heads
    ratio = m.ffn / m.width
    best = None

    def count(h: int, q: int, ffn: int | None = None) -> int:
        return count_parameters(_shaped(m, layers, h, q, round(ratio * h * q) if ffn is None else ffn))

    for q in _head_sizes(m):
        lo, hi = 1, max(1, MAX_WIDTH // q)
        while lo < hi:  # the fewest heads at or over the budget: parameters grow with width
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if count(mid, q) < params else (lo, mid)
        for h in {max(1, lo - 1), lo}:
            held = round(ratio * h * q)
            sizes = [held]
            base, more = count(h, q, held), count(h, q, held + 1)
            if abs(base - params) > tolerance * params and more > base:  # parameters are linear in the FFN size
                fitted = held + round((params - base) / (more - base))
                sizes.append(min(max(fitted, max(1, held // 2)), 2 * held))
            for ffn in sizes:
                c = _shaped(m, layers, h, q, ffn)
                dev = abs(count_parameters(c) - params) / params
                change = abs(math.log(q / head)) + abs(math.log(max(1, ffn) / max(1, held)))
                key = (0, change, dev) if dev <= tolerance else (1, dev, change)
                if best is None or key < best[0]:
                    best = (key, c)
    return best[1]


def shapes(config: Config, params: int, depths: tuple[int, int] | None = None, tolerance: float = 0.03) -> list[Shape]:
    """One shape like ``config.model`` per depth in ``depths`` = (A, B) inclusive (default
    :func:`default_depths`), at the width, heads and FFN closest to ``params`` parameters
    (:func:`closest_shape`), shallowest first; each with its deviation from ``params``, which may exceed
    ``tolerance`` where no shape at that depth comes within it. The depths from the first whose
    :func:`narrowest` model exceeds ``params`` by more than ``tolerance`` on are left out (deeper is larger)."""
    from kilolayer.nn.budget import budget

    lo, hi = depths or default_depths(config.model)
    out = []
    for layers in range(lo, hi + 1):
        if count_parameters(narrowest(config.model, layers)) > params * (1 + tolerance):
            break
        c = closest_shape(config.model, layers, params, tolerance)
        n = count_parameters(c)
        out.append(Shape(shape_name(c), c, n, budget(c).flops_per_token, n / params - 1))
    return out


def parse_depths(text: str) -> tuple[int, int]:
    """``A..B`` (inclusive, 1 <= A <= B) for ``--depths``."""
    a, sep, b = text.partition("..")
    try:
        lo, hi = int(a), int(b)
    except ValueError:
        lo = hi = 0
    if not sep or not 1 <= lo <= hi:
        raise ConfigError(f"--depths {text!r}: expected A..B with 1 <= A <= B, e.g. 2..24")
    return lo, hi


def trial_config(config: Config, shape: Shape, lr: float) -> Config:
    """``config`` with the shape's model and learning rate ``lr``."""
    data = config.model_dump()
    data["model"] = shape.model.model_dump()
    data["train"] = {**data["train"], "lr": lr}
    return load_config(data)


# ---------------------------------------------------------------- the pre-screen


@dataclass
class Screen:
    """The doctor's forecast of one shape, and whether the search races it."""

    shape: str
    verdict: str  # trains | stalls | diverges
    reason: str
    kept: bool
    seconds: float = 0.0
    score: float | None = None  # the forecast's evaluation loss at train.steps (projected), in units of chance
    steps: int = 0  # the training steps the forecast replayed (with the DeepNorm twin's)
    note: str = ""  # why a stall was raced anyway


STALL_MARGIN = 0.1  # a stall is dropped only if another shape is forecast at least this much (x chance) lower


def doctor_forecast(config: Config, steps: int | None = None, save_to: Path | None = None) -> tuple[str, str, dict]:
    """(verdict, reason, {"score", "steps", "start"}) of :func:`kilolayer.doctor.forecast` for ``config``:
    ``score`` the evaluation loss it projects for train.steps (else its last), in units of chance; ``steps``
    replayed (the DeepNorm twin's too). With ``save_to``, the replay's state after its last step is saved there
    as a checkpoint of that step (``start``: the step; 0 when the replay stopped early), for
    :meth:`_Racer.start` to begin the trial of ``config`` from."""
    from kilolayer.doctor.forecast import forecast

    f = forecast(config, steps=steps, keep_state=save_to is not None)
    n, m = f.numbers, f.measurements
    level = n.get("chance")
    loss = n.get("projected", n.get("eval_loss_last"))
    score = max(loss, 0.0) / level if level and loss is not None and math.isfinite(loss / level) else None
    start = 0
    if f.state is not None:
        from kilolayer.train.checkpoint import save_checkpoint

        st = f.state
        start = int(st["state"]["step"])
        save_checkpoint(save_to, start, st["model"], st["optimizer"], st["rng"], st["state"], st["extra"], keep=1)
    ran = int(m.get("steps_run", 0) or 0) + int(m.get("steps_twin", 0) or 0)
    return f.verdict, f.reason, {"score": score, "steps": ran, "start": start}


def forecast_steps(config: Config, settings: Settings) -> int:
    """The steps the pre-screen replays: ``--forecast-steps``, else the doctor's default
    (:func:`kilolayer.doctor.forecast.auto_steps`) capped below the first rung, so that the replay is the first
    steps of the shape's trial at the config's lr (:func:`starts_from_prescreen`), which the race then continues
    instead of training them again."""
    from kilolayer.doctor.forecast import auto_steps

    if settings.forecast_steps is not None:
        return settings.forecast_steps
    return max(1, min(auto_steps(config), first_rung(config, settings) - 1))


def starts_from_prescreen(config: Config, settings: Settings) -> bool:
    """Whether the pre-screen's replays are saved for the trials to start from: when they end before the first
    rung (a trial is judged there on an evaluation of its own), and without early stopping (it tracks every
    evaluation, and the replay makes none of the run's)."""
    return config.train.patience == 0 and forecast_steps(config, settings) < first_rung(config, settings)


def _key(config: Config) -> str:
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


def _clearly_better(other: Screen, me: Screen) -> bool:
    if other.verdict == "diverges":
        return False
    if other.score is not None and me.score is not None:
        return other.score <= me.score - STALL_MARGIN
    return other.verdict == "trains"


def prescreen(
    config: Config,
    found: list[Shape],
    out: Path,
    keep_all: bool = False,
    forecaster: Callable[[Config], tuple] | None = None,
    log=print,
) -> list[Screen]:
    """Each shape's forecast (``forecaster``, default :func:`doctor_forecast`), read from ``prescreen.json`` when
    that config's forecast is saved there. A shape forecast to diverge is not raced; one forecast to stall only
    when another shape is forecast clearly better (its projected loss at least :data:`STALL_MARGIN` x chance
    lower, or, without numbers, forecast to train): a stall verdict depends on the step budget, and when every
    shape is forecast near chance it says nothing about which is best. ``keep_all`` races every shape."""
    forecaster = forecaster or doctor_forecast
    saved = rundir.read_json(out / PRESCREEN, {}) or {}
    screens = []
    for s in found:
        cfg = trial_config(config, s, config.train.lr)
        key = _key(cfg)
        entry = saved.get(s.name)
        if not entry or entry.get("key") != key:
            t0 = time.perf_counter()
            verdict, reason, *extra = forecaster(cfg)
            extra = extra[0] if extra else {}
            entry = {
                "key": key,
                "verdict": verdict,
                "reason": reason,
                "seconds": time.perf_counter() - t0,
                "score": extra.get("score"),
                "steps": extra.get("steps", 0),
                "start": extra.get("start", 0),
            }
            saved[s.name] = entry
            rundir.write_json(out / PRESCREEN, saved)
            log(f"[search] forecast {s.name}: {verdict} — {reason}")
        screens.append(
            Screen(
                s.name,
                entry["verdict"],
                entry["reason"],
                True,
                entry.get("seconds", 0.0),
                entry.get("score"),
                int(entry.get("steps") or 0),
            )
        )
    for sc in screens:
        if keep_all or sc.verdict not in DROPPED:
            continue
        if sc.verdict == "diverges":
            sc.kept = False
        elif any(_clearly_better(o, sc) for o in screens if o is not sc):
            sc.kept = False
        else:
            sc.note = "raced: no other shape is forecast clearly better"
    for s, sc in zip(found, screens):  # a shape not raced needs no start
        if not sc.kept:
            shutil.rmtree(out / STARTS / _key(trial_config(config, s, config.train.lr)), ignore_errors=True)
    return screens


# ---------------------------------------------------------------- the settings


@dataclass
class Settings:
    """What a search is (recorded in ``search.json``; a re-run must agree) and how much it may spend (may change
    between runs: a larger budget continues the search)."""

    params: int
    depths: tuple[int, int] | None = None
    tolerance: float = 0.03
    metric: str = ""  # default: the config's train.early_stop_metric
    lr_factor: float | None = None  # search the lr log-uniformly in [lr / f, lr * f]; None: the config's lr
    trials: int | None = None  # with lr_factor: how many (default 2 per shape)
    reduction_factor: int = 3
    min_steps: int | None = None  # the first rung (default train.steps / eta^2 on the evaluation grid)
    keep_forecast_failures: bool = False
    forecast_steps: int | None = None
    budget_steps: int | None = None  # optimizer steps over all trials
    minutes: float | None = None  # training time over all trials

    SPENDING = ("budget_steps", "minutes")

    def identity(self, config: Config) -> dict:
        kept = {k: v for k, v in self.__dict__.items() if k not in self.SPENDING}
        return json.loads(json.dumps({"config": config.model_dump(mode="json"), **kept}))


def check_settings(config: Config, settings: Settings) -> Config:
    """One line for a setting that cannot work; returns the config the trials train with (evaluations on, and
    ``train.precision: auto`` unless the config names a precision)."""
    if "precision" not in config.train.model_fields_set:
        config = load_config({**config.model_dump(), "train": {**config.train.model_dump(), "precision": "auto"}})
    tc = config.train
    if settings.params < 1:
        raise ConfigError(f"--params {settings.params}: expected a positive count")
    if not 0 < settings.tolerance < 1:
        raise ConfigError(f"--tolerance {settings.tolerance}: expected a fraction between 0 and 1, e.g. 0.03")
    if settings.reduction_factor < 2:
        raise ConfigError(f"--reduction-factor {settings.reduction_factor}: expected an integer >= 2")
    if settings.lr_factor is not None and not settings.lr_factor > 1:
        raise ConfigError(f"--search-lr {settings.lr_factor}: expected a factor > 1 (the lr ranges over lr/F..lr*F)")
    if settings.trials is not None and settings.lr_factor is None:
        raise ConfigError("--trials: only with --search-lr (without it, each shape is one trial)")
    if settings.trials is not None and settings.trials < 1:
        raise ConfigError(f"--trials {settings.trials}: expected an integer >= 1")
    if settings.budget_steps is not None and settings.budget_steps < 1:
        raise ConfigError(f"--budget-steps {settings.budget_steps}: expected an integer >= 1")
    if settings.minutes is not None and not settings.minutes > 0:
        raise ConfigError(f"--minutes {settings.minutes}: expected a positive number")
    if tc.steps < 2:
        raise ConfigError(f"train.steps={tc.steps}: a search races trials over their steps; give at least 2")
    if settings.min_steps is not None and not 1 <= settings.min_steps < tc.steps:
        raise ConfigError(f"--min-steps {settings.min_steps}: expected 1 <= steps < train.steps ({tc.steps})")
    settings.metric = settings.metric or tc.early_stop_metric
    if not tc.eval_every:  # the race compares evaluations: about ten of them
        config = load_config(
            {**config.model_dump(), "train": {**tc.model_dump(), "eval_every": max(1, tc.steps // 10)}}
        )
    return config


def direction(config: Config, metric: str) -> str:
    """``minimize`` or ``maximize`` ``metric`` (:func:`kilolayer.train.policies.early_stop_mode`)."""
    tc = config.train
    if metric != tc.early_stop_metric:
        tc = SimpleNamespace(early_stop_mode="auto", early_stop_metric=metric)
    return "maximize" if early_stop_mode(tc) == "max" else "minimize"


def first_rung(config: Config, settings: Settings) -> int:
    """The first rung's step: ``--min-steps``, else train.steps / eta^2 rounded up to an evaluation."""
    if settings.min_steps is not None:
        return settings.min_steps
    every = config.train.eval_every
    raw = config.train.steps / settings.reduction_factor**2
    return max(every, math.ceil(raw / every) * every)


# ---------------------------------------------------------------- the time plan


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


# ---------------------------------------------------------------- the trials


@dataclass
class TrialResult:
    """One trial, read back from Optuna's storage and its run directory."""

    number: int
    shape: Shape
    lr: float
    run: Path
    state: str  # completed | pruned | diverged | failed | unfinished
    step: int
    value: float | None
    reason: str
    curve: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    continued: bool = False  # pruned, then continued by hand past its rung: value and step are its run's own
    from_prescreen: int = 0  # its first steps: the pre-screen's replay of its config (counted in ``step``)


STATE_ORDER = {"completed": 0, "pruned": 1, "unfinished": 2, "diverged": 3, "failed": 4}


@dataclass
class Comparison:
    """The top two completed trials' metric on the same evaluation batches: the mean difference, its standard
    error over batches, and whether it is within noise (|mean| below the two-sided 95% Student-t bound)."""

    first: int
    second: int
    metric: str
    batches: int
    difference: float
    stderr: float
    bound: float
    tied: bool
    agrees: bool = (
        True  # the difference has the sign of the ranking (False: the re-evaluation ranks them the other way)
    )


@dataclass
class Search:
    """Everything the report shows."""

    config: Config
    settings: Settings
    out: Path
    shapes: list[Shape]
    screens: list[Screen]
    trials: list[TrialResult]
    planned: int
    direction: str
    rung: int
    comparison: Comparison | None = None
    best: Path | None = None
    notes: list[str] = field(default_factory=list)
    stopped_by_budget: str = ""
    decisions: list[dict] = field(default_factory=list)  # each rung's judgement (:meth:`_Racer.judge`)
    rungs: list[int] = field(default_factory=list)
    plan: Plan | None = None  # the trials' length chosen for --minutes
    compare_seconds: float = 0.0  # the top two's comparison (:func:`compare_top`) in this run

    def seconds_spent(self) -> float:
        """Seconds the search has spent on what ``--minutes`` counts: planning, the pre-screen's forecasts, the
        trials' training, the rung cuts, and the top two's comparison."""
        probe = self.plan.probe_seconds if self.plan is not None else 0.0
        return (
            probe
            + sum(sc.seconds for sc in self.screens)
            + sum(t.seconds for t in self.trials)
            + sum(float(d.get("seconds", 0.0)) for d in self.decisions)
            + self.compare_seconds
        )

    def compute(self) -> dict:
        """What the search spent against a full grid of the planned trials (each trained for all train.steps,
        no pre-screen), in optimizer steps and model FLOPs (each shape's training FLOPs per sample at full
        length x batch size x steps): ``race`` (the trials' steps, those they started from the pre-screen
        included), ``prescreen`` (every step the forecasts replayed), ``reused`` (the replayed steps trials
        started from), ``extra`` (the pre-screen's other steps) and ``total`` = race + extra; ``grid``."""
        bs, steps = self.config.train.batch_size, self.config.train.steps
        flops = {s.name: s.step_flops(bs) for s in self.shapes}
        kept = [s for s, sc in zip(self.shapes, self.screens) if sc.kept]
        per_trial = self.planned / max(1, len(kept))  # trials per shape in a full grid of the planned trials
        out = {
            "race": (sum(t.step for t in self.trials), sum(t.step * flops[t.shape.name] for t in self.trials)),
            "prescreen": (sum(sc.steps for sc in self.screens), sum(sc.steps * flops[sc.shape] for sc in self.screens)),
            "reused": (
                sum(t.from_prescreen for t in self.trials),
                sum(t.from_prescreen * flops[t.shape.name] for t in self.trials),
            ),
            "grid": (self.planned * steps, per_trial * sum(steps * flops[s.name] for s in kept)),
        }
        out["extra"] = tuple(a - b for a, b in zip(out["prescreen"], out["reused"]))
        out["total"] = tuple(a + b for a, b in zip(out["race"], out["extra"]))
        return {k: {"steps": v[0], "flops": v[1]} for k, v in out.items()}

    @property
    def ranked(self) -> list[TrialResult]:
        sign = -1.0 if self.direction == "maximize" else 1.0

        def key(t: TrialResult):
            value = sign * t.value if t.value is not None and math.isfinite(t.value) else math.inf
            return STATE_ORDER[t.state], -t.step if t.state != "completed" else 0, value

        return sorted(self.trials, key=key)


def _import_optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            "kilolayer search needs Optuna (its successive-halving pruner races the trials): "
            "pip install 'kilolayer[search]'"
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _open_study(optuna, out: Path, config: Config, settings: Settings, rung: int, dirn: str):
    """The search's Optuna study on its journal file. Optuna keeps the trials (their shape and lr, drawn by its
    TPE sampler, the evaluations each reported, their states); the race itself is decided by
    :meth:`_Racer.judge` (synchronous successive halving), so the study has no pruner of its own."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(out / JOURNAL)))
    return optuna.create_study(
        study_name="search",
        storage=storage,
        load_if_exists=True,
        direction=dirn,
        sampler=optuna.samplers.TPESampler(seed=config.train.seed),
        pruner=optuna.pruners.NopPruner(),
    )


def rung_steps(config: Config, settings: Settings) -> list[int]:
    """The rungs' steps: the first rung (:func:`first_rung`) times eta^i, each moved to the first evaluation at
    or after it (the value a trial is judged by), those before train.steps."""
    every = config.train.eval_every or 1
    steps, found = config.train.steps, []
    r = first_rung(config, settings)
    while r < steps:
        at = math.ceil(r / every) * every
        if at < steps and at not in found:
            found.append(at)
        r *= settings.reduction_factor
    return found


def promote(entries: list[tuple[float, str, int]], eta: int, maximize: bool) -> tuple[list[int], list[int]]:
    """Successive halving's cut at one rung, judged once for every competitor: ``entries`` are (value, a
    tie-break that names the trial's shape and lr, trial number); the best ``max(n // eta, 1)`` go on (Optuna's
    SuccessiveHalvingPruner's arithmetic: of fewer than eta, the best). Returns (kept, pruned) trial numbers.
    The result does not depend on the order of ``entries``: a non-finite value ranks last, ties go by the
    tie-break, never by trial number."""
    sign = -1.0 if maximize else 1.0

    def key(e):
        value = sign * e[0] if math.isfinite(e[0]) else math.inf
        return value, e[1]

    ranked = sorted(entries, key=key)
    keep = max(len(ranked) // eta, 1) if ranked else 0
    return [e[2] for e in ranked[:keep]], [e[2] for e in ranked[keep:]]


def seconds_outside_trials(out: Path, study_attrs: dict) -> float:
    """Seconds the search at ``out`` has spent outside its trials' training: planning (finding the shapes and
    measuring their costs, ``plan.json``), the pre-screen's forecasts (``prescreen.json``) and the rung cuts
    (each decision's ``seconds`` in the study's ``study_attrs``). Each is saved with what it measured, so a
    re-run counts what the runs before it spent."""
    plan = rundir.read_json(out / PLAN, None) or {}
    screens = rundir.read_json(out / PRESCREEN, None) or {}
    cuts = [v for k, v in study_attrs.items() if k.startswith("decision_") and isinstance(v, dict)]
    return (
        float(plan.get("probe_seconds", 0.0))
        + sum(float(e.get("seconds", 0.0)) for e in screens.values() if isinstance(e, dict))
        + sum(float(d.get("seconds", 0.0)) for d in cuts)
    )


def _check_same_search(out: Path, config: Config, settings: Settings, write: bool = True) -> None:
    """``search.json``: written by the first run (``write``); a re-run with other settings is refused (naming
    them)."""
    mine = settings.identity(config)
    saved = rundir.read_json(out / SETTINGS, None) if out.is_dir() else None
    if saved is None:
        if write:
            rundir.write_json(out / SETTINGS, mine)
        return
    if saved != mine:
        from kilolayer.config import differences

        keys = list(differences(saved, mine))
        if keys == ["config.train.precision"] and _same_precision(config, saved["config"]["train"]["precision"]):
            return
        raise ConfigError(
            f"--out {out}: holds a search with other settings ({', '.join(keys[:5])} differ); give the same config "
            f"and options to continue it (only --budget-steps and --minutes may change), or choose another --out"
        )


def _same_precision(config: Config, saved: str) -> bool:
    """Whether a search saved with ``train.precision`` ``saved`` trained at what ``config``'s asks for here (fp32
    and an ``auto`` that decides fp32 on this machine: one search)."""
    from kilolayer.train.run import precision_here

    return precision_here(config, saved) == precision_here(config)


def _check_out(out: Path) -> None:
    """Refuse an --out that is a file, or a non-empty directory that holds no search (nothing is created)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: a file, not a directory")
    if out.is_dir() and not (out / SETTINGS).is_file() and any(p.name != LOCK for p in out.iterdir()):
        raise ConfigError(f"--out {out}: not empty and holds no search; choose another --out")


def _steps_of(run: Path) -> int:
    return rundir.RunDir(run).step if run.is_dir() else 0


RESUME_HINT = "re-run the same kilolayer search command (it continues this trial)"


class _Racer:
    """Runs trials: each an ordinary run directory trained in this process by :func:`kilolayer.train.run.train`,
    its evaluations reported to its Optuna trial. The race is synchronous successive halving over the fixed set
    of planned trials: every trial still in the race trains to a rung (it pauses there with a checkpoint), and
    once all of them have reached it or stopped, :meth:`judge` keeps the best 1/eta and prunes the rest. The
    local executor trains a rung's trials one at a time here; the Ray executor trains them at once, one per task
    (:func:`trial_task`), on the same study's journal. Either way no decision depends on the order
    of the trials or on which finished first."""

    def __init__(self, optuna, study, config, settings, kept: dict[str, Shape], out: Path, log, threads=None):
        self.optuna, self.study, self.config, self.settings = optuna, study, config, settings
        self.kept, self.out, self.log = kept, out, log
        self.threads = threads  # train.threads of every trial's run (``--threads``); None: this process's count
        self.lr = config.train.lr
        self.rung = first_rung(config, settings)
        self.rungs = rung_steps(config, settings)

    # -- what has been spent

    def _runs(self, exclude: int | None = None) -> list:
        return [t for t in self.study.get_trials(deepcopy=False) if t.number != exclude and "run" in t.user_attrs]

    def spent(self, exclude: int | None = None) -> tuple[int, float]:
        """(optimizer steps of every trial but ``exclude``, seconds the search has spent but that trial's): the
        trials' training, and what the search spent outside them (:func:`seconds_outside_trials`)."""
        trials = self._runs(exclude)
        steps = sum(_steps_of(self.out / t.user_attrs["run"]) for t in trials)
        outside = seconds_outside_trials(self.out, self.study.user_attrs)
        return steps, outside + sum(float(t.user_attrs.get("seconds", 0.0)) for t in trials)

    def over_budget(self, steps: int, seconds: float) -> str:
        s = self.settings
        if s.budget_steps is not None and steps >= s.budget_steps:
            return f"the search's budget of {s.budget_steps:,} steps is spent"
        if s.minutes is not None and seconds >= s.minutes * 60:
            return (
                f"the search's budget of {s.minutes:g} minutes is spent (planning, the pre-screen, the trials and "
                f"the rung cuts)"
            )
        return ""

    # -- the trials

    def create(self, planned: int) -> None:
        """Every planned trial, asked of the study (and its shape and lr drawn) before any trains, once per
        search: the set of trials the race halves is fixed from the start."""
        from optuna.trial import Trial, TrialState

        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if "run" not in t.user_attrs:  # asked by a run that stopped before assigning it
                self.assign(Trial(self.study, t._trial_id))
        started = self.study.get_trials(deepcopy=False, states=tuple(s for s in TrialState if s != TrialState.WAITING))
        for _ in range(planned - len(started)):
            self.assign(self.study.ask())

    def assign(self, trial) -> tuple[str, float, str]:
        """The trial's (shape, lr, run directory relative to the search): sampled once, by the process that asked
        for the trial (so the sampler's draws do not depend on the executor), and read back after."""
        s = self.settings
        name = trial.suggest_categorical("shape", list(self.kept))
        lr = self.lr
        if s.lr_factor is not None:
            lr = trial.suggest_float("lr", self.lr / s.lr_factor, self.lr * s.lr_factor, log=True)
        rel = trial.user_attrs.get("run")
        if rel is None:
            rel = f"{TRIALS}/{trial.number:03d}-{name}" + (f"-lr{lr:.3g}" if s.lr_factor is not None else "")
            trial.set_user_attr("run", rel)
        return name, lr, rel

    def alive(self, level: int) -> list:
        """The trials racing at ``level`` (a rung's index; ``len(rungs)``: the last leg, to train.steps), by
        number: at level 0 every trial still running; after, those the previous rung kept that still run."""
        from optuna.trial import TrialState

        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if level == 0:
            return running
        kept = set(self.study.user_attrs.get(f"decision_{level - 1}", {}).get("kept", []))
        return [t for t in running if t.number in kept]

    def todo(self, level: int) -> list:
        """The trials that still have to train at ``level``: racing there and not yet at its rung."""
        from optuna.trial import Trial

        return [
            Trial(self.study, t._trial_id)
            for t in self.alive(level)
            if level >= len(self.rungs) or f"rung_{level}" not in t.user_attrs
        ]

    def decisions(self) -> list[dict]:
        return [self.study.user_attrs[k] for k in sorted(self._decision_keys(), key=lambda k: int(k.split("_")[1]))]

    def _decision_keys(self) -> list[str]:
        return [k for k in self.study.user_attrs if k.startswith("decision_")]

    def judge(self, level: int) -> dict:
        """Successive halving at rung ``level``, once every trial racing there has reached it or stopped: the
        best 1/eta of those at the rung go on (:func:`promote`), the others are pruned (their runs stay paused
        at the rung with a checkpoint). The decision is recorded in the study before it is applied, so an
        interrupted judgement is finished, not re-made, by a re-run. Whether the cut between the last trial
        kept and the best one pruned is inside the evaluation-batch noise is measured and recorded too."""
        from optuna.trial import Trial, TrialState

        key = f"decision_{level}"
        decision = self.study.user_attrs.get(key)
        racing = self.alive(level)
        if decision is None:
            t0 = time.perf_counter()
            at = [t for t in racing if f"rung_{level}" in t.user_attrs]
            entries = [(float(t.user_attrs[f"rung_{level}"][1]), self._tiebreak(t), t.number) for t in at]
            maximize = self.study.direction == self.optuna.study.StudyDirection.MAXIMIZE
            kept, pruned = promote(entries, self.settings.reduction_factor, maximize)
            values = {str(n): v for v, _, n in entries}
            decision = {
                "level": level,
                "step": self.rungs[level],
                "kept": kept,
                "pruned": pruned,
                "values": values,
                "margin": self._margin(at, kept, pruned) if kept and pruned else None,
            }
            decision["seconds"] = time.perf_counter() - t0  # counted against --minutes
            self.study.set_user_attr(key, decision)
        for t in racing:
            if t.number in decision["pruned"] and t.state == TrialState.RUNNING:
                self._prune(Trial(self.study, t._trial_id), t, decision)
        return decision

    @staticmethod
    def _tiebreak(frozen) -> str:
        return f"{frozen.params.get('shape', '')}|{float(frozen.params.get('lr', 0.0)):.17g}"

    def _margin(self, at: list, kept: list[int], pruned: list[int]) -> dict | None:
        """The last trial kept against the best one pruned, on the same evaluation batches at the rung's
        checkpoints (:func:`compare_runs`); None where it cannot be measured."""
        runs = {t.number: self.out / t.user_attrs["run"] for t in at}
        try:
            c = compare_runs(runs[kept[-1]], runs[pruned[0]], self.settings.metric)
        except Exception:  # a measurement for the report only: never stop the search for it
            return None
        if c is None:
            return None
        difference, stderr, bound, batches = c
        return {
            "kept": kept[-1],
            "pruned": pruned[0],
            "difference": difference,
            "bound": bound,
            "batches": batches,
            "within_noise": abs(difference) <= bound,
        }

    def _prune(self, trial, frozen, decision: dict) -> None:
        level, step = decision["level"], decision["step"]
        values = sorted(decision["values"].values())
        maximize = self.study.direction == self.optuna.study.StudyDirection.MAXIMIZE
        keep = len(decision["kept"])
        cut = [decision["values"][str(n)] for n in decision["kept"]][-1]
        value = decision["values"][str(frozen.number)]
        reason = (
            f"successive halving, rung {level} (step {step}): {self.settings.metric} {value:.6g} is not among the "
            f"best {keep} of the {len(values)} trials at this rung (cut-off {cut:.6g}, "
            f"{'higher' if maximize else 'lower'} is better; judged once every trial in the race had reached it)"
        )
        m = decision.get("margin")
        if m and m["within_noise"] and m["pruned"] == frozen.number:
            reason += (
                f"; the margin to the last trial kept ({m['difference']:+.3g} on {m['batches']} evaluation batches) "
                f"is within evaluation-batch noise, one seed (+/-{m['bound']:.3g})"
            )
        trial.set_user_attr("ended", "pruned")
        trial.set_user_attr("reason", reason)
        trial.set_user_attr("pruned_step", int(frozen.user_attrs[f"rung_{level}"][0]))
        self.study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
        run = self.out / frozen.user_attrs["run"]
        status = rundir.read_status(run)
        if status.get("status") == "interrupted":  # the run says why it stopped, for kilolayer doctor and ls
            extra = {k: v for k, v in status.items() if k not in ("status", "step", "reason")}
            rundir.write_status(
                run,
                "interrupted",
                status.get("step", 0),
                f"pruned by kilolayer search: {reason}; kilolayer train --resume --out {run} continues it "
                f"outside the search",
                **extra,
            )
        self.log(f"[search] trial {frozen.number}: pruned at step {step}")

    # -- one trial

    def run(self, trial, level: int) -> str:
        """Train ``trial`` to rung ``level`` (where it pauses with a checkpoint; ``len(rungs)``: to the end), or
        until it completes, diverges or fails (each recorded in the study); returns why the search must stop
        ("" to go on)."""
        from kilolayer.train.run import Halted, train
        from kilolayer.train.signals import Interrupted

        s = self.settings
        name, lr, rel = self.assign(trial)
        shape = self.kept[name]
        run = self.out / rel
        frozen = self.study._storage.get_trial(trial._trial_id)
        until = self.rungs[level] if level < len(self.rungs) else None
        if until is not None and f"rung_{level}" in frozen.user_attrs:
            return ""
        reported = set(frozen.intermediate_values)
        seconds0 = float(frozen.user_attrs.get("seconds", 0.0))
        t0 = time.perf_counter()
        verdict = {"paused": False, "budget": ""}

        def on_eval(step: int, metrics: dict) -> str:
            if s.metric not in metrics:
                raise ConfigError(
                    f"--metric {s.metric}: not an evaluation metric of {self.config.objective.name} (it reports "
                    f"{', '.join(sorted(metrics))})"
                )
            elapsed = seconds0 + time.perf_counter() - t0
            trial.set_user_attr("seconds", elapsed)
            value = float(metrics[s.metric])
            if step not in reported:
                trial.report(value, step)
                reported.add(step)
            if until is not None and step >= until:
                trial.set_user_attr(f"rung_{level}", [step, value])
                verdict["paused"] = True
                return f"paused by kilolayer search at rung {level} (step {until}) until every trial has reached it"
            steps_others, seconds_others = self.spent(exclude=trial.number)  # others may be training at once
            verdict["budget"] = self.over_budget(steps_others + step, seconds_others + elapsed)
            return f"stopped by kilolayer search: {verdict['budget']}" if verdict["budget"] else ""

        self.log(
            f"[search] trial {trial.number}: {name} (lr {lr:.3g}) -> {run}" + (f" to step {until}" if until else "")
        )
        cfg = trial_config(self.config, shape, lr)
        if not run.exists():
            start = self.start(cfg, run)
            if start:
                trial.set_user_attr("from_prescreen", start)
        try:
            threads = {"sets": [f"train.threads={self.threads}"]} if self.threads is not None else {}
            train(cfg, run, resume=True, quiet=True, on_eval=on_eval, resume_hint=RESUME_HINT, **threads)
        except Halted:
            trial.set_user_attr("seconds", seconds0 + time.perf_counter() - t0)
            return "" if verdict["paused"] else verdict["budget"]  # left running: a re-run continues it
        except DivergedError as err:
            trial.set_user_attr("ended", "diverged")
            trial.set_user_attr("reason", str(err))
            self.study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
            self.log(f"[search] trial {trial.number}: diverged ({err})")
            return ""
        except Interrupted:
            raise  # Ctrl-C or SIGTERM: the trial saved a checkpoint and stays running; a re-run continues it
        except ConfigError as err:
            if str(err).startswith("--metric"):
                raise  # the user's mistake, the same for every trial
            self.failed(trial, err, seconds0 + time.perf_counter() - t0)
            return ""
        except Exception as err:
            self.failed(trial, err, seconds0 + time.perf_counter() - t0)
            return ""
        trial.set_user_attr("seconds", seconds0 + time.perf_counter() - t0)
        trial.set_user_attr("ended", "completed")
        value = self.final_value(run)
        self.study.tell(trial, value)
        self.log(f"[search] trial {trial.number}: completed, {s.metric} {value:.4g}")
        return ""

    def start(self, config: Config, run: Path) -> int:
        """Begin the run of ``config`` at ``run`` from the pre-screen's replay of the same config, if one is saved
        (``starts/<its hash>``, :func:`doctor_forecast`) and ends before the first rung: its checkpoint is moved
        into the new run directory with the config, and training resumes from it, the steps the replay trained
        not trained again (the same steps, bit for bit at the same thread count: :mod:`kilolayer.doctor.measure`).
        Returns that step (0: the run starts from scratch)."""
        from kilolayer.config import dump_yaml
        from kilolayer.files import atomic_folder, write_atomic

        saved = rundir.complete_checkpoints(self.out / STARTS / _key(config))
        if not saved or not starts_from_prescreen(self.config, self.settings):
            return 0
        step = rundir.checkpoint_step(saved[-1])
        if not 0 < step < (self.rungs[0] if self.rungs else config.train.steps):
            return 0
        run.parent.mkdir(parents=True, exist_ok=True)
        with atomic_folder(run) as tmp:
            write_atomic(tmp / rundir.CONFIG, dump_yaml(config))
            rundir.checkpoint_dir(tmp, step).parent.mkdir()
            saved[-1].rename(rundir.checkpoint_dir(tmp, step))
        shutil.rmtree(self.out / STARTS / _key(config), ignore_errors=True)
        self.log(f"[search] {run.name}: starts at step {step}, from the pre-screen's replay")
        return step

    def failed(self, trial, err: BaseException | str, seconds: float) -> None:
        """Record ``trial`` failed with ``err`` (one line) after ``seconds`` of training; the search goes on."""
        if not isinstance(err, str):
            err = str(err) if isinstance(err, KilolayerError) else f"{type(err).__name__}: {err}"
        reason = " ".join(err.split())[:300]
        trial.set_user_attr("seconds", seconds)
        trial.set_user_attr("ended", "failed")
        trial.set_user_attr("reason", reason)
        self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
        self.log(f"[search] trial {trial.number}: failed ({reason})")

    def final_value(self, run: Path) -> float:
        """The metric of the evaluation that stands for a completed run (with early stopping: its best)."""
        return _final_value(run, self.settings.metric)


def _final_value(run: Path, metric: str) -> float:
    r = rundir.RunDir(run)
    evals = [e for e in r.metrics() if e.get("split") == "eval"]
    record = r.final_eval(evals, on_damaged=lambda _: None)
    return float(record.get(metric, math.nan))


def _enqueue(study, kept: list[str], lr: float | None) -> None:
    """One trial per shape first (at the config's lr), once per search."""
    if study.user_attrs.get("enqueued"):
        return
    for name in kept:
        study.enqueue_trial({"shape": name, **({"lr": lr} if lr is not None else {})}, skip_if_exists=True)
    study.set_user_attr("enqueued", True)


def collect(study, found: dict[str, Shape], out: Path, metric: str) -> list[TrialResult]:
    """Every started trial, from the study and its run directory. A pruned trial that was continued by hand
    (``kilolayer train --resume``) past the rung it was pruned at shows its run's own final evaluation, flagged
    as continued outside the search."""
    from optuna.trial import TrialState

    results = []
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING or "run" not in t.user_attrs or t.params.get("shape") not in found:
            continue
        run = out / t.user_attrs["run"]
        r = rundir.RunDir(run)
        status = r.status
        curve = []
        if run.is_dir():
            try:
                curve = [
                    (int(e["step"]), float(e[metric])) for e in r.metrics() if e.get("split") == "eval" and metric in e
                ]
            except KilolayerError:
                curve = []
        ended = t.user_attrs.get("ended", "")
        step = r.step if run.is_dir() else 0
        continued = False
        if t.state == TrialState.COMPLETE:
            state, value, reason = "completed", t.value, status.get("reason", "")
        elif t.state == TrialState.PRUNED:
            state = "diverged" if ended == "diverged" else "pruned"
            value = t.intermediate_values[t.last_step] if t.last_step is not None else None
            reason = t.user_attrs.get("reason", "")
            stopped = t.user_attrs.get("pruned_step")
            if state == "pruned" and stopped is not None and step > stopped:
                continued = True
                try:
                    value = _final_value(run, metric)
                except KilolayerError:
                    pass
                reason = (
                    f"{reason}; then continued outside the search (kilolayer train --resume) to step {step} "
                    f"({status.get('status', '?')}): its own final evaluation is shown"
                )
        elif t.state == TrialState.FAIL:
            state, value, reason = "failed", None, t.user_attrs.get("reason", status.get("reason", ""))
        else:
            state = "unfinished"
            value = t.intermediate_values[t.last_step] if t.last_step is not None else None
            reason = status.get("reason", "not started")
        results.append(
            TrialResult(
                number=t.number,
                shape=found[t.params["shape"]],
                lr=float(t.params.get("lr", study.user_attrs.get("lr", math.nan))),
                run=run,
                state=state,
                step=step,
                value=value,
                reason=reason,
                curve=curve,
                seconds=float(t.user_attrs.get("seconds", 0.0)),
                continued=continued,
                from_prescreen=int(t.user_attrs.get("from_prescreen", 0)),
            )
        )
    return results


def per_batch_metric(run: Path, metric: str) -> list[float]:
    """``metric`` of the run's chosen checkpoint on each of its evaluation batches, masks and noise drawn from one
    fixed seed, so that two runs of one config are scored on the same draws."""
    import torch

    from kilolayer.train.checkpoint import load_run_weights, standing_checkpoint
    from kilolayer.train.engine import Engine, to_device

    config = load_config(run / rundir.CONFIG)
    ckpt = standing_checkpoint(run, patience=config.train.patience, on_damaged=lambda _: None)
    engine = Engine(config, fresh=False)
    load_run_weights(run, engine.task, ckpt)
    values = []
    with engine.evaluating():
        torch.manual_seed(config.train.seed)
        for batch in engine.eval_data():
            found = engine.objective.evaluate(engine.task.backbone, [to_device(batch, engine.env.device)])
            values.append(float(found[metric]))
    return values


def compare_runs(a: Path, b: Path, metric: str) -> tuple[float, float, float, int] | None:
    """``a``'s metric minus ``b``'s on the same evaluation batches (:func:`per_batch_metric`): (mean difference,
    its standard error over batches, the two-sided 95% Student-t bound, batches); None with one batch."""
    from kilolayer.verdicts.rule import t_bound

    diffs = [x - y for x, y in zip(per_batch_metric(a, metric), per_batch_metric(b, metric))]
    if len(diffs) < 2:
        return None
    return *t_bound(diffs, 0.975), len(diffs)


def compare_top(ranked: list[TrialResult], metric: str, maximize: bool = False) -> Comparison | None:
    """The top two completed trials compared batch by batch (:class:`Comparison`); None with fewer than two or a
    single evaluation batch (no spread to measure)."""
    done = [t for t in ranked if t.state == "completed"][:2]
    if len(done) < 2:
        return None
    found = compare_runs(done[0].run, done[1].run, metric)
    if found is None:
        return None
    mean, se, bound, n = found
    agrees = mean > 0 if maximize else mean < 0  # the re-evaluation ranks them as the leaderboard does
    return Comparison(done[0].number, done[1].number, metric, n, mean, se, bound, abs(mean) <= bound, agrees)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_choice(search: Search) -> None:
    """best.yaml: the recommended trial's config; when the top two are within noise, tied-<shape>.yaml for each
    of them instead (the report says so rather than pick). Only files the search wrote itself are replaced or
    removed (their names and hashes are in ``choice.json``): one edited since is kept as ``NAME.edited`` (a
    note in the report says so), and a file the search never wrote is left alone."""
    from kilolayer.config import dump_yaml
    from kilolayer.files import write_atomic

    out = search.out
    written: dict = rundir.read_json(out / CHOICE, {}) or {}

    def release(path: Path) -> None:
        """Make way for the search's own ``path``: remove it if the search wrote it as it is, keep an edited
        copy otherwise."""
        if not path.is_file():
            return
        if written.get(path.name) == _sha(path):
            path.unlink()
            return
        kept = path.with_name(path.name + ".edited")
        path.replace(kept)
        search.notes.append(f"{path.name} was not as the search wrote it: kept as {kept.name}")

    for name in list(written):
        release(out / name)
        written.pop(name)
    done = [t for t in search.ranked if t.state == "completed"]
    new: dict[str, Path] = {}
    c = search.comparison
    if done and c is not None and c.tied:
        new = {f"tied-{t.shape.name}.yaml": t.run for t in done[:2]}
    elif done:
        new = {"best.yaml": done[0].run}
    for name, run in new.items():
        path = out / name
        release(path)
        write_atomic(path, dump_yaml(load_config(run / rundir.CONFIG)))
        written[name] = _sha(path)
    if "best.yaml" in new:
        search.best = out / "best.yaml"
    rundir.write_json(out / CHOICE, written)


def race(racer: _Racer, planned: int, pool) -> str:
    """Synchronous successive halving on an executor's ``pool`` (:mod:`kilolayer.study.executors`): the trials
    racing at each rung trained (as many at once as the pool has slots), then the rung judged here once all have
    returned (:meth:`_Racer.judge`); returns why a budget stopped them. A trial trains in this process
    (:meth:`_Racer.run`, which hears each evaluation) where the pool runs units here, else as
    :func:`trial_task`, which opens the same study from its journal."""
    racer.create(planned)
    for level in range(len(racer.rungs) + 1):
        stop = _race_rung(racer, level, pool)
        if stop:
            return stop
        if level < len(racer.rungs):
            racer.judge(level)
    return ""


def race_here(racer: _Racer, planned: int) -> str:
    """:func:`race` on the local executor: one trial after another in this process."""
    from kilolayer.study.executors.local import LocalPool

    return race(racer, planned, LocalPool())


def _race_rung(racer: _Racer, level: int, pool) -> str:
    queue = racer.todo(level)
    stop = ""
    if not pool.in_process:
        args = (racer.config, racer.settings, racer.kept, racer.out.resolve(), racer.threads)
    try:
        while True:
            while not stop and queue and pool.busy < pool.slots:
                stop = racer.over_budget(*racer.spent())
                if stop:
                    break
                trial = queue.pop(0)
                if pool.in_process:
                    pool.submit(trial, _run_here, racer, trial, level)
                else:
                    pool.submit(trial, trial_task, args, trial._trial_id, level, pool.threads)
            if not pool.busy:
                return stop
            for trial, value in pool.wait():
                if not isinstance(value, dict):  # the executor gave up on the unit (Ray: its retries spent)
                    _lost(racer, trial, value.reason)
                    continue
                for line in value["log"]:
                    racer.log(line)
                stop = stop or value["stop"]
    except BaseException:
        if pool.busy:  # Ctrl-C or a refusal: every trial saves a checkpoint and stays running in the study
            racer.log(f"[search] cancelling {pool.busy} trial(s); re-run the same command to continue them")
            pool.cancel()
        raise


def _run_here(racer: _Racer, trial, level: int) -> dict:
    return {"stop": racer.run(trial, level), "log": []}  # it logs as it goes


def _lost(racer: _Racer, trial, reason: str) -> None:
    """A unit the executor gave up on: its trial is failed unless it recorded an end of its own."""
    from optuna.trial import TrialState

    frozen = racer.study._storage.get_trial(trial._trial_id)
    if frozen.state == TrialState.RUNNING:
        racer.failed(trial, f"Ray task: {reason}", float(frozen.user_attrs.get("seconds", 0.0)))


def trial_task(racer_args: tuple, trial_id: int, level: int, threads: int) -> dict:
    """A unit of a pool outside this process (a Ray task): train one trial to rung ``level`` (:meth:`_Racer.run`
    on the search's study, opened from its journal); returns why the search must stop ("" to go on) and the lines
    it logged."""
    import os
    import signal

    import ray

    if not ray.get_runtime_context().get_accelerator_ids().get("GPU"):
        # a trial uses the GPUs it reserved, and none without (Ray leaves them all visible then); read when this
        # worker first touches CUDA, and every trial of a search reserves alike
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    from optuna.trial import Trial

    config, settings, kept, out, train_threads = racer_args
    optuna = _import_optuna()
    study = _open_study(optuna, out, config, settings, first_rung(config, settings), direction(config, settings.metric))
    lines: list[str] = []
    racer = _Racer(optuna, study, config, settings, kept, out, lines.append, train_threads)
    torch.set_num_threads(threads)
    # Ray workers ignore SIGINT, and ray.cancel interrupts a running task by simulating one: let training's
    # stop signals see it (a checkpoint, the trial left running)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stop = racer.run(Trial(study, trial_id), level)
    finally:
        signal.signal(signal.SIGINT, previous)
    return {"stop": stop, "log": lines}


def percent(x: float) -> str:
    """A fraction as a percentage with the digits it needs (0.0001 -> 0.01%, 0.03 -> 3%)."""
    return f"{x * 100:.3g}%"


def check_metric(config: Config, shape: Shape, metric: str) -> None:
    """One line unless ``metric`` is an evaluation metric of the config's objective: one evaluation batch of
    ``shape`` at initialisation, in memory, before the search writes anything."""
    import torch

    from kilolayer.train.engine import Engine, to_device

    cfg = trial_config(config, shape, config.train.lr)
    engine = Engine(cfg)
    with engine.evaluating():
        torch.manual_seed(cfg.train.seed)
        batch = next(iter(engine.eval_data(1)))
        found = engine.objective.evaluate(engine.task.backbone, [to_device(batch, engine.env.device)])
    if metric not in found:
        raise ConfigError(
            f"--metric {metric}: not an evaluation metric of {config.objective.name} (it reports "
            f"{', '.join(sorted(found))})"
        )


def run_search(
    config: Config,
    out: str | Path,
    settings: Settings,
    log=print,
    forecaster: Callable[[Config], tuple] | None = None,
    executor: Executor | None = None,
    measure: Callable[[Config], Cost] | None = None,
) -> Search:
    """The whole search (module docstring) into ``out``; returns what the report shows. ``forecaster(config)``
    gives (verdict, reason[, {"score", "steps"}]) for the pre-screen (default: the doctor's forecast);
    ``executor`` trains the trials (:func:`race`; default: local, in this process); ``measure(config)`` gives a
    shape's :class:`Cost` for the time plan of ``settings.minutes`` (default :func:`measure_cost`). With
    ``settings.minutes``, everything the search spends from here counts against them: a search whose shortest
    plan does not fit is refused before it writes anything."""
    started = time.perf_counter()
    executor = executor or Executor()
    out = Path(out)
    config = check_settings(config, settings)
    optuna = _import_optuna()
    found = shapes(config, settings.params, settings.depths, settings.tolerance)
    lo, hi = settings.depths or default_depths(config.model)
    if not found:
        least = narrowest(config.model, lo)
        raise ConfigError(
            f"--params {settings.params:,}: even the narrowest shape at depth {lo} ({shape_name(least)}, "
            f"{count_parameters(least):,} parameters) exceeds it by more than {percent(settings.tolerance)}; raise "
            f"--params or --tolerance"
        )
    left_out = (found[-1].layers + 1, hi) if found[-1].layers < hi else None
    _check_out(out)
    _check_same_search(out, config, settings, write=False)
    saved = rundir.read_json(out / SETTINGS, None) if out.is_dir() else None
    if settings.metric != config.train.early_stop_metric and (saved or {}).get("metric") != settings.metric:
        check_metric(config, found[0], settings.metric)  # before search.json records it
    plan = saved_plan(out)  # a re-run keeps the trials' length whatever minutes it is given
    if settings.minutes is not None and plan is None:  # the trials' length spends the minutes
        plan = time_plan(config, settings, found, measure, started)  # or refused, nothing written
        log(
            f"[search] time plan: trials of {plan.steps:,} steps (the config's {config.train.steps:,}), estimated "
            f"to take {plan.total / 60:.1f} of the {settings.minutes:g} minutes ({plan.probe_seconds:.0f} s spent "
            f"finding and measuring the shapes)"
        )
    out.mkdir(parents=True, exist_ok=True)
    with rundir.RunLock(out, LOCK, "kilolayer search"):
        _check_same_search(out, config, settings)
        if settings.minutes is not None:
            if saved_plan(out) is None:
                rundir.write_json(out / PLAN, plan.to_dict())
            plan = saved_plan(out)
            config = with_steps(config, plan.steps)
        else:
            plan = None
        steps, keep = forecast_steps(config, settings), starts_from_prescreen(config, settings)
        screens = prescreen(
            config,
            found,
            out,
            settings.keep_forecast_failures,
            forecaster or (lambda c: doctor_forecast(c, steps, out / STARTS / _key(c) if keep else None)),
            log,
        )
        kept = {s.name: s for s, sc in zip(found, screens) if sc.kept}
        rung = first_rung(config, settings)
        dirn = direction(config, settings.metric)
        search = Search(config, settings, out, found, screens, [], 0, dirn, rung, plan=plan)
        search.rungs = rung_steps(config, settings)
        if left_out:
            search.notes.append(
                f"depths {left_out[0]}..{left_out[1]} left out: even their narrowest shape exceeds "
                f"{settings.params:,} parameters by more than {percent(settings.tolerance)}"
            )
        if kept:
            if len(kept) == 1 and len(found) > 1:
                search.notes.append(
                    f"the pre-screen left only {next(iter(kept))} of the {len(found)} shapes: nothing was raced "
                    f"against it; --keep-forecast-failures races them all"
                )
            planned = len(kept) if settings.lr_factor is None else settings.trials or 2 * len(kept)
            search.planned = planned
            study = _open_study(optuna, out, config, settings, rung, dirn)
            study.set_user_attr("lr", config.train.lr)
            _enqueue(study, list(kept), config.train.lr if settings.lr_factor is not None else None)
            racer = _Racer(optuna, study, config, settings, kept, out, log, executor.threads)
            with executor.pool(out) as pool:
                if not pool.in_process:
                    log(
                        f"[search] {pool.cluster}; up to {pool.slots} trial(s) at once, each {executor.cpus:g} CPU, "
                        f"{executor.gpus:g} GPU"
                    )
                search.stopped_by_budget = race(racer, planned, pool)
            search.trials = collect(study, kept, out, settings.metric)
            search.decisions = racer.decisions()
        else:
            search.notes.append(
                "the pre-screen dropped every shape (each forecast to diverge, or to stall behind another), so none "
                "was trained; --keep-forecast-failures races them anyway"
            )
        t0 = time.perf_counter()
        search.comparison = compare_top(search.ranked, settings.metric, dirn == "maximize")
        search.compare_seconds = time.perf_counter() - t0
        _write_choice(search)
    return search
