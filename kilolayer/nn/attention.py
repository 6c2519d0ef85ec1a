"""Multi-head attention through PyTorch's scaled_dot_product_attention.

Self-attention keeps Q, K and V in one fused matrix (one GEMM); cross-attention
fuses K and V. :meth:`Attention.weights` hands out each projection's own
slice, so every scheme initialises Q, K, V and O separately. With
``fp32_on_cpu`` (the default), bf16/fp16 inputs on CPU (autocast) are attended
in fp32: faster there, and the softmax is computed in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(
        self,
        width: int,
        heads: int,
        *,
        cross: bool = False,
        causal: bool = False,
        bias: bool = True,
        inner_norm: bool = False,
        head_scale: bool = False,
        dropout: float = 0.0,
        eps: float = 1e-5,
        fp32_on_cpu: bool = True,
    ):
        super().__init__()
        self.width, self.heads, self.cross, self.causal = width, heads, cross, causal
        self.fp32_on_cpu = fp32_on_cpu
        if cross:
            self.q = nn.Linear(width, width, bias=bias)
            self.kv = nn.Linear(width, 2 * width, bias=bias)
        else:
            self.qkv = nn.Linear(width, 3 * width, bias=bias)
        self.inner_norm = nn.LayerNorm(width, eps=eps) if inner_norm else None
        self.head_scale = nn.Parameter(torch.ones(heads)) if head_scale else None
        self.out = nn.Linear(width, width, bias=bias)
        self.dropout = dropout

    def weights(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """(name, weight slice, bias slice) for q, k, v, o; slices are views into the fused matrices."""
        d = self.width
        if self.cross:
            parts = [("q", self.q, 0), ("k", self.kv, 0), ("v", self.kv, 1)]
        else:
            parts = [("q", self.qkv, 0), ("k", self.qkv, 1), ("v", self.qkv, 2)]
        for name, lin, i in parts:
            b = lin.bias[i * d : (i + 1) * d] if lin.bias is not None else None
            yield name, lin.weight[i * d : (i + 1) * d], b
        yield "o", self.out.weight, self.out.bias

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``mask``: bool, broadcastable to (B, heads, T, S), True where attention is allowed.

        A causal self-attention with ``mask=None`` uses SDPA's own causal path.
        """
        B, T, d = x.shape
        H = self.heads
        if self.cross:
            q = self.q(x)
            k, v = self.kv(memory).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        S = k.shape[1]
        q = q.view(B, T, H, d // H).transpose(1, 2)
        k = k.view(B, S, H, d // H).transpose(1, 2)
        v = v.view(B, S, H, d // H).transpose(1, 2)
        dropout_p = self.dropout if self.training else 0.0
        is_causal = self.causal and mask is None
        if self.fp32_on_cpu and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
            # PyTorch's bf16 CPU flash-attention backward is slower than its fp32 one (and less exact)
            with torch.autocast("cpu", enabled=False):
                y = F.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
                ).to(q.dtype)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        if self.head_scale is not None:
            y = y * self.head_scale.view(1, H, 1, 1)
        y = y.transpose(1, 2).reshape(B, T, d)
        if self.inner_norm is not None:
            y = self.inner_norm(y)
        return self.out(y)
