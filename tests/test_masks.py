"""Causal and padding masks, for every residual scheme; the keyed random draws of training masks.

Causal: changing token p never changes an output before p (decoder-only and
the decoder of an encoder-decoder). Padding: whatever sits at padded
positions never changes an output at a non-padded position (encoder
self-attention, decoder self-attention, and cross-attention to padded memory).
Keyed draws: a sample's random words are a function of (seed, its index,
stream, position) only, and look uniform.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilolayer import SCHEMES, build_model
from kilolayer.objectives import common

V, T, S, B = 50, 9, 7, 2
ATOL = 1e-6
SCHEME_NAMES = sorted(SCHEMES)
examples = settings(max_examples=12, deadline=None)


@cache
def model(scheme: str, arch: str):
    torch.manual_seed(0)
    cfg = dict(arch=arch, scheme=scheme, layers=2, width=32, heads=4, ffn=64, vocab_size=V, max_len=16)
    if arch == "encoder_decoder":
        cfg["decoder_layers"] = 2
    m = build_model(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1 and p.numel() == 1:  # ReZero's per-layer scalar starts at 0: open the branches
                p.fill_(0.7)
    return m


def tokens(seed: int, shape=(B, T)) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def other_token(t: int, shift: int) -> int:
    return (t + 1 + shift % (V - 1)) % V


@torch.no_grad()
def run(m, arch, tgt, src=None, tgt_pad=None, src_pad=None):
    if arch == "encoder_decoder":
        return m(src, tgt, src_pad, tgt_pad)
    return m(tgt, tgt_pad)


# ---------------------------------------------------------------- causal


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@examples
@given(p=st.integers(0, T - 1), b=st.integers(0, B - 1), shift=st.integers(0, 1000), seed=st.integers(0, 3))
def test_future_tokens_never_change_the_past(scheme, arch, p, b, shift, seed):
    m = model(scheme, arch)
    tgt = tokens(seed)
    src = tokens(seed + 100, (B, S)) if arch == "encoder_decoder" else None
    before = run(m, arch, tgt, src)
    tgt2 = tgt.clone()
    tgt2[b, p] = other_token(int(tgt[b, p]), shift)
    after = run(m, arch, tgt2, src)
    assert torch.allclose(before[:, :p], after[:, :p], atol=ATOL, rtol=0), "an earlier position saw the future"
    assert not torch.allclose(before[b, p], after[b, p], atol=1e-4), "the changed position did not change"
    other = 1 - b
    assert torch.allclose(before[other], after[other], atol=ATOL, rtol=0), "samples leak into each other"


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_causal_with_padding_mask(scheme):
    """With a padding mask the decoder builds its own causal mask (not SDPA's): it must still be causal."""
    m = model(scheme, "decoder")
    tgt = tokens(0)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, 6:] = True
    before = run(m, "decoder", tgt, tgt_pad=pad)
    for p in range(T - 1):
        tgt2 = tgt.clone()
        tgt2[:, p] = (tgt[:, p] + 1) % V
        after = run(m, "decoder", tgt2, tgt_pad=pad)
        assert torch.allclose(before[:, :p], after[:, :p], atol=ATOL, rtol=0)


def test_encoder_is_not_causal():
    """Sanity check for the test above: in the encoder a later token does change earlier outputs."""
    m = model("pre_ln", "encoder")
    x = tokens(0)
    x2 = x.clone()
    x2[:, -1] = (x[:, -1] + 1) % V
    assert not torch.allclose(run(m, "encoder", x)[:, 0], run(m, "encoder", x2)[:, 0], atol=1e-4)


# ---------------------------------------------------------------- padding


def pad_strategy(length: int):
    """A padding mask row with at least one real (non-padded) position."""
    return st.lists(st.booleans(), min_size=length, max_size=length).filter(lambda r: not all(r))


def refill_padding(x: torch.Tensor, pad: torch.Tensor, seed: int) -> torch.Tensor:
    noise = torch.randint(0, V, x.shape, generator=torch.Generator().manual_seed(seed))
    return torch.where(pad, noise, x)


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@examples
@given(rows=st.lists(pad_strategy(T), min_size=B, max_size=B), seed=st.integers(0, 1000))
def test_encoder_padding_is_invisible(scheme, rows, seed):
    m = model(scheme, "encoder")
    pad = torch.tensor(rows)
    x = tokens(seed % 7)
    x2 = refill_padding(x, pad, seed)
    before, after = run(m, "encoder", x, tgt_pad=pad), run(m, "encoder", x2, tgt_pad=pad)
    keep = ~pad
    assert torch.allclose(before[keep], after[keep], atol=ATOL, rtol=0)


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@examples
@given(rows=st.lists(pad_strategy(T), min_size=B, max_size=B), seed=st.integers(0, 1000))
def test_decoder_padding_is_invisible(scheme, rows, seed):
    m = model(scheme, "decoder")
    pad = torch.tensor(rows)
    x = tokens(seed % 7)
    x2 = refill_padding(x, pad, seed)
    before, after = run(m, "decoder", x, tgt_pad=pad), run(m, "decoder", x2, tgt_pad=pad)
    keep = ~pad
    assert torch.allclose(before[keep], after[keep], atol=ATOL, rtol=0)


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@examples
@given(rows=st.lists(pad_strategy(S), min_size=B, max_size=B), seed=st.integers(0, 1000))
def test_cross_attention_ignores_padded_memory(scheme, rows, seed):
    m = model(scheme, "encoder_decoder")
    src_pad = torch.tensor(rows)
    src, tgt = tokens(seed % 5, (B, S)), tokens(seed % 3)
    src2 = refill_padding(src, src_pad, seed)
    before = run(m, "encoder_decoder", tgt, src, src_pad=src_pad)
    after = run(m, "encoder_decoder", tgt, src2, src_pad=src_pad)
    assert torch.allclose(before, after, atol=ATOL, rtol=0), "padded source tokens reached the decoder"
    # the encoder's own non-padded outputs are unchanged too
    with torch.no_grad():
        keep = ~src_pad
        assert torch.allclose(m.encode(src, src_pad)[keep], m.encode(src2, src_pad)[keep], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder"])
def test_padding_masks_are_what_hides_the_padding(arch):
    """Sanity check: without the mask, changing the padded tokens does change real outputs."""
    m = model("post_ln", arch)
    pad = torch.zeros(B, S if arch == "encoder_decoder" else T, dtype=torch.bool)
    pad[:, -3:] = True
    x = tokens(0, tuple(pad.shape))
    x2 = refill_padding(x, pad, 1)
    if arch == "encoder":
        a, b = run(m, arch, x), run(m, arch, x2)
        assert not torch.allclose(a[~pad], b[~pad], atol=1e-4)
    else:
        tgt = tokens(1)
        a, b = run(m, arch, tgt, x), run(m, arch, tgt, x2)
        assert not torch.allclose(a, b, atol=1e-4)


# ---------------------------------------------------------------- keyed random draws


def test_the_hash_multiplies_modulo_two_to_the_32_without_overflow():
    x = torch.randint(0, 2**32, (2000,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    x[:2] = torch.tensor([0, 2**32 - 1])
    for c in (0x85EBCA6B, 0xC2B2AE35):
        assert common._mul32(x, c).tolist() == [(int(v) * c) % 2**32 for v in x]
    assert common._fmix32(x).tolist() == [fmix32(int(v)) for v in x]


def fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser on Python integers (as in its reference C source)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2**32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2**32
    return h ^ (h >> 16)


def test_keyed_words_depend_on_the_key_alone_and_look_uniform():
    samples = torch.arange(10_000, 12_000)
    bits = common.keyed_bits(7, samples, 0, 64)
    assert bits.shape == (2000, 64) and int(bits.min()) >= 0 and int(bits.max()) < 2**32
    # any subset of the samples, in any order, gets the same rows
    order = torch.randperm(2000, generator=torch.Generator().manual_seed(1))[:300]
    assert torch.equal(common.keyed_bits(7, samples[order], 0, 64), bits[order])
    assert torch.equal(common.keyed_bits(7, samples[:5], 0, 16), bits[:5, :16])  # a prefix of the positions too
    for other in (common.keyed_bits(8, samples, 0, 64), common.keyed_bits(7, samples, 1, 64)):
        assert float((other == bits).float().mean()) < 1e-3  # another seed or stream: other words
    n = bits.numel()
    for k in range(32):  # every bit is 1 half the time, within 5 standard deviations
        assert abs(float(((bits >> k) & 1).sum()) - n / 2) < 5 * (n / 4) ** 0.5, k
    u = common.keyed_uniform(7, samples, 0, 64)
    assert abs(float(u.mean()) - 0.5) < 5 * (1 / 12 / n) ** 0.5
    # neighbouring positions and neighbouring samples are uncorrelated (|r| within 5 / sqrt(n))
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(r)) < 5 / a.numel() ** 0.5
