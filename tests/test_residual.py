"""The residual sublayer against each scheme's formula, `describe` against the init actually applied, and Admin's
profiling through its hooks (formulas: docs/deepnet.md)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kilolayer
import kilolayer.nn.layers as layers_module
from kilolayer import ConfigError, build_model
from kilolayer.nn import residual
from kilolayer.nn.residual import SCHEMES, Depth, Residual, Scheme, Site, make_scheme
from kilolayer.nn.transformer import data_dependent_init
from kilolayer.registry import Registry

ALL = [
    "admin",
    "branchnorm",
    "deepnorm",
    "dlcl",
    "ds_init",
    "layerscale",
    "normformer",
    "post_ln",
    "post_ln_init",
    "pre_ln",
    "r_fixup",
    "rezero",
    "sandwich_ln",
    "sub_ln",
    "t_fixup",
]


def test_one_registry_importable_from_everywhere():
    assert isinstance(SCHEMES, Registry) and kilolayer.SCHEMES is SCHEMES
    assert sorted(SCHEMES) == ALL and "deepnorm" in SCHEMES and SCHEMES["deepnorm"].name == "deepnorm"
    with pytest.raises(ConfigError, match=r"^model.scheme='deepnrom': unknown residual scheme; allowed: admin, "):
        make_scheme("deepnrom", Depth("encoder", 2))
    with pytest.raises(ConfigError, match=r"model.scheme='deepnrom': unknown residual scheme"):
        build_model(dict(scheme="deepnrom", layers=1, width=16, heads=2, ffn=32))


def test_a_scheme_added_in_one_place_builds(monkeypatch):
    monkeypatch.setattr(SCHEMES, "_items", dict(SCHEMES._items))  # this test's registration does not leak

    @SCHEMES.register()
    class Halved(Scheme):
        """A test scheme: x <- 0.5 x + F(x), gain 0.5 on W2."""

        name = "halved"

        def alpha(self, site):
            return 0.5

        def init_gain(self, site, weight):
            return 0.5 if weight == "w2" else 1.0

    model = build_model(dict(arch="encoder", scheme="halved", layers=1, width=16, heads=2, ffn=32, max_len=8))
    assert model.encoder.layers[0].ffn.alpha == 0.5


# ---------------------------------------------------------------- each scheme's forward is its formula

D, T = 8, 5


def ln(x, norm):
    return F.layer_norm(x, (D,), norm.weight, norm.bias, norm.eps)


BRANCHNORM_T = 4000  # model.branchnorm_steps by default


def branchnorm(y, step):
    """BranchNorm's rescaled branch: y (Var(y) + eps)^(-(1 - lambda) / 2), lambda = min(t / T, 1)."""
    lam = min(step / BRANCHNORM_T, 1.0)
    return y * (y.var(-1, unbiased=False, keepdim=True) + 1e-5) ** (-(1 - lam) / 2)


# every scheme's sublayer written out: x, f the branch, r the Residual (its norms and learned scales), alpha
# DeepNorm's constant from the table below, a the layer's ReZero scalar
FORMULAS = {
    "post_ln": lambda x, f, r, alpha, a: ln(x + f(x), r.post_norm),
    "post_ln_init": lambda x, f, r, alpha, a: ln(x + f(x), r.post_norm),
    "branchnorm": lambda x, f, r, alpha, a: ln(x + branchnorm(f(x), int(r.branch_scale.step)), r.post_norm),
    "dlcl": lambda x, f, r, alpha, a: x + f(ln(x, r.pre_norm)),
    "r_fixup": lambda x, f, r, alpha, a: x + r.branch_scale.weight * f(x + r.shift.bias),
    "ds_init": lambda x, f, r, alpha, a: ln(x + f(x), r.post_norm),
    "deepnorm": lambda x, f, r, alpha, a: ln(alpha * x + f(x), r.post_norm),
    "admin": lambda x, f, r, alpha, a: ln(r.shortcut.omega * x + f(x), r.post_norm),
    "pre_ln": lambda x, f, r, alpha, a: x + f(ln(x, r.pre_norm)),
    "sub_ln": lambda x, f, r, alpha, a: x + f(ln(x, r.pre_norm)),
    "sandwich_ln": lambda x, f, r, alpha, a: x + ln(f(ln(x, r.pre_norm)), r.out_norm),
    "normformer": lambda x, f, r, alpha, a: (
        x + (ln(f(ln(x, r.pre_norm)), r.out_norm) if r.site.kind == "self_attn" else f(ln(x, r.pre_norm)))
    ),
    "layerscale": lambda x, f, r, alpha, a: x + r.branch_scale.weight * f(ln(x, r.pre_norm)),
    "rezero": lambda x, f, r, alpha, a: x + a * f(x),
    "t_fixup": lambda x, f, r, alpha, a: x + f(x),
}


def deepnorm_alpha(arch: str, side: str, n: int, m: int) -> float:
    """DeepNet Table 1, typed in again here."""
    if arch == "encoder":
        return (2 * n) ** 0.25
    if arch == "decoder":
        return (2 * m) ** 0.25
    return 0.81 * (n**4 * m) ** (1 / 16) if side == "encoder" else (3 * m) ** 0.25


@pytest.mark.parametrize("scheme", ALL)
def test_each_scheme_forward_is_its_formula(scheme):
    assert set(FORMULAS) == set(SCHEMES)
    torch.manual_seed(0)
    n, m = 2, 3
    model = build_model(
        dict(arch="encoder_decoder", scheme=scheme, layers=n, decoder_layers=m, width=D, heads=2, ffn=16, max_len=8)
    )
    model.eval()
    with torch.no_grad():  # every learned scale, shift and norm away from its start, so a misplaced one shows
        for name, p in model.named_parameters():
            if any(part in name for part in ("norm", "branch_scale", "shortcut", "resweight", "shift")):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("branch_scale.step"):  # BranchNorm a quarter of the way through its schedule
                b.fill_(BRANCHNORM_T // 4)
    memory = torch.randn(2, 4, D)
    seen = set()
    for stack in model.stacks():
        for layer in stack.layers:
            for res in layer.sublayers():
                kind = res.site.kind
                inputs = {"memory": memory} if kind == "cross_attn" else {}
                alpha = deepnorm_alpha("encoder_decoder", stack.side, n, m)
                x = torch.randn(2, T, D)
                with torch.no_grad():
                    got = res(x, shared_scale=layer.resweight, **inputs)
                    f = lambda h: res.branch(h, **inputs)  # noqa: B023
                    want = FORMULAS[scheme](x, f, res, alpha, layer.resweight)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
                seen.add(kind)
    assert seen == {"self_attn", "cross_attn", "ffn"}


def test_deepnorm_residual_reads_like_the_paper():
    """x <- LN(alpha x + G(x)): the parts DeepNorm does not use are identities, the shortcut is alpha * x."""
    model = build_model(dict(arch="decoder", scheme="deepnorm", layers=4, width=D, heads=2, ffn=16, max_len=8))
    res = model.decoder.layers[0].ffn
    assert isinstance(res.pre_norm, nn.Identity) and isinstance(res.out_norm, nn.Identity)
    assert isinstance(res.branch_scale, nn.Identity) and isinstance(res.dropout, nn.Identity)
    assert isinstance(res.shortcut, residual.ScaledShortcut) and isinstance(res.post_norm, nn.LayerNorm)
    assert res.shortcut.alpha == pytest.approx(8**0.25) and res.alpha == res.shortcut.alpha
    x = torch.randn(3, D)
    assert torch.equal(res.shortcut(x), 8**0.25 * x)


def test_layers_pass_masks_by_keyword():
    torch.manual_seed(0)
    model = build_model(dict(arch="decoder", scheme="pre_ln", layers=1, width=D, heads=2, ffn=16, max_len=8))
    layer = model.decoder.layers[0]
    x = torch.randn(1, 4, D)
    mask = torch.tensor([[[[True, False, False, False]] * 4]])  # every query sees only token 0
    with torch.no_grad():
        h = layer.self_attn(x, mask=mask)
        v = layer.self_attn.branch(layer.self_attn.pre_norm(x), mask=mask)
    assert torch.allclose(v, v[:, :1].expand_as(v), atol=1e-6)  # the mask reached the attention
    assert torch.allclose(h, x + v, atol=1e-6)


# ---------------------------------------------------------------- describe reads what the init applies


def recorded_init(monkeypatch, cfg) -> tuple[nn.Module, dict]:
    """Build ``cfg`` and record the Xavier gain applied to every (side, layer, kind, weight)."""
    applied = {}
    real = layers_module.xavier_

    def spy(weight, gain, dist="normal"):
        applied[len(applied)] = gain
        real(weight, gain, dist)

    sites = []
    real_reset = layers_module.Layer.reset_parameters

    def reset(self, scheme):
        for res in self.sublayers():
            for name, _, _ in res.branch.weights():
                sites.append((res.site.side, res.site.layer, res.site.kind, name))
        real_reset(self, scheme)

    monkeypatch.setattr(layers_module, "xavier_", spy)
    monkeypatch.setattr(layers_module.Layer, "reset_parameters", reset)
    torch.manual_seed(0)
    model = build_model(cfg)
    assert len(sites) == len(applied)
    return model, {site: applied[i] for i, site in enumerate(sites)}


def residuals(model, side):
    return [
        res for stack in model.stacks() if stack.side == side for layer in stack.layers for res in layer.sublayers()
    ]


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder_decoder"])
@pytest.mark.parametrize("scheme", ALL)
def test_describe_equals_the_init_applied(monkeypatch, scheme, arch):
    width = 64
    cfg = dict(arch=arch, scheme=scheme, layers=3, width=width, heads=2, ffn=128, vocab_size=512, max_len=8)
    if arch == "encoder_decoder":
        cfg["decoder_layers"] = 5
    model, gains = recorded_init(monkeypatch, cfg)
    described = model.scheme.describe()
    assert described or scheme not in ("deepnorm", "sub_ln", "t_fixup", "admin", "layerscale")
    for side, consts in described.items():
        sides = model.scheme.depth.sides() if side == "all" else [side]
        for key, value in consts.items():
            for s in sides:
                if key == "alpha":  # DeepNorm's fixed shortcut scale on every sublayer of the side
                    assert {res.alpha for res in residuals(model, s)} == {value}
                elif key == "omega":  # Admin's learned shortcut scale at its start
                    omegas = torch.cat([res.shortcut.omega for res in residuals(model, s)])
                    assert torch.all(omegas == torch.tensor(value, dtype=torch.float32))
                elif key == "init":  # LayerScale's branch scale at its start
                    scales = torch.cat([res.branch_scale.weight for res in residuals(model, s)])
                    assert torch.all(scales == torch.tensor(value, dtype=torch.float32))
                elif key in ("beta", "gamma", "scale"):  # the Xavier gain of V, O, W1, W2
                    kinds = ("self_attn", "ffn") if key == "gamma" else ("self_attn", "cross_attn", "ffn")
                    got = {
                        g
                        for (sd, _, kind, w), g in gains.items()
                        if sd == s and kind in kinds and w in ("v", "o", "w1", "w2")
                    }
                    assert got == {value}, (key, s, got)
                elif key == "embed":  # T-Fixup's factor on the token embedding's width^-1/2 std
                    embed = (
                        {"encoder": "src_embed", "decoder": "tgt_embed"}[s] if arch == "encoder_decoder" else "embed"
                    )
                    std = getattr(model, embed).tokens.weight.std().item()
                    assert std == pytest.approx(width**-0.5 * value, rel=0.03)
                elif key == "k_1":  # Post-LN-init's divisor of the bottom layer: every weight of it
                    got = {g for (sd, layer, _, _), g in gains.items() if sd == s and layer == 0}
                    assert got == {1 / value}, (s, got)
                elif key == "L":  # R-Fixup's count of residual branches, over the whole model
                    assert value == len(residuals(model, "encoder")) + len(residuals(model, "decoder"))
                elif key in ("qkv", "w1"):  # R-Fixup's gains (the last weight of each branch starts at 0)
                    names = ("q", "k", "v") if key == "qkv" else ("w1",)
                    assert {g for (sd, _, _, w), g in gains.items() if sd == s and w in names} == {value}
                    assert {g for (sd, _, _, w), g in gains.items() if sd == s and w in ("o", "w2")} == {0.0}
                elif key == "W_l,k":  # DLCL's combination weights: layer l + 1 reads the average of l + 1 outputs
                    assert value == "1/(l+1)"
                    for stack in model.stacks():
                        starts = [w.detach() for w in stack.history.weights]
                        assert [len(w) for w in starts] == list(range(1, len(stack.layers) + 2))
                        assert all(torch.equal(w, torch.full_like(w, 1 / len(w))) for w in starts)
                elif key == "T":  # BranchNorm's schedule length, on every sublayer
                    assert {res.branch_scale.steps for res in residuals(model, s)} == {value}
                else:
                    pytest.fail(f"{scheme}.describe() reports {key!r}, which this test cannot check against the init")


# ---------------------------------------------------------------- Admin's profiled omega

ADMIN = dict(
    arch="encoder_decoder",
    scheme="admin",
    admin_omega="profile",
    layers=2,
    decoder_layers=2,
    width=32,
    heads=2,
    ffn=64,
    vocab_size=50,
    max_len=16,
)

# measured with the profiling code before it moved into hooks (kilolayer f81b2ed), same seeds
PINNED_OMEGA = {
    "encoder.layers.0.self_attn": 1.0,
    "encoder.layers.0.ffn": 0.25821760296821594,
    "encoder.layers.1.self_attn": 0.6391686201095581,
    "encoder.layers.1.ffn": 0.9418634176254272,
    "decoder.layers.0.self_attn": 1.0,
    "decoder.layers.0.cross_attn": 0.30343708395957947,
    "decoder.layers.0.ffn": 0.695321261882782,
    "decoder.layers.1.self_attn": 0.8476425409317017,
    "decoder.layers.1.cross_attn": 1.2094331979751587,
    "decoder.layers.1.ffn": 1.376928687095642,
}
PINNED_FINAL = {"encoder": 1.0944220385635406, "decoder": 1.5081722443093482}


def admin_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (3, 9), generator=g), torch.randint(0, 50, (3, 6), generator=g)


def test_admin_profile_through_hooks_gives_the_pinned_omega():
    torch.manual_seed(0)
    model = build_model(ADMIN)
    src, tgt = admin_batch()
    final = data_dependent_init(model, lambda: model(src, tgt))
    assert final == pytest.approx(PINNED_FINAL, rel=1e-6)
    for name, res in model.named_modules():
        if isinstance(res, Residual):
            omega = res.shortcut.omega
            assert torch.all(omega == omega[0]) and omega[0].item() == pytest.approx(PINNED_OMEGA[name], rel=1e-6)
            assert not res.shortcut._forward_pre_hooks and not res.dropout._forward_hooks  # hooks removed
    assert model.training  # the profile ran in eval mode and restored training mode


def test_data_dependent_init_is_a_no_op_for_other_schemes():
    calls = []
    for scheme, extra in (("deepnorm", {}), ("admin", {})):  # admin with the default omega measures nothing
        model = build_model(dict(arch="encoder", scheme=scheme, layers=2, width=16, heads=2, ffn=32, **extra))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert data_dependent_init(model, lambda: calls.append(1)) is None
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert calls == []


def test_unprofiled_admin_refuses_to_train():
    torch.manual_seed(0)
    model = build_model(ADMIN)
    src, tgt = admin_batch()
    with pytest.raises(ConfigError) as e:
        model(src, tgt)  # a training forward: built with admin_omega=profile, never profiled
    message = str(e.value)
    assert "\n" not in message and "kilolayer.nn.transformer.data_dependent_init" in message
    assert "model.admin_omega=profile" in message
    model.eval()
    model(src, tgt)  # evaluating (analysis of a built model) is allowed
    with torch.no_grad():
        model.train()(src, tgt)
    model.train()
    data_dependent_init(model, lambda: model(src, tgt))
    model(src, tgt).sum().backward()  # profiled: trains


def test_loaded_weights_count_as_profiled():
    """A resumed or pretrained model takes omega from its weights, so it may train without profiling."""
    torch.manual_seed(0)
    profiled = build_model(ADMIN)
    src, tgt = admin_batch()
    data_dependent_init(profiled, lambda: profiled(src, tgt))
    fresh = build_model(ADMIN)
    fresh.load_state_dict(profiled.state_dict())
    fresh(src, tgt).sum().backward()
    partial = build_model(ADMIN)
    state = {k: v for k, v in profiled.state_dict().items() if not k.endswith("shortcut.omega")}
    partial.load_state_dict(state, strict=False)  # omega not loaded: still pending
    with pytest.raises(ConfigError, match="data_dependent_init"):
        partial(src, tgt)


def test_loaded_omega_is_not_profiled_again():
    """Fine-tuning from a profiled Admin model (init_from) keeps the omega it loaded."""
    torch.manual_seed(0)
    profiled = build_model(ADMIN)
    src, tgt = admin_batch()
    data_dependent_init(profiled, lambda: profiled(src, tgt))
    with torch.no_grad():
        for m in profiled.modules():
            if isinstance(m, Residual):
                m.shortcut.omega.fill_(0.5)  # as if trained away from the profile
    fresh = build_model(ADMIN)
    fresh.load_state_dict(profiled.state_dict())
    calls = []
    assert data_dependent_init(fresh, lambda: calls.append(1) or fresh(src, tgt)) is None and calls == []
    assert all(torch.all(m.shortcut.omega == 0.5) for m in fresh.modules() if isinstance(m, Residual))


def test_every_backbone_of_a_task_is_profiled():
    """A module holding several Admin backbones (a CLIP task's two towers) profiles each of them."""
    torch.manual_seed(0)
    towers = torch.nn.ModuleDict({"a": build_model(ADMIN), "b": build_model(ADMIN)})
    src, tgt = admin_batch()
    found = data_dependent_init(towers, lambda: (towers["a"](src, tgt), towers["b"](src, tgt)))
    assert set(found) == {"a", "b"}
    towers["a"](src, tgt).sum().backward()
    towers["b"](src, tgt).sum().backward()  # neither refuses to train


def test_the_trainer_profiles_admin(tmp_path):
    from kilolayer.train.checkpoint import read_weights
    from kilolayer.train.run import train

    config = {
        "model": {
            "arch": "decoder",
            "scheme": "admin",
            "admin_omega": "profile",
            "layers": 2,
            "width": 32,
            "heads": 2,
            "ffn": 64,
            "vocab_size": 262,
            "max_len": 32,
        },
        "objective": {"name": "causal_lm"},
        "data": {"name": "stdlib_bytes", "options": {"seq_len": 32, "max_bytes": 50_000, "eval_windows": 4}},
        "train": {"steps": 1, "batch_size": 2, "lr": 1e-4, "log_every": 1},
    }
    train(config, tmp_path / "run", quiet=True)
    (ckpt,) = (tmp_path / "run" / "checkpoints").iterdir()
    weights = read_weights(ckpt / "model.safetensors")
    first = weights["backbone.decoder.layers.0.self_attn.shortcut.omega"]
    default = make_scheme("admin", Depth("decoder", 0, 2)).omega("decoder")
    assert default == pytest.approx(math.sqrt(5 / math.log(5) - 1))
    # the profiled chain starts at 1 (one step of lr 1e-4 moves it by about 1e-4), the default is 1.45
    assert torch.allclose(first, torch.ones_like(first), atol=1e-3)


def test_site_and_depth_helpers():
    depth = Depth("encoder_decoder", 2, 3)
    assert depth.sides() == ["encoder", "decoder"] and depth.sublayers("decoder") == 9
    assert Depth("decoder", 0, 4).sides() == ["decoder"]
    assert Site("encoder", 0, "ffn").kind == "ffn"
