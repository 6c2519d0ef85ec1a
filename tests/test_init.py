"""Initialisation of every branch weight by scheme (docs/deepnet.md#which-weights-get-beta and
#baseline-schemes), measured on built models.

Widths are 256 (FFN 1024), so a 256x256 slice has 65,536 samples and its
sample standard deviation is within ~0.3% of the true one; the tolerance
(2.5%) is many standard errors wide yet much tighter than the differences
between rules (0.81 vs 0.87, l^-1/2 vs l^-1/4, sqrt 2 factors).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kilolayer import build_model
from kilolayer.nn.admin import admin_profile

D, H, F = 256, 4, 1024
REL = 0.025

ARCHS = {
    "encoder": dict(arch="encoder", layers=2),
    "decoder": dict(arch="decoder", layers=2),
    "encoder_decoder": dict(arch="encoder_decoder", layers=2, decoder_layers=3),
}


def build(scheme: str, arch: str, seed: int = 0, **extra):
    torch.manual_seed(seed)
    cfg = dict(scheme=scheme, width=D, heads=H, ffn=F, vocab_size=512, max_len=32, **ARCHS[arch])
    cfg.update(extra)
    return build_model(cfg)


def own_slices(attn) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """q/k/v/o (weight, bias) cut by hand from the fused matrices: q|k|v rows of qkv, k|v rows of kv."""
    d = attn.width
    if attn.cross:
        out = {"q": (attn.q.weight, attn.q.bias)}
        for i, name in enumerate("kv"):
            out[name] = (attn.kv.weight[i * d : (i + 1) * d], attn.kv.bias[i * d : (i + 1) * d])
    else:
        out = {
            name: (attn.qkv.weight[i * d : (i + 1) * d], attn.qkv.bias[i * d : (i + 1) * d])
            for i, name in enumerate("qkv")
        }
    out["o"] = (attn.out.weight, attn.out.bias)
    return out


def branch_weights(model):
    """Yield (side, layer 1-based, kind, name, weight, bias) for every branch matrix, q/k/v cut by hand.

    Also checks that ``Attention.weights()`` hands out exactly those slices.
    """
    for stack in model.stacks():
        for i, layer in enumerate(stack.layers, 1):
            for res in layer.sublayers():
                kind = res.site.kind
                if kind == "ffn":
                    ffn = res.branch
                    parts = {"w1": (ffn.fc1.weight, ffn.fc1.bias), "w2": (ffn.fc2.weight, ffn.fc2.bias)}
                else:
                    parts = own_slices(res.branch)
                    via_api = {n: (w, b) for n, w, b in res.branch.weights()}
                    assert set(via_api) == set(parts) == {"q", "k", "v", "o"}
                    for n, (w, b) in parts.items():
                        w2, b2 = via_api[n]
                        assert w2.shape == w.shape and w2.data_ptr() == w.data_ptr(), f"weights() slice {n} is wrong"
                        assert b2.data_ptr() == b.data_ptr(), f"weights() bias slice {n} is wrong"
                for name, (w, b) in parts.items():
                    yield stack.side, i, kind, name, w, b


def xavier_std(w: torch.Tensor, gain: float) -> float:
    fan_out, fan_in = w.shape
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


def assert_std(w: torch.Tensor, want: float, label: str, dist: str = "normal"):
    w = w.detach()
    got = w.std().item()
    assert got == pytest.approx(want, rel=REL), f"{label}: std {got:.5g}, expected {want:.5g}"
    assert abs(w.mean().item()) < 6 * want / math.sqrt(w.numel()), f"{label}: mean not 0"
    peak = w.abs().max().item() / want
    if dist == "uniform":
        # U(-b, b) with b = sqrt(3) std: never beyond b, and reaches close to it
        assert math.sqrt(3) * 0.98 < peak <= math.sqrt(3) * (1 + REL), f"{label}: not uniform"
    else:
        assert peak > 3.0, f"{label}: tails too short for a normal"


def assert_zero_biases(model):
    for side, i, kind, name, _w, b in branch_weights(model):
        assert b is not None and torch.count_nonzero(b) == 0, f"{side}[{i}].{kind}.{name} bias not zero"


def check_gains(model, gain_of, dist="normal"):
    """``gain_of(side, layer, kind, name)`` -> expected Xavier gain; checks every branch matrix."""
    n = 0
    for side, i, kind, name, w, b in branch_weights(model):
        assert_std(w, xavier_std(w, gain_of(side, i, kind, name)), f"{side}[{i}].{kind}.{name}", dist)
        assert torch.count_nonzero(b) == 0, f"{side}[{i}].{kind}.{name} bias not zero"
        n += 1
    return n


def n_matrices(arch: str) -> int:
    """q, k, v, o, w1, w2 per layer, plus cross-attention's q, k, v, o in an encoder-decoder's decoder."""
    cfg = ARCHS[arch]
    return cfg["layers"] * 6 + cfg.get("decoder_layers", 0) * 10


def layer_norms(model) -> list[nn.LayerNorm]:
    return [m for m in model.modules() if isinstance(m, nn.LayerNorm)]


def is_ln(module) -> bool:
    """A sublayer's norm slot holds a LayerNorm (absent ones are nn.Identity)."""
    return isinstance(module, nn.LayerNorm)


# ---------------------------------------------------------------- DeepNorm


def deepnorm_beta(arch: str, side: str) -> float:
    cfg = ARCHS[arch]
    if arch in ("encoder", "decoder"):
        return (8 * cfg["layers"]) ** -0.25
    n, m = cfg["layers"], cfg["decoder_layers"]
    return 0.87 * (n**4 * m) ** (-1 / 16) if side == "encoder" else (12 * m) ** -0.25


@pytest.mark.parametrize("arch", list(ARCHS))
def test_deepnorm_init(arch):
    model = build("deepnorm", arch)

    def gain(side, i, kind, name):
        return deepnorm_beta(arch, side) if name in ("v", "o", "w1", "w2") else 1.0

    assert check_gains(model, gain) == n_matrices(arch)


def test_deepnorm_scales_cross_attention_too():
    """V and O of cross-attention carry the decoder beta (self- AND cross-attention, per the paper)."""
    model = build("deepnorm", "encoder_decoder")
    beta = (12 * 3) ** -0.25
    cross = model.decoder.layers[1].cross_attn.branch
    d = cross.width
    assert_std(cross.kv.weight[d:], beta * math.sqrt(2 / (2 * d)), "cross V")
    assert_std(cross.out.weight, beta * math.sqrt(2 / (2 * d)), "cross O")
    assert_std(cross.kv.weight[:d], math.sqrt(2 / (2 * d)), "cross K")
    assert_std(cross.q.weight, math.sqrt(2 / (2 * d)), "cross Q")


# ---------------------------------------------------------------- Sub-LN


def subln_gamma(arch: str, side: str) -> float:
    cfg = ARCHS[arch]
    if arch in ("encoder", "decoder"):
        return math.sqrt(math.log(2 * cfg["layers"]))
    n, m = cfg["layers"], cfg["decoder_layers"]
    if side == "encoder":
        return math.sqrt(math.log(3 * m) * math.log(2 * n) / 3)
    return math.sqrt(math.log(3 * m))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_subln_init_and_norms(arch):
    model = build("sub_ln", arch)

    def gain(side, i, kind, name):
        if kind == "cross_attn" or name not in ("v", "o", "w1", "w2"):
            return 1.0
        return subln_gamma(arch, side)

    assert check_gains(model, gain) == n_matrices(arch)
    for stack in model.stacks():
        assert stack.final_norm is not None
        for layer in stack.layers:
            assert layer.self_attn.branch.inner_norm is not None
            assert layer.ffn.branch.inner_norm is not None and layer.ffn.branch.inner_norm.normalized_shape == (F,)
            if layer.cross_attn is not None:
                assert layer.cross_attn.branch.inner_norm is None  # self-attention only
            assert all(is_ln(r.pre_norm) and not is_ln(r.post_norm) for r in layer.sublayers())


# ---------------------------------------------------------------- T-Fixup


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tfixup_init(arch):
    model = build("t_fixup", arch)
    cfg = ARCHS[arch]
    n = cfg["layers"] if arch != "decoder" else 0
    m = cfg["layers"] if arch == "decoder" else cfg.get("decoder_layers", 0)

    def gain(side, i, kind, name):
        if name not in ("v", "o", "w1", "w2"):
            return 1.0
        return 0.67 * n**-0.25 if side == "encoder" else (9 * m) ** -0.25

    assert check_gains(model, gain, dist="uniform") == n_matrices(arch)
    assert layer_norms(model) == []  # no LayerNorm anywhere
    if arch == "encoder_decoder":
        embeds = [(model.src_embed, n), (model.tgt_embed, m)]
    else:
        embeds = [(model.embed, n or m)]
    for emb, depth in embeds:
        want = D**-0.5 * (9 * depth) ** -0.25
        got = emb.tokens.weight.std().item()
        assert got == pytest.approx(want, rel=REL), f"token embedding std {got}, expected {want} (depth {depth})"


def test_tfixup_embeddings_differ_by_side():
    model = build("t_fixup", "encoder_decoder", layers=4, decoder_layers=1)
    src, tgt = model.src_embed.tokens.weight.std().item(), model.tgt_embed.tokens.weight.std().item()
    assert src == pytest.approx(D**-0.5 * 36**-0.25, rel=REL)
    assert tgt == pytest.approx(D**-0.5 * 9**-0.25, rel=REL)


# ---------------------------------------------------------------- DS-Init


@pytest.mark.parametrize("variant, power", [("paper", -0.5), ("code", -0.25)])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_ds_init(arch, variant, power):
    model = build("ds_init", arch, ds_init_variant=variant, **({"layers": 4} if arch != "encoder_decoder" else {}))
    seen = set()

    def gain(side, i, kind, name):
        seen.add((side, i))
        return i**power  # every matrix of layer i (1-based per side), Q and K included

    check_gains(model, gain, dist="uniform")
    if arch == "encoder_decoder":  # counted separately per side: each restarts at 1
        assert {("encoder", 1), ("decoder", 1), ("decoder", 3)} <= seen
    assert all(is_ln(r.post_norm) for s in model.stacks() for l in s.layers for r in l.sublayers())


def test_ds_init_bound_by_hand():
    """Layer 4 of the paper variant: U(-r/2, r/2), r = sqrt(6 / (256 + 1024))."""
    model = build("ds_init", "encoder", layers=4)
    w = model.encoder.layers[3].ffn.branch.fc1.weight
    r = math.sqrt(6 / (256 + 1024))
    assert w.abs().max().item() <= r / 2 * (1 + 1e-6)
    assert w.abs().max().item() > r / 2 * 0.98


# ---------------------------------------------------------------- Admin


def admin_omega(n: int) -> float:
    return math.sqrt((n + 1) / math.log(n + 1) - 1)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_admin_default_omega(arch):
    model = build("admin", arch)
    cfg = ARCHS[arch]
    sublayers = {
        "encoder": {"encoder": 2 * cfg["layers"]},
        "decoder": {"decoder": 2 * cfg["layers"]},
        "encoder_decoder": {"encoder": 2 * cfg["layers"], "decoder": 3 * cfg.get("decoder_layers", 0)},
    }[arch]
    count = 0
    for stack in model.stacks():
        want = admin_omega(sublayers[stack.side])
        for layer in stack.layers:
            for res in layer.sublayers():
                omega = res.shortcut.omega
                assert omega.shape == (D,) and omega.requires_grad
                assert torch.allclose(omega, torch.full((D,), want))
                assert is_ln(res.post_norm) and not is_ln(res.pre_norm)
                count += 1
    assert count == sum(sublayers.values())
    check_gains(model, lambda *a: 1.0)  # Admin keeps plain Xavier


def test_admin_omega_by_hand():
    # 6-layer encoder: n = 12, omega = sqrt(13 / ln 13 - 1)
    model = build_model(dict(arch="encoder", scheme="admin", layers=6, width=16, heads=2, ffn=32, max_len=8))
    assert model.encoder.layers[0].self_attn.shortcut.omega[0].item() == pytest.approx(math.sqrt(13 / math.log(13) - 1))
    assert model.encoder.layers[0].self_attn.shortcut.omega[0].item() == pytest.approx(2.01701, abs=1e-5)


@torch.no_grad()
def hand_admin_chain(model, src, tgt):
    """The profiling chain written out: returns [(Residual, expected w)], final ratio per side."""
    expected, final = [], {}
    x, ratio = model.src_embed(src), 1.0
    for layer in model.encoder.layers:
        for res, args in ((layer.self_attn, (None, None)), (layer.ffn, ())):
            y = res.branch(x, *args)
            expected.append((res, ratio))
            w = ratio
            ratio = math.sqrt(torch.var(w * x).item() + torch.var(y).item())
            x = res.post_norm(w * x + y)
    final["encoder"], memory = ratio, x
    x, ratio = model.tgt_embed(tgt), 1.0  # the decoder's chain restarts at 1
    for layer in model.decoder.layers:
        for res, args in ((layer.self_attn, (None, None)), (layer.cross_attn, (memory, None)), (layer.ffn, ())):
            y = res.branch(x, *args)
            expected.append((res, ratio))
            w = ratio
            ratio = math.sqrt(torch.var(w * x).item() + torch.var(y).item())
            x = res.post_norm(w * x + y)
    final["decoder"] = ratio
    return expected, final


def test_admin_profile_matches_hand_computation():
    torch.manual_seed(0)
    model = build_model(
        dict(
            arch="encoder_decoder",
            scheme="admin",
            admin_omega="profile",
            layers=3,
            decoder_layers=2,
            width=64,
            heads=4,
            ffn=256,
            vocab_size=100,
            max_len=32,
        )
    )
    src, tgt = torch.randint(0, 100, (4, 24)), torch.randint(0, 100, (4, 16))
    model.train()
    result = admin_profile(model, lambda: model(src, tgt))
    assert model.training  # restored
    expected, final = hand_admin_chain(model, src, tgt)
    assert len(expected) == 3 * 2 + 2 * 3
    assert expected[0][1] == 1.0 and expected[6][1] == 1.0
    for res, w in expected:
        omega = res.shortcut.omega
        assert torch.allclose(omega, torch.full_like(omega, w), rtol=1e-3), (res.site, w)
        assert not res.shortcut._forward_pre_hooks and not res.dropout._forward_hooks  # profiling hooks removed
    assert result["encoder"] == pytest.approx(final["encoder"], rel=1e-3)
    assert result["decoder"] == pytest.approx(final["decoder"], rel=1e-3)
    # after the first sublayer every input is a LayerNorm output (variance ~1), so the chain
    # ratio^2 <- ratio^2 + Var(F) grows strictly along each side
    for chain in (expected[1:6], expected[7:]):
        ws = [w for _, w in chain]
        assert all(a < b for a, b in zip(ws, ws[1:])), ws


def test_admin_profile_without_admin_is_a_no_op():
    model = build_model(dict(arch="encoder", scheme="post_ln", layers=1, width=16, heads=2, ffn=32, max_len=8))
    assert admin_profile(model, lambda: model(torch.zeros(1, 4, dtype=torch.long))) == {}


# ---------------------------------------------------------------- ReZero


@pytest.mark.parametrize("arch", list(ARCHS))
def test_rezero_init(arch):
    model = build("rezero", arch)
    assert layer_norms(model) == []
    for stack in model.stacks():
        assert stack.final_norm is None
        for layer in stack.layers:
            assert layer.resweight.shape == (1,) and layer.resweight.item() == 0.0
    # one scalar per layer: no other branch gains, no shortcut scale
    gains = [n for n, _ in model.named_parameters() if n.endswith("resweight")]
    assert len(gains) == sum(len(s.layers) for s in model.stacks())
    check_gains(model, lambda *a: 1.0)


def test_rezero_starts_as_identity_and_shares_the_scalar():
    torch.manual_seed(0)
    model = build_model(dict(arch="encoder", scheme="rezero", layers=2, width=32, heads=2, ffn=64, max_len=8))
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(tokens), model.embed(tokens))
        layer = model.encoder.layers[0]
        layer.resweight.fill_(0.5)
        x = model.embed(tokens)
        h = x + 0.5 * layer.self_attn.branch(x, None, None)
        want = h + 0.5 * layer.ffn.branch(h)
        assert torch.allclose(layer(x), want, atol=1e-6)


# ---------------------------------------------------------------- LayerScale


@pytest.mark.parametrize(
    "layers, want", [(1, 0.1), (12, 0.1), (18, 0.1), (19, 1e-5), (24, 1e-5), (25, 1e-6), (36, 1e-6)]
)
def test_layerscale_init_by_depth(layers, want):
    model = build_model(dict(arch="encoder", scheme="layerscale", layers=layers, width=16, heads=2, ffn=32, max_len=8))
    for layer in model.encoder.layers:
        for res in layer.sublayers():
            assert res.branch_scale.weight.shape == (16,)
            assert torch.allclose(res.branch_scale.weight, torch.full((16,), want))
            assert is_ln(res.pre_norm)


def test_layerscale_explicit_init_and_encoder_decoder_depth():
    model = build_model(
        dict(arch="encoder", scheme="layerscale", layers=30, layerscale_init=0.3, width=16, heads=2, ffn=32, max_len=8)
    )
    assert torch.allclose(model.encoder.layers[5].ffn.branch_scale.weight, torch.full((16,), 0.3))
    model = build_model(
        dict(
            arch="encoder_decoder",
            scheme="layerscale",
            layers=6,
            decoder_layers=20,
            width=16,
            heads=2,
            ffn=32,
            max_len=8,
        )
    )
    gains = torch.cat([r.branch_scale.weight for s in model.stacks() for l in s.layers for r in l.sublayers()])
    assert torch.allclose(gains, torch.full_like(gains, 1e-5))  # depth = the deeper side (20 layers)


# ---------------------------------------------------------------- plain Xavier schemes


@pytest.mark.parametrize("scheme", ["post_ln", "pre_ln", "sandwich_ln", "normformer"])
def test_plain_xavier(scheme):
    model = build(scheme, "encoder_decoder")
    assert check_gains(model, lambda *a: 1.0) == n_matrices("encoder_decoder")


def test_token_embedding_std_default():
    model = build("pre_ln", "encoder")
    assert model.embed.tokens.weight.std().item() == pytest.approx(D**-0.5, rel=REL)
