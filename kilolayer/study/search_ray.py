"""Run a search's trials as Ray tasks, on one machine or a cluster (``kilolayer search ... --executor ray``).

The driver (the ``kilolayer search`` process) holds the search: its lock, its Optuna study and the choice of
each trial's shape and learning rate (the sampler's draws are the same as the local executor's). Each trial is
one Ray task that opens the same study (Optuna's journal file under ``--out``) and trains the trial in its
worker exactly as the local executor does (:meth:`kilolayer.study.search._Racer.run`): an ordinary run
directory, its evaluations reported to its trial. As many trials run at once as the cluster has room for
(``--cpus-per-run``, ``--gpus-per-run``); they are submitted in trial order, each as soon as a slot frees.

Pruning is successive halving judged synchronously (:class:`kilolayer.study.search._Racer`): the trials racing
at a rung train at once, each pausing at the rung with a checkpoint; when every one has returned, the driver
keeps the best 1/eta and prunes the rest, so the leaderboard is the local executor's whatever the number of
trials at once or which finished first. The cost is the barrier: a slot idles when a rung has fewer trials
left than slots.

The cluster side is the study's (:mod:`kilolayer.study.ray_executor`): the same preflight, loopback-only Ray
when no ``--address`` is given, and the check that every node sees ``--out`` (one shared file system). A task
whose worker dies is retried by Ray and continues its trial from its newest checkpoint; a task that still
fails records its trial failed, and the search goes on. Ctrl-C cancels every task (each trial saves a
checkpoint and stays running in the study; re-running the search continues them).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from kilolayer.study import ray_executor as RE
from kilolayer.study.search import _import_optuna, _open_study, _Racer, direction, first_rung


def trial_task(racer_args: tuple, trial_id: int, level: int, threads: int) -> dict:
    """Task: train one trial to rung ``level`` (the search's ``_Racer.run`` in this worker); returns why the
    search must stop ("" to go on) and the lines it logged."""
    import ray

    if not ray.get_runtime_context().get_accelerator_ids().get("GPU"):
        # a trial uses the GPUs it reserved, and none without (Ray leaves them all visible then); read when this
        # worker first touches CUDA, and every trial of a search reserves alike
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    from optuna.trial import Trial

    config, settings, kept, out = racer_args
    optuna = _import_optuna()
    study = _open_study(optuna, out, config, settings, first_rung(config, settings), direction(config, settings.metric))
    lines: list[str] = []
    racer = _Racer(optuna, study, config, settings, kept, out, lines.append)
    torch.set_num_threads(threads)
    # Ray workers ignore SIGINT, and ray.cancel interrupts a running task by simulating one: let training's
    # stop signals see it (a checkpoint, the trial left running)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stop = racer.run(Trial(study, trial_id), level)
    finally:
        signal.signal(signal.SIGINT, previous)
    return {"stop": stop, "log": lines}


@dataclass
class RayRace:
    """The Ray executor's ``race`` for :func:`kilolayer.study.search.run_search` (module docstring)."""

    address: str | None = None
    cpus_per_run: float = 1
    gpus_per_run: float = 0

    def __call__(self, racer: _Racer, planned: int) -> str:
        ray = RE.preflight(self.address)
        root = racer.out.resolve()  # tasks run elsewhere: they get the absolute path
        RE.connect(ray, self.address)
        token_path = None
        try:
            token_path, _ = RE.check_shared(ray, root, self.cpus_per_run, self.gpus_per_run)
            res = ray.cluster_resources()
            slots = int(res.get("CPU", 0) // self.cpus_per_run)
            if self.gpus_per_run:
                slots = min(slots, int(res.get("GPU", 0) // self.gpus_per_run))
            slots = max(1, slots)
            racer.log(
                f"[search] Ray: {len(ray.nodes())} node(s), {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU; "
                f"up to {slots} trial(s) at once, each {self.cpus_per_run:g} CPU, {self.gpus_per_run:g} GPU"
            )
            return self._drive(ray, racer, planned, root, slots)
        finally:
            if token_path is not None:
                token_path.unlink(missing_ok=True)
            ray.shutdown()

    def _drive(self, ray, racer: _Racer, planned: int, root: Path, slots: int) -> str:
        """Synchronous successive halving: the trials racing at a rung trained at once (as many as there are
        slots), then the rung judged here once all have returned (:meth:`_Racer.judge`)."""
        task = ray.remote(trial_task).options(
            num_cpus=self.cpus_per_run, num_gpus=self.gpus_per_run, max_retries=RE.MAX_RETRIES
        )
        args = ray.put((racer.config, racer.settings, racer.kept, root))
        threads = max(1, int(self.cpus_per_run))
        racer.create(planned)
        stop = ""
        for level in range(len(racer.rungs) + 1):
            stop = self._rung(ray, task, args, threads, racer, level, slots)
            if stop:
                return stop
            if level < len(racer.rungs):
                racer.judge(level)
        return ""

    def _rung(self, ray, task, args, threads: int, racer: _Racer, level: int, slots: int) -> str:
        queue = racer.todo(level)
        pending: dict = {}  # ObjectRef -> trial
        stop = ""
        try:
            while True:
                while not stop and queue and len(pending) < slots:
                    stop = racer.over_budget(*racer.spent())
                    if stop:
                        break
                    trial = queue.pop(0)
                    pending[task.remote(args, trial._trial_id, level, threads)] = trial
                if not pending:
                    return stop
                done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for ref in done:
                    trial = pending.pop(ref)
                    try:
                        value = ray.get(ref)
                    except ray.exceptions.RayError as err:
                        self._book_failure(racer, trial, err)
                        continue
                    for line in value["log"]:
                        racer.log(line)
                    stop = stop or value["stop"]
        except BaseException:
            if pending:  # Ctrl-C or a refusal: every trial saves a checkpoint and stays running in the study
                racer.log(f"[search] cancelling {len(pending)} trial(s); re-run the same command to continue them")
                for ref in pending:
                    ray.cancel(ref)
                _, left = ray.wait(list(pending), num_returns=len(pending), timeout=RE.CANCEL_WAIT_S)
                for ref in left:
                    ray.cancel(ref, force=True)
            raise

    @staticmethod
    def _book_failure(racer: _Racer, trial, err) -> None:
        """Ray gave up on a task (retries spent): its trial is failed unless it recorded an end of its own."""
        from optuna.trial import TrialState

        frozen = racer.study._storage.get_trial(trial._trial_id)
        if frozen.state == TrialState.RUNNING:
            racer.failed(trial, f"Ray task: {RE._error_line(err)}", float(frozen.user_attrs.get("seconds", 0.0)))
