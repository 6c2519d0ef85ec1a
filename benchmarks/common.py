"""Shared pieces of the benchmarks: the training step, the side-by-side race (variants taking turns, ratios
against the peers), the GEMM peak, machine facts, tables and JSON."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.peers import LM, NotSupported, Spec, batch, build, versions
from kilolayer.train import host, metrics
from kilolayer.train.engine import apply_update, forward_backward

PRECISIONS = ("fp32", "bf16")
#: ``train.compile``'s modes: eager, each layer, the whole model
COMPILE_MODES = (False, "layers", "model")
COMPILE_LABELS = {"layers": "per-layer compile", "model": "whole-model compile"}
#: the libraries kilolayer races against
PEER_LIBRARIES = ("torchscale", "x-transformers")
#: a race's rematch (:func:`rematch`) takes every peer fast-path row whose median step time is within this
#: fraction of the fastest one's
REMATCH_PEER_SPREAD = 0.05


# ---------------------------------------------------------------- the training step


@dataclass(frozen=True)
class StepOptions:
    """The training-loop switches, with the meaning of the training loop's ``train.*`` keys.

    ``precision``: ``fp32``, or ``bf16`` = the forward under bf16 autocast of the model's device (the
    loss on fp32 logits) with fp32 weights, gradients and optimizer state (``train.precision``).
    ``compile`` (``train.compile``): ``False``; ``layers`` (``True`` means this): ``torch.compile`` applied to
    each layer in place; ``model``: to the whole model (backbone and LM head) once, in place.
    ``fused_optimizer``: AdamW's fused kernel instead of its multi-tensor (foreach) path, the trainer's
    default (``train.fused_optimizer``).
    """

    precision: str = "fp32"
    compile: bool | str = False
    fused_optimizer: bool = False

    def __post_init__(self):
        if self.compile is True:
            object.__setattr__(self, "compile", "layers")
        if not (self.compile is False or self.compile in ("layers", "model")):
            raise ValueError(f"compile={self.compile!r}: expected False, 'layers' or 'model'")

    def label(self) -> str:
        parts = [self.precision] + ([COMPILE_LABELS[self.compile]] if self.compile else [])
        return " + ".join(parts + ["fused AdamW"] * self.fused_optimizer)

    @property
    def fast(self) -> bool:
        """The fast path: a compile (either mode) and fused AdamW, in the run's fast precision (bf16 autocast
        where the machine's bf16 GEMM is at least as fast as its fp32 one, else fp32; :func:`choose_fast_precision`)."""
        return bool(self.compile) and self.fused_optimizer


def fast_modes(precision: str) -> dict[str, StepOptions]:
    """The fast path in ``precision`` under each compile mode (per layer, whole model)."""
    return {mode: StepOptions(precision, mode, True) for mode in ("layers", "model")}


EAGER = StepOptions()
#: the fast path on a machine with fast bf16 (AMX, a GPU), under each compile mode
FAST_MODES = fast_modes("bf16")
FAST, FAST_MODEL = FAST_MODES["layers"], FAST_MODES["model"]


def make_optimizer(model: torch.nn.Module, fused: bool, lr: float = 1e-4) -> torch.optim.Optimizer:
    """AdamW as the trainer makes it: the multi-tensor (foreach) path, its default, or the fused kernel
    (``train.fused_optimizer``); a device without the fused kernel is refused, not silently given another."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not fused:
        return torch.optim.AdamW(params, lr=lr, foreach=True)
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True)
    except (RuntimeError, ValueError) as err:
        raise NotSupported(f"fused AdamW: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def compile_layers(model: LM, backend: str = "inductor") -> None:
    """torch.compile each layer in place (the stack's Python loop, embeddings and head stay eager).

    Static shapes: one process compiles several configs, and a shape change must not turn the next
    config's graph into a slower dynamic-shape one. A layer list that holds lists of modules (x-transformers':
    norms, block, residual, which its forward calls one by one) has nothing to compile per layer: refused.
    """
    layers = model.layer_modules()
    if any(isinstance(layer, (nn.ModuleList, nn.ModuleDict)) for layer in layers):
        raise NotSupported("per-layer compile: its layers are lists of modules, not modules it calls")
    for layer in layers:
        layer.compile(backend=backend, dynamic=False)


def compile_model(model: LM, backend: str = "inductor") -> None:
    """torch.compile the whole model (embeddings, every layer, LM head) once, in place; static shapes as
    :func:`compile_layers`. The one compile that applies alike to every library (the peers' layer lists
    are not all modules that their forward calls)."""
    model.compile(backend=backend, dynamic=False)


class TrainStep:
    """One training step (forward, LM head, cross-entropy, backward, AdamW) of ``model`` with ``options``, on the
    device the model's parameters are on (autocast of that device type).

    ``compile_backend`` other than inductor (``aot_eager``) only serves smoke runs: no C++ build.
    """

    def __init__(self, model: LM, options: StepOptions, lr: float = 1e-4, compile_backend: str = "inductor"):
        if options.precision not in PRECISIONS:
            raise ValueError(f"precision={options.precision!r}: expected one of {', '.join(PRECISIONS)}")
        self.model, self.options = model, options
        self.device_type = next(model.parameters()).device.type
        model.train()
        if options.compile == "layers":
            compile_layers(model, compile_backend)
        elif options.compile == "model":
            compile_model(model, compile_backend)
        self.optimizer = make_optimizer(model, options.fused_optimizer, lr)

    def loss(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.options.precision == "bf16"):
            logits = self.model(*inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def __call__(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor) -> float:
        # the training engine's two halves; a timed step is a finished one (its loss read, its update applied)
        loss = forward_backward(
            [(inputs, targets)], lambda b: (self.loss(*b), targets.numel()), self.model.parameters()
        )
        apply_update(self.optimizer)
        if self.device_type == "cuda":
            torch.cuda.synchronize()  # the optimizer's kernels belong to this step's time
        return loss


def fixed_batch(spec: Spec, batch_size: int, seed: int = 0, device: str | torch.device = "cpu"):
    inputs, targets = batch(spec, batch_size, torch.Generator().manual_seed(seed))
    return tuple(x.to(device) for x in inputs), targets.to(device)


@contextlib.contextmanager
def fresh_compiles():
    """Compiles inside start from an empty inductor cache (a temporary one on disk) and with no graphs that
    dynamo compiled earlier in this process, so each compile time is a first compile's."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with fresh_cache():
        yield


# ---------------------------------------------------------------- the side-by-side race


@dataclass(frozen=True)
class Variant:
    """One row of a race: a library (``peer``) under training switches (``options``)."""

    name: str
    peer: str
    options: StepOptions
    bias: bool = True  # False: kilolayer without biases, as x-transformers' attention (its FFN keeps them)
    skip: str | None = None  # a one-line reason: the row is not run and carries it as its note

    @property
    def peer_fast(self) -> bool:
        """A peer library on the fast path: the rows ``x best peer fast path`` compares against."""
        return self.peer in PEER_LIBRARIES and self.options.fast

    @property
    def peer_eager(self) -> bool:
        """A peer library in eager fp32: the rows ``x faster peer`` compares against."""
        return self.peer in PEER_LIBRARIES and self.options == EAGER


def fast_variant(peer: str, options: StepOptions) -> Variant:
    """``peer`` on the fast path ``options`` (one compile mode), named after both."""
    return Variant(f"{peer} fast path ({options.label()})", peer, options)


def one_line(err: BaseException) -> str:
    msg = str(err).strip().splitlines()
    return f"{type(err).__name__}: {msg[0] if msg else ''}"[:300]


def free(device: torch.device) -> None:
    """Hand a failed or finished variant's memory back: a compiled module holds itself in a reference cycle, so
    its parameters outlive ``del`` until a collection."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prepare(
    variant: Variant,
    spec: Spec,
    inputs,
    targets,
    seed: int = 0,
    backend: str = "inductor",
    device: str | torch.device = "cpu",
) -> dict:
    """Build ``variant``'s model on ``device``, run its first step (which includes any compile, timed) and a
    second, untimed one (optimizer state exists, a compiled backward is warm). A library that cannot build
    the spec, or a compile or step that fails, becomes the row's ``error`` instead of a crash."""
    device = torch.device(device)
    torch.manual_seed(seed)
    entry: dict = {"name": variant.name, "peer": variant.peer, "options": dict(variant.options.__dict__)}
    try:
        model = build(variant.peer, spec.with_(bias=variant.bias)).to(device)
        step = TrainStep(model, variant.options, compile_backend=backend)
        t0 = time.perf_counter()
        step(inputs, targets)
        entry["first_step_s"] = time.perf_counter() - t0
        step(inputs, targets)
        entry["step"] = step
    except NotSupported as err:
        entry["error"] = str(err)
    except Exception as err:  # a compile failure (or out of memory) is a result to report, not a crash
        entry["error"] = one_line(err)
        entry["traceback"] = traceback.format_exc(limit=3)
    if "step" not in entry:  # a failed variant: drop this frame's references to its model, then collect it
        model = step = None
        free(device)
    return entry


def race(
    spec: Spec,
    batch_size: int,
    rounds: int,
    variants: Sequence[Variant],
    seed: int = 0,
    backend: str = "inductor",
    device: str | torch.device = "cpu",
    deadline: float | None = None,
    rematch_rounds: int = 0,
) -> dict:
    """Time ``variants`` side by side: each prepared (:func:`prepare`), then ``rounds`` rounds of one step each,
    the order rotating every round, so load from other processes hits them alike.

    Each row gets its median step time, tokens/s and, as medians over rounds of per-round ratios,
    ``ratio_vs_faster_peer`` (the faster peer in eager fp32 / this) and ``ratio_vs_best_peer_fast`` (the
    fastest peer on the fast path / this). ``deadline`` (a ``time.perf_counter()`` value): a variant not yet
    prepared by then is skipped with a note, so a run stays within its time budget; so is one with a ``skip``.

    ``rematch_rounds``: then kilolayer's fastest fast-path row races the peers' fast-path rows within
    :data:`REMATCH_PEER_SPREAD` of the fastest one for that many more rounds (``rematch``, :func:`rematch`). In
    the race every step follows another model's, each row always the same one, and the better of kilolayer's
    rows is the best of several medians of a few rounds; the rematch times the chosen rows afresh, each step
    after one of its own model, and gives the ratio an interval."""
    device = torch.device(device)
    inputs, targets = fixed_batch(spec, batch_size, seed, device)
    tokens = batch_size * spec.tokens_per_sample()
    entries = []
    for v in variants:
        skip = v.skip
        if skip is None and deadline is not None and time.perf_counter() > deadline:
            skip = "skipped: the run's time budget was spent"
        if skip is not None:
            entries.append({"name": v.name, "peer": v.peer, "options": dict(v.options.__dict__), "error": skip})
            continue
        entries.append(prepare(v, spec, inputs, targets, seed, backend, device))
    live = [e for e in entries if "step" in e]
    for e in live:
        e["times"] = []
    cuda = device.type == "cuda"
    for r in range(rounds):
        k = r % len(live) if live else 0
        for e in live[k:] + live[:k]:
            failed = None
            try:
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                e["times"].append(timed(lambda step=e["step"]: step(inputs, targets)))
                if cuda:  # the step's peak, with every variant's weights and optimizer state resident
                    e["peak_gib"] = max(e.get("peak_gib", 0.0), torch.cuda.max_memory_allocated(device) / 2**30)
            except Exception as err:  # a later recompile that fails, or memory running out
                failed = one_line(err)
            if failed is not None:  # outside the except block: its traceback no longer holds the step's frames
                e["error"] = failed
                del e["step"], e["times"]
                free(device)
        live = [e for e in live if "step" in e]
    by_name = {e["name"]: e for e in entries}
    timed_ = [v for v in variants if "times" in by_name[v.name]]
    # the faster peer (eager fp32) and the best peer fast path, by median step time
    faster = _fastest([v.name for v in timed_ if v.peer_eager], by_name)
    best_fast = _fastest([v.name for v in timed_ if v.peer_fast], by_name)
    ours = _fastest([v.name for v in timed_ if v.peer == "kilolayer" and v.options.fast], by_name)
    rematched = None
    if rematch_rounds and ours and best_fast:
        # every peer fast path near the fastest one: six rounds of the race may not tell them apart
        near = median(by_name[best_fast]["times"]) * (1 + REMATCH_PEER_SPREAD)
        peers = [by_name[v.name] for v in timed_ if v.peer_fast and median(by_name[v.name]["times"]) <= near]
        rematched = rematch(by_name[ours], peers, rematch_rounds, inputs, targets)
    out = []
    for e in entries:
        row = {k: v for k, v in e.items() if k not in ("step", "times", "traceback")}
        if "times" in e:
            t = e["times"]
            row["step_ms"] = 1000 * median(t)
            row["tokens_per_s"] = tokens / median(t)
            row["tokens_per_s_range"] = [tokens / max(t), tokens / min(t)]
            row["step_s_per_round"] = list(t)
            row["compile_s"] = max(0.0, e["first_step_s"] - median(t)) if e["options"]["compile"] else None
            for key, ref in (("ratio_vs_faster_peer", faster), ("ratio_vs_best_peer_fast", best_fast)):
                if ref is not None:
                    row[key] = median([b / a for a, b in zip(t, by_name[ref]["times"])])
        elif "traceback" in e:
            row["traceback"] = e["traceback"]
        out.append(row)
    return {
        "spec": spec.to_dict(),
        "label": spec.label(),
        "batch_size": batch_size,
        "tokens_per_step": tokens,
        "compile_backend": backend,
        "device": str(device),
        "rounds": rounds,
        "faster_peer": faster,
        "best_peer_fast": best_fast,
        **({"rematch": rematched} if rematched else {}),
        "variants": out,
    }


def rematch(ours: dict, peers: Sequence[dict], rounds: int, inputs, targets) -> dict:
    """Kilolayer's fastest fast-path entry of a race against each of ``peers`` (prepared entries) for ``rounds``
    more rounds, with no other row stepping. In a round each entry takes two steps in a row and only the second
    is timed, so every timed step follows a step of its own model, as in training; the entries' order rotates
    from round to round, so each goes first equally often. Per peer: the per-round ratios (its step time / ours),
    their median, the sign test's interval of that median (:func:`median_interval`; at least 95% from 6 rounds)
    and the median of the rounds where kilolayer went first and of those where the peer did. The top-level
    figures are those of the peer with the lowest median ratio, the strongest. A step that fails ends the
    rematch with its ``error`` (the race's own figures stand)."""
    entries = [ours, *peers]
    times: dict[str, list[float]] = {e["name"]: [] for e in entries}
    first: list[str] = []
    try:
        for r in range(rounds):
            k = r % len(entries)
            order = entries[k:] + entries[:k]
            first.append(order[0]["name"])
            for e in order:
                e["step"](inputs, targets)  # untimed: the timed step follows a step of its own model
                times[e["name"]].append(timed(lambda step=e["step"]: step(inputs, targets)))
    except Exception as err:  # a recompile that fails, memory running out: a note, not a lost run
        return {"kilolayer": ours["name"], "rounds": rounds, "error": one_line(err)}
    by_peer = {}
    for p in peers:
        ratios = [b / a for a, b in zip(times[ours["name"]], times[p["name"]])]
        lo, hi, coverage = median_interval(ratios)
        went_first = {
            who: [x for x, f in zip(ratios, first) if f == name]
            for who, name in (("kilolayer", ours["name"]), ("peer", p["name"]))
        }
        by_peer[p["name"]] = {
            "ratio": statistics.median(ratios),
            "interval": [lo, hi],
            "coverage": coverage,
            "ratios": ratios,
            "ratio_by_first": {who: statistics.median(x) for who, x in went_first.items() if x},
        }
    strongest = min(by_peer, key=lambda name: by_peer[name]["ratio"])
    return {
        "kilolayer": ours["name"],
        "rounds": rounds,
        "first": first,
        "peer": strongest,
        **by_peer[strongest],
        "peers": by_peer,
    }


def interval_words(m: dict) -> str:
    """A rematch's interval in words: its coverage, then its ends."""
    return f"{m['coverage']:.0%} interval {m['interval'][0]:.2f}-{m['interval'][1]:.2f}"


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free interval for the median of ``values`` and its coverage: the order statistics x_(k)
    and x_(n+1-k), k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2, which cover the median with
    probability 1 - 2 P(Binomial(n, 1/2) < k) >= ``level`` (the sign test's interval; it assumes only that the
    values are independent draws). With too few values for any such k: their range, and its coverage, below
    ``level``."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        raise ValueError("median_interval: no values")

    def below(k: int) -> float:  # P(Binomial(n, 1/2) < k)
        return sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and below(k + 1) <= (1 - level) / 2:
        k += 1
    return xs[k - 1], xs[n - k], 1 - 2 * below(k)


def _fastest(names: list[str], by_name: dict) -> str | None:
    return min(names, key=lambda n: median(by_name[n]["times"])) if names else None


def add_mfu(res: dict, flops_per_token: float, peaks: dict[str, float]) -> None:
    """``model_tflops_per_s`` and ``mfu`` (against ``peaks[precision]``, FLOP/s) on every timed row of a race."""
    res["model_flops_per_token"] = flops_per_token
    for row in res["variants"]:
        if "tokens_per_s" in row:
            row["model_tflops_per_s"] = row["tokens_per_s"] * flops_per_token / 1e12
            row["mfu"] = metrics.mfu(row["tokens_per_s"], flops_per_token, peaks[row["options"]["precision"]])


#: the columns of a race's table (``format_race``)
RACE_COLUMNS = [
    ("name", "implementation"),
    ("tokens_per_s", "tokens/s"),
    ("step_ms", "step ms"),
    ("ratio_vs_faster_peer", "x faster peer"),
    ("ratio_vs_best_peer_fast", "x best peer fast path"),
    ("mfu", "MFU"),
    ("compile_s", "compile s"),
    ("error", "note"),
]


def format_race(res: dict, columns: list[tuple[str, str]] | None = None) -> str:
    """A race's rows as a Markdown table (``columns``: (key, header), default :data:`RACE_COLUMNS`): ratios to
    two decimals, MFU as a percentage of its dtype's peak."""
    rows = []
    for row in res["variants"]:
        r = dict(row)
        if "mfu" in r:
            r["mfu"] = f"{100 * r['mfu']:.0f}% of {r['options']['precision']}"
        for key in ("ratio_vs_faster_peer", "ratio_vs_best_peer_fast"):
            if key in r:
                r[key] = f"{r[key]:.2f}"
        rows.append(r)
    return table(rows, columns or RACE_COLUMNS)


# ---------------------------------------------------------------- peak GEMM rate


def gemm_peak(dtype: torch.dtype, n: int = 2048, seconds: float = 1.0, rounds: int = 3) -> float:
    """Best large-GEMM rate (FLOP/s) of ``dtype`` on this CPU: max over ``rounds`` of the mean over ~``seconds``
    (the trainer's peak measurement, :func:`kilolayer.train.host.gemm_rate`, at benchmark sizes)."""
    return host.gemm_rate(dtype, n=n, seconds=seconds, rounds=rounds)


def gemm_peaks(n: int = 2048, seconds: float = 1.0, precisions: Sequence[str] = PRECISIONS) -> dict[str, float]:
    """:func:`gemm_peak` of each of ``precisions`` (FLOP/s), keyed fp32 / bf16."""
    return {p: gemm_peak(host.DTYPES[p], n=n, seconds=seconds) for p in precisions}


#: a quick GEMM of each precision: which one is faster here (a second at most where bf16 is slow)
PROBE_GEMM = {"n": 256, "seconds": 0.05}


def measure_peaks(n: int = 2048, seconds: float = 1.0) -> tuple[dict[str, float], dict[str, int]]:
    """(peak FLOP/s, GEMM size) of fp32 and bf16: :func:`gemm_peak` at ``n`` of both, except where a quick
    probe (:data:`PROBE_GEMM`) finds bf16 slower than fp32: bf16's figure is then the probe's, as one bf16
    product at ``n`` = 2048 (17 GFLOP) takes 17 s at the 1 GFLOP/s of a CPU without bf16 instructions."""
    peaks, sizes = {"fp32": gemm_peak(torch.float32, n=n, seconds=seconds)}, {"fp32": n, "bf16": n}
    if n > PROBE_GEMM["n"]:
        probe = gemm_peaks(**PROBE_GEMM)
        if probe["bf16"] < probe["fp32"]:
            peaks["bf16"], sizes["bf16"] = probe["bf16"], PROBE_GEMM["n"]
            return peaks, sizes
    peaks["bf16"] = gemm_peak(torch.bfloat16, n=n, seconds=seconds)
    return peaks, sizes


# ---------------------------------------------------------------- the fast path's precision

#: ``--fast-precision``: decide from the measured GEMM peaks, or force one
FAST_PRECISION_CHOICES = ("auto", "bf16", "fp32")
#: CPU flags of instructions that compute in bf16 (AVX-512 dot products, AMX tiles)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def gflops(flops: float) -> str:
    """FLOP/s as GFLOP/s, one decimal below 10."""
    g = flops / 1e9
    return f"{g:.1f}" if g < 10 else f"{g:,.0f}"


def times(ratio: float) -> str:
    """A ratio as ``7.0x``, or ``0.013x`` below 0.1."""
    return f"{ratio:.1f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def _slower(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def bf16_support(flags: Sequence[str]) -> str:
    """Which of ``flags`` give bf16 instructions, as words: ``no bf16 instructions`` when none."""
    have = [f for f in BF16_FLAGS if f in flags]
    return f"bf16 instructions: {', '.join(have)}" if have else "no bf16 instructions"


def has_amx(flags: Sequence[str]) -> bool:
    return any(f.startswith("amx") for f in flags)


def choose_fast_precision(peaks: dict[str, float], flags: Sequence[str], requested: str = "auto") -> dict:
    """The fast path's precision: under ``auto``, bf16 when the measured bf16 GEMM peak is at least the fp32
    one, else fp32; ``bf16`` or ``fp32`` forces it. Returns ``precision``, ``requested``, ``reason`` (one line),
    ``bf16_over_fp32`` (the measured ratio), ``bf16_slower`` and ``skip_bf16``: the note of the rows whose only
    point is bf16 when the fast path is fp32 (else None)."""
    if requested not in FAST_PRECISION_CHOICES:
        raise ValueError(f"fast precision {requested!r}: expected one of {', '.join(FAST_PRECISION_CHOICES)}")
    bf16, fp32 = peaks["bf16"], peaks["fp32"]
    slower = bf16 < fp32
    measured = (
        f"bf16 GEMM {gflops(bf16)} GFLOP/s vs fp32 {gflops(fp32)} GFLOP/s ({times(bf16 / fp32)}); {bf16_support(flags)}"
    )
    if requested == "auto":
        precision = "fp32" if slower else "bf16"
        reason = f"auto: {measured}"
    else:
        precision = requested
        reason = f"forced (--fast-precision {requested}); measured {measured}"
    skip = None
    if precision == "fp32":
        if slower:
            skip = (
                f"skipped: bf16 GEMM here is {gflops(bf16)} GFLOP/s, {_slower(fp32 / bf16)} slower than fp32; "
                f"{bf16_support(flags)}"
            )
        else:
            skip = f"skipped: --fast-precision fp32 (bf16 GEMM here is {times(bf16 / fp32)} fp32's)"
    return {
        "precision": precision,
        "requested": requested,
        "reason": reason,
        "bf16_over_fp32": bf16 / fp32,
        "bf16_slower": slower,
        "skip_bf16": skip,
    }


def add_fast_precision_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fast-precision",
        choices=FAST_PRECISION_CHOICES,
        default="auto",
        help="the fast path's precision (default auto: bf16 when the measured bf16 GEMM peak is at least the "
        "fp32 one, else fp32)",
    )


# ---------------------------------------------------------------- machine and provenance


def cpu_model() -> str:
    return host.cpu_model()


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
