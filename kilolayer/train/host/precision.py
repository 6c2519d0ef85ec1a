"""The precision a run trains at (:func:`policy`): ``train.precision`` as given, or ``auto`` decided once, at the
run's start.

``auto`` is bf16 where bf16 matrix products are fast, and fp32 elsewhere:

* on CUDA, bf16 where the GPU supports it (``torch.cuda.is_bf16_supported``);
* on a CPU, bf16 only where the CPU has bf16 instructions (AVX512-BF16 or AMX as torch reports them, else the
  ``/proc/cpuinfo`` flags: :func:`cpu_bf16`) *and* one of the model's layers trains faster under bf16 autocast
  than in fp32: a forward and backward of one layer of the run's shape (width, heads, FFN, sequence length,
  micro-batch; its residual scheme aside) on random inputs (:func:`layer_speedup`), at least
  :data:`MIN_LAYER_SPEEDUP` times as fast. A faster GEMM alone does not decide it: at small widths and short
  sequences autocast's casts and the fp32 LayerNorms cost more than the products save, and the rest of a step
  (embeddings, loss, optimizer, data) gains nothing from bf16. Without bf16 instructions autocast emulates bf16,
  many times slower than fp32, so nothing is measured. The ratio is measured once per CPU model, thread count,
  layer shape and torch version and cached in ``precision.json`` of the cache folder (``$KILOLAYER_CACHE``, else
  ``~/.cache/kilolayer``; delete it to measure again).

Runs compared with one another share one precision: a study (:mod:`kilolayer.study.runner`, on Ray too) and a
search decide ``auto`` once for all their runs (:func:`shared`: bf16 only where every shape among them pays for
it; a study whose runs already recorded one precision keeps it) and hand the decision to each run in the
environment (:data:`SHARED_ENV`, :func:`sharing`), so that a shallow-wide and a deep-narrow model, or Post-LN and
DeepNorm, do not differ in precision as well. Runs a user starts one by one decide each for itself: give them
``train.precision`` to compare them.

A run records its precision and the reason (status.json ``precision`` and ``precision_reason``, its checkpoints'
state.json ``precision``) and a resume of an ``auto`` run reuses it: bf16 and fp32 steps differ in their last
bits, so deciding again mid-run would break a bit-exact resume. A precision given as fp32 or bf16 is never
overridden; ``train.precision: fp32`` is the one flag for runs bit-comparable with fp32 runs.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kilolayer.config import Config, ModelConfig
from kilolayer.train.host.peak import BF16_CPU_FLAGS, _cache_lock, _read_cache, _write_cache, cpu_flags, cpu_model

AUTO = "auto"
#: the precisions a step runs at (what ``auto`` resolves to)
PRECISIONS = ("fp32", "bf16")
CACHE_FILE = "precision.json"
#: the environment variable that hands a run the precision its study or search decided for all of its runs
#: ("bf16" or "fp32", a tab, the reason): :func:`sharing`
SHARED_ENV = "KILOLAYER_SHARED_PRECISION"
#: how a precision was chosen (:attr:`Precision.source`)
GIVEN, RECORDED, DECIDED = "given", "recorded", "auto"


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


#: how much faster one layer must train in bf16 for ``auto`` to choose it: the rest of the step gains nothing.
#: Calibrated once, on a 2-core AVX512-BF16 CPU (kilolayer study quick, one thread per run): layers probed at
#: 1.08-1.22x trained 10-25% slower as whole runs in bf16, one at 1.36x 10-15% faster, one at 3.7x 1.4x faster.
MIN_LAYER_SPEEDUP = 1.3
#: the most tokens the layer probe runs on (a larger micro-batch is probed with fewer sequences of its length)
PROBE_TOKENS = 4096


@dataclass(frozen=True)
class LayerShape:
    """What decides whether bf16 pays off for a model: one layer's shape (its residual scheme aside) and the tokens
    it sees per step."""

    model: ModelConfig
    batch: int  # sequences per micro-batch

    @classmethod
    def of(cls, config: Config) -> LayerShape:
        tc = config.train
        return cls(config.model, max(1, tc.batch_size // tc.accumulate))

    @property
    def sequences(self) -> int:
        """The sequences the probe runs: the micro-batch, at most :data:`PROBE_TOKENS` tokens of them."""
        return max(1, min(self.batch, PROBE_TOKENS // self.model.seq_len))

    def key(self) -> str:
        m = self.model
        return (
            f"{m.arch} width {m.width} heads {m.heads} ffn {m.ffn} {m.activation} dropout {m.dropout:g} "
            f"attention {m.cpu_attention} | {self.sequences} x {m.seq_len} tokens"
        )

    def words(self) -> str:
        return f"width {self.model.width}, {self.sequences} x {self.model.seq_len} tokens"


def layer_speedup(shape: LayerShape, seconds: float = 1.0) -> float:
    """fp32 time over bf16 time of a forward and backward of one Pre-LN layer of ``shape`` (an encoder layer; a
    decoder layer for a decoder-only model) on random inputs, the bf16 one under autocast as a training step runs
    it, the two taking turns for about ``seconds`` (:func:`_ratio_in_turns`). Above 1: bf16 is faster. Every
    residual scheme is probed as Pre-LN, so that the schemes a study compares at one shape train at one precision.
    The layer runs eagerly whatever ``train.compile`` says: a compiled run is judged by its eager layer.
    The layer and its inputs come from a forked random state: the global random streams do not move."""
    from kilolayer.nn.layers import Layer
    from kilolayer.nn.transformer import scheme_for

    m = shape.model.model_copy(update={"scheme": "pre_ln"})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = Layer(m, scheme_for(m), "decoder" if m.arch == "decoder" else "encoder", 0)
        x = torch.randn(shape.sequences, m.seq_len, m.width, requires_grad=True)

    inputs = [x, *layer.parameters()]

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = layer(x)
        torch.autograd.grad(y.float().sum(), inputs)  # every gradient a step computes, none kept: nothing trains

    return _ratio_in_turns(lambda: step(False), lambda: step(True), seconds)


def _ratio_in_turns(a: Callable[[], object], b: Callable[[], object], seconds: float) -> float:
    """The median over rounds of (time of a call of ``a`` / time of a call of ``b``), the two called in turn for
    at least 7 rounds and about ``seconds`` after a warm-up of a tenth of that: a round's ratio is not moved by
    the machine's drift, and the median not by one slow round."""
    warm_until = time.perf_counter() + seconds / 10
    a(), b()
    while time.perf_counter() < warm_until:
        a(), b()
    ratios: list[float] = []
    until = time.perf_counter() + seconds
    while len(ratios) < 7 or time.perf_counter() < until:
        times = []
        for fn in (a, b) if len(ratios) % 2 == 0 else (b, a):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        ratios.append(times[0] / times[1] if len(ratios) % 2 == 0 else times[1] / times[0])
    return statistics.median(ratios)


def cached_speedup(shape: LayerShape) -> float:
    """:func:`layer_speedup` of ``shape`` from the cache, measured and cached on the first call for this CPU model,
    thread count, layer shape and torch version (two processes starting together measure once)."""
    from kilolayer.data.cache import cache_dir

    threads = torch.get_num_threads()
    key = f"cpu|{cpu_model()}, {threads} thread{'s' * (threads != 1)}|{shape.key()}|torch {torch.__version__}"
    path = cache_dir() / CACHE_FILE
    entry = _read_cache(path).get(key)
    if not _usable(entry):
        with _cache_lock(path):
            entry = _read_cache(path).get(key)  # another process may have measured meanwhile
            if not _usable(entry):
                entry = {"speedup": layer_speedup(shape), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                _write_cache(path, key, entry)  # a read-only cache folder: measured again next time
    return float(entry["speedup"])


def _usable(entry) -> bool:
    value = entry.get("speedup") if isinstance(entry, dict) else None
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def auto(device: str | torch.device, shape: LayerShape) -> Precision:
    """``train.precision: auto`` decided on ``device`` for a model of ``shape`` (module docstring)."""
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
    ratio = cached_speedup(shape)
    measured = f"a layer trains {ratio:.2f}x as fast in bf16 ({shape.words()})"
    if ratio >= MIN_LAYER_SPEEDUP:
        return Precision("bf16", f"auto: {measured}", DECIDED)
    return Precision(
        "fp32", f"auto: {measured}, under the {MIN_LAYER_SPEEDUP}x that pays for the step ({what})", DECIDED
    )


def shared(device: str | torch.device, configs: list[Config]) -> Precision | None:
    """``auto`` decided once for runs of ``configs`` compared with one another (those that ask for ``auto``; None
    where none does): bf16 only where :func:`auto` decides bf16 for every distinct layer shape among them, else
    fp32, with the shape that does not pay named."""
    shapes = {s.key(): s for s in (LayerShape.of(c) for c in configs if c.train.precision == AUTO)}
    if not shapes:
        return None
    decided = [(s, auto(device, s)) for s in shapes.values()]
    against = next(((s, d) for s, d in decided if d.value != "bf16"), None)
    if len(shapes) == 1:
        return decided[0][1]
    n = f"one precision for the {len(shapes)} shapes compared"
    if against is None:
        return Precision("bf16", f"{decided[0][1].reason}; {n}: bf16 pays for every one", DECIDED)
    return Precision("fp32", f"{against[1].reason}; {n}", DECIDED)


@contextlib.contextmanager
def sharing(precision: Precision | None):
    """Within the block, ``auto`` decides ``precision`` (:data:`SHARED_ENV`: for this process and the runs it
    starts); None changes nothing."""
    if precision is None:
        yield
        return
    before = os.environ.get(SHARED_ENV)
    os.environ[SHARED_ENV] = f"{precision.value}\t{precision.reason}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SHARED_ENV, None)
        else:
            os.environ[SHARED_ENV] = before


def _shared_here(device: str | torch.device) -> Precision | None:
    """The precision :data:`SHARED_ENV` hands this run, if any it can train at: a value that is not "fp32" or
    "bf16", a tab and a reason is said once and passed over, and so is bf16 on a CPU without bf16 instructions
    (a study driven from another machine), where autocast would emulate it."""
    raw = os.environ.get(SHARED_ENV, "")
    value, _, reason = raw.partition("\t")
    if not raw:
        return None
    if value not in PRECISIONS or not reason.strip():
        if raw not in _SAID:
            _SAID.add(raw)
            print(
                f"kilolayer: {SHARED_ENV}={raw!r}: expected fp32 or bf16, a tab and the reason; passed over",
                file=sys.stderr,
            )
        return None
    if value == "bf16" and torch.device(device).type == "cpu" and not cpu_bf16()[0]:
        return None
    return Precision(value, reason, DECIDED)


_SAID: set[str] = set()


def policy(asked: str, device: str | torch.device, config: Config, recorded: Precision | None = None) -> Precision:
    """The precision of a run of ``config`` that asks for ``asked`` (``train.precision``): fp32 or bf16 as given;
    ``auto``: the precision the run being resumed recorded (``recorded``), else the one its study or search
    decided for all of its runs (:func:`sharing`), else :func:`auto`."""
    if asked != AUTO:
        return Precision(asked, "train.precision", GIVEN)
    if recorded is not None:
        return Precision(recorded.value, recorded.reason, RECORDED)
    return _shared_here(device) or auto(device, LayerShape.of(config))
