"""The training engine: a config's task, optimizer and schedule, its training step and its evaluation.

:class:`Engine` builds everything a step needs from a config (data source, seeded initialisation, the task on
its device with :func:`~kilolayer.train.parallelize.parallelize` applied and the heap handled as
:mod:`kilolayer.train.host.heap` says, AdamW and the learning-rate
schedule) and runs steps and evaluations; it applies the divergence and early-stopping rules of
:mod:`kilolayer.train.policies`. It reads and writes no files and handles no signals: ``kilolayer train``
gives it a run directory (:class:`kilolayer.train.run.Run`); the doctor's replay, the study's cost
estimate and ``benchmarks/`` drive it in memory. :func:`forward_backward` and :func:`apply_update` are the
step's two halves, the one place where gradients are computed and applied.
"""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kilolayer.config import Config
from kilolayer.data import load_source
from kilolayer.data.base import with_sample_index
from kilolayer.errors import ConfigError, InputError
from kilolayer.nn.transformer import set_training_step
from kilolayer.objectives import build_task
from kilolayer.train import diagnostics as diag
from kilolayer.train import distributed as D
from kilolayer.train import host
from kilolayer.train.optim import build_optimizer, build_scheduler
from kilolayer.train.parallelize import parallelize
from kilolayer.train.policies import DivergenceRule, EarlyStopping


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


def autocast(precision: str, device: torch.device):
    """bf16 autocast for a step that runs in bf16; nothing for fp32 (``precision``: a run's decided precision,
    :mod:`kilolayer.train.host.precision`)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_backward(
    micro_batches: list,
    loss_of: Callable[[object], tuple[torch.Tensor, int]],
    params: Iterable[torch.Tensor],
    env: D.Dist | None = None,
    no_sync: Callable[[bool], object] | None = None,
) -> float:
    """Forward and backward over a step's micro-batches on every process; returns the step's loss.

    ``loss_of(mb)`` gives a micro-batch's loss L_i, a mean over its w_i targets, and w_i (the objective's
    ``loss_weight``). The loss returned and the gradients left on ``params`` are those of the mean over all
    the step's targets on all processes, sum_i w_i L_i / W with W = sum_i w_i (one all-reduce of the weights
    and weighted losses, as fairseq and torchtitan normalise): the same whatever the number of processes and
    micro-batches, to float rounding. Each L_i is back-propagated times w_i / w_ref; DDP (once, on the last
    micro-batch: ``no_sync(skip)`` wraps the others) or FSDP2 (on each) averages the processes' gradients,
    which are then multiplied by world * w_ref / W. w_ref is 1 with several processes (it must be the same on
    each) and w_0 in one: there one micro-batch is never rescaled, and k of equal weight are rescaled by 1/k,
    which for k a power of two is exact (bit for bit the mean of their losses' gradients)."""
    world = env.world if env is not None else 1
    ref, weighted, total = None, 0.0, 0
    for i, mb in enumerate(micro_batches):
        with no_sync(i < len(micro_batches) - 1) if no_sync is not None else contextlib.nullcontext():
            loss, weight = loss_of(mb)
            if ref is None:  # w_ref (1 where the first micro-batch has no targets)
                ref = (weight or 1) if world == 1 else 1
            (loss * (weight / ref)).backward()
        weighted, total = weighted + float(loss.detach()) * weight, total + weight
    if world > 1:
        weighted, total = D.all_sum(torch.tensor([weighted, total], dtype=torch.float64), env).tolist()
    total = total or 1  # no targets anywhere: nothing to normalise
    scale = world * ref / total
    if scale != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return weighted / total


def apply_update(optimizer: torch.optim.Optimizer, scheduler=None) -> None:
    """Apply the accumulated gradients, advance the schedule and clear the gradients."""
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class StepStats:
    """What :meth:`Engine.train_step` measured."""

    loss: float  # the step's loss: the mean over its targets on all processes (:func:`forward_backward`)
    grad_norm: torch.Tensor  # the global gradient norm before clipping
    tokens: int  # tokens the backbone processed on this process
    flops: float  # model FLOPs of the step on this process (the objective's train_flops)
    layer_grads: tuple[list[str], list[float]] | None  # per-layer gradient norms, when asked for


class Engine:
    """A config's task, optimizer and schedule on ``env``'s device, seeded as ``train.seed`` says.

    ``fresh=True`` initialises the weights (``train.init_from``, then the schemes' data-dependent
    initialisation); ``fresh=False`` leaves them for :meth:`load_state`. ``source`` reuses a loaded data source.
    ``precision`` (fp32 | bf16) is what the steps run at; None: ``train.precision``, ``auto`` decided here
    (:mod:`kilolayer.train.host.precision`; a run decides it once and hands it over).
    """

    def __init__(
        self, config: Config, env: D.Dist | None = None, fresh: bool = True, source=None, precision: str | None = None
    ):
        self.config, tc = config, config.train
        self.env = env if env is not None else D.Dist(device=torch.device("cpu"))
        self.precision = precision or host.precision_policy(tc.precision, self.env.device, config, step_speedup).value
        self.source = source if source is not None else load_source(config)
        seed_everything(tc.seed)
        self.task = build_task(config, self.source)
        self.objective = self.task.objective
        self.init_from: dict | None = None  # the run whose weights a fresh start loaded, and its step
        if fresh:
            self._initialise()
        self.task.to(self.env.device)
        trim = host.apply_heap(self.task, config, self.env.device)  # glibc's heap: before the layers are wrapped
        self.model = parallelize(self.task, config, self.env, after_layer=trim)
        if not any(p.requires_grad for p in self.task.parameters()):
            raise ConfigError("train: nothing to train (every parameter is frozen)")
        self.optimizer = build_optimizer(self.task, tc)
        self.scheduler = build_scheduler(self.optimizer, tc)
        self.divergence = DivergenceRule(tc)
        self.early_stopping = EarlyStopping(tc)
        self.step = 0  # the last step whose update is applied
        self.tokens = 0  # tokens trained on, over all processes
        # F(x, theta_0) on a fixed probe batch: the reference of DeepNet's model update (train.diagnostics_every),
        # with the LayerNorm inputs at initialisation
        self.probe_batch = self.reference = self.initial_ln = None
        if tc.diagnostics_every:
            self.probe_batch = self.eval_batch(min(8, tc.batch_size))
            if fresh:
                with self.full_params():
                    self.reference, *self.initial_ln = diag.probe(self.objective, self.task.backbone, self.probe_batch)

    def _initialise(self) -> None:
        from kilolayer.nn.transformer import data_dependent_init

        tc = self.config.train
        if tc.init_from:
            from kilolayer.train.init_from import load_pretrained

            loaded = load_pretrained(self.task, tc.init_from, freeze=tc.freeze_backbone)
            self.init_from = {"path": str(Path(tc.init_from).resolve()), "step": loaded["step"]}
            # the loaded weights carry the source run's step (BranchNorm's schedule); this run has applied none
            set_training_step(self.task, 0)
        # every backbone of the task (a CLIP text tower too); the batch is drawn only if a scheme runs the pass
        # (Admin's profiled omega)
        data_dependent_init(
            self.task, lambda: self.objective(self.task.backbone, self.source.train_batch(0, tc.batch_size))
        )

    # -------------------------------------------------------------- the step

    def train_step(self, step: int, layer_grads: bool = False) -> StepStats:
        """Forward and backward over step ``step``'s micro-batches (``train.accumulate``; DDP all-reduces on the
        last one only), under autocast for the engine's precision, normalised by the step's targets on all
        processes (:func:`forward_backward`); then the per-layer gradient norms (on diagnostic steps, and on
        every step with ``layer_grads``) and clipping to ``train.clip``. The gradients are left for
        :meth:`update`, which a diverged step never reaches."""
        tc, env = self.config.train, self.env
        # each sample carries its index in the run's sample stream: random masks are keyed by it, so they are the
        # same at any number of processes and micro-batches
        batch = self.source.train_batch(step - 1, tc.batch_size, env.rank, env.world)
        batch = with_sample_index(batch, step - 1, tc.batch_size, env.rank, env.world)
        tokens, flops = 0, 0.0

        def loss_of(mb):
            nonlocal tokens, flops
            # each micro-batch's masks are drawn just before its forward pass, and its tokens and FLOPs are counted
            # on them
            mb = self.objective.prepare(to_device(mb, env.device))
            tokens += self.objective.tokens(mb)
            flops += self.objective.train_flops(mb)
            with autocast(self.precision, env.device):
                return self.model(mb)[0], self.objective.loss_weight(mb)

        micro = split_batch(batch, tc.accumulate)
        loss = forward_backward(micro, loss_of, self.task.parameters(), env, self._no_sync)
        grads = None
        if layer_grads or self.diagnostic_step(step):
            grads = diag.grad_norms(self.task.backbone, (lambda t: D.all_sum(t, env)) if env.active else None)
        params = [p for p in self.task.parameters() if p.grad is not None]
        gnorm = torch.nn.utils.clip_grad_norm_(params, tc.clip if tc.clip > 0 else float("inf"))
        return StepStats(loss, gnorm, tokens, flops, grads)

    def diverged(self, step: int, loss: float) -> str:
        """The divergence rule's verdict on step ``step`` ("" if it has not diverged); a diverged step's
        gradients are dropped."""
        reason = self.divergence(step, loss)
        if reason:
            self.optimizer.zero_grad(set_to_none=True)
        return reason

    def update(self, step: int, stats: StepStats) -> None:
        """Apply step ``step``'s gradients (optimizer, then schedule), tell the model, and count its tokens."""
        apply_update(self.optimizer, self.scheduler)
        set_training_step(self.task, step)
        self.tokens += stats.tokens * self.env.world
        self.step = step

    def diagnostic_step(self, step: int) -> bool:
        tc = self.config.train
        every, until = tc.diagnostics_every, tc.diagnostics_until
        return every > 0 and (step == 1 or step % every == 0) and (not until or step <= until)

    def _no_sync(self, skip: bool):
        """DDP's ``no_sync`` for a micro-batch whose gradients are not all-reduced yet."""
        if skip and self.env.active and self.config.train.parallel == "ddp":
            return self.model.no_sync()
        return contextlib.nullcontext()

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # -------------------------------------------------------------- evaluation and probes

    def eval_batch(self, size: int) -> dict:
        """The first ``size`` evaluation samples as one batch on the device."""
        return to_device(next(self.source.eval_batches(size, size)), self.env.device)

    @contextlib.contextmanager
    def full_params(self):
        """Under FSDP2, the root's parameters (embeddings, heads) gathered, for calls that bypass task.forward."""
        if self.env.active and self.config.train.parallel == "fsdp":
            self.model.unshard()
            try:
                yield
            finally:
                self.model.reshard()
        else:
            yield

    @contextlib.contextmanager
    def evaluating(self):
        """Eval mode, gathered parameters and autocast, in a forked RNG stream: what evaluation runs in, so that
        it never consumes the training's random numbers (bit-exact resume)."""
        env = self.env
        self.task.eval()
        try:
            with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []):
                with torch.no_grad(), self.full_params(), autocast(self.precision, env.device):
                    yield
        finally:
            self.task.train()

    def eval_data(self, batches: int | None = None):
        """The evaluation batches :meth:`evaluate` scores: the first ``train.eval_batches`` (or ``batches``) of
        ``train.batch_size`` samples (on the CPU)."""
        tc = self.config.train
        return self.source.eval_batches(tc.batch_size, (batches or tc.eval_batches) * tc.batch_size)

    def evaluate(self, batches: int | None = None) -> dict:
        """The objective's evaluation metrics over ``train.eval_batches`` batches (or ``batches``)."""
        with self.evaluating():
            data = (to_device(b, self.env.device) for b in self.eval_data(batches))
            metrics = self.objective.evaluate(self.task.backbone, data)
        return {k: float(v) for k, v in metrics.items()}

    def baselines(self, batches: int | None = None, paired: bool = False) -> dict:
        """The objective's baselines (:meth:`~kilolayer.objectives.base.Objective.baselines`) on the pairs
        :meth:`evaluate` scores, with the split they come from: ``{"split", "pairs", "baselines"}``; {} where the
        objective has none. No model runs: every process may call it alone. ``paired``: right after
        :meth:`evaluate` of the same batches, each baseline also holds the model's paired bootstrap difference
        from it (seq2seq's ``model_minus``)."""
        found = self.objective.baselines(self.eval_data(batches), paired=paired)
        return {"split": self.source.eval_split, **found} if found else {}

    def check_early_stop_metric(self) -> None:
        """Early stopping's metric must be one the objective reports: one evaluation batch says."""
        names = self.evaluate(batches=1)
        if self.early_stopping.metric not in names:
            raise ConfigError(
                f"train.early_stop_metric={self.early_stopping.metric!r}: not an evaluation metric of "
                f"{self.config.objective.name} (it reports {', '.join(sorted(names))})"
            )

    def probe(self, batch: dict | None = None) -> tuple[torch.Tensor, list[str], list[float]]:
        """F(x, theta) and the mean input magnitude of every LayerNorm on ``batch`` (the probe batch), in a
        forked RNG stream."""
        with torch.random.fork_rng(devices=[]), self.full_params():
            return diag.probe(self.objective, self.task.backbone, batch if batch is not None else self.probe_batch)

    def diagnostics(self, step: int, names: list[str], norms: list[float]) -> dict:
        """DeepNet's per-step quantities as a ``diagnostics`` record: per-layer gradient norms, the model update
        ||F(x, theta_t) - F(x, theta_0)|| on the probe batch, and the LayerNorm inputs."""
        out, ln_names, ln_values = self.probe()
        return {
            "step": step,
            "split": "diagnostics",
            "layers": names,
            "grad_norm": norms,
            "update": diag.update_size(out, self.reference),
            "ln_names": ln_names,
            "ln_input": ln_values,
        }

    # -------------------------------------------------------------- state

    def trainer_state(self) -> dict:
        """The rules' and counters' state, as a checkpoint's ``state.json`` keeps it under ``trainer``."""
        state = {**self.divergence.state_dict(), "tokens": self.tokens, **self.early_stopping.state_dict()}
        if self.init_from is not None:
            state["init_from"] = self.init_from
        return state

    def state(self, step: int | None = None) -> dict:
        """Everything a checkpoint of ``step`` (the last updated one by default) holds; collective under FSDP:
        every process calls it."""
        tensors, plain = rng_state()
        return {
            "model": D.model_state(self.model),
            "optimizer": {
                "optimizer": D.optimizer_state(self.model, self.optimizer),
                "scheduler": self.scheduler.state_dict(),
            },
            "rng": tensors,
            "state": {
                "step": self.step if step is None else step,
                "rng": plain,
                "trainer": self.trainer_state(),
                "precision": self.precision,  # what the weights trained at: a resume of an auto run keeps it
            },
            "extra": {"reference": self.reference.cpu()} if self.reference is not None else None,
        }

    def load_state(self, data: dict, source: Path) -> str:
        """Continue from a checkpoint's contents (read from ``source``, named in errors): weights, optimizer
        moments and schedule position, the rules' state and the RNG streams. The optimizer's hyper-parameters
        and the schedule's formula come from this engine's config (a resume may change ``train.*``).
        Returns a line to show if early stopping starts over ("" otherwise)."""
        tc = self.config.train
        st = data["state"]
        if tc.steps < int(st["step"]):
            raise ConfigError(
                f"train.steps={tc.steps}: the run is already at step {st['step']} ({source}); "
                f"give train.steps >= {st['step']}"
            )
        D.load_model_state(self.model, data["model"])
        if tc.freeze_backbone:
            for p in self.task.backbone.parameters():
                p.requires_grad_(False)
        planned = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        try:
            D.load_optimizer_state(self.model, self.optimizer, data["optimizer"]["optimizer"])
            self.scheduler.load_state_dict(data["optimizer"]["scheduler"])
        except (KeyError, ValueError, RuntimeError) as err:
            raise InputError(
                f"{source / 'optimizer.pt'}: does not fit this run ({str(err).splitlines()[0][:100]})"
            ) from None
        for group, plan in zip(self.optimizer.param_groups, planned):
            group.update(plan)
        sched = self.scheduler
        sched.base_lrs = [g["initial_lr"] for g in self.optimizer.param_groups]
        # LambdaLR's own formula, with the lambdas reading the current config: the schedule re-planned from here
        lrs = [base * f(sched.last_epoch) for f, base in zip(sched.lr_lambdas, sched.base_lrs)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs
        self.step = int(st["step"])
        saved = st["trainer"]
        self.divergence.load_state_dict(saved)
        self.tokens = int(saved.get("tokens", 0))
        self.init_from = saved.get("init_from")
        dropped = self.early_stopping.resume(saved, self.step)
        set_rng_state(data["rng"], st["rng"])
        extra = data.get("extra") or {}
        if "reference" in extra:
            self.reference = extra["reference"].to(self.env.device)
        return dropped


#: the batches the step probe cycles through: each is stepped in both precisions before any step is timed
PROBE_BATCHES = 4


def step_speedup(config: Config, seconds: float = 1.0) -> float:
    """fp32 time over bf16 time of a training step of ``config`` (above 1: bf16 is faster): one engine of it on the
    CPU, whose steps alternate between fp32 and bf16 autocast for an even number of rounds, at least eight, and
    about ``seconds`` (:func:`kilolayer.train.host.precision.ratio_in_turns`), the step's batch, forward, backward
    and update each time. Both precisions cycle through the same :data:`PROBE_BATCHES` batches, each stepped in
    both before any step is timed: batches of other lengths would otherwise decide a round, and a tensor shape
    met for the first time costs bf16's matrix products a set-up that a long run pays once. ``train.precision:
    auto`` gives it the probe's config (:class:`~kilolayer.train.host.precision.StepShape`). The global random
    streams are as they were before it."""
    saved = rng_state()
    try:
        engine = Engine(config, precision="fp32")
        taken = {"fp32": 0, "bf16": 0}

        def one(precision: str) -> None:
            taken[precision] += 1
            engine.precision = precision
            engine.update(taken[precision], engine.train_step(1 + (taken[precision] - 1) % PROBE_BATCHES))

        for _ in range(PROBE_BATCHES):
            one("fp32"), one("bf16")
        return host.ratio_in_turns(lambda: one("fp32"), lambda: one("bf16"), seconds)
    finally:
        engine = None
        gc.collect()  # the probe's model, optimizer and data go before the run builds its own
        set_rng_state(*saved)
