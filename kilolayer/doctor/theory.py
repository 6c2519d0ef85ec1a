"""DeepNet's bound on the model update (arXiv 2203.00555, section 4), evaluated for a model's constants.

For sublayers ``x <- LN(alpha x + G(x))`` whose value/output (attention) or W1/W2 (FFN) weights start
with Xavier gains ``v`` and ``w``, the paper bounds the change of the output after one update by the
per-sublayer parameter changes ``||theta*_i - theta_i||`` (each O(eta) with Adam):

* one stack of sublayers i (encoder-only, or decoder-only)::

      ||dF|| <= sum_i (v_i^2 + w_i^2) / alpha^2 * ||theta*_i - theta_i||

* an encoder-decoder: the decoder's own sum over its 3M sublayers, plus the encoder's sum carried
  through the M cross-attention sublayers::

      ||dF|| <= sum_dec (v^2 + w^2) / alpha_d^2 * |d theta|
                + (sum_cross v w / alpha_d) * sum_enc (v^2 + w^2) / alpha_e^2 * |d theta|

With |d theta| = eta the bound is ``coefficient x eta``. DeepNorm's constants (Figure 2(b)) are the ones
that make every sum 1, whatever the depth: ``2N * 2 beta^2 / alpha^2 = 1`` with alpha = (2N)^(1/4),
beta = (8N)^(-1/4); the decoder side of an encoder-decoder gives 3M * 2 beta^2 / alpha^2 = 1, and its
cross term (M beta_d^2 / alpha_d) * (2N * 2 beta_e^2 / alpha_e^2) = 1.01 with the paper's 0.81 and
0.87 (tests/test_doctor.py checks these). Post-LN (alpha = v = w = 1) gets 4N for one stack and
6M + 4NM for an encoder-decoder: its bound grows with depth, DeepNorm's does not.

This is our reading of the paper's theorems, checked by that consistency with Figure 2(b)'s constants (the PDF is not
in this repository). It is a *bound*: it says how the worst case scales with depth, not how large a
measured update is. ``kilolayer doctor`` therefore states it next to an empirical reference (the
measured first update of a DeepNorm model of the same shape), never in place of one.
"""

from __future__ import annotations

from kilolayer.config import ModelConfig

# schemes of the form x <- LN(alpha x + G(x)) with no other norm, which the theorem covers
POST_LN_FORM = ("post_ln", "post_ln_init", "deepnorm", "ds_init", "admin")

# DeepNet shows depth's trouble on 18L-18L models, the depth of its whole section-3 analysis: there Post-LN
# fails to converge while Post-LN-init, whose early updates are small, converges (Figure 3(c)). Below this many
# layers on every side, the doctor does not name depth as a cause, DeepNorm as the cure, or over-smoothing.
# It counts layers per side (ModelConfig.encoder_depth / decoder_depth), not sublayers: 18L-18L is 18 encoder
# layers of 2 sublayers and 18 decoder layers of 3, 90 sublayers in all.
DEEP_LAYERS = 18


def deep_enough(model: ModelConfig) -> bool:
    """Whether the deeper side of ``model`` has at least :data:`DEEP_LAYERS` layers (not sublayers): deep enough
    for DeepNet's effects of depth (an update that grows with the number of sublayers, Pre-LN's top layers
    changing a residual stream that has outgrown them) to be the reason for what is measured."""
    return max(model.encoder_depth, model.decoder_depth) >= DEEP_LAYERS


def shape_name(model: ModelConfig) -> str:
    """``6L-6L`` for an encoder-decoder, ``4L`` for one stack."""
    if model.arch == "encoder_decoder":
        return f"{model.encoder_depth}L-{model.decoder_depth}L"
    return f"{model.encoder_depth or model.decoder_depth}L"


def _side_sum(scheme, side: str, depth) -> float:
    from kilolayer.nn.residual import Site

    total = 0.0
    kinds = (
        ("self_attn", "cross_attn", "ffn")
        if side == "decoder" and depth.arch == "encoder_decoder"
        else ("self_attn", "ffn")
    )
    for layer in range(depth.layers(side)):
        for kind in kinds:
            site = Site(side, layer, kind)
            alpha = scheme.alpha(site)  # the shortcut scale at initialisation (Admin's omega too)
            v, w = (
                (scheme.init_gain(site, "w1"), scheme.init_gain(site, "w2"))
                if kind == "ffn"
                else (scheme.init_gain(site, "v"), scheme.init_gain(site, "o"))
            )
            total += (v * v + w * w) / alpha**2
    return total


def _cross_factor(scheme, depth) -> float:
    from kilolayer.nn.residual import Site

    total = 0.0
    for layer in range(depth.M):
        site = Site("decoder", layer, "cross_attn")
        alpha = scheme.alpha(site)
        total += scheme.init_gain(site, "v") * scheme.init_gain(site, "o") / alpha
    return total


def update_coefficient(model: ModelConfig, scheme_name: str | None = None) -> float | None:
    """The bound's coefficient C in ``||dF|| <= C eta`` for ``model`` (or the same shape with
    ``scheme_name``); None for schemes the theorem does not cover (Pre-LN and other pre-norm schemes, DLCL,
    ReZero, T-Fixup, R-Fixup, and BranchNorm, whose branch output is normalised rather than set by its
    weights' gains)."""
    from kilolayer.nn.residual import Depth, make_scheme

    name = scheme_name or model.scheme
    if name not in POST_LN_FORM:
        return None
    depth = Depth(model.arch, model.encoder_depth, model.decoder_depth)
    scheme = make_scheme(name, depth, layerscale_init=model.layerscale_init, ds_init_variant=model.ds_init_variant)
    if model.arch == "encoder":
        return _side_sum(scheme, "encoder", depth)
    if model.arch == "decoder":
        return _side_sum(scheme, "decoder", depth)
    return _side_sum(scheme, "decoder", depth) + _cross_factor(scheme, depth) * _side_sum(scheme, "encoder", depth)
