"""The precision a run trains at (:func:`policy`): ``train.precision`` as given, or ``auto`` decided once, at the
run's start.

``auto`` is bf16 where bf16 matrix products are fast, and fp32 elsewhere:

* on CUDA, bf16 where the GPU supports it (``torch.cuda.is_bf16_supported``);
* on a CPU, bf16 only where the CPU has bf16 instructions (AVX512-BF16 or AMX as torch reports them, else the
  ``/proc/cpuinfo`` flags: :func:`cpu_bf16`) *and* a short GEMM at the model's width runs faster under bf16
  autocast than in fp32 (:func:`gemm_speedup`, a ratio above 1). Without those instructions autocast emulates
  bf16, many times slower than fp32, so nothing is measured. The ratio is measured once per CPU model, thread
  count, width and torch version and cached in ``precision.json`` of the cache folder (``$KILOLAYER_CACHE``, else
  ``~/.cache/kilolayer``; delete it to measure again), so the runs of one study on one machine decide alike.

A run records its precision and the reason (status.json ``precision`` and ``precision_reason``, its checkpoints'
state.json ``precision``) and a resume of an ``auto`` run reuses it: bf16 and fp32 steps differ in their last
bits, so deciding again mid-run would break a bit-exact resume. A precision given as fp32 or bf16 is never
overridden; ``train.precision: fp32`` is the one flag for runs bit-comparable with fp32 runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kilolayer.train.host.peak import BF16_CPU_FLAGS, _cache_lock, _read_cache, _write_cache, cpu_flags, cpu_model

AUTO = "auto"
#: the precisions a step runs at (what ``auto`` resolves to)
PRECISIONS = ("fp32", "bf16")
CACHE_FILE = "precision.json"
#: how a precision was chosen (:attr:`Precision.source`)
GIVEN, RECORDED, DECIDED = "given", "recorded", "auto"
#: the FLOPs of one product of the speed test, at most (its rows shrink as the width grows)
GEMM_FLOPS = 2e9


@dataclass(frozen=True)
class Precision:
    """The precision a run's steps run at (``value``: fp32 | bf16), why (``reason``, one line), and how it was
    chosen (``source``: given, auto, or recorded by the run being resumed)."""

    value: str
    reason: str
    source: str = GIVEN

    def line(self) -> str:
        """The line a run prints at its start."""
        how = "; the run's own, reused on resume" if self.source == RECORDED else ""
        return f"kilolayer: precision {self.value} ({self.reason}{how})"


def cpu_bf16() -> tuple[bool, str]:
    """(whether this CPU computes in bf16, what it has in words): the bf16 instructions torch finds (AVX512-BF16,
    AMX) or ``/proc/cpuinfo`` lists (:data:`~kilolayer.train.host.peak.BF16_CPU_FLAGS`); without any, torch's
    vector capability (``avx2``, ``avx512``, ``default``)."""
    found = []
    for name, probe in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_bf16", "_is_amx_tile_supported")):
        with contextlib.suppress(AttributeError, RuntimeError):
            if getattr(torch.cpu, probe)():
                found.append(name)
    found += [f for f in BF16_CPU_FLAGS if f in (cpu_flags() or set()) and f not in found]
    if found:
        return True, ", ".join(found)
    try:
        capability = torch.backends.cpu.get_cpu_capability().lower()
    except (AttributeError, RuntimeError):
        capability = "capability unknown"
    return False, capability


def _fastest(fn: Callable[[], object], seconds: float) -> float:
    """The fastest of repeated calls of ``fn`` (at least 3) within about ``seconds``."""
    fn()  # warm up (and let oneDNN pick its kernel)
    best, reps, until = float("inf"), 0, time.perf_counter() + seconds
    while reps < 3 or time.perf_counter() < until:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


def gemm_speedup(width: int, seconds: float = 0.4) -> float:
    """fp32 time over bf16 time of one feed-forward GEMM at ``width`` (rows x width times width x 4 width), the bf16
    one under autocast as a training step runs it (the fp32 operands cast on every call), each the fastest of
    repeated products within about ``seconds`` / 2. Above 1: bf16 is faster. The operands come from a private
    generator: the global random streams do not move."""
    rows = max(64, min(1024, int(GEMM_FLOPS // (8 * width * width))))
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, width, generator=gen)
    w = torch.randn(width, 4 * width, generator=gen)

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.mm(a, w)

    return _fastest(lambda: torch.mm(a, w), seconds / 2) / _fastest(bf16, seconds / 2)


def cached_speedup(width: int) -> float:
    """:func:`gemm_speedup` at ``width`` from the cache, measured and cached on the first call for this CPU model,
    thread count, width and torch version (two processes starting together measure once)."""
    from kilolayer.data.cache import cache_dir

    threads = torch.get_num_threads()
    key = f"cpu|{cpu_model()}, {threads} thread{'s' * (threads != 1)}|width {width}|torch {torch.__version__}"
    path = cache_dir() / CACHE_FILE
    entry = _read_cache(path).get(key)
    if not _usable(entry):
        with _cache_lock(path):
            entry = _read_cache(path).get(key)  # another process may have measured meanwhile
            if not _usable(entry):
                entry = {"speedup": gemm_speedup(width), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                _write_cache(path, key, entry)  # a read-only cache folder: measured again next time
    return float(entry["speedup"])


def _usable(entry) -> bool:
    value = entry.get("speedup") if isinstance(entry, dict) else None
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def auto(device: str | torch.device, width: int) -> Precision:
    """``train.precision: auto`` decided on ``device`` for a model of ``width`` (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return Precision("bf16", f"auto: {name} computes in bf16", DECIDED)
        return Precision("fp32", f"auto: {name} does not compute in bf16", DECIDED)
    if device.type != "cpu":
        return Precision("fp32", f"auto: bf16 is chosen only on a CPU or CUDA, not on {device.type}", DECIDED)
    has, what = cpu_bf16()
    if not has:
        return Precision("fp32", f"auto: this CPU has no bf16 instructions ({what})", DECIDED)
    ratio = cached_speedup(width)
    if ratio > 1:
        return Precision("bf16", f"auto: bf16 GEMM {ratio:.2f}x fp32 at width {width}", DECIDED)
    return Precision("fp32", f"auto: bf16 GEMM {ratio:.2f}x fp32 at width {width}, not faster ({what})", DECIDED)


def policy(asked: str, device: str | torch.device, width: int, recorded: Precision | None = None) -> Precision:
    """The precision of a run that asks for ``asked`` (``train.precision``): fp32 or bf16 as given; ``auto``: the
    precision the run being resumed recorded (``recorded``), else :func:`auto`."""
    if asked != AUTO:
        return Precision(asked, "train.precision", GIVEN)
    if recorded is not None:
        return Precision(recorded.value, recorded.reason, RECORDED)
    return auto(device, width)
