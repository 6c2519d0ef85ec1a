"""glibc heap handling for CPU training: optional, process-wide, Linux with glibc only (elsewhere each part does
nothing). The trainer calls :func:`apply` once per task; the rest of training knows nothing of the heap.

With layers checkpointed (``model.checkpoint_activations``), each recomputed layer frees its activation blocks
between tensors that live on, and glibc keeps the holes resident, so the peak grows with depth:

* ``train.trim_heap_every`` (default 32; 0: never): every this many checkpointed layers, in the forward pass and
  again in the backward pass, hand the heap's free pages back to the system (:class:`HeapTrimmer`,
  ``malloc_trim``). It changes no number; it runs on the CPU only and not inside a compiled graph
  (``train.compile``), which a call out of it would split at every layer. ``KILOLAYER_TRIM_HEAP=0`` (or false,
  off, no) turns it off whatever the config says.
* ``train.pin_mmap`` (default off): pin glibc's mmap threshold at 64 KiB instead (:func:`pin_mmap_threshold`),
  so every such block is a mapping of its own; it saves about as much as the trim but slows each step.
  ``KILOLAYER_PIN_MMAP=1`` pins wherever layers are checkpointed, ``0`` never.

With nothing checkpointed, on the CPU:

* ``train.hold_heap`` (default on): keep the memory a step frees for the next (:func:`hold_heap`: mmap threshold
  32 MiB, trim threshold 2 GiB) instead of handing the top of the heap back and faulting the same pages in again
  each step. It lasts for the process's life, which keeps the memory it has used at its highest;
  :func:`heap_held` says whether it took (a completed run's ``status.json`` records it). ``KILOLAYER_HOLD_HEAP=0``
  (or false, off, no) turns it off.

glibc's own settings in the environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_TOP_PAD_``, ``glibc.malloc.*`` in ``GLIBC_TUNABLES``) win over the pin and the hold. What each saves, in
memory, page faults and step time: docs/benchmarks.md (``python -m benchmarks.memory``, ``python -m
benchmarks.heap``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

from kilolayer import rundir
from kilolayer.config import Config
from kilolayer.train.parallelize import checkpointed_backbones

#: values of the environment switches that turn a part off
_OFF = ("0", "false", "off", "no")


def _glibc() -> ctypes.CDLL | None:
    """glibc, where this process runs on it (Linux); None elsewhere (musl and others lack its malloc tunables)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "malloc_trim") else None


# ---------------------------------------------------------------- checkpointed layers: the trim and the pin

#: release the heap's free pages every this many checkpointed layers (train.trim_heap_every's default)
TRIM_EVERY = 32
#: turns the heap trim off whatever the config says
TRIM_ENV = "KILOLAYER_TRIM_HEAP"


class HeapTrimmer:
    """Hands the heap's free pages back to the system (glibc's ``malloc_trim(0)``, which releases whole free
    pages anywhere in the heap, not only at its top) every ``every`` checkpointed layers, in the forward pass
    and again in the backward pass when the gradient reaches the same layers' outputs. :meth:`after_layer` is
    the per-layer callback of :func:`~kilolayer.train.parallelize.checkpoint_layers`. ``trim`` replaces
    ``malloc_trim`` (tests count the calls)."""

    def __init__(self, every: int = TRIM_EVERY, trim: Callable[[], object] | None = None):
        if trim is None:
            off = os.environ.get(TRIM_ENV, "").strip().lower() in _OFF
            libc = _glibc() if every > 0 and not off else None
            trim = (lambda: libc.malloc_trim(0)) if libc is not None else None
        self.every, self.trim, self.layers = every, trim, 0

    @property
    def active(self) -> bool:
        return self.trim is not None and self.every > 0

    def after_layer(self, out: object) -> None:
        """Called with each checkpointed layer's output: trim now at every ``every``-th layer, and once more
        when the backward pass has computed that output's gradient."""
        if not self.active or not isinstance(out, torch.Tensor) or out.device.type != "cpu":
            return  # (a CUDA step's activations are not on this process's heap)
        self.layers += 1
        if self.layers % self.every:
            return
        self.trim()
        if out.requires_grad:
            out.register_hook(self._in_backward)

    def _in_backward(self, grad: torch.Tensor) -> None:
        self.trim()


#: glibc's mallopt parameter number for the mmap threshold (malloc.h)
_M_MMAP_THRESHOLD = -3
#: blocks of at least this many bytes get their own mapping, returned to the system when freed
MMAP_THRESHOLD = 64 * 1024
#: 1 pins the threshold wherever layers are checkpointed, 0 never (overriding train.pin_mmap)
PIN_ENV = "KILOLAYER_PIN_MMAP"


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for the rest of this process, so freed activation
    blocks go back to the system instead of leaving holes in the heap. Returns whether it was pinned: not on
    other C libraries or systems, nor when ``MALLOC_MMAP_THRESHOLD_`` (glibc's own setting, which wins) is
    set, nor with ``KILOLAYER_PIN_MMAP=0``."""
    if os.environ.get(PIN_ENV) == "0" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _glibc()  # only glibc has the setting (musl's mallopt does nothing)
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1


def prepare_checkpointing(trim_every: int = TRIM_EVERY, pin_mmap: bool = False) -> Callable[[object], None] | None:
    """Ready the heap for checkpointed layers: pin glibc's mmap threshold if ``pin_mmap`` or
    ``KILOLAYER_PIN_MMAP=1`` asks, and return the trim to pass as
    :func:`~kilolayer.train.parallelize.checkpoint_layers`' ``after_layer`` (a fresh :class:`HeapTrimmer`;
    None where it is off)."""
    if pin_mmap or os.environ.get(PIN_ENV) == "1":
        pin_mmap_threshold()
    trimmer = HeapTrimmer(trim_every)
    return trimmer.after_layer if trimmer.active else None


# ---------------------------------------------------------------- nothing checkpointed: the held heap

#: glibc's mallopt parameter number for the trim threshold (malloc.h)
_M_TRIM_THRESHOLD = -1
#: what :func:`hold_heap` sets: blocks below 32 MiB (glibc's largest dynamic mmap threshold) come from the
#: heap, and free memory at its top is handed back only past 2 GiB (mallopt takes an int)
HOLD_MMAP_THRESHOLD = 32 * 1024 * 1024
HOLD_TRIM_THRESHOLD = 2**31 - 1
#: turns the held heap off whatever the config says
HOLD_ENV = "KILOLAYER_HOLD_HEAP"
_GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _glibc_malloc_settings() -> list[str]:
    """glibc's own malloc settings in this process's environment (non-empty ``MALLOC_*_`` variables, and
    ``glibc.malloc.*`` tunables in ``GLIBC_TUNABLES``): a user who set them decides the allocator's behaviour."""
    found = [name for name in _GLIBC_ENV if os.environ.get(name, "").strip()]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables:
        found.append("GLIBC_TUNABLES")
    return found


def hold_heap() -> bool:
    """Keep the memory a training step frees for the next step, for the rest of this process (glibc): fix the
    mmap threshold at 32 MiB and the trim threshold at 2 GiB, so the activations of one step reuse the pages of
    the last instead of being handed back and faulted in again, page by page, as glibc's dynamic thresholds do
    after a step frees its activations. Returns whether it was set: not on other C libraries or systems, nor
    when glibc's own settings are in the environment (:func:`_glibc_malloc_settings`: they win), nor with
    ``KILOLAYER_HOLD_HEAP=0`` (or false, off, no). With another allocator preloaded (jemalloc, tcmalloc) it may
    return True and change nothing.

    It cannot be undone: glibc's dynamic thresholds stay off for the process's life, which then keeps the
    memory it has used at its highest (up to 2 GiB free at the heap's top) until it exits. A later
    checkpointed run in the same process still hands free pages back through :class:`HeapTrimmer`
    (``malloc_trim`` ignores the trim threshold)."""
    if os.environ.get(HOLD_ENV, "").strip().lower() in _OFF:
        return False
    if _glibc_malloc_settings():
        return False
    libc = _glibc()
    if libc is None:
        return False
    mmap_set = libc.mallopt(_M_MMAP_THRESHOLD, HOLD_MMAP_THRESHOLD) == 1
    held = mmap_set and libc.mallopt(_M_TRIM_THRESHOLD, HOLD_TRIM_THRESHOLD) == 1
    if not held and not _WARNED[0]:  # glibc itself said no: unexpected, unlike the settings a user chose above
        _WARNED[0] = True
        which = "the trim threshold (the mmap threshold is set)" if mmap_set else "the mmap threshold"
        rundir.warn(f"train.hold_heap: glibc's mallopt refused {which}; the heap is not held")
    _HELD[0] = _HELD[0] or held
    return held


#: whether :func:`hold_heap` has held this process's heap (it stays held); whether it has warned of a refusal
_HELD = [False]
_WARNED = [False]


def heap_held() -> bool:
    """Whether this process's heap is held (:func:`hold_heap` succeeded in it at some point): a completed
    run's ``status.json`` records it as ``heap_held``, so step times of runs can be compared knowingly."""
    return _HELD[0]


# ---------------------------------------------------------------- the trainer's entry point


def apply(task: nn.Module, config: Config, device: str | torch.device) -> Callable[[object], None] | None:
    """The heap handling ``config.train`` asks for, for ``task`` training on ``device``; call it before
    :func:`~kilolayer.train.parallelize.parallelize`. With any layer checkpointed
    (:func:`~kilolayer.train.parallelize.checkpointed_backbones`), :func:`prepare_checkpointing`: returns the
    trim for ``parallelize``'s ``after_layer``. Otherwise, on the CPU with ``train.hold_heap``, :func:`hold_heap`;
    returns None."""
    tc = config.train
    if checkpointed_backbones(task, config):
        return prepare_checkpointing(tc.trim_heap_every, tc.pin_mmap)
    if tc.hold_heap and torch.device(device).type == "cpu":
        hold_heap()
    return None
