"""DeepNet's stability diagnostics (docs/deepnet.md#stability-diagnostics), logged during training.

* per-layer gradient norm: ||grad|| over each Transformer layer's parameters;
* model update: ||F(x, theta_t) - F(x, theta_0)|| on a fixed probe batch, as the
  mean over the probe's output tokens of the per-token L2 distance;
* LayerNorm input magnitude: mean |input| of every LayerNorm on the probe batch.
"""

from __future__ import annotations

import torch
from torch import nn


def layer_names(backbone: nn.Module) -> list[tuple[str, nn.Module]]:
    """("encoder.0", layer), ... then ("decoder.0", layer), ... in forward order."""
    out = []
    for stack in backbone.stacks():
        out += [(f"{stack.side}.{i}", layer) for i, layer in enumerate(stack.layers)]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # FSDP2 shards are DTensors


def grad_norms(backbone: nn.Module, all_reduce=None) -> tuple[list[str], list[float]]:
    """Gradient norm of each layer (call after backward, before clipping)."""
    names, sq = [], []
    for name, layer in layer_names(backbone):
        total = torch.zeros((), dtype=torch.float64)
        for p in layer.parameters():
            if p.grad is not None:
                total += _local(p.grad).detach().double().pow(2).sum().cpu()
        names.append(name)
        sq.append(total)
    stacked = torch.stack(sq) if sq else torch.zeros(0, dtype=torch.float64)
    if all_reduce is not None:
        stacked = all_reduce(stacked)
    return names, stacked.sqrt().tolist()


class LayerNormInputs:
    """Forward pre-hooks that record mean |input| of every LayerNorm during one forward pass."""

    def __init__(self, backbone: nn.Module):
        self.norms = [(n, m) for n, m in backbone.named_modules() if isinstance(m, nn.LayerNorm)]
        self.values: dict[str, float] = {}
        self.handles = []

    def __enter__(self):
        for name, m in self.norms:
            self.handles.append(m.register_forward_pre_hook(self._hook(name)))
        return self

    def _hook(self, name):
        def hook(module, args):
            self.values[name] = float(args[0].detach().float().abs().mean())

        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []

    def result(self) -> tuple[list[str], list[float]]:
        names = [n for n, _ in self.norms if n in self.values]
        return names, [self.values[n] for n in names]


@torch.no_grad()
def probe(objective, backbone: nn.Module, batch: dict) -> tuple[torch.Tensor, list[str], list[float]]:
    """(F(x, theta) on the probe batch, LayerNorm names, their mean input magnitudes), in eval mode."""
    was = backbone.training
    backbone.eval()
    try:
        with LayerNormInputs(backbone) as lns:
            out = objective.represent(backbone, batch).float()
        names, values = lns.result()
    finally:
        backbone.train(was)
    return out, names, values


def update_size(current: torch.Tensor, reference: torch.Tensor) -> float:
    return float((current - reference).norm(dim=-1).mean())
