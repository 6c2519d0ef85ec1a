"""Training-step throughput on one CUDA GPU: kilolayer, torchscale and x-transformers side by side on the fast
path, plus MFU against the GPU's bf16 peak.

All three train the same decoder-only DeepNorm model (``benchmarks.peers``) under the same switches: bf16
autocast with fp32 weights and AdamW state, ``torch.compile`` (kilolayer per layer and whole model,
torchscale whole model and per layer, x-transformers whole model: its layer list holds lists of modules) and
fused AdamW; these are the fast-path rows of ``benchmarks.train_step``. Attention: kilolayer and
x-transformers call PyTorch's SDPA (bf16, causal, no mask, head dim 64) with cuDNN's attention turned off, so
that both take the same kernel (x-transformers leaves cuDNN out of its own choice; on sm90 PyTorch would
otherwise put it first for kilolayer's plain call), and the kernel SDPA picks for each shape is recorded;
torchscale 0.3.0 computes softmax(QK^T)V itself. The variants take turns, one step each per round
(``benchmarks.common.race``), and ratios are medians of per-round ratios. MFU = tokens/s x model FLOPs per token
(``kilolayer.training_flops`` + 6 d V for the head) / the vendor's dense bf16 figure for the GPU
(``kilolayer.train.host.device_peak``; measured where the GPU is not in its table).

Shapes: seq 1024, batch 8 (8,192 tokens a step), vocabulary 32,768; d=1024 x 24L (16 heads, FFN 4096,
0.37B parameters) and d=512 x 96L (8 heads, FFN 2048, 0.34B). By arithmetic: at
16 bytes a parameter (fp32 weights, gradients, two AdamW moments) the five models of a shape hold about 30 GiB
together, and the largest step's activations (torchscale's attention probabilities, kept in fp32 and bf16, at
96 layers) about 50 GiB more, within an H200's 141 GB; each row records the peak memory its steps allocated
(``torch.cuda.max_memory_allocated``, every variant of the shape resident). The timed steps take well under a
second each, so compiling takes most of the run. The run is meant to finish within 8 minutes on an H200: a
variant not started within ``--budget-min`` minutes (default 6) is skipped with a note in its row, and each
shape's table is printed (and ``--out`` written) as soon as that shape is done, so a run cut short keeps them.

    python -m benchmarks.gpu [--smoke] [--rounds R] [--budget-min M] [--out FILE]

Without CUDA it exits with one line and status 2; ``--smoke`` runs the same code on tiny models, on the GPU if
there is one, else on the CPU, in seconds (with the aot_eager backend: no Triton or C++ build).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from benchmarks import common, train_step
from benchmarks.peers import Spec, model_flops_per_token
from kilolayer.train.host import DTYPES, device_peak

CONFIGS = {
    "d1024x24": Spec(width=1024, layers=24, heads=16, ffn=4096, seq_len=1024, vocab=32768),
    "d512x96": Spec(width=512, layers=96, heads=8, ffn=2048, seq_len=1024, vocab=32768),
}
SMOKE_CONFIGS = {
    "smoke_wide": Spec(width=64, layers=2, heads=2, ffn=256, seq_len=16, vocab=64),
    "smoke_deep": Spec(width=32, layers=4, heads=2, ffn=128, seq_len=16, vocab=64),
}
BATCH, SMOKE_BATCH = 8, 2
ROUNDS, SMOKE_ROUNDS = 20, 2
BUDGET_MIN = 6.0
SCHEME = train_step.SCHEME
#: every library on the fast path, as in the CPU race
VARIANTS = [v for v in train_step.VARIANTS if v.options.fast]
#: no eager fp32 rows here, so no ``x faster peer`` column; the GPU memory each row's steps allocated at most
COLUMNS = [c for c in common.RACE_COLUMNS if c[0] not in ("ratio_vs_faster_peer", "error")]
COLUMNS += [("peak_gib", "peak GiB"), ("error", "note")]


def gpu_facts(device: torch.device) -> dict | None:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": list(torch.cuda.get_device_capability(device)),
        "memory_gib": props.total_memory / 2**30,
        "cuda": torch.version.cuda,
        "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(),
        "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
    }


def sdpa_backend(spec, batch_size: int, device: torch.device) -> str:
    """The kernel SDPA picks for this shape's causal bf16 attention without a mask (what kilolayer and
    x-transformers call), by PyTorch's own chooser; ``unknown`` where that private function is missing."""
    if device.type != "cuda":
        return "cpu"
    q = torch.zeros(batch_size, spec.heads, spec.seq_len, spec.width // spec.heads, device=device, dtype=torch.bfloat16)
    try:
        choice = torch._fused_sdp_choice(q, q, q, is_causal=True)
        return torch.nn.attention.SDPBackend(choice).name.lower()
    except (AttributeError, RuntimeError, TypeError, ValueError) as err:
        return f"unknown ({type(err).__name__})"


def peaks(device: torch.device, smoke: bool) -> dict:
    """FLOP/s per precision and where each figure came from: the GPU's (vendor table, else measured and
    cached); a smoke run on the CPU measures a quick GEMM instead of touching the machine's cache."""
    out = {"flops": {}, "source": {}}
    for precision, dtype in DTYPES.items():
        if device.type == "cuda":
            peak = device_peak(device, precision)
            out["flops"][precision], out["source"][precision] = peak.flops, peak.source
        else:
            out["flops"][precision] = common.gemm_peak(dtype, n=256, seconds=0.05)
            out["source"][precision] = f"measured: {precision} GEMM 256x256 (smoke)"
    return out


def run(
    smoke: bool = False,
    rounds: int | None = None,
    budget_min: float = BUDGET_MIN,
    configs: list[str] | None = None,
    done: Callable[[dict, str], None] | None = None,
) -> dict:
    """Race every config on the GPU (tiny models, and the CPU when there is no GPU, under ``smoke``); compiles
    start from an empty inductor cache. Variants not started within ``budget_min`` minutes are skipped.
    ``done(result, key)`` is called after each shape with the results so far."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # the same SDPA kernel for kilolayer and x-transformers
    specs = SMOKE_CONFIGS if smoke else CONFIGS
    if configs:
        unknown = [c for c in configs if c not in specs]
        if unknown:
            raise SystemExit(f"--config {unknown[0]}: expected one of {', '.join(specs)}")
        specs = {k: specs[k] for k in configs}
    backend = "aot_eager" if smoke else "inductor"
    rounds = rounds or (SMOKE_ROUNDS if smoke else ROUNDS)
    t0 = time.perf_counter()
    deadline = t0 + 60 * budget_min
    result: dict = {
        "machine": common.machine(),
        "gpu": gpu_facts(device),
        "device": str(device),
        "smoke": smoke,
        "scheme": SCHEME,
        "compile_backend": backend,
        "compile_cache": "fresh",
        "budget_min": budget_min,
        "peak": peaks(device, smoke),
        "configs": {},
    }
    with common.fresh_compiles():
        for key, spec in specs.items():
            spec = spec.with_(scheme=SCHEME)
            batch_size = SMOKE_BATCH if smoke else BATCH
            backend_name = sdpa_backend(spec, batch_size, device)
            res = common.race(spec, batch_size, rounds, VARIANTS, backend=backend, device=device, deadline=deadline)
            common.add_mfu(res, model_flops_per_token(spec), result["peak"]["flops"])
            res["sdpa_backend"] = backend_name
            result["configs"][key] = res
            torch._dynamo.reset()  # the next shape compiles afresh, never against this one's recompile limit
            common.free(device)  # this shape's models are gone: collect them and hand their blocks back
            result["seconds"] = time.perf_counter() - t0
            if done is not None:
                done(result, key)
    result["seconds"] = time.perf_counter() - t0
    return result


def format_result(result: dict) -> str:
    gpu = result["gpu"]
    if gpu is None:
        where = f"CPU ({result['machine']['cpu']}), smoke run"
    else:
        sm = "".join(str(x) for x in gpu["capability"])
        where = f"{gpu['name']} (sm {sm}, {gpu['memory_gib']:.0f} GiB, CUDA {gpu['cuda']})"
    versions = result["machine"]["versions"]
    lines = [
        f"Device: {where}; torch {versions['torch']}, kilolayer {versions['kilolayer']}, torchscale "
        f"{versions['torchscale']}, x-transformers {versions['x-transformers']}",
        f"bf16 peak for MFU: {result['peak']['flops']['bf16'] / 1e12:,.1f} TFLOP/s ({result['peak']['source']['bf16']})"
        f"; compile backend {result['compile_backend']}, {result['compile_cache']} cache; "
        f"total {result['seconds'] / 60:.1f} min (variants not started within {result['budget_min']:g} min are "
        "skipped)",
    ]
    for key in result["configs"]:
        lines += ["", format_shape(result, key)]
    return "\n".join(lines)


def format_shape(result: dict, key: str) -> str:
    res = result["configs"][key]
    spec = res["spec"]
    return "\n".join(
        [
            f"### {res['label']}, seq {spec['seq_len']}, batch {res['batch_size']}, vocabulary {spec['vocab']} "
            f"({spec['scheme']}, decoder-only; {res['rounds']} rounds; best peer fast path: {res['best_peer_fast']}; "
            f"SDPA kernel: {res.get('sdpa_backend', 'not recorded')})",
            "",
            common.format_race(res, COLUMNS),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--rounds", type=int, help=f"timed rounds per shape (default {ROUNDS}; smoke {SMOKE_ROUNDS})")
    parser.add_argument(
        "--budget-min",
        type=float,
        default=BUDGET_MIN,
        help=f"start no variant after this many minutes; it is skipped with a note (default {BUDGET_MIN:g})",
    )
    parser.add_argument("--config", action="append", help=f"only this shape ({', '.join(CONFIGS)}); repeatable")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            f"python -m benchmarks.gpu: no CUDA device here (torch {torch.__version__}); run it on a GPU machine, "
            "or add --smoke for the tiny CPU check",
            file=sys.stderr,
        )
        return 2
    common.apply_threads(args.threads)

    def done(result: dict, key: str) -> None:  # a run cut short by its host keeps the shapes it finished
        print(format_shape(result, key), "\n", flush=True)
        if args.out:
            common.write_json(args.out, result)

    result = run(args.smoke, args.rounds, args.budget_min, args.config, done)
    return common.finish(result, format_result(result), args.out)


if __name__ == "__main__":
    sys.exit(main())
