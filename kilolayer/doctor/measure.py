"""Replay the first steps of a config in memory and measure DeepNet's quantities at every step.

:func:`replay` drives the training engine (:class:`kilolayer.train.engine.Engine`) that ``kilolayer
train`` drives, in memory: the same seed, initialisation, batches, step, AdamW, learning-rate schedule and
divergence rule, for ``steps`` optimiser steps, without touching the disk. After each step it records what
``train.diagnostics_every`` logs (per-layer gradient norms before clipping, the model update
``||F(x, theta_t) - F(x, theta_0)||`` on the engine's probe batch, the mean input magnitude of every
LayerNorm) and the training loss. Because data and initialisation depend only on the seeds, the replayed
steps are the run's: for an eager run at the same thread count, loss for loss, bit for bit (a compiled run
differs in the last bits; the replay runs eager). ``kilolayer doctor RUN_DIR`` uses it for runs trained
without diagnostics, and the forecast uses it before any run exists.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from kilolayer.config import Config, load_config
from kilolayer.train import diagnostics as diag
from kilolayer.train.distributed import Dist
from kilolayer.train.engine import Engine, autocast, forward_backward, split_batch, to_device


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
    """The steps replayed; ``stopped`` says why fewer than asked were run (the engine's divergence rule, or a
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
    state: dict | None = None  # with ``keep_state``: the engine's state after the last step, as a checkpoint holds it

    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]


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


def _in_memory(config: Config) -> Config:
    """``config`` as the replay trains it: eager (a compile per replayed config costs more than the steps; a
    compiled run's losses differ from eager ones in the last bits) and with glibc's heap left as it is (holding
    it lasts for the life of the process that asks for a replay)."""
    if not config.train.compile and not config.train.hold_heap:
        return config
    data = config.model_dump()
    data["train"].update(compile=False, hold_heap=False)
    return load_config(data)


def replay(config: Config, steps: int, device: str = "cpu", eval_every: int = 0, keep_state: bool = False) -> Replay:
    """Train ``config`` for ``steps`` steps in memory on the training engine, measuring after every step (see
    module docstring); with ``eval_every``, also the loss on a fixed evaluation batch (up to 64 samples) before
    training and every ``eval_every`` steps. Stops where the divergence rule stops a run. With ``keep_state``,
    a replay that ran every step keeps the engine's state after the last one (:meth:`Engine.state`: weights,
    optimizer, schedule, the rules' state and the random streams): what the run's checkpoint of that step holds.

    Writes nothing and leaves the global random state as it found it."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        engine = Engine(_in_memory(config), Dist(device=dev))
        task, bs = engine.task, config.train.batch_size
        if engine.reference is not None:  # taken as the run takes it (train.diagnostics_every)
            probe_batch, reference, (ln_names, ln_input) = engine.probe_batch, engine.reference, engine.initial_ln
        else:  # in a stream of its own: the replay must not consume random numbers the run did not
            with torch.random.fork_rng(devices=[]):
                probe_batch = engine.eval_batch(min(8, bs))
            reference, ln_names, ln_input = engine.probe(probe_batch)
        output_norm = float(reference.norm(dim=-1).mean())
        previous = reference
        eval_batch = eval_loss0 = None
        if eval_every:
            with torch.random.fork_rng(devices=[]):
                eval_batch = engine.eval_batch(64)
                eval_loss0 = _eval_loss(task, eval_batch)
        out: list[Step] = []
        stopped = ""
        task.train()
        for step in range(1, steps + 1):
            stats = engine.train_step(step, layer_grads=True)
            record = Step(step, engine.lr(), stats.loss, *stats.layer_grads)
            out.append(record)
            stopped = engine.diverged(step, stats.loss)
            if stopped:
                break
            engine.update(step, stats)
            current, record.ln_names, record.ln_input = engine.probe(probe_batch)
            if eval_batch is not None and (step % eval_every == 0 or step == steps):
                with torch.random.fork_rng(devices=[]):
                    record.eval_loss = _eval_loss(task, eval_batch)
            record.update = diag.update_size(current, reference)
            record.change = diag.update_size(current, previous)
            previous = current
            if not math.isfinite(record.update):
                stopped = f"non-finite output after step {step}"
                break
        # inside the replay's random stream: the state the run's own streams are in after its step
        state = engine.state() if keep_state and not stopped and len(out) == steps else None
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
        engine.divergence.ungated,
        state,
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
    update: float  # ||F(x, theta_step) - F(x, theta_0)|| on the engine's probe batch
    layers: list[str]
    grad_norm: list[float]  # on the training batch the run would take next
    ln_names: list[str]
    ln_input: list[float]


def at_checkpoint(run_dir, config: Config, start: Replay, device: str = "cpu") -> AtCheckpoint | None:
    """Measure the newest intact checkpoint of ``run_dir`` against ``start`` (a replay of the same config,
    which holds F(x, theta_0)); None if the run has no complete checkpoint."""
    from kilolayer.data import load_source
    from kilolayer.data.base import with_sample_index
    from kilolayer.rundir import checkpoint_step, intact_checkpoint
    from kilolayer.train.checkpoint import load_run
    from kilolayer.train.host import apply_heap
    from kilolayer.train.parallelize import apply_checkpointing

    ckpt = intact_checkpoint(run_dir)
    if ckpt is None or start.reference is None:
        return None
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        _, task = load_run(run_dir, device=device, checkpoint=ckpt)  # the step measured is the weights' own
        step = checkpoint_step(ckpt)
        current, ln_names, ln_input = diag.probe(task.objective, task.backbone, start.probe_batch)
        update = diag.update_size(current, start.reference)
        source = load_source(config)
        # the gradients below take what training takes, no more
        apply_checkpointing(task, config, apply_heap(task, config, dev))
        task.train()
        tc = config.train
        batch = with_sample_index(source.train_batch(step, tc.batch_size), step, tc.batch_size)  # training's masks
        micro = [to_device(mb, dev) for mb in split_batch(batch, tc.accumulate)]

        def loss_of(mb):
            mb = task.objective.prepare(mb)
            with autocast(tc.precision, dev):
                return task(mb)[0], task.objective.loss_weight(mb)

        forward_backward(micro, loss_of, task.parameters())
        names, norms = diag.grad_norms(task.backbone)
    return AtCheckpoint(step, update, names, norms, ln_names, ln_input)
