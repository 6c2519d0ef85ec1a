"""What each layer of a stack reads: the previous layer's output, or DLCL's combination of all earlier ones.

A stack hands its history every output in order, the embedding output first (``y_0``) and then each layer's
(``y_1 .. y_N``); after each one, :meth:`LayerHistory.push` returns what comes next, the next layer's input or,
after the last layer, the stack's output. The history is a child of the stack, not of a layer, so its
parameters sit outside the per-layer units that activation checkpointing, ``torch.compile`` and FSDP wrap:
they are used between layers, in the stack's own (eager) loop, and gathered with the model's root.
"""

from __future__ import annotations

import torch
from torch import nn


class LayerHistory(nn.Module):
    """A plain stack: each layer reads the previous layer's output (nothing is kept, nothing is learned)."""

    def __init__(self, layers: int, width: int, eps: float):
        super().__init__()

    @staticmethod
    def parameter_count(layers: int, width: int) -> int:
        """Parameters of the history of a stack of ``layers`` (``kilolayer.nn.budget`` counts without building)."""
        return 0

    def push(self, outputs: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        """Record ``y`` in ``outputs`` (the forward pass's list, empty at the start) and return what comes next."""
        return y


class LinearCombination(LayerHistory):
    """DLCL's dynamic linear combination of layers (Wang et al. 2019, ACL), in its Pre-LN form::

        x_{l+1} = sum_{k=0}^{l} W[l][k] * LN_k(y_k)

    ``y_0`` is the embedding output and enters as it is (``LN_0`` is the identity, as in the authors' code);
    every later ``y_k`` passes through its own LayerNorm once, when it is recorded. ``W[l]`` holds the
    ``l + 1`` weights of the input of layer ``l + 1`` (``W[N]``: the stack's output), learned, starting at the
    average ``1 / (l + 1)``.
    """

    def __init__(self, layers: int, width: int, eps: float):
        super().__init__(layers, width, eps)
        self.weights = nn.ParameterList(nn.Parameter(torch.full((i + 1,), 1.0 / (i + 1))) for i in range(layers + 1))
        self.norms = nn.ModuleList(nn.LayerNorm(width, eps=eps) for _ in range(layers))

    @staticmethod
    def parameter_count(layers: int, width: int) -> int:
        return (layers + 1) * (layers + 2) // 2 + 2 * width * layers

    def push(self, outputs: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        outputs.append(self.norms[len(outputs) - 1](y) if outputs else y)
        w = self.weights[len(outputs) - 1]
        # a sum of products keeps only references to the recorded outputs for backward (no stacked copy per layer)
        x = w[0] * outputs[0]
        for k in range(1, len(outputs)):
            x = x + w[k] * outputs[k]
        return x
