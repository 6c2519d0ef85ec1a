"""The efficiency component (kilolayer.train.metrics): FLOPs from the formula, rates over a known time, MFU,
the device peak (kilolayer.train.host.peak: given, vendor table, measured once and cached), peak memory, and a real
run's records."""

from __future__ import annotations

import json
import math

import pytest
import torch
from objective_helpers import WHOLE_TASKS, tiny_lm

from kilolayer import rundir
from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.objectives import build_task
from kilolayer.objectives.base import head_weights
from kilolayer.train import metrics as M
from kilolayer.train.host import peak as P
from kilolayer.train.run import train

LM = tiny_lm(steps=6, batch_size=4, lr=1e-3, log_every=2)
LOAD_PER_CPU = P.load_per_cpu


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test measures into a cache folder of its own, on a machine whose load is unknown unless it says."""
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(P, "load_per_cpu", lambda: None)


# ---------------------------------------------------------------- FLOPs, rates, MFU


def test_train_flops_of_a_decoder_are_the_formula():
    L, d, f, V = 2, 32, 64, 262
    matmul = L * (4 * d * d + 2 * d * f)
    cfg = load_config(LM)
    task = build_task(cfg, load_source(cfg))
    assert head_weights(task.objective) == d * V
    # 4 samples of 33 bytes: 32 inputs and 32 next-byte targets each; 6 N T + 12 L d T^2 a sample, the LM head's
    # d x V weights on every target
    batch = {"tokens": torch.zeros(4, 33, dtype=torch.long)}
    assert task.objective.train_flops(batch) == 4 * (6 * matmul * 32 + 12 * L * d * 32 * 32) + 6 * d * V * 4 * 32
    # padding: the mean valid length a sample
    padded = {**batch, "padding_mask": torch.zeros(4, 33, dtype=torch.bool)}
    padded["padding_mask"][:2, 17:] = True  # two samples of 16 targets, two of 32: 24 on average
    assert task.objective.train_flops(padded) == pytest.approx(
        4 * (6 * matmul * 24 + 12 * L * d * 24 * 24) + 6 * d * V * 96, rel=1e-12
    )


def test_train_flops_of_an_encoder_decoder_count_source_and_target_apart():
    """S source and T target tokens (S != T, the decoder deeper than the encoder); the head on targets only."""
    model = {"arch": "encoder_decoder", "layers": 2, "decoder_layers": 3, "width": 32, "heads": 2, "ffn": 64}
    cfg = load_config({"model": model, "objective": {"name": "seq2seq"}, "data": {"name": "synthetic"}})
    task = build_task(cfg, load_source(cfg))
    d, f, V = 32, 64, cfg.model.vocab_size
    enc = 2 * (4 * d * d + 2 * d * f)
    dec = 3 * (4 * d * d + 2 * d * f) + 3 * 4 * d * d  # + cross-attention (Q, K, V, O)
    S, T, B = 7, 12, 4
    per_sample = (
        6 * enc * S
        + 12 * 2 * d * S * S
        + 6 * (dec - 3 * 2 * d * d) * T
        + 12 * 3 * d * T * T
        + 6 * (3 * 2 * d * d) * S
        + 12 * 3 * d * T * S
    )
    batch = {
        "src": torch.zeros(B, S, dtype=torch.long),
        "src_padding_mask": torch.zeros(B, S, dtype=torch.bool),
        "tgt_in": torch.zeros(B, T, dtype=torch.long),
        "tgt_out": torch.zeros(B, T, dtype=torch.long),
        "tgt_padding_mask": torch.zeros(B, T, dtype=torch.bool),
    }
    assert task.objective.train_flops(batch) == pytest.approx(B * per_sample + 6 * d * V * B * T, rel=1e-12)


@pytest.mark.parametrize("name", list(WHOLE_TASKS) + ["probe"])
def test_train_flops_are_the_matmuls_a_step_runs(name):
    """Every objective's ``train_flops`` against torch's FlopCounterMode over one real forward and backward, with
    SDPA on its math path so that attention is counted as the matrix products it is: the same number. The
    seq2seq head runs on target tokens only, MAE's encoder on the visible patches and its decoder on all, the
    classifier's head once per sample (over a frozen backbone, a probe: forward only below the head)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load_config(WHOLE_TASKS["classifier" if name == "probe" else name])
    source = load_source(cfg)
    task = build_task(cfg, source).train()
    if name == "probe":  # as train.freeze_backbone with train.init_from leaves it
        task.backbone.requires_grad_(False)
        probe = cfg.train.model_copy(update={"freeze_backbone": True})
        task.objective.config = cfg.model_copy(update={"train": probe})
    raw = source.train_batch(0, 8)  # no padding: padded positions run but are not model FLOPs
    batch = task.objective.prepare(
        {k: torch.zeros_like(v) if k.endswith("padding_mask") else v for k, v in raw.items()}
    )
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss, _ = task.compute(batch)
        loss.backward()
    counted = counter.get_total_flops()
    if name == "contrastive":  # the batch accuracy's similarity matrix, computed without gradients
        counted -= 2 * 8 * 8 * task.objective.image_proj.out_features
    assert task.objective.train_flops(batch) == pytest.approx(counted, rel=1e-9)


def test_mlms_expected_flops_are_near_the_drawn_ones_and_the_meter_sums_them():
    """Without a draw, MLM counts its head on the expected selection (within sampling noise of a draw); the meter's
    FLOP/s is the sum of the steps' FLOPs over the training time."""
    cfg = load_config(WHOLE_TASKS["mlm"])
    source = load_source(cfg)
    task = build_task(cfg, source)
    raw = source.train_batch(0, 8)
    expected = task.objective.train_flops(raw)
    torch.manual_seed(0)
    drawn = task.objective.prepare(raw)
    assert task.objective.prepare(drawn) is drawn  # prepared once: the trainer's batch keeps its draw
    # the expected selection (mask_prob of the candidates) against the one drawn: within sampling noise
    assert task.objective.train_flops(drawn) == pytest.approx(expected, rel=0.05)
    now = [0.0]
    meter = M.Efficiency(M.Peak(1e9, "test"), "cpu", clock=lambda: now[0])
    meter.add(100, expected)
    meter.add(100, 2 * expected)
    now[0] += 3.0
    r = meter.report()
    assert r["flops_per_s"] == pytest.approx(expected) and r["mfu"] == pytest.approx(expected / 1e9)


def test_a_runs_flops_are_its_objectives_of_each_step(tmp_path):
    """An MAE run (every batch the same shape): each train record's FLOP/s over tokens/s is the objective's
    train_flops over tokens of one such batch, so the trainer counted what the objective counts."""
    section = {**WHOLE_TASKS["mae"], "train": {"steps": 4, "batch_size": 8, "log_every": 2}}
    train(section, tmp_path / "run", quiet=True)
    cfg = load_config(section)
    source = load_source(cfg)
    objective = build_task(cfg, source).objective
    batch = source.train_batch(0, 8)
    per_token = objective.train_flops(batch) / objective.tokens(batch)
    recs = [r for r in rundir.read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert len(recs) == 2
    assert all(r["flops_per_s"] / r["tokens_per_s"] == pytest.approx(per_token, rel=1e-9) for r in recs)


def test_meter_rates_over_a_known_time():
    now = [100.0]
    peak = M.Peak(1e9, "test")
    meter = M.Efficiency(peak, "cpu", processes=2, clock=lambda: now[0])
    meter.add(600, 600 * 3000.0)
    now[0] += 2.0
    with meter.paused():  # an evaluation: 0.5 s that are not training time
        now[0] += 0.5
    meter.add(900, 900 * 3000.0)
    now[0] += 1.0
    r = meter.report()
    assert r["tokens_per_s"] == pytest.approx(1500 / 3.0)
    assert r["flops_per_s"] == pytest.approx(500 * 3000.0)
    assert r["mfu"] == pytest.approx(500 * 3000.0 / (2 * 1e9))  # two devices' peak
    assert M.mfu(500, 3000.0, 1e9, 2) == r["mfu"]
    assert r["peak_mem_gib"] > 0
    # the next window starts empty
    meter.add(100)
    now[0] += 4.0
    assert meter.report()["tokens_per_s"] == pytest.approx(25.0)


def test_summarize_means_and_maximum():
    recs = [
        {"step": 1, "split": "train", "tokens_per_s": 100.0, "mfu": 0.1, "peak_mem_gib": 1.0},
        {"step": 1, "split": "eval", "loss": 3.0, "mfu": 9.0},
        {"step": 2, "split": "train", "tokens_per_s": 300.0, "mfu": 0.3, "peak_mem_gib": 1.5},
        {"step": 3, "split": "train", "loss": 2.0},
    ]
    # without the running token count every window weighs alike
    assert M.summarize(recs) == pytest.approx({"tokens_per_s": 200.0, "mfu": 0.2, "peak_mem_gib": 1.5})
    assert M.summarize([]) == {}
    # with it, each window by the training seconds it covers: 1,000 tokens at 100/s (10 s), then 3,000 at
    # 300/s (10 s), then 100 at 100/s (1 s): 4,100 tokens in 21 s
    timed = [
        {"step": 1, "split": "train", "train_s": 10.0, "tokens_per_s": 100.0, "mfu": 0.1},
        {"step": 2, "split": "train", "train_s": 10.0, "tokens_per_s": 300.0, "mfu": 0.3},
        {"step": 3, "split": "train", "train_s": 1.0, "tokens_per_s": 100.0, "mfu": 0.1},
    ]
    assert M.summarize(timed) == pytest.approx({"tokens_per_s": 4100 / 21, "mfu": (1 + 3 + 0.1) / 21})


# ---------------------------------------------------------------- the peak


def test_vendor_figures():
    assert P.vendor_peak("NVIDIA H200", "bf16", tf32=False) == 989e12
    assert P.vendor_peak("NVIDIA H100 80GB HBM3", "bf16", tf32=False) == 989e12
    assert P.vendor_peak("NVIDIA H100 PCIe", "bf16", tf32=False) == 756e12
    assert P.vendor_peak("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == 494.5e12
    assert P.vendor_peak("NVIDIA H100 80GB HBM3", "fp32", tf32=False) == 67e12
    assert P.vendor_peak("NVIDIA A100-SXM4-80GB", "bf16", tf32=False) == 312e12
    assert P.vendor_peak("Some Future GPU", "bf16", tf32=False) is None
    # whole names: an NVL card is not the SXM one, an L40 not an L4 (it has no figure here: measured)
    assert P.vendor_peak("NVIDIA H200 NVL", "bf16", tf32=False) == 835.5e12
    assert P.vendor_peak("NVIDIA L4", "bf16", tf32=False) == 121e12
    assert P.vendor_peak("NVIDIA L40S", "bf16", tf32=False) == 362.05e12
    assert P.vendor_peak("NVIDIA L40", "bf16", tf32=False) is None


def test_given_peak_measures_nothing(monkeypatch):
    monkeypatch.setattr(P, "quick_gemm_rate", lambda *a, **k: pytest.fail("measured although given"))
    assert P.device_peak("cpu", "fp32", given=2.5e11) == M.Peak(2.5e11, "train.peak_flops")


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    calls = []

    def fake(dtype, budget_s=1.5, **kw):
        calls.append(dtype)
        return 4.2e10, 512

    monkeypatch.setattr(P, "quick_gemm_rate", fake)
    first = P.device_peak("cpu", "fp32")
    again = P.device_peak("cpu", "fp32")
    assert first.flops == again.flops == 4.2e10 and calls == [torch.float32]
    assert first.source.startswith("measured") and again.source.startswith("cached")
    P.device_peak("cpu", "bf16")  # another dtype is another entry
    assert calls == [torch.float32, torch.bfloat16]
    data = json.loads((tmp_path / "cache" / P.CACHE_FILE).read_text())
    assert len(data) == 2 and all(f"torch {torch.__version__}" in k for k in data)
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp" in p.name]  # written by a rename
    # a damaged cache file is measured again and replaced
    (tmp_path / "cache" / P.CACHE_FILE).write_text("{not json")
    assert P.device_peak("cpu", "fp32").source.startswith("measured") and len(calls) == 3


def test_a_peak_measured_on_a_busy_machine_is_measured_again_when_it_is_quiet(tmp_path, monkeypatch):
    """Other processes can only slow a GEMM down: a figure taken at a load of BUSY_LOAD or more per CPU is
    measured again by the first run on a quieter machine, the higher figure kept; a quiet figure never is."""
    rates, loads, calls = iter([3.0e10, 5.0e10, 4.0e10, 9.9e10]), iter([1.6, 1.2, 0.3, 0.1, 1.5]), []

    def fake(dtype, budget_s=1.5, **kw):
        calls.append(dtype)
        return next(rates), 512

    monkeypatch.setattr(P, "quick_gemm_rate", fake)
    monkeypatch.setattr(P, "load_per_cpu", lambda: next(loads))
    busy = P.device_peak("cpu", "fp32")  # load 1.6: measured, flagged
    assert busy.flops == 3.0e10 and "load of 1.60 per CPU" in busy.source and len(calls) == 1
    still = P.device_peak("cpu", "fp32")  # load 1.2: still busy, the cached figure stands
    assert still.flops == 3.0e10 and still.source.startswith("cached") and len(calls) == 1
    quiet = P.device_peak("cpu", "fp32")  # load 0.3: measured again
    assert quiet.flops == 5.0e10 and quiet.source.startswith("measured") and "load" not in quiet.source
    assert len(calls) == 2
    entry = next(iter(json.loads((tmp_path / "cache" / P.CACHE_FILE).read_text()).values()))
    assert entry["load_per_cpu"] == 0.3 and entry["flops"] == 5.0e10
    for _ in range(2):  # loads 0.1 and 1.5: a quiet figure is final
        assert P.device_peak("cpu", "fp32").flops == 5.0e10
    assert len(calls) == 2


def test_a_quiet_remeasurement_never_lowers_the_peak(monkeypatch):
    rates, loads = iter([6.0e10, 2.0e10]), iter([2.0, 0.2])
    monkeypatch.setattr(P, "quick_gemm_rate", lambda *a, **k: (next(rates), 256))
    monkeypatch.setattr(P, "load_per_cpu", lambda: next(loads))
    assert P.device_peak("cpu", "fp32").flops == 6.0e10
    again = P.device_peak("cpu", "fp32")
    assert again.flops == 6.0e10 and again.source.startswith("cached") and "2e+10 FLOP/s, below" in again.source


@pytest.mark.parametrize(
    "content",
    [
        "[" * 100_000 + "]" * 100_000,  # deeper than the JSON parser goes
        '{"KEY": {"flops": ' + "9" * 401 + "}}",  # an integer no float holds
        '{"KEY": {"flops": true}}',
        '{"KEY": {"flops": 5e10, "load_per_cpu": ' + "9" * 401 + "}}",
        '{"KEY": {"flops": -1}}',
        '{"KEY": []}',
        "[1, 2]",
    ],
    ids=["nested", "huge_flops", "bool_flops", "huge_load", "negative", "list_entry", "list"],
)
def test_a_damaged_or_hostile_peak_cache_is_measured_again(tmp_path, monkeypatch, content):
    monkeypatch.setattr(P, "quick_gemm_rate", lambda *a, **k: (4.0e10, 256))
    P.device_peak("cpu", "fp32")
    path = tmp_path / "cache" / P.CACHE_FILE
    (key,) = json.loads(path.read_text())
    path.write_text(content.replace("KEY", key))
    peak = P.device_peak("cpu", "fp32")
    if "load_per_cpu" in content:  # the figure is fine; a load that is no number is ignored
        assert peak.flops == 5e10
    else:
        assert peak == M.Peak(4.0e10, peak.source) and peak.source.startswith("measured")


def test_a_cache_folder_that_cannot_be_written_only_costs_a_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "quick_gemm_rate", lambda *a, **k: (4.0e10, 256))
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "file"))
    assert P.device_peak("cpu", "fp32").flops == 4.0e10
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    monkeypatch.setenv("KILOLAYER_CACHE", str(readonly))
    monkeypatch.setattr(P.Path, "write_text", lambda *a, **k: (_ for _ in ()).throw(OSError(30, "Read-only")))
    monkeypatch.setattr(P.Path, "unlink", lambda *a, **k: (_ for _ in ()).throw(OSError(30, "Read-only")))
    assert P.device_peak("cpu", "fp32").flops == 4.0e10


def test_the_load_is_per_usable_cpu(monkeypatch):
    monkeypatch.setattr(P.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    monkeypatch.setattr(P, "usable_cpus", lambda: 4)
    assert LOAD_PER_CPU() == 0.75
    monkeypatch.setattr(P.os, "getloadavg", lambda: (_ for _ in ()).throw(OSError("no load average")))
    assert LOAD_PER_CPU() is None


def test_gemm_measurement_is_quick_and_leaves_the_rng_alone():
    state = torch.get_rng_state()
    flops, n = P.quick_gemm_rate(torch.float32, budget_s=0.2, n_max=512)
    assert torch.equal(state, torch.get_rng_state())
    assert math.isfinite(flops) and flops > 1e6 and n in (256, 512)


def test_peak_memory_is_this_process():
    rss = M.peak_rss()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert M.peak_rss() >= rss and M.peak_memory("cpu") >= block.numel() * 4


# ---------------------------------------------------------------- a real run


def test_a_run_reports_its_efficiency(tmp_path):
    run = tmp_path / "run"
    train(LM, run, quiet=True)
    recs = [r for r in rundir.read_metrics(run) if r["split"] == "train"]
    assert [r["step"] for r in recs] == [2, 4, 6]
    st = rundir.read_status(run)
    L, d, f, V, T = 2, 32, 64, 262, 32  # data.seq_len 32: 32 inputs and 32 next-token targets a sample
    fpt = 6 * L * (4 * d * d + 2 * d * f) + 12 * L * d * T + 6 * d * V
    for r in recs:
        assert r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0.05
        assert r["flops_per_s"] == pytest.approx(r["tokens_per_s"] * fpt, rel=1e-9)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / st["peak_flops"], rel=1e-9)
    # the CPU's fp32 GEMM peak was measured in this run (the cache was empty) and recorded
    assert st["peak_flops_source"].startswith("measured: fp32 GEMM")
    seconds = [r["train_s"] for r in recs]
    assert all(s > 0 for s in seconds)
    assert st["mfu"] == pytest.approx(sum(r["mfu"] * s for r, s in zip(recs, seconds)) / sum(seconds))
    assert st["peak_mem_gib"] == max(r["peak_mem_gib"] for r in recs)
    assert st["stopped_early"] is False and st["reason"] == "step budget"


def test_given_peak_is_used_and_recorded(tmp_path):
    run = tmp_path / "run"
    train(LM, run, quiet=True, sets=["train.peak_flops=1e12"])
    st = rundir.read_status(run)
    assert st["peak_flops"] == 1e12 and st["peak_flops_source"] == "train.peak_flops"
    for r in rundir.read_metrics(run):
        if r["split"] == "train":
            assert r["mfu"] == pytest.approx(r["flops_per_s"] / 1e12, rel=1e-12)


# ---------------------------------------------------------------- memory: a config that cannot fit


def test_train_refuses_a_config_that_cannot_fit_before_touching_the_directory(tmp_path):
    """The trainer calls kilolayer.train.host.memory.check_memory after the directory checks and before the lock:
    a fresh run leaves no directory, a resumed one keeps its status and files; the override trains."""
    from kilolayer.errors import ConfigError

    out = tmp_path / "new"
    with pytest.raises(ConfigError, match=r"^model: needs about [\d.]+ GiB .* train.memory_check=false$"):
        train(LM, out, quiet=True, sets=["model.layers=100000", "model.width=256", "model.heads=4"])
    assert not out.exists()
    run = tmp_path / "run"
    train(LM, run, quiet=True)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ConfigError, match="needs about"):
        train(None, run, resume=True, quiet=True, sets=["train.batch_size=100000000", "train.steps=8"])
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_several_threads_count_at_least_threads_times_one(monkeypatch):
    """On a busy machine a multi-threaded product keeps waiting for a descheduled thread: the peak is then
    threads x the one-thread rate (at most the usable CPUs), and the thread count is restored."""
    seen = []

    def fake(dtype, budget_s=1.5, **kw):
        seen.append(torch.get_num_threads())
        return (1e9, 1024) if torch.get_num_threads() > 1 else (4e10, 512)

    monkeypatch.setattr(P, "quick_gemm_rate", fake)
    monkeypatch.setattr(P, "usable_cpus", lambda: 2)
    torch.set_num_threads(3)  # the autouse fixture restores it
    assert P.cpu_peak(torch.float32) == (8e10, 512)  # 2 usable CPUs x 4e10
    assert seen == [3, 1] and torch.get_num_threads() == 3
    monkeypatch.setattr(
        P,
        "quick_gemm_rate",
        lambda dtype, budget_s=1.5, **kw: (1.9e11, 2048) if torch.get_num_threads() > 1 else (9e10, 512),
    )
    assert P.cpu_peak(torch.float32) == (1.9e11, 2048)  # an idle machine: the measured rate itself


def test_an_impossible_mfu_is_reported(tmp_path, capsys):
    train(LM, tmp_path / "run", quiet=True, sets=["train.peak_flops=1000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("(train.peak_flops) is too low; raise train.peak_flops"), err


def test_an_impossible_mfu_from_a_cached_peak_says_how_to_measure_again(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(P, "quick_gemm_rate", lambda *a, **k: (1000.0, 256))
    train(LM, tmp_path / "run", quiet=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is too low; set train.peak_flops, or delete the cached figure" in err[0], err


def test_bf16_on_a_cpu_without_bf16_instructions_is_named():
    cpu = torch.device("cpu")
    warning = P.cpu_bf16_warning("bf16", cpu, flags={"sse2", "avx2", "fma"})
    assert warning.startswith("train.precision: bf16 on a CPU without bf16 instructions")
    assert "use train.precision: fp32" in warning
    for flags in ({"avx2", "avx512_bf16"}, {"amx_bf16", "amx_tile"}, {"asimd", "bf16"}):
        assert P.cpu_bf16_warning("bf16", cpu, flags=flags) is None
    assert P.cpu_bf16_warning("fp32", cpu, flags={"avx2"}) is None
    assert P.cpu_bf16_warning("bf16", torch.device("meta"), flags={"avx2"}) is None


def test_a_bf16_run_on_such_a_cpu_warns_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(P, "cpu_flags", lambda: {"sse2", "avx2"})
    train(LM, tmp_path / "run", quiet=True, sets=["train.precision=bf16", "train.peak_flops=1e12", "train.steps=2"])
    err = [line for line in capsys.readouterr().err.splitlines() if "bf16 instructions" in line]
    assert len(err) == 1 and err[0].startswith("kilolayer: warning: train.precision: bf16")
    monkeypatch.setattr(P, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    train(LM, tmp_path / "run2", quiet=True, sets=["train.precision=bf16", "train.peak_flops=1e12", "train.steps=2"])
    assert "bf16 instructions" not in capsys.readouterr().err
