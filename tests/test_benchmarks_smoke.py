"""Benchmarks in smoke mode (structure and sanity of their JSON, never timings), and the fast path's numbers.

The fast path runs in bf16 where the measured bf16 GEMM is at least as fast as fp32, else in fp32: the smoke
runs force each, and the reports are checked on results whose peaks are set to either kind of CPU.

The fast path must not change what the model computes beyond dtype rounding:
bf16 autocast against fp32 for every residual scheme, the loss of the fast path
under each ``train.compile`` mode against fp32's, and activation checkpointing
against none (float64, exactly equal gradients). ``train.compile`` takes
false, layers (true) or model, and the trainer compiles what it names.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from objective_helpers import tiny_decoder

import kilolayer
from kilolayer import build_model
from kilolayer.config import load_config
from kilolayer.errors import ConfigError
from kilolayer.train.host import heap as H
from kilolayer.train.parallelize import checkpoint_layers, transformer_layers

# benchmarks/ sits next to tests/ and is not an installed package: make it importable under any runner
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import common, gpu, heap, memory, profile_step, run_all, side_by_side, study_points, train_step


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# ---------------------------------------------------------------- benchmark scripts (smoke mode)


@pytest.fixture(scope="module")
def train_result(tmp_path_factory):
    """The race with the fast path forced to bf16 (what auto picks where bf16 is fast: AMX)."""
    out = tmp_path_factory.mktemp("bench") / "train_step.json"
    assert train_step.main(["--smoke", "--fast-precision", "bf16", "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def train_result_fp32(tmp_path_factory):
    """The race with the fast path forced to fp32 (what auto picks where bf16 is slower than fp32)."""
    out = tmp_path_factory.mktemp("bench") / "train_step_fp32.json"
    assert train_step.main(["--smoke", "--fast-precision", "fp32", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def gpu_smoke(out: Path, shapes: list[str], *extra: str) -> tuple[dict, list]:
    """``benchmarks.gpu --smoke --out OUT`` with ``shapes`` named (in that order) and ``extra`` arguments: its JSON,
    and what it handed over after each shape (the shape, the shapes in its result then, the shapes in OUT then)."""
    handed = []
    real_run = gpu.run

    def run(smoke, rounds, budget_min, configs, done):
        def spy(result, key):
            done(result, key)
            handed.append((key, list(result["configs"]), list(json.loads(out.read_text())["configs"])))

        return real_run(smoke, rounds, budget_min, configs, spy)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu, "run", run)
        named = [a for key in shapes for a in ("--config", key)]
        assert gpu.main(["--smoke", *named, *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text()), handed


#: the smoke shape the GPU script races in full here, each fast-path row compiled once (train_result compiles the
#: same rows in the CPU race); the hand-over test runs every smoke shape, cut short before any compile
GPU_SHAPE = next(iter(gpu.SMOKE_CONFIGS))


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    """``benchmarks.gpu --smoke --config GPU_SHAPE --out FILE``: its JSON."""
    return gpu_smoke(tmp_path_factory.mktemp("bench") / "gpu.json", [GPU_SHAPE])[0]


@pytest.fixture(scope="module")
def memory_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "memory.json"
    assert memory.main(["--smoke", "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def heap_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "heap.json"
    assert heap.main(["--smoke", "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def profile_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "profile.json"
    assert profile_step.main(["--smoke", "--out", str(out)]) == 0
    return json.loads(out.read_text())


# (library, compile mode) of every fast-path row: kilolayer and torchscale in both modes, x-transformers whole-model
FAST_ROWS = {
    ("kilolayer", "layers"),
    ("kilolayer", "model"),
    ("torchscale", "layers"),
    ("torchscale", "model"),
    ("x-transformers", "model"),
}


def _check_race(res: dict, ratios: tuple[str, ...], skipped: str | None = None) -> None:
    """One config's race: every row timed or carrying a one-line note; ratios, MFU, compile times sane.
    ``skipped``: the note of the rows not run (the bf16-only row where the fast path is fp32)."""
    assert _positive(res["model_flops_per_token"])
    assert res["best_peer_fast"] in {v["name"] for v in res["variants"] if v["peer"] != "kilolayer"}
    fast = {(v["peer"], v["options"]["compile"]) for v in res["variants"] if v["options"]["compile"]}
    assert fast == FAST_ROWS
    for v in res["variants"]:
        if not v["options"]["compile"] and v.get("error") != skipped:
            assert "error" not in v, v.get("error")  # only a compile may be refused (it becomes the row's note)
        if "error" in v:
            assert isinstance(v["error"], str) and v["error"] and "\n" not in v["error"]
            continue
        for key in ("tokens_per_s", "step_ms", "model_tflops_per_s", "mfu", *ratios):
            assert _positive(v[key]), (v["name"], key, v[key])
        if v["options"]["compile"]:
            assert v["compile_s"] is not None and v["compile_s"] >= 0
        else:
            assert v["compile_s"] is None
        if v["name"] == res["best_peer_fast"]:
            assert v["ratio_vs_best_peer_fast"] == 1.0


def _check_mfu(r: dict, res: dict) -> None:
    """Every timed row's MFU: training FLOPs / time / the peak of the precision the row runs in."""
    for v in res["variants"]:
        if "tokens_per_s" in v:
            peak = r["peak_flops"][v["options"]["precision"]]
            assert v["mfu"] == pytest.approx(v["tokens_per_s"] * res["model_flops_per_token"] / peak, rel=1e-9)


@pytest.mark.slow
def test_train_step_json(train_result):
    r = train_result
    assert r["machine"]["cores"] >= 1 and r["machine"]["versions"]["torch"]
    assert _positive(r["peak_flops"]["fp32"]) and _positive(r["peak_flops"]["bf16"])
    choice = r["fast_precision"]
    assert choice["precision"] == "bf16" and choice["requested"] == "bf16" and choice["skip_bf16"] is None
    assert choice["reason"].startswith("forced (--fast-precision bf16); measured bf16 GEMM ")
    (res,) = r["configs"].values()
    assert res["tokens_per_step"] == 2 * 16
    names = [v["name"] for v in res["variants"]]
    assert names == [v.name for v in train_step.VARIANTS] == [v.name for v in train_step.variants("bf16")]
    assert all(v["options"]["precision"] == "bf16" for v in res["variants"] if v["options"]["compile"])
    _check_mfu(r, res)
    assert res["faster_peer"] in ("torchscale", "x-transformers")
    _check_race(res, ("ratio_vs_faster_peer", "ratio_vs_best_peer_fast"))
    for v in res["variants"]:
        if "error" not in v:
            assert v["mfu"] < 1.5  # a model FLOP count off by a large factor would show here
    # the fast path under each compile mode against fp32, same seed and batches, after la["steps"] steps
    la = r["loss_agreement"]
    assert set(la["modes"]) == {"layers", "model"}
    assert len(la["loss_fp32"]) == la["steps"] and all(math.isfinite(x) for x in la["loss_fp32"])
    for mode, m in la["modes"].items():
        assert m["options"] == {"precision": "bf16", "compile": mode, "fused_optimizer": True}
        assert len(m["loss"]) == la["steps"] and all(math.isfinite(x) for x in m["loss"])
        assert m["final_rel_diff"] == pytest.approx(abs(m["loss"][-1] - la["loss_fp32"][-1]) / la["loss_fp32"][-1])
        assert m["final_rel_diff"] <= la["rtol"] == 0.02, mode
        assert m["agree"] is True, mode
    assert la["agree"] is True and la["precision"] == "bf16"


@pytest.mark.slow
def test_train_step_fp32_fast_path(train_result_fp32):
    """Forced fp32 (auto's choice where bf16 is slower): every library's fast path is fp32 + compile + fused
    AdamW, the bf16-only row is not run and says why, MFU is against the fp32 peak, the loss check is fp32's."""
    r = train_result_fp32
    choice = r["fast_precision"]
    assert choice["precision"] == "fp32" and choice["requested"] == "fp32"
    assert choice["reason"].startswith("forced (--fast-precision fp32); measured bf16 GEMM ")
    skip = choice["skip_bf16"]
    assert skip.startswith("skipped: ") and "\n" not in skip
    (res,) = r["configs"].values()
    assert [v["name"] for v in res["variants"]] == [v.name for v in train_step.variants("fp32")]
    _check_race(res, ("ratio_vs_faster_peer", "ratio_vs_best_peer_fast"), skipped=skip)
    (bf16,) = [v for v in res["variants"] if v["options"]["precision"] == "bf16"]
    assert bf16["name"] == "kilolayer bf16 + fused AdamW" and bf16["error"] == skip
    assert "tokens_per_s" not in bf16 and "mfu" not in bf16
    timed = [v for v in res["variants"] if "tokens_per_s" in v]
    assert len(timed) == len(res["variants"]) - 1
    assert all(v["options"]["precision"] == "fp32" for v in timed)
    assert {v["name"] for v in timed if v["options"]["compile"]} == {
        "kilolayer fast path (fp32 + per-layer compile + fused AdamW)",
        "kilolayer fast path (fp32 + whole-model compile + fused AdamW)",
        "x-transformers fast path (fp32 + whole-model compile + fused AdamW)",
        "torchscale fast path (fp32 + whole-model compile + fused AdamW)",
        "torchscale fast path (fp32 + per-layer compile + fused AdamW)",
    }
    for v in timed:
        peak = r["peak_flops"]["fp32"]
        assert v["mfu"] == pytest.approx(v["tokens_per_s"] * res["model_flops_per_token"] / peak, rel=1e-9)
    la = r["loss_agreement"]
    assert la["precision"] == "fp32" and la["agree"] is True
    for mode, m in la["modes"].items():
        assert m["options"] == {"precision": "fp32", "compile": mode, "fused_optimizer": True}
        assert len(m["loss"]) == la["steps"] and m["final_rel_diff"] <= la["rtol"]
    text = train_step.format_result(r)
    assert skip in text and "% of fp32" in text and "% of bf16" not in text
    assert "Fast path: fp32 + torch.compile + fused AdamW (forced (--fast-precision fp32)" in text
    assert "fast path (fp32), compile: layers" in text


SLOW_BF16 = {"fp32": 76e9, "bf16": 1.0e9}  # this AVX2-only EPYC: bf16 has no instructions
FAST_BF16 = {"fp32": 100e9, "bf16": 700e9}  # a CPU with AMX tiles


def test_the_fast_precision_follows_the_measured_peaks():
    slow = common.choose_fast_precision(SLOW_BF16, ["avx2"])
    assert slow["precision"] == "fp32" and slow["requested"] == "auto" and slow["bf16_slower"] is True
    assert slow["reason"] == "auto: bf16 GEMM 1.0 GFLOP/s vs fp32 76 GFLOP/s (0.013x); no bf16 instructions"
    assert slow["skip_bf16"] == "skipped: bf16 GEMM here is 1.0 GFLOP/s, 76x slower than fp32; no bf16 instructions"
    fast = common.choose_fast_precision(FAST_BF16, ["avx512f", "avx512_bf16", "amx_bf16", "amx_tile"])
    assert fast["precision"] == "bf16" and fast["skip_bf16"] is None
    assert fast["reason"].endswith("(7.0x); bf16 instructions: avx512_bf16, amx_bf16")
    assert common.choose_fast_precision({"fp32": 5e10, "bf16": 5e10}, [])["precision"] == "bf16"  # at least
    # forced either way, against the measurement
    assert common.choose_fast_precision(SLOW_BF16, ["avx2"], "bf16")["precision"] == "bf16"
    forced = common.choose_fast_precision(FAST_BF16, ["amx_bf16"], "fp32")
    assert forced["precision"] == "fp32" and forced["reason"].startswith("forced (--fast-precision fp32); ")
    assert forced["skip_bf16"] == "skipped: --fast-precision fp32 (bf16 GEMM here is 7.0x fp32's)"
    with pytest.raises(ValueError):
        common.choose_fast_precision(SLOW_BF16, [], "fp16")


@pytest.mark.parametrize(
    "peaks,requested,want", [(SLOW_BF16, "auto", "fp32"), (FAST_BF16, "auto", "bf16"), (SLOW_BF16, "bf16", "bf16")]
)
def test_the_race_runs_the_chosen_fast_path(monkeypatch, peaks, requested, want):
    """train_step's run: the rows and the loss check follow the choice made from the measured peaks."""
    raced, checked = [], []

    def fake_measure(spec, batch_size, rounds, variants, seed=0, backend="inductor", rematch_rounds=0):
        raced.append(variants)
        return {"variants": [], "model_flops_per_token": 1.0}

    def fake_loss(*args, precision, **kwargs):
        checked.append(precision)
        return {}

    monkeypatch.setattr(common, "measure_peaks", lambda n, seconds: (dict(peaks), {"fp32": n, "bf16": n}))
    monkeypatch.setattr(train_step, "measure", fake_measure)
    monkeypatch.setattr(train_step, "loss_agreement", fake_loss)
    r = train_step.run(smoke=True, fast_precision=requested, warm_cache=True)
    assert r["fast_precision"] == common.choose_fast_precision(peaks, r["machine"]["flags"], requested)
    assert r["fast_precision"]["precision"] == want and checked == [want]
    (rows,) = raced
    assert {v.options.precision for v in rows if v.options.fast} == {want}
    assert len([v for v in rows if v.options.fast]) == 5
    (bf16,) = [v for v in rows if v.name == "kilolayer bf16 + fused AdamW"]
    assert bf16.skip == r["fast_precision"]["skip_bf16"]
    assert (bf16.skip is None) == (want == "bf16")


def test_a_slow_bf16_gemm_is_measured_only_at_the_probe_size(monkeypatch):
    """Where a quick probe finds bf16 slower, its peak is the probe's: no bf16 product at 2048."""
    calls = []

    def fake_peak(dtype, n=2048, seconds=1.0, rounds=3):
        calls.append((dtype, n))
        return (1e9 if dtype == torch.bfloat16 else 70e9) * (1 if n <= 256 else 1.1)

    monkeypatch.setattr(common, "gemm_peak", fake_peak)
    peaks, sizes = common.measure_peaks(2048, 1.0)
    assert peaks == {"fp32": pytest.approx(77e9), "bf16": 1e9} and sizes == {"fp32": 2048, "bf16": 256}
    assert (torch.bfloat16, 2048) not in calls
    calls.clear()
    monkeypatch.setattr(common, "gemm_peak", lambda dtype, n=2048, seconds=1.0, rounds=3: calls.append(n) or 1e10)
    assert common.measure_peaks(2048, 1.0) == ({"fp32": 1e10, "bf16": 1e10}, {"fp32": 2048, "bf16": 2048})
    assert calls.count(2048) == 2  # bf16 as fast as fp32: both measured at full size


def _on_cpu(result: dict, peaks: dict, flags: list[str]) -> dict:
    """``result`` as if measured on a CPU with ``peaks`` and ``flags``, the fast precision chosen by auto."""
    r = copy.deepcopy(result)
    r["peak_flops"], r["machine"]["flags"] = dict(peaks), list(flags)
    r["fast_precision"] = common.choose_fast_precision(peaks, flags)
    return r


def _mfu_row(targets: list[dict]) -> dict:
    (row,) = [t for t in targets if "fast-path MFU >= 30% of the measured bf16 peak" in t["target"]]
    return row


def _best_kilolayer_fast(res: dict) -> dict:
    """kilolayer's compiled row with the highest MFU (what the MFU target reports)."""
    return max(
        (v for v in res["variants"] if v["peer"] == "kilolayer" and v["options"]["compile"] and "mfu" in v),
        key=lambda v: v["mfu"],
    )


@pytest.mark.integration
def test_reports_where_bf16_is_slower(train_result_fp32, memory_result, profile_result):
    """The MFU goal stays a share of the bf16 peak and is not met, saying why; no AMX, no bf16 autocast."""
    ts = _on_cpu(train_result_fp32, SLOW_BF16, ["avx2"])
    assert ts["fast_precision"]["precision"] == "fp32"
    targets = run_all.targets(ts, memory_result)
    mfu = _mfu_row(targets)
    (res,) = ts["configs"].values()
    best = _best_kilolayer_fast(res)
    assert mfu["met"] is False
    assert mfu["measured"] == (
        "not attainable on this CPU: bf16 GEMM 1.0 GFLOP/s vs fp32 76 GFLOP/s (no bf16 instructions); best "
        f"attainable: fp32 fast path {100 * best['mfu']:.0f}% of the fp32 peak (compile: {best['options']['compile']})"
    )
    race = next(t for t in targets if "best fast path >= 1.05x the best peer" in t["target"])
    assert "same fast path, fp32 + torch.compile + fused AdamW (" in race["target"]
    said = run_all.findings(ts, profile_result, memory_result)
    assert said[0] == (
        "This CPU's bf16 GEMM peak is 0.013x its fp32 peak (1.0 vs 76 GFLOP/s): bf16 has no hardware support here "
        "(no bf16 instructions), so the fast path runs in fp32 (torch.compile + fused AdamW, every library alike) "
        "and the bf16-only row is skipped."
    )
    text = "\n".join(said)
    assert "AMX" not in text and "bf16 autocast" not in text and "of the bf16 peak" not in text
    assert "same fast path (fp32 + torch.compile + fused AdamW)" in text
    assert "Fast path (fp32 + torch.compile + fused AdamW) vs eager fp32 after" in text
    md = run_all.markdown(ts, memory_result, profile_result, ["python -m benchmarks.run_all"], 1.0)
    assert "AMX" not in md and "`bf16` = CPU autocast" not in md
    assert (
        "- Fast path: fp32 + torch.compile + fused AdamW; precision fp32, chosen from the peaks measured before the "
        "race (auto: bf16 GEMM 1.0 GFLOP/s" in md
    )
    (skipped,) = [v for v in res["variants"] if v["options"]["precision"] == "bf16"]
    assert f"| {skipped['error']} |" in md and "not attainable on this CPU" in md


@pytest.mark.integration
def test_reports_where_bf16_is_fast(train_result, memory_result, profile_result):
    """bf16 peak 7x fp32's with AMX tiles: the fast path is bf16 and the reports read as they always did."""
    flags = ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    ts = _on_cpu(train_result, FAST_BF16, flags)
    assert ts["fast_precision"]["precision"] == "bf16"
    targets = run_all.targets(ts, memory_result)
    mfu = _mfu_row(targets)
    (res,) = ts["configs"].values()
    best = _best_kilolayer_fast(res)
    assert mfu["measured"] == f"{100 * best['mfu']:.0f}% (compile: {best['options']['compile']})"
    assert mfu["met"] == (best["mfu"] >= run_all.MFU_GOAL)
    race = next(t for t in targets if "best fast path >= 1.05x the best peer" in t["target"])
    assert "same fast path, bf16 autocast + torch.compile + fused AdamW (" in race["target"]
    said = run_all.findings(ts, profile_result, memory_result)
    assert said[0] == (
        "This CPU's bf16 GEMM peak is 7.0x its fp32 peak (AMX tiles); LayerNorm, GELU, residual adds, dtype casts, "
        "attention and the optimizer get no such speed-up, so bf16 MFU is bounded by how much of the step is not GEMM."
    )
    text = "\n".join(said)
    assert "+ bf16 autocast " in text and "of the bf16 peak" in text
    assert "same fast path (bf16 autocast + torch.compile + fused AdamW)" in text
    md = run_all.markdown(ts, memory_result, profile_result, ["python -m benchmarks.run_all"], 1.0)
    assert "`bf16` = CPU autocast" in md and "not attainable" not in md and "skipped: " not in md
    # the same CPU without AMX names the instructions it has instead
    plain = run_all.findings(_on_cpu(train_result, FAST_BF16, ["avx512_bf16"]), profile_result, memory_result)
    assert plain[0].startswith("This CPU's bf16 GEMM peak is 7.0x its fp32 peak (bf16 instructions: avx512_bf16);")


@pytest.mark.slow
def test_gpu_smoke_json(gpu_run):
    """``benchmarks.gpu --smoke``: the GPU race's code on a tiny model (here on the CPU)."""
    r = gpu_run
    assert r["smoke"] is True and r["compile_backend"] == "aot_eager"
    assert _positive(r["peak"]["flops"]["bf16"]) and r["peak"]["source"]["bf16"]
    assert set(r["configs"]) == {GPU_SHAPE}
    for res in r["configs"].values():
        assert [v["name"] for v in res["variants"]] == [v.name for v in gpu.VARIANTS]
        assert all(v["options"]["precision"] == "bf16" and v["options"]["fused_optimizer"] for v in res["variants"])
        assert res["faster_peer"] is None  # no eager peers on the GPU
        assert res["sdpa_backend"] == "cpu"  # on CUDA: the kernel PyTorch's chooser picks for the shape
        _check_race(res, ("ratio_vs_best_peer_fast",))
    text = gpu.format_result(r)
    assert "x best peer fast path" in text and "x faster peer" not in text
    assert "SDPA kernel: cpu" in text and "| peak GiB |" in text


def test_gpu_race_hands_over_each_shape_when_it_is_done(tmp_path):
    """A GPU run cut short by its host keeps what it finished: each shape's results are handed over (printed,
    and written to --out) as soon as that shape is done, with every shape finished so far. With a budget of 0
    minutes every row of every shape is skipped with the budget's note, none compiled."""
    second, first = gpu.SMOKE_CONFIGS  # in the order --config names them
    r, handed = gpu_smoke(tmp_path / "gpu.json", [first, second], "--budget-min", "0")
    assert handed == [(first, [first], [first]), (second, [first, second], [first, second])]
    assert list(r["configs"]) == [first, second]
    for res in r["configs"].values():
        assert [v["name"] for v in res["variants"]] == [v.name for v in gpu.VARIANTS]
        assert {v["error"] for v in res["variants"]} == {"skipped: the run's time budget was spent"}


def test_gpu_without_cuda_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "--smoke" in lines[0]


def test_a_refused_compile_is_a_note_not_a_crash():
    """x-transformers' layer list holds lists of modules: per-layer compile is refused in the row's note."""
    from benchmarks.common import FAST, fast_variant, race

    spec = train_step.SMOKE_CONFIGS["smoke"]
    res = race(spec, 2, 1, [fast_variant("x-transformers", FAST), train_step.VARIANTS[2]], backend="aot_eager")
    refused, eager = res["variants"]
    assert "per-layer compile" in refused["error"] and "tokens_per_s" not in refused
    assert _positive(eager["tokens_per_s"]) and res["best_peer_fast"] is None


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


@pytest.mark.integration
def test_memory_json(memory_result):
    r = memory_result
    assert r["rows"] and r["encoder_decoder"]
    for row in r["rows"] + r["encoder_decoder"]:
        assert "error" not in row, row.get("error")
        for key in ("peak_rss", "baseline_rss", "parameters", "step_s", "peak_gib"):
            assert _positive(row[key]), (row, key)
        assert row["peak_rss"] >= row["baseline_rss"]
    assert {(row["peer"], row["checkpoint"]) for row in r["rows"]} >= {("kilolayer", True), ("kilolayer", False)}
    # kilolayer's deepest checkpointed point is measured again without the heap trim and with the mmap pin (the
    # encoder-decoder too, in a full run)
    deepest = [row for row in r["rows"] if row["peer"] == "kilolayer" and row["checkpoint"]][-1]
    for name in memory.VARIANTS:
        assert _positive(deepest[f"peak_gib_{name}"]) and _positive(deepest[f"step_s_{name}"]), (deepest, name)


def test_profile_json(profile_result):
    choice = profile_result["fast_precision"]  # auto: from a quick GEMM of each precision
    assert choice["requested"] == "auto"
    assert choice["precision"] == ("bf16" if choice["bf16_over_fp32"] >= 1 else "fp32")
    fast = [r for r in profile_result["rows"] if r["options"]["fused_optimizer"]]
    assert fast and all(r["options"]["precision"] == choice["precision"] for r in fast)
    assert profile_step.format_result(profile_result).startswith(f"Fast path in {choice['precision']} (auto: ")
    for row in profile_result["rows"]:
        assert _positive(row["wall_ms_per_step"])
        assert set(row["share"]) == set(profile_step.KINDS)
        assert all(v >= 0 for v in row["share"].values())
        assert sum(row["share"].values()) >= 0.99  # host overhead is the remainder of the wall time


@pytest.mark.integration
def test_run_all_writes_markdown(train_result, memory_result, profile_result, tmp_path):
    text = run_all.markdown(train_result, memory_result, profile_result, ["python -m benchmarks.run_all"], 1.0)
    assert "## Training-step throughput and MFU" in text and "## Peak memory vs depth" in text
    assert train_result["machine"]["cpu"] in text and "x best peer fast path" in text
    targets = run_all.targets(train_result, memory_result)
    for target in targets:
        assert isinstance(target["met"], bool) and target["measured"]
    names = [t["target"] for t in targets]
    # this goals, each present once per shape it names (the smoke run has one shape)
    assert sum(">= 1.05x the faster peer's" in n for n in names) == 1
    assert sum("best fast path >= 1.05x the best peer" in n for n in names) == 1
    assert sum("fast-path MFU >= 30% of the measured bf16 peak" in n for n in names) == 1
    assert sum("<= 1.6 GiB peak" in n for n in names) == 1 + len(memory_result["encoder_decoder"])
    (res,) = train_result["configs"].values()
    fast = next(t for t in targets if "best fast path" in t["target"])
    # the target reads the rematch: kilolayer's fastest fast-path row (by median) against the peers' near the fastest
    m = res["rematch"]
    timed = {v["name"]: v for v in res["variants"] if "step_ms" in v}
    ours = min((v for v in timed.values() if v["peer"] == "kilolayer" and v["options"]["compile"]), key=_step_ms)
    fastest = timed[res["best_peer_fast"]]["step_ms"]
    near = {n for n, v in timed.items() if v["peer"] != "kilolayer" and v["options"]["compile"]}
    near = {n for n in near if timed[n]["step_ms"] <= fastest * (1 + common.REMATCH_PEER_SPREAD) + 1e-9}
    assert (m["kilolayer"], set(m["peers"]), m["rounds"]) == (ours["name"], near, 2)
    assert m["peer"] == min(m["peers"], key=lambda n: m["peers"][n]["ratio"])
    assert m["interval"] == [min(m["ratios"]), max(m["ratios"])] and m["coverage"] == 0.5  # 2 rounds: their range
    mode = ours["options"]["compile"]
    lo, hi = m["interval"]
    assert fast["measured"] == (
        f"{m['ratio']:.2f}x (compile: {mode}; against {m['peer']}, 2 rounds, 50% interval {lo:.2f}-{hi:.2f})"
    )
    assert fast["met"] == (lo >= run_all.FAST_GOAL)  # the interval's lower end decides
    said = "\n".join(run_all.findings(train_result, profile_result, memory_result))
    assert "kilolayer's better compile mode is compile: " in said and "of compile" in said
    assert "compile: layers" in said and "compile: model" in said
    assert f"Timed again, 2 rounds with no other row stepping: {m['ratio']:.2f}x {m['peer']} (50% interval" in said
    rematch_line = next(ln for ln in train_step.format_result(train_result).splitlines() if ln.startswith("Rematch"))
    assert rematch_line.startswith("Rematch, 2 rounds, each row's timed step after an untimed one of its own")
    assert f"stepping: {ours['name']} against {m['peer']}: {m['ratio']:.2f}x (50% interval" in rematch_line
    assert "The fast-path targets read a rematch" in text


def test_a_rematch_times_each_rows_second_step_in_rotating_order_and_divides_the_peers_time_by_ours(monkeypatch):
    """Scripted step times: kilolayer's timed steps take 1.0 s, the peers' 1.1 and 1.3 s (the untimed ones 9 s,
    never counted); each round every row steps twice, the second timed, the first row rotating; the ratios are
    the peer's time over ours, the strongest peer decides, and a step that fails becomes the rematch's note."""
    calls: list[str] = []
    clock = {"ours": 1.0, "ts": 1.1, "xt": 1.3}

    def entry(name):
        return {"name": name, "step": lambda inputs, targets: calls.append(name)}

    def fake_timed(fn):
        fn()
        return clock[calls[-1]]

    monkeypatch.setattr(common, "timed", fake_timed)
    m = common.rematch(entry("ours"), [entry("ts"), entry("xt")], 6, None, None)
    # two steps a row a round, the first row rotating: ours, ts, xt, then ts, xt, ours, ...
    rounds = [calls[i : i + 6] for i in range(0, len(calls), 6)]
    assert [r[::2] for r in rounds] == [["ours", "ts", "xt"], ["ts", "xt", "ours"], ["xt", "ours", "ts"]] * 2
    assert all(r[0::2] == r[1::2] for r in rounds)
    assert m["first"] == ["ours", "ts", "xt"] * 2
    assert m["peers"]["ts"]["ratios"] == pytest.approx([1.1] * 6) and m["peers"]["xt"]["ratio"] == pytest.approx(1.3)
    assert (m["peer"], m["ratio"], m["rounds"]) == ("ts", pytest.approx(1.1), 6)
    assert m["peers"]["ts"]["ratio_by_first"] == {"kilolayer": pytest.approx(1.1), "peer": pytest.approx(1.1)}
    assert m["interval"] == pytest.approx([1.1, 1.1]) and m["coverage"] == pytest.approx(1 - 2 / 64)

    def broken(inputs, targets):
        raise RuntimeError("out of memory\nmore")

    m = common.rematch(entry("ours"), [{"name": "ts", "step": broken}], 6, None, None)
    assert m == {"kilolayer": "ours", "rounds": 6, "error": "RuntimeError: out of memory"}
    assert (
        train_step.rematch_words(m)
        == "Rematch of ours: stopped (RuntimeError: out of memory); the race's figures stand"
    )


@pytest.mark.parametrize("rounds", ["-1", "1", "5"])
def test_a_rematch_too_short_for_an_interval_is_refused_in_one_line(rounds, capsys):
    with pytest.raises(SystemExit) as exc:
        train_step.main(["--rematch-rounds", rounds, "--out", "unused.json"])
    assert exc.value.code == 2
    assert f"--rematch-rounds={rounds}: expected 0 (none) or at least 6" in capsys.readouterr().err.splitlines()[-1]


def _step_ms(row: dict) -> float:
    return row["step_ms"]


def _below(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) < k), counted."""
    return sum(math.comb(n, i) for i in range(k)) / 2**n


@pytest.mark.parametrize(
    "n, ends, coverage",
    [
        # the sign test's interval: x_(k), x_(n+1-k), covering the median with probability 1 - 2 P(B(n, 1/2) < k)
        (24, (7, 18), 1 - 2 * _below(7, 24)),
        (20, (6, 15), 1 - 2 * _below(6, 20)),
        (9, (2, 8), 1 - 2 * _below(2, 9)),
        (8, (1, 8), 1 - 2 * _below(1, 8)),  # k = 2 would cover 93%: the range
        (5, (1, 5), 1 - 2 * _below(1, 5)),  # too few for 95%: the range, and its coverage (94%)
        (1, (1, 1), 0.0),
    ],
)
def test_the_median_interval_is_the_sign_tests(n, ends, coverage):
    values = [float(i) for i in range(n, 0, -1)]  # order does not matter
    lo, hi, cov = common.median_interval(values)
    assert (lo, hi) == ends and cov == pytest.approx(coverage, abs=1e-12)
    if n > 1:
        assert common.median_interval(values, level=0.5)[2] >= 0.5


@pytest.mark.integration
def test_heap_smoke_json(heap_result):
    """``benchmarks.heap --smoke``: a held and a default process, each with per-step faults and times."""
    r = heap_result
    assert [row["hold_heap"] for row in r["rows"]] == [False, True]
    held = H._glibc() is not None  # only glibc has the setting
    for row in r["rows"]:
        assert len(row["per_pair"]) == r["pairs"] == heap.SMOKE_PAIRS
        assert all(s["hold_heap"] == (row["hold_heap"] and held) for s in row["per_pair"])
        assert row["held"] == (row["hold_heap"] and held)
        assert _positive(row["wall_s"]) and row["minflt"] >= 0 and row["sys_s"] >= 0
        assert row["wall_s"] == common.median([s["wall_s"] for s in row["per_pair"]])
    off, on = r["rows"][0]["per_pair"][0], r["rows"][1]["per_pair"][0]
    assert r["speedup"] == pytest.approx(off["wall_s"] / on["wall_s"])


@pytest.mark.integration
def test_run_all_reports_the_held_heap(train_result, memory_result, profile_result, heap_result):
    text = run_all.markdown(
        train_result, memory_result, profile_result, ["python -m benchmarks.run_all"], 1.0, heap_result
    )
    assert "## Page faults between steps (`train.hold_heap`)" in text
    assert "| train.hold_heap | page faults / step |" in text
    said = run_all.findings(train_result, profile_result, memory_result, heap_result)
    off, on = heap_result["rows"]
    line = [x for x in said if x.startswith("train.hold_heap")]
    if on["held"]:
        assert line == [run_all._heap_finding(heap_result)]
        assert (
            f"default / held step time {heap_result['speedup']:.3f}" in line[0]
            and f"{off['minflt']:,.0f} pages" in line[0]
        )
    else:
        assert line == []  # no sentence about a setting this C library refused
    assert "## Page faults" not in run_all.markdown(
        train_result, memory_result, profile_result, ["python -m benchmarks.run_all"], 1.0
    )


def test_scripts_have_help(capsys):
    for mod in (train_step, memory, profile_step, run_all, gpu, heap, study_points):
        with pytest.raises(SystemExit) as exit_info:
            mod.main(["--help"])
        assert exit_info.value.code == 0
        assert "--out" in capsys.readouterr().out


# ---------------------------------------------------------------- train.compile


def test_train_compile_takes_false_layers_or_model():
    """true still loads (old configs, saved runs) and means layers; anything else is one line naming the key."""
    for given, want in ((False, False), (True, "layers"), ("layers", "layers"), ("model", "model")):
        assert load_config({"train": {"compile": given}}).train.compile == want
    assert load_config(None, ["train.compile=true"]).train.compile == "layers"
    assert load_config(None, ["train.compile=model"]).train.compile == "model"
    for bad in ("fast", "true", "Model", 1, 0, None, ["layers"]):
        with pytest.raises(ConfigError) as info:
            load_config({"train": {"compile": bad}})
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("train.compile="), msg
        assert "expected false, layers or model" in msg


TINY_LM = {
    "model": tiny_decoder("deepnorm"),
    "objective": {"name": "causal_lm"},
    "data": {"name": "stdlib_bytes", "options": {"seq_len": 16, "max_bytes": 50_000, "eval_windows": 4}},
    "train": {"steps": 2, "batch_size": 2, "log_every": 1, "precision": "bf16", "fused_optimizer": True},
}


@pytest.mark.parametrize("mode", [False, "layers", "model"])
def test_the_trainer_compiles_what_train_compile_names(tmp_path, monkeypatch, mode):
    """layers: each Transformer layer, nothing else; model: the task (backbone, head, loss) once; false: nothing.
    The compile itself runs with the aot_eager backend here (no C++ build); the trainer's steps go through it."""

    from kilolayer.objectives.base import Task
    from kilolayer.train import engine, run

    compiled, original = [], torch.compile

    def compile_(fn, **options):  # nn.Module.compile calls torch.compile on the module's _call_impl
        compiled.append((fn.__self__, fn.__name__))
        return original(fn, **{**options, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", compile_)
    made, build = [], engine.build_task

    made_keys = []

    def build_task(*args, **kwargs):
        made.append(build(*args, **kwargs))
        made_keys.append(made[-1].state_dict().keys())
        return made[-1]

    monkeypatch.setattr(engine, "build_task", build_task)
    result = run.train(TINY_LM, tmp_path / "run", quiet=True, sets=[f"train.compile={str(mode).lower()}"])
    assert result == {"status": "completed", "step": 2}
    (task,) = made
    if mode == "layers":
        layers = transformer_layers(task.backbone)
        assert compiled == [(m, "_call_impl") for m in layers] and len(compiled) == 2
        assert all(getattr(m, "_compiled_call_impl", None) is not None for m in layers)
    elif mode == "model":  # the task's compute: backbone, head and loss, after the objective's eager prepare
        assert compiled == [(task, "compute")] and isinstance(task, Task)
        assert "compute" in vars(task) and task.state_dict().keys() == made_keys[0]
    else:
        assert compiled == []
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows if r["split"] == "train")
    saved = load_config(tmp_path / "run" / "config.yaml")  # the saved run config loads back with its mode
    assert saved.train.compile == mode


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


@pytest.mark.parametrize("mode", ["auto", "sdpa"])
def test_cpu_attention_modes_only_change_rounding(mode):
    """``model.cpu_attention`` auto (matrix products in bf16 at these lengths) and sdpa (bf16 SDPA) agree with
    fp32 SDPA within bf16 tolerance, and in fp32 every mode gives the same bits."""
    torch.manual_seed(0)
    a = build_model(_small("deepnorm", cpu_attention="fp32"))
    b = build_model(_small("deepnorm", cpu_attention=mode))
    b.load_state_dict(a.state_dict())
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(0, 32, (4, 16), generator=g), torch.randint(0, 32, (4, 12), generator=g)
    proj = torch.randn(4, 12, 32, generator=g)
    oa, ga = _forward_backward(a, src, tgt, proj, bf16=True)
    ob, gb = _forward_backward(b, src, tgt, proj, bf16=True)
    assert not torch.equal(oa, ob)  # the mode is in effect
    assert (oa - ob).norm() <= OUT_RTOL * oa.norm()
    fa, fb = torch.cat([g.flatten() for g in ga.values()]), torch.cat([gb[n].flatten() for n in ga])
    assert (fa - fb).norm() <= GRAD_RTOL * fa.norm()
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


def test_the_side_by_side_targets_read_the_auto_and_study_rows():
    """Constructed rows: shape a's auto pair at 1.2x (1.26x over the faster every-core run alone) and its study pair at
    1.4x meet the 1.5x goal, and its default run alone (every core) is the fastest; shape b's auto pair at 1.5x its
    own run alone misses it over the faster every-core run (1.8x), its study pair at 1.6x misses it, and its default
    run alone at 1.25x the one-thread run's is outside the 10% noise."""
    rows = [
        {"shape": "a", "threads": "auto", "alone_s": 10.5, "side_by_side_s": 12.6, "ratio": 1.2},
        {"shape": "a", "threads": "every core (2 threads)", "alone_s": 10.0, "side_by_side_s": 50.0, "ratio": 5.0},
        {"shape": "a", "threads": "one thread", "alone_s": 13.0, "side_by_side_s": 13.0, "ratio": 1.0},
        {"shape": "a", "threads": "study --jobs 2", "alone_s": 11.0, "side_by_side_s": 15.4, "ratio": 1.4},
        {"shape": "b", "threads": "auto", "alone_s": 12.0, "side_by_side_s": 18.0, "ratio": 1.5},
        {"shape": "b", "threads": "every core (2 threads)", "alone_s": 10.0, "side_by_side_s": 40.0, "ratio": 4.0},
        {"shape": "b", "threads": "one thread", "alone_s": 8.0, "side_by_side_s": 8.0, "ratio": 1.0},
        {"shape": "b", "threads": "study --jobs 2", "alone_s": 11.0, "side_by_side_s": 17.6, "ratio": 1.6},
    ]
    got = run_all.side_by_side_targets({"rows": rows, "steps": 60})
    assert [(t["measured"], t["met"]) for t in got] == [
        (
            "1.20x; over the faster run alone, auto's or every core's: 1.26x; two one-thread runs over every core "
            "alone: 1.30x (every core side by side: 5.00x)",
            True,
        ),
        ("1.40x (every core side by side: 5.00x)", True),
        ("1.00x (every core (2 threads) fastest)", True),
        (
            "1.50x; over the faster run alone, auto's or every core's: 1.80x; two one-thread runs over every core "
            "alone: 0.80x (every core side by side: 4.00x)",
            False,
        ),
        ("1.60x (every core side by side: 4.00x)", False),
        ("1.25x (one thread fastest)", False),
    ]
    machine = {"date": "2026-12-06", "cpu": "AMD EPYC", "cores": 2, "flags": ["avx2"]}
    text = "\n".join(run_all._side_by_side_section({"rows": rows, "steps": 60, "machine": machine}))
    assert "| a | auto | 10.5 | 12.6 | 1.20x |" in text and "60 steps" in text and "AMD EPYC, 2 cores" in text
    assert "measured 1 times" not in text and "a cell is the median" not in text  # one measurement per cell
    assert run_all.side_by_side_targets(None) == []


def test_a_repeated_side_by_side_cell_is_the_median_with_its_range():
    """Three repeats of 6L x 256: auto alone 15.52, 14.76, 13.40 s, its pairs 21.70, 20.37, 19.78 s, every core
    alone 14.32, 13.47, 14.75 s. The cells are medians with their ranges; the ratio is repeat by repeat (1.40,
    1.38, 1.48: median 1.40x; the median pair over the median run alone would be 1.38x); over the faster run alone
    of each repeat it is 1.515, 1.512, 1.476: median 1.51x, which misses the 1.5x goal."""
    alone, pairs, every_alone = [15.52, 14.76, 13.40], [21.70, 20.37, 19.78], [14.32, 13.47, 14.75]
    assert side_by_side.paired_ratio(pairs, alone) == pytest.approx(21.70 / 15.52)
    row = {
        "shape": "a",
        "threads": "auto",
        "alone_s": 14.76,
        "side_by_side_s": 20.37,
        "ratio": side_by_side.paired_ratio(pairs, alone),
        "alone_runs": alone,
        "side_by_side_runs": pairs,
    }
    every = {**row, "threads": "every core (2 threads)", "alone_s": 14.32, "alone_runs": every_alone, "ratio": 3.4}
    res = {"rows": [row, every], "steps": 60, "repeats": 3}
    assert "| a | auto | 14.8 (13.4-15.5) | 20.4 (19.8-21.7) | 1.40x |" in side_by_side.format_result(res)
    machine = {"date": "2026-12-06", "cpu": "AMD EPYC", "cores": 2, "flags": ["avx2"]}
    text = " ".join(run_all._side_by_side_section({**res, "machine": machine}))
    assert "measured 3 times" in text and "a cell is the median" in text and "its own repeat" in text
    auto = run_all.side_by_side_targets(res)[0]
    assert auto["measured"].startswith("1.40x; over the faster run alone, auto's or every core's: 1.51x")
    assert auto["met"] is False
    with pytest.raises(ValueError):  # runs that do not pair up are refused, not silently truncated
        side_by_side.paired_ratio(pairs, alone[:2])


def test_run_all_writes_the_page_again_from_its_results_alone(train_result, memory_result, profile_result, tmp_path):
    """``--from-json`` renders the page from a run's results: the same page, nothing measured again."""
    commands = ["python -m benchmarks.run_all"]
    results = {"train_step": train_result, "memory": memory_result, "profile": profile_result}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({**results, "heap": None, "side_by_side": None, "seconds": 2.0, "commands": commands}))
    assert run_all.main(["--from-json", str(path), "--out", str(tmp_path / "page.md")]) == 0
    expected = run_all.markdown(train_result, memory_result, profile_result, commands, 2.0)
    assert (tmp_path / "page.md").read_text() == expected


@pytest.mark.integration
def test_the_attention_benchmark_times_each_way_and_the_page_shows_it(train_result, memory_result, profile_result):
    """``benchmarks.attention --smoke``: every way timed per shape and mask, its table, and its section on the
    page with the machine and date it was measured on."""
    from benchmarks import attention

    att = attention.run(smoke=True, threads=1)
    assert [(r["shape"], r["causal"]) for r in att["rows"]] == [(attention.SMOKE_SHAPES[0], c) for c in (False, True)]
    assert all(set(r["ms"]) == set(attention.WAYS) and min(r["ms"].values()) > 0 for r in att["rows"])
    table = attention.format_result(att)
    ms = att["rows"][1]["ms"]
    assert f"| 2 x 2 x 16 x 8 | causal | {ms['products']:.1f} | {ms['fp32']:.1f} | {ms['sdpa']:.1f} |" in table
    commands = ["python -m benchmarks.run_all"]
    page = run_all.markdown(train_result, memory_result, profile_result, commands, 1.0, att=att)
    assert "## Attention on a CPU under bf16" in page and table in page
    assert f"Measured on {att['machine']['cpu']}, {att['machine']['date']}." in page
    assert "## Attention" not in run_all.markdown(train_result, memory_result, profile_result, commands, 1.0)


def test_search_vs_grid_reads_back_only_a_grid_of_the_same_settings(tmp_path):
    from types import SimpleNamespace

    from benchmarks import search_vs_grid as B

    shapes = [SimpleNamespace(name="1x72"), SimpleNamespace(name="2x48")]
    row = {
        "objective": "mae",
        "sets": ["a=1"],
        "shapes": ["1x72", "2x48"],
        "grid": {"1x72": {"losses": [0.4, 0.41]}, "2x48": {"losses": [0.39, 0.38]}},
        "times": {"grid_seed0": {"wall_s": 1.0, "cpu_s": 1.0}, "search": {"wall_s": 2.0, "cpu_s": 2.0}},
    }
    path = tmp_path / "svg.json"
    path.write_text(json.dumps({"objectives": [row]}))
    losses, times = B.recorded_grid(path, "mae", ["a=1"], shapes)
    assert losses == {"1x72": [0.4, 0.41], "2x48": [0.39, 0.38]}
    assert times == {"grid_seed0": {"wall_s": 1.0, "cpu_s": 1.0}}  # the search's own time is not the grid's
    assert B.recorded_grid(path, "mlm", ["a=1"], shapes) is None  # an objective the file lacks is trained
    with pytest.raises(SystemExit, match="no grid of mae with these settings"):
        B.recorded_grid(path, "mae", ["a=2"], shapes)
    with pytest.raises(SystemExit, match=r"--grid-from .*missing\.json: expected a search_vs_grid\.json"):
        B.recorded_grid(tmp_path / "missing.json", "mae", ["a=1"], shapes)


def test_search_vs_grid_repeats_corpus(tmp_path):
    """The repeated-string corpus: seeded, every line a string of 4-14 lowercase letters, "|", the same string;
    written under OUT whatever OUT's name, read from there as data.path (never parsed as a --set value, so '#'
    and ': ' in a path stay as they are); the same corpus there is left as it is, a file of another content in
    its place stops the benchmark and is kept; a grid read back with --grid-from does not depend on OUT."""
    from benchmarks import search_vs_grid as B

    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    B.repeats_corpus(a, lines=500)
    B.repeats_corpus(b, lines=500)
    B.repeats_corpus(c, lines=500, seed=1)
    assert a.read_text() == b.read_text() != c.read_text()
    rows = a.read_text().splitlines()
    assert len(rows) == 500
    for row in rows:
        left, bar, right = row.partition("|")
        assert bar and left == right and 4 <= len(left) <= 14 and left.isalpha() and left.islower()
    assert {len(r.partition("|")[0]) for r in rows} == set(range(4, 15))  # the copy's offset varies
    os.utime(a, (1, 1))
    B.repeats_corpus(a, lines=500)  # the same corpus again: left as it is
    assert a.stat().st_mtime == 1
    a.write_text("mine\n")
    with pytest.raises(SystemExit, match="a.txt: exists and is not the repeated-string corpus"):
        B.repeats_corpus(a, lines=500)
    assert a.read_text() == "mine\n"

    name, config, sets = next(o for o in B.OBJECTIVES if o[0] in B.CORPORA)
    out = tmp_path / "runs #1: x"
    cfg = B.objective_config(name, config, sets, out)
    assert cfg.data.name == "text" and cfg.data.path == str(out / "repeats.txt")
    assert (out / "repeats.txt").read_text().count("\n") == 20_000
    assert B.objective_config("mae", "configs/digits_mae.yaml", [], tmp_path / "m").data.name == "digits"
    assert not (tmp_path / "m").exists()  # an objective without a corpus writes nothing


@pytest.mark.xfail(
    strict=True,
    reason="docs/data/search_vs_grid.json holds the grids of a shape generator that kept the head size and listed "
    "every shape within the tolerance; kilolayer search now offers one shape per depth, so the recorded grids await "
    "`OMP_NUM_THREADS=1 python -m benchmarks.search_vs_grid --out runs/search_vs_grid` (a strict xfail: it fails "
    "once the JSON is regenerated, and the marker goes)",
)
def test_the_recorded_search_vs_grid_holds_the_shapes_the_search_offers(tmp_path):
    """Every objective's config and settings give the shapes the measured JSON holds, and its grid is found from
    any OUT (its settings hold no path)."""
    from benchmarks import search_vs_grid as B
    from kilolayer.study import search as S

    measured_json = Path(__file__).resolve().parent.parent / "docs/data/search_vs_grid.json"
    measured = {r["objective"]: r for r in json.loads(measured_json.read_text())["objectives"]}
    for name, config, sets in B.OBJECTIVES:
        got = S.shapes(load_config(config, [*B.COMMON, *sets]), B.PARAMS, B.DEPTHS, B.TOLERANCE)
        assert [s.name for s in got] == measured[name]["shapes"]
        assert measured[name]["sets"] == [*B.COMMON, *sets]
    name, config, sets = next(o for o in B.OBJECTIVES if o[0] in B.CORPORA)
    cfg = B.objective_config(name, config, sets, tmp_path / "runs #1: x")
    shapes = S.shapes(cfg, B.PARAMS, B.DEPTHS, B.TOLERANCE)
    losses, _ = B.recorded_grid(measured_json, name, [*B.COMMON, *sets], shapes)
    assert set(losses) == {s.name for s in shapes}


def test_side_by_side_takes_turns_within_each_repeat_and_keeps_every_run(monkeypatch):
    """Scripted wall times: each setting's run alone and pair per repeat, settings in turn within a repeat; the row
    keeps every run, each pair's two times, the medians and the ratio repeat by repeat."""
    order, clock = [], iter(range(1, 1000))

    def race(cfg_path, work, runs, threads):
        order.append((str(threads), runs))
        return [float(next(clock)) for _ in range(runs)]

    def study(cfg, work, seeds):
        order.append(("study", len(seeds)))
        return float(next(clock))

    monkeypatch.setattr(side_by_side, "race", race)
    monkeypatch.setattr(side_by_side, "study", study)
    monkeypatch.setattr(side_by_side, "usable_cpus", lambda: 2)
    res = side_by_side.run(repeats=2)
    one_repeat = [("auto", 1), ("auto", 2), ("2", 1), ("2", 2), ("1", 1), ("1", 2), ("study", 1), ("study", 2)]
    assert order == (one_repeat * 2) * len(side_by_side.SHAPES)
    auto = res["rows"][0]
    assert auto["threads"] == "auto" and res["repeats"] == 2
    assert auto["alone_runs"] == [1.0, 12.0] and auto["pairs"] == [[2.0, 3.0], [13.0, 14.0]]
    assert auto["side_by_side_runs"] == [2.5, 13.5] and auto["alone_s"] == 6.5 and auto["side_by_side_s"] == 8.0
    assert auto["ratio"] == pytest.approx((2.5 / 1.0 + 13.5 / 12.0) / 2)
    with pytest.raises(SystemExit):
        side_by_side.main(["--repeats", "0"])


# ---------------------------------------------------------------- the built-in studies' points


def test_a_study_points_variant_is_judged_at_the_points_step_cap():
    """A compiled run with a faster step and a compile to pay for: its time at the cap, its ratio to eager fp32 and
    the step it repays its compile at, from the steady step (the median of the last half of the intervals, so a
    first interval holding the compile does not count)."""
    records = [{"step": 10, "train_s": 30.0}, {"step": 20, "train_s": 1.0}, {"step": 30, "train_s": 0.8}]
    records += [{"step": 40, "train_s": 0.6}, {"step": 50, "train_s": 0.6}]
    assert study_points.steady_step(records) == pytest.approx(0.06)
    eager = {"precision": "fp32", "compile": False, "step_s": 0.1, "fixed_s": 5.0}
    compiled = {"precision": "fp32", "compile": "layers", "step_s": 0.06, "fixed_s": 25.0}
    slower = {"precision": "bf16", "compile": "layers", "step_s": 0.12, "fixed_s": 30.0}
    failed = {"precision": "bf16", "compile": False, "error": "kilolayer: error: out of memory"}
    point = {"study": "s", "point": "g/p", "cap": 1000, "auto": "fp32", "variants": [eager, compiled, slower, failed]}
    study_points.summarize(point)
    assert eager["x_eager_fp32"] == 1.0 and eager["repays_after"] is None
    assert compiled["at_cap_s"] == pytest.approx(85.0) and compiled["x_eager_fp32"] == pytest.approx(105 / 85)
    assert compiled["repays_after"] == pytest.approx(500.0)  # 20 s more to save at 0.04 s a step
    assert slower["repays_after"] == float("inf") and "at_cap_s" not in failed
    text = study_points.format_result(
        {"machine": {"date": "d", "cpu": "c"}, "bf16_instructions": "f", "steps": 60, "jobs": 2, "points": [point]}
    )
    assert (
        "| s | g/p | 1,000 | fp32 | fp32 + compile | 60.0 | 1.67 | 25.0 | 1.24 | after 500 steps (within the cap) |"
        in text
    )
    assert "| bf16 + compile | 120.0 | 0.83 | 30.0 | 0.70 | never (no faster step) |" in text
    assert "| bf16 | failed: kilolayer: error: out of memory |" in text
    point["cap"] = 400
    study_points.summarize(point)
    assert "after 500 steps (beyond the cap)" in study_points.format_result(
        {"machine": {"date": "d", "cpu": "c"}, "bf16_instructions": "f", "steps": 60, "jobs": 2, "points": [point]}
    )


@pytest.mark.integration
def test_the_study_points_benchmark_runs_a_studys_point_and_the_page_shows_it(
    train_result, memory_result, profile_result
):
    """``benchmarks.study_points --smoke``: quick's smallest DeepNet point as its study configures it, eager fp32 (and
    bf16 where the CPU has bf16 instructions), timed and shown with the machine and date on the page."""
    sp = study_points.run(smoke=True)
    (row,) = sp["points"]
    assert (row["study"], row["cap"]) == ("quick", 200) and row["auto"] in ("fp32", "bf16")
    assert [v["precision"] for v in row["variants"]][0] == "fp32" and all("error" not in v for v in row["variants"])
    assert all(v["step_s"] > 0 and v["run_s"] > v["step_s"] * sp["steps"] for v in row["variants"])
    page = run_all.markdown(train_result, memory_result, profile_result, ["x"], 1.0, sp=sp)
    assert "## The built-in studies' points: bf16 and compile" in page and study_points.format_result(sp) in page
    assert sp["machine"]["date"] in page
