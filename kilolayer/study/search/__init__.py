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

import time
from collections.abc import Callable
from pathlib import Path

from kilolayer import rundir
from kilolayer.config import Config
from kilolayer.errors import ConfigError
from kilolayer.nn.budget import count_parameters
from kilolayer.study.executors import Executor
from kilolayer.study.search.choice import _write_choice
from kilolayer.study.search.compare import Comparison
from kilolayer.study.search.directory import (
    CHOICE,
    LOCK,
    PLAN,
    SETTINGS,
    STARTS,
    TRIALS,
    _check_out,
    _check_same_search,
    config_key,
    seconds_outside_trials,
)
from kilolayer.study.search.journal import _enqueue, _import_optuna, _open_study
from kilolayer.study.search.plan import (
    Cost,
    Plan,
    estimate_seconds,
    measure_costs,
    plan_steps,
    saved_plan,
    time_plan,
    with_steps,
)
from kilolayer.study.search.pool import race, race_here
from kilolayer.study.search.racer import _Racer, promote
from kilolayer.study.search.result import Search, TrialResult, collect, compare_top
from kilolayer.study.search.screen import (
    DROPPED,
    Screen,
    doctor_forecast,
    forecast_steps,
    prescreen,
    starts_from_prescreen,
)
from kilolayer.study.search.settings import (
    Settings,
    check_settings,
    direction,
    first_rung,
    rung_steps,
    unknown_metric,
)
from kilolayer.study.search.shape import (
    Shape,
    _shaped,
    closest_shape,
    default_depths,
    narrowest,
    parse_depths,
    percent,
    shape_name,
    shapes,
    trial_config,
)
from kilolayer.train import host
from kilolayer.train.run import shared_precision

# the search's public face, and the parts its tests and benchmarks drive one at a time
__all__ = [
    "CHOICE",
    "DROPPED",
    "LOCK",
    "STARTS",
    "TRIALS",
    "Comparison",
    "Cost",
    "Plan",
    "Screen",
    "Search",
    "Settings",
    "Shape",
    "TrialResult",
    "_Racer",
    "_check_same_search",
    "_enqueue",
    "_open_study",
    "_shaped",
    "_write_choice",
    "check_settings",
    "closest_shape",
    "compare_top",
    "count_parameters",
    "estimate_seconds",
    "forecast_steps",
    "measure_costs",
    "narrowest",
    "parse_depths",
    "plan_steps",
    "prescreen",
    "promote",
    "race",
    "race_here",
    "run_search",
    "rung_steps",
    "seconds_outside_trials",
    "shape_name",
    "shapes",
    "starts_from_prescreen",
    "time_plan",
    "trial_config",
    "with_steps",
]


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
        raise unknown_metric(config, metric, found)


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
    out = Path(out)
    config = check_settings(config, settings)
    _check_out(out)
    found = shapes(config, settings.params, settings.depths, settings.tolerance)
    # the shapes raced against one another train at one precision: auto decided here once for them all, and for
    # the pre-screen and the time plan too; a re-run goes on at the one its trials recorded
    trials = sorted((out / TRIALS).iterdir()) if (out / TRIALS).is_dir() else []
    precision = shared_precision([trial_config(config, s, config.train.lr) for s in found], trials)
    with host.precision_sharing(precision):
        return _search(config, out, settings, found, log, forecaster, executor, measure, started, precision)


def _search(config, out, settings, found, log, forecaster, executor, measure, started, precision) -> Search:
    executor = executor or Executor()
    optuna = _import_optuna()
    lo, hi = settings.depths or default_depths(config.model)
    if not found:
        least = narrowest(config.model, lo)
        raise ConfigError(
            f"--params {settings.params:,}: even the narrowest shape at depth {lo} ({shape_name(least)}, "
            f"{count_parameters(least):,} parameters) exceeds it by more than {percent(settings.tolerance)}; raise "
            f"--params or --tolerance"
        )
    left_out = (found[-1].layers + 1, hi) if found[-1].layers < hi else None
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
        with host.torch_threads(executor.unit_threads):  # a trial starts from its replay: one thread count for both
            screens = prescreen(
                config,
                found,
                out,
                settings.keep_forecast_failures,
                forecaster or (lambda c: doctor_forecast(c, steps, out / STARTS / config_key(c) if keep else None)),
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
            racer.precision = precision
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
