"""Training-step throughput of kilolayer, torchscale and x-transformers at identical configs, plus MFU.

A step is forward + LM head + cross-entropy on random tokens + backward +
AdamW. All implementations live in one process and run in turn, one step
each per round (the order rotates every round), so load from other processes
hits them alike; ratios are medians of per-round ratios. Each library runs in
eager fp32 and on the fast path (``torch.compile``, fused AdamW, and bf16
autocast where this CPU's bf16 GEMM is at least as fast as its fp32 one, else
fp32; ``--fast-precision`` forces either): kilolayer with per-layer compile
(``train.compile: layers``) and whole-model compile (``train.compile: model``),
torchscale with either (its layers are modules its forward calls),
x-transformers with whole-model compile (its layer list holds lists of modules,
nothing one can compile per layer). Also measured: kilolayer with fused AdamW
alone and with bf16 + fused AdamW (skipped, with the reason in its note, when
the fast path is fp32), every compile's time, the loss after 50 steps of the
fast path under each compile mode against eager fp32 from the same seed on the
same data, and MFU = model FLOP/s (kilolayer.training_flops + 6 d V for the
head) over the best large-GEMM rate of the precision the row runs in, measured
in the same run.

    python -m benchmarks.train_step [--smoke] [--rounds R] [--fast-precision auto|bf16|fp32] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from benchmarks import common
from benchmarks.common import EAGER, PEER_LIBRARIES, StepOptions, TrainStep, Variant, fast_modes, fast_variant
from benchmarks.peers import Spec, build, model_flops_per_token
from kilolayer.train import host

CONFIGS = {
    "d256x12": Spec(width=256, layers=12, heads=4, ffn=1024, seq_len=128, vocab=256),
    "d128x48": Spec(width=128, layers=48, heads=2, ffn=512, seq_len=128, vocab=256),
}
SMOKE_CONFIGS = {"smoke": Spec(width=32, layers=2, heads=2, ffn=64, seq_len=16, vocab=64)}
# the loss check: d256x12's layers, 4 of them, so 3 x 50 steps stay within a few minutes
LOSS_SPEC = CONFIGS["d256x12"].with_(layers=4)
BATCH, SMOKE_BATCH = 16, 2
#: rounds of the rematch the fast-path target reads (benchmarks.common.rematch): 24 rounds put the median's
#: interval (98%) between the 7th and 18th ratios
REMATCH_ROUNDS = 24
SCHEME = "deepnorm"


def variants(fast_precision: str, skip_bf16: str | None = None) -> list[Variant]:
    """The race's rows with the fast path in ``fast_precision``; ``skip_bf16``: the note of the row whose only
    point is bf16 (bf16 + fused AdamW), which is then not run."""
    fast = fast_modes(fast_precision)
    return [
        Variant("torchscale", "torchscale", EAGER),
        Variant("x-transformers", "x-transformers", EAGER),
        Variant("kilolayer", "kilolayer", EAGER),
        Variant("kilolayer, bias=False", "kilolayer", EAGER, bias=False),
        Variant("kilolayer fp32 + fused AdamW", "kilolayer", StepOptions("fp32", False, True)),
        Variant("kilolayer bf16 + fused AdamW", "kilolayer", StepOptions("bf16", False, True), skip=skip_bf16),
        # the fast path of every library, under the same switches
        fast_variant("kilolayer", fast["layers"]),
        fast_variant("kilolayer", fast["model"]),
        fast_variant("x-transformers", fast["model"]),
        fast_variant("torchscale", fast["model"]),
        fast_variant("torchscale", fast["layers"]),
    ]


#: the rows where bf16 is fast (benchmarks.gpu races the fast-path ones on a GPU)
VARIANTS = variants("bf16")
PEERS = PEER_LIBRARIES


def measure(
    spec: Spec,
    batch_size: int,
    rounds: int,
    variants: list[Variant],
    seed: int = 0,
    backend: str = "inductor",
    rematch_rounds: int = 0,
) -> dict:
    """One config's race on this CPU (:func:`benchmarks.common.race`, with its rematch of kilolayer's fastest
    fast path against the fastest peer's), with the model FLOPs per token."""
    res = common.race(spec, batch_size, rounds, variants, seed=seed, backend=backend, rematch_rounds=rematch_rounds)
    res["model_flops_per_token"] = model_flops_per_token(spec)
    return res


def loss_agreement(
    spec: Spec,
    batch_size: int,
    steps: int,
    pool: int = 4,
    lr: float = 5e-4,
    seed: int = 0,
    rtol: float = 0.02,
    backend: str = "inductor",
    precision: str = "bf16",
) -> dict:
    """Train kilolayer fp32-eager and on the fast path in ``precision`` under each compile mode (per layer,
    whole model) from the same init on the same batches; compare each fast path's losses with fp32's.

    The data is ``pool`` fixed random batches in turn, so the loss falls (the model memorises them). The
    top-level ``loss_fast``, ``final_*`` and ``max_abs_diff`` are the per-layer mode's; ``agree`` is every
    mode's.
    """
    batches = [common.fixed_batch(spec, batch_size, seed + 1 + i) for i in range(pool)]

    def curve(options: StepOptions) -> list[float]:
        torch.manual_seed(seed)
        step = TrainStep(build("kilolayer", spec), options, lr=lr, compile_backend=backend)
        return [step(*batches[i % pool]) for i in range(steps)]

    a = curve(EAGER)
    modes = {}
    for mode, options in fast_modes(precision).items():
        b = curve(options)
        diff = [abs(x - y) for x, y in zip(a, b)]
        final_rel = diff[-1] / abs(a[-1])
        modes[mode] = {
            "options": dict(options.__dict__),
            "loss": b,
            "final_loss": b[-1],
            "final_abs_diff": diff[-1],
            "final_rel_diff": final_rel,
            "max_abs_diff": max(diff),
            "agree": bool(final_rel <= rtol and all(math.isfinite(x) for x in a + b)),
        }
    layers = modes["layers"]
    return {
        "spec": spec.to_dict(),
        "batch_size": batch_size,
        "steps": steps,
        "lr": lr,
        "pool": pool,
        "precision": precision,
        "loss_fp32": a,
        "loss_fast": layers["loss"],
        "first_loss": a[0],
        "final_loss_fp32": a[-1],
        "final_loss_fast": layers["final_loss"],
        "final_abs_diff": layers["final_abs_diff"],
        "final_rel_diff": layers["final_rel_diff"],
        "max_abs_diff": layers["max_abs_diff"],
        "modes": modes,
        "rtol": rtol,
        "agree": all(m["agree"] for m in modes.values()),
    }


def run(
    smoke: bool = False,
    rounds: int | None = None,
    loss_steps: int | None = None,
    configs: list[str] | None = None,
    warm_cache: bool = False,
    fast_precision: str = "auto",
    rematch_rounds: int | None = None,
) -> dict:
    """Measure every config; compiles start from an empty inductor cache unless ``warm_cache``. The fast path
    runs in ``fast_precision`` (``auto``: decided from the GEMM peaks measured first,
    :func:`benchmarks.common.choose_fast_precision`)."""
    args = (smoke, rounds, loss_steps, configs, fast_precision, rematch_rounds)
    if warm_cache:
        return _run(*args)
    with common.fresh_compiles():
        result = _run(*args)
    result["compile_cache"] = "fresh"
    return result


def _run(
    smoke: bool,
    rounds: int | None,
    loss_steps: int | None,
    configs: list[str] | None,
    fast_precision: str,
    rematch_rounds: int | None,
) -> dict:
    specs = SMOKE_CONFIGS if smoke else CONFIGS
    if configs:
        unknown = [c for c in configs if c not in specs]
        if unknown:
            raise SystemExit(f"--config {unknown[0]}: expected one of {', '.join(specs)}")
        specs = {k: specs[k] for k in configs}
    batch_size = SMOKE_BATCH if smoke else BATCH
    backend = "aot_eager" if smoke else "inductor"  # smoke runs skip inductor's C++ build
    rounds = rounds or (1 if smoke else 6)
    rematch_rounds = (2 if smoke else REMATCH_ROUNDS) if rematch_rounds is None else rematch_rounds
    result: dict = {
        "machine": common.machine(),
        "load_before": common.load_average(),
        "scheme": SCHEME,
        "compile_cache": "warm",
    }
    t0 = time.perf_counter()
    gemm = {"n": 256, "seconds": 0.05} if smoke else {"n": 2048, "seconds": 1.0}
    result["peak_flops"], result["peak_gemm_n"] = common.measure_peaks(**gemm)
    choice = common.choose_fast_precision(result["peak_flops"], result["machine"]["flags"], fast_precision)
    result["fast_precision"] = choice
    rows = variants(choice["precision"], choice["skip_bf16"])
    result["configs"] = {}
    for key, spec in specs.items():
        spec = spec.with_(scheme=SCHEME)
        res = measure(spec, batch_size, rounds, rows, backend=backend, rematch_rounds=rematch_rounds)
        common.add_mfu(res, res["model_flops_per_token"], result["peak_flops"])
        result["configs"][key] = res
    # re-measure, after the models, the peaks that some row's MFU is against: the better of the two is the peak
    used = {
        row["options"]["precision"] for res in result["configs"].values() for row in res["variants"] if "mfu" in row
    }
    for key in (p for p in common.PRECISIONS if p in used):
        again = common.gemm_peak(host.DTYPES[key], n=result["peak_gemm_n"][key], seconds=gemm["seconds"])
        if again > result["peak_flops"][key]:
            scale = result["peak_flops"][key] / again
            result["peak_flops"][key] = again
            for res in result["configs"].values():
                for row in res["variants"]:
                    if "mfu" in row and row["options"]["precision"] == key:
                        row["mfu"] *= scale
    loss_spec = (SMOKE_CONFIGS["smoke"] if smoke else LOSS_SPEC).with_(scheme=SCHEME)
    steps = loss_steps or (3 if smoke else 50)
    result["loss_agreement"] = loss_agreement(
        loss_spec, batch_size, steps, backend=backend, precision=choice["precision"]
    )
    result["load_after"] = common.load_average()
    result["seconds"] = time.perf_counter() - t0
    return result


COLUMNS = common.RACE_COLUMNS


def fast_choice(result: dict) -> dict:
    """``result``'s fast-path precision and why (:func:`benchmarks.common.choose_fast_precision`)."""
    return result["fast_precision"]


def fast_precision(result: dict) -> str:
    """The precision ``result``'s fast path ran in."""
    return fast_choice(result)["precision"]


def rematch_words(m: dict) -> str:
    """A config's rematch in one line: each peer's ratio with its interval, and the ratios by who went first."""
    if "error" in m:
        return f"Rematch of {m['kilolayer']}: stopped ({m['error']}); the race's figures stand"
    each = "; ".join(
        f"{name}: {p['ratio']:.2f}x ({common.interval_words(p)}; "
        + ", ".join(f"{who} first {x:.2f}x" for who, x in p["ratio_by_first"].items())
        + ")"
        for name, p in sorted(m["peers"].items(), key=lambda item: item[1]["ratio"])  # the strongest first
    )
    return (
        f"Rematch, {m['rounds']} rounds, each row's timed step after an untimed one of its own, no other row "
        f"stepping: {m['kilolayer']} against {each}"
    )


def fast_path_words(precision: str) -> str:
    """The fast path's switches in words."""
    return f"{'bf16 autocast' if precision == 'bf16' else 'fp32'} + torch.compile + fused AdamW"


def format_result(result: dict) -> str:
    lines = []
    peaks = result["peak_flops"]
    sizes = result.get("peak_gemm_n", {})
    small = sizes.get("bf16", 0) < sizes.get("fp32", 0)
    lines.append(
        f"Peak GEMM (measured in this run): fp32 {common.gflops(peaks['fp32'])} GFLOP/s, "
        f"bf16 {common.gflops(peaks['bf16'])} GFLOP/s"
        + (f" (at {sizes['bf16']}x{sizes['bf16']}: slower than fp32 there, so not measured larger)" if small else "")
        + f"; torch threads {result['machine']['torch_threads']}; compile times from a {result['compile_cache']} "
        "inductor cache"
    )
    lines.append(f"Fast path: {fast_path_words(fast_precision(result))} ({fast_choice(result)['reason']})")
    for _key, res in result["configs"].items():
        lines.append("")
        lines.append(
            f"### {res['label']}, seq {res['spec']['seq_len']}, batch {res['batch_size']} "
            f"({res['spec']['scheme']}, decoder-only; {res['rounds']} rounds; faster peer: {res['faster_peer']}; "
            f"best peer fast path: {res.get('best_peer_fast')})"
        )
        lines.append("")
        lines.append(common.format_race(res))
        if "rematch" in res:
            lines.append("")
            lines.append(rematch_words(res["rematch"]))
    la = result["loss_agreement"]
    lines.append("")
    per_mode = "; ".join(
        f"fast path ({la.get('precision', 'bf16')}), compile: {mode} {m['final_loss']:.4f} "
        f"({100 * m['final_rel_diff']:.2f}%)"
        for mode, m in la["modes"].items()
    )
    lines.append(
        f"Loss after {la['steps']} steps of d={la['spec']['width']} x {la['spec']['layers']}L, "
        f"batch {la['batch_size']}, {la['pool']} fixed batches in turn (same seed, lr {la['lr']}): "
        f"fp32 {la['final_loss_fp32']:.4f} (start {la['first_loss']:.4f}); {per_mode} "
        f"(tolerance {100 * la['rtol']:.0f}%): {'agree' if la['agree'] else 'DISAGREE'}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_step", description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--rounds", type=int, help="timed rounds per config (default 6; smoke 1)")
    parser.add_argument(
        "--rematch-rounds",
        type=int,
        help=f"rounds of kilolayer's fastest fast path against the fastest peer's, alone (default {REMATCH_ROUNDS}; "
        "smoke 2; 0: none)",
    )
    parser.add_argument("--loss-steps", type=int, help="steps of the fp32-vs-fast-path loss check (default 50)")
    parser.add_argument("--config", action="append", help=f"only this config ({', '.join(CONFIGS)}); repeatable")
    common.add_fast_precision_arg(parser)
    parser.add_argument(
        "--warm-cache", action="store_true", help="reuse inductor's on-disk cache (default: compile from an empty one)"
    )
    args = parser.parse_args(argv)
    if args.rematch_rounds is not None and 0 < args.rematch_rounds < 6 and not args.smoke:
        parser.error(f"--rematch-rounds={args.rematch_rounds}: expected 0 (none) or at least 6 (a 95% interval)")
    if args.rematch_rounds is not None and args.rematch_rounds < 0:
        parser.error(f"--rematch-rounds={args.rematch_rounds}: expected 0 (none) or at least 6 (a 95% interval)")
    common.apply_threads(args.threads)
    result = run(
        args.smoke, args.rounds, args.loss_steps, args.config, args.warm_cache, args.fast_precision, args.rematch_rounds
    )
    return common.finish(result, format_result(result), args.out)


if __name__ == "__main__":
    sys.exit(main())
