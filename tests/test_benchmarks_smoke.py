"""Benchmarks in smoke mode (structure and sanity of their JSON, never timings), and the fast path's numbers.

The fast path must not change what the model computes beyond dtype rounding:
bf16 autocast against fp32 for every residual scheme, and activation
checkpointing against none (float64, exactly equal gradients).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import kilolayer
from kilolayer import build_model
from kilolayer.train.parallelize import checkpoint_layers

# benchmarks/ sits next to tests/ and is not an installed package: make it importable under any runner
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import memory, profile_step, run_all, train_step


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# ---------------------------------------------------------------- benchmark scripts (smoke mode)


@pytest.fixture(scope="module")
def train_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "train_step.json"
    assert train_step.main(["--smoke", "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def memory_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "memory.json"
    assert memory.main(["--smoke", "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def profile_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "profile.json"
    assert profile_step.main(["--smoke", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_train_step_json(train_result):
    r = train_result
    assert r["machine"]["cores"] >= 1 and r["machine"]["versions"]["torch"]
    assert _positive(r["peak_flops"]["fp32"]) and _positive(r["peak_flops"]["bf16"])
    (res,) = r["configs"].values()
    assert _positive(res["model_flops_per_token"]) and res["tokens_per_step"] == 2 * 16
    names = [v["name"] for v in res["variants"]]
    assert names == [v.name for v in train_step.VARIANTS]
    assert res["faster_peer"] in ("torchscale", "x-transformers")
    for v in res["variants"]:
        if v["peer"] != "kilolayer" or not v["options"]["compile"]:
            # everything but a compile that this machine may refuse must run
            assert "error" not in v, v.get("error")
        if "error" in v:
            assert isinstance(v["error"], str) and v["error"]
            continue
        for key in ("tokens_per_s", "step_ms", "model_tflops_per_s", "mfu", "ratio_vs_faster_peer"):
            assert _positive(v[key]), (v["name"], key, v[key])
        assert v["mfu"] < 1.5  # a model FLOP count off by a large factor would show here
        if v["options"]["compile"]:
            assert v["compile_s"] is not None and v["compile_s"] >= 0
    la = r["loss_agreement"]
    assert len(la["loss_fp32"]) == len(la["loss_fast"]) == la["steps"]
    assert all(math.isfinite(x) for x in la["loss_fp32"] + la["loss_fast"])
    assert la["agree"] is True


def test_model_flops_match_the_formula():
    """6 N T + 12 L d T^2 (+ 6 d V T for the head), per token, for a decoder-only spec."""
    from benchmarks.peers import Spec, model_flops_per_token

    s = Spec(width=32, layers=3, heads=2, ffn=64, seq_len=16, vocab=50)
    n_matmul = s.layers * (4 * s.width**2 + 2 * s.width * s.ffn)
    want = 6 * n_matmul + 12 * s.layers * s.width * s.seq_len + 6 * s.width * s.vocab
    assert model_flops_per_token(s) == pytest.approx(want)


def test_peers_build_identical_shapes():
    """Same matmul parameters in all three (biases and norm betas are the only differences)."""
    from benchmarks.peers import Spec, build

    s = Spec(width=32, layers=2, heads=2, ffn=64, seq_len=8, vocab=40)
    tokens = torch.randint(0, 40, (2, 8))
    for peer in ("kilolayer", "torchscale", "x-transformers"):
        model = build(peer, s)
        assert model(tokens).shape == (2, 8, 40)
        mats = sum(
            p.numel()
            for n, p in model.named_parameters()
            if p.dim() == 2 and "emb" not in n and "positions" not in n and "pos" not in n
        )
        assert mats == s.layers * (4 * 32 * 32 + 2 * 32 * 64) + 32 * 40, peer


def test_memory_json(memory_result):
    r = memory_result
    assert r["rows"] and r["encoder_decoder"]
    for row in r["rows"] + r["encoder_decoder"]:
        assert "error" not in row, row.get("error")
        for key in ("peak_rss", "baseline_rss", "parameters", "step_s", "peak_gib"):
            assert _positive(row[key]), (row, key)
        assert row["peak_rss"] >= row["baseline_rss"]
    assert {(row["peer"], row["checkpoint"]) for row in r["rows"]} >= {("kilolayer", True), ("kilolayer", False)}


def test_profile_json(profile_result):
    for row in profile_result["rows"]:
        assert _positive(row["wall_ms_per_step"])
        assert set(row["share"]) == set(profile_step.KINDS)
        assert all(v >= 0 for v in row["share"].values())
        assert sum(row["share"].values()) >= 0.99  # host overhead is the remainder of the wall time


def test_run_all_writes_markdown(train_result, memory_result, profile_result, tmp_path):
    text = run_all.markdown(train_result, memory_result, profile_result, ["python -m benchmarks.run_all"], 1.0)
    assert "## Training-step throughput and MFU" in text and "## Peak memory vs depth" in text
    assert train_result["machine"]["cpu"] in text
    for target in run_all.targets(train_result, memory_result):
        assert isinstance(target["met"], bool) and target["measured"]


def test_scripts_have_help(capsys):
    for mod in (train_step, memory, profile_step, run_all):
        with pytest.raises(SystemExit) as exit_info:
            mod.main(["--help"])
        assert exit_info.value.code == 0
        assert "--out" in capsys.readouterr().out


# ---------------------------------------------------------------- the fast path keeps the numbers

# bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2% per op); through a few layers it compounds
# to ~1% on outputs and ~2% on the gradient as a whole (measured worst: 0.9% and 1.8%, NormFormer).
# Tiny gradients (NormFormer's head scales, ReZero's gains) only keep absolute precision, hence the second
# term of the per-tensor bound.
OUT_RTOL, GRAD_RTOL, TENSOR_RTOL, TENSOR_ATOL_OF_TOTAL = 0.03, 0.05, 0.05, 0.005


def _small(scheme: str, **extra) -> dict:
    return dict(
        arch="encoder_decoder",
        scheme=scheme,
        layers=3,
        decoder_layers=2,
        width=32,
        heads=2,
        ffn=64,
        vocab_size=32,
        max_len=16,
        **extra,
    )


def _forward_backward(model, src, tgt, proj, *, bf16: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(src, tgt)
    out = out.to(proj.dtype)
    (out * proj).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("scheme", sorted(kilolayer.SCHEMES))
def test_bf16_autocast_matches_fp32(scheme):
    """Encoder-decoder (self-, causal and cross-attention): output and every gradient within bf16 tolerance."""
    torch.manual_seed(0)
    model = build_model(_small(scheme))
    with torch.no_grad():  # ReZero's gains start at 0, which would hide its branches
        for name, p in model.named_parameters():
            if name.endswith("resweight"):
                p.fill_(0.5)
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(0, 32, (4, 16), generator=g), torch.randint(0, 32, (4, 12), generator=g)
    proj = torch.randn(4, 12, 32, generator=g)
    o32, g32 = _forward_backward(model, src, tgt, proj)
    o16, g16 = _forward_backward(model, src, tgt, proj, bf16=True)
    assert set(g16) == set(g32)
    assert (o16 - o32).norm() <= OUT_RTOL * o32.norm()
    flat32 = torch.cat([g.flatten() for g in g32.values()])
    flat16 = torch.cat([g16[n].flatten() for n in g32])
    assert (flat16 - flat32).norm() <= GRAD_RTOL * flat32.norm()
    for name in g32:
        err = (g16[name] - g32[name]).norm()
        assert err <= TENSOR_RTOL * g32[name].norm() + TENSOR_ATOL_OF_TOTAL * flat32.norm(), name


def test_bf16_attention_in_fp32_only_changes_rounding():
    """``attention_fp32_cpu`` off (bf16 SDPA) and on (fp32 SDPA) agree within bf16 tolerance."""
    torch.manual_seed(0)
    a = build_model(_small("deepnorm"))
    b = build_model(_small("deepnorm", attention_fp32_cpu=False))
    b.load_state_dict(a.state_dict())
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(0, 32, (4, 16), generator=g), torch.randint(0, 32, (4, 12), generator=g)
    proj = torch.randn(4, 12, 32, generator=g)
    oa, ga = _forward_backward(a, src, tgt, proj, bf16=True)
    ob, gb = _forward_backward(b, src, tgt, proj, bf16=True)
    assert (oa - ob).norm() <= OUT_RTOL * oa.norm()
    fa, fb = torch.cat([g.flatten() for g in ga.values()]), torch.cat([gb[n].flatten() for n in ga])
    assert (fa - fb).norm() <= GRAD_RTOL * fa.norm()
    # and in fp32 the switch changes nothing at all
    o1, g1 = _forward_backward(a, src, tgt, proj)
    o2, g2 = _forward_backward(b, src, tgt, proj)
    assert torch.equal(o1, o2) and all(torch.equal(g1[n], g2[n]) for n in g1)


@pytest.mark.parametrize(
    "arch,scheme",
    [("decoder", "deepnorm"), ("encoder", "pre_ln"), ("encoder_decoder", "deepnorm"), ("encoder_decoder", "admin")],
)
def test_activation_checkpointing_gives_identical_gradients(arch, scheme):
    """float64: recomputing each layer in the backward gives exactly the gradients of storing it."""
    cfg = dict(
        arch=arch,
        scheme=scheme,
        layers=3,
        decoder_layers=2 if arch == "encoder_decoder" else 0,
        width=32,
        heads=2,
        ffn=64,
        vocab_size=32,
        max_len=16,
    )
    torch.manual_seed(0)
    plain = build_model(cfg).double()
    ckpt = build_model(cfg).double()
    ckpt.load_state_dict(plain.state_dict())
    checkpoint_layers(ckpt)  # from outside the model, as the trainer's parallelize step does
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(0, 32, (4, 16), generator=g), torch.randint(0, 32, (4, 12), generator=g)
    pad = torch.zeros(4, 16, dtype=torch.bool)
    pad[0, -3:] = True  # a padding mask, so the masked path is recomputed too

    def grads(model):
        model.zero_grad(set_to_none=True)
        if arch == "encoder_decoder":
            out = model(src, tgt, src_padding_mask=pad)
        else:
            out = model(src, pad)
        proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        (out * proj).sum().backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    o1, g1 = grads(plain)
    o2, g2 = grads(ckpt)
    assert torch.equal(o1, o2)
    assert set(g1) == set(g2) and len(g1) > 0
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n
