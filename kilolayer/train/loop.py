"""The training loop: plain PyTorch, objective-agnostic, resumable bit for bit.

``train(config, out_dir, resume=False)`` writes into ``out_dir``: the resolved
``config.yaml``, ``metrics.jsonl``, ``status.json``, ``checkpoints/`` and
``tensorboard/`` (the layout and status lifecycle are :mod:`kilolayer.rundir`'s).
It holds the run directory's lock while it trains, and returns the final status.
A diverged run raises :class:`~kilolayer.errors.DivergedError` (exit code 3 from
the CLI) after recording ``status: diverged`` with its step and reason; SIGINT and
SIGTERM stop at the next step boundary with a checkpoint and raise
:class:`Interrupted` (exit 130 / 143) after recording ``interrupted``; any other
error records ``failed`` with its reason. Nothing in the directory changes until
training has started: a run refused during set-up keeps its status.

Train records carry the run's efficiency (:mod:`kilolayer.train.metrics`: ``tokens_per_s``, ``flops_per_s``,
``mfu``, ``peak_mem_gib``, ``train_s``, over the training time since the previous record; evaluation, diagnostics and
checkpoints are not training time). With ``train.patience`` > 0 the run stops early once that many
evaluations in a row have not improved ``train.early_stop_metric`` by ``train.min_delta``; every
improvement is saved as a checkpoint that rotation never removes while the run needs it (the best), and
``status.json`` says ``completed`` with ``stopped_early``, ``best_step`` and the reason.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kilolayer import rundir
from kilolayer.config import Config, dump_yaml, load_config
from kilolayer.data import load_source
from kilolayer.errors import ConfigError, DivergedError, InputError, KilolayerError
from kilolayer.objectives import build_task
from kilolayer.train import checkpoint as ckpt
from kilolayer.train import diagnostics as diag
from kilolayer.train import distributed as D
from kilolayer.train import metrics as M
from kilolayer.train.logging import MetricsLog, Progress
from kilolayer.train.memory import check_memory
from kilolayer.train.optim import build_optimizer, build_scheduler
from kilolayer.train.parallelize import heap_held, parallelize

# early_stop_mode auto: these evaluation metrics are better higher, every other one lower
HIGHER_IS_BETTER = ("accuracy", "exact_match", "bleu")


def early_stop_mode(tc) -> str:
    """``min`` or ``max``: whether lower or higher values of ``train.early_stop_metric`` are better."""
    if tc.early_stop_mode != "auto":
        return tc.early_stop_mode
    name = tc.early_stop_metric
    return "max" if name in HIGHER_IS_BETTER or name.endswith("accuracy") else "min"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> tuple[dict, dict]:
    """(tensor states for rng.pt, JSON-able states for state.json)."""
    tensors = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.stack([s for s in torch.cuda.get_rng_state_all()])
    np_state = np.random.get_state()
    plain = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    return tensors, plain


def set_rng_state(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["cpu"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["cuda"]))
    v, s, g = plain["python"]
    random.setstate((v, tuple(s), g))
    n = plain["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def split_batch(batch: dict, parts: int) -> list[dict]:
    if parts == 1:
        return [batch]
    chunks = {k: v.chunk(parts) if isinstance(v, torch.Tensor) else [v] * parts for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]


def _autocast(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _full_params(module, env: D.Dist, mode: str):
    """Under FSDP2, gather the root's parameters (embeddings, heads) for calls that bypass task.forward."""
    if env.active and mode == "fsdp":
        module.unshard()
        try:
            yield
        finally:
            module.reshard()
    else:
        yield


class Interrupted(KilolayerError):
    """SIGINT or SIGTERM stopped training; the exit code is 128 + the signal number (130, 143)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class StopSignals:
    """SIGINT and SIGTERM: during set-up they stop at once; once the loop runs (``armed``), the first asks
    it to stop at the next step boundary (with a checkpoint) and a second one stops at once. A SIGTERM within
    :data:`ECHO_S` of the first SIGTERM is not a second request: when a study driver with several threads
    dies, Linux sends its child the parent-death signal once per exiting thread. Nor is a SIGTERM that finds
    the process orphaned (its parent, a study driver or torchrun, has exited since the first): that is the
    parent's death arriving late, on a loaded machine after the checkpoint has begun. Installed only in the
    main thread (where Python allows it)."""

    #: seconds within which a repeated SIGTERM counts as the same request
    ECHO_S = 2.0

    def __init__(self):
        self.signum = 0
        self.armed = False
        self.first_at = 0.0
        self.parent = os.getppid()
        self._previous: dict = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.armed:
            raise Interrupted(f"interrupted by {name} before training started", signum)
        if self.signum:
            soon = time.monotonic() - self.first_at < self.ECHO_S
            echo = signum == self.signum == signal.SIGTERM and (soon or os.getppid() != self.parent)
            if echo:
                return
            raise Interrupted(f"stopped at once by a second {name}; the newest complete checkpoint is kept", signum)
        self.signum = signum
        self.first_at = time.monotonic()

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


@dataclass
class StepStats:
    """What :meth:`Trainer.train_step` measured."""

    loss: float  # the step's loss, averaged over micro-batches and processes
    grad_norm: torch.Tensor  # the global gradient norm before clipping
    tokens: int  # tokens the backbone processed on this process
    flops: float  # model FLOPs of the step on this process (the objective's train_flops)
    layer_grads: tuple[list[str], list[float]] | None  # per-layer gradient norms, on diagnostic steps


class Trainer:
    """One run: set-up (``__init__``), then :meth:`run`, the loop over :meth:`train_step`, the divergence check,
    the update, logging, diagnostics, evaluation and checkpoints."""

    def __init__(
        self,
        config: Config,
        out_dir: Path,
        resume: bool = False,
        quiet: bool = False,
        overwrite: bool = False,
        signals: StopSignals | None = None,
    ):
        self.config, self.out, self.resume, self.quiet = config, Path(out_dir), resume, quiet
        self.signals = signals
        tc = config.train
        self.env = D.setup(tc.device)
        if tc.batch_size % (self.env.world * tc.accumulate):
            raise ConfigError(
                f"train.batch_size={tc.batch_size}: must be divisible by processes x train.accumulate "
                f"({self.env.world} x {tc.accumulate})"
            )
        self.lock: rundir.RunLock | None = None
        self.life: rundir.Lifecycle | None = None  # rank 0's status.json
        self.started = False  # status.json says running: from here on every exit is recorded
        self.created = False
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
        config, tc, resume = self.config, self.config.train, self.resume
        self.source = load_source(config)
        seed_everything(tc.seed)
        self.task = build_task(config, self.source)
        obj = self.task.objective
        self.start_step = self.step = 0
        # ema: the smoothed training loss (bias-corrected, weight 0.9); running_min: its minimum;
        # early stopping: the best value of the metric, its step, evaluations since without improvement, and
        # the metric, mode and min_delta they were found with (a resume that changes metric or mode resets them);
        # init_from (a run started from another's weights): that run and the checkpoint step it loaded
        self.state = {
            "running_min": math.inf,
            "ema": 0.0,
            "ema_weight": 0.0,
            "tokens": 0,
            "best": None,
            "best_step": None,
            "bad_evals": 0,
            "early_stop_metric": tc.early_stop_metric,
            "early_stop_mode": early_stop_mode(tc),
            "min_delta": tc.min_delta,
        }
        latest = (
            rundir.intact_checkpoint(self.out, on_damaged=rundir.warn if self.env.main else _quiet) if resume else None
        )
        if latest is None:
            self._fresh_start()
        self.task.to(self.env.device)
        self.model = parallelize(self.task, config, self.env)
        params = [p for p in self.task.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("train: nothing to train (every parameter is frozen)")
        self.optimizer = build_optimizer(self.task, tc)
        self.scheduler = build_scheduler(self.optimizer, tc)
        self.reference = None  # F(x, theta_0) on the probe batch
        self.probe_batch = None
        if tc.diagnostics_every:
            self.probe_batch = to_device(next(self.source.eval_batches(min(8, tc.batch_size), 8)), self.env.device)
        if latest is not None:
            self._restore(latest)
        elif self.probe_batch is not None:
            with _full_params(self.model, self.env, tc.parallel):
                self.reference = diag.probe(obj, self.task.backbone, self.probe_batch)[0]
        if tc.patience and tc.eval_every:
            self._check_metric()
        self._begin(latest)

    # -------------------------------------------------------------- set-up

    def _claim(self, overwrite: bool) -> None:
        """Rank 0 takes the run directory's lock and checks, under it, that this run may write there; the
        other ranks learn the outcome, so a refusal ends every process instead of leaving some waiting."""
        error = None
        if self.env.main:
            try:
                rundir.check_out(self.out)
                self.created = not self.out.exists()
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
            if _all_sum(failed, self.env).item():
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

    def _fresh_start(self) -> None:
        tc = self.config.train
        if tc.init_from:
            from kilolayer.train.init_from import load_pretrained

            loaded = load_pretrained(self.task, tc.init_from, freeze=tc.freeze_backbone)
            self.state["init_from"] = {"path": str(Path(tc.init_from).resolve()), "step": loaded["step"]}
        from kilolayer.nn.transformer import data_dependent_init

        backbone = self.task.backbone
        # every backbone of the task (a CLIP text tower too); the batch is drawn only if a scheme runs the pass
        # (Admin's profiled omega)
        data_dependent_init(
            self.task,
            lambda: self.task.objective(backbone, self.source.train_batch(0, self.config.train.batch_size)),
        )

    def _restore(self, path: Path) -> None:
        tc = self.config.train
        data = ckpt.upgrade_checkpoint(self.task, ckpt.load_checkpoint(path))  # issue 13's renamed keys too
        ckpt.check_fits(path / "model.safetensors", data["model"], self.task.state_dict())
        st = data["state"]
        if tc.steps < int(st["step"]):
            raise ConfigError(
                f"train.steps={tc.steps}: the run is already at step {st['step']} ({path}); "
                f"give train.steps >= {st['step']}"
            )
        D.load_model_state(self.model, data["model"])
        if tc.freeze_backbone:
            for p in self.task.backbone.parameters():
                p.requires_grad_(False)
        # the optimizer's hyperparameters come from the config (a --resume may change train.lr, betas, ...);
        # only its state (moments, step counts) and the scheduler's position come from the checkpoint
        planned = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        try:
            D.load_optimizer_state(self.model, self.optimizer, data["optimizer"]["optimizer"])
            self.scheduler.load_state_dict(data["optimizer"]["scheduler"])
        except (KeyError, ValueError, RuntimeError) as err:
            raise InputError(
                f"{path / 'optimizer.pt'}: does not fit this run ({str(err).splitlines()[0][:100]})"
            ) from None
        for group, plan in zip(self.optimizer.param_groups, planned):
            group.update(plan)
        sched = self.scheduler
        sched.base_lrs = [g["initial_lr"] for g in self.optimizer.param_groups]
        # LambdaLR's own formula, with the lambdas reading the current config: schedule re-planned from here
        lrs = [base * f(sched.last_epoch) for f, base in zip(sched.lr_lambdas, sched.base_lrs)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs
        self.start_step = self.step = int(st["step"])
        self.state.update(st["trainer"])
        self._continue_early_stopping(st["trainer"])
        set_rng_state(data["rng"], st["rng"])
        if "reference" in data["extra"]:
            self.reference = data["extra"]["reference"].to(self.env.device)

    def _continue_early_stopping(self, saved: dict) -> None:
        """On resume: early stopping's best and count carry on only under the metric and mode they were found
        with (the checkpoint says which; one written before it did, the run's previous config.yaml); under
        another they are reset, said in one line. A changed ``min_delta`` applies from here on."""
        tc, st = self.config.train, self.state
        now = (tc.early_stop_metric, early_stop_mode(tc))
        if "early_stop_metric" in saved:
            was = (saved["early_stop_metric"], saved.get("early_stop_mode"))
        else:
            previous = self._saved_config()
            was = now if previous is None else (previous.train.early_stop_metric, early_stop_mode(previous.train))
        if was != now:
            if self.env.main and (st["best"] is not None or st["bad_evals"]):
                best = f"best {st['best']:.6g} at step {st['best_step']}, " if st["best"] is not None else ""
                rundir.warn(
                    f"train.early_stop_metric={now[0]!r} (mode {now[1]}): the run tracked {was[0]!r} (mode "
                    f"{was[1]}) until step {self.start_step}; early stopping starts over ({best}{st['bad_evals']} "
                    f"evaluations without improvement dropped)"
                )
            st.update(best=None, best_step=None, bad_evals=0)
        st.update(early_stop_metric=now[0], early_stop_mode=now[1], min_delta=tc.min_delta)

    def _begin(self, latest: Path | None) -> None:
        """Set-up succeeded: from here on the run directory changes. status.json says running, config.yaml
        holds the config trained with now, and a resume is recorded in resume.json."""
        if self.env.main:
            self.life = rundir.Lifecycle(self.out)
            if "init_from" in self.state:  # every status of the run says what it started from
                self.life.fields["init_from"] = self.state["init_from"]
            previous = self._saved_config() if self.resume else None
            if self.replace:
                rundir.clear_run(self.out)
            ckpt.remove_partial(self.out)
            if latest is None:
                (self.out / rundir.METRICS).unlink(missing_ok=True)  # a restart from step 0 logs anew
                self.life.running(0)
            else:
                rundir.truncate_metrics(self.out, self.start_step)
                for later in rundir.complete_checkpoints(self.out):
                    if rundir.checkpoint_step(later) > self.start_step:
                        shutil.rmtree(later, ignore_errors=True)  # damaged (reported): this run replays them
                self.life.running(self.start_step, resumed_from=latest.name)
            self.started = True
            rundir.write_atomic(self.out / rundir.CONFIG, dump_yaml(self.config))
            if self.resume:
                rundir.record_resume(self.out, self.start_step, _changes(previous, self.config))
        self.started = True
        D.barrier(self.env)

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
            if isinstance(err, (Interrupted, KeyboardInterrupt)):
                status = "interrupted"
            else:
                status = "failed"
            reason = str(err) if isinstance(err, KilolayerError) else f"{err.__class__.__name__}: {err}"
            self.life.finish(status, self.step, reason)
        return err

    # -------------------------------------------------------------- pieces

    def save(self, step: int) -> None:
        tc = self.config.train
        model_sd = D.model_state(self.model)
        optim_sd = D.optimizer_state(self.model, self.optimizer)
        if self.env.main:
            tensors, plain = rng_state()
            extra = {"reference": self.reference.cpu()} if self.reference is not None else None
            # early stopping keeps the best checkpoint too: rotation is rundir's, which spares it
            keep = 2**31 if tc.patience else tc.keep_checkpoints
            ckpt.save_checkpoint(
                self.out,
                step,
                model_sd,
                {"optimizer": optim_sd, "scheduler": self.scheduler.state_dict()},
                tensors,
                {"step": step, "rng": plain, "trainer": self.state},
                extra,
                keep=keep,
            )
            if tc.patience:
                rundir.prune_checkpoints(self.out, tc.keep_checkpoints)
        D.barrier(self.env)

    @torch.no_grad()
    def evaluate(self, step: int, batches: int = 0) -> dict:
        """The objective's evaluation metrics over ``train.eval_batches`` batches (``batches`` if given: then
        no samples are saved)."""
        tc = self.config.train
        self.task.eval()
        count = batches or tc.eval_batches
        # evaluation must not consume the training RNG streams (bit-exact resume)
        with torch.random.fork_rng(devices=[self.env.device] if self.env.device.type == "cuda" else []):
            with _full_params(self.model, self.env, tc.parallel), _autocast(tc.precision, self.env.device):
                data = (
                    to_device(b, self.env.device)
                    for b in self.source.eval_batches(tc.batch_size, count * tc.batch_size)
                )
                metrics = self.task.objective.evaluate(self.task.backbone, data)
                save = getattr(self.task.objective, "save_samples", None)
                if save is not None and self.env.main and not batches:
                    # e.g. MAE's original / masked / reconstruction grid
                    batch = to_device(next(self.source.eval_batches(8, 8)), self.env.device)
                    save(self.task.backbone, batch, self.out / "samples" / f"step_{step:08d}.png")
        self.task.train()
        return {k: float(v) for k, v in metrics.items()}

    def diagnostics(self, step: int, names: list[str], norms: list[float]) -> dict:
        with torch.random.fork_rng(devices=[]), _full_params(self.model, self.env, self.config.train.parallel):
            out, ln_names, ln_values = diag.probe(self.task.objective, self.task.backbone, self.probe_batch)
        return {
            "step": step,
            "split": "diagnostics",
            "layers": names,
            "grad_norm": norms,
            "update": diag.update_size(out, self.reference),
            "ln_names": ln_names,
            "ln_input": ln_values,
        }

    def _check_metric(self) -> None:
        """Early stopping's metric must be one the objective reports: one evaluation batch at set-up says."""
        tc = self.config.train
        names = self.evaluate(0, batches=1)
        if tc.early_stop_metric not in names:
            raise ConfigError(
                f"train.early_stop_metric={tc.early_stop_metric!r}: not an evaluation metric of "
                f"{self.config.objective.name} (it reports {', '.join(sorted(names))})"
            )

    def _track(self, step: int, metrics: dict) -> bool:
        """Early stopping's bookkeeping after an evaluation; True if ``step`` is the new best."""
        tc, st = self.config.train, self.state
        value = float(metrics.get(tc.early_stop_metric, math.nan))  # checked at set-up; missing = no improvement
        sign = 1.0 if early_stop_mode(tc) == "min" else -1.0
        better = math.isfinite(value) and (st["best"] is None or sign * value < sign * st["best"] - tc.min_delta)
        if better:
            st["best"], st["best_step"], st["bad_evals"] = float(value), step, 0
        else:
            st["bad_evals"] += 1
        return better

    def _plateaued(self) -> bool:
        tc = self.config.train
        return bool(tc.patience) and self.state["bad_evals"] >= tc.patience

    def _plateau_reason(self) -> str:
        tc, st = self.config.train, self.state
        best = f"; best {st['best']:.6g} at step {st['best_step']}" if st["best"] is not None else ""
        return (
            f"plateau: no improvement of {tc.early_stop_metric} by {tc.min_delta:g} in {tc.patience} evaluations{best}"
        )

    def _smoothed(self, loss: float) -> float:
        st = self.state
        st["ema"] = 0.9 * st["ema"] + 0.1 * loss
        st["ema_weight"] = 0.9 * st["ema_weight"] + 0.1
        return st["ema"] / st["ema_weight"]

    def _diverged(self, step: int, loss: float) -> str:
        """Non-finite loss, or (after warm-up) a smoothed loss above factor x its running minimum and above
        that minimum by ``diverge_increase``. Updates the smoothed loss and its minimum."""
        tc = self.config.train
        if not math.isfinite(loss):
            return f"non-finite loss ({loss}) at step {step}"
        smooth = self._smoothed(loss)
        best = self.state["running_min"]
        if step > tc.warmup and smooth > tc.diverge_factor * best and smooth > best + tc.diverge_increase:
            return (
                f"smoothed loss {smooth:.4g} at step {step} exceeds {tc.diverge_factor:g} x its running minimum "
                f"{best:.4g}"
            )
        self.state["running_min"] = min(best, smooth)
        return ""

    # -------------------------------------------------------------- the loop

    def run(self) -> dict:
        """Train from the start step to ``train.steps``; every way out is recorded in status.json."""
        tc = self.config.train
        with self._recorded(), self._logs():
            if self.signals is not None:
                self.signals.armed = True  # from here a signal waits for the step boundary
            if self._plateaued():
                return self._complete(self.start_step)  # resumed after an early stop: nothing left to do
            self.model.train()
            for step in range(self.start_step + 1, tc.steps + 1):
                stats = self.train_step(step)
                self._stop_if_diverged(step, stats.loss)
                self._update(step, stats)
                self._log_train(step, stats)
                with self._paused():  # diagnostics, evaluation and checkpoints are not training time
                    if stats.layer_grads is not None:
                        self._write(self.diagnostics(step, *stats.layer_grads))
                    improved, stop = self._evaluate_on_schedule(step)
                    saved = self._save_on_schedule(step, improved or stop)
                if stop:
                    return self._complete(step)
                self._stop_on_signal(step, saved)
            if tc.steps == 0 and self.start_step == 0:
                self.save(0)  # an untrained run is still a run: analysis can load it
            return self._complete(tc.steps)

    def train_step(self, step: int) -> StepStats:
        """Forward and backward over the step's micro-batches (``train.accumulate``; DDP all-reduces on the last
        one only), under autocast for ``train.precision``; then, on diagnostic steps, the per-layer gradient
        norms, and clipping to ``train.clip``. The gradients are left for :meth:`_update`."""
        tc, env = self.config.train, self.env
        micro = split_batch(self.source.train_batch(step - 1, tc.batch_size, env.rank, env.world), tc.accumulate)
        loss_sum, tokens, flops = 0.0, 0, 0.0
        for i, mb in enumerate(micro):
            mb = self.task.objective.prepare(to_device(mb, env.device))  # its masks drawn: FLOPs counted on them
            with self._no_sync(i < len(micro) - 1):
                with _autocast(tc.precision, env.device):
                    loss, _ = self.model(mb)
                (loss / len(micro)).backward()
            loss_sum += float(loss.detach()) / len(micro)
            tokens += self.task.objective.tokens(mb)
            flops += self.task.objective.train_flops(mb)
        loss_value = D.all_mean(loss_sum, env)
        reduce = (lambda t: _all_sum(t, env)) if env.active else None
        layer_grads = diag.grad_norms(self.task.backbone, reduce) if self._diagnostic_step(step) else None
        params = [p for p in self.task.parameters() if p.grad is not None]
        gnorm = torch.nn.utils.clip_grad_norm_(params, tc.clip if tc.clip > 0 else float("inf"))
        return StepStats(loss_value, gnorm, tokens, flops, layer_grads)

    def _no_sync(self, skip: bool):
        """DDP's ``no_sync`` for a micro-batch whose gradients are not all-reduced yet."""
        if skip and self.env.active and self.config.train.parallel == "ddp":
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _diagnostic_step(self, step: int) -> bool:
        tc = self.config.train
        every, until = tc.diagnostics_every, tc.diagnostics_until
        return every > 0 and (step == 1 or step % every == 0) and (not until or step <= until)

    def _stop_if_diverged(self, step: int, loss: float) -> None:
        """Raise :class:`DivergedError` (after recording ``diverged``) without applying the step's update."""
        reason = self._diverged(step, loss)
        if reason:
            self.optimizer.zero_grad(set_to_none=True)
            if self.log:
                self.log.write({"step": step, "split": "train", "loss": loss})
                self.life.finish("diverged", step, reason)
            raise DivergedError(reason)

    def _update(self, step: int, stats: StepStats) -> None:
        """Apply the step's gradients (optimizer, then schedule) and count its tokens."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state["tokens"] += stats.tokens * self.env.world
        self.step = step  # its update is applied: a failure from here on is at this step
        if self.meter is not None:
            self.meter.add(stats.tokens * self.env.world, stats.flops * self.env.world)

    def _evaluate_on_schedule(self, step: int) -> tuple[bool, bool]:
        """Evaluate every ``train.eval_every`` steps and at the last; returns (a new best, early stop)."""
        tc = self.config.train
        on_grid = bool(tc.eval_every) and step % tc.eval_every == 0
        if not (on_grid or step == tc.steps):
            return False, False
        metrics = self.evaluate(step)
        self._write({"step": step, "split": "eval", **metrics})
        # only the evaluations every eval_every steps count: a leg that ended off that grid (and evaluated
        # there) resumes exactly as if it had never stopped
        if not (tc.patience and on_grid):
            return False, False
        return self._agree(self._track(step, metrics)), self._agree(self._plateaued())

    def _save_on_schedule(self, step: int, early_stopping: bool) -> bool:
        """Checkpoint every ``train.checkpoint_every`` steps, at the last, and where early stopping asks (the
        best, and where it stopped); returns whether it saved."""
        tc = self.config.train
        saved = bool(tc.checkpoint_every and step % tc.checkpoint_every == 0) or step == tc.steps or early_stopping
        if saved:
            self.save(step)
        return saved

    def _stop_on_signal(self, step: int, saved: bool) -> None:
        """A SIGINT/SIGTERM arrived: finish the step with a checkpoint, so a resume replays nothing, and stop."""
        signum = self._stop_signal() if step < self.config.train.steps else 0
        if signum:
            if not saved:
                self.save(step)
            raise self._interrupt(signum, step)

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
            if self.peak.source.startswith(("measured", "cached")):
                fix = (
                    f"set train.peak_flops, or delete the cached figure ({M.CACHE_FILE} in the cache folder) to "
                    "measure it again"
                )
            else:  # given, or a vendor's figure
                fix = "set train.peak_flops" if self.peak.source != "train.peak_flops" else "raise train.peak_flops"
            rundir.warn(
                f"MFU {100 * eff['mfu']:.0f}% at step {step}: the peak of {self.peak.flops:.3g} "
                f"FLOP/s ({self.peak.source}) is too low; {fix}"
            )
        lr = self.scheduler.get_last_lr()[0]
        record = {"step": step, "split": "train", "loss": stats.loss, "lr": lr, "grad_norm": float(stats.grad_norm)}
        self.log.write({**record, "tokens": self.state["tokens"], **eff})
        self.progress.update(
            step,
            f"loss {stats.loss:.4f} lr {lr:.2e} {eff['tokens_per_s']:,.0f} tok/s MFU {100 * eff.get('mfu', 0.0):.1f}%",
        )

    def _stop_signal(self) -> int:
        """The signal that asked training to stop (0 if none), agreed by every process."""
        signum = self.signals.signum if self.signals is not None else 0
        if self.env.active:
            signum = _all_max(signum, self.env)
        return signum

    def _interrupt(self, signum: int, step: int) -> Interrupted:
        return Interrupted(
            f"interrupted by {signal.Signals(signum).name} at step {step} (checkpoint step {step} "
            f"saved); continue with: kilolayer train --resume --out {self.out}",
            signum,
        )

    def _meter(self) -> M.Efficiency:
        """Rank 0's efficiency meter; the device's peak is given, a vendor figure, or measured once per machine
        (before any step is timed)."""
        tc = self.config.train
        slow = M.cpu_bf16_warning(tc.precision, self.env.device)
        if slow:
            rundir.warn(slow)
        self.peak = M.device_peak(self.env.device, tc.precision, tc.peak_flops)
        self.peak_warned = False
        return M.Efficiency(self.peak, self.env.device, processes=self.env.world)

    def _agree(self, flag: bool) -> bool:
        """True on every process if it is true on any (decisions that lead to collective work)."""
        return bool(_all_max(int(flag), self.env)) if self.env.active else flag

    def _complete(self, step: int) -> dict:
        """Record ``completed`` (rank 0): why it ended (the plateau or the step budget), early stopping's best
        step, and the run's efficiency from its train records."""
        tc = self.config.train
        plateau = self._plateaued()
        result = {"status": "completed", "step": step}
        if tc.patience:
            result.update(stopped_early=plateau, best_step=self.state["best_step"])
        if self.env.main:
            fields = {"stopped_early": plateau, "tokens": self.state["tokens"]}
            if tc.patience:
                fields.update(
                    best_step=self.state["best_step"], best=self.state["best"], early_stop_metric=tc.early_stop_metric
                )
            fields.update(M.summarize(rundir.read_metrics(self.out)))
            fields.update(peak_flops=self.peak.flops, peak_flops_source=self.peak.source, heap_held=heap_held())
            self.life.finish("completed", step, self._plateau_reason() if plateau else "step budget", **fields)
        return result


def _quiet(message: str) -> None:
    """Ranks other than 0 do not repeat rank 0's warnings."""


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def _changes(old: Config | None, new: Config) -> dict:
    """``{"train.lr": [old, new], ...}`` for every key whose value differs."""
    if old is None:
        return {}
    a, b = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _all_max(value: int, env: D.Dist) -> int:
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64, device=env.device if env.device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _all_sum(t: torch.Tensor, env: D.Dist) -> torch.Tensor:
    import torch.distributed as dist

    t = t.to(env.device if env.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.cpu()


def resolve_config(config, out_dir: Path, resume: bool, sets: list[str] | None = None) -> Config:
    """The config a run uses. Resuming a run that has a config.yaml: that file, plus ``sets``; a config
    given as well must agree with it on model, objective and data (the train section may change,
    e.g. more steps)."""
    saved = Path(out_dir) / rundir.CONFIG
    if resume and saved.is_file():
        original = load_config(saved)

        def same_run(cfg: Config) -> None:
            for section in ("model", "objective", "data"):
                a, b = getattr(cfg, section).model_dump(), getattr(original, section).model_dump()
                for key in a:
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


def check_early_stopping(config: Config) -> None:
    """Early stopping compares evaluations: ``train.patience`` needs ``train.eval_every``. (Checked here, not in
    the config, so tools that probe a config with evaluations off, like the study estimator, still can.)"""
    tc = config.train
    if tc.patience and not tc.eval_every:
        raise ConfigError(
            f"train.patience={tc.patience}: early stopping compares evaluations, but train.eval_every=0 "
            f"evaluates only at the end; set train.eval_every > 0"
        )


def train(
    config: Config | dict | str | Path | None,
    out_dir: str | Path,
    resume: bool = False,
    sets: list[str] | None = None,
    quiet: bool = False,
    overwrite: bool = False,
) -> dict:
    """Train a config into ``out_dir`` (see module docstring), holding the directory's lock meanwhile.

    ``resume=True`` continues from the newest intact checkpoint (or starts, if there is none), with any
    ``train.*`` values given now. Without it, a directory that already holds a run is refused unless
    ``overwrite=True`` (which removes only what a run writes); a non-empty directory that is not a run
    is always refused. A config whose estimated memory exceeds what the device has free is refused in one
    line before anything is allocated (:func:`kilolayer.train.memory.check_memory`). SIGINT and SIGTERM stop at
    the next step boundary with a checkpoint.
    """
    out = Path(out_dir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: give one (continue the run, or replace it)")
    rundir.check_out(out)
    config = resolve_config(config, out, resume, sets)
    check_early_stopping(config)
    # a config that cannot fit is refused before anything is allocated or written (train.memory_check: false
    # skips it): after the directory checks, before the lock, so the directory stays as it was (and before the
    # data is loaded: a classifier whose classes only the data knows is counted with 2, a small head)
    check_memory(config, config.train.device)
    signals = StopSignals().install()
    trainer = None
    try:
        trainer = Trainer(config, out, resume=resume, quiet=quiet, overwrite=overwrite, signals=signals)
        return trainer.run()
    finally:
        signals.restore()
        if trainer is not None:
            trainer.close()
        D.teardown()
