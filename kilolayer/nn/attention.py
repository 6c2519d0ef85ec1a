"""Multi-head attention through PyTorch's scaled_dot_product_attention.

Self-attention keeps Q, K and V in one fused matrix (one GEMM); cross-attention
fuses K and V. :meth:`Attention.weights` hands out each projection's own
slice, so every scheme initialises Q, K, V and O separately.

On a CPU under bf16/fp16 autocast, ``cpu_attention`` says how attention runs
(fp32 inputs and every other device always go through SDPA as they are):

* ``auto`` (the default): in bf16 up to :data:`MATMUL_MAX_KEYS` keys, as two
  matrix products around an fp32 softmax (:func:`matmul_attention`), which
  inductor fuses with the rest of a compiled layer; longer, and in fp16 (whose
  scores overflow at 65,504), as ``fp32``. Causal self-attention of
  :data:`CAUSAL_SPLIT_MIN` positions or more skips the quarter of the products
  that the mask would discard: the first half of the queries attends to the
  first half of the keys alone, as flash attention skips masked blocks. The
  products are faster than PyTorch's fused CPU kernels at the lengths measured
  (``python -m benchmarks.attention``), whose bf16 backward is slower than
  their fp32 one; but they keep each head's T x S probabilities for the
  backward, where the fused kernels keep O(T).
* ``fp32``: SDPA on the inputs cast to fp32.
* ``sdpa``: SDPA in the autocast dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

#: how attention runs on a CPU under bf16/fp16 autocast (module docstring)
CPU_ATTENTION = ("auto", "fp32", "sdpa")
#: ``auto``'s longest key sequence attended by matrix products: beyond it fp32 SDPA, whose memory does not grow
#: with the square of the length (the products keep 6 bytes per head, query and key for the backward: 200 MB a
#: layer at 512 keys, batch 16 and 8 heads), at 1.0-1.7x their time at 512-1,024 keys (python -m
#: benchmarks.attention)
MATMUL_MAX_KEYS = 256
#: causal self-attention of at least this many positions runs as two halves of queries (:func:`matmul_attention`):
#: at 128 positions that takes a layer's attention forward and backward from 11.0 to 8.7 ms (batch 16, 4 heads
#: of 64) and from 9.7 to 6.3 ms (2 heads), compiled, one thread; at 96 from 8.0 to 7.1 ms (4 heads), while at
#: 64 the halves' smaller products cost more than the quarter saves (3.9 to 4.7 ms)
CAUSAL_SPLIT_MIN = 96


def matmul_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA's result as ``softmax(q k^T / sqrt(head size)) v``, with the products in the inputs' dtype and the
    softmax in fp32 (or the inputs' dtype, if wider); ``mask`` and ``is_causal`` as SDPA takes them (bool, True
    where attention is allowed). A query that may attend to no key gets zeros, as SDPA's CPU kernels give.

    Causal self-attention of :data:`CAUSAL_SPLIT_MIN` positions or more runs as two halves of the queries: the
    first against the first half of the keys alone (every later key is masked for it), the second against all
    of them. The forward and the queries' gradients are the whole product's up to the order of its sums (a
    masked key adds an exact zero); the keys' and values' gradients are the sums of the halves' bf16 products,
    so they round up to twice more. ``mask`` with ``is_causal`` is refused, as SDPA refuses it."""
    if is_causal and mask is not None:
        raise ValueError("matmul_attention: give mask or is_causal, not both")
    T, S = q.shape[-2], k.shape[-2]
    if is_causal and T == S and T >= CAUSAL_SPLIT_MIN:
        h = T // 2
        first = _products(q[..., :h, :], k[..., :h, :], v[..., :h, :], None, dropout_p, causal_from=0)
        second = _products(q[..., h:, :], k, v, None, dropout_p, causal_from=h)
        return torch.cat([first, second], dim=-2)
    return _products(q, k, v, mask, dropout_p, causal_from=0 if is_causal else None)


def _products(q, k, v, mask, dropout_p: float, causal_from: int | None) -> torch.Tensor:
    """:func:`matmul_attention` of one block of queries; ``causal_from``: the position of the first query among
    the keys, each query attending to the keys up to its own (None: ``mask`` alone)."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if causal_from is not None:
        T, S = scores.shape[-2:]
        later = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1 + causal_from)
        scores = scores.masked_fill(later, float("-inf"))
    elif mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    if mask is not None and causal_from is None:
        # a query with every key masked: zeros, not NaN (a NaN from overflowing scores stays one, as in SDPA)
        probs = probs.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return probs.to(v.dtype) @ v


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
        cpu_attention: str = "auto",
    ):
        super().__init__()
        if cpu_attention not in CPU_ATTENTION:
            raise ValueError(f"cpu_attention={cpu_attention!r}: expected one of {', '.join(CPU_ATTENTION)}")
        self.width, self.heads, self.cross, self.causal = width, heads, cross, causal
        self.cpu_attention = cpu_attention
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
        how = self.cpu_attention
        if how == "sdpa" or q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        elif how == "auto" and q.dtype == torch.bfloat16 and S <= MATMUL_MAX_KEYS:
            with torch.autocast("cpu", enabled=False):
                y = matmul_attention(q, k, v, mask, dropout_p, is_causal)
        else:
            with torch.autocast("cpu", enabled=False):
                y = F.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
                ).to(q.dtype)
        if self.head_scale is not None:
            y = y * self.head_scale.view(1, H, 1, 1)
        y = y.transpose(1, 2).reshape(B, T, d)
        if self.inner_norm is not None:
            y = self.inner_norm(y)
        return self.out(y)
