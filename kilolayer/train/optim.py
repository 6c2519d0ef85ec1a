"""AdamW with decay only on matrices, and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

# learned tokens and positions, exempt from weight decay as in ViT/MAE (timm's ``no_weight_decay``)
NO_DECAY_NAMES = frozenset({"cls", "mask_token", "positions", "decoder_positions"})


def decays(name: str, p: torch.Tensor) -> bool:
    """Whether AdamW decays parameter ``name``: weight matrices and token embeddings do; norms, biases,
    scalar/vector gains, the CLS and mask tokens and learned position embeddings do not."""
    return p.dim() >= 2 and name.rsplit(".", 1)[-1] not in NO_DECAY_NAMES


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: :func:`decays` parameters with ``weight_decay``, the rest with none."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(module: nn.Module, tc) -> torch.optim.Optimizer:
    kind = {"fused": True} if tc.fused_optimizer else {"foreach": True}
    return torch.optim.AdamW(param_groups(module, tc.weight_decay), lr=tc.lr, betas=tuple(tc.betas), eps=tc.eps, **kind)


def lr_factor(step: int, tc) -> float:
    """Multiplier on ``train.lr`` at ``step`` (0-based; the first update uses step 0).

    * constant: linear warm-up, then 1;
    * inverse_sqrt (the MT recipe): linear warm-up, then sqrt(warmup / step);
    * cosine: linear warm-up, then cosine decay to ``min_lr_ratio`` at ``train.steps``.
    """
    s = step + 1
    w = tc.warmup
    if w and s <= w:
        return s / w
    if tc.schedule == "constant":
        return 1.0
    if tc.schedule == "inverse_sqrt":
        return math.sqrt(w / s) if w else 1.0 / math.sqrt(s)
    span = max(1, tc.steps - w)
    progress = min(1.0, (s - w) / span)
    return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, tc) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, tc))
