"""Residual/normalisation schemes: one registry, one small class per scheme.

A scheme decides, for one sublayer at a :class:`Site` (side, layer index,
kind) of a model of a given :class:`Depth` (arch, N, M):

* where the LayerNorms go (before the branch, on its output, after the add,
  inside attention/FFN, after the stack);
* the shortcut scale ``alpha`` (or a learned per-channel shortcut, Admin);
* any learned gain on the branch (ReZero, LayerScale);
* how the branch weights start: every scheme here is "Xavier with a gain per
  weight" (normal or uniform), so a scheme only states the gains.

Adding a scheme is one class below plus ``@register``; nothing else changes.
The formulas are REFERENCE.md section 2 (DeepNorm: section 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kilolayer.nn.deepnorm import deepnorm_constants

SCHEMES: dict[str, type[Scheme]] = {}


def register(cls):
    SCHEMES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Depth:
    """The architecture a scheme is set for: N encoder and M decoder layers."""

    arch: str
    N: int = 0
    M: int = 0

    def layers(self, side: str) -> int:
        return self.N if side == "encoder" else self.M

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


class Scheme:
    """Base class. Defaults: no norms, shortcut 1, Xavier-normal gain 1, zero biases."""

    name = ""
    pre_norm = False  # LN(x) feeds the branch
    post_norm = False  # LN after the add
    final_norm = False  # LN after the last layer of a stack
    init_dist = "normal"  # Xavier-normal or Xavier-uniform
    learned_shortcut = False  # Admin's per-channel omega
    layer_gain = False  # ReZero: one scalar per layer, shared by its sublayers, starts at 0
    channel_gain = False  # LayerScale: a per-channel gain on each branch

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

    # -- scales
    def alpha(self, site: Site) -> float:
        """The shortcut multiplier: x <- alpha * x + branch."""
        return 1.0

    def shortcut_init(self, site: Site) -> float:
        """Initial value of a learned shortcut (Admin)."""
        return 1.0

    def channel_gain_init(self) -> float:
        return 1.0

    # -- initialisation
    def gain(self, site: Site, weight: str) -> float:
        """Xavier gain for weight ``q|k|v|o`` (attention) or ``w1|w2`` (FFN)."""
        return 1.0

    def embedding_std(self, side: str, width: int) -> float:
        """Standard deviation of token/position embeddings."""
        return width**-0.5

    def describe(self) -> dict:
        """Per-side constants worth showing in a table (``kilolayer describe``)."""
        return {}

    def data_dependent_init(self, model: nn.Module, run: Callable[[], object]) -> dict | None:
        """Set any data-dependent initial values of ``model`` from one forward pass ``run()``; None if none."""
        return None


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


@register
class PostLN(Scheme):
    """Post-LN (the original Transformer): x <- LN(x + F(x))."""

    name = "post_ln"
    post_norm = True


@register
class PreLN(Scheme):
    """Pre-LN: x <- x + F(LN(x)), a final LN after the stack."""

    name = "pre_ln"
    pre_norm = True
    final_norm = True


@register
class DeepNorm(Scheme):
    """DeepNorm: x <- LN(alpha x + G(x)); Xavier gain beta on V, O, W1, W2 (self- and cross-attention)."""

    name = "deepnorm"
    post_norm = True
    scaled = ("v", "o", "w1", "w2")

    def __init__(self, depth: Depth, **options):
        super().__init__(depth, **options)
        self.constants = deepnorm_constants(depth.arch, depth.N, depth.M)

    def alpha(self, site):
        return self.constants[site.side][0]

    def gain(self, site, weight):
        return self.constants[site.side][1] if weight in self.scaled else 1.0

    def describe(self):
        return {side: {"alpha": a, "beta": b} for side, (a, b) in self.constants.items()}


@register
class SubLN(Scheme):
    """Sub-LN / Magneto: Pre-LN plus LN before the self-attention output projection and after the FFN activation."""

    name = "sub_ln"
    pre_norm = True
    final_norm = True

    def attn_inner_norm(self, site):
        return site.kind == "self_attn"

    def ffn_inner_norm(self, site):
        return site.kind == "ffn"

    def gamma(self, side: str) -> float:
        d = self.depth
        if d.arch == "encoder":
            return math.sqrt(math.log(2 * d.N))
        if d.arch == "decoder":
            return math.sqrt(math.log(2 * d.M))
        if side == "encoder":
            return math.sqrt(math.log(3 * d.M) * math.log(2 * d.N) / 3)
        return math.sqrt(math.log(3 * d.M))

    def gain(self, site, weight):
        if site.kind == "cross_attn" or weight not in ("v", "o", "w1", "w2"):
            return 1.0
        return self.gamma(site.side)

    def describe(self):
        return {s: {"gamma": self.gamma(s)} for s in ("encoder", "decoder") if self.depth.layers(s)}


@register
class ReZero(Scheme):
    """ReZero: x <- x + a F(x), one scalar a per layer starting at 0; no LayerNorm anywhere."""

    name = "rezero"
    layer_gain = True


@register
class SandwichLN(Scheme):
    """Sandwich-LN: Pre-LN plus an LN on every sublayer's output before the add."""

    name = "sandwich_ln"
    pre_norm = True
    final_norm = True

    def out_norm(self, site):
        return True


@register
class NormFormer(Scheme):
    """NormFormer: Pre-LN, head scales and an LN after self-attention, LN(ffn) after the FFN activation."""

    name = "normformer"
    pre_norm = True
    final_norm = True

    def out_norm(self, site):
        return site.kind == "self_attn"

    def head_scale(self, site):
        return site.kind == "self_attn"

    def ffn_inner_norm(self, site):
        return site.kind == "ffn"


@register
class LayerScale(Scheme):
    """LayerScale (CaiT): Pre-LN with a per-channel branch gain that starts small (by depth unless set)."""

    name = "layerscale"
    pre_norm = True
    final_norm = True
    channel_gain = True

    def channel_gain_init(self):
        if self.options.get("layerscale_init") is not None:
            return float(self.options["layerscale_init"])
        depth = max(self.depth.N, self.depth.M)
        # CaiT's rule: 0.1 up to 18 layers, 1e-5 up to 24, 1e-6 deeper
        return 0.1 if depth <= 18 else 1e-5 if depth <= 24 else 1e-6

    def describe(self):
        return {"all": {"init": self.channel_gain_init()}}


@register
class DSInit(Scheme):
    """DS-Init: Post-LN; layer l (1-based) weights ~ U(+-r/sqrt(l)); ``ds_init_variant=code`` uses l^(-1/4)."""

    name = "ds_init"
    post_norm = True
    init_dist = "uniform"

    def gain(self, site, weight):
        l = site.layer + 1
        return l**-0.25 if self.options.get("ds_init_variant") == "code" else l**-0.5


@register
class TFixup(Scheme):
    """T-Fixup: no LayerNorm, Xavier-uniform, scaled V/O/W1/W2 and token embeddings."""

    name = "t_fixup"
    init_dist = "uniform"

    def gain(self, site, weight):
        if weight not in ("v", "o", "w1", "w2"):
            return 1.0
        if site.side == "encoder":
            return 0.67 * self.depth.N**-0.25
        return (9 * self.depth.M) ** -0.25

    def embedding_std(self, side, width):
        return width**-0.5 * (9 * self.depth.layers(side)) ** -0.25

    def describe(self):
        d = self.depth
        out = {}
        if d.N:
            out["encoder"] = {"scale": 0.67 * d.N**-0.25, "embed": (9 * d.N) ** -0.25}
        if d.M:
            out["decoder"] = {"scale": (9 * d.M) ** -0.25, "embed": (9 * d.M) ** -0.25}
        return out


@register
class Admin(Scheme):
    """Admin: x <- LN(w * x + F(x)) with a per-channel learned w (profile-free default or profiled)."""

    name = "admin"
    post_norm = True
    learned_shortcut = True

    def omega(self, side: str) -> float:
        n = self.depth.sublayers(side)
        return math.sqrt((n + 1) / math.log(n + 1) - 1)

    def shortcut_init(self, site):
        return self.omega(site.side)

    def describe(self):
        return {s: {"omega": self.omega(s)} for s in ("encoder", "decoder") if self.depth.layers(s)}

    def data_dependent_init(self, model, run):
        if self.options.get("admin_omega") != "profile":
            return None
        return admin_profile(model, run)


def make_scheme(name: str, depth: Depth, **options) -> Scheme:
    return SCHEMES[name](depth, **options)


class Residual(nn.Module):
    """One residual sublayer around ``branch``, arranged as its scheme says.

    ``forward(x, *args, gain=None)``: ``gain`` is a per-layer scalar owned by
    the layer (ReZero); everything else is held here.
    """

    def __init__(self, branch: nn.Module, width: int, site: Site, scheme: Scheme, eps: float, dropout: float = 0.0):
        super().__init__()
        self.branch = branch
        self.site = site
        self.pre_norm = nn.LayerNorm(width, eps=eps) if scheme.pre_norm else None
        self.out_norm = nn.LayerNorm(width, eps=eps) if scheme.out_norm(site) else None
        self.post_norm = nn.LayerNorm(width, eps=eps) if scheme.post_norm else None
        self.alpha = scheme.alpha(site)
        self.shortcut = (
            nn.Parameter(torch.full((width,), scheme.shortcut_init(site))) if scheme.learned_shortcut else None
        )
        self.gain = nn.Parameter(torch.full((width,), scheme.channel_gain_init())) if scheme.channel_gain else None
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self._profile: dict | None = None  # Admin profiling state, set by admin_profile()

    def forward(self, x: torch.Tensor, *args, gain: torch.Tensor | None = None) -> torch.Tensor:
        h = self.pre_norm(x) if self.pre_norm is not None else x
        y = self.branch(h, *args)
        if self.out_norm is not None:
            y = self.out_norm(y)
        if self.gain is not None:
            y = y * self.gain
        if gain is not None:
            y = y * gain
        if self.dropout is not None:
            y = self.dropout(y)
        if self.shortcut is not None:
            if self._profile is not None:
                self._admin_profile_step(x, y)
            out = x * self.shortcut + y
        elif self.alpha != 1.0:
            out = torch.add(y, x, alpha=self.alpha)  # alpha * x + y in one pass over memory
        else:
            out = x + y
        return self.post_norm(out) if self.post_norm is not None else out

    @torch.no_grad()
    def _admin_profile_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        state = self._profile
        ratio = state.get(self.site.side, 1.0)
        self.shortcut.fill_(ratio)
        state[self.site.side] = math.sqrt(float((x * ratio).var()) + float(y.var()))


@torch.no_grad()
def admin_profile(model: nn.Module, run: Callable[[], object]) -> dict:
    """Admin's profiling pass: set every learned shortcut from measured variances.

    ``run`` runs one forward pass of ``model`` on a representative batch.
    One chain per side, each starting at 1: at sublayer i, w_i = ratio, then
    ratio = sqrt(Var(w_i x) + Var(F_i(x))). Returns the final ratio per side.
    """
    sites = [m for m in model.modules() if isinstance(m, Residual) and m.shortcut is not None]
    if not sites:
        return {}
    state: dict = {}
    was_training = model.training
    model.eval()
    for m in sites:
        m._profile = state
    try:
        run()
    finally:
        for m in sites:
            m._profile = None
        model.train(was_training)
    return state
