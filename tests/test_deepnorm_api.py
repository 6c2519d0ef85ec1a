"""DeepNorm (and every scheme whose parts sit in the residual) in a user's own modules: kilolayer.residual_scheme,
kilolayer.residual and kilolayer.init_branches (docs/models.md#deepnorm-in-your-own-modules).

The user-side blocks below are written as a user would: one with a fused Q/K/V projection (nanoGPT's layout,
K/V fused in cross-attention) and one with separate q_proj/k_proj/v_proj/out_proj (torchscale's names). Their
init is measured against DeepNet's rule, and models built from them are compared with build_model's on copied
weights. Init statistics use width 256 (FFN 1024): a 256x256 slice has 65,536 samples, so the tolerance (2.5%)
is many standard errors wide yet far below the gap between beta and 1 or between two sides' betas.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kilolayer
from kilolayer import ConfigError, build_model, deepnorm_constants, init_branches, residual, residual_scheme
from kilolayer.nn.residual import SCHEMES, Residual

D, H, FFN_WIDTH = 256, 4, 1024
REL = 0.025
VOCAB, MAX_LEN = 97, 16
DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"


# ---------------------------------------------------------------- a user's own modules


class FusedAttention(nn.Module):
    """Self-attention through one fused ``[Q; K; V]`` Linear; cross-attention through ``q`` and a fused ``[K; V]``."""

    def __init__(self, d: int, heads: int, causal: bool = False, cross: bool = False):
        super().__init__()
        self.heads, self.causal, self.cross = heads, causal, cross
        if cross:
            self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * d)
        else:
            self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, memory=None):
        if self.cross:
            q, (k, v) = self.q(x), self.kv(memory).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).flatten(2))


class SplitAttention(nn.Module):
    """Attention with separate q_proj, k_proj, v_proj and out_proj; cross-attention when given ``memory``."""

    def __init__(self, d: int, heads: int, causal: bool = False, cross: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, memory=None):
        kv = x if memory is None else memory
        q, k, v = (
            t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
            for t in (self.q_proj(x), self.k_proj(kv), self.v_proj(kv))
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(y.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def roles(attention: type, arch: str) -> dict[str, str]:
    """init_branches' roles for these modules (a pattern that matches nothing is an error: q/kv only with
    cross-attention)."""
    if attention is SplitAttention:
        return dict(q="q_proj", k="k_proj", v="v_proj", o="out_proj", w1="fc1", w2="fc2")
    cross = dict(q="q", kv="kv") if arch == "encoder_decoder" else {}
    return dict(qkv="qkv", o="out", w1="fc1", w2="fc2", **cross)


class UserLayer(nn.Module):
    def __init__(self, scheme, side, i, d, heads, ffn, attention, cross=False):
        super().__init__()
        causal = side == "decoder"

        def wrap(branch, kind):
            return residual(branch, d, scheme, kind=kind, layer=i, side=side)

        self.self_attn = wrap(attention(d, heads, causal=causal), "self_attn")
        self.cross_attn = wrap(attention(d, heads, cross=True), "cross_attn") if cross else None
        self.ffn = wrap(FeedForward(d, ffn), "ffn")

    def forward(self, x, memory=None):
        x = self.self_attn(x)
        if self.cross_attn is not None:
            x = self.cross_attn(x, memory=memory)
        return self.ffn(x)


class UserStack(nn.Module):
    """Token embedding + learned positions, the layers, and the scheme's final part (a pre-norm scheme's LN)."""

    def __init__(self, scheme, side, n, d, heads, ffn, attention, cross=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.positions = nn.Parameter(torch.randn(MAX_LEN, d))
        self.layers = nn.ModuleList(UserLayer(scheme, side, i, d, heads, ffn, attention, cross) for i in range(n))
        self.final = scheme.final_part(side, d, 1e-5) or nn.Identity()

    def forward(self, tokens, memory=None):
        x = self.embed(tokens) + self.positions[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, memory)
        return self.final(x)


class UserModel(nn.Module):
    """A user's encoder, decoder or encoder-decoder with an output head."""

    def __init__(self, scheme, attention, d=D, heads=H, ffn=FFN_WIDTH):
        super().__init__()
        depth = scheme.depth
        stack = dict(d=d, heads=heads, ffn=ffn, attention=attention)
        self.encoder = UserStack(scheme, "encoder", depth.N, **stack) if depth.N else None
        cross = depth.arch == "encoder_decoder"
        self.decoder = UserStack(scheme, "decoder", depth.M, cross=cross, **stack) if depth.M else None
        self.head = nn.Linear(d, VOCAB)

    def forward(self, *tokens):
        if self.encoder is None:
            return self.decoder(tokens[0])
        memory = self.encoder(tokens[0])
        return memory if self.decoder is None else self.decoder(tokens[1], memory)


SHAPES = {
    "encoder": dict(arch="encoder", encoder_layers=2),
    "decoder": dict(arch="decoder", decoder_layers=2),
    "encoder_decoder": dict(arch="encoder_decoder", encoder_layers=2, decoder_layers=3),
}


def user_model(scheme_name, arch, attention, seed=0, **dims):
    torch.manual_seed(seed)
    scheme = residual_scheme(scheme_name, **SHAPES[arch])
    return scheme, UserModel(scheme, attention, **dims)


def xavier_std(w: torch.Tensor, gain: float) -> float:
    fan_out, fan_in = w.shape
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


def role_weights(attn_or_ffn: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(weight, bias) per role, fused rows cut by hand, detached."""
    return {role: (w.detach(), b.detach()) for role, (w, b) in _role_weights(attn_or_ffn).items()}


def _role_weights(m: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(m, FeedForward):
        return {"w1": (m.fc1.weight, m.fc1.bias), "w2": (m.fc2.weight, m.fc2.bias)}
    if isinstance(m, SplitAttention):
        return {r: (p.weight, p.bias) for r, p in zip("qkvo", (m.q_proj, m.k_proj, m.v_proj, m.out_proj))}
    d = m.out.weight.shape[0]
    out = {"o": (m.out.weight, m.out.bias)}
    if m.cross:
        out["q"] = (m.q.weight, m.q.bias)
        out.update({r: (m.kv.weight[i * d : (i + 1) * d], m.kv.bias[i * d : (i + 1) * d]) for i, r in enumerate("kv")})
    else:
        out.update(
            {r: (m.qkv.weight[i * d : (i + 1) * d], m.qkv.bias[i * d : (i + 1) * d]) for i, r in enumerate("qkv")}
        )
    return out


# ---------------------------------------------------------------- the constants


def paper_table(arch, n, m):
    """DeepNet Figure 2(b) / section 4.3 (REFERENCE.md), written out term by term."""
    if arch == "encoder":
        return {"encoder": ((2 * n) ** 0.25, (8 * n) ** -0.25)}
    if arch == "decoder":
        return {"decoder": ((2 * m) ** 0.25, (8 * m) ** -0.25)}
    return {
        "encoder": (0.81 * n**0.25 * m**0.0625, 0.87 / (n**0.25 * m**0.0625)),
        "decoder": ((3 * m) ** 0.25, (12 * m) ** -0.25),
    }


@pytest.mark.parametrize(
    "arch,n,m", [("encoder", 6, 0), ("decoder", 0, 24), ("encoder_decoder", 100, 100), ("encoder_decoder", 18, 6)]
)
def test_a_users_residual_carries_the_papers_alpha_and_its_init_the_papers_beta(arch, n, m):
    scheme = residual_scheme("deepnorm", arch, encoder_layers=n, decoder_layers=m)
    table = paper_table(arch, n, m)
    assert {side: pytest.approx(c, rel=1e-12) for side, c in deepnorm_constants(arch, n, m).items()} == table
    for side, (alpha, beta) in table.items():
        kinds = ["self_attn", "ffn"] + (["cross_attn"] if arch == "encoder_decoder" and side == "decoder" else [])
        for kind in kinds:
            res = residual(nn.Linear(8, 8), 8, scheme, kind=kind, layer=0, side=side)
            assert res.alpha == pytest.approx(alpha, rel=1e-12)
            roles = ("w1", "w2") if kind == "ffn" else ("q", "k", "v", "o")
            gains = {r: scheme.init_gain(res.site, r) for r in roles}
            assert gains == {r: pytest.approx(beta if r in ("v", "o", "w1", "w2") else 1.0, rel=1e-12) for r in roles}
    if arch == "encoder_decoder" and n == m == 100:  # the paper's 100L-100L numbers (docs/models.md)
        assert table["encoder"][1] == pytest.approx(0.2063, abs=1e-4)
        assert table["decoder"] == (pytest.approx(4.1617, abs=1e-4), pytest.approx(0.1699, abs=1e-4))


# ---------------------------------------------------------------- the residual


def test_the_residual_computes_layernorm_of_alpha_times_x_plus_the_branch():
    torch.manual_seed(0)
    scheme = residual_scheme("deepnorm", "encoder", encoder_layers=100)
    branch = nn.Linear(32, 32)
    res = residual(branch, 32, scheme, kind="ffn", layer=7)
    with torch.no_grad():
        res.post_norm.weight.uniform_(0.5, 1.5)
        res.post_norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 5, 32)
    alpha = (2 * 100) ** 0.25
    ln = res.post_norm

    def norm(t):
        return F.layer_norm(t, (32,), ln.weight, ln.bias, ln.eps)

    want = norm(alpha * x + branch(x))
    torch.testing.assert_close(res(x), want, rtol=0, atol=1e-6)
    # alpha on the branch instead of the shortcut is a different function (a common porting slip)
    assert (res(x) - norm(x + alpha * branch(x))).abs().max() > 0.1


# ---------------------------------------------------------------- the init


@pytest.mark.parametrize("arch", list(SHAPES))
@pytest.mark.parametrize("attention", [FusedAttention, SplitAttention], ids=["fused_qkv", "separate_qkv"])
def test_a_users_blocks_start_with_the_papers_init_statistics(arch, attention):
    scheme, model = user_model("deepnorm", arch, attention)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if ".branch." not in name}
    assert any(name.startswith("head.") for name in before) and any("embed" in name for name in before)
    done = init_branches(model, scheme, **roles(attention, arch))

    shape = SHAPES[arch]
    constants = paper_table(arch, shape.get("encoder_layers", 0), shape.get("decoder_layers", 0))
    seen = 0
    for res in (m for m in model.modules() if isinstance(m, Residual)):
        beta = constants[res.site.side][1]
        for role, (w, b) in role_weights(res.branch).items():
            gain = beta if role in ("v", "o", "w1", "w2") else 1.0
            assert float(w.std()) == pytest.approx(xavier_std(w, gain), rel=REL), (res.site, role)
            assert abs(float(w.mean())) < 0.05 * xavier_std(w, gain), (res.site, role)
            assert torch.count_nonzero(b) == 0, (res.site, role)
            seen += 1
    assert seen == len(done)  # one entry per weight (fused slices counted apart), each with the gain it got
    assert sorted({gain for *_, gain in done}) == pytest.approx(sorted({1.0, *(b for _, b in constants.values())}))
    # everything outside the branches (embeddings, positions, LayerNorms, the head) is as it was
    after = {name: p for name, p in model.named_parameters() if ".branch." not in name}
    assert after.keys() == before.keys()
    for name, p in after.items():
        assert torch.equal(p, before[name]), name


def test_a_fused_qkv_gets_beta_on_its_value_third_only():
    scheme, model = user_model("deepnorm", "encoder", FusedAttention)
    done = init_branches(model, scheme, **roles(FusedAttention, "encoder"))
    qkv = model.encoder.layers[0].self_attn.branch.qkv.weight.detach()
    beta = scheme.constants["encoder"][1]
    stds = [float(qkv[i * D : (i + 1) * D].std()) for i in range(3)]
    assert stds == [pytest.approx(xavier_std(qkv[:D], g), rel=REL) for g in (1.0, 1.0, beta)]
    assert ("encoder.layers.0.self_attn.branch.qkv.weight[512:768]", "v", pytest.approx(beta)) in done


def test_roles_may_be_given_as_modules_and_lists():
    scheme, model = user_model("deepnorm", "decoder", SplitAttention)
    attn = [layer.self_attn.branch for layer in model.decoder.layers]
    ffn = [layer.ffn.branch for layer in model.decoder.layers]
    done = init_branches(
        model,
        scheme,
        q=[a.q_proj for a in attn],
        k=[a.k_proj.weight for a in attn],
        v="v_proj",
        o="out_*",
        w1=[f.fc1 for f in ffn],
        w2="fc2",
    )
    beta = scheme.constants["decoder"][1]
    assert {(name, role) for name, role, _ in done} == {
        (f"decoder.layers.{i}.{sub}.branch.{lin}.weight", role)
        for i in range(2)
        for sub, lin, role in [
            ("self_attn", "q_proj", "q"),
            ("self_attn", "k_proj", "k"),
            ("self_attn", "v_proj", "v"),
            ("self_attn", "out_proj", "o"),
            ("ffn", "fc1", "w1"),
            ("ffn", "fc2", "w2"),
        ]
    }
    assert {role: gain for _, role, gain in done} == pytest.approx(
        {"q": 1.0, "k": 1.0, "v": beta, "o": beta, "w1": beta, "w2": beta}
    )


def test_the_init_follows_each_schemes_own_gain_by_site():
    # post_ln_init scales layer l of n by 1/(n - l + 1): the gain follows the wrapper's layer index
    scheme, model = user_model("post_ln_init", "encoder_decoder", FusedAttention, d=32, ffn=64)
    done = dict(
        ((name, role), gain)
        for name, role, gain in init_branches(model, scheme, **roles(FusedAttention, "encoder_decoder"))
    )
    assert done["encoder.layers.0.ffn.branch.fc1.weight", "w1"] == pytest.approx(1 / 2)
    assert done["encoder.layers.1.ffn.branch.fc1.weight", "w1"] == pytest.approx(1.0)
    assert done["decoder.layers.0.cross_attn.branch.q.weight", "q"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------- equivalence with build_model


def copy_into(backbone: nn.Module, user: UserModel) -> None:
    """build_model's weights into the user's model: the residual parts as they are, Q/K/V split or kept fused."""

    def copy_embedding(embed, stack):
        stack.embed.weight.copy_(embed.tokens.weight)
        stack.positions.copy_(embed.positions)

    def copy_attention(mine, theirs):
        d = theirs.width
        if isinstance(mine, FusedAttention):
            mine.load_state_dict(theirs.state_dict())
            return
        fused = theirs.kv if theirs.cross else theirs.qkv
        parts = ["k_proj", "v_proj"] if theirs.cross else ["q_proj", "k_proj", "v_proj"]
        if theirs.cross:
            mine.q_proj.load_state_dict(theirs.q.state_dict())
        for i, name in enumerate(parts):
            getattr(mine, name).weight.copy_(fused.weight[i * d : (i + 1) * d])
            getattr(mine, name).bias.copy_(fused.bias[i * d : (i + 1) * d])
        mine.out_proj.load_state_dict(theirs.out.state_dict())

    def copy_stack(stack, user_stack):
        for layer, mine in zip(stack.layers, user_stack.layers, strict=True):
            for res, my_res in zip(layer.sublayers(), [m for m in mine.children() if isinstance(m, Residual)]):
                assert res.site == my_res.site
                keep = {k: v for k, v in res.state_dict().items() if not k.startswith("branch.")}
                my_res.load_state_dict({**my_res.state_dict(), **keep})
                if res.site.kind == "ffn":
                    my_res.branch.load_state_dict(res.branch.state_dict())
                else:
                    copy_attention(my_res.branch, res.branch)
        if stack.final_norm is not None:
            user_stack.final.load_state_dict(stack.final_norm.state_dict())

    with torch.no_grad():
        if hasattr(backbone, "src_embed"):
            copy_embedding(backbone.src_embed, user.encoder)
            copy_embedding(backbone.tgt_embed, user.decoder)
        else:
            copy_embedding(backbone.embed, user.encoder or user.decoder)
        for stack in backbone.stacks():
            copy_stack(stack, getattr(user, stack.side))


def kilolayer_model(scheme_name, arch, d=32, heads=4, ffn=64, **options):
    shape = SHAPES[arch]
    cfg = dict(
        arch=arch,
        scheme=scheme_name,
        layers=shape.get("encoder_layers") or shape.get("decoder_layers"),
        width=d,
        heads=heads,
        ffn=ffn,
        vocab_size=VOCAB,
        max_len=MAX_LEN,
        **options,
    )
    if arch == "encoder_decoder":
        cfg["decoder_layers"] = shape["decoder_layers"]
    torch.manual_seed(1)
    return build_model(cfg)


# every scheme whose parts all sit in the residual sublayer and the init of its weights
WRAPPABLE = [
    "admin",
    "deepnorm",
    "ds_init",
    "layerscale",
    "post_ln",
    "post_ln_init",
    "pre_ln",
    "sandwich_ln",
    "t_fixup",
]


@pytest.mark.parametrize("arch", list(SHAPES))
@pytest.mark.parametrize("attention", [FusedAttention, SplitAttention], ids=["fused_qkv", "separate_qkv"])
@pytest.mark.parametrize("scheme_name", ["deepnorm", "pre_ln"])
def test_a_model_of_user_blocks_equals_build_models_on_copied_weights(scheme_name, arch, attention):
    backbone = kilolayer_model(scheme_name, arch).eval()
    scheme, user = user_model(scheme_name, arch, attention, d=32, heads=4, ffn=64)
    init_branches(user, scheme, **roles(attention, arch))
    copy_into(backbone, user)
    user.eval()
    torch.manual_seed(2)
    inputs = [torch.randint(0, VOCAB, (3, 9))] + (
        [torch.randint(0, VOCAB, (3, 7))] if arch == "encoder_decoder" else []
    )
    with torch.no_grad():
        want, got = backbone(*inputs), user(*inputs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # the residuals themselves are the same: DeepNorm's alpha per side, the same norms
    mine = [(m.site, m.alpha, type(m.post_norm), type(m.pre_norm)) for m in user.modules() if isinstance(m, Residual)]
    theirs = [
        (m.site, m.alpha, type(m.post_norm), type(m.pre_norm)) for m in backbone.modules() if isinstance(m, Residual)
    ]
    assert sorted(mine, key=str) == sorted(theirs, key=str)


@pytest.mark.parametrize("scheme_name", WRAPPABLE)
def test_every_scheme_whose_parts_sit_in_the_residual_matches_build_model(scheme_name):
    backbone = kilolayer_model(scheme_name, "encoder_decoder").eval()
    scheme, user = user_model(scheme_name, "encoder_decoder", FusedAttention, d=32, heads=4, ffn=64)
    copy_into(backbone, user)
    user.eval()
    torch.manual_seed(2)
    src, tgt = torch.randint(0, VOCAB, (2, 9)), torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(user(src, tgt), backbone(src, tgt), rtol=0, atol=1e-6)


def test_schemes_with_parts_outside_the_residual_are_refused_with_what_they_need():
    refused = set()
    for name in SCHEMES:
        for options in ({}, {"admin_omega": "profile"}) if name == "admin" else ({},):
            scheme = residual_scheme(name, "encoder", encoder_layers=2, **options)
            try:
                for kind in ("self_attn", "ffn"):
                    residual(nn.Identity(), 8, scheme, kind=kind, layer=0)
            except ConfigError as e:
                assert str(e).startswith(f"scheme={name!r} at {kind} needs "), str(e)
                refused.add(name + ("(profile)" if options else ""))
    assert sorted(refused) == ["admin(profile)", "branchnorm", "dlcl", "normformer", "r_fixup", "rezero", "sub_ln"]
    assert sorted(set(SCHEMES) - refused) == WRAPPABLE


# ---------------------------------------------------------------- errors


def test_bad_arguments_are_one_line_errors_naming_the_argument():
    deepnorm = residual_scheme("deepnorm", "encoder_decoder", encoder_layers=2, decoder_layers=2)
    encoder = residual_scheme("deepnorm", "encoder", encoder_layers=2)
    cases = [
        (lambda: residual_scheme("deepnrom", "encoder", 2), r"^name='deepnrom': unknown residual scheme; allowed: "),
        (lambda: residual_scheme("deepnorm", "encoder_only", 2), r"^arch='encoder_only': expected one of "),
        (lambda: residual_scheme("deepnorm", "decoder", 2), r"^decoder_layers=0: "),
        (lambda: residual_scheme("deepnorm", "encoder", 2, 3), r"^decoder_layers=3: an encoder has no decoder"),
        (lambda: residual_scheme("layerscale", "encoder", 2, layerscale=0.1), r"^layerscale: not a scheme option"),
        (lambda: residual(nn.Identity(), 8, "deepnorm", kind="ffn", layer=0), r"^scheme: expected a scheme from"),
        (lambda: residual(nn.Identity(), 8, encoder, kind="mlp", layer=0), r"^kind='mlp': expected one of "),
        (lambda: residual(nn.Identity(), 8, encoder, kind="ffn", layer=2), r"^layer=2: expected an int in 0..1 "),
        (lambda: residual(nn.Identity(), 8, deepnorm, kind="ffn", layer=0), r"^side: expected 'encoder' or 'decoder'"),
        (lambda: residual(nn.Identity(), 8, encoder, kind="cross_attn", layer=0), r"^kind='cross_attn': only the "),
        (lambda: residual(nn.Identity(), 8, encoder, kind="ffn", layer=0, side="decoder"), r"^side='decoder': "),
        (lambda: residual(lambda x: x, 8, encoder, kind="ffn", layer=0), r"^branch: expected an nn.Module"),
        (lambda: init_branches(nn.Linear(2, 2), encoder, w1="weight"), r"^module: contains no residual sublayer"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


def init_errors():
    scheme, model = user_model("deepnorm", "encoder", FusedAttention, d=8, heads=2, ffn=16)
    roles = dict(qkv="qkv", o="out", w1="fc1", w2="fc2")
    yield lambda: init_branches(model, scheme, **{**roles, "qkv": "qvk"}), r"^qkv='qvk': matches no nn.Linear or 2-D "
    yield lambda: init_branches(model, scheme, **{**roles, "w2": "out"}), r"^w2='out': matches no .* in any FFN "
    # the value projection must not be skipped: every attention branch needs Q, K, V and O
    yield lambda: init_branches(model, scheme, q="qkv", o="out", w1="fc1", w2="fc2"), r"^k: the self_attn branch of "
    yield lambda: init_branches(model, scheme, **{**roles, "w1": "fc*"}), r"^w2: .*fc2.weight is already given as w1"
    yield lambda: init_branches(model, scheme, **{**roles, "o": 3}), r"^o: expected a name pattern, an nn.Linear"
    odd = FusedAttention(8, 2)
    odd.qkv = nn.Linear(8, 20)
    model.encoder.layers[0].self_attn.branch = odd
    yield lambda: init_branches(model, scheme, **roles), r"^qkv='qkv': a fused Q/K/V weight needs a row count divisible"


def test_bad_roles_are_one_line_errors_naming_the_role():
    for call, message in init_errors():
        with pytest.raises(ConfigError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the documented example


def test_the_documented_example_runs_and_initialises_as_deepnorm():
    code = re.search(r"<!-- example: own_modules -->\n```python\n(.*?)```", DOCS.read_text(), re.S)
    assert code, "docs/models.md: no block marked <!-- example: own_modules -->"
    line = DOCS.read_text().count("\n", 0, code.start(1))
    namespace: dict = {"__name__": "docs_models_own_modules"}
    torch.manual_seed(0)
    exec(compile("\n" * line + code.group(1), str(DOCS), "exec"), namespace)
    model, hidden = namespace["model"], namespace["hidden"]
    assert hidden.shape == (2, 10, 64)
    alpha, beta = deepnorm_constants("encoder", encoder_layers=12)["encoder"]
    residuals = [m for m in model.modules() if isinstance(m, Residual)]
    assert len(residuals) == 24 and all(r.alpha == pytest.approx(alpha) for r in residuals)
    # V rows of every layer's fused in_proj_weight, pooled: beta x Xavier; Q rows gain 1
    attn = [r.branch for r in residuals if r.site.kind == "self_attn"]
    v = torch.cat([a.in_proj_weight.detach()[128:] for a in attn])
    q = torch.cat([a.in_proj_weight.detach()[:64] for a in attn])
    assert float(v.std()) == pytest.approx(beta * math.sqrt(2 / 128), rel=0.03)
    assert float(q.std()) == pytest.approx(math.sqrt(2 / 128), rel=0.03)
    assert float(model[0].weight.detach().std()) == pytest.approx(1.0, rel=0.03)  # nn.Embedding's own N(0, 1)
    assert kilolayer.init_branches is init_branches


# ---------------------------------------------------------------- weights no role names, layouts, widths


class GatedFFN(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, ffn), nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Conv1DAttention(nn.Module):
    """GPT-2's attention projections: ``Conv1D`` weights stored ``(in, out)``, Q/K/V fused in ``c_attn``."""

    def __init__(self, d: int):
        super().__init__()
        self.c_attn, self.c_attn_bias = nn.Parameter(torch.zeros(d, 3 * d)), nn.Parameter(torch.zeros(3 * d))
        self.c_proj = nn.Parameter(torch.zeros(d, d))

    def forward(self, x):
        q, k, v = (x @ self.c_attn + self.c_attn_bias).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v) @ self.c_proj


def test_a_branch_weight_no_role_names_is_refused_and_a_gated_ffn_takes_both_gates_as_w1():
    scheme = residual_scheme("deepnorm", "encoder", encoder_layers=1)
    ffn = GatedFFN(D, FFN_WIDTH)
    model = nn.Sequential(residual(ffn, D, scheme, kind="ffn", layer=0))
    with pytest.raises(ConfigError, match=r"^0\.branch\.w3\.weight: a 2-D weight .* w1=\['w1', 'w3'\]") as e:
        init_branches(model, scheme, w1="w1", w2="w2")
    assert "\n" not in str(e.value)
    done = init_branches(model, scheme, w1=["w1", "w3"], w2="w2")
    beta = scheme.constants["encoder"][1]
    assert {name: role for name, role, _ in done}["0.branch.w3.weight"] == "w1"
    for w in (ffn.w1.weight.detach(), ffn.w3.weight.detach(), ffn.w2.weight.detach()):
        assert float(w.std()) == pytest.approx(xavier_std(w, beta), rel=REL)


def test_a_fused_qkv_stored_in_out_is_refused_untransposed_and_split_by_columns_when_transposed():
    d = 192  # rows divisible by 3: split by rows, a (d, 3d) weight would mix Q, K and V without a word
    scheme = residual_scheme("deepnorm", "encoder", encoder_layers=1)
    attn = Conv1DAttention(d)
    model = nn.Sequential(residual(attn, d, scheme, kind="self_attn", layer=0))
    with pytest.raises(ConfigError, match=r"^qkv='c_attn': .* shape \(192, 576\) is laid out \(in, out\).*transposed="):
        init_branches(model, scheme, qkv="c_attn", o="c_proj")
    assert torch.count_nonzero(attn.c_attn) == 0  # refused before any weight is touched
    done = init_branches(model, scheme, qkv="c_attn", o="c_proj", transposed=True)
    beta = scheme.constants["encoder"][1]
    std = xavier_std(attn.c_attn[:, :d].T, 1.0)
    thirds = [float(attn.c_attn[:, i * d : (i + 1) * d].std()) for i in range(3)]
    assert thirds == pytest.approx([std, std, beta * std], rel=REL)
    assert ("0.branch.c_attn[:, 384:576]", "v", pytest.approx(beta)) in done
    fused = nn.Sequential(residual(FusedAttention(d, H), d, scheme, kind="self_attn", layer=0))
    with pytest.raises(ConfigError, match=r"laid out \(out, in\); leave out transposed=True"):
        init_branches(fused, scheme, qkv="qkv", o="out", transposed=True)


def test_a_width_that_does_not_fit_the_branch_or_its_input_is_one_line():
    scheme = residual_scheme("deepnorm", "encoder", encoder_layers=1)
    with pytest.raises(ConfigError, match=r"^width=64: the branch \(Linear\) is 48 wide \(in_features=48\)"):
        residual(nn.Linear(48, 48), 64, scheme, kind="ffn", layer=0)
    res = residual(FeedForward(48, 96), 64, scheme, kind="ffn", layer=0)  # states no width: checked on input
    with pytest.raises(ConfigError, match=r"^width=64: the ffn residual of layer 0 got an input 48 wide") as e:
        res(torch.zeros(2, 3, 48))
    assert "\n" not in str(e.value)
    ok = residual(FeedForward(48, 96), 48, scheme, kind="ffn", layer=0)
    assert ok(torch.zeros(2, 3, 48)).shape == (2, 3, 48) and not ok._forward_pre_hooks  # the check ran once


@pytest.mark.parametrize("count", [12.7, True, "abc", -1])
def test_a_layer_count_that_is_not_a_non_negative_int_is_one_line(count):
    with pytest.raises(ConfigError, match=rf"^encoder_layers={re.escape(repr(count))}: expected a layer count"):
        residual_scheme("deepnorm", "encoder", encoder_layers=count)
