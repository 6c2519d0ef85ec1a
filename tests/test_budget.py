"""Parameter and FLOP budgets from configs alone, against built models and PyTorch's FLOP counter."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from kilolayer import (
    SCHEMES,
    ModelConfig,
    budget,
    build_model,
    count_parameters,
    deepnorm_constants,
    matched_configs,
    training_flops,
)
from kilolayer.cli import main
from kilolayer.presets import PRESETS as PRESET_FIELDS

PRESETS = {name: ModelConfig(**fields) for name, fields in PRESET_FIELDS.items()}  # presets are plain data


def built_parameters(cfg) -> int:
    # the meta device allocates nothing, and initialisation sets values, not shapes: skipped, the 1,000-layer
    # presets build in seconds (on meta each init op runs as a Python decomposition)
    keep = lambda self, *args, **kwargs: self
    inits = [mock.patch.object(torch.Tensor, op, keep) for op in ("normal_", "uniform_", "zero_", "fill_")]
    with contextlib.ExitStack() as stack, torch.device("meta"):
        for patch in inits:
            stack.enter_context(patch)
        model = build_model(cfg)
    assert all(p.is_meta for p in model.parameters())
    return sum(p.numel() for p in model.parameters())


BIG = {"deepnet_200l200l", "deepnet_250l250l", "deepnet_500l500l"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in BIG else n for n in PRESETS])
def test_preset_parameter_counts(name):
    assert count_parameters(PRESETS[name]) == built_parameters(PRESETS[name])


def test_published_sizes():
    """Backbone sizes of published models (no output head, no pooler), worked out by hand."""
    # BERT-base encoder without token-type embeddings or pooler: 108.9M
    d, f, L = 768, 3072, 12
    layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 2 * 2 * d
    assert count_parameters(PRESETS["bert_base"]) == L * layer + 30522 * d + 512 * d
    # ViT-B/16: 12 layers + patch projection + CLS + 197 positions + final LN = 85,798,656
    assert count_parameters(PRESETS["vit_b16"]) == 85_798_656


schemes = st.sampled_from(sorted(SCHEMES))
archs = st.sampled_from(["encoder", "decoder", "encoder_decoder"])


@settings(max_examples=60, deadline=None)
@given(
    scheme=schemes,
    arch=archs,
    layers=st.integers(1, 3),
    dec=st.integers(1, 3),
    heads=st.integers(1, 4),
    head_dim=st.integers(1, 8),
    ffn=st.integers(1, 40),
    bias=st.booleans(),
    positions=st.sampled_from(["learned", "sinusoidal", "none"]),
)
def test_count_matches_build_for_every_scheme(scheme, arch, layers, dec, heads, head_dim, ffn, bias, positions):
    cfg = dict(
        arch=arch,
        scheme=scheme,
        layers=layers,
        width=heads * head_dim,
        heads=heads,
        ffn=ffn,
        bias=bias,
        positions=positions,
        vocab_size=11,
        max_len=7,
    )
    if arch == "encoder_decoder":
        cfg["decoder_layers"] = dec
    assert count_parameters(cfg) == built_parameters(cfg)


@settings(max_examples=20, deadline=None)
@given(scheme=schemes, cls=st.booleans(), patch=st.sampled_from([2, 4]), channels=st.integers(1, 3))
def test_count_matches_build_for_patch_encoders(scheme, cls, patch, channels):
    cfg = dict(
        arch="encoder",
        scheme=scheme,
        input="patches",
        image_size=8,
        patch_size=patch,
        channels=channels,
        cls_token=cls,
        layers=2,
        width=16,
        heads=2,
        ffn=24,
    )
    assert count_parameters(cfg) == built_parameters(cfg)


# ---------------------------------------------------------------- FLOPs


def counted_training_flops(cfg: dict, batch: int, src_len: int, tgt_len: int) -> int:
    """FLOPs PyTorch counts for one forward + backward (loss = output.sum()).

    SDPA runs through its math backend: the counter has no formula for the CPU
    fused attention kernel and would silently count its matmuls as 0.
    """
    torch.manual_seed(0)
    model = build_model(cfg)
    c = model.config
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        if c.arch == "encoder_decoder":
            src, tgt = (
                torch.randint(0, c.vocab_size, (batch, src_len)),
                torch.randint(0, c.vocab_size, (batch, tgt_len)),
            )
            out = model(src, tgt)
        elif c.input == "patches":
            out = model(torch.randn(batch, c.channels, c.image_size, c.image_size))
        else:
            out = model(torch.randint(0, c.vocab_size, (batch, tgt_len if c.arch == "decoder" else src_len)))
        out.sum().backward()
    return counter.get_total_flops()


FLOP_CASES = {
    "encoder": dict(arch="encoder", scheme="post_ln", layers=2, width=64, heads=4, ffn=256, max_len=32),
    "decoder": dict(arch="decoder", scheme="pre_ln", layers=3, width=64, heads=2, ffn=128, max_len=32),
    "encoder_decoder": dict(
        arch="encoder_decoder", scheme="deepnorm", layers=2, decoder_layers=3, width=64, heads=4, ffn=256, max_len=32
    ),
    "patches": dict(
        arch="encoder",
        scheme="pre_ln",
        input="patches",
        image_size=32,
        patch_size=4,
        channels=3,
        layers=2,
        width=64,
        heads=4,
        ffn=256,
    ),
    "sub_ln_no_bias": dict(
        arch="encoder", scheme="sub_ln", layers=2, width=64, heads=4, ffn=256, max_len=32, bias=False
    ),
}


@pytest.mark.parametrize("case", list(FLOP_CASES))
def test_training_flops_match_the_counter(case):
    cfg = FLOP_CASES[case]
    c = ModelConfig(**cfg)
    batch = 2
    if c.arch == "encoder_decoder":
        src_len, tgt_len = 24, 16  # different lengths so cross-attention's S x T term is tested
        want = batch * training_flops(cfg, src_len, tgt_len)
    elif c.input == "patches":
        src_len = tgt_len = c.seq_len
        want = batch * training_flops(cfg)
    else:
        src_len = tgt_len = 20
        want = batch * training_flops(cfg, src_len, tgt_len)
    got = counted_training_flops(cfg, batch, src_len, tgt_len)
    assert got == pytest.approx(want, rel=0.05), f"counted {got}, formula {want}"


def test_training_flops_by_hand():
    """6 x matmul weights x tokens + 12 x L x d x T^2 for a 1-layer encoder (docs/bamboo.md#model-flops-and-mfu)."""
    d, f, T = 32, 64, 10
    cfg = dict(arch="encoder", scheme="pre_ln", layers=1, width=d, heads=2, ffn=f, max_len=T)
    assert training_flops(cfg) == 6 * (4 * d * d + 2 * d * f) * T + 12 * d * T * T
    b = budget(cfg)
    assert b.flops_per_token == pytest.approx(training_flops(cfg) / T)
    assert b.seq_len == T and b.tokens_per_sample == T


# ---------------------------------------------------------------- configurator


@pytest.mark.parametrize("name, tolerance", [("vit_b16", 0.03), ("bert_base", 0.02), ("gpt2_small", 0.03)])
def test_matched_configs_are_within_tolerance(name, tolerance):
    base = PRESETS[name]
    target = count_parameters(base)
    rows = matched_configs(base, tolerance=tolerance)
    assert len(rows) >= 3
    assert any(c.layers > base.layers for c in rows)
    assert [c.layers for c in rows] == sorted(c.layers for c in rows)
    for c in rows:
        assert abs(count_parameters(c) - target) / target <= tolerance
        assert c.head_dim == 64 and c.width % 64 == 0 and c.width == 64 * c.heads
        assert c.ffn / c.width == pytest.approx(base.ffn / base.width, abs=0.01)
        assert c.layers >= base.layers and c.width <= base.width
        assert (c.arch, c.scheme, c.input, c.vocab_size) == (base.arch, base.scheme, base.input, base.vocab_size)
    # the 48 x 384 deep-narrow preset is one of vit_b16's matches
    if name == "vit_b16":
        assert any((c.layers, c.width) == (48, 384) for c in rows)


def test_matched_configs_for_a_parameter_count():
    base = ModelConfig(arch="encoder", scheme="pre_ln", layers=2, width=128, heads=2, ffn=512)
    rows = matched_configs(base, params=5_000_000, tolerance=0.02)
    assert rows
    for c in rows:
        assert abs(count_parameters(c) - 5_000_000) / 5_000_000 <= 0.02
        assert c.head_dim == 64


# ---------------------------------------------------------------- CLI tables


def table_rows(text: str) -> list[list[str]]:
    """Cells of each body row of a rich table (rows drawn with the box character │)."""
    return [
        [c.strip() for c in line.strip().strip("│").split("│")]
        for line in text.splitlines()
        if line.strip().startswith("│")
    ]


def millions(n: float) -> str:
    return f"{n / 1e6:.2f}M"


def test_describe_table_matches_budget(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no wrapped cells
    assert main(["describe", "vit_b16", "deepnet_100l100l", "--set", "model.max_len=128"]) == 0
    rows = {r[0]: r for r in table_rows(capsys.readouterr().out)}
    vit = budget(PRESETS["vit_b16"])
    assert rows["vit_b16"][9] == millions(vit.parameters) == "85.80M"
    assert rows["vit_b16"][10] == str(vit.seq_len) == "197"
    assert rows["vit_b16"][11] == millions(vit.flops_per_token)
    deep = ModelConfig(**{**PRESETS["deepnet_100l100l"].model_dump(), "max_len": 128})
    b = budget(deep)
    assert rows["deepnet_100l100l"][9] == millions(b.parameters)
    assert rows["deepnet_100l100l"][11] == f"{b.flops_per_token / 1e9:.2f}B"
    consts = deepnorm_constants("encoder_decoder", 100, 100)
    enc, dec = f"{consts['encoder'][0]:.4g}", f"{consts['decoder'][0]:.4g}"
    assert f"alpha={enc}" in rows["deepnet_100l100l"][8] and f"alpha={dec}" in rows["deepnet_100l100l"][8]
    assert "beta=0.2063" in rows["deepnet_100l100l"][8]


def test_describe_shows_dlcls_starting_combination_weights(capsys, monkeypatch):
    """DLCL's scheme constants: the weights of each layer's input start at the average of the outputs below."""
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["describe", "deepnet_100l100l", "--set", "model.scheme=dlcl", "--set", "model.max_len=128"]) == 0
    (row,) = table_rows(capsys.readouterr().out)
    assert row[7] == "dlcl" and row[8] == "all: W_l,k=1/(l+1)"


def test_configs_table_matches_matched_configs(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["configs", "--like", "vit_b16"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    want = matched_configs(PRESETS["vit_b16"])
    target = count_parameters(PRESETS["vit_b16"])
    assert millions(target) in out
    assert len(rows) == len(want)
    for row, c in zip(rows, want):
        b = budget(c)
        assert row[0] == str(c.layers) and row[2] == str(c.width) and row[3] == str(c.heads)
        assert row[4] == str(c.ffn)
        assert row[5] == millions(b.parameters)
        assert row[6] == f"{(b.parameters - target) / target:+.1%}"
        assert row[7] == millions(b.flops_per_token)
    assert ["48", "-", "384", "6", "1536", millions(count_parameters(PRESETS["vit_b16_deep48"]))] == [
        r for r in rows if r[0] == "48"
    ][0][:6]
