"""Where a training step's time goes: torch.profiler, ops grouped into a few kinds.

Kinds: matmul (GEMMs, incl. the LM head), attention (SDPA kernels),
compiled kernels (inductor's fused code, when compiled), elementwise/norm/copy
(LayerNorm, GELU, adds, casts, concatenations), loss, optimizer (everything
under ``optimizer.step``), and host overhead (wall time not spent inside any
op: Python, dispatch, autograd bookkeeping). Shares are of the profiled wall
time, which the profiler itself inflates a little. Profiled with one torch thread by
default, so the shares do not depend on what else the machine runs. The fast path
(per-layer compile + fused AdamW) runs in bf16 autocast where this CPU's bf16 GEMM
is at least as fast as its fp32 one, else in fp32 (``--fast-precision`` forces
either).

    python -m benchmarks.profile_step [--smoke] [--fast-precision auto|bf16|fp32] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import common
from benchmarks.common import EAGER, StepOptions, TrainStep
from benchmarks.peers import Spec, build

KINDS = ("matmul", "attention", "compiled kernels", "elementwise/norm/copy", "loss", "optimizer", "host overhead")
MATMUL = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::_addmm_activation",
}
ELEMENTWISE = (
    "layer_norm",
    "gelu",
    "add",
    "mul",
    "div",
    "copy",
    "to_copy",
    "cat",
    "sum",
    "fill",
    "zero",
    "clone",
    "embedding",
    "index",
    "sqrt",
    "lerp",
    "masked",
    "where",
    "neg",
    "expand",
    "contiguous",
)


def _kind(evt) -> str | None:
    p = evt
    while p is not None:
        if p.name.startswith("Optimizer.step"):
            return "optimizer"
        p = p.cpu_parent
    name = evt.name
    if "CompiledFxGraph" in name:
        return "compiled kernels"
    if name in MATMUL:
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    if "log_softmax" in name or "nll_loss" in name or "cross_entropy" in name:
        return "loss"
    if name.startswith("aten::") and any(k in name for k in ELEMENTWISE):
        return "elementwise/norm/copy"
    return None  # views, allocations, wrappers: counted as host overhead


def breakdown(
    spec: Spec, options: StepOptions, batch_size: int, steps: int = 2, seed: int = 0, peer: str = "kilolayer"
) -> dict:
    torch.manual_seed(seed)
    step = TrainStep(build(peer, spec), options)
    inputs, targets = common.fixed_batch(spec, batch_size, seed)
    step(inputs, targets)
    step(inputs, targets)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(inputs, targets)
        wall = (time.perf_counter() - t0) * 1e6
    # only the main thread's ops: autograd's engine runs the backward on it for CPU
    totals = dict.fromkeys(KINDS, 0.0)
    for evt in prof.events():
        kind = _kind(evt)
        if kind is not None:
            totals[kind] += evt.self_cpu_time_total
    totals["host overhead"] = max(0.0, wall - sum(v for k, v in totals.items() if k != "host overhead"))
    return {
        "peer": peer,
        "options": options.__dict__,
        "label": options.label(),
        "spec": spec.to_dict(),
        "steps": steps,
        "wall_ms_per_step": wall / steps / 1000,
        "share": {k: v / wall for k, v in totals.items()},
    }


def run(
    smoke: bool = False,
    configs: dict | None = None,
    threads: int | None = 1,
    fast_precision: str = "auto",
    choice: dict | None = None,
) -> dict:
    """Profile each config's steps with ``threads`` torch threads (default 1; restored afterwards). The fast
    path runs in ``choice["precision"]`` when ``choice`` is given (the speed run's decision,
    :func:`benchmarks.common.choose_fast_precision`), else in ``fast_precision`` (``auto``: decided here from a
    quick GEMM measurement of each precision)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(smoke, configs, choice or _choose(fast_precision))
    finally:
        torch.set_num_threads(before)


def _choose(requested: str) -> dict:
    if requested not in common.FAST_PRECISION_CHOICES:
        raise ValueError(f"fast precision {requested!r}: expected one of {', '.join(common.FAST_PRECISION_CHOICES)}")
    if requested == "auto":
        return common.choose_fast_precision(common.gemm_peaks(**common.PROBE_GEMM), common.cpu_flags())
    return {"precision": requested, "requested": requested, "reason": f"forced (--fast-precision {requested})"}


def _run(smoke: bool, configs: dict | None, choice: dict) -> dict:
    from benchmarks.train_step import BATCH, CONFIGS, SCHEME, SMOKE_BATCH, SMOKE_CONFIGS

    specs = configs or (SMOKE_CONFIGS if smoke else CONFIGS)
    batch_size = SMOKE_BATCH if smoke else BATCH
    # smoke runs skip inductor's C++ build: no compile there
    fast = StepOptions(choice["precision"], False if smoke else "layers", True)
    variants = [("x-transformers", EAGER), ("kilolayer", EAGER), ("kilolayer", fast)]
    out = {
        "machine": common.machine(),
        "threads": torch.get_num_threads(),
        "load_before": common.load_average(),
        "fast_precision": dict(choice),
        "rows": [],
    }
    for _key, spec in specs.items():
        spec = spec.with_(scheme=SCHEME)
        for peer, options in variants:
            row = breakdown(spec, options, batch_size, steps=1 if smoke else 2, peer=peer)
            row["config"] = spec.label()
            out["rows"].append(row)
    out["load_after"] = common.load_average()
    return out


def format_result(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        row = {"config": r["config"], "variant": f"{r['peer']} {r['label']}", "ms": r["wall_ms_per_step"]}
        row.update({k: f"{100 * v:.0f}%" for k, v in r["share"].items()})
        rows.append(row)
    cols = [("config", "model"), ("variant", "step"), ("ms", "profiled ms/step")] + [(k, k) for k in KINDS]
    fast = result.get("fast_precision")
    head = [f"Fast path in {fast['precision']} ({fast['reason']})", ""] if fast else []
    return "\n".join(head + [common.table(rows, cols)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one step (finishes in seconds)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads while profiling (default 1: the profiler's per-op cost stalls "
        "multi-threaded ops whenever another process holds a core)",
    )
    common.add_fast_precision_arg(parser)
    args = parser.parse_args(argv)
    result = run(args.smoke, threads=args.threads, fast_precision=args.fast_precision)
    return common.finish(result, format_result(result), args.out)


if __name__ == "__main__":
    sys.exit(main())
