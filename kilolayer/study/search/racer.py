"""The race's trials: each trained to a rung and judged there by synchronous successive halving
(:class:`_Racer`, :func:`promote`)."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

from kilolayer import rundir
from kilolayer.config import Config
from kilolayer.errors import ConfigError, DivergedError, KilolayerError
from kilolayer.study.search.compare import compare_runs
from kilolayer.study.search.directory import STARTS, TRIALS, config_key, seconds_outside_trials
from kilolayer.study.search.result import _final_value
from kilolayer.study.search.screen import starts_from_prescreen
from kilolayer.study.search.settings import first_rung, rung_steps, unknown_metric
from kilolayer.study.search.shape import Shape, trial_config


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
        self.precision = None  # what auto decides for every trial (host.precision_sharing); None: each its own
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
                raise unknown_metric(self.config, s.metric, metrics)
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

        saved = rundir.complete_checkpoints(self.out / STARTS / config_key(config))
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
        shutil.rmtree(self.out / STARTS / config_key(config), ignore_errors=True)
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
