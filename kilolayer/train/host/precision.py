"""The precision a run trains at (:func:`policy`): ``train.precision`` as given, or ``auto`` decided once, at the
run's start.

``auto`` is bf16 where bf16 matrix products are fast, and fp32 elsewhere:

* on CUDA, bf16 where the GPU supports it (``torch.cuda.is_bf16_supported``);
* on a CPU, bf16 only where the CPU has bf16 instructions (AVX512-BF16 or AMX as torch reports them, else the
  ``/proc/cpuinfo`` flags: :func:`cpu_bf16`) *and* the run's training step is measured to run at least
  :data:`MIN_STEP_SPEEDUP` times as fast under bf16 autocast as in fp32: the whole step, the run's own model,
  objective, data and micro-batch, eager, taking turns with fp32 (``measure``:
  :func:`kilolayer.train.engine.step_speedup`; :class:`StepShape` says what it runs). A faster GEMM alone does not
  decide it: at small widths and short sequences autocast's casts and the fp32 LayerNorms cost more than the
  products save, and embeddings, loss, optimizer and data gain little. Without bf16 instructions autocast
  emulates bf16, many times slower than fp32, so nothing is measured. The ratio is measured once per CPU model,
  thread count, step and torch version and cached in ``precision.json`` of the cache folder
  (``$KILOLAYER_CACHE``, else ``~/.cache/kilolayer``; delete it to measure again).

Runs compared with one another share one precision: a study (:mod:`kilolayer.study.runner`, on Ray too) and a
search decide ``auto`` once for all their runs (:func:`shared`: bf16 only where every step among them pays for
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
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kilolayer.config import Config, ModelConfig
from kilolayer.errors import KilolayerError
from kilolayer.train.host.peak import (
    BF16_CPU_FLAGS,
    BUSY_LOAD,
    _busy_note,
    _cache_lock,
    _read_cache,
    _write_cache,
    cpu_flags,
    cpu_model,
    load_per_cpu,
)

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


#: how much faster a whole training step must run in bf16 for ``auto`` to choose it: a chosen margin of about the
#: few percent that repeated probes of one step spread by, so that a step within it of fp32 keeps fp32 (a
#: precision whose runs compare bit for bit with fp32 runs)
MIN_STEP_SPEEDUP = 1.05
#: the probe's method, in its cache key: a changed method measures again
PROBE_VERSION = 1
#: the residual schemes' own options, which the probe (always Pre-LN) leaves at their defaults
SCHEME_OPTIONS = ("layerscale_init", "ds_init_variant", "admin_omega", "branchnorm_steps")


@dataclass(frozen=True)
class StepShape:
    """What decides whether bf16 pays off for a run: its training step with the seed, the budget and every setting
    that does not change a step's work left out (``config``: the probe's config, :meth:`of`)."""

    config: Config

    @classmethod
    def of(cls, config: Config) -> StepShape:
        """The step of ``config``'s run as the probe runs it: one micro-batch a step, eager (a compiled run is
        judged by its eager step), Pre-LN whatever the run's residual scheme (so that the schemes a study compares
        at one shape train at one precision), no held heap (the probe shares its process), no diagnostics, no
        weights loaded, seed 0, on the CPU."""
        tc = config.train
        # Pre-LN, and so none of the other schemes' options: they do not change the step the probe times
        plain = {k: ModelConfig.model_fields[k].default for k in SCHEME_OPTIONS}
        model = config.model.model_copy(update={"scheme": "pre_ln", **plain})
        train = tc.model_copy(
            update={
                "batch_size": max(1, tc.batch_size // tc.accumulate),
                "accumulate": 1,
                "precision": "fp32",
                "compile": False,
                "hold_heap": False,
                "diagnostics_every": 0,
                "diagnostics_until": 0,
                "init_from": None,
                "freeze_backbone": False,
                "untrained": False,
                "steps": max(tc.steps, 1),
                "seed": 0,
                "device": "cpu",
                "threads": None,
            }
        )
        return cls(config.model_copy(update={"model": model, "train": train}))

    def key(self) -> str:
        """The words, and a digest of everything that makes the step's work (model, objective, data, micro-batch,
        fused optimizer) and of the probe's method (:data:`PROBE_VERSION`)."""
        c = self.config
        work = {
            "model": c.model.model_dump(mode="json"),
            "objective": c.objective.model_dump(mode="json"),
            "data": c.data.model_dump(mode="json"),
            "train": c.train.model_dump(mode="json", include={"batch_size", "fused_optimizer"}),
        }
        digest = hashlib.sha256(json.dumps(work, sort_keys=True).encode()).hexdigest()[:12]
        return f"step v{PROBE_VERSION} {self.words()} {digest}"

    def words(self) -> str:
        m, c = self.config.model, self.config
        depth = f"{m.layers}L-{m.decoder_layers}L" if m.arch == "encoder_decoder" else f"{m.layers}L"
        return (
            f"{c.objective.name} on {c.data.name}, {m.arch} {depth} width {m.width}, "
            f"{c.train.batch_size} x {m.seq_len} tokens"
        )


def ratio_in_turns(a: Callable[[], object], b: Callable[[], object], seconds: float) -> float:
    """The median over rounds of (time of a call of ``a`` / time of a call of ``b``), the two called in turn for
    an even number of rounds, at least 8, and about ``seconds``, after a warm-up of a tenth of that: a round's
    ratio is not moved by the machine's drift, the median not by one slow round, and as many rounds call ``a``
    first as call ``b`` first."""
    warm_until = time.perf_counter() + seconds / 10
    a(), b()
    while time.perf_counter() < warm_until:
        a(), b()
    ratios: list[float] = []
    until = time.perf_counter() + seconds
    while len(ratios) < 8 or len(ratios) % 2 or time.perf_counter() < until:
        times = []
        for fn in (a, b) if len(ratios) % 2 == 0 else (b, a):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        ratios.append(times[0] / times[1] if len(ratios) % 2 == 0 else times[1] / times[0])
    return statistics.median(ratios)


#: what measures a step's speed-up (:func:`kilolayer.train.engine.step_speedup`): the probe's config in, fp32 time
#: over bf16 time out
Measure = Callable[[Config], float]


def cached_speedup(shape: StepShape, measure: Measure) -> tuple[float, float | None]:
    """``measure`` of ``shape``'s step from the cache, and the load per CPU it was measured at (None where the
    system does not say): measured and cached on the first call for this CPU model, thread count, step and torch
    version (two processes starting together measure once), and measured again by the first call that finds the
    machine quieter than :data:`~kilolayer.train.host.peak.BUSY_LOAD` where it was measured busier (other work's
    threads take turns with the probe's and can decide its rounds)."""
    from kilolayer.data.cache import cache_dir

    threads = torch.get_num_threads()
    key = f"cpu|{cpu_model()}, {threads} thread{'s' * (threads != 1)}|{shape.key()}|torch {torch.__version__}"
    path = cache_dir() / CACHE_FILE
    load = load_per_cpu()
    entry = _read_cache(path).get(key)
    if _stale(entry, load):
        with _cache_lock(path):
            entry = _read_cache(path).get(key)  # another process may have measured meanwhile
            if _stale(entry, load):
                print(
                    f"kilolayer: timing training steps of {shape.words()} in bf16 against fp32, once on this "
                    "machine (train.precision: auto)",
                    file=sys.stderr,
                    flush=True,
                )
                entry = {"speedup": measure(shape.config), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                if load is not None:
                    entry["load_per_cpu"] = round(load, 2)
                _write_cache(path, key, entry)  # a read-only cache folder: measured again next time
    return float(entry["speedup"]), entry.get("load_per_cpu")


def _usable(entry) -> bool:
    value = entry.get("speedup") if isinstance(entry, dict) else None
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def _stale(entry, load: float | None) -> bool:
    """Whether a cache entry must be measured (again): missing or damaged, or taken on a busy machine that is
    quieter now."""
    if not _usable(entry):
        return True
    then = entry.get("load_per_cpu")
    return isinstance(then, (int, float)) and then >= BUSY_LOAD and load is not None and load < BUSY_LOAD


def auto(device: str | torch.device, config: Config, measure: Measure) -> Precision:
    """``train.precision: auto`` decided on ``device`` for a run of ``config`` (module docstring); ``measure`` times
    its step where the CPU has bf16 instructions."""
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
    if config.train.steps == 0:
        return Precision("fp32", "auto: an untrained run takes no step to time", DECIDED)
    shape = StepShape.of(config)
    try:
        ratio, load = cached_speedup(shape, measure)
    except (KilolayerError, OSError, RuntimeError) as err:  # the run itself says what is wrong, if it is
        said = " ".join(str(err).split())[:200]
        return Precision("fp32", f"auto: timing a step of {shape.words()} failed ({said})", DECIDED)
    measured = f"a training step runs {_times(ratio)} as fast in bf16 ({shape.words()}{_busy_note(load)})"
    if ratio >= MIN_STEP_SPEEDUP:
        return Precision("bf16", f"auto: {measured}", DECIDED)
    return Precision("fp32", f"auto: {measured}, under the {MIN_STEP_SPEEDUP}x that pays ({what})", DECIDED)


def _times(ratio: float) -> str:
    """``ratio`` to two decimals, or three where two would round it onto :data:`MIN_STEP_SPEEDUP` from below."""
    if ratio < MIN_STEP_SPEEDUP and round(ratio, 2) >= MIN_STEP_SPEEDUP:
        return f"{ratio:.3f}x"
    return f"{ratio:.2f}x"


def shared(device: str | torch.device, configs: list[Config], measure: Measure) -> Precision | None:
    """``auto`` decided once for runs of ``configs`` compared with one another (those that ask for ``auto``; None
    where none does): bf16 only where :func:`auto` decides bf16 for every distinct step among them, else fp32,
    with the first step (in ``configs``' order) that does not pay named; the steps after it are not measured."""
    steps = {s.key(): c for c in configs if c.train.precision == AUTO and (s := StepShape.of(c))}
    if not steps:
        return None
    decided = []
    for config in steps.values():
        decided.append(auto(device, config, measure))
        if decided[-1].value != "bf16":
            break
    if len(steps) == 1:
        return decided[0]
    n = f"one precision for the {len(steps)} steps compared"
    if decided[-1].value == "bf16":
        return Precision("bf16", f"{decided[0].reason}; {n}: bf16 pays for every one", DECIDED)
    return Precision("fp32", f"{decided[-1].reason}; {n}", DECIDED)


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


def policy(
    asked: str, device: str | torch.device, config: Config, measure: Measure, recorded: Precision | None = None
) -> Precision:
    """The precision of a run of ``config`` that asks for ``asked`` (``train.precision``): fp32 or bf16 as given;
    ``auto``: the precision the run being resumed recorded (``recorded``), else the one its study or search
    decided for all of its runs (:func:`sharing`), else :func:`auto` (``measure`` times the step)."""
    if asked != AUTO:
        return Precision(asked, "train.precision", GIVEN)
    if recorded is not None:
        return Precision(recorded.value, recorded.reason, RECORDED)
    return _shared_here(device) or auto(device, config, measure)
