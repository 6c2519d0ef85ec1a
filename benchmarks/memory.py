"""Peak memory of a training step vs depth, with and without activation checkpointing.

Each point runs in its own subprocess: build the model, run two fp32 training
steps (forward + LM head + cross-entropy + backward + AdamW; the second step
holds AdamW state and activations at once) and report the process's peak
resident set size (VmHWM), next to its size right after the imports.
kilolayer checkpoints through ``kilolayer.train.parallelize`` with
``kilolayer.train.host.heap``'s trim (as its trainer does for ``model.checkpoint_activations``), torchscale through its
``checkpoint_activations`` flag (fairscale); x-transformers has no
checkpointing. Also: a 500L-500L width-64 DeepNorm encoder-decoder.

    python -m benchmarks.memory [--smoke] [--depths 12,100,1000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.peers import Spec

GiB = 1024**3
ROOT = Path(__file__).resolve().parent.parent

SWEEP = Spec(arch="decoder", scheme="deepnorm", width=64, heads=2, ffn=256, seq_len=128, vocab=256)
ENCDEC = Spec(
    arch="encoder_decoder",
    scheme="deepnorm",
    layers=500,
    decoder_layers=500,
    width=64,
    heads=2,
    ffn=256,
    seq_len=128,
    vocab=256,
    checkpoint=True,
)
BATCH = 8
DEPTHS = (12, 100, 1000)
PEER_DEPTHS = (12, 100)
SMOKE_SWEEP = Spec(arch="decoder", scheme="deepnorm", width=16, heads=2, ffn=32, seq_len=8, vocab=32)
SMOKE_ENCDEC = Spec(
    arch="encoder_decoder",
    scheme="deepnorm",
    layers=2,
    decoder_layers=2,
    width=16,
    heads=2,
    ffn=32,
    seq_len=8,
    vocab=32,
    checkpoint=True,
)
SMOKE_DEPTHS = (2,)
# points whose extrapolated peak exceeds this are skipped, not run
DEFAULT_CAP_GIB = 12.0
# kilolayer's deepest checkpointed points are measured again under each of these environments, to show what
# the default heap trim (train.trim_heap_every, kilolayer.train.host.heap.HeapTrimmer) saves against none
# ("before") and against the opt-in train.pin_mmap, in memory and in step time
VARIANTS = {
    "untrimmed": {"KILOLAYER_TRIM_HEAP": "0"},
    "pinned": {"KILOLAYER_PIN_MMAP": "1", "KILOLAYER_TRIM_HEAP": "0"},  # the pin alone, instead of the trim
}
#: switches of kilolayer's allocator behaviour that a user's environment must not pass into the default column
_SWITCHES = ("KILOLAYER_TRIM_HEAP", "KILOLAYER_PIN_MMAP")


def _status(field: str) -> int | None:
    """A size field of /proc/self/status, in bytes (None where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_now() -> int:
    return _status("VmRSS") or 0


def _peak_rss() -> int:
    """This process's peak resident set size (VmHWM; see :func:`kilolayer.train.metrics.peak_rss`)."""
    from kilolayer.train.metrics import peak_rss

    return peak_rss()


def run_point(peer: str, spec: Spec, batch_size: int, steps: int = 2) -> dict:
    """In THIS process: build, train ``steps`` steps, report RSS figures (call it in a fresh process)."""
    import torch

    from benchmarks.common import EAGER, TrainStep, fixed_batch
    from benchmarks.peers import build

    if peer == "torchscale":
        from benchmarks.peers import install_timm_stub

        install_timm_stub()
        import torchscale.architecture.decoder  # noqa: F401 - import cost belongs to the baseline
    elif peer == "x-transformers":
        import x_transformers  # noqa: F401
    baseline = _rss_now()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build(peer, spec)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    after_build = _rss_now()
    step = TrainStep(model, EAGER)
    inputs, targets = fixed_batch(spec, batch_size)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(inputs, targets)
        times.append(time.perf_counter() - t0)
    return {
        "peak_rss": _peak_rss(),
        "baseline_rss": baseline,
        "after_build_rss": after_build,
        "parameters": params,
        "build_s": build_s,
        "step_s": times[-1],
        "first_step_s": times[0],
    }


def measure(
    peer: str, spec: Spec, batch_size: int, threads: int = 1, timeout: float = 900, extra_env: dict | None = None
) -> dict:
    """Run one point in a fresh interpreter (``threads`` torch threads); its figures, or its error in one line."""
    payload = json.dumps({"peer": peer, "spec": spec.to_dict(), "batch_size": batch_size})
    env = {**{k: v for k, v in os.environ.items() if k not in _SWITCHES}, **(extra_env or {})}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(threads)
    row = {
        "peer": peer,
        "layers": spec.layers,
        "decoder_layers": spec.decoder_layers,
        "arch": spec.arch,
        "checkpoint": spec.checkpoint,
        "label": spec.label(),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.memory", "--point", payload, "--threads", str(threads)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired:
        row["error"] = f"timed out after {timeout:.0f} s"
        return row
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        row["error"] = err[:300]
        return row
    row.update(json.loads(lines[-1]))
    if "error" not in row:
        row["peak_gib"] = row["peak_rss"] / GiB
        row["baseline_gib"] = row["baseline_rss"] / GiB
        row["above_baseline_gib"] = (row["peak_rss"] - row["baseline_rss"]) / GiB
        # parameters + gradients + AdamW's two moments, 4 bytes each
        row["weights_and_adam_gib"] = 16 * row["parameters"] / GiB
    return row


def _extrapolate(rows: list[dict], layers: int) -> float | None:
    pts = [(r["layers"], r["peak_gib"]) for r in rows if "peak_gib" in r]
    if len(pts) < 2:
        return None
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    if x1 == x0:
        return None
    return y1 + (y1 - y0) / (x1 - x0) * (layers - x1)


def _add_variants(row: dict, peer: str, spec: Spec, batch_size: int, threads: int) -> None:
    """Measure ``row``'s point again under each of :data:`VARIANTS`: ``peak_gib_<name>``, ``step_s_<name>``."""
    for name, env in VARIANTS.items():
        other = measure(peer, spec, batch_size, threads, extra_env=env)
        row[f"peak_gib_{name}"] = other.get("peak_gib")
        row[f"step_s_{name}"] = other.get("step_s")


def series(
    peer: str, spec: Spec, depths, batch_size: int, cap_gib: float, threads: int, variants: bool = False
) -> list[dict]:
    """One curve of peak memory vs depth; ``variants`` also measures the deepest point untrimmed and with
    the mmap-threshold pin (:data:`VARIANTS`)."""
    rows: list[dict] = []
    for n in depths:
        guess = _extrapolate(rows, n)
        if guess is not None and guess > cap_gib:
            rows.append(
                {
                    "peer": peer,
                    "layers": n,
                    "decoder_layers": 0,
                    "arch": spec.arch,
                    "checkpoint": spec.checkpoint,
                    "label": spec.with_(layers=n).label(),
                    "skipped": f"extrapolated peak {guess:.1f} GiB > cap {cap_gib:.0f} GiB",
                }
            )
            continue
        row = measure(peer, spec.with_(layers=n), batch_size, threads)
        if variants and n == max(depths) and "peak_gib" in row:
            _add_variants(row, peer, spec.with_(layers=n), batch_size, threads)
        rows.append(row)
    return rows


def run(
    smoke: bool = False,
    depths=None,
    peer_depths=None,
    cap_gib: float = DEFAULT_CAP_GIB,
    encdec: bool = True,
    threads: int = 1,
) -> dict:
    sweep = SMOKE_SWEEP if smoke else SWEEP
    depths = tuple(depths or (SMOKE_DEPTHS if smoke else DEPTHS))
    peer_depths = tuple(peer_depths or (SMOKE_DEPTHS[:1] if smoke else PEER_DEPTHS))
    batch_size = 2 if smoke else BATCH
    t0 = time.perf_counter()
    result: dict = {
        "machine": common.machine(),
        "load_before": common.load_average(),
        "batch_size": batch_size,
        "threads": threads,
        "sweep_spec": sweep.to_dict(),
        "rows": [],
    }
    # torchscale, the one peer with checkpointing, follows kilolayer's checkpointed curve to the deepest point; a
    # smoke run (a fresh interpreter a point, seconds each) measures the checkpointed curves and kilolayer's plain
    # one, the variants on kilolayer's deepest decoder point alone
    plan = [("kilolayer", True, depths), ("kilolayer", False, depths), ("torchscale", True, depths)]
    if not smoke:
        plan += [("torchscale", False, peer_depths), ("x-transformers", False, peer_depths)]
    for peer, ckpt, ds in plan:
        variants = peer == "kilolayer" and ckpt
        result["rows"] += series(peer, sweep.with_(checkpoint=ckpt), sorted(ds), batch_size, cap_gib, threads, variants)
    if encdec:
        spec = SMOKE_ENCDEC if smoke else ENCDEC
        result["encoder_decoder_spec"] = spec.to_dict()
        row = measure("kilolayer", spec, batch_size, threads)
        if "peak_gib" in row and not smoke:
            _add_variants(row, "kilolayer", spec, batch_size, threads)
        result["encoder_decoder"] = [row]
    result["load_after"] = common.load_average()
    result["seconds"] = time.perf_counter() - t0
    return result


COLUMNS = [
    ("peer", "implementation"),
    ("label", "model"),
    ("checkpoint", "checkpointing"),
    ("peak_gib", "peak GiB"),
    ("peak_gib_untrimmed", "peak GiB, trim_heap_every 0 (before)"),
    ("peak_gib_pinned", "peak GiB, train.pin_mmap"),
    ("above_baseline_gib", "above imports GiB"),
    ("weights_and_adam_gib", "weights+grads+AdamW GiB"),
    ("step_s", "step s"),
    ("step_s_untrimmed", "step s, trim_heap_every 0"),
    ("step_s_pinned", "step s, train.pin_mmap"),
    ("note", "note"),
]


def _rows_for_table(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        r = dict(r)
        r["note"] = r.get("error") or r.get("skipped")
        out.append(r)
    return out


def format_result(result: dict) -> str:
    s = result["sweep_spec"]
    lines = [
        f"Decoder-only {s['scheme']}, width {s['width']}, heads {s['heads']}, FFN {s['ffn']}, seq {s['seq_len']}, "
        f"batch {result['batch_size']}, fp32, AdamW; peak = peak resident set size (VmHWM) of a fresh process "
        "over two steps "
        f"({result['threads']} torch thread(s) per process).",
        "",
        common.table(_rows_for_table(result["rows"]), COLUMNS),
    ]
    if result.get("encoder_decoder"):
        e = result["encoder_decoder_spec"]
        lines += [
            "",
            f"Encoder-decoder {e['scheme']} {e['layers']}L-{e['decoder_layers']}L, width {e['width']}, "
            f"heads {e['heads']}, FFN {e['ffn']}, source and target {e['seq_len']} tokens, "
            f"batch {result['batch_size']}:",
            "",
            common.table(_rows_for_table(result["encoder_decoder"]), COLUMNS),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one depth (finishes in seconds)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in each point's process (default 1: on a shared 2-core machine many small ops "
        "stall at 2 threads whenever another process holds a core; memory does not depend on it)",
    )
    parser.add_argument("--depths", help="comma-separated depths, checkpointed or not (default 12,100,1000)")
    parser.add_argument(
        "--peer-depths", help="comma-separated depths for the peers without checkpointing (default 12,100)"
    )
    parser.add_argument(
        "--cap-gib",
        type=float,
        default=DEFAULT_CAP_GIB,
        help="skip points whose extrapolated peak exceeds this (default 12)",
    )
    parser.add_argument("--no-encdec", action="store_true", help="leave out the 500L-500L encoder-decoder point")
    parser.add_argument("--point", help=argparse.SUPPRESS)  # internal: run one point in this process
    args = parser.parse_args(argv)
    if args.point:
        common.apply_threads(args.threads)
        p = json.loads(args.point)
        print(json.dumps(run_point(p["peer"], Spec(**p["spec"]), p["batch_size"])))
        return 0

    def ints(text):
        return [int(x) for x in text.split(",")] if text else None

    result = run(args.smoke, ints(args.depths), ints(args.peer_depths), args.cap_gib, not args.no_encdec, args.threads)
    return common.finish(result, format_result(result), args.out)


if __name__ == "__main__":
    sys.exit(main())
