"""What training applies to a built model from outside it: activation checkpointing, ``torch.compile``, and
DDP or FSDP2. The model (``kilolayer.nn``) knows nothing of any of them.

:func:`parallelize` applies them in that order, per Transformer layer where they work per layer:

* ``model.checkpoint_activations``: each layer's forward runs under :func:`torch.utils.checkpoint.checkpoint`
  (non-reentrant) while training with gradients on, so the backward pass keeps only each layer's input and
  recomputes one layer at a time. The module tree, hence parameter names and checkpoints, is unchanged. A
  backbone that an objective builds from a model section of its own (the contrastive objective's text tower,
  ``objective.options.text_model``) is checkpointed when that section sets ``checkpoint_activations``
  (:func:`apply_checkpointing`). Every ``train.trim_heap_every`` checkpointed layers (Linux, glibc) the
  forward pass, and the backward pass at the same layers, hand the heap's free pages back to the system
  (:class:`HeapTrimmer`, ``malloc_trim``): each recomputed layer frees its activation blocks between
  long-lived tensors, and the holes would stay resident otherwise. ``train.pin_mmap`` instead pins glibc's
  mmap threshold (:func:`pin_mmap_threshold`), so every such block is a fresh mapping: it saves as much but
  costs step time, so it is opt-in (figures for both: docs/benchmarks.md). The trim runs in eager layers on
  the CPU only: not inside a compiled graph (``train.compile``), whose graphs a call out would
  split at every layer, nor for CUDA activations, which are not on the heap.
* ``train.hold_heap`` (on by default; CPU, Linux/glibc, nothing checkpointed): :func:`hold_heap` keeps the
  memory one step frees for the next. glibc's default hands the top of the heap back to the system once a
  step has freed its activations, and the next step faults the same pages in again (page faults and system
  time with and without: ``python -m benchmarks.heap``, docs/benchmarks.md). The setting is process-wide and
  lasts for the process's life (each study point trains in its own process); with any layer checkpointed (a
  contrastive text tower's too) the heap trim above applies instead.
* ``train.compile``: ``layers`` (``true`` means the same) runs ``torch.compile`` on each Transformer layer, the
  backbone's and those of the objective's own towers (:func:`compile_layers`; the stack's Python loop,
  embeddings, heads and loss stay eager, and layers of one shape share one compiled graph, so compile time
  hardly grows with depth); ``model`` compiles the whole task once (:func:`compile_model`: backbone, objective
  heads and loss together after the objective's eager ``prepare``, more to fuse, but the layer loop is unrolled
  into the graph, so compile time grows with depth); ``false``: eager. Both compile in place, so parameter
  names and checkpoints do not change.
* under ``torchrun``, ``train.parallel``: ``fsdp`` shards each layer and then the whole task (FSDP2's
  ``fully_shard``); ``ddp`` wraps the task in ``DistributedDataParallel``. One process: nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kilolayer import rundir
from kilolayer.config import Config
from kilolayer.nn.layers import Layer
from kilolayer.nn.transformer import Backbone
from kilolayer.train import distributed as D


def transformer_layers(backbone: nn.Module) -> list[nn.Module]:
    """The backbone's Transformer layers, encoder's then decoder's, in forward order."""
    return [layer for stack in backbone.stacks() for layer in stack.layers]


def _glibc() -> ctypes.CDLL | None:
    """glibc, where this process runs on it (Linux); None elsewhere (musl and others lack its malloc tunables)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "malloc_trim") else None


#: release the heap's free pages every this many checkpointed layers (train.trim_heap_every's default)
TRIM_EVERY = 32
#: 0 (or false, off, no) turns the heap trim off whatever the config says (the memory benchmark's "untrimmed"
#: column)
TRIM_ENV = "KILOLAYER_TRIM_HEAP"


class HeapTrimmer:
    """Hands the heap's free pages back to the system (glibc's ``malloc_trim(0)``, which releases whole free
    pages anywhere in the heap, not only at its top) every ``every`` checkpointed layers, in the forward pass
    and again in the backward pass when the gradient reaches the same layers' outputs.

    Why: a checkpointed layer keeps only its input, and in the backward pass recomputes its activations,
    frees them and moves on. Those blocks come from the heap between tensors that live on (the kept inputs,
    the gradients), so the freed holes stay resident and the peak grows with depth. Trimming does not move
    any tensor or change any number; its cost is a page fault for each page handed back and reused, and a
    walk of the heap's free blocks per call. ``trim`` replaces ``malloc_trim`` (tests count the calls)."""

    def __init__(self, every: int = TRIM_EVERY, trim: Callable[[], object] | None = None):
        if trim is None:
            off = os.environ.get(TRIM_ENV, "").strip().lower() in ("0", "false", "off", "no")
            libc = _glibc() if every > 0 and not off else None
            trim = (lambda: libc.malloc_trim(0)) if libc is not None else None
        self.every, self.trim, self.layers = every, trim, 0

    @property
    def active(self) -> bool:
        return self.trim is not None and self.every > 0

    def after_layer(self, out: object) -> None:
        """Called with each checkpointed layer's output: trim now at every ``every``-th layer, and once more
        when the backward pass has computed that output's gradient."""
        if not self.active or not isinstance(out, torch.Tensor) or out.device.type != "cpu":
            return  # (a CUDA step's activations are not on this process's heap)
        self.layers += 1
        if self.layers % self.every:
            return
        self.trim()
        if out.requires_grad:
            out.register_hook(self._in_backward)

    def _in_backward(self, grad: torch.Tensor) -> None:
        self.trim()


class _Recompute:
    """A layer's forward, run under activation checkpointing while training with gradients on."""

    def __init__(self, layer: nn.Module, forward: Callable, trimmer: HeapTrimmer | None = None):
        self.layer, self.forward, self.trimmer = layer, forward, trimmer

    def __call__(self, *args, **kwargs):
        if self.layer.training and torch.is_grad_enabled():
            out = checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
            # not inside a compiled graph (train.compile): a call out of it would split the graph at every layer
            if self.trimmer is not None and not torch.compiler.is_compiling():
                self.trimmer.after_layer(out)
            return out
        return self.forward(*args, **kwargs)


#: glibc's mallopt parameter number for the mmap threshold (malloc.h)
_M_MMAP_THRESHOLD = -3
#: blocks of at least this many bytes get their own mapping, returned to the system when freed
MMAP_THRESHOLD = 64 * 1024
#: 1 pins the threshold wherever layers are checkpointed, 0 never (overriding train.pin_mmap; the memory
#: benchmark measures both)
PIN_ENV = "KILOLAYER_PIN_MMAP"


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for the rest of this process, so freed activation
    blocks go back to the system instead of leaving holes in the heap. Returns whether it was pinned: not on
    other C libraries or systems, nor when ``MALLOC_MMAP_THRESHOLD_`` (glibc's own setting, which wins) is
    set, nor with ``KILOLAYER_PIN_MMAP=0``."""
    if os.environ.get(PIN_ENV) == "0" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()  # only glibc has the setting (musl's mallopt does nothing)
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1


#: glibc's mallopt parameter number for the trim threshold (malloc.h)
_M_TRIM_THRESHOLD = -1
#: what :func:`hold_heap` sets: blocks below 32 MiB (glibc's largest dynamic mmap threshold) come from the
#: heap, and free memory at its top is handed back only past 2 GiB (mallopt takes an int)
HOLD_MMAP_THRESHOLD = 32 * 1024 * 1024
HOLD_TRIM_THRESHOLD = 2**31 - 1
#: 0 (or false, off, no) turns the held heap off whatever the config says
HOLD_ENV = "KILOLAYER_HOLD_HEAP"
_GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _glibc_malloc_settings() -> list[str]:
    """glibc's own malloc settings in this process's environment (non-empty ``MALLOC_*_`` variables, and
    ``glibc.malloc.*`` tunables in ``GLIBC_TUNABLES``): a user who set them decides the allocator's behaviour."""
    found = [name for name in _GLIBC_ENV if os.environ.get(name, "").strip()]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables:
        found.append("GLIBC_TUNABLES")
    return found


def hold_heap() -> bool:
    """Keep the memory a training step frees for the next step, for the rest of this process (glibc): fix the
    mmap threshold at 32 MiB and the trim threshold at 2 GiB, so the activations of one step reuse the pages of
    the last instead of being handed back and faulted in again, page by page, as glibc's dynamic thresholds do
    after a step frees its activations. Returns whether it was set: not on other C libraries or systems, nor
    when glibc's own settings are in the environment (non-empty ``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_TOP_PAD_``, or ``glibc.malloc.*`` in ``GLIBC_TUNABLES``: they win),
    nor with ``KILOLAYER_HOLD_HEAP=0`` (or false, off, no). With another allocator preloaded (jemalloc,
    tcmalloc) it may return True and change nothing.

    It cannot be undone: glibc's dynamic thresholds stay off for the process's life, which then keeps the
    memory it has used at its highest (up to 2 GiB free at the heap's top) until it exits. A later
    checkpointed run in the same process still hands free pages back through :class:`HeapTrimmer`
    (``malloc_trim`` ignores the trim threshold)."""
    if os.environ.get(HOLD_ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return False
    if _glibc_malloc_settings():
        return False
    libc = _glibc()
    if libc is None:
        return False
    mmap_set = libc.mallopt(_M_MMAP_THRESHOLD, HOLD_MMAP_THRESHOLD) == 1
    held = mmap_set and libc.mallopt(_M_TRIM_THRESHOLD, HOLD_TRIM_THRESHOLD) == 1
    if not held and not _WARNED[0]:  # glibc itself said no: unexpected, unlike the settings a user chose above
        _WARNED[0] = True
        which = "the trim threshold (the mmap threshold is set)" if mmap_set else "the mmap threshold"
        rundir.warn(f"train.hold_heap: glibc's mallopt refused {which}; the heap is not held")
    _HELD[0] = _HELD[0] or held
    return held


#: whether :func:`hold_heap` has held this process's heap (it stays held); whether it has warned of a refusal
_HELD = [False]
_WARNED = [False]


def heap_held() -> bool:
    """Whether this process's heap is held (:func:`hold_heap` succeeded in it at some point): a completed
    run's ``status.json`` records it as ``heap_held``, so step times of runs can be compared knowingly."""
    return _HELD[0]


def checkpoint_layers(backbone: nn.Module, pin_mmap: bool = False, trim_every: int = TRIM_EVERY) -> None:
    """Recompute each Transformer layer in the backward pass instead of keeping its activations (in place;
    names and state dict unchanged), releasing the heap's free pages every ``trim_every`` layers
    (:class:`HeapTrimmer`; 0: never); with ``pin_mmap`` (or ``KILOLAYER_PIN_MMAP=1``), also pin glibc's mmap
    threshold (:func:`pin_mmap_threshold`). Calling it twice does nothing more."""
    layers = transformer_layers(backbone)
    trimmer = HeapTrimmer(trim_every) if layers else None
    trimmer = trimmer if trimmer is not None and trimmer.active else None
    for layer in layers:
        if not isinstance(layer.forward, _Recompute):
            layer.forward = _Recompute(layer, layer.forward, trimmer)
    if layers and (pin_mmap or os.environ.get(PIN_ENV) == "1"):
        pin_mmap_threshold()


def checkpointed_backbones(task: nn.Module, config: Config) -> list[nn.Module]:
    """The backbones of ``task`` whose layers activation checkpointing recomputes: the task's own backbone
    with ``model.checkpoint_activations``, and each backbone its objective builds from a model section of its
    own (the contrastive text tower: ``objective.options.text_model``) when that section sets it."""
    chosen = [task.backbone] if config.model.checkpoint_activations else []
    chosen += [
        m
        for m in task.objective.modules()
        if isinstance(m, Backbone) and m is not task.backbone and m.config.checkpoint_activations
    ]
    return chosen


def apply_checkpointing(task: nn.Module, config: Config) -> list[nn.Module]:
    """Activation checkpointing as ``config`` asks (:func:`checkpointed_backbones`), in place; returns the
    backbones it applied to. The first step of :func:`parallelize`, for code that trains a task outside the
    trainer (the doctor's replay)."""
    chosen = checkpointed_backbones(task, config)
    for backbone in chosen:
        checkpoint_layers(backbone, pin_mmap=config.train.pin_mmap, trim_every=config.train.trim_heap_every)
    return chosen


def compile_layers(module: nn.Module, **options) -> None:
    """``torch.compile`` each Transformer layer in ``module`` in place (``options`` go to ``nn.Module.compile``):
    given a task, the backbone's and those of the objective's own towers (MAE's decoder, the contrastive text
    tower)."""
    for layer in [m for m in module.modules() if isinstance(m, Layer)]:
        layer.compile(**options)


def compile_model(task: nn.Module, **options) -> None:
    """``torch.compile`` the whole task in place (``options`` go to ``torch.compile``): calling ``task(batch)``
    runs the objective's eager ``prepare`` (random masks, index lists), then backbone, objective heads and loss
    as compiled code (:meth:`Task.compute <kilolayer.objectives.base.Task.compute>`); evaluation and diagnostics,
    which call the objective and backbone directly, stay eager. Weights and their names are untouched."""
    task.compute = torch.compile(task.compute, **options)


def distribute(task: nn.Module, mode: str, env: D.Dist) -> nn.Module:
    """DDP or FSDP2 around the task (``mode``: ``train.parallel``); the task itself for one process."""
    if not env.active:
        return task
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for module in task.modules():  # the heads' own layers too (MAE's decoder, CLIP's text tower)
            if isinstance(module, Layer):
                fully_shard(module)
        fully_shard(task)
        return task
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(task, device_ids=[env.device.index] if env.device.type == "cuda" else None)


def parallelize(task: nn.Module, config: Config, env: D.Dist) -> nn.Module:
    """Apply activation checkpointing, compile and DDP/FSDP2 to ``task`` (a :class:`~kilolayer.objectives.Task`
    already on its device), as ``config`` asks; returns the module to call for training steps (the task, or
    its DDP wrapper)."""
    checkpointed = apply_checkpointing(task, config)
    if config.train.hold_heap and not checkpointed and env.device.type == "cpu":
        hold_heap()
    if config.train.compile == "layers":
        compile_layers(task)
    elif config.train.compile == "model":
        compile_model(task)
    return distribute(task, config.train.parallel, env)
