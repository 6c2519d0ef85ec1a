"""What ``train.hold_heap`` saves: page faults, system time and step time of a CPU training step.

Each point runs in its own process (an allocator setting lasts for the process's life): build the model,
then call :func:`kilolayer.train.host.hold_heap` as the trainer's engine does for an
un-checkpointed CPU run (or not), take two warm-up steps, then time steady-state fp32 training steps
(forward, LM head, cross-entropy, backward, AdamW: ``benchmarks.common.TrainStep``) and read the process's
``getrusage``: minor page faults, system and user CPU seconds, and wall seconds, per step. Held and default
processes take turns, pair by pair, so drift in the machine's load hits both alike. Each row gives the
medians of its processes; the speed-up is the median over pairs of (default step time / held step time).
glibc's own ``MALLOC_*`` and ``GLIBC_TUNABLES`` settings are removed from the points' environment.

    python -m benchmarks.heap [--smoke] [--pairs N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.peers import Spec

ROOT = Path(__file__).resolve().parent.parent
SPEC = Spec(arch="decoder", scheme="deepnorm", width=128, layers=24, heads=2, ffn=512, seq_len=128, vocab=256)
SMOKE_SPEC = Spec(arch="decoder", scheme="deepnorm", width=16, layers=2, heads=2, ffn=32, seq_len=8, vocab=32)
BATCH, SMOKE_BATCH = 16, 2
STEPS, SMOKE_STEPS = 6, 1
PAIRS, SMOKE_PAIRS = 4, 1
KEYS = ("minflt", "sys_s", "user_s", "wall_s")
#: variables that would decide the allocator's behaviour in a point's process instead of the point itself
_ENV_OUT = ("KILOLAYER_HOLD_HEAP", "KILOLAYER_TRIM_HEAP", "KILOLAYER_PIN_MMAP")


def run_point(hold: bool, spec: Spec, batch_size: int, steps: int) -> dict:
    """In this process: hold the heap or not, build, warm up, then per-step figures over ``steps`` steps."""
    import torch

    from benchmarks.common import EAGER, TrainStep, fixed_batch
    from benchmarks.peers import build
    from kilolayer.train.host import hold_heap

    torch.manual_seed(0)
    step = TrainStep(build("kilolayer", spec), EAGER)
    inputs, targets = fixed_batch(spec, batch_size)
    held = hold_heap() if hold else False  # after the model is built, as the trainer's engine does
    for _ in range(2):
        step(inputs, targets)
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        step(inputs, targets)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "hold_heap": held,
        "minflt": (after.ru_minflt - before.ru_minflt) / steps,
        "sys_s": (after.ru_stime - before.ru_stime) / steps,
        "user_s": (after.ru_utime - before.ru_utime) / steps,
        "wall_s": wall / steps,
    }


def _spawn(hold: bool, spec: Spec, batch_size: int, steps: int, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in _ENV_OUT}
    env.pop("GLIBC_TUNABLES", None)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    point = json.dumps({"hold": hold, "spec": spec.to_dict(), "batch_size": batch_size, "steps": steps})
    cmd = [sys.executable, "-m", "benchmarks.heap", "--point", point, "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"a benchmarks.heap point exited with {proc.returncode}: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(smoke: bool = False, pairs: int | None = None, threads: int = 1) -> dict:
    spec, batch = (SMOKE_SPEC, SMOKE_BATCH) if smoke else (SPEC, BATCH)
    steps = SMOKE_STEPS if smoke else STEPS
    pairs = pairs or (SMOKE_PAIRS if smoke else PAIRS)
    load_before = common.load_average()
    samples: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for hold in order:
            samples[hold].append(_spawn(hold, spec, batch, steps, threads))
    rows = []
    for hold in (False, True):
        row = {"hold_heap": hold, "held": all(s["hold_heap"] for s in samples[hold])}
        row.update({k: common.median([s[k] for s in samples[hold]]) for k in KEYS})
        row["per_pair"] = samples[hold]
        rows.append(row)
    speedup = common.median([d["wall_s"] / h["wall_s"] for d, h in zip(samples[False], samples[True])])
    return {
        "machine": common.machine(),
        "spec": spec.to_dict(),
        "label": spec.label(),
        "batch_size": batch,
        "steps": steps,
        "pairs": pairs,
        "threads": threads,
        "load_before": load_before,
        "load_after": common.load_average(),
        "rows": rows,
        "speedup": speedup,
    }


def format_result(res: dict) -> str:
    rows = [
        {
            "train.hold_heap": ("on" if r["held"] else "on (refused here)")
            if r["hold_heap"]
            else "off (default glibc)",
            "page faults / step": f"{r['minflt']:,.0f}",
            "system s / step": f"{r['sys_s']:.3f}",
            "user s / step": f"{r['user_s']:.3f}",
            "wall s / step": f"{r['wall_s']:.3f}",
        }
        for r in res["rows"]
    ]
    head = (
        f"{res['spec']['scheme']} decoder {res['label']}, batch {res['batch_size']}, fp32, AdamW; {res['steps']} "
        f"steady-state steps per process, medians over {res['pairs']} pair(s) of fresh processes, "
        f"{res['threads']} torch thread(s). Default step time / held step time (median over pairs): "
        f"{res['speedup']:.3f}."
    )
    return head + "\n\n" + common.table(rows, [(c, c) for c in rows[0]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.heap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one pair of one step (seconds)")
    parser.add_argument("--pairs", type=int, help=f"pairs of processes, held and default (default {PAIRS})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process (default 1)")
    parser.add_argument("--point", help=argparse.SUPPRESS)  # internal: run one point in this process
    args = parser.parse_args(argv)
    if args.point:
        common.apply_threads(args.threads)
        p = json.loads(args.point)
        print(json.dumps(run_point(p["hold"], Spec(**p["spec"]), p["batch_size"], p["steps"])))
        return 0
    result = run(args.smoke, args.pairs, args.threads)
    return common.finish(result, format_result(result), args.out)


if __name__ == "__main__":
    sys.exit(main())
