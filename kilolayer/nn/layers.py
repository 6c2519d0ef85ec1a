"""One Transformer layer: self-attention, optional cross-attention, FFN, each a Residual of its scheme."""

from __future__ import annotations

import torch
from torch import nn

from kilolayer.nn.attention import Attention
from kilolayer.nn.feedforward import FeedForward
from kilolayer.nn.residual import Residual, Scheme, Site, xavier_


class Layer(nn.Module):
    """An encoder layer (``cross=False``) or a decoder layer (causal; ``cross=True`` adds cross-attention)."""

    def __init__(self, cfg, scheme: Scheme, side: str, index: int, cross: bool = False):
        super().__init__()
        d, eps = cfg.width, cfg.norm_eps
        causal = side == "decoder"

        def site(kind):
            return Site(side, index, kind)

        def attention(kind):
            s = site(kind)
            return Attention(
                d,
                cfg.heads,
                cross=kind == "cross_attn",
                causal=causal and kind == "self_attn",
                bias=cfg.bias,
                inner_norm=scheme.attn_inner_norm(s),
                head_scale=scheme.head_scale(s),
                dropout=cfg.dropout,
                eps=eps,
                cpu_attention=cfg.cpu_attention,
            )

        self.self_attn = Residual(attention("self_attn"), d, site("self_attn"), scheme, eps, cfg.dropout)
        self.cross_attn = None
        if cross:
            self.cross_attn = Residual(attention("cross_attn"), d, site("cross_attn"), scheme, eps, cfg.dropout)
        s = site("ffn")
        ff = FeedForward(
            d,
            cfg.ffn,
            activation=cfg.activation,
            bias=cfg.bias,
            inner_norm=scheme.ffn_inner_norm(s),
            shifts=scheme.ffn_shifts(s),
            dropout=cfg.dropout,
            eps=eps,
        )
        self.ffn = Residual(ff, d, s, scheme, eps, cfg.dropout)
        # ReZero's branch scale: one scalar per layer (its code's name), shared by the sublayers
        layer_scale = scheme.branch_scale == "layer"
        self.resweight = nn.Parameter(torch.full((1,), scheme.branch_scale_init())) if layer_scale else None
        self.reset_parameters(scheme)

    def sublayers(self) -> list[Residual]:
        return [r for r in (self.self_attn, self.cross_attn, self.ffn) if r is not None]

    @torch.no_grad()
    def reset_parameters(self, scheme: Scheme) -> None:
        """Each branch weight: Xavier with the scheme's init gain for its site and name; biases zero."""
        for res in self.sublayers():
            for name, weight, bias in res.branch.weights():
                xavier_(weight, scheme.init_gain(res.site, name), scheme.init_dist)
                if bias is not None:
                    bias.zero_()

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scale = self.resweight
        x = self.self_attn(x, mask=mask, shared_scale=scale)
        if self.cross_attn is not None:
            x = self.cross_attn(x, memory=memory, mask=memory_mask, shared_scale=scale)
        return self.ffn(x, shared_scale=scale)
