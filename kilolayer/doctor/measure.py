"""Replay the first steps of a config in memory and measure DeepNet's quantities at every step.

:func:`replay` sets a run up exactly as ``kilolayer train`` does (the same seed, initialisation,
batches, AdamW and learning-rate schedule; see ``kilolayer.train.loop.Trainer``) and trains
``steps`` optimiser steps without touching the disk. After each step it records what
``train.diagnostics_every`` logs (per-layer gradient norms before clipping, the model update
``||F(x, theta_t) - F(x, theta_0)||`` on the trainer's probe batch, the mean input magnitude of every
LayerNorm) and the training loss. Because data and initialisation depend only on the seeds, step 1 of
a replay is step 1 of the real run: ``kilolayer doctor RUN_DIR`` uses it for runs trained without
diagnostics, and the forecast uses it before any run exists.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from kilolayer.config import Config, load_config
from kilolayer.train import diagnostics as diag


@dataclass
class Step:
    """What one replayed step measured (``update`` and ``ln_input`` after the step's update)."""

    step: int
    lr: float
    loss: float
    layers: list[str]
    grad_norm: list[float]
    update: float = math.nan
    ln_names: list[str] = field(default_factory=list)
    ln_input: list[float] = field(default_factory=list)
    change: float = math.nan  # ||F(x, theta_t) - F(x, theta_{t-1})||: this step's own update
    eval_loss: float = math.nan  # the loss on the fixed evaluation batch after the step (every eval_every)


@dataclass
class Replay:
    """The steps replayed; ``stopped`` says why fewer than asked were run (the trainer's divergence rule, or a
    non-finite output)."""

    steps: list[Step]
    output_norm: float  # mean per-token ||F(x, theta_0)|| on the probe batch: the scale of the output
    ln_names: list[str]  # LayerNorm inputs at initialisation, before any step
    ln_input: list[float]
    seconds: float
    stopped: str = ""
    reference: torch.Tensor | None = None  # F(x, theta_0) on the probe batch
    probe_batch: dict | None = None
    eval_loss0: float = math.nan  # the loss on the fixed evaluation batch at initialisation
    ungated: int | None = None  # first step the divergence ratio test held during warm-up (not applied there)

    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]


def _autocast(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def _eval_loss(task, batch: dict) -> float:
    """The loss on a fixed evaluation batch in eval mode, with a fixed seed (MAE's masking is random)."""
    was = task.training
    task.eval()
    try:
        torch.manual_seed(0)
        loss, _ = task(batch)
    finally:
        task.train(was)
    return float(loss)


class DivergenceRule:
    """The trainer's divergence rule (``Trainer._diverged``): a non-finite loss, or after warm-up a smoothed
    loss (EMA 0.9, bias-corrected) above ``diverge_factor`` x its running minimum and above that minimum by
    ``diverge_increase``. ``ungated`` also records the first step where the ratio test held during warm-up,
    when the trainer does not yet apply it."""

    def __init__(self, tc):
        self.tc = tc
        self.ema = self.weight = 0.0
        self.best = math.inf
        self.ungated: int | None = None

    def __call__(self, step: int, loss: float) -> str:
        tc = self.tc
        if not math.isfinite(loss):
            return f"non-finite loss ({loss}) at step {step}"
        self.ema = 0.9 * self.ema + 0.1 * loss
        self.weight = 0.9 * self.weight + 0.1
        smooth = self.ema / self.weight
        if smooth > tc.diverge_factor * self.best and smooth > self.best + tc.diverge_increase:
            if step > tc.warmup:
                return (
                    f"smoothed loss {smooth:.4g} at step {step} exceeds {tc.diverge_factor:g} x its running "
                    f"minimum {self.best:.4g}"
                )
            if self.ungated is None:
                self.ungated = step
        self.best = min(self.best, smooth)
        return ""


def replay(config: Config, steps: int, device: str = "cpu", eval_every: int = 0) -> Replay:
    """Train ``config`` for ``steps`` steps in memory, measuring after every step (see module docstring);
    with ``eval_every``, also the loss on a fixed evaluation batch (up to 64 samples) before training and
    every ``eval_every`` steps. Stops where the trainer would stop a diverged run.

    Writes nothing and leaves the global random state as it found it."""
    from kilolayer.data import load_source
    from kilolayer.nn.transformer import data_dependent_init
    from kilolayer.objectives import build_task
    from kilolayer.train.loop import seed_everything, split_batch, to_device
    from kilolayer.train.optim import build_optimizer, build_scheduler
    from kilolayer.train.parallelize import apply_checkpointing

    t0 = time.perf_counter()
    dev = torch.device(device)
    tc = config.train
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        source = load_source(config)
        seed_everything(tc.seed)
        task = build_task(config, source)
        objective = task.objective
        if tc.init_from:
            from kilolayer.train.init_from import load_pretrained

            load_pretrained(task, tc.init_from, freeze=tc.freeze_backbone)
        # as the trainer does: the batch is drawn only if the scheme runs the pass (Admin's profiled omega)
        data_dependent_init(task, lambda: objective(task.backbone, source.train_batch(0, tc.batch_size)))
        task.to(dev)
        apply_checkpointing(task, config)  # as the trainer's parallelize step does
        optimizer = build_optimizer(task, tc)
        scheduler = build_scheduler(optimizer, tc)
        # the trainer takes its probe batch and F(x, theta_0) in its own RNG stream only when it logs
        # diagnostics; otherwise the replay must not consume random numbers the run did not
        ours = contextlib.nullcontext() if tc.diagnostics_every else torch.random.fork_rng(devices=[])
        with ours:
            probe_batch = to_device(next(source.eval_batches(min(8, tc.batch_size), 8)), dev)
            reference, ln_names, ln_input = diag.probe(objective, task.backbone, probe_batch)
        output_norm = float(reference.norm(dim=-1).mean())
        previous = reference
        eval_batch = eval_loss0 = None
        if eval_every:
            with torch.random.fork_rng(devices=[]):
                eval_batch = to_device(next(source.eval_batches(64, 64)), dev)
                eval_loss0 = _eval_loss(task, eval_batch)
        params = [p for p in task.parameters() if p.requires_grad]
        diverged = DivergenceRule(tc)
        out: list[Step] = []
        stopped = ""
        task.train()
        for step in range(1, steps + 1):
            batch = source.train_batch(step - 1, tc.batch_size, 0, 1)
            loss_sum = 0.0
            micro = split_batch(batch, tc.accumulate)
            for mb in micro:
                with _autocast(tc.precision, dev):
                    loss, _ = task(to_device(mb, dev))
                (loss / len(micro)).backward()
                loss_sum += float(loss.detach()) / len(micro)
            names, norms = diag.grad_norms(task.backbone)
            lr = scheduler.get_last_lr()[0]
            record = Step(step, lr, loss_sum, names, norms)
            out.append(record)
            torch.nn.utils.clip_grad_norm_(
                [p for p in params if p.grad is not None], tc.clip if tc.clip > 0 else float("inf")
            )
            stopped = diverged(step, loss_sum)
            if stopped:
                break
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.random.fork_rng(devices=[]):
                current, record.ln_names, record.ln_input = diag.probe(objective, task.backbone, probe_batch)
                if eval_batch is not None and (step % eval_every == 0 or step == steps):
                    record.eval_loss = _eval_loss(task, eval_batch)
            record.update = diag.update_size(current, reference)
            record.change = diag.update_size(current, previous)
            previous = current
            if not math.isfinite(record.update):
                stopped = f"non-finite output after step {step}"
                break
    return Replay(
        out,
        output_norm,
        ln_names,
        ln_input,
        time.perf_counter() - t0,
        stopped,
        reference,
        probe_batch,
        eval_loss0 if eval_loss0 is not None else math.nan,
        diverged.ungated,
    )


def with_scheme(config: Config, scheme: str) -> Config:
    """``config`` with another residual scheme (same shape, seed, data and training)."""
    data = config.model_dump()
    data["model"]["scheme"] = scheme
    return load_config(data)


def deepnorm_first_update(config: Config, device: str = "cpu") -> float | None:
    """The step-1 model update of a DeepNorm model of ``config``'s shape, seed, batch and learning rate: the
    empirical reference a first update is compared with. None if the replay could not take the step, or
    if the run starts from pretrained weights (``train.init_from``: no DeepNorm twin of those exists)."""
    if config.train.init_from:
        return None
    twin = replay(with_scheme(config, "deepnorm"), 1, device)
    return twin.steps[0].update if twin.steps and math.isfinite(twin.steps[0].update) else None


@dataclass
class AtCheckpoint:
    """DeepNet's quantities at a run's newest intact checkpoint (step ``step``)."""

    step: int
    update: float  # ||F(x, theta_step) - F(x, theta_0)|| on the trainer's probe batch
    layers: list[str]
    grad_norm: list[float]  # on the training batch the run would take next
    ln_names: list[str]
    ln_input: list[float]


def at_checkpoint(run_dir, config: Config, start: Replay, device: str = "cpu") -> AtCheckpoint | None:
    """Measure the newest intact checkpoint of ``run_dir`` against ``start`` (a replay of the same config,
    which holds F(x, theta_0)); None if the run has no complete checkpoint."""
    from kilolayer.data import load_source
    from kilolayer.rundir import checkpoint_step, intact_checkpoint, load_run
    from kilolayer.train.loop import split_batch, to_device
    from kilolayer.train.parallelize import apply_checkpointing

    ckpt = intact_checkpoint(run_dir)
    if ckpt is None or start.reference is None:
        return None
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        _, task = load_run(run_dir, device=device)
        step = checkpoint_step(ckpt)
        current, ln_names, ln_input = diag.probe(task.objective, task.backbone, start.probe_batch)
        update = diag.update_size(current, start.reference)
        source = load_source(config)
        apply_checkpointing(task, config)  # the gradients below take what training takes, no more
        task.train()
        tc = config.train
        micro = split_batch(source.train_batch(step, tc.batch_size, 0, 1), tc.accumulate)
        for mb in micro:
            with _autocast(tc.precision, dev):
                loss, _ = task(to_device(mb, dev))
            (loss / len(micro)).backward()
        names, norms = diag.grad_norms(task.backbone)
    return AtCheckpoint(step, update, names, norms, ln_names, ln_input)
