"""The residual sublayer and the scheme that arranges it.

Every sublayer of every scheme computes

    x <- post_norm( shortcut(x) + dropout( branch_scale( out_norm( branch( shift( pre_norm(x) ) ) ) ) ) )

and a part that a scheme does not use is ``nn.Identity``. DeepNorm, for example, keeps only a LayerNorm after
the add and a fixed shortcut scale, so its sublayer reads ``x <- LN(alpha * x + G(x))`` (docs/deepnet.md).

Three kinds of number, one name each:

* the **shortcut scale** multiplies ``x``: 1 (most schemes), DeepNorm's fixed ``alpha``, or Admin's learned
  per-channel ``omega`` (:meth:`Scheme.alpha` gives its value at initialisation);
* the **branch scale** multiplies the branch output: LayerScale's learned per-channel one, R-Fixup's learned
  scalar (both ``Residual.branch_scale``), ReZero's one scalar per layer (``Layer.resweight``, passed in as
  ``shared_scale``), or BranchNorm's scale computed from the branch output and the training step;
* the **init gain** is the Xavier gain a branch weight starts with (:meth:`Scheme.init_gain`; DeepNorm's beta).

A stack of layers consults its scheme twice more: :attr:`Scheme.history` says what each layer reads (the
previous layer's output, or DLCL's combination of all earlier ones) and :meth:`Scheme.final_part` what
follows the last layer.

A scheme is a small class registered in :data:`SCHEMES` by decorator, in the module that defines it
(``kilolayer/nn/deepnorm.py``, ``kilolayer/nn/admin.py``, ``kilolayer/nn/branchnorm.py``,
``kilolayer/nn/schemes.py``); ``kilolayer.nn`` imports those modules, so the registry is full whenever this
module is importable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kilolayer.nn.history import LayerHistory
from kilolayer.registry import SCHEMES


@dataclass(frozen=True)
class Depth:
    """The architecture a scheme is set for: N encoder and M decoder layers."""

    arch: str
    N: int = 0
    M: int = 0

    def layers(self, side: str) -> int:
        return self.N if side == "encoder" else self.M

    def sides(self) -> list[str]:
        """The sides that have layers, encoder first."""
        return [side for side in ("encoder", "decoder") if self.layers(side)]

    def sublayers(self, side: str) -> int:
        """Residual sublayers on one side (2 per encoder layer, 3 per decoder layer with cross-attention)."""
        if side == "encoder":
            return 2 * self.N
        return (3 if self.arch == "encoder_decoder" else 2) * self.M


@dataclass(frozen=True)
class Site:
    """One residual sublayer: side (encoder|decoder), 0-based layer index, kind (self_attn|cross_attn|ffn)."""

    side: str
    layer: int
    kind: str


# ---------------------------------------------------------------- the parts of a sublayer


class ScaledShortcut(nn.Module):
    """``x -> alpha * x`` with a fixed ``alpha`` (DeepNorm)."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * x

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:.6g}"


class LearnedShortcut(nn.Module):
    """``x -> omega * x`` with a learned per-channel ``omega`` (Admin)."""

    def __init__(self, width: int, init: float):
        super().__init__()
        self.omega = nn.Parameter(torch.full((width,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.omega


class BranchScale(nn.Module):
    """``y -> weight * y`` with a learned ``weight``: per channel (LayerScale) or one scalar (``width`` 1,
    R-Fixup)."""

    def __init__(self, width: int, init: float):
        super().__init__()
        self.weight = nn.Parameter(torch.full((width,), float(init)))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.weight


class ScalarAffine(nn.Module):
    """``x -> s * (x + b)``: Fixup's learned scalar bias ``b`` (from 0) and, if ``scaled``, its learned scalar
    multiplier ``s`` (from 1)."""

    def __init__(self, scaled: bool = False):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1))
        self.scale = nn.Parameter(torch.ones(1)) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.bias
        return x * self.scale if self.scale is not None else x


def layer_norm(present: bool, width: int, eps: float) -> nn.Module:
    return nn.LayerNorm(width, eps=eps) if present else nn.Identity()


# ---------------------------------------------------------------- schemes


class Scheme:
    """Base class: where the norms go, the shortcut and branch scales, and the init gain of every branch weight.

    The defaults are a plain residual ``x <- x + F(x)``: no norms, shortcut scale 1, no branch scale,
    Xavier-normal with gain 1, zero biases. A scheme overrides only what differs.
    """

    name = ""
    pre_norm = False  # LN(x) feeds the branch
    post_norm = False  # LN after the add
    final_norm = False  # LN after the last layer of a stack
    init_dist = "normal"  # Xavier-normal or Xavier-uniform
    learned_shortcut = False  # the shortcut scale is a learned per-channel parameter (Admin)
    # learned branch scale: "channel" (LayerScale), "scalar" (one per sublayer, R-Fixup), "layer" (ReZero)
    branch_scale: str | None = None
    branch_shift = False  # a learned scalar bias on the branch input (R-Fixup)
    history: type[LayerHistory] = LayerHistory  # what each layer of a stack reads

    def __init__(self, depth: Depth, **options):
        self.depth = depth
        self.options = options

    # -- placement
    def out_norm(self, site: Site) -> bool:
        """LN on the branch output, before the add."""
        return False

    def attn_inner_norm(self, site: Site) -> bool:
        """LN right before the attention output projection."""
        return False

    def ffn_inner_norm(self, site: Site) -> bool:
        """LN(ffn) after the FFN activation."""
        return False

    def head_scale(self, site: Site) -> bool:
        """A learned per-head scale on the attention output."""
        return False

    def ffn_shifts(self, site: Site) -> bool:
        """Learned scalar biases before the FFN activation and before W2 (R-Fixup)."""
        return False

    # -- scales
    def alpha(self, site: Site) -> float:
        """The shortcut scale at initialisation: ``x <- alpha * x + branch`` (fixed unless learned_shortcut)."""
        return 1.0

    def branch_scale_init(self) -> float:
        """Initial value of the learned branch scale (when ``branch_scale`` is set)."""
        return 1.0

    def shortcut(self, site: Site, width: int) -> nn.Module:
        """The module that scales ``x`` on the shortcut of ``site``."""
        alpha = self.alpha(site)
        if self.learned_shortcut:
            return LearnedShortcut(width, alpha)
        return nn.Identity() if alpha == 1.0 else ScaledShortcut(alpha)

    def branch_scale_module(self, site: Site, width: int, eps: float) -> nn.Module:
        """The module that scales the branch output of ``site`` (ReZero's per-layer scalar is the layer's)."""
        if self.branch_scale == "channel":
            return BranchScale(width, self.branch_scale_init())
        if self.branch_scale == "scalar":
            return BranchScale(1, self.branch_scale_init())
        return nn.Identity()

    def final_part(self, side: str, width: int, eps: float) -> nn.Module | None:
        """What follows the last layer of a stack: a LayerNorm with ``final_norm``, else nothing."""
        return nn.LayerNorm(width, eps=eps) if self.final_norm else None

    # -- initialisation
    def init_gain(self, site: Site, weight: str) -> float:
        """Xavier gain for branch weight ``q|k|v|o`` (attention) or ``w1|w2`` (FFN) at ``site``."""
        return 1.0

    def embedding_std(self, side: str, width: int) -> float:
        """Standard deviation of token embeddings."""
        return width**-0.5

    def describe(self) -> dict:
        """Per-side constants worth showing in a table (``kilolayer describe``), read off the methods above: a
        number, or a rule as text where the constant varies by layer."""
        return {}

    def outside_residual(self, site: Site) -> list[str]:
        """The parts this scheme places at ``site`` beyond the :class:`Residual` around a branch and the init of
        its weights: what a user's own module would have to supply (kilolayer's layers and stacks do)."""
        parts = []
        if self.attn_inner_norm(site):
            parts.append("a LayerNorm before the attention output projection")
        if self.head_scale(site):
            parts.append("learned per-head scales on the attention output")
        if self.ffn_inner_norm(site):
            parts.append("a LayerNorm after the FFN activation")
        if self.ffn_shifts(site):
            parts.append("learned scalar biases around the FFN activation")
        if self.branch_scale == "layer":
            parts.append("one learned branch scale shared by the sublayers of a layer")
        if self.history is not LayerHistory:
            parts.append("layer inputs combined from all earlier layers")
        return parts

    # -- after building
    def attach(self, model: nn.Module) -> None:
        """Called once by the backbone built with this scheme (hooks that the scheme needs go here)."""

    def data_dependent_init(self, model: nn.Module, run: Callable[[], object]) -> dict | None:
        """Set any data-dependent initial values of ``model`` from one forward pass ``run()``; None if none."""
        return None

    def on_step(self, stack: nn.Module, step: int) -> None:
        """``stack`` (a stack of layers built with this scheme) has had ``step`` updates; a scheme whose forward
        follows training progress (BranchNorm) records it in the stack, where checkpoints keep it."""


# the ``model`` config fields a scheme reads from its options
SCHEME_OPTIONS = ("layerscale_init", "ds_init_variant", "admin_omega", "branchnorm_steps")


def make_scheme(name: str, depth: Depth, **options) -> Scheme:
    """The scheme called ``name`` set for ``depth``; a one-line ConfigError naming the choices if unknown."""
    return SCHEMES.get(name)(depth, **options)


def xavier_(weight: torch.Tensor, gain: float, dist: str = "normal") -> None:
    """Xavier init of a (possibly sliced) Linear weight ``(fan_out, fan_in)`` in place."""
    fan_out, fan_in = weight.shape
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    with torch.no_grad():
        if dist == "normal":
            weight.normal_(0.0, std)
        else:
            bound = math.sqrt(3.0) * std
            weight.uniform_(-bound, bound)


# ---------------------------------------------------------------- the sublayer


class Residual(nn.Module):
    """One residual sublayer around ``branch`` (attention or FFN), with the parts its scheme uses at ``site``.

    ``dropout``'s output is the branch's contribution as added to the shortcut (Admin's profiling hooks read it
    there).
    """

    def __init__(self, branch: nn.Module, width: int, site: Site, scheme: Scheme, eps: float, dropout: float = 0.0):
        super().__init__()
        self.site, self.width = site, width
        self.shortcut = scheme.shortcut(site, width)
        self.branch_scale = scheme.branch_scale_module(site, width, eps)
        self.branch = branch
        self.pre_norm = layer_norm(scheme.pre_norm, width, eps)
        self.shift = ScalarAffine() if scheme.branch_shift else nn.Identity()
        self.out_norm = layer_norm(scheme.out_norm(site), width, eps)
        self.post_norm = layer_norm(scheme.post_norm, width, eps)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def alpha(self) -> float:
        """The fixed shortcut scale (DeepNorm's alpha); 1 when the shortcut is the identity or learned."""
        return getattr(self.shortcut, "alpha", 1.0)

    def forward(self, x: torch.Tensor, *, shared_scale: torch.Tensor | None = None, **inputs) -> torch.Tensor:
        """``inputs`` go to the branch by keyword; ``shared_scale`` is a branch scale the layer's sublayers
        share (ReZero's one scalar per layer)."""
        y = self.branch_scale(self.out_norm(self.branch(self.shift(self.pre_norm(x)), **inputs)))
        if shared_scale is not None:
            y = y * shared_scale
        return self.post_norm(self.shortcut(x) + self.dropout(y))
