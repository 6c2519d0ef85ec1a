"""A training run: an :class:`~kilolayer.train.engine.Engine` given a home on disk.

:class:`Run` owns the run directory (layout and status lifecycle: :mod:`kilolayer.rundir`): its lock, the
status it records, ``config.yaml``, ``metrics.jsonl`` (+ TensorBoard), checkpoints, the efficiency of its
steps, and the stop signals. ``train(config, out_dir, resume=False)`` is ``kilolayer train``. A diverged run
raises :class:`~kilolayer.errors.DivergedError` (exit code 3 from the CLI) after recording ``status:
diverged`` with its step and reason; SIGINT and SIGTERM stop at the next step boundary with a checkpoint and
raise :class:`~kilolayer.train.signals.Interrupted` (exit 130 / 143) after recording ``interrupted``; any
other error records ``failed`` with its reason. Nothing in the directory changes until training has started:
a run refused during set-up keeps its status.

Each evaluation is an ``eval`` record and a line of the progress output; an objective with baselines (seq2seq:
the scores of predictors that do not translate, on the evaluation's pairs) has them computed once, at the first
evaluation, written to ``baselines.json`` and quoted on every evaluation line.

Train records carry the run's efficiency (:mod:`kilolayer.train.metrics`: ``tokens_per_s``, ``flops_per_s``,
``mfu``, ``peak_mem_gib``, ``train_s``) over the training time since the previous record; evaluation,
diagnostics and checkpoints are not training time. With ``train.patience`` > 0 the run stops early on a
plateau (:class:`~kilolayer.train.policies.EarlyStopping`); every improvement is saved as a checkpoint that
rotation keeps while the run needs it, and ``status.json`` says ``completed`` with ``stopped_early``,
``best_step`` and the reason.

A caller may watch the evaluations: ``on_eval(step, metrics)`` is called after each one, and a non-empty line it
returns stops the run at that step with a checkpoint, recorded ``interrupted`` with that line as its reason (a
resume continues it), by raising :class:`Halted`. ``kilolayer search`` races its trials this way.

Its intra-op thread count is one count for the whole run (:mod:`kilolayer.train.host.threads`; only
``train.threads: auto`` follows the machine's load); ``status.json`` records it (``threads``,
``threads_reason``, ``threads_adaptive``), every train record carries the count it ran at, and a resume reuses
the recorded count unless ``train.threads`` says otherwise (float reductions are ordered by the thread count, so
a resume is bit-exact only at the same count). Its precision is decided once, before the engine is built
(:mod:`kilolayer.train.host.precision`: ``train.precision`` as given, or ``auto``); ``status.json`` records it
(``precision``, ``precision_reason``) and so does each checkpoint's state.json, the run's first lines say it,
and a resume of an ``auto`` run reuses it. While it trains, :func:`train` marks the process as a kilolayer
run on this machine, so that a run started beside it sees it.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kilolayer import rundir
from kilolayer.config import Config, config_changes, dump_yaml, load_config
from kilolayer.data.text import codec_for
from kilolayer.errors import ConfigError, DivergedError, KilolayerError
from kilolayer.files import write_atomic
from kilolayer.train import checkpoint as ckpt
from kilolayer.train import distributed as D
from kilolayer.train import engine as E
from kilolayer.train import host
from kilolayer.train import metrics as M
from kilolayer.train.engine import Engine, StepStats
from kilolayer.train.logging import MetricsLog, Progress, eval_line
from kilolayer.train.signals import Interrupted, StopSignals


class Halted(KilolayerError):
    """The caller's ``on_eval`` stopped the run (recorded ``interrupted``: a resume continues it)."""


class Run:
    """One training process's run in ``out_dir``: set-up (``__init__``: claim the directory, build the engine,
    restore the newest intact checkpoint on ``resume``), then :meth:`run`. :func:`train` wraps it with what a
    process does around a run (config resolution, the memory check, the thread policy, stop signals, the
    process group's teardown); a ``Run`` made directly trains at the process's thread count, signals unhandled."""

    def __init__(
        self,
        config: Config,
        out_dir: Path,
        resume: bool = False,
        quiet: bool = False,
        overwrite: bool = False,
        signals: StopSignals | None = None,
        threads: host.Threads | None = None,
        on_eval: Callable[[int, dict], str] | None = None,
        resume_hint: str = "",
        crowded: str = "",
    ):
        self.config, self.out, self.resume, self.quiet = config, Path(out_dir), resume, quiet
        self.signals = signals
        self.on_eval = on_eval
        # how to continue after a stop, in the stop's message (a caller such as kilolayer search gives its own)
        self.resume_hint = resume_hint or f"kilolayer train --resume --out {self.out}"
        self.halt = ""  # why on_eval asked the run to stop ("" while it has not)
        self.announce = threads is not None  # the run's first line says the count and why
        self.crowded = crowded  # the line that says other runs train here too ("" if none need saying)
        own = host.Threads(torch.get_num_threads(), "this process's setting", source="process")
        self.threads = host.Adapter(threads or own)
        tc = config.train
        self.env = D.setup(tc.device)
        if tc.batch_size % (self.env.world * tc.accumulate):
            raise ConfigError(
                f"train.batch_size={tc.batch_size}: must be divisible by processes x train.accumulate "
                f"({self.env.world} x {tc.accumulate})"
            )
        self.lock: rundir.RunLock | None = None
        self.baseline_scores: dict | None = None  # baselines.json, once computed
        self.life: rundir.Lifecycle | None = None  # rank 0's status.json
        self.engine: Engine | None = None
        self.started = False  # status.json says running: from here on every exit is recorded
        self.created = False
        self.had_run = True  # whether --out held a run before this one (rank 0 looks)
        self.replace = False
        self._claim(overwrite)
        try:
            self._setup()
        except BaseException as err:
            out = self._ended(err)
            self._abandon()
            if out is err:
                raise
            raise out from None

    def _setup(self) -> None:
        latest = (
            rundir.intact_checkpoint(self.out, on_damaged=rundir.warn if self.env.main else _quiet)
            if self.resume
            else None
        )
        self.precision = self._precision(latest)
        self.engine = Engine(self.config, self.env, fresh=latest is None, precision=self.precision.value)
        self.start_step = 0
        self.last_record = 0  # the step of the newest train record (what the next one counts from)
        if latest is not None:
            self._restore(latest)
        elif self.resume and not self.had_run and self.env.main and not self.quiet:
            # resume-or-start (a study's points rely on it), said aloud: the --out may be a typo
            rundir.say(f"kilolayer: {self.out} holds no run to resume: starting a new run", sys.stderr)
        tc = self.config.train
        if tc.patience and tc.eval_every:
            self.engine.check_early_stop_metric()
        self._begin(latest)

    # -------------------------------------------------------------- the directory

    def _claim(self, overwrite: bool) -> None:
        """Rank 0 takes the run directory's lock and checks, under it, that this run may write there; the
        other ranks learn the outcome, so a refusal ends every process instead of leaving some waiting."""
        error = None
        if self.env.main:
            try:
                rundir.check_out(self.out)
                self.created = not self.out.exists()
                self.had_run = rundir.is_run_dir(self.out)
                self.out.mkdir(parents=True, exist_ok=True)
                self.lock = rundir.RunLock(self.out).acquire()
                if not self.resume and rundir.is_run_dir(self.out):
                    if not overwrite:
                        st = rundir.read_status(self.out)
                        what = f" ({st['status']} at step {st.get('step', 0)})" if st.get("status") else ""
                        raise ConfigError(
                            f"{self.out}: already holds a run{what}; add --resume to continue it, "
                            f"--overwrite to replace it, or choose another --out"
                        )
                    self.replace = True  # cleared once set-up has succeeded
            except KilolayerError as err:
                error = err
            except OSError as err:
                error = rundir.os_error(err, self.out)
        if self.env.active:
            failed = torch.tensor([error is not None], dtype=torch.int64)
            if D.all_sum(failed, self.env).item():
                error = error or rundir.RunDirError(f"{self.out}: refused by rank 0 (see its message)")
        if error is not None:
            self._abandon()
            raise error

    def _abandon(self) -> None:
        """Set-up failed before training started: release the lock, and leave a directory this process
        created as it was (gone)."""
        if self.lock is None:
            return
        self.lock.release()
        self.lock = None
        if not self.started and rundir.is_empty(self.out):
            (self.out / rundir.LOCK).unlink(missing_ok=True)
            if self.created:
                with contextlib.suppress(OSError):
                    self.out.rmdir()

    def close(self) -> None:
        """Release the run directory (the lock also dies with the process)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _precision(self, latest: Path | None) -> host.Precision:
        """The precision of the whole run, decided by rank 0 (a resume of an ``auto`` run keeps its own)."""
        chosen = None
        if self.env.main:
            tc = self.config.train
            recorded = recorded_precision(self.out, latest) if self.resume and tc.precision == "auto" else None
            chosen = host.precision_policy(tc.precision, self.env.device, self.config, E.step_speedup, recorded)
        return D.from_main(chosen, self.env)

    def _begin(self, latest: Path | None) -> None:
        """Set-up succeeded: from here on the run directory changes. status.json says running, config.yaml
        holds the config trained with now, and a resume is recorded in resume.json."""
        if self.env.main:
            self.life = rundir.Lifecycle(self.out)
            self._record_threads()
            self.life.fields.update(precision=self.precision.value, precision_reason=self.precision.reason)
            if self.engine.init_from is not None:  # every status of the run says what it started from
                self.life.fields["init_from"] = self.engine.init_from
            previous = self._saved_config() if self.resume else None
            if self.replace:
                rundir.clear_run(self.out)
            ckpt.remove_partial(self.out)
            if latest is None:
                (self.out / rundir.METRICS).unlink(missing_ok=True)  # a restart from step 0 logs anew
                self.life.running(0)
            else:
                rundir.truncate_metrics(self.out, self.start_step)
                trained = [r["step"] for r in rundir.read_metrics(self.out) if r.get("split") == "train"]
                self.last_record = max(trained, default=0)
                for later in rundir.complete_checkpoints(self.out):
                    if rundir.checkpoint_step(later) > self.start_step:
                        shutil.rmtree(later, ignore_errors=True)  # damaged (reported): this run replays them
                self.life.running(self.start_step, resumed_from=latest.name)
            self.started = True
            write_atomic(self.out / rundir.CONFIG, dump_yaml(self.config))
            codec = codec_for(self.config, self.engine.source)
            if codec is not None:  # kilolayer.load reads the model's text with it once the data is gone
                codec.save(self.out)
            if self.resume:
                rundir.record_resume(self.out, self.start_step, config_changes(previous, self.config))
        self.started = True
        D.barrier(self.env)

    def _record_threads(self) -> None:
        """The thread count in every status from here on: a resume reuses it (float reductions follow it)."""
        chosen = self.threads.threads
        self.life.fields.update(threads=chosen.count, threads_reason=chosen.reason, threads_adaptive=chosen.adaptive)

    def _saved_config(self) -> Config | None:
        try:
            return load_config(self.out / rundir.CONFIG)
        except KilolayerError:
            return None

    def _ended(self, err: BaseException) -> BaseException:
        """Record how the run ended (once training has started); returns the exception to raise, with an
        operating-system error turned into one line."""
        if isinstance(err, OSError):
            err = rundir.os_error(err)
        if self.life is not None and self.started and self.life.final is None:
            if isinstance(err, (Interrupted, Halted, KeyboardInterrupt)):
                status = "interrupted"
            else:
                status = "failed"
            reason = str(err) if isinstance(err, KilolayerError) else f"{err.__class__.__name__}: {err}"
            self.life.finish(status, self.engine.step if self.engine else 0, reason)
        return err

    def _restore(self, path: Path) -> None:
        data = ckpt.load_checkpoint(path)
        ckpt.check_fits(path / "model.safetensors", data["model"], self.engine.task.state_dict())
        dropped = self.engine.load_state(data, path)
        if dropped and self.env.main:
            rundir.warn(dropped)
        self.start_step = self.engine.step

    def save(self, step: int) -> None:
        """A checkpoint of step ``step`` (every process takes part; rank 0 writes)."""
        tc = self.config.train
        state = self.engine.state(step)
        if self.env.main:
            # early stopping keeps the best checkpoint too: rotation is rundir's, which spares it
            keep = 2**31 if tc.patience else tc.keep_checkpoints
            ckpt.save_checkpoint(
                self.out,
                step,
                state["model"],
                state["optimizer"],
                state["rng"],
                state["state"],
                state["extra"],
                keep=keep,
            )
            if tc.patience:
                rundir.prune_checkpoints(self.out, tc.keep_checkpoints)
        D.barrier(self.env)

    def evaluate(self, step: int) -> dict:
        """The engine's evaluation, and the objective's samples of this step if it draws any (e.g. MAE's
        original / masked / reconstruction grid)."""
        metrics = self.engine.evaluate()
        save = getattr(self.engine.objective, "save_samples", None)
        # under FSDP a forward pass on rank 0 alone would wait for the other ranks' shards: no samples there
        sharded = self.env.active and self.config.train.parallel == "fsdp"
        if save is not None and self.env.main and not sharded:
            with self.engine.evaluating():
                save(
                    self.engine.task.backbone, self.engine.eval_batch(8), self.out / "samples" / f"step_{step:08d}.png"
                )
        return metrics

    # -------------------------------------------------------------- the loop

    def run(self) -> dict:
        """Train from the start step to ``train.steps``; every way out is recorded in status.json."""
        tc, engine = self.config.train, self.engine
        chosen = self.threads.threads
        if self.env.main and not self.quiet and self.announce:
            rundir.say(chosen.line(), sys.stderr)
            if self.crowded:
                rundir.warn(self.crowded)
        elif self.env.main and chosen.recorded is not None:  # said even under --quiet: a study's log keeps it
            rundir.warn(
                f"resumed at {chosen.count} thread{'s' * (chosen.count != 1)} (OMP_NUM_THREADS), not at the "
                f"{chosen.recorded} this run recorded: its numbers differ from an uninterrupted run's in the last bits"
            )
        elif self.env.main and chosen.adaptive:  # said even under --quiet, as above
            rundir.warn(
                f"train.threads: {host.AUTO} follows the machine's load, so this run's losses are not "
                "bit-reproducible (give a count for that)"
            )
        if self.env.main and not self.quiet:
            rundir.say(self.precision.line(), sys.stderr)
        with self._recorded(), self._logs():
            if self.signals is not None:
                self.signals.armed = True  # from here a signal waits for the step boundary
            if engine.early_stopping.plateaued:
                return self._complete(self.start_step)  # resumed after an early stop: nothing left to do
            engine.model.train()
            for step in range(self.start_step + 1, tc.steps + 1):
                stats = engine.train_step(step)
                self._stop_if_diverged(step, stats.loss)
                engine.update(step, stats)
                if self.threads.check() is not None and self.life is not None:
                    self._record_threads()
                    self.life.running(step)
                if self.meter is not None:
                    self.meter.add(stats.tokens * self.env.world, stats.flops * self.env.world)
                self._log_train(step, stats)
                with self._paused():  # diagnostics, evaluation and checkpoints are not training time
                    if stats.layer_grads is not None:
                        self._write(engine.diagnostics(step, *stats.layer_grads))
                    improved, stop = self._evaluate_on_schedule(step)
                    saved = self._save_on_schedule(step, improved or stop or bool(self.halt))
                if stop:
                    return self._complete(step)
                self._stop_on_signal(step, saved)
            if tc.steps == 0 and self.start_step == 0:
                self.save(0)  # an untrained run is still a run: analysis can load it
            return self._complete(tc.steps)

    def _stop_if_diverged(self, step: int, loss: float) -> None:
        """Raise :class:`DivergedError` (after recording ``diverged``) without applying the step's update."""
        reason = self.engine.diverged(step, loss)
        if reason:
            if self.log:
                self.log.write({"step": step, "split": "train", "loss": loss})
                self.life.finish("diverged", step, reason)
            raise DivergedError(reason)

    def _evaluate_on_schedule(self, step: int) -> tuple[bool, bool]:
        """Evaluate every ``train.eval_every`` steps and at the last; returns (a new best, early stop)."""
        tc = self.config.train
        on_grid = bool(tc.eval_every) and step % tc.eval_every == 0
        if not (on_grid or step == tc.steps):
            return False, False
        metrics = self.evaluate(step)
        self._write({"step": step, "split": "eval", **metrics})
        if self.env.main:
            self.progress.note(eval_line(f"eval step {step}", metrics, self._baselines().get("baselines", {})))
        if self.on_eval is not None and step < tc.steps:
            self.halt = self.on_eval(step, metrics) or ""
        # only the evaluations every eval_every steps count: a leg that ended off that grid (and evaluated
        # there) resumes exactly as if it had never stopped
        if not (tc.patience and on_grid):
            return False, False
        stopping = self.engine.early_stopping
        return self._agree(stopping.track(step, metrics)), self._agree(stopping.plateaued)

    def _baselines(self) -> dict:
        """The engine's baselines on the evaluation's pairs, computed once in this process and written to
        baselines.json (rank 0; {} for an objective without them)."""
        if self.baseline_scores is None:
            self.baseline_scores = self.engine.baselines()
            if self.baseline_scores:
                rundir.write_json(self.out / rundir.BASELINES, {"data": self.config.data.name, **self.baseline_scores})
        return self.baseline_scores

    def _save_on_schedule(self, step: int, early_stopping: bool) -> bool:
        """Checkpoint every ``train.checkpoint_every`` steps, at the last, and where early stopping asks (the
        best, and where it stopped); returns whether it saved."""
        tc = self.config.train
        saved = bool(tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == tc.steps or early_stopping
        if saved:
            self.save(step)
        return saved

    def _stop_on_signal(self, step: int, saved: bool) -> None:
        """A SIGINT/SIGTERM arrived, or ``on_eval`` asked to stop: finish the step with a checkpoint, so a resume
        replays nothing, and stop."""
        # agreed only where a caller watches the evaluations: plain training adds no collective per step
        if self.on_eval is not None and self._agree(bool(self.halt)):
            if not saved:
                self.save(step)
            raise Halted(f"{self.halt} (checkpoint step {step} saved); continue with: {self.resume_hint}")
        signum = self._stop_signal() if step < self.config.train.steps else 0
        if signum:
            if not saved:
                self.save(step)
            raise Interrupted(
                f"interrupted by {signal.Signals(signum).name} at step {step} (checkpoint step {step} "
                f"saved); continue with: {self.resume_hint}",
                signum,
            )

    def _stop_signal(self) -> int:
        """The signal that asked training to stop (0 if none), agreed by every process."""
        return D.all_max(self.signals.signum if self.signals is not None else 0, self.env)

    def _agree(self, flag: bool) -> bool:
        """True on every process if it is true on any (decisions that lead to collective work)."""
        return bool(D.all_max(int(flag), self.env))

    @contextlib.contextmanager
    def _recorded(self):
        """Record how the run ended in status.json, whatever the exit; release the run directory."""
        try:
            yield
        except BaseException as err:
            out = self._ended(err)
            if out is err:
                raise
            raise out from None
        finally:
            self.close()

    # -------------------------------------------------------------- logging and metrics

    @contextlib.contextmanager
    def _logs(self):
        """Rank 0's metrics.jsonl (+ TensorBoard), progress line and efficiency meter, for the loop's duration."""
        tc, env = self.config.train, self.env
        self.progress = Progress(tc.steps, self.start_step, enabled=env.main and not self.quiet)
        self.log, self.meter = None, None
        try:
            self.log = MetricsLog(self.out, tensorboard=True) if env.main else None
            self.meter = self._meter() if env.main else None
            yield
        finally:
            self.progress.close()
            if self.log:
                self.log.close()

    def _write(self, record: dict) -> None:
        if self.log:
            self.log.write(record)

    def _paused(self):
        """The efficiency meter's clock stopped (rank 0)."""
        return self.meter.paused() if self.meter is not None else contextlib.nullcontext()

    def _log_train(self, step: int, stats: StepStats) -> None:
        """Every ``train.log_every`` steps and at the last: the train record (loss, lr, gradient norm, tokens and
        the efficiency since the previous record) and the progress line."""
        tc = self.config.train
        if not self.log or not (step % tc.log_every == 0 or step == tc.steps):
            return
        eff = self.meter.report()
        if eff.get("mfu", 0) > 1 and not self.peak_warned:
            self.peak_warned = True
            rundir.warn(host.peak_too_low(self.peak, eff["mfu"], step))
        lr = self.engine.lr()
        record = {"step": step, "split": "train", "loss": stats.loss, "lr": lr, "grad_norm": float(stats.grad_norm)}
        data = self.engine.source.log_fields(self.last_record, step)
        self.last_record = step
        self.log.write({**record, **data, "tokens": self.engine.tokens, "threads": self.threads.count, **eff})
        self.progress.update(
            step,
            f"loss {stats.loss:.4f} lr {lr:.2e} {eff['tokens_per_s']:,.0f} tok/s MFU {100 * eff.get('mfu', 0.0):.1f}%",
        )

    def _meter(self) -> M.Efficiency:
        """Rank 0's efficiency meter, with the device's peak from :mod:`kilolayer.train.host.peak` (given, a vendor
        figure, or measured once per machine, before any step is timed)."""
        tc, precision = self.config.train, self.precision.value
        slow = host.cpu_bf16_warning(precision, self.env.device)
        if slow:
            rundir.warn(slow)
        self.peak = host.device_peak(self.env.device, precision, tc.peak_flops)
        self.peak_warned = False
        return M.Efficiency(self.peak, self.env.device, processes=self.env.world)

    def _complete(self, step: int) -> dict:
        """Record ``completed`` (rank 0): why it ended (the plateau or the step budget), early stopping's best
        step, and the run's efficiency from its train records."""
        tc, stopping = self.config.train, self.engine.early_stopping
        plateau = stopping.plateaued
        result = {"status": "completed", "step": step}
        if tc.patience:
            result.update(stopped_early=plateau, best_step=stopping.best_step)
        if self.env.main:
            fields = {"stopped_early": plateau, "tokens": self.engine.tokens}
            if tc.patience:
                fields.update(best_step=stopping.best_step, best=stopping.best, early_stop_metric=tc.early_stop_metric)
            fields.update(M.summarize(rundir.read_metrics(self.out)))
            fields.update(peak_flops=self.peak.flops, peak_flops_source=self.peak.source, heap_held=host.heap_held())
            self.life.finish("completed", step, stopping.reason() if plateau else "step budget", **fields)
        return result


def _quiet(message: str) -> None:
    """Ranks other than 0 do not repeat rank 0's warnings."""


#: model keys that change a run's speed and nothing beyond dtype rounding: a config given with a resume may differ
#: from the run on them, and the run keeps its own
SPEED_OPTIONS = {("model", "cpu_attention")}


def resolve_config(config, out_dir: Path, resume: bool, sets: list[str] | None = None) -> Config:
    """The config a run uses. Resuming a run that has a config.yaml: that file, plus ``sets``; a config
    given as well must agree with it on model, objective and data (the train section may change,
    e.g. more steps; the model's :data:`SPEED_OPTIONS` stay the run's own)."""
    saved = Path(out_dir) / rundir.CONFIG
    if resume and saved.is_file():
        original = load_config(saved)

        def same_run(cfg: Config) -> None:
            for section in ("model", "objective", "data"):
                a, b = getattr(cfg, section).model_dump(), getattr(original, section).model_dump()
                for key in a:
                    if (section, key) in SPEED_OPTIONS:
                        continue  # the run keeps its own
                    if a[key] != b.get(key):
                        raise ConfigError(
                            f"{section}.{key}={a[key]!r}: differs from the run being resumed "
                            f"({saved} has {b.get(key)!r}); only train.* may change on --resume"
                        )

        resumed = load_config(saved, sets)
        if config is not None:
            given = load_config(config, sets)
            same_run(given)
            resumed = load_config({**resumed.model_dump(), "train": given.train.model_dump()})
        same_run(resumed)
        return resumed
    if config is None:
        raise ConfigError(f"{out_dir}: nothing to resume (no config.yaml); give a CONFIG to start a run")
    if isinstance(config, Config):
        return load_config(config.model_dump(), sets) if sets else config
    return load_config(config, sets)


def check_steps(config: Config) -> None:
    """A run trains at least one step unless ``train.untrained`` says it is an untrained baseline: that flag, not
    a step count of 0, is what marks a baseline to every reader (the study's estimate and plots)."""
    if config.train.steps == 0 and not config.train.untrained:
        raise ConfigError(
            "train.steps=0: expected at least 1; for an untrained baseline (the initialised model saved as a "
            "run) set train.untrained=true as well"
        )


def check_early_stopping(config: Config) -> None:
    """Early stopping compares evaluations: ``train.patience`` needs ``train.eval_every``. (Checked here, not in
    the config, so tools that probe a config with evaluations off, like the study estimator, still can.)"""
    tc = config.train
    if tc.patience and not tc.eval_every:
        raise ConfigError(
            f"train.patience={tc.patience}: early stopping compares evaluations, but train.eval_every=0 "
            f"evaluates only at the end; set train.eval_every > 0"
        )


def recorded_threads(out_dir: Path) -> int | None:
    """The intra-op thread count a run recorded, if it chose or was given one (an ``auto`` count is not kept: it
    followed the machine's load, so no count reproduces the run). A value that is not a count is said once and
    passed over."""
    status = rundir.read_status(out_dir)
    value = status.get("threads")
    if value is None or status.get("threads_adaptive"):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= host.MAX_THREADS:
        rundir.warn(f"{Path(out_dir) / rundir.STATUS}: threads={value!r} is not a thread count; the policy chooses")
        return None
    return value


def recorded_precision(out_dir: Path, checkpoint: Path | None = None) -> host.Precision | None:
    """The precision the run in ``out_dir`` trained at, for a resume of an ``auto`` run to keep: its checkpoint's
    (state.json ``precision``: what the weights trained at), else its status.json's, else the fp32 or bf16 of its
    config.yaml (a run that recorded none: its config named it); None where none of them says. A value that is not
    a precision is said once and passed over."""
    status = rundir.read_status(out_dir)
    found = []
    if checkpoint is not None:
        state = rundir.read_json(Path(checkpoint) / "state.json", {})
        found.append(("in its checkpoint", state.get("precision") if isinstance(state, dict) else None))
    found.append(("in its status.json", status.get("precision")))
    with contextlib.suppress(KilolayerError):
        found.append(("in its config.yaml", load_config(Path(out_dir) / rundir.CONFIG).train.precision))
    for where, value in found:
        if value is None or value == "auto":
            continue
        if value not in ("fp32", "bf16"):
            rundir.warn(f"{Path(out_dir)}: precision={value!r} {where} is not fp32 or bf16; passed over")
            continue
        said = status.get("precision_reason")
        reason = said if status.get("precision") == value and isinstance(said, str) and said else f"as recorded {where}"
        return host.Precision(value, reason, source="recorded")
    return None


def _device_here(config: Config) -> str:
    tc = config.train
    return "cuda" if tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available()) else "cpu"


def precision_here(config: Config, asked: str | None = None) -> str:
    """What ``asked`` (default: ``config``'s train.precision) runs at for ``config`` on this machine now: fp32 or
    bf16 as given, ``auto`` as a new run of ``config`` would decide it."""
    return host.precision_policy(asked or config.train.precision, _device_here(config), config, E.step_speedup).value


def shared_precision(configs: list[Config], runs: list[Path] = ()) -> host.Precision | None:
    """``auto`` decided once, on this machine, for runs of ``configs`` compared with one another (a study's, a
    search's): :func:`kilolayer.train.host.precision.shared`; hand it to them with ``host.precision_sharing``.
    ``runs``: the directories of those runs that may exist already; where the ones that recorded a precision all
    recorded the same, that one, so that a study resumed on another machine or at another thread count goes on
    at the precision it began with."""
    configs = [c for c in configs if c.train.steps > 0]  # an untrained baseline takes no step at any precision
    found = {r.value for d in runs if (r := recorded_precision(d)) is not None}
    if len(found) == 1:
        value = found.pop()
        return host.Precision(value, f"auto, as the runs compared began: {value}", "auto")
    return host.precision_shared(_device_here(configs[0]), configs, E.step_speedup) if configs else None


def trained_as_asked(run_dir: Path, config: Config) -> bool:
    """Whether the run in ``run_dir`` trained at the precision ``config`` asks for on this machine now (a run
    started at fp32 is one that ``auto`` asks for where ``auto`` decides fp32, and the other way round)."""
    recorded = recorded_precision(run_dir)
    return recorded is not None and recorded.value == precision_here(config)


def train(
    config: Config | dict | str | Path | None,
    out_dir: str | Path,
    resume: bool = False,
    sets: list[str] | None = None,
    quiet: bool = False,
    overwrite: bool = False,
    choose_threads: bool = False,
    on_eval: Callable[[int, dict], str] | None = None,
    resume_hint: str = "",
    require_steps: bool = False,
) -> dict:
    """Train a config into ``out_dir`` (see module docstring), holding the directory's lock meanwhile.

    ``resume=True`` continues from the newest intact checkpoint (or starts, if there is none), with any
    ``train.*`` values given now, at the thread count the run recorded unless ``train.threads`` is given.
    Without it, a directory that already holds a run is refused unless ``overwrite=True`` (which removes only
    what a run writes); a non-empty directory that is not a run is always refused. A config whose estimated
    memory exceeds what the device has free is refused in one line before anything is allocated
    (:func:`kilolayer.train.host.check_memory`). SIGINT and SIGTERM stop at the next step boundary with a
    checkpoint. ``choose_threads`` (the CLI's) applies :mod:`kilolayer.train.host.threads`' whole policy (by
    default every usable core, fixed for the run; a default run that finds other kilolayer runs training on this
    machine says so in one line); otherwise a count (or ``auto``) given or recorded is used, else the process's
    own setting. ``on_eval``: see the module docstring; ``resume_hint``: what a stop's message says to continue
    with (default: this command with ``--resume``). ``require_steps`` (the CLI's) refuses ``train.steps: 0``
    unless ``train.untrained`` says the run is an untrained baseline.
    """
    out = Path(out_dir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: give one (continue the run, or replace it)")
    rundir.check_out(out)
    config = resolve_config(config, out, resume, sets)
    if require_steps:
        check_steps(config)
    check_early_stopping(config)
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda': no CUDA device is available here; use cpu or auto")
    # a config that cannot fit is refused before anything is allocated or written (train.memory_check: false
    # skips it): after the directory checks, before the lock, so the directory stays as it was (and before the
    # data is loaded: a classifier whose classes only the data knows is counted with 2, a small head)
    host.check_memory(config, config.train.device)
    tc = config.train
    recorded = recorded_threads(out) if resume else None
    device = "cuda" if tc.device == "cuda" or (tc.device == "auto" and torch.cuda.is_available()) else "cpu"
    # a CPU run is marked before its count is chosen, so two runs started together see each other (those at auto
    # share the cores by the marks); a GPU run is not marked: its threads only feed its device
    marked = host.Training(following=tc.threads == host.AUTO) if device == "cpu" else contextlib.nullcontext()
    with marked:
        if choose_threads:
            threads = host.thread_policy(tc.threads, recorded, device)
        elif tc.threads is not None or recorded:
            threads = host.thread_policy(tc.threads, recorded)
        else:
            threads = None  # the process's own setting, unannounced
        with host.torch_threads(threads.count if threads is not None else None):
            signals = StopSignals().install()
            run, error = None, None
            try:
                crowded = host.crowded(threads) if device == "cpu" else ""  # a GPU run's threads feed its device
                run = Run(
                    config,
                    out,
                    resume=resume,
                    quiet=quiet,
                    overwrite=overwrite,
                    signals=signals,
                    threads=threads,
                    on_eval=on_eval,
                    resume_hint=resume_hint,
                    crowded=crowded,
                )
                return run.run()
            except BaseException as err:
                error = err
                raise
            finally:
                signals.restore()
                if run is not None:
                    run.close()
                run = None  # its engine's model holds the process group: let go of it first (see D.teardown)
                D.teardown(error)
                error = None  # the exception's traceback holds this frame
