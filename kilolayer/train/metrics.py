"""Training efficiency as a component of its own: tokens/s, model FLOP/s, MFU and peak memory.

Anything that times training steps can use it (the training loop, ``benchmarks/``)::

    peak = device_peak(device, "fp32")                    # kilolayer.train.host.peak: FLOP/s, and whence
    meter = Efficiency(peak, device)
    meter.add(tokens, flops)                              # after each step: its tokens and model FLOPs
    with meter.paused():                                  # evaluation, checkpoints: not training time
        ...
    meter.report()  # {"tokens_per_s", "flops_per_s", "mfu", "peak_mem_gib", "train_s"} since the previous report

* **Model FLOPs** are those of docs/bamboo.md#model-flops-and-mfu, counted per step by the objective
  (``Objective.train_flops``) from the batch's shapes: 6 x matmul weights x the tokens they act on +
  12 x layers x width x query length x key length (:func:`kilolayer.nn.budget.training_flops`), for the
  backbone and for the heads and towers the objective runs, on the tokens each runs on. Non-matmul work
  is not counted. With a frozen backbone (a linear probe) the backbone only runs forward: a third of its
  training FLOPs.
* **MFU** = model FLOP/s / (peak FLOP/s x processes).
* **Peak FLOP/s**: a :class:`Peak` given from outside: the run's is :func:`kilolayer.train.host.peak.device_peak`'s
  (``train.peak_flops``, a vendor's figure, or a measured and cached GEMM rate).
* **Peak memory**: on CPU the process's peak resident set (VmHWM, else
  ``ru_maxrss``); on CUDA ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 2**30


# ---------------------------------------------------------------- model FLOPs


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, processes: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of ``processes`` devices."""
    return tokens_per_s * flops_per_token / (peak_flops * processes)


# ---------------------------------------------------------------- peak FLOP/s (kilolayer.train.host.peak)


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s that MFU divides by, and where the figure came from."""

    flops: float  # FLOP/s of one device
    source: str  # "train.peak_flops", "vendor: NVIDIA H200 bf16", "measured: ...", "cached: ..."


# ---------------------------------------------------------------- peak memory


def _proc_status(field: str) -> int | None:
    """A size field of /proc/self/status in bytes (None where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss() -> int:
    """This process's peak resident set size in bytes: VmHWM (it belongs to the address space the process got
    at exec; ``ru_maxrss``, the fallback, carries a forking parent's peak over into the child)."""
    hwm = _proc_status("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def peak_memory(device: str | torch.device) -> int:
    """Peak memory in bytes: ``max_memory_allocated`` on CUDA, the process's peak RSS on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss()


# ---------------------------------------------------------------- the meter


class Efficiency:
    """Tokens/s, model FLOP/s, MFU and peak memory over windows of training time.

    Each step adds its tokens and its model FLOPs (the trainer: the objective's ``train_flops``); a window
    without FLOPs reports no FLOP/s or MFU. ``processes`` devices share the counted tokens and FLOPs. ``clock``
    is for tests.
    """

    def __init__(
        self,
        peak: Peak,
        device: str | torch.device = "cpu",
        processes: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.peak, self.device = peak, torch.device(device)
        self.processes, self.clock = processes, clock
        self.tokens = 0
        self.flops = 0.0
        self.paused_s = 0.0
        self.t0 = clock()

    def add(self, tokens: int, flops: float = 0.0) -> None:
        """One step's tokens and model FLOPs (all processes together)."""
        self.tokens += int(tokens)
        self.flops += float(flops)

    @contextlib.contextmanager
    def paused(self):
        """Time inside is not training time (evaluation, diagnostics, checkpoints)."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.paused_s += self.clock() - t0

    def report(self) -> dict:
        """Rates over the training time since the previous report (or the start), then a new window."""
        now = self.clock()
        seconds = max(now - self.t0 - self.paused_s, 1e-9)
        rate = self.tokens / seconds
        out = {"tokens_per_s": rate, "train_s": seconds}
        if self.flops > 0:
            out["flops_per_s"] = self.flops / seconds  # all processes together
            out["mfu"] = out["flops_per_s"] / (self.peak.flops * self.processes)
        out["peak_mem_gib"] = peak_memory(self.device) / GIB
        self.tokens, self.flops, self.paused_s, self.t0 = 0, 0.0, 0.0, now
        return out


def finite_positive(x) -> bool:
    """A finite number above 0 (not a bool, not an integer too large for a float), as read from JSON."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x) and x > 0
    except OverflowError:
        return False


def summarize(records: Iterable[dict]) -> dict:
    """A run's efficiency from its train records: ``tokens_per_s`` and ``mfu`` over its whole training time, each
    record weighted by the training seconds it covers (``train_s``; one second where absent), and the largest
    ``peak_mem_gib``. Keys without any value are left out."""
    train = [r for r in records if r.get("split", "train") == "train"]
    rows = [(r, float(r["train_s"]) if finite_positive(r.get("train_s")) else 1.0) for r in train]
    out = {}
    for key in ("tokens_per_s", "mfu"):
        scored = [(float(r[key]), w) for r, w in rows if finite_positive(r.get(key))]
        if scored:
            out[key] = sum(v * w for v, w in scored) / sum(w for _, w in scored)
    mem = [float(r["peak_mem_gib"]) for r in train if finite_positive(r.get("peak_mem_gib"))]
    if mem:
        out["peak_mem_gib"] = max(mem)
    return out
