"""Shared pieces of the benchmarks: the training step, the GEMM peak, machine facts, tables and JSON."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.peers import LM, Spec, batch, versions
from kilolayer.train import metrics

PRECISIONS = ("fp32", "bf16")


# ---------------------------------------------------------------- the training step


@dataclass(frozen=True)
class StepOptions:
    """The training-loop switches, with the meaning of the training loop's ``train.*`` keys.

    ``precision``: ``fp32``, or ``bf16`` = the forward under CPU bf16 autocast (the
    loss on fp32 logits) with fp32 weights, gradients and optimizer state (``train.precision``).
    ``compile``: ``torch.compile`` applied to each layer in place (``train.compile``).
    ``fused_optimizer``: AdamW's fused kernel, else its foreach one, instead of
    the per-tensor loop (``train.fused_optimizer``).
    """

    precision: str = "fp32"
    compile: bool = False
    fused_optimizer: bool = False

    def label(self) -> str:
        parts = [self.precision] + ["compile"] * self.compile + ["fused AdamW"] * self.fused_optimizer
        return " + ".join(parts)


EAGER = StepOptions()
FAST = StepOptions("bf16", True, True)


def make_optimizer(model: torch.nn.Module, fused: bool, lr: float = 1e-4) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not fused:
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=lr, foreach=True)


def compile_layers(model: LM, backend: str = "inductor") -> None:
    """torch.compile each layer in place (the stack's Python loop, embeddings and head stay eager).

    Static shapes: one process compiles several configs, and a shape change must not turn the next
    config's graph into a slower dynamic-shape one.
    """
    for layer in model.layer_modules():
        layer.compile(backend=backend, dynamic=False)


class TrainStep:
    """One training step (forward, LM head, cross-entropy, backward, AdamW) of ``model`` with ``options``.

    ``compile_backend`` other than inductor (``aot_eager``) only serves smoke runs: no C++ build.
    """

    def __init__(self, model: LM, options: StepOptions, lr: float = 1e-4, compile_backend: str = "inductor"):
        if options.precision not in PRECISIONS:
            raise ValueError(f"precision={options.precision!r}: expected one of {', '.join(PRECISIONS)}")
        self.model, self.options = model, options
        model.train()
        if options.compile:
            compile_layers(model, compile_backend)
        self.optimizer = make_optimizer(model, options.fused_optimizer, lr)

    def loss(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.options.precision == "bf16"):
            logits = self.model(*inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def __call__(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor) -> float:
        loss = self.loss(inputs, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def fixed_batch(spec: Spec, batch_size: int, seed: int = 0):
    return batch(spec, batch_size, torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- peak GEMM rate


def gemm_peak(dtype: torch.dtype, n: int = 2048, seconds: float = 1.0, rounds: int = 3) -> float:
    """Best large-GEMM rate (FLOP/s) of ``dtype`` on this CPU: max over ``rounds`` of the mean over ~``seconds``
    (the efficiency component's measurement, :func:`kilolayer.train.metrics.gemm_rate`, at benchmark sizes)."""
    return metrics.gemm_rate(dtype, n=n, seconds=seconds, rounds=rounds)


# ---------------------------------------------------------------- machine and provenance


def cpu_model() -> str:
    return metrics.cpu_model()


def cpu_flags() -> list[str]:
    """The instruction-set flags that matter for these kernels (AVX-512, AMX, bf16)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def machine() -> dict:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "flags": cpu_flags(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: other processes on the machine skew every timing."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---------------------------------------------------------------- timing


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- output


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A Markdown table of ``rows``; ``columns`` are (key, header); floats shown as given by ``fmt``."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, rule]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def write_json(path: str | Path, data: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2) + "\n")


def finish(result: dict, text: str, out: str | None) -> int:
    """A benchmark's end: print its table, write the raw results to ``out`` if given; exit code 0."""
    print(text)
    if out:
        write_json(out, result)
    return 0


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and 1-2 repetitions (finishes in seconds)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)"
    )


def apply_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
