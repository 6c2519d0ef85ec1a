"""Attention as matrix products (``model.cpu_attention: auto`` under bf16 on a CPU) against PyTorch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kilolayer.config import ModelConfig
from kilolayer.nn.attention import CAUSAL_SPLIT_MIN, MATMUL_MAX_KEYS, Attention, matmul_attention


def _qkv(B, H, T, S, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize(
    "T,S,masked,causal",
    [
        (7, 7, False, False),
        (7, 7, True, False),
        (7, 7, False, True),
        (5, 9, False, True),
        (5, 9, True, False),
        (CAUSAL_SPLIT_MIN, CAUSAL_SPLIT_MIN, False, True),  # causal in two halves of queries
        (CAUSAL_SPLIT_MIN + 7, CAUSAL_SPLIT_MIN + 7, False, True),  # an odd count: halves of 51 and 52
    ],
)
def test_matmul_attention_is_sdpa_in_float64(T, S, masked, causal):
    """Forward and gradients equal SDPA's to float64 rounding: padding masks (a query with no key left gets
    zeros and no gradient, as SDPA gives), causal self-attention and a causal mask with more keys than queries
    (SDPA's top-left alignment)."""
    mask = None
    if masked:
        mask = torch.rand(2, 1, T, S, generator=torch.Generator().manual_seed(3)) > 0.4
        mask[0, 0, 1] = False  # every key masked for this query
    a, b = _qkv(2, 3, T, S, 8), _qkv(2, 3, T, S, 8)
    ya = F.scaled_dot_product_attention(*a, attn_mask=mask, is_causal=causal)
    yb = matmul_attention(*b, mask, 0.0, causal)
    assert torch.allclose(ya, yb, atol=1e-12, rtol=1e-10)
    if masked:
        assert torch.equal(yb[0, :, 1], torch.zeros_like(yb[0, :, 1]))
    grad = torch.randn_like(ya)
    ya.backward(grad), yb.backward(grad)
    for ta, tb in zip(a, b):
        assert torch.isfinite(tb.grad).all()
        assert torch.allclose(ta.grad, tb.grad, atol=1e-12, rtol=1e-10)


def test_matmul_attention_in_bf16_is_within_bf16_rounding_of_fp32():
    q, k, v = (t.detach().float() for t in _qkv(4, 2, 64, 64, 32))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    approx = matmul_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 0.0, True)
    assert approx.dtype == torch.bfloat16
    assert (approx.float() - exact).norm() <= 0.01 * exact.norm()


def test_causal_attention_in_halves_gives_the_whole_products_result():
    """In bf16, the two halves of queries give the whole causal product's forward and queries' gradients up to the
    order of their sums (within one bf16 rounding; bit for bit on the CPUs measured), the keys' and values'
    gradients within two more roundings (each is the sum of the halves' bf16 products). A mask with is_causal is
    refused, as SDPA refuses it."""
    n = 2 * CAUSAL_SPLIT_MIN
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in _qkv(4, 2, n, n, 32))
    whole = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    causal = torch.ones(n, n, dtype=torch.bool).tril()  # the same mask, given: no split
    halves, ref = matmul_attention(q, k, v, None, 0.0, True), matmul_attention(*whole, causal)
    grad = torch.randn_like(ref)
    halves.backward(grad), ref.backward(grad)
    pairs = [(halves, ref, 1), (q.grad, whole[0].grad, 1), (k.grad, whole[1].grad, 3), (v.grad, whole[2].grad, 3)]
    for split, one, roundings in pairs:
        scale = one.float().abs().amax(dim=-1, keepdim=True)  # one rounding of a row's largest entry
        assert ((split.float() - one.float()).abs() <= roundings * 2**-8 * scale).all()
    assert not torch.equal(k.grad, whole[1].grad)  # the keys' gradients were summed over the halves
    with pytest.raises(ValueError, match="mask or is_causal, not both"):
        matmul_attention(q, k, v, causal, 0.0, True)


@pytest.mark.parametrize("keys", [16, MATMUL_MAX_KEYS + 1])
def test_auto_attends_short_sequences_as_products_and_long_ones_in_fp32(keys):
    """Under bf16 autocast on a CPU, ``auto`` gives bit for bit what matrix products give up to
    MATMUL_MAX_KEYS keys, and what ``fp32`` (SDPA in fp32) gives beyond."""
    torch.manual_seed(0)
    auto = Attention(32, 2, causal=True)
    other = Attention(32, 2, causal=True, cpu_attention="fp32")
    other.load_state_dict(auto.state_dict())
    x = torch.randn(2, keys, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_auto, y_fp32 = auto(x), other(x)
        q, k, v = (t.view(2, keys, 2, 16).transpose(1, 2) for t in auto.qkv(x).chunk(3, dim=-1))
        with torch.autocast("cpu", enabled=False):
            products = matmul_attention(q, k, v, None, 0.0, True)
        y_products = auto.out(products.transpose(1, 2).reshape(2, keys, 32))
    assert torch.equal(y_auto, y_products if keys <= MATMUL_MAX_KEYS else y_fp32)
    assert not torch.equal(y_products, y_fp32)


def test_cpu_attention_is_checked_and_reads_its_boolean_form():
    base = {"arch": "decoder", "layers": 2, "width": 32, "heads": 2, "ffn": 64, "vocab_size": 16}
    assert ModelConfig(**base).cpu_attention == "auto"
    assert ModelConfig(**base, attention_fp32_cpu=True).cpu_attention == "fp32"
    assert ModelConfig(**base, attention_fp32_cpu=False).cpu_attention == "sdpa"
    with pytest.raises(ValueError, match="cpu_attention"):
        ModelConfig(**base, cpu_attention="flash")
    with pytest.raises(ValueError, match=r"model.attention_fp32_cpu: give model.cpu_attention alone"):
        ModelConfig(**base, attention_fp32_cpu=True, cpu_attention="auto")
    with pytest.raises(ValueError, match=r"attention_fp32_cpu='yes': expected true or false"):
        ModelConfig(**base, attention_fp32_cpu="yes")
    with pytest.raises(ValueError, match="cpu_attention='flash': expected one of auto, fp32, sdpa"):
        Attention(32, 2, cpu_attention="flash")


def test_scores_that_overflow_give_nan_as_sdpa_does_even_with_a_padding_mask():
    """Only a query with no key left is set to zeros: a NaN from overflowing scores stays visible (a diverging
    run must look diverged whichever way it attends)."""
    q = torch.full((1, 1, 3, 4), 3e38)
    mask = torch.tensor([[True, True, False]] * 3).view(1, 1, 3, 3)
    assert torch.isnan(F.scaled_dot_product_attention(q, q, q, attn_mask=mask)).all()
    assert torch.isnan(matmul_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), mask)).all()


def test_fp16_on_a_cpu_attends_in_fp32_whatever_its_length():
    torch.manual_seed(0)
    auto = Attention(32, 2, causal=True)
    fp32 = Attention(32, 2, causal=True, cpu_attention="fp32")
    fp32.load_state_dict(auto.state_dict())
    x = torch.randn(2, 16, 32)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(auto(x), fp32(x))
