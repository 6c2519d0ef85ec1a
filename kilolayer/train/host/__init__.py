"""Host tuning: what a training process adapts to the machine it runs on, behind one seam.

The engine, the run, the command line and the benchmarks use what this module exports; nothing else in
kilolayer reaches into its modules:

* :mod:`.threads`: the intra-op thread count, fixed for a run (every usable core by default; ``auto`` follows
  the load), and the marks that let a run see other kilolayer runs training on the machine;
* :mod:`.heap`: glibc's heap during CPU training (the trim between checkpointed layers, the held heap);
* :mod:`.peak`: the peak FLOP/s that MFU divides by (given, a vendor figure, or measured and cached);
* :mod:`.precision`: the precision a run trains at (``auto``: bf16 where one of its layers trains enough faster
  in it), decided once at the run's start (once for all the runs of a study or search) and reused on resume;
* :mod:`.memory`: the memory a config will take at its peak, and the refusal of one that cannot fit.
"""

from __future__ import annotations

from kilolayer.train.host.heap import apply as apply_heap
from kilolayer.train.host.heap import heap_held, hold_heap, prepare_checkpointing
from kilolayer.train.host.memory import available_memory, check_memory, estimate_memory, format_estimate
from kilolayer.train.host.peak import DTYPES, cpu_bf16_warning, cpu_model, device_peak, gemm_rate, peak_too_low
from kilolayer.train.host.precision import Precision, ratio_in_turns
from kilolayer.train.host.precision import policy as precision_policy
from kilolayer.train.host.precision import shared as precision_shared
from kilolayer.train.host.precision import sharing as precision_sharing
from kilolayer.train.host.threads import (
    AUTO,
    MAX_THREADS,
    Adapter,
    Threads,
    Training,
    crowded,
    others_training,
    torch_threads,
    usable_cpus,
)
from kilolayer.train.host.threads import policy as thread_policy

__all__ = [
    "AUTO",
    "DTYPES",
    "MAX_THREADS",
    "Adapter",
    "Precision",
    "Threads",
    "Training",
    "apply_heap",
    "available_memory",
    "check_memory",
    "cpu_bf16_warning",
    "cpu_model",
    "crowded",
    "device_peak",
    "estimate_memory",
    "format_estimate",
    "gemm_rate",
    "heap_held",
    "hold_heap",
    "others_training",
    "peak_too_low",
    "precision_policy",
    "precision_shared",
    "precision_sharing",
    "ratio_in_turns",
    "prepare_checkpointing",
    "thread_policy",
    "torch_threads",
    "usable_cpus",
]
