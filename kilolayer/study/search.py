"""``kilolayer search``: the best depth and width for a config's objective at a parameter budget.

Bamboo's advice as a tool: a Transformer's best shape depends on its training objective, so search it per
objective instead of inheriting 12 x 768. From the user's config (objective, data, training settings):

1. :func:`shapes`: parameter-matched shapes across a depth range (:func:`kilolayer.nn.budget.matched_configs`:
   the config's head size held, widths multiples of it, parameters within a tolerance), with their FLOPs per
   token;
2. :func:`prescreen`: each shape forecast by the doctor (:func:`kilolayer.doctor.forecast`); those forecast to
   diverge or stall are dropped with its reason, unless kept on purpose;
3. :func:`run_search`: the rest raced under Optuna's successive-halving pruner in trial order (a trial goes on
   past a rung only if its metric is among the best 1/eta of the trials numbered before it that reached that
   rung, and itself: :func:`in_order_pruner`), optionally with the learning rate searched jointly (log-uniform
   around the config's, Optuna's TPE sampler). Each trial is an ordinary run directory trained by
   :func:`kilolayer.train.run.train`, which reports every evaluation to the trial; a pruned trial stops there
   with a checkpoint (status ``interrupted``: resumable, and diagnosable by ``kilolayer doctor``). The trials
   run one after another in this process (:func:`race_here`), or at once as Ray tasks
   (:mod:`kilolayer.study.search_ray`), with the same leaderboard.

The search lives in its directory: ``search.json`` (its settings), ``prescreen.json`` (the forecasts),
``optuna.journal`` (Optuna's journal storage: every trial, its state and reported values) and ``trials/``. A
re-run continues it: finished trials are read back, a trial left running by an interruption continues from its
newest checkpoint, and the rest start. One search at a time writes a directory (``search.lock``).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from kilolayer import rundir
from kilolayer.config import Config, ModelConfig, load_config
from kilolayer.errors import ConfigError, DivergedError, KilolayerError
from kilolayer.nn.budget import count_parameters, matched_configs, training_flops
from kilolayer.train.policies import early_stop_mode

SETTINGS = "search.json"
PRESCREEN = "prescreen.json"
JOURNAL = "optuna.journal"
LOCK = "search.lock"
TRIALS = "trials"
DROPPED = ("diverges", "stalls")  # forecast verdicts the pre-screen drops


# ---------------------------------------------------------------- the shapes


@dataclass(frozen=True)
class Shape:
    """One parameter-matched model: its name (``LAYERSxWIDTH``), config, parameters and training FLOPs per token."""

    name: str
    model: ModelConfig
    parameters: int
    flops_per_token: float

    @property
    def layers(self) -> int:
        return self.model.layers

    def step_flops(self, batch_size: int) -> float:
        """Model FLOPs of one training step at the model's full length (:func:`kilolayer.nn.budget.training_flops`)."""
        return training_flops(self.model) * batch_size


def shape_name(model: ModelConfig) -> str:
    if model.arch == "encoder_decoder":
        return f"{model.layers}+{model.decoder_layers}x{model.width}"
    return f"{model.layers}x{model.width}"


def shapes(config: Config, params: int, depths: tuple[int, int] | None = None, tolerance: float = 0.03) -> list[Shape]:
    """Shapes like ``config.model`` (its head size and FFN ratio) within ``tolerance`` of ``params`` parameters,
    one per width (the depth whose count comes closest, within ``depths`` = (A, B) inclusive), shallowest first."""
    from kilolayer.nn.budget import budget

    m = config.model
    head = m.width // m.heads
    found = matched_configs(
        m, params=params, tolerance=tolerance, head_dim=head, depths=range(depths[0], depths[1] + 1) if depths else None
    )
    return [Shape(shape_name(c), c, count_parameters(c), budget(c).flops_per_token) for c in found]


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


def doctor_forecast(config: Config, steps: int | None = None) -> tuple[str, str]:
    """(verdict, reason) of :func:`kilolayer.doctor.forecast` for ``config``."""
    from kilolayer.doctor.forecast import forecast

    f = forecast(config, steps=steps)
    return f.verdict, f.reason


def _key(config: Config) -> str:
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


def prescreen(
    config: Config,
    found: list[Shape],
    out: Path,
    keep_all: bool = False,
    forecaster: Callable[[Config], tuple[str, str]] | None = None,
    log=print,
) -> list[Screen]:
    """Each shape's forecast (``forecaster``, default :func:`doctor_forecast`), read from ``prescreen.json`` when
    that config's forecast is saved there; shapes forecast to diverge or stall are not kept unless ``keep_all``."""
    forecaster = forecaster or doctor_forecast
    saved = rundir.read_json(out / PRESCREEN, {}) or {}
    screens = []
    for s in found:
        cfg = trial_config(config, s, config.train.lr)
        key = _key(cfg)
        entry = saved.get(s.name)
        if not entry or entry.get("key") != key:
            t0 = time.perf_counter()
            verdict, reason = forecaster(cfg)
            entry = {"key": key, "verdict": verdict, "reason": reason, "seconds": time.perf_counter() - t0}
            saved[s.name] = entry
            rundir.write_json(out / PRESCREEN, saved)
            log(f"[search] forecast {s.name}: {verdict} — {reason}")
        kept = keep_all or entry["verdict"] not in DROPPED
        screens.append(Screen(s.name, entry["verdict"], entry["reason"], kept, entry.get("seconds", 0.0)))
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
    """One line for a setting that cannot work; returns the config the trials train with (evaluations on)."""
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
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(out / JOURNAL)))
    return optuna.create_study(
        study_name="search",
        storage=storage,
        load_if_exists=True,
        direction=dirn,
        sampler=optuna.samplers.TPESampler(seed=config.train.seed),
        pruner=in_order_pruner(optuna, rung, settings.reduction_factor),
    )


def in_order_pruner(optuna, rung: int, eta: int):
    """Optuna's successive-halving pruner (first rung ``rung``, reduction factor ``eta``) in which the trials a
    trial competes with at a rung are fixed by trial order: those numbered below it that reached the rung, and
    itself, never a later one. Trials trained one after another meet exactly Optuna's own rule; trials trained
    at once (``--executor ray``) each wait at a rung for every earlier trial to reach it or stop
    (:meth:`_Racer.wait_for_earlier`), so no decision depends on how many run at once or which is faster."""
    inner = optuna.pruners.SuccessiveHalvingPruner(min_resource=rung, reduction_factor=eta, min_early_stopping_rate=0)

    class InOrderSuccessiveHalving(optuna.pruners.BasePruner):
        def prune(self, study, trial) -> bool:
            return inner.prune(_Earlier(study, trial.number), trial)

    return InOrderSuccessiveHalving()


class _Earlier:
    """The study as trial ``number`` sees it at a rung: the trials numbered below it (what the pruner reads)."""

    def __init__(self, study, number: int):
        self.study, self.number = study, number
        self._storage = study._storage
        self.direction = study.direction

    def get_trials(self, deepcopy: bool = True, states=None) -> list:
        return [t for t in self.study.get_trials(deepcopy=deepcopy, states=states) if t.number < self.number]


def rung_of(frozen) -> int:
    """The rung a trial is at: how many rungs it has passed (Optuna's ``completed_rung_<i>`` attributes)."""
    rung = 0
    while f"completed_rung_{rung}" in frozen.system_attrs:
        rung += 1
    return rung


def _check_same_search(out: Path, config: Config, settings: Settings) -> None:
    """``search.json``: written by the first run; a re-run with other settings is refused (naming them)."""
    mine = settings.identity(config)
    saved = rundir.read_json(out / SETTINGS, None)
    if saved is None:
        rundir.write_json(out / SETTINGS, mine)
        return
    if saved != mine:
        from kilolayer.train.run import _flatten

        a, b = _flatten(saved), _flatten(mine)
        keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        raise ConfigError(
            f"--out {out}: holds a search with other settings ({', '.join(keys[:5])} differ); give the same config "
            f"and options to continue it (only --budget-steps and --minutes may change), or choose another --out"
        )


def _check_out(out: Path) -> None:
    """Refuse an --out that is a file, or a non-empty directory that holds no search (nothing is created)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: a file, not a directory")
    if out.is_dir() and not (out / SETTINGS).is_file() and any(p.name != LOCK for p in out.iterdir()):
        raise ConfigError(f"--out {out}: not empty and holds no search; choose another --out")


def _steps_of(run: Path) -> int:
    return rundir.RunDir(run).step if run.is_dir() else 0


class _Racer:
    """Runs trials: each an ordinary run directory trained in this process by :func:`kilolayer.train.run.train`,
    its evaluations reported to its Optuna trial. The local executor runs them one at a time here; the Ray
    executor (:mod:`kilolayer.study.search_ray`) makes one in each task, on the same study's journal."""

    POLL_S = 0.5  # how often a trial waiting at a rung looks at the earlier trials again

    def __init__(self, optuna, study, config, settings, kept: dict[str, Shape], out: Path, log):
        self.optuna, self.study, self.config, self.settings = optuna, study, config, settings
        self.kept, self.out, self.log = kept, out, log
        self.lr = config.train.lr
        self.rung = first_rung(config, settings)

    # -- what has been spent

    def _runs(self, exclude: int | None = None) -> list:
        return [t for t in self.study.get_trials(deepcopy=False) if t.number != exclude and "run" in t.user_attrs]

    def spent(self, exclude: int | None = None) -> tuple[int, float]:
        """(optimizer steps, training seconds) of every trial but ``exclude``."""
        trials = self._runs(exclude)
        steps = sum(_steps_of(self.out / t.user_attrs["run"]) for t in trials)
        return steps, sum(float(t.user_attrs.get("seconds", 0.0)) for t in trials)

    def over_budget(self, steps: int, seconds: float) -> str:
        s = self.settings
        if s.budget_steps is not None and steps >= s.budget_steps:
            return f"the search's budget of {s.budget_steps:,} steps is spent"
        if s.minutes is not None and seconds >= s.minutes * 60:
            return f"the search's budget of {s.minutes:g} minutes of training is spent"
        return ""

    # -- the next trial

    def next_trial(self, planned: int, busy: frozenset[int] = frozenset()):
        """The lowest-numbered trial an interruption left running and no one is training now (``busy``: trial
        numbers; continued: the search holds the directory, so its process is gone), else a new one while fewer
        than ``planned`` exist, else None. Its shape and lr are chosen here (:meth:`assign`)."""
        from optuna.trial import Trial, TrialState

        trial = None
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t.number not in busy:
                trial = Trial(self.study, t._trial_id)
                break
        if trial is None:
            started = self.study.get_trials(
                deepcopy=False, states=tuple(s for s in TrialState if s != TrialState.WAITING)
            )
            if len(started) >= planned:
                return None
            trial = self.study.ask()
        self.assign(trial)
        return trial

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

    def wait_for_earlier(self, trial, step: int) -> str:
        """At a rung's step, wait until every earlier trial has reached that rung or stopped (in-order successive
        halving: :func:`in_order_pruner`); returns why it must stop instead ("" to go on): the budget is spent,
        or a signal asked training to stop. Trials run one after another never wait here."""
        from optuna.trial import TrialState

        from kilolayer.train.signals import stop_requested

        rung = rung_of(self.study._storage.get_trial(trial._trial_id))
        if step < self.rung * self.settings.reduction_factor**rung:
            return ""
        key = f"completed_rung_{rung}"
        while True:
            waiting_for = [
                t.number
                for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t.number < trial.number and key not in t.system_attrs
            ]
            if not waiting_for:
                return ""
            stop = self.over_budget(*self.spent())
            if stop:
                return stop
            if stop_requested():
                return "stopped by a signal while waiting at a rung for earlier trials"
            time.sleep(self.POLL_S)

    # -- one trial

    def run(self, trial) -> str:
        """Train ``trial`` until it completes, is pruned, diverges or fails (each recorded in the study); returns
        why the search must stop ("" to go on)."""
        from kilolayer.train.run import Halted, train
        from kilolayer.train.signals import Interrupted

        s = self.settings
        name, lr, rel = self.assign(trial)
        shape = self.kept[name]
        run = self.out / rel
        frozen = self.study._storage.get_trial(trial._trial_id)
        reported = set(frozen.intermediate_values)
        seconds0 = float(frozen.user_attrs.get("seconds", 0.0))
        t0 = time.perf_counter()
        verdict = {"pruned": "", "budget": ""}

        def judge(step: int, value: float) -> str:
            """Report ``value`` at ``step`` (after the earlier trials reached this rung); why to stop, or ""."""
            waited = self.wait_for_earlier(trial, step)
            if waited:
                # not reported: the re-run that continues this trial judges it here first (``pending``)
                trial.set_user_attr("pending", [step, value])
                verdict["budget"] = waited
                return waited
            trial.report(value, step)
            reported.add(step)
            if "pending" in trial.user_attrs:
                trial.set_user_attr("pending", None)
            if trial.should_prune():
                verdict["pruned"] = self.prune_reason(trial, step, value)
                return f"pruned by kilolayer search: {verdict['pruned']}"
            return ""

        def on_eval(step: int, metrics: dict) -> str:
            if s.metric not in metrics:
                raise ConfigError(
                    f"--metric {s.metric}: not an evaluation metric of {self.config.objective.name} (it reports "
                    f"{', '.join(sorted(metrics))})"
                )
            elapsed = seconds0 + time.perf_counter() - t0
            trial.set_user_attr("seconds", elapsed)
            if step not in reported:
                stop = judge(step, float(metrics[s.metric]))
                if stop:
                    return stop if verdict["pruned"] else f"stopped by kilolayer search: {stop}"
            steps_others, seconds_others = self.spent(exclude=trial.number)  # others may be training at once
            verdict["budget"] = self.over_budget(steps_others + step, seconds_others + elapsed)
            return f"stopped by kilolayer search: {verdict['budget']}" if verdict["budget"] else ""

        pending = frozen.user_attrs.get("pending")
        if pending and pending[0] not in reported and judge(*pending):
            if verdict["pruned"]:
                return self._pruned(trial, run, verdict["pruned"])
            return verdict["budget"]

        self.log(f"[search] trial {trial.number}: {name} (lr {lr:.3g}) -> {run}")
        cfg = trial_config(self.config, shape, lr)
        try:
            train(cfg, run, resume=True, quiet=True, on_eval=on_eval)
        except Halted:
            trial.set_user_attr("seconds", seconds0 + time.perf_counter() - t0)
            if verdict["pruned"]:
                return self._pruned(trial, run, verdict["pruned"])
            return verdict["budget"]  # left running: a larger budget continues it
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

    def _pruned(self, trial, run: Path, reason: str) -> str:
        trial.set_user_attr("ended", "pruned")
        trial.set_user_attr("reason", reason)
        self.study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
        self.log(f"[search] trial {trial.number}: pruned at step {_steps_of(run)}")
        return ""

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
        r = rundir.RunDir(run)
        evals = [e for e in r.metrics() if e.get("split") == "eval"]
        record = r.final_eval(evals, on_damaged=lambda _: None)
        return float(record.get(self.settings.metric, math.nan))

    def prune_reason(self, trial, step: int, value: float) -> str:
        """Which rung's rule stopped ``trial`` at ``step``, in words: the competing values at that rung and the
        cut-off (the pruner's own arithmetic: the best 1/eta of them go on; of fewer than eta, the best)."""
        frozen = self.study._storage.get_trial(trial._trial_id)
        rung = max(
            (int(k.rsplit("_", 1)[1]) for k in frozen.system_attrs if k.startswith("completed_rung_")), default=0
        )
        key = f"completed_rung_{rung}"
        values = sorted(
            t.system_attrs[key]
            for t in self.study.get_trials(deepcopy=False)
            if key in t.system_attrs and t.number <= trial.number  # the pruner's field (in_order_pruner)
        )
        eta = self.settings.reduction_factor
        keep = max(len(values) // eta, 1)
        maximize = self.study.direction == self.optuna.study.StudyDirection.MAXIMIZE
        cutoff = values[-keep] if maximize else values[keep - 1]
        better = "higher" if maximize else "lower"
        where = self.rung * eta**rung
        return (
            f"successive halving, rung {rung} (step >= {where}): {self.settings.metric} {value:.6g} at step {step} is "
            f"not among the best {keep} of the {len(values)} trials that reached this rung, this one and those before "
            f"it (cut-off {cutoff:.6g}, "
            f"{better} is better)"
        )


def _enqueue(study, kept: list[str], lr: float | None) -> None:
    """One trial per shape first (at the config's lr), once per search."""
    if study.user_attrs.get("enqueued"):
        return
    for name in kept:
        study.enqueue_trial({"shape": name, **({"lr": lr} if lr is not None else {})}, skip_if_exists=True)
    study.set_user_attr("enqueued", True)


def collect(study, found: dict[str, Shape], out: Path, metric: str) -> list[TrialResult]:
    """Every started trial, from the study and its run directory."""
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
        if t.state == TrialState.COMPLETE:
            state, value, reason = "completed", t.value, status.get("reason", "")
        elif t.state == TrialState.PRUNED:
            state = "diverged" if ended == "diverged" else "pruned"
            value = t.intermediate_values[t.last_step] if t.last_step is not None else None
            reason = t.user_attrs.get("reason", "")
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
                step=r.step if run.is_dir() else 0,
                value=value,
                reason=reason,
                curve=curve,
                seconds=float(t.user_attrs.get("seconds", 0.0)),
            )
        )
    return results


def per_batch_metric(run: Path, metric: str) -> list[float]:
    """``metric`` of the run's chosen checkpoint on each of its evaluation batches, masks and noise drawn from one
    fixed seed, so that two runs of one config are scored on the same draws."""
    import torch

    from kilolayer.train.checkpoint import load_weights
    from kilolayer.train.engine import Engine, to_device

    config = load_config(run / rundir.CONFIG)
    ckpt = rundir.chosen_checkpoint(run, config.train.patience, on_damaged=lambda _: None)
    if ckpt is None:
        raise KilolayerError(f"{run}: no complete checkpoint to compare")
    engine = Engine(config, fresh=False)
    load_weights(engine.task, ckpt)
    values = []
    with engine.evaluating():
        torch.manual_seed(config.train.seed)
        for batch in engine.eval_data():
            found = engine.objective.evaluate(engine.task.backbone, [to_device(batch, engine.env.device)])
            values.append(float(found[metric]))
    return values


def compare_top(ranked: list[TrialResult], metric: str) -> Comparison | None:
    """The top two completed trials compared batch by batch (:class:`Comparison`); None with fewer than two or a
    single evaluation batch (no spread to measure)."""
    import statistics

    from kilolayer.study.findings import t_quantile

    done = [t for t in ranked if t.state == "completed"][:2]
    if len(done) < 2:
        return None
    a, b = (per_batch_metric(t.run, metric) for t in done)
    diffs = [x - y for x, y in zip(a, b)]
    if len(diffs) < 2:
        return None
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    bound = t_quantile(len(diffs) - 1, 0.975) * se
    return Comparison(done[0].number, done[1].number, metric, len(diffs), mean, se, bound, abs(mean) <= bound)


def _write_choice(search: Search) -> None:
    """best.yaml: the recommended trial's config; when the top two are within noise, tied-<shape>.yaml for each
    of them instead (the report says so rather than pick)."""
    from kilolayer.config import dump_yaml
    from kilolayer.files import write_atomic

    out = search.out
    for old in [out / "best.yaml", *out.glob("tied-*.yaml")]:
        old.unlink(missing_ok=True)
    done = [t for t in search.ranked if t.state == "completed"]
    if not done:
        return
    c = search.comparison
    if c is not None and c.tied:
        for t in done[:2]:
            write_atomic(out / f"tied-{t.shape.name}.yaml", dump_yaml(load_config(t.run / rundir.CONFIG)))
        return
    search.best = out / "best.yaml"
    write_atomic(search.best, dump_yaml(load_config(done[0].run / rundir.CONFIG)))


def race_here(racer: _Racer, planned: int) -> str:
    """The local executor: the trials one after another in this process; returns why a budget stopped them."""
    while True:
        stop = racer.over_budget(*racer.spent())
        if stop:
            return stop
        trial = racer.next_trial(planned)
        if trial is None:
            return ""
        stop = racer.run(trial)
        if stop:
            return stop


def run_search(
    config: Config,
    out: str | Path,
    settings: Settings,
    log=print,
    forecaster: Callable[[Config], tuple[str, str]] | None = None,
    race: Callable[[_Racer, int], str] | None = None,
) -> Search:
    """The whole search (module docstring) into ``out``; returns what the report shows. ``forecaster(config)``
    gives (verdict, reason) for the pre-screen (default: the doctor's forecast); ``race(racer, planned)`` runs
    the trials and says why a budget stopped them (default :func:`race_here`; Ray's:
    :class:`kilolayer.study.search_ray.RayRace`)."""
    race = race or race_here
    out = Path(out)
    config = check_settings(config, settings)
    optuna = _import_optuna()
    found = shapes(config, settings.params, settings.depths, settings.tolerance)
    if not found:
        span = f" at depths {settings.depths[0]}..{settings.depths[1]}" if settings.depths else ""
        raise ConfigError(
            f"--params {settings.params:,}: no shape of head size {config.model.width // config.model.heads}{span} "
            f"is within {settings.tolerance:.0%} of it; widen --tolerance or --depths"
        )
    _check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    with rundir.RunLock(out, LOCK, "kilolayer search"):
        _check_same_search(out, config, settings)
        screens = prescreen(
            config,
            found,
            out,
            settings.keep_forecast_failures,
            forecaster or (lambda c: doctor_forecast(c, settings.forecast_steps)),
            log,
        )
        kept = {s.name: s for s, sc in zip(found, screens) if sc.kept}
        rung = first_rung(config, settings)
        dirn = direction(config, settings.metric)
        search = Search(config, settings, out, found, screens, [], 0, dirn, rung)
        if kept:
            planned = len(kept) if settings.lr_factor is None else settings.trials or 2 * len(kept)
            search.planned = planned
            study = _open_study(optuna, out, config, settings, rung, dirn)
            study.set_user_attr("lr", config.train.lr)
            _enqueue(study, list(kept), config.train.lr if settings.lr_factor is not None else None)
            racer = _Racer(optuna, study, config, settings, kept, out, log)
            search.stopped_by_budget = race(racer, planned)
            search.trials = collect(study, kept, out, settings.metric)
        else:
            search.notes.append(
                "every shape was forecast to diverge or stall, so none was trained; --keep-forecast-failures "
                "races them anyway"
            )
        search.comparison = compare_top(search.ranked, settings.metric)
        _write_choice(search)
    return search
