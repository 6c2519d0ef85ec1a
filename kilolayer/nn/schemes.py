"""The baseline residual schemes DeepNet compares against, one small class each (formulas: docs/deepnet.md).

DeepNorm lives in ``kilolayer/nn/deepnorm.py``, Admin in ``kilolayer/nn/admin.py`` and BranchNorm in
``kilolayer/nn/branchnorm.py``. Adding a scheme is one class with ``@SCHEMES.register()`` in one module that
``kilolayer/nn/__init__.py`` imports.
"""

from __future__ import annotations

import math

from kilolayer.nn.history import LinearCombination
from kilolayer.nn.residual import SCHEMES, ScalarAffine, Scheme, Site

SCALED = ("v", "o", "w1", "w2")  # the branch weights that DeepNet-style inits scale


@SCHEMES.register()
class PostLN(Scheme):
    """Post-LN (the original Transformer): x <- LN(x + F(x))."""

    name = "post_ln"
    post_norm = True


@SCHEMES.register()
class PostLNInit(PostLN):
    """Post-LN-init (DeepNet section 3): Post-LN whose layer-l weights (1-based, per side) start Xavier / k_l,
    k_l = n - l + 1 for the side's n layers, so the bottom layer is scaled down most."""

    name = "post_ln_init"

    def divisor(self, site: Site) -> int:
        """k_l = n - l + 1 for the layer of ``site`` (``site.layer`` is l - 1)."""
        return self.depth.layers(site.side) - site.layer

    def init_gain(self, site, weight):
        return 1.0 / self.divisor(site)

    def describe(self):
        return {side: {"k_1": self.divisor(Site(side, 0, "ffn"))} for side in self.depth.sides()}


@SCHEMES.register()
class PreLN(Scheme):
    """Pre-LN: x <- x + F(LN(x)), a final LN after the stack."""

    name = "pre_ln"
    pre_norm = True
    final_norm = True


@SCHEMES.register()
class SubLN(PreLN):
    """Sub-LN / Magneto: Pre-LN plus LN before the self-attention output projection and after the FFN activation,
    and Xavier gain gamma on V, O, W1, W2 of self-attention and FFN."""

    name = "sub_ln"

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

    def init_gain(self, site, weight):
        if site.kind == "cross_attn" or weight not in SCALED:
            return 1.0
        return self.gamma(site.side)

    def describe(self):
        return {side: {"gamma": self.init_gain(Site(side, 0, "ffn"), "w2")} for side in self.depth.sides()}


@SCHEMES.register()
class SandwichLN(PreLN):
    """Sandwich-LN: Pre-LN plus an LN on every sublayer's output before the add."""

    name = "sandwich_ln"

    def out_norm(self, site):
        return True


@SCHEMES.register()
class NormFormer(PreLN):
    """NormFormer: Pre-LN, head scales and an LN after self-attention, LN(ffn) after the FFN activation."""

    name = "normformer"

    def out_norm(self, site):
        return site.kind == "self_attn"

    def head_scale(self, site):
        return site.kind == "self_attn"

    def ffn_inner_norm(self, site):
        return site.kind == "ffn"


@SCHEMES.register()
class LayerScale(PreLN):
    """LayerScale (CaiT): Pre-LN with a learned per-channel branch scale that starts small (by depth unless
    set)."""

    name = "layerscale"
    branch_scale = "channel"

    def branch_scale_init(self):
        if self.options.get("layerscale_init") is not None:
            return float(self.options["layerscale_init"])
        depth = max(self.depth.N, self.depth.M)
        # CaiT's rule: 0.1 up to 18 layers, 1e-5 up to 24, 1e-6 deeper
        return 0.1 if depth <= 18 else 1e-5 if depth <= 24 else 1e-6

    def describe(self):
        return {"all": {"init": self.branch_scale_init()}}


@SCHEMES.register()
class ReZero(Scheme):
    """ReZero: x <- x + a F(x), one learned scalar a per layer (shared by its sublayers) starting at 0; no
    LayerNorm anywhere."""

    name = "rezero"
    branch_scale = "layer"

    def branch_scale_init(self):
        return 0.0


@SCHEMES.register()
class DLCL(PreLN):
    """DLCL (Wang et al. 2019): Pre-LN layers, each reading a learned combination of the LayerNormed outputs of
    the embedding and every earlier layer (:class:`~kilolayer.nn.history.LinearCombination`)."""

    name = "dlcl"
    history = LinearCombination

    def describe(self):
        # the weights of layer l + 1's input start at the average of the l + 1 outputs below it
        return {"all": {"W_l,k": "1/(l+1)"}}


@SCHEMES.register()
class DSInit(PostLN):
    """DS-Init: Post-LN; layer l (1-based) weights ~ U(+-r/sqrt(l)); ``ds_init_variant=code`` uses l^(-1/4)."""

    name = "ds_init"
    init_dist = "uniform"

    def init_gain(self, site, weight):
        l = site.layer + 1
        return l**-0.25 if self.options.get("ds_init_variant") == "code" else l**-0.5


@SCHEMES.register()
class TFixup(Scheme):
    """T-Fixup: no LayerNorm, Xavier-uniform, scaled V/O/W1/W2 and token embeddings."""

    name = "t_fixup"
    init_dist = "uniform"

    def init_gain(self, site, weight):
        if weight not in SCALED:
            return 1.0
        if site.side == "encoder":
            return 0.67 * self.depth.N**-0.25
        return (9 * self.depth.M) ** -0.25

    def embedding_scale(self, side: str) -> float:
        """T-Fixup's factor on the usual width^-1/2 embedding std: (9 L)^-1/4."""
        return (9 * self.depth.layers(side)) ** -0.25

    def embedding_std(self, side, width):
        return width**-0.5 * self.embedding_scale(side)

    def describe(self):
        return {
            side: {"scale": self.init_gain(Site(side, 0, "ffn"), "w2"), "embed": self.embedding_scale(side)}
            for side in self.depth.sides()
        }


@SCHEMES.register()
class RFixup(Scheme):
    """R-Fixup: Fixup (Zhang, Dauphin, Ma 2019) on a Transformer without LayerNorm, as the Fixup authors' code
    builds it: a scalar bias on each branch input and a scalar multiplier on each branch output, scalar biases
    around the FFN activation, the last weight of every branch at zero, the others Xavier-uniform scaled by a
    power of L, the number of residual branches in the model."""

    name = "r_fixup"
    init_dist = "uniform"
    branch_scale = "scalar"
    branch_shift = True

    @property
    def branches(self) -> int:
        """L: residual branches of the whole model (2 per encoder layer, 2 or 3 per decoder layer)."""
        return sum(self.depth.sublayers(side) for side in self.depth.sides())

    def ffn_shifts(self, site):
        return True

    def init_gain(self, site, weight):
        if weight in ("o", "w2"):
            return 0.0  # the last layer of each branch: the branch starts at zero
        if weight == "w1":
            return self.branches**-0.5  # L^(-1/(2m-2)) for the FFN's m = 2 layers
        # Q, K, V: the code's L^(-1/6) on Xavier over its fused (3d, d) in-projection, whose fan (d + 3d) is
        # twice that of each (d, d) slice that kilolayer initialises
        return self.branches ** (-1 / 6) * math.sqrt(0.5)

    def final_part(self, side, width, eps):
        # a scalar bias on each stack's output; the encoder's (read by every cross-attention) is also scaled
        return ScalarAffine(scaled=side == "encoder")

    def describe(self):
        site = Site(self.depth.sides()[0], 0, "ffn")
        return {"all": {"L": self.branches, "qkv": self.init_gain(site, "v"), "w1": self.init_gain(site, "w1")}}
