"""Runs side by side: the wall time of ``kilolayer train`` alone and with a second run beside it.

For each shape, ``kilolayer train`` runs as a user runs it: the command's whole wall time, start-up included,
with ``OMP_NUM_THREADS`` removed from its environment. The settings:

* ``auto``: ``--threads auto``, the count that follows the load (:mod:`kilolayer.train.host.threads`): the usable
  CPUs less those other work keeps busy, re-checked every second;
* ``every core``: ``--threads`` = the usable CPUs, the default count, what each process takes by itself;
* ``one thread``: ``--threads 1``;
* ``study --jobs 2``: ``kilolayer study`` of one point (alone, ``--jobs 1``: the default count) against the same
  study with a second seed at ``--jobs 2`` (each point one share of the CPUs); the pair's time is the study's.

Per setting: one run alone, then two started together (each one's wall time), :data:`REPEATS` times; a cell is the
median over the repeats (a pair's time is the mean of its two runs), and the ratio is the median over the repeats
of each pair's time over the run alone just before it (:func:`paired_ratio`). A run of a few seconds moves by
several percent with the machine, so one pair cannot decide a bound. Settings take turns within each repeat,
shape by shape, so drift in the machine's load hits each.

    python -m benchmarks.side_by_side [--smoke] [--repeats N] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks import common
from kilolayer.train.host import usable_cpus

#: (name, model section): a small and a wider encoder-decoder reversing digit strings
SHAPES = [
    ("12L x 64 (6L-6L)", {"layers": 6, "decoder_layers": 6, "width": 64, "heads": 4, "ffn": 256}),
    ("6L x 256 (3L-3L)", {"layers": 3, "decoder_layers": 3, "width": 256, "heads": 4, "ffn": 1024}),
]
STEPS, SMOKE_STEPS = 60, 2
#: alone-and-pair measurements per setting and shape (the cells are their medians)
REPEATS = 3


def config(model: dict, steps: int) -> dict:
    return {
        "model": {"arch": "encoder_decoder", "scheme": "deepnorm", "vocab_size": 16, "max_len": 24, **model},
        "objective": {"name": "seq2seq"},
        "data": {"name": "synthetic", "task": "reverse", "options": {"vocab": 10, "min_len": 4, "max_len": 12}},
        "train": {"steps": steps, "batch_size": 32, "lr": 1e-3, "warmup": 10, "log_every": 10},
    }


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def race(cfg_path: Path, work: Path, runs: int, threads: int | str) -> list[float]:
    """Wall seconds of ``runs`` ``kilolayer train`` processes started together."""
    extra = ["--threads", str(threads)]
    procs, t0 = [], time.perf_counter()
    for i in range(runs):
        out = work / f"run{time.monotonic_ns()}_{i}"
        cmd = [sys.executable, "-m", "kilolayer", "train", str(cfg_path), "--out", str(out), "--quiet", *extra]
        procs.append(subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    seconds = [0.0] * runs
    pending = dict(enumerate(procs))
    while pending:
        for i, p in list(pending.items()):
            if p.poll() is not None:
                seconds[i] = time.perf_counter() - t0
                if p.returncode:
                    raise RuntimeError(f"kilolayer train exited {p.returncode}: {p.stderr.read().strip()[-300:]}")
                del pending[i]
        time.sleep(0.01)
    return seconds


def study(cfg: dict, work: Path, seeds: list[int]) -> float:
    """Wall seconds of ``kilolayer study`` training ``cfg`` once per seed, ``len(seeds)`` points at once."""
    spec = {"name": "side_by_side", "groups": [{"name": "runs", "base": cfg, "seeds": seeds}]}
    path = work / f"study{len(seeds)}.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = work / f"study{len(seeds)}"
    cmd = [sys.executable, "-m", "kilolayer", "study", str(path), "--out", str(out), "--jobs", str(len(seeds))]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"kilolayer study exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return time.perf_counter() - t0


STUDY = "study --jobs 2"


def run(smoke: bool = False, repeats: int = REPEATS) -> dict:
    cpus = usable_cpus()
    settings = [("auto", "auto"), (f"every core ({cpus} threads)", cpus), ("one thread", 1), (STUDY, None)]
    rows, load, machine = [], common.load_average(), common.machine()  # the date the measurement started
    repeats = 1 if smoke else repeats
    with tempfile.TemporaryDirectory(prefix="kilolayer-side-by-side-") as tmp:
        for shape, model in SHAPES[:1] if smoke else SHAPES:
            cfg = config(model, SMOKE_STEPS if smoke else STEPS)
            cfg_path = Path(tmp) / f"{len(rows)}.yaml"
            cfg_path.write_text(yaml.safe_dump(cfg))
            times = {name: ([], []) for name, _ in settings}  # alone, pair (the mean of its two runs)
            for r in range(repeats):
                for name, threads in settings:
                    work = Path(tmp) / f"{len(rows)}-{name.split()[0]}-{r}"
                    work.mkdir()
                    if name == STUDY:
                        alone, pair = study(cfg, work, [0]), [study(cfg, work, [0, 1])]
                    else:
                        alone = race(cfg_path, work, 1, threads)[0]
                        pair = race(cfg_path, work, 2, threads)
                    times[name][0].append(alone)
                    times[name][1].append(pair)
                    print({"shape": shape, "threads": name, "repeat": r, "alone_s": alone, "pair_s": pair}, flush=True)
            for name, _ in settings:
                alone_runs, pairs = times[name]
                pair_runs = [statistics.fmean(pair) for pair in pairs]
                rows.append(
                    {
                        "shape": shape,
                        "threads": name,
                        "alone_s": statistics.median(alone_runs),
                        "side_by_side_s": statistics.median(pair_runs),
                        "ratio": paired_ratio(pair_runs, alone_runs),
                        "alone_runs": alone_runs,
                        "side_by_side_runs": pair_runs,
                        "pairs": pairs,  # each run of each pair: an uneven split shows here
                    }
                )
    steps = SMOKE_STEPS if smoke else STEPS
    return {"machine": machine, "load": load, "cpus": cpus, "steps": steps, "repeats": repeats, "rows": rows}


def paired_ratio(pair_runs: list[float], alone_runs: list[float]) -> float:
    """The median over the repeats of each pair's time over its own repeat's run alone: the two were measured
    minutes apart, so drift in the machine's speed cancels within a repeat."""
    return statistics.median(p / a for p, a in zip(pair_runs, alone_runs, strict=True))


def format_result(res: dict) -> str:
    columns = [
        ("shape", "model"),
        ("threads", "threads"),
        ("alone_s", "alone s"),
        ("side_by_side_s", "side by side s (each)"),
        ("ratio", "side by side / alone"),
    ]
    rows = [
        {
            **r,
            "ratio": f"{r['ratio']:.2f}x",
            "alone_s": _cell(r["alone_s"], r.get("alone_runs")),
            "side_by_side_s": _cell(r["side_by_side_s"], r.get("side_by_side_runs")),
        }
        for r in res["rows"]
    ]
    return common.table(rows, columns)


def _cell(median: float, runs: list[float] | None) -> str:
    """A median, with the range of its runs where there were several."""
    if runs and len(runs) > 1:
        return f"{median:.1f} ({min(runs):.1f}-{max(runs):.1f})"
    return f"{median:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--smoke", action="store_true", help="one shape, two steps, one repeat")
    parser.add_argument(
        "--repeats", type=int, default=REPEATS, help=f"alone-and-pair measurements per cell (default {REPEATS})"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: expected a positive count")
    res = run(smoke=args.smoke, repeats=args.repeats)
    return common.finish(res, format_result(res), args.out)


if __name__ == "__main__":
    sys.exit(main())
