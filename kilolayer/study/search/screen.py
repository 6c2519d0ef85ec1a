"""The pre-screen: each shape forecast by the doctor (:func:`kilolayer.doctor.forecast`) before the race; those
forecast to diverge, or to stall while another shape is forecast clearly better, are not raced
(:func:`prescreen`). The forecast's replay of a shape's first steps is saved for its trial to start from
(:func:`starts_from_prescreen`)."""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kilolayer import rundir
from kilolayer.config import Config
from kilolayer.study.search.directory import PRESCREEN, STARTS, config_key
from kilolayer.study.search.settings import Settings, first_rung
from kilolayer.study.search.shape import Shape, trial_config

DROPPED = ("diverges", "stalls")  # forecast verdicts the pre-screen drops


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
        key = config_key(cfg)
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
            shutil.rmtree(out / STARTS / config_key(trial_config(config, s, config.train.lr)), ignore_errors=True)
    return screens
