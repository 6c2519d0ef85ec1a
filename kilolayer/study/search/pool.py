"""The race on an executor's pool (:mod:`kilolayer.study.executors`): each rung's trials trained as many at once
as the pool has slots, in this process or as Ray tasks (:func:`trial_task`), then the rung judged here."""

from __future__ import annotations

from kilolayer.study.search.journal import _import_optuna, _open_study
from kilolayer.study.search.racer import _Racer
from kilolayer.study.search.settings import direction, first_rung


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
        args = (racer.config, racer.settings, racer.kept, racer.out.resolve(), racer.threads, racer.precision)
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
    from optuna.trial import Trial

    from kilolayer.train import host

    config, settings, kept, out, train_threads, precision = racer_args
    optuna = _import_optuna()
    study = _open_study(optuna, out, config, settings, first_rung(config, settings), direction(config, settings.metric))
    lines: list[str] = []
    racer = _Racer(optuna, study, config, settings, kept, out, lines.append, train_threads)
    # Ray workers ignore SIGINT, and ray.cancel interrupts a running task by simulating one: let training's
    # stop signals see it (a checkpoint, the trial left running)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with host.torch_threads(threads), host.precision_sharing(precision):
            stop = racer.run(Trial(study, trial_id), level)
    finally:
        signal.signal(signal.SIGINT, previous)
    return {"stop": stop, "log": lines}
