"""What training applies to a built model from outside it: activation checkpointing, ``torch.compile``, and
DDP or FSDP2. The model (``kilolayer.nn``) knows nothing of any of them.

:func:`parallelize` applies them in that order, per Transformer layer where they work per layer:

* ``model.checkpoint_activations``: each layer's forward runs under :func:`torch.utils.checkpoint.checkpoint`
  (non-reentrant) while training with gradients on, so the backward pass keeps only each layer's input and
  recomputes one layer at a time. The module tree, hence parameter names and checkpoints, is unchanged. A
  backbone that an objective builds from a model section of its own (the contrastive objective's text tower,
  ``objective.options.text_model``) is checkpointed when that section sets ``checkpoint_activations``
  (:func:`apply_checkpointing`). With ``train.pin_mmap`` (Linux, glibc) it also pins glibc's mmap threshold
  (:func:`pin_mmap_threshold`): by default glibc raises that threshold after large frees, so later
  activation-sized blocks come from the heap, and the holes freed between the long-lived layer inputs that
  checkpointing keeps stay resident. At 1,000 layers of width 64 that was 46% of the peak (2.58 GiB
  against 1.39 pinned); the pin makes every such block a fresh mapping, and the step took 1.8x as long.
* ``train.compile``: ``layers`` (``true`` means the same) runs ``torch.compile`` on each Transformer layer
  (:func:`compile_layers`; the stack's Python loop, embeddings, heads and loss stay eager, and layers of one
  shape share one compiled graph, so compile time hardly grows with depth); ``model`` compiles the whole task
  once (:func:`compile_model`: backbone, objective heads and loss together, more to fuse, but the layer loop is
  unrolled into the graph, so compile time grows with depth); ``false``: eager. Both compile in place, so
  parameter names and checkpoints do not change.
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

from kilolayer.config import Config
from kilolayer.nn.transformer import Backbone
from kilolayer.train import distributed as D


def transformer_layers(backbone: nn.Module) -> list[nn.Module]:
    """The backbone's Transformer layers, encoder's then decoder's, in forward order."""
    return [layer for stack in backbone.stacks() for layer in stack.layers]


class _Recompute:
    """A layer's forward, run under activation checkpointing while training with gradients on."""

    def __init__(self, layer: nn.Module, forward: Callable):
        self.layer, self.forward = layer, forward

    def __call__(self, *args, **kwargs):
        if self.layer.training and torch.is_grad_enabled():
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
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
    if not sys.platform.startswith("linux") or os.environ.get(PIN_ENV) == "0":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it (musl's mallopt does nothing)
        return False
    return libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1


def checkpoint_layers(backbone: nn.Module, pin_mmap: bool = False) -> None:
    """Recompute each Transformer layer in the backward pass instead of keeping its activations (in place;
    names and state dict unchanged); with ``pin_mmap`` (or ``KILOLAYER_PIN_MMAP=1``), also pin glibc's mmap
    threshold (:func:`pin_mmap_threshold`). Calling it twice does nothing more."""
    layers = transformer_layers(backbone)
    for layer in layers:
        if not isinstance(layer.forward, _Recompute):
            layer.forward = _Recompute(layer, layer.forward)
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
        checkpoint_layers(backbone, pin_mmap=config.train.pin_mmap)
    return chosen


def compile_layers(backbone: nn.Module, **options) -> None:
    """``torch.compile`` each Transformer layer in place (``options`` go to ``nn.Module.compile``)."""
    for layer in transformer_layers(backbone):
        layer.compile(**options)


def compile_model(task: nn.Module, **options) -> None:
    """``torch.compile`` the whole task in place (``options`` go to ``nn.Module.compile``): calling ``task(batch)``
    runs backbone, objective heads and loss as compiled code; evaluation and diagnostics, which call the
    objective and backbone directly, stay eager."""
    task.compile(**options)


def distribute(task: nn.Module, mode: str, env: D.Dist) -> nn.Module:
    """DDP or FSDP2 around the task (``mode``: ``train.parallel``); the task itself for one process."""
    if not env.active:
        return task
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from kilolayer.nn.layers import Layer

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
    apply_checkpointing(task, config)
    if config.train.compile == "layers":
        compile_layers(task.backbone)
    elif config.train.compile == "model":
        compile_model(task)
    return distribute(task, config.train.parallel, env)
