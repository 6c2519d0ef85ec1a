"""Training-step throughput of kilolayer, torchscale and x-transformers at identical configs, plus MFU.

A step is forward + LM head + cross-entropy on random tokens + backward +
AdamW. All implementations live in one process and run in turn, one step
each per round (the order rotates every round), so load from other processes
hits them alike; ratios are medians of per-round ratios. Also measured:
kilolayer's fast-path variants (bf16 autocast, per-layer ``torch.compile``,
fused AdamW), their compile time, the loss after 50 steps of the fast path
against fp32 from the same seed on the same data, and MFU = model FLOP/s
(kilolayer.training_flops + 6 d V for the head) over the best large-GEMM rate
of the same dtype measured in the same run.

    python -m benchmarks.train_step [--smoke] [--rounds R] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from benchmarks import common
from benchmarks.common import EAGER, FAST, StepOptions, TrainStep
from benchmarks.peers import NotSupported, Spec, build, model_flops_per_token
from kilolayer.train import metrics

CONFIGS = {
    "d256x12": Spec(width=256, layers=12, heads=4, ffn=1024, seq_len=128, vocab=256),
    "d128x48": Spec(width=128, layers=48, heads=2, ffn=512, seq_len=128, vocab=256),
}
SMOKE_CONFIGS = {"smoke": Spec(width=32, layers=2, heads=2, ffn=64, seq_len=16, vocab=64)}
# the loss check: d256x12's layers, 4 of them, so 2 x 50 steps stay within a minute or two
LOSS_SPEC = CONFIGS["d256x12"].with_(layers=4)
BATCH, SMOKE_BATCH = 16, 2
SCHEME = "deepnorm"


@dataclass(frozen=True)
class Variant:
    name: str
    peer: str
    options: StepOptions
    bias: bool = True  # False: kilolayer without biases, as x-transformers' attention (its FFN keeps them)


VARIANTS = [
    Variant("torchscale", "torchscale", EAGER),
    Variant("x-transformers", "x-transformers", EAGER),
    Variant("kilolayer", "kilolayer", EAGER),
    Variant("kilolayer, bias=False", "kilolayer", EAGER, bias=False),
    Variant("kilolayer fp32 + fused AdamW", "kilolayer", StepOptions("fp32", False, True)),
    Variant("kilolayer bf16 + fused AdamW", "kilolayer", StepOptions("bf16", False, True)),
    Variant("kilolayer fast path (bf16 + compile + fused AdamW)", "kilolayer", FAST),
]
PEERS = ("torchscale", "x-transformers")


def one_line(err: BaseException) -> str:
    msg = str(err).strip().splitlines()
    return f"{type(err).__name__}: {msg[0] if msg else ''}"[:300]


def prepare(variant: Variant, spec: Spec, inputs, targets, seed: int, backend: str) -> dict:
    """Build, wrap and run the first step (which includes any compile) of one variant."""
    torch.manual_seed(seed)
    entry: dict = {"name": variant.name, "peer": variant.peer, "options": variant.options.__dict__}
    try:
        model = build(variant.peer, spec.with_(bias=variant.bias))
        step = TrainStep(model, variant.options, compile_backend=backend)
        t0 = time.perf_counter()
        step(inputs, targets)
        entry["first_step_s"] = time.perf_counter() - t0
        entry["step"] = step
    except NotSupported as err:
        entry["error"] = str(err)
    except Exception as err:  # a compile failure on this CPU is a result to report, not a crash
        entry["error"] = one_line(err)
        entry["traceback"] = traceback.format_exc(limit=3)
    return entry


def measure(
    spec: Spec, batch_size: int, rounds: int, variants: list[Variant], seed: int = 0, backend: str = "inductor"
) -> dict:
    inputs, targets = common.fixed_batch(spec, batch_size, seed)
    tokens = batch_size * spec.tokens_per_sample()
    entries = [prepare(v, spec, inputs, targets, seed, backend) for v in variants]
    live = [e for e in entries if "step" in e]
    for e in live:  # a second untimed step: optimizer state exists, compiled backward is warm
        e["step"](inputs, targets)
        e["times"] = []
    for r in range(rounds):
        k = r % len(live)
        for e in live[k:] + live[:k]:
            e["times"].append(common.timed(lambda step=e["step"]: step(inputs, targets)))
    by_name = {e["name"]: e for e in entries}
    peer_names = [v.name for v in variants if v.peer in PEERS and "times" in by_name[v.name]]
    # the faster peer by median step time; per-round ratios against it
    faster = min(peer_names, key=lambda n: common.median(by_name[n]["times"])) if peer_names else None
    flops = model_flops_per_token(spec)
    out = []
    for e in entries:
        row = {k: v for k, v in e.items() if k not in ("step", "times", "traceback")}
        if "times" in e:
            t = e["times"]
            row["step_ms"] = 1000 * common.median(t)
            row["tokens_per_s"] = tokens / common.median(t)
            row["tokens_per_s_range"] = [tokens / max(t), tokens / min(t)]
            row["step_s_per_round"] = list(t)
            row["model_tflops_per_s"] = row["tokens_per_s"] * flops / 1e12
            steady = common.median(t)
            row["compile_s"] = max(0.0, e["first_step_s"] - steady) if e["options"]["compile"] else None
            if faster is not None:
                ref = by_name[faster]["times"]
                row["ratio_vs_faster_peer"] = common.median([b / a for a, b in zip(t, ref)])
        elif "traceback" in e:
            row["traceback"] = e["traceback"]
        out.append(row)
    return {
        "spec": spec.to_dict(),
        "label": spec.label(),
        "batch_size": batch_size,
        "tokens_per_step": tokens,
        "compile_backend": backend,
        "model_flops_per_token": flops,
        "rounds": rounds,
        "faster_peer": faster,
        "variants": out,
    }


def loss_agreement(
    spec: Spec,
    batch_size: int,
    steps: int,
    pool: int = 4,
    lr: float = 5e-4,
    seed: int = 0,
    rtol: float = 0.02,
    backend: str = "inductor",
) -> dict:
    """Train kilolayer fp32-eager and fast-path from the same init on the same batches; compare the losses.

    The data is ``pool`` fixed random batches in turn, so the loss falls (the model memorises them).
    """
    batches = [common.fixed_batch(spec, batch_size, seed + 1 + i) for i in range(pool)]
    curves = {}
    for name, options in (("fp32", EAGER), ("fast", FAST)):
        torch.manual_seed(seed)
        step = TrainStep(build("kilolayer", spec), options, lr=lr, compile_backend=backend)
        curves[name] = [step(*batches[i % pool]) for i in range(steps)]
    a, b = curves["fp32"], curves["fast"]
    diff = [abs(x - y) for x, y in zip(a, b)]
    final_rel = diff[-1] / abs(a[-1])
    return {
        "spec": spec.to_dict(),
        "batch_size": batch_size,
        "steps": steps,
        "lr": lr,
        "pool": pool,
        "loss_fp32": a,
        "loss_fast": b,
        "first_loss": a[0],
        "final_loss_fp32": a[-1],
        "final_loss_fast": b[-1],
        "final_abs_diff": diff[-1],
        "final_rel_diff": final_rel,
        "max_abs_diff": max(diff),
        "rtol": rtol,
        "agree": bool(final_rel <= rtol and all(math.isfinite(x) for x in a + b)),
    }


def run(
    smoke: bool = False,
    rounds: int | None = None,
    loss_steps: int | None = None,
    configs: list[str] | None = None,
    warm_cache: bool = False,
) -> dict:
    """Measure every config; compiles start from an empty inductor cache unless ``warm_cache``."""
    if warm_cache:
        return _run(smoke, rounds, loss_steps, configs)
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()  # forget graphs compiled earlier in this process, too
    with fresh_cache():
        result = _run(smoke, rounds, loss_steps, configs)
    result["compile_cache"] = "fresh"
    return result


def _run(smoke: bool, rounds: int | None, loss_steps: int | None, configs: list[str] | None) -> dict:
    specs = SMOKE_CONFIGS if smoke else CONFIGS
    if configs:
        unknown = [c for c in configs if c not in specs]
        if unknown:
            raise SystemExit(f"--config {unknown[0]}: expected one of {', '.join(specs)}")
        specs = {k: specs[k] for k in configs}
    batch_size = SMOKE_BATCH if smoke else BATCH
    backend = "aot_eager" if smoke else "inductor"  # smoke runs skip inductor's C++ build
    rounds = rounds or (1 if smoke else 6)
    result: dict = {
        "machine": common.machine(),
        "load_before": common.load_average(),
        "scheme": SCHEME,
        "compile_cache": "warm",
    }
    t0 = time.perf_counter()
    result["peak_flops"] = {
        "fp32": common.gemm_peak(torch.float32, n=256 if smoke else 2048, seconds=0.05 if smoke else 1.0),
        "bf16": common.gemm_peak(torch.bfloat16, n=256 if smoke else 2048, seconds=0.05 if smoke else 1.0),
    }
    result["configs"] = {}
    for key, spec in specs.items():
        spec = spec.with_(scheme=SCHEME)
        res = measure(spec, batch_size, rounds, VARIANTS, backend=backend)
        for row in res["variants"]:
            if "tokens_per_s" in row:
                peak = result["peak_flops"][row["options"]["precision"]]
                row["mfu"] = metrics.mfu(row["tokens_per_s"], res["model_flops_per_token"], peak)
        result["configs"][key] = res
    # re-measure the peaks after the models: the better of the two is the peak
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        again = common.gemm_peak(dtype, n=256 if smoke else 2048, seconds=0.05 if smoke else 1.0)
        if again > result["peak_flops"][key]:
            scale = result["peak_flops"][key] / again
            result["peak_flops"][key] = again
            for res in result["configs"].values():
                for row in res["variants"]:
                    if "mfu" in row and row["options"]["precision"] == key:
                        row["mfu"] *= scale
    loss_spec = (SMOKE_CONFIGS["smoke"] if smoke else LOSS_SPEC).with_(scheme=SCHEME)
    steps = loss_steps or (3 if smoke else 50)
    result["loss_agreement"] = loss_agreement(loss_spec, batch_size, steps, backend=backend)
    result["load_after"] = common.load_average()
    result["seconds"] = time.perf_counter() - t0
    return result


COLUMNS = [
    ("name", "implementation"),
    ("tokens_per_s", "tokens/s"),
    ("step_ms", "step ms"),
    ("ratio_vs_faster_peer", "x faster peer"),
    ("mfu", "MFU"),
    ("compile_s", "compile s"),
    ("error", "note"),
]


def format_result(result: dict) -> str:
    lines = []
    peaks = result["peak_flops"]
    lines.append(
        f"Peak GEMM (measured in this run): fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, "
        f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s"
        f"; torch threads {result['machine']['torch_threads']}; compile times from a {result['compile_cache']} "
        "inductor cache"
    )
    for _key, res in result["configs"].items():
        lines.append("")
        lines.append(
            f"### {res['label']}, seq {res['spec']['seq_len']}, batch {res['batch_size']} "
            f"({res['spec']['scheme']}, decoder-only; {res['rounds']} rounds; faster peer: {res['faster_peer']})"
        )
        lines.append("")
        rows = []
        for row in res["variants"]:
            r = dict(row)
            if "mfu" in r:
                r["mfu"] = f"{100 * r['mfu']:.0f}% of {r['options']['precision']}"
            if "ratio_vs_faster_peer" in r:
                r["ratio_vs_faster_peer"] = f"{r['ratio_vs_faster_peer']:.2f}"
            rows.append(r)
        lines.append(common.table(rows, COLUMNS))
    la = result["loss_agreement"]
    lines.append("")
    lines.append(
        f"Loss after {la['steps']} steps of d={la['spec']['width']} x {la['spec']['layers']}L, "
        f"batch {la['batch_size']}, {la['pool']} fixed batches in turn (same seed, lr {la['lr']}): "
        f"fp32 {la['final_loss_fp32']:.4f}, "
        f"fast path {la['final_loss_fast']:.4f} (start {la['first_loss']:.4f}); |diff| {la['final_abs_diff']:.4f} "
        f"= {100 * la['final_rel_diff']:.2f}% (tolerance {100 * la['rtol']:.0f}%): "
        f"{'agree' if la['agree'] else 'DISAGREE'}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_step", description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--rounds", type=int, help="timed rounds per config (default 6; smoke 1)")
    parser.add_argument("--loss-steps", type=int, help="steps of the fp32-vs-fast-path loss check (default 50)")
    parser.add_argument("--config", action="append", help=f"only this config ({', '.join(CONFIGS)}); repeatable")
    parser.add_argument(
        "--warm-cache", action="store_true", help="reuse inductor's on-disk cache (default: compile from an empty one)"
    )
    args = parser.parse_args(argv)
    common.apply_threads(args.threads)
    result = run(args.smoke, args.rounds, args.loss_steps, args.config, args.warm_cache)
    return common.finish(result, format_result(result), args.out)


if __name__ == "__main__":
    sys.exit(main())
