"""What training applies to a built model from outside it: activation checkpointing, ``torch.compile``, and
DDP or FSDP2. The model (``kilolayer.nn``) knows nothing of any of them.

:func:`parallelize` applies them in that order, per Transformer layer where they work per layer:

* ``model.checkpoint_activations``: each layer's forward runs under :func:`torch.utils.checkpoint.checkpoint`
  (non-reentrant) while training with gradients on, so the backward pass keeps only each layer's input and
  recomputes one layer at a time. The module tree, hence parameter names and checkpoints, is unchanged. A
  backbone that an objective builds from a model section of its own (the contrastive objective's text tower,
  ``objective.options.text_model``) is checkpointed when that section sets ``checkpoint_activations``
  (:func:`apply_checkpointing`). An ``after_layer`` callback, if given, sees each checkpointed layer's output
  in eager code (the trainer's: :mod:`kilolayer.train.host.heap`'s trim).
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

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kilolayer.config import Config
from kilolayer.nn.layers import Layer
from kilolayer.nn.transformer import Backbone
from kilolayer.train import distributed as D


def transformer_layers(backbone: nn.Module) -> list[nn.Module]:
    """The backbone's Transformer layers, encoder's then decoder's, in forward order."""
    return [layer for stack in backbone.stacks() for layer in stack.layers]


#: called with each checkpointed layer's output, in eager code
AfterLayer = Callable[[object], None]


class _Recompute:
    """A layer's forward, run under activation checkpointing while training with gradients on."""

    def __init__(self, layer: nn.Module, forward: Callable, after_layer: AfterLayer | None = None):
        self.layer, self.forward, self.after_layer = layer, forward, after_layer

    def __call__(self, *args, **kwargs):
        if self.layer.training and torch.is_grad_enabled():
            out = checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
            # not inside a compiled graph (train.compile): a call out of it would split the graph at every layer
            if self.after_layer is not None and not torch.compiler.is_compiling():
                self.after_layer(out)
            return out
        return self.forward(*args, **kwargs)


def checkpoint_layers(backbone: nn.Module, after_layer: AfterLayer | None = None) -> None:
    """Recompute each Transformer layer in the backward pass instead of keeping its activations (in place;
    names and state dict unchanged), calling ``after_layer`` with each recomputed layer's output while training,
    outside compiled code. Calling it twice does nothing more."""
    for layer in transformer_layers(backbone):
        if not isinstance(layer.forward, _Recompute):
            layer.forward = _Recompute(layer, layer.forward, after_layer)


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


def apply_checkpointing(task: nn.Module, config: Config, after_layer: AfterLayer | None = None) -> list[nn.Module]:
    """Activation checkpointing as ``config`` asks (:func:`checkpointed_backbones`), in place, with
    ``after_layer`` for every checkpointed layer; returns the backbones it applied to. The first step of
    :func:`parallelize`, for code that trains a task outside the trainer (the doctor's replay)."""
    chosen = checkpointed_backbones(task, config)
    for backbone in chosen:
        checkpoint_layers(backbone, after_layer)
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

        mesh = D.device_mesh(env)
        for module in task.modules():  # the heads' own layers too (MAE's decoder, CLIP's text tower)
            if isinstance(module, Layer):
                fully_shard(module, mesh=mesh)
        fully_shard(task, mesh=mesh)
        # FSDP2 takes the first sharded module to run forward for the root. Evaluation, DeepNet's probe and early
        # stopping's check call the backbone's layers directly, some before the first training step: a layer would
        # take itself for the root, and the task's first forward then fail ("already lazily initialized"). So the
        # task initialises as the root here (FSDP2 has no public call for it).
        task._get_fsdp_state()._lazy_init()
        return task
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(task, device_ids=[env.device.index] if env.device.type == "cuda" else None)


def parallelize(task: nn.Module, config: Config, env: D.Dist, after_layer: AfterLayer | None = None) -> nn.Module:
    """Apply activation checkpointing (with ``after_layer`` for every checkpointed layer), compile and DDP/FSDP2
    to ``task`` (a :class:`~kilolayer.objectives.Task` already on its device), as ``config`` asks; returns the
    module to call for training steps (the task, or its DDP wrapper)."""
    apply_checkpointing(task, config, after_layer)
    if config.train.compile == "layers":
        compile_layers(task)
    elif config.train.compile == "model":
        compile_model(task)
    return distribute(task, config.train.parallel, env)
