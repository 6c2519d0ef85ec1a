"""The position-wise feed-forward sublayer: W2 act(W1 x), with an optional LN after the activation and optional
learned scalar biases before the activation and before W2 (Fixup's, ``shifts``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


class FeedForward(nn.Module):
    def __init__(
        self,
        width: int,
        ffn: int,
        *,
        activation: str = "gelu",
        bias: bool = True,
        inner_norm: bool = False,
        shifts: bool = False,
        dropout: float = 0.0,
        eps: float = 1e-5,
    ):
        super().__init__()
        self.fc1 = nn.Linear(width, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, width, bias=bias)
        self.act = ACTIVATIONS[activation]
        self.inner_norm = nn.LayerNorm(ffn, eps=eps) if inner_norm else None
        self.act_shift = nn.Parameter(torch.zeros(1)) if shifts else None
        self.out_shift = nn.Parameter(torch.zeros(1)) if shifts else None
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None

    def weights(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        yield "w1", self.fc1.weight, self.fc1.bias
        yield "w2", self.fc2.weight, self.fc2.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.act_shift is not None:
            h = h + self.act_shift
        h = self.act(h)
        if self.inner_norm is not None:
            h = self.inner_norm(h)
        if self.dropout is not None:
            h = self.dropout(h)
        if self.out_shift is not None:
            h = h + self.out_shift
        return self.fc2(h)
