"""Where the built-in CPU studies' points gain from bf16 and from ``torch.compile``, within their step budgets.

For each point below (the largest shapes of ``quick``, ``bamboo_cpu`` and ``deepnet_mt_depth``, seed 0), four
``kilolayer train`` runs of :data:`STEPS` steps, as the point's config asks but at one thread: eager fp32, eager
bf16 autocast, and each of them with ``train.compile: layers``. Each run evaluates once, at its last step, as
the point would (a compiled layer compiles again for evaluation); checkpoints and stability diagnostics are
off. The runs go one at a time (``--jobs 1``, the default): a run beside another is slowed by what that one
does (compiling or stepping), which would decide the ratios. Every run compiles from an empty inductor cache
of its own.

From each run: its steady step (the median of the last half of its 10-step intervals) and its fixed cost (the
run's seconds less its steps at that step: set-up, the first steps, compiling, the evaluation). A point's time
at its step cap (``train.steps``) is then fixed cost + cap x step, per variant; ``x eager fp32`` divides the
eager fp32 estimate by it (above 1: faster), and a compiled variant repays its compile after (its fixed cost
less the eager one's) / (the eager step less its step) steps. ``auto`` is what ``train.precision: auto``
decides for the point's step here, with the ratio its probe measured (:mod:`kilolayer.train.host.precision`,
at one thread, from the cache where it holds the step); a study decides once for all its points.

    python -m benchmarks.study_points [--smoke] [--jobs K] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from benchmarks import common

ROOT = Path(__file__).resolve().parent.parent
STEPS, SMOKE_STEPS = 40, 4
LOG_EVERY, SMOKE_LOG_EVERY = 10, 1
#: (study, point): the points measured
POINTS = [
    ("quick", "deepnet/scheme=deepnorm_layers=18_decoder_layers=18_seed=0"),
    ("quick", "mae/layers=16_width=64_heads=1_ffn=256_seed=0"),
    ("bamboo_cpu", "supervised/layers=8_width=48_heads=3_ffn=192_seed=0"),
    ("bamboo_cpu", "mae/layers=8_width=48_heads=3_ffn=192_seed=0"),
    ("bamboo_cpu", "text_classify/layers=8_width=48_heads=3_ffn=192_seed=0"),
    ("bamboo_cpu", "mlm/layers=8_width=48_heads=3_ffn=192_seed=0"),
    ("bamboo_cpu", "next_token/layers=8_width=48_heads=3_ffn=192_seed=0"),
    ("deepnet_mt_depth", "deepnet/scheme=deepnorm_layers=18_decoder_layers=18_seed=0"),
]
SMOKE_POINTS = [("quick", "deepnet/scheme=deepnorm_layers=2_decoder_layers=2_seed=0")]
#: (precision, train.compile) of each run of a point; the first is what the others are compared with
VARIANTS = [("fp32", False), ("bf16", False), ("fp32", "layers"), ("bf16", "layers")]
SMOKE_VARIANTS = VARIANTS[:2]


def point_config(study: str, key: str) -> dict:
    """The config of point ``key`` (group/name) of the built-in ``study``, as a plain dict."""
    from kilolayer.study.spec import expand, load_spec

    for p in expand(load_spec(study)):
        if p.key == key:
            return p.config.model_dump(mode="json")
    raise SystemExit(f"benchmarks.study_points: {study} has no point {key}")


def steady_step(records: list[dict]) -> float:
    """Seconds per step: the median over the last half of the train records of their interval's seconds per step
    (a compiled run's first interval holds its compile)."""
    per_step, prev = [], 0
    for r in records:
        per_step.append(r["train_s"] / (r["step"] - prev))
        prev = r["step"]
    return statistics.median(per_step[len(per_step) // 2 :])


def run_variant(config: dict, precision: str, compile_mode, steps: int, log_every: int) -> dict:
    """One ``kilolayer train`` run of ``config`` at ``precision`` and ``compile_mode``, one thread, ``steps`` steps and
    one evaluation at the end; its steady step and fixed cost (module docstring)."""
    sets = {
        "precision": precision,
        "compile": compile_mode,
        "steps": steps,
        "log_every": log_every,
        "eval_every": steps,
        "patience": 0,
        "checkpoint_every": 0,
        "diagnostics_every": 0,
        "init_from": None,
        "freeze_backbone": False,
    }
    with tempfile.TemporaryDirectory(prefix="kilolayer-study-points-") as tmp:
        cfg = dict(config, train={**config["train"], **sets})
        (Path(tmp) / "config.yaml").write_text(yaml.safe_dump(cfg))
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"))
        cmd = [sys.executable, "-m", "kilolayer", "train", str(Path(tmp) / "config.yaml")]
        cmd += ["--out", str(Path(tmp) / "run"), "--quiet", "--threads", "1"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return {"precision": precision, "compile": compile_mode, "error": tail}
        status = json.loads((Path(tmp) / "run" / "status.json").read_text())
        lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r.get("split") == "train" and "train_s" in r]
    step = steady_step(records)
    return {
        "precision": precision,
        "compile": compile_mode,
        "steps": steps,
        "step_s": step,
        "fixed_s": status["seconds"] - steps * step,
        "run_s": status["seconds"],
        "wall_s": wall,
    }


def step_probe(config: dict) -> dict:
    """What ``train.precision: auto`` decides for ``config``'s step here, at one thread, and the ratio it read."""
    import torch

    from kilolayer.config import load_config
    from kilolayer.train.engine import step_speedup
    from kilolayer.train.host.precision import StepShape, auto, cached_speedup, cpu_bf16

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_config(config)
        decided = auto("cpu", cfg, step_speedup)
        ratio = cached_speedup(StepShape.of(cfg), step_speedup)[0] if cpu_bf16()[0] else None
    finally:
        torch.set_num_threads(before)
    return {"auto": decided.value, "auto_reason": decided.reason, "probe_x": ratio}


def summarize(point: dict) -> None:
    """Add each variant's estimate at the point's step cap, its ratio to eager fp32 and its payback steps."""
    cap = point["cap"]
    base = next((v for v in point["variants"] if "step_s" in v), None)
    for v in point["variants"]:
        if "step_s" not in v or base is None:
            continue
        v["at_cap_s"] = v["fixed_s"] + cap * v["step_s"]
        v["x_eager_fp32"] = (base["fixed_s"] + cap * base["step_s"]) / v["at_cap_s"]
        v["step_x"] = base["step_s"] / v["step_s"]
        extra, saved = v["fixed_s"] - base["fixed_s"], base["step_s"] - v["step_s"]
        v["repays_after"] = None if v is base else (max(0.0, extra) / saved if saved > 0 else float("inf"))


def run(smoke: bool = False, jobs: int = 1) -> dict:
    from kilolayer.train.host.precision import cpu_bf16

    points = SMOKE_POINTS if smoke else POINTS
    variants = SMOKE_VARIANTS if smoke else VARIANTS
    steps, log_every = (SMOKE_STEPS, SMOKE_LOG_EVERY) if smoke else (STEPS, LOG_EVERY)
    has_bf16, flag = cpu_bf16()
    if not has_bf16:
        variants = [v for v in variants if v[0] == "fp32"]
    result = {"machine": common.machine(), "load": common.load_average(), "steps": steps, "jobs": jobs}
    result["bf16_instructions"] = flag
    rows, configs = [], []
    for study, key in points:
        configs.append(point_config(study, key))
        rows.append({"study": study, "point": key, "cap": configs[-1]["train"]["steps"], **step_probe(configs[-1])})
    tasks = [(row, config, p, c) for row, config in zip(rows, configs) for p, c in variants]
    with ThreadPoolExecutor(jobs) as pool:
        done = list(pool.map(lambda t: run_variant(t[1], t[2], t[3], steps, log_every), tasks))
    for (row, _, _, _), variant in zip(tasks, done):
        row.setdefault("variants", []).append(variant)
    for row in rows:
        summarize(row)
    result["points"] = rows
    return result


def _variant_name(v: dict) -> str:
    return f"{v['precision']}{' + compile' if v['compile'] else ''}"


def _repays(v: dict, cap: int) -> str:
    after = v.get("repays_after")
    if after is None:
        return "-"
    if after == float("inf"):
        return "never (no faster step)"
    return f"after {after:,.0f} steps ({'within' if after <= cap else 'beyond'} the cap)"


def format_result(res: dict) -> str:
    lines = [
        f"Measured {res['machine']['date']} on {res['machine']['cpu']} (bf16 instructions: {res['bf16_instructions']}),"
        f" {res['steps']} steps a run, {res['jobs']} runs at a time, one thread each.",
        "",
        "| study | point | step cap | auto here (probe) | run | step ms | x eager fp32 step | fixed s "
        "| x eager fp32 at the cap | compile repays |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["points"]:
        auto = f"{row['auto']} ({row['probe_x']:.2f}x)" if row.get("probe_x") else row["auto"]
        for v in row["variants"]:
            cells = f"| {row['study']} | {row['point']} | {row['cap']:,} | {auto} | {_variant_name(v)} | "
            if "error" in v:
                lines.append(cells + f"failed: {v['error']} | - | - | - | - |")
                continue
            lines.append(
                cells + f"{v['step_s'] * 1000:,.1f} | {v['step_x']:.2f} | {v['fixed_s']:.1f} | "
                f"{v['x_eager_fp32']:.2f} | {_repays(v, row['cap']) if v['compile'] else '-'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.study_points", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--smoke", action="store_true", help="one small point, eager only, a few steps")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each (default 1)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs}: expected 1 or more")
    res = run(smoke=args.smoke, jobs=args.jobs)
    return common.finish(res, format_result(res), args.out)


if __name__ == "__main__":
    sys.exit(main())
