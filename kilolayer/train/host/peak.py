"""The peak FLOP/s that MFU divides by, for one device and precision (:func:`device_peak`).

``train.peak_flops`` when given; on CUDA the vendor's dense figure for the GPUs in :data:`VENDOR_PEAKS` (bf16;
fp32 counts as TF32 where PyTorch lets matmuls use TF32, else as plain FP32), any other GPU measured; on a CPU
the best GEMM rate of the run's dtype, measured once per machine (:func:`cpu_peak`: the fastest single product
within about 1.5 s, sized so one product never takes long even where a dtype is emulated; with several threads
at least threads x the one-thread rate) and cached in ``peak_flops.json`` of the cache folder
(``$KILOLAYER_CACHE``, else ``~/.cache/kilolayer``), keyed by CPU model, torch threads, dtype and torch version.
A figure measured while the machine was busy (1-minute load average of :data:`BUSY_LOAD` or more per CPU) is
measured again by the first run that finds it quieter, and the higher figure kept. Delete that file to measure
again. The measurement uses its own random generator: training's RNG streams are untouched.

The run (:class:`kilolayer.train.run.Run`) asks for its device's peak once, before any step is timed, and hands
it to the efficiency meter (:class:`kilolayer.train.metrics.Efficiency`); ``benchmarks/`` use the same figures.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kilolayer.files import write_atomic
from kilolayer.train.host.threads import torch_threads, usable_cpus
from kilolayer.train.metrics import Peak, finite_positive

CACHE_FILE = "peak_flops.json"

# dense (no sparsity) tensor-core figures from the vendors' data sheets, FLOP/s: (bf16, tf32, fp32).
# Matched against torch.cuda.get_device_name, most specific name first.
VENDOR_PEAKS: list[tuple[str, tuple[float, float, float]]] = [
    ("H200 NVL", (835.5e12, 417.5e12, 60e12)),
    ("H200", (989e12, 494.5e12, 67e12)),  # SXM
    ("H100 NVL", (835e12, 417.5e12, 60e12)),
    ("H100 PCIe", (756e12, 378e12, 51e12)),
    ("H100", (989e12, 494.5e12, 67e12)),  # SXM
    ("A100", (312e12, 156e12, 19.5e12)),
    ("L40S", (362.05e12, 183e12, 91.6e12)),
    ("L4", (121e12, 60e12, 30.3e12)),
    ("A10", (125e12, 62.5e12, 31.2e12)),
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_rate(
    dtype: torch.dtype, n: int = 2048, seconds: float = 1.0, rounds: int = 3, device: str | torch.device = "cpu"
) -> float:
    """Best large-GEMM rate (FLOP/s) of ``dtype`` at size ``n``: max over ``rounds`` of the mean over ~``seconds``.
    The operands come from a private generator, so the global RNG streams do not move."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    torch.mm(a, b, out=out)  # warm up (and let oneDNN / cuBLAS pick its kernel)
    _sync(device)
    best = 0.0
    for _ in range(rounds):
        reps, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            reps += 1
            _sync(device)
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        best = max(best, 2 * n**3 * reps / dt)
    return best


def quick_gemm_rate(
    dtype: torch.dtype, budget_s: float = 1.5, n_max: int = 2048, device: str | torch.device = "cpu"
) -> tuple[float, int]:
    """(FLOP/s, n): the fastest single ``n x n`` product of ``dtype``, over sizes 256, 512, ... up to ``n_max``,
    within about ``budget_s`` seconds. The best single product, not a mean: on a machine that other processes
    keep busy, some products still run undisturbed, and a peak is what the hardware can do. Bounded in time even
    where a dtype is emulated (bf16 without AVX512-BF16 or AMX runs a hundred times slower than fp32): a size
    is not tried once one product of it would take more than ``budget_s`` / 8."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    deadline = time.perf_counter() + budget_s
    best, best_n, n = 0.0, 256, 256
    while True:
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype, device=device)
        torch.mm(a, b, out=out)  # warm up (and let oneDNN / cuBLAS pick its kernel)
        _sync(device)
        until = min(deadline, time.perf_counter() + budget_s / 4)
        fastest, reps = math.inf, 0
        while reps < 3 or time.perf_counter() < until:
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            _sync(device)
            fastest = min(fastest, time.perf_counter() - t0)
            reps += 1
        if 2 * n**3 / fastest > best:
            best, best_n = 2 * n**3 / fastest, n
        if n >= n_max or time.perf_counter() >= deadline or 8 * fastest > budget_s / 8:
            return best, best_n
        n *= 2


def cpu_peak(dtype: torch.dtype, budget_s: float = 1.5) -> tuple[float, int]:
    """(FLOP/s, n) of this CPU at torch's thread count: the larger of the measured multi-threaded rate and
    threads (at most the usable CPUs) x the measured one-thread rate. On a machine that other processes keep
    busy, every multi-threaded product waits for a descheduled thread, and the measurement would fall far
    below what the cores can do (MFU above 100%); one thread still finds undisturbed moments."""
    threads = torch.get_num_threads()
    if threads == 1:
        return quick_gemm_rate(dtype, budget_s)
    flops, n = quick_gemm_rate(dtype, budget_s / 2)
    with torch_threads(1):
        single, n1 = quick_gemm_rate(dtype, budget_s / 2)
    scaled = single * min(threads, usable_cpus())
    return (flops, n) if flops >= scaled else (scaled, n1)


def vendor_peak(name: str, precision: str, tf32: bool) -> float | None:
    """The vendor's dense figure for a GPU called ``name`` in ``precision`` (fp32 as TF32 if ``tf32``)."""
    for key, (bf16, tf32_peak, fp32) in VENDOR_PEAKS:
        # a whole-word match, first in the table's order: "L4" is not an "L40", "H200" not an "H200 NVL"
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name, re.IGNORECASE):
            return bf16 if precision == "bf16" else tf32_peak if tf32 else fp32
    return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: CPU flags (``/proc/cpuinfo``) of instructions that compute in bf16: x86's AVX512-BF16 and AMX, Arm's BF16
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm); None where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    except OSError:
        pass
    return None


def cpu_bf16_warning(precision: str, device: torch.device, flags: set[str] | None = None) -> str | None:
    """A warning when ``precision`` is bf16 on a CPU without bf16 instructions, where autocast's bf16 matrix
    products are emulated and run many times slower than fp32 (figures: docs/benchmarks.md); None otherwise, or
    where the flags are unknown."""
    if precision != "bf16" or torch.device(device).type != "cpu":
        return None
    flags = cpu_flags() if flags is None else flags
    if flags is None or flags & set(BF16_CPU_FLAGS):
        return None
    return (
        f"train.precision: bf16 on a CPU without bf16 instructions ({cpu_model()}: none of "
        f"{', '.join(BF16_CPU_FLAGS)}): autocast emulates bf16 here and is much slower than fp32; use "
        "train.precision: fp32 on this machine"
    )


def _cache_path() -> Path:
    from kilolayer.data.cache import cache_dir

    return cache_dir() / CACHE_FILE


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):  # unreadable, not JSON, nested past the parser's depth
        return {}


@contextlib.contextmanager
def _cache_lock(path: Path):
    """Serialise measurements between processes (two runs starting together must not time each other)."""
    import fcntl

    fd = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        fd = None  # a read-only cache folder: measure without the lock
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _write_cache(path: Path, key: str, entry: dict) -> None:
    data = {**_read_cache(path), key: entry}
    # a read-only or full cache folder, or a file where it should be: measured again next time
    with contextlib.suppress(OSError):
        write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def measured_peak(device: torch.device, precision: str, measure: Callable[[], tuple[float, int]] | None = None) -> Peak:
    """The GEMM peak of ``precision`` on ``device`` (CPU, or a GPU without a vendor figure) from the cache,
    measured and cached on the first call for this machine, thread count, dtype and torch version."""
    dtype = DTYPES[precision]
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        threads = torch.get_num_threads()
        where = f"{cpu_model()}, {threads} thread{'s' if threads != 1 else ''}"
    key = f"{device.type}|{where}|{precision}|torch {torch.__version__}"
    path = _cache_path()
    load = load_per_cpu() if device.type == "cpu" else None
    entry = _read_cache(path).get(key)
    if _stale(entry, load):
        with _cache_lock(path):
            entry = _read_cache(path).get(key)  # another process may have measured meanwhile
            if _stale(entry, load):
                if measure is None:
                    measure = (
                        (lambda: quick_gemm_rate(dtype, n_max=8192, device=device))
                        if device.type == "cuda"
                        else (lambda: cpu_peak(dtype))
                    )
                flops, n = measure()
                busy = entry if _usable(entry) else None
                entry = {"flops": flops, "n": n, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                if busy is not None and float(busy["flops"]) > flops:  # a peak: the busy figure was higher
                    entry["flops"] = float(busy["flops"])
                if load is not None:
                    entry["load_per_cpu"] = round(load, 2)
                _write_cache(path, key, entry)
                if entry["flops"] != flops:
                    return Peak(
                        entry["flops"],
                        f"cached: {precision} GEMM on {where} ({path}); measured again at a lower load, "
                        f"{flops:.3g} FLOP/s, below the cached figure, which stands",
                    )
                return Peak(flops, f"measured: {precision} GEMM {n}x{n} on {where}{_busy_note(load)}")
    note = _busy_note(entry.get("load_per_cpu"))
    return Peak(float(entry["flops"]), f"cached: {precision} GEMM on {where} ({path}){note}")


#: a CPU peak measured while the 1-minute load average per usable CPU was at least this is measured again (and
#: the higher figure kept) by the first run that finds the machine quieter than that
BUSY_LOAD = 0.75


def load_per_cpu() -> float | None:
    """The 1-minute load average over the usable CPUs; None where the system does not say."""
    try:
        return os.getloadavg()[0] / usable_cpus()
    except (AttributeError, OSError):
        return None


def _usable(entry) -> bool:
    return isinstance(entry, dict) and finite_positive(entry.get("flops"))


def _stale(entry, load: float | None) -> bool:
    """Whether a cache entry must be measured (again): missing or damaged, or taken on a busy machine that is
    quieter now (other processes' threads slow a GEMM down, so a busy figure can only be too low)."""
    if not _usable(entry):
        return True
    then = entry.get("load_per_cpu")
    return finite_positive(then) and then >= BUSY_LOAD and load is not None and load < BUSY_LOAD


def _busy_note(load) -> str:
    if finite_positive(load) and load >= BUSY_LOAD:
        return f"; measured at a load of {load:.2f} per CPU, measured again when the machine is quieter"
    return ""


def _tf32_allowed() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def device_peak(device: str | torch.device, precision: str, given: float | None = None) -> Peak:
    """Peak FLOP/s of one ``device`` for training in ``precision`` (fp32 | bf16): ``given`` (train.peak_flops)
    if set, else the vendor figure of a known GPU, else the measured (cached) GEMM peak."""
    if given:
        return Peak(float(given), "train.peak_flops")
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = precision == "fp32" and _tf32_allowed()
        figure = vendor_peak(name, precision, tf32)
        if figure is not None:
            kind = "tf32" if tf32 else precision
            return Peak(figure, f"vendor: {name} {kind} dense")
    return measured_peak(device, precision)


def peak_too_low(peak: Peak, mfu_value: float, step: int) -> str:
    """The warning for an MFU above 100%: the peak it divides by is too low, and how to fix that source."""
    if peak.source.startswith(("measured", "cached")):
        fix = (
            f"set train.peak_flops, or delete the cached figure ({CACHE_FILE} in the cache folder) to measure it again"
        )
    else:  # given, or a vendor's figure
        fix = "set train.peak_flops" if peak.source != "train.peak_flops" else "raise train.peak_flops"
    return (
        f"MFU {100 * mfu_value:.0f}% at step {step}: the peak of {peak.flops:.3g} FLOP/s ({peak.source}) is too low; "
        f"{fix}"
    )
