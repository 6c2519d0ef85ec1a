"""Attention on a CPU under bf16: forward + backward of ``model.cpu_attention``'s three ways, side by side.

For each shape (batch x heads x length x head size, causal and not), the three ways attend the same bf16 Q, K
and V in turn, one call each per round (the order rotates), and the table gives the fastest round's
milliseconds and each way's ratio to ``fp32``:

* ``products``: :func:`kilolayer.nn.attention.matmul_attention`, what ``auto`` runs up to
  :data:`~kilolayer.nn.attention.MATMUL_MAX_KEYS` keys;
* ``fp32``: SDPA on Q, K and V cast to fp32, what ``auto`` runs beyond;
* ``sdpa``: SDPA in bf16.

The crossover length this measures is the one ``auto`` uses.

    python -m benchmarks.attention [--smoke] [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks import common
from kilolayer.nn.attention import MATMUL_MAX_KEYS, matmul_attention

#: (batch, heads, length, head size): the benchmark's two models at seq 128, then longer sequences
SHAPES = [(16, 4, 128, 64), (16, 2, 128, 64), (16, 8, 128, 16), (4, 8, 256, 32), (8, 4, 512, 64), (2, 4, 1024, 64)]
SMOKE_SHAPES = [(2, 2, 16, 8)]
ROUNDS, SMOKE_ROUNDS = 5, 1


def _fp32(q, k, v, causal):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal).to(q.dtype)


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _products(q, k, v, causal):
    return matmul_attention(q, k, v, None, 0.0, causal)


WAYS = {"products": _products, "fp32": _fp32, "sdpa": _sdpa}


def measure(shape: tuple[int, int, int, int], causal: bool, rounds: int, seed: int = 0) -> dict:
    """The fastest forward + backward of each way at ``shape``, in milliseconds, over ``rounds`` rounds."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(*shape, generator=g).bfloat16() for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    best = dict.fromkeys(WAYS, float("inf"))
    names = list(WAYS)
    for name in names:  # warm-up
        WAYS[name](q, k, v, causal).backward(grad)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            WAYS[name](q, k, v, causal).backward(grad)
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: 1000 * s for name, s in best.items()}


def run(smoke: bool = False, threads: int | None = None) -> dict:
    if threads:
        torch.set_num_threads(threads)
    rounds = SMOKE_ROUNDS if smoke else ROUNDS
    rows = [
        {"shape": shape, "causal": causal, "ms": measure(shape, causal, rounds)}
        for shape in (SMOKE_SHAPES if smoke else SHAPES)
        for causal in (False, True)
    ]
    return {
        "machine": common.machine(),
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "max_keys": MATMUL_MAX_KEYS,
        "rows": rows,
    }


def format_result(result: dict) -> str:
    lines = [
        f"Forward + backward of one attention call on bf16 Q, K and V, fastest of {result['rounds']} rounds, "
        f"{result['threads']} thread(s); `auto` attends as products up to {result['max_keys']} keys.",
        "",
        "| batch x heads x length x head size | mask | products ms | fp32 SDPA ms | bf16 SDPA ms "
        "| products / fp32 time |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        ms = row["ms"]
        lines.append(
            f"| {' x '.join(map(str, row['shape']))} | {'causal' if row['causal'] else 'none'} | "
            f"{ms['products']:.1f} | {ms['fp32']:.1f} | {ms['sdpa']:.1f} | {ms['products'] / ms['fp32']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny shape, one round (finishes in a second)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--out", help="write the results as JSON to FILE")
    args = parser.parse_args(argv)
    result = run(args.smoke, args.threads)
    print(format_result(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
