"""kilolayer vs torchscale 0.3.0 on copied weights: same forward numbers, different (paper vs torchscale) init.

torchscale's forward formula is right (docs/deepnet.md#torchscale-deviations), so with the
same weights and the same input hidden states the two stacks must agree.
torchscale runs its FFN activation and its softmax in float32 even on float64
inputs (``activation_fn(x.float())``, ``softmax(dtype=float32)``), so a float64
comparison cannot reach 1e-10; it is held to 1e-6 and float32 to 1e-5.
"""

from __future__ import annotations

import math

import peers  # noqa: F401  (installs the timm stand-in before torchscale is imported)
import pytest
import torch
from peers import (
    DecoderConfig,
    EncoderConfig,
    copy_stack,
    run_decoder,
    run_encoder,
    torchscale_decoder,
    torchscale_encoder,
    torchscale_encoder_decoder,
)

from kilolayer import build_model, deepnorm_constants

TOL = {torch.float32: 1e-5, torch.float64: 1e-6}
D, H, F = 64, 4, 128


def padding(batch: int, length: int, lengths: list[int]) -> torch.Tensor:
    pad = torch.zeros(batch, length, dtype=torch.bool)
    for b, n in enumerate(lengths):
        pad[b, n:] = True
    return pad


def assert_close(ours, theirs, keep, dtype, what):
    diff = (ours - theirs)[keep].abs().max().item()
    assert diff <= TOL[dtype], f"{what}: max |difference| {diff:.3g} > {TOL[dtype]}"
    # and the outputs are not trivially equal (e.g. both zero)
    assert ours[keep].abs().mean().item() > 0.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scheme, activation", [("post_ln", "gelu"), ("deepnorm", "gelu"), ("deepnorm", "relu")])
def test_encoder_only(scheme, activation, dtype):
    torch.manual_seed(0)
    layers = 4
    ours = (
        build_model(dict(arch="encoder", scheme=scheme, layers=layers, width=D, heads=H, ffn=F, activation=activation))
        .to(dtype)
        .eval()
    )
    theirs = torchscale_encoder(D, H, F, layers, deepnorm=scheme == "deepnorm", activation=activation)
    theirs = theirs.to(dtype).eval()
    want_alpha = (2 * layers) ** 0.25 if scheme == "deepnorm" else 1.0
    assert [layer.alpha for layer in theirs.layers] == pytest.approx([want_alpha] * layers)
    assert ours.encoder.layers[0].ffn.alpha == pytest.approx(want_alpha)
    copy_stack(theirs.layers, ours.encoder)

    x = torch.randn(3, 11, D, dtype=dtype)
    with torch.no_grad():
        assert_close(ours.encoder(x), run_encoder(theirs, x), torch.ones(3, 11, dtype=torch.bool), dtype, "no padding")
        pad = padding(3, 11, [11, 7, 2])
        assert_close(ours.encoder(x, pad), run_encoder(theirs, x, pad), ~pad, dtype, "padding")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scheme", ["post_ln", "deepnorm"])
def test_decoder_only(scheme, dtype):
    """Causal self-attention: SDPA's own causal path, and our bool mask when there is padding."""
    torch.manual_seed(0)
    layers = 3
    ours = build_model(dict(arch="decoder", scheme=scheme, layers=layers, width=D, heads=H, ffn=F)).to(dtype).eval()
    theirs = torchscale_decoder(D, H, F, layers, deepnorm=scheme == "deepnorm").to(dtype).eval()
    want_alpha = (2 * layers) ** 0.25 if scheme == "deepnorm" else 1.0
    assert theirs.layers[0].alpha == pytest.approx(want_alpha) and ours.decoder.layers[
        0
    ].self_attn.alpha == pytest.approx(want_alpha)
    copy_stack(theirs.layers, ours.decoder)
    y = torch.randn(3, 8, D, dtype=dtype)
    pad = padding(3, 8, [8, 5, 2])
    with torch.no_grad():
        assert_close(ours.decoder(y), run_decoder(theirs, y), torch.ones(3, 8, dtype=torch.bool), dtype, "causal")
        assert_close(ours.decoder(y, pad), run_decoder(theirs, y, padding_mask=pad), ~pad, dtype, "causal+padding")


def test_encoder_gradients_match():
    """Backward through the DeepNorm residual too: input gradients agree on copied weights."""
    torch.manual_seed(1)
    ours = build_model(dict(arch="encoder", scheme="deepnorm", layers=3, width=D, heads=H, ffn=F)).double()
    theirs = torchscale_encoder(D, H, F, 3, deepnorm=True).double()
    copy_stack(theirs.layers, ours.encoder)
    pad = padding(2, 9, [9, 5])
    probe = torch.randn(2, 9, D, dtype=torch.float64) * (~pad)[..., None]
    grads = []
    for run in (lambda x: ours.encoder(x, pad), lambda x: run_encoder(theirs, x, pad)):
        x = torch.randn(2, 9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
        (run(x) * probe).sum().backward()
        grads.append(x.grad)
    keep = ~pad
    assert (grads[0] - grads[1])[keep].abs().max().item() < 1e-6
    assert grads[0][keep].abs().mean().item() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n, m", [(2, 3), (3, 1)])
def test_encoder_decoder_deepnorm(n, m, dtype):
    torch.manual_seed(0)
    ours = (
        build_model(
            dict(arch="encoder_decoder", scheme="deepnorm", layers=n, decoder_layers=m, width=D, heads=H, ffn=F)
        )
        .to(dtype)
        .eval()
    )
    theirs = torchscale_encoder_decoder(D, H, F, n, m, deepnorm=True).to(dtype).eval()
    consts = deepnorm_constants("encoder_decoder", n, m)
    assert theirs.encoder.layers[0].alpha == pytest.approx(consts["encoder"][0])
    assert theirs.decoder.layers[0].alpha == pytest.approx(consts["decoder"][0])
    copy_stack(theirs.encoder.layers, ours.encoder)
    copy_stack(theirs.decoder.layers, ours.decoder)

    x, y = torch.randn(3, 10, D, dtype=dtype), torch.randn(3, 7, D, dtype=dtype)
    src_pad, tgt_pad = padding(3, 10, [10, 6, 3]), padding(3, 7, [7, 7, 4])
    with torch.no_grad():
        for sp, tp in ((None, None), (src_pad, None), (src_pad, tgt_pad)):
            mem_ours = ours.encoder(x, sp)
            mem_theirs = run_encoder(theirs.encoder, x, sp)
            keep_src = torch.ones(3, 10, dtype=torch.bool) if sp is None else ~sp
            assert_close(mem_ours, mem_theirs, keep_src, dtype, "encoder output")
            out_ours = ours.decoder(y, tp, mem_ours, sp)
            out_theirs = run_decoder(theirs.decoder, y, mem_theirs, sp, tp)
            keep_tgt = torch.ones(3, 7, dtype=torch.bool) if tp is None else ~tp
            assert_close(out_ours, out_theirs, keep_tgt, dtype, f"decoder output (padding {sp is not None})")


def test_copy_is_not_vacuous():
    """Perturbing one copied weight must break the agreement (the comparison can fail)."""
    torch.manual_seed(0)
    ours = build_model(dict(arch="encoder", scheme="deepnorm", layers=2, width=D, heads=H, ffn=F)).double()
    theirs = torchscale_encoder(D, H, F, 2, deepnorm=True).double()
    copy_stack(theirs.layers, ours.encoder)
    with torch.no_grad():
        ours.encoder.layers[1].self_attn.branch.qkv.weight[2 * D :] *= 1.01  # V only
        x = torch.randn(2, 5, D, dtype=torch.float64)
        assert (ours.encoder(x) - run_encoder(theirs, x)).abs().max().item() > 1e-4


# ---------------------------------------------------------------- init: ours is the paper's, torchscale's is not


def _std(w: torch.Tensor) -> float:
    return w.detach().double().std().item()


def test_torchscale_init_deviates_from_the_paper():
    torch.manual_seed(0)
    n, m, d = 2, 2, 256
    theirs = torchscale_encoder_decoder(d, 4, 4 * d, n, m, deepnorm=True)
    ours = build_model(
        dict(arch="encoder_decoder", scheme="deepnorm", layers=n, decoder_layers=m, width=d, heads=4, ffn=4 * d)
    )
    paper_beta = 0.87 * (n**4 * m) ** (-1 / 16)
    torchscale_beta = 1.15 * (n**4 * m) ** (-1 / 16)
    assert deepnorm_constants("encoder_decoder", n, m)["encoder"][1] == pytest.approx(paper_beta)

    # torchscale: V is Q's default init divided by its scale, so std(V)/std(Q) is its beta: 1.15, not 0.87
    ts_attn = theirs.encoder.layers[0].self_attn
    ratio = _std(ts_attn.v_proj.weight) / _std(ts_attn.q_proj.weight)
    assert ratio == pytest.approx(torchscale_beta, rel=0.02)
    assert ratio != pytest.approx(paper_beta, rel=0.1)

    # ours: the same ratio is the paper's beta
    qkv = ours.encoder.layers[0].self_attn.branch.qkv.weight
    ratio = _std(qkv[2 * d :]) / _std(qkv[:d])
    assert ratio == pytest.approx(paper_beta, rel=0.02)

    # torchscale skips the Xavier step: Q keeps PyTorch's Linear default, std 1/sqrt(3 fan_in), not Xavier's
    assert _std(ts_attn.q_proj.weight) == pytest.approx(1 / math.sqrt(3 * d), rel=0.02)
    assert _std(qkv[:d]) == pytest.approx(math.sqrt(2 / (2 * d)), rel=0.02)

    # torchscale divides (nonzero) biases too; ours start at zero
    assert ts_attn.v_proj.bias.abs().max().item() > 0
    assert ours.encoder.layers[0].self_attn.branch.qkv.bias.abs().max().item() == 0

    # its decoder side uses the paper's (12M)^(1/4) as a divisor: same ratio as ours
    ts_dec = theirs.decoder.layers[0].self_attn
    dec_beta = (12 * m) ** -0.25
    assert _std(ts_dec.v_proj.weight) / _std(ts_dec.q_proj.weight) == pytest.approx(dec_beta, rel=0.02)
    ours_dec = ours.decoder.layers[0].self_attn.branch.qkv.weight
    assert _std(ours_dec[2 * d :]) / _std(ours_dec[:d]) == pytest.approx(dec_beta, rel=0.02)


def test_torchscale_flag_trap_is_pinned_down():
    """torchscale's default ``subln=True`` silently overrides ``*_normalize_before=False`` (Pre-LN);
    our builders therefore pass ``subln=False`` and check what was built.

    (An earlier note said ``DecoderConfig(deepnorm=True)`` stays Pre-LN; in 0.3.0 ``deepnorm=True`` turns
    ``subln`` off first, so it does build Post-LN -- pinned here so a change in the peer is noticed.)
    """
    trap = EncoderConfig(encoder_normalize_before=False)
    assert trap.encoder_normalize_before is True and trap.subln is True
    assert DecoderConfig(decoder_normalize_before=False).decoder_normalize_before is True
    assert EncoderConfig(encoder_normalize_before=False, subln=False).encoder_normalize_before is False
    deep = DecoderConfig(deepnorm=True)
    assert (deep.decoder_normalize_before, deep.subln, deep.deepnorm) == (False, False, True)
