"""DeepNorm's constants against DeepNet's Figure 2(b) / section 4.3 (docs/deepnet.md#alpha-and-beta), and where a
built model puts them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import kilolayer
from kilolayer import ConfigError, build_model, deepnorm_constants

layers = st.integers(min_value=1, max_value=100_000)


# The table, written out term by term so that a slip in the library's exponents shows up.
def table_encoder_only(n):
    return math.sqrt(math.sqrt(2 * n)), 1 / math.sqrt(math.sqrt(8 * n))


def table_decoder_only(m):
    return math.sqrt(math.sqrt(2 * m)), 1 / math.sqrt(math.sqrt(8 * m))


def table_encoder_decoder(n, m):
    encoder = (0.81 * n**0.25 * m**0.0625, 0.87 / (n**0.25 * m**0.0625))
    decoder = (math.sqrt(math.sqrt(3 * m)), 1 / math.sqrt(math.sqrt(12 * m)))
    return encoder, decoder


def close(got, want):
    assert got == pytest.approx(want, rel=1e-12, abs=0)


@settings(max_examples=200, deadline=None)
@given(n=layers)
def test_encoder_only_row(n):
    got = deepnorm_constants("encoder", encoder_layers=n)
    assert set(got) == {"encoder"}
    close(got["encoder"], table_encoder_only(n))


@settings(max_examples=200, deadline=None)
@given(m=layers)
def test_decoder_only_row(m):
    got = deepnorm_constants("decoder", decoder_layers=m)
    assert set(got) == {"decoder"}
    close(got["decoder"], table_decoder_only(m))


@settings(max_examples=300, deadline=None)
@given(n=layers, m=layers)
def test_encoder_decoder_rows(n, m):
    got = deepnorm_constants("encoder_decoder", encoder_layers=n, decoder_layers=m)
    assert set(got) == {"encoder", "decoder"}
    encoder, decoder = table_encoder_decoder(n, m)
    close(got["encoder"], encoder)
    close(got["decoder"], decoder)


def test_known_values():
    """A few values worked by hand (not through the formulas above)."""
    # encoder-only N=2: alpha = 4^(1/4) = sqrt 2, beta = 16^(-1/4) = 1/2
    a, b = deepnorm_constants("encoder", encoder_layers=2)["encoder"]
    assert a == pytest.approx(math.sqrt(2), rel=1e-14) and b == pytest.approx(0.5, rel=1e-14)
    # decoder-only M=32: alpha = 64^(1/4) = 2 sqrt 2, beta = 256^(-1/4) = 1/4
    a, b = deepnorm_constants("decoder", decoder_layers=32)["decoder"]
    assert a == pytest.approx(2 * math.sqrt(2), rel=1e-14) and b == pytest.approx(0.25, rel=1e-14)
    # encoder-decoder N=M=1: encoder (0.81, 0.87); decoder M=1: 3^(1/4), 12^(-1/4)
    c = deepnorm_constants("encoder_decoder", encoder_layers=1, decoder_layers=1)
    assert c["encoder"] == pytest.approx((0.81, 0.87), rel=1e-14)
    assert c["decoder"] == pytest.approx((3**0.25, 12**-0.25), rel=1e-14)
    # docs/deepnet.md#torchscale-deviations: at N=M=100 the paper's encoder beta is 0.206
    # (torchscale's 1.15 would give 0.273)
    c = deepnorm_constants("encoder_decoder", encoder_layers=100, decoder_layers=100)
    assert c["encoder"][1] == pytest.approx(0.2063, abs=5e-5)
    assert c["encoder"][0] == pytest.approx(0.81 * 10 ** (10 / 16), rel=1e-12)
    # N=16, M=65536=2^16: (N^4 M)^(1/16) = 2 * 2 = 4
    c = deepnorm_constants("encoder_decoder", encoder_layers=16, decoder_layers=65536)
    assert c["encoder"] == pytest.approx((0.81 * 4, 0.87 / 4), rel=1e-13)


def test_only_the_arch_layers_count():
    """The unused side's layer count must not leak into a single-stack model."""
    assert deepnorm_constants("encoder", 6, 999) == deepnorm_constants("encoder", 6)
    assert deepnorm_constants("decoder", 999, 6) == deepnorm_constants("decoder", 0, 6)


@pytest.mark.parametrize(
    "args, field",
    [
        (("encoderdecoder", 6, 6), "arch='encoderdecoder'"),
        (("seq2seq", 6, 6), "arch='seq2seq'"),
        (("encoder", 0, 0), "encoder_layers=0"),
        (("encoder", -3, 0), "encoder_layers=-3"),
        (("decoder", 6, 0), "decoder_layers=0"),
        (("encoder_decoder", 0, 6), "encoder_layers=0"),
        (("encoder_decoder", 6, 0), "decoder_layers=0"),
    ],
)
def test_bad_arguments_are_one_line_config_errors(args, field):
    with pytest.raises(ConfigError) as info:
        deepnorm_constants(*args)
    msg = str(info.value)
    assert "\n" not in msg
    assert field in msg
    if field.startswith("arch"):
        assert all(a in msg for a in ("encoder", "decoder", "encoder_decoder"))


@pytest.mark.parametrize(
    "arch, n, m",
    [("encoder", 3, 0), ("decoder", 0, 4), ("encoder_decoder", 3, 4), ("encoder_decoder", 5, 2)],
)
def test_built_model_carries_each_sides_alpha(arch, n, m):
    cfg = dict(arch=arch, scheme="deepnorm", layers=n or m, width=16, heads=2, ffn=32, max_len=8)
    if arch == "encoder_decoder":
        cfg["decoder_layers"] = m
    model = build_model(cfg)
    # the table by hand: N/M as built, not as passed
    if arch == "encoder":
        want = {"encoder": table_encoder_only(n)[0]}
    elif arch == "decoder":
        want = {"decoder": table_decoder_only(m)[0]}
    else:
        enc, dec = table_encoder_decoder(n, m)
        want = {"encoder": enc[0], "decoder": dec[0]}
    seen = 0
    for stack in model.stacks():
        assert len(stack.layers) == (n if stack.side == "encoder" else m)
        for layer in stack.layers:
            subs = [layer.self_attn, layer.ffn]
            if arch == "encoder_decoder" and stack.side == "decoder":
                assert layer.cross_attn is not None
                subs.append(layer.cross_attn)
            else:
                assert layer.cross_attn is None
            for res in subs:
                assert res.alpha == pytest.approx(want[stack.side], rel=1e-12)
                # DeepNorm is Post-LN: one LN after the add, none before the branch, no final LN
                assert isinstance(res.pre_norm, nn.Identity) and isinstance(res.post_norm, nn.LayerNorm)
                seen += 1
        assert stack.final_norm is None
    assert seen == (2 * n + (3 if arch == "encoder_decoder" else 2) * m)


def test_encoder_decoder_sides_differ():
    """The encoder side of an encoder-decoder must not reuse the decoder's (or encoder-only's) constant."""
    model = build_model(
        dict(
            arch="encoder_decoder", scheme="deepnorm", layers=6, decoder_layers=6, width=16, heads=2, ffn=32, max_len=8
        )
    )
    enc_alpha = model.encoder.layers[0].ffn.alpha
    dec_alpha = model.decoder.layers[0].cross_attn.alpha
    assert enc_alpha == pytest.approx(0.81 * (6**5) ** (1 / 16))
    assert dec_alpha == pytest.approx(18**0.25)
    assert enc_alpha != pytest.approx(12**0.25)  # encoder-only's (2N)^(1/4)


def test_public_name():
    assert kilolayer.deepnorm_constants is deepnorm_constants
