"""What a search is and how much it may spend (:class:`Settings`, checked by :func:`check_settings`), and the
rungs it judges its trials at (:func:`rung_steps`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from types import SimpleNamespace

from kilolayer.config import Config, load_config
from kilolayer.errors import ConfigError
from kilolayer.train.policies import early_stop_mode


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


def unknown_metric(config: Config, metric: str, reported) -> ConfigError:
    """The one line for a ``--metric`` that the config's objective does not report (``reported``: the metrics it
    does)."""
    return ConfigError(
        f"--metric {metric}: not an evaluation metric of {config.objective.name} (it reports "
        f"{', '.join(sorted(reported))})"
    )


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
