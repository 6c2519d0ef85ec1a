"""Calibrate ``kilolayer doctor --forecast``: forecast every point of grids whose outcome is known by training it.

    python -m benchmarks.doctor_calibration --out runs/doctor_calibration --jobs 2
    python -m benchmarks.doctor_calibration --out runs/doctor_calibration --quick-runs runs/demo/runs/deepnet

Each point is trained for real with ``kilolayer train`` (``OMP_NUM_THREADS=1``, at most ``--jobs`` at
once; finished points are kept and skipped), then forecast from its config alone, and the forecast is
compared with the run's outcome by one rule (``kilolayer.doctor.outcome``): *diverges* = status.json says
diverged; *stalls* = completed with a final evaluation loss above 0.9 x the data's chance level (the
study report's "learned nothing"); *trains* = completed below that. Writes
``OUT/calibration_<steps>.json`` and ``OUT/calibration_<steps>.md`` (accuracy per grid and outcome
class, the confusion table and every miss; ``<steps>`` is ``auto`` or ``--steps``). The forecast's
measurements are cached in ``OUT/forecasts/`` and the rule re-applied to them on the next call.

Grids (reverse-digits encoder-decoders of the built-in ``quick`` study: width 64, 200 steps, warm-up 100,
inverse-sqrt schedule, no clipping):

* ``quick``: post_ln / pre_ln / deepnorm at 2L-2L, 6L-6L, 18L-18L, lr 1e-3, seeds 0 and 1 (the ``quick``
  study's DeepNet group; ``--quick-runs DIR`` reads those runs from an existing study instead of training);
* ``lr``: the same schemes at 2L-2L and 6L-6L, lr 1e-5, 1e-4, 1e-2, 3e-2, 1e-1; ReZero and T-Fixup (no
  LayerNorm) at 2L-2L and 6L-6L, lr 1e-3, 1e-2, 1e-1; the three schemes at 2L-2L with lr 1; seed 0;
* ``held_out``: other architectures and objectives, never looked at while the rule's thresholds were
  chosen: a byte-level decoder (causal LM) and a digits ViT (classification), three schemes, three lrs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMES = ("post_ln", "pre_ln", "deepnorm")


@dataclass
class Point:
    grid: str
    name: str
    config: dict

    def run_dir(self, root: Path) -> Path:
        return root / "runs" / self.grid / self.name


def _quick_base() -> dict:
    from kilolayer.study.builtin import BUILTIN

    group = next(g for g in BUILTIN["quick"]()["groups"] if g["name"] == "deepnet")
    return copy.deepcopy(group["base"])


def _with(base: dict, **sections) -> dict:
    cfg = copy.deepcopy(base)
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def _lr_name(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-").replace("e+00", "")


def grid_quick() -> list[Point]:
    base = _quick_base()
    out = []
    for scheme in SCHEMES:
        for depth in (2, 6, 18):
            for seed in (0, 1):
                name = f"scheme={scheme}_layers={depth}_decoder_layers={depth}_seed={seed}"  # the study's names
                cfg = _with(
                    base, model={"scheme": scheme, "layers": depth, "decoder_layers": depth}, train={"seed": seed}
                )
                out.append(Point("quick", name, cfg))
    return out


def grid_lr() -> list[Point]:
    base = _quick_base()
    cells = [(scheme, depth, lr) for scheme in SCHEMES for depth in (2, 6) for lr in (1e-5, 1e-4, 1e-2, 3e-2, 1e-1)]
    # schemes without LayerNorm, whose activations can grow without bound, and a learning rate of 1
    cells += [(scheme, depth, lr) for scheme in ("rezero", "t_fixup") for depth in (2, 6) for lr in (1e-3, 1e-2, 1e-1)]
    cells += [(scheme, 2, 1.0) for scheme in SCHEMES]
    out = []
    for scheme, depth, lr in cells:
        cfg = _with(base, model={"scheme": scheme, "layers": depth, "decoder_layers": depth}, train={"lr": lr})
        out.append(Point("lr", f"{scheme}_{depth}L-{depth}L_lr={_lr_name(lr)}", cfg))
    return out


def _gpt(scheme: str, lr: float) -> dict:
    return {
        "model": {
            "arch": "decoder",
            "scheme": scheme,
            "layers": 6,
            "width": 64,
            "heads": 4,
            "ffn": 256,
            "vocab_size": 262,
            "max_len": 64,
        },
        "objective": {"name": "causal_lm"},
        "data": {"name": "stdlib_bytes", "options": {"seq_len": 64}},
        "train": {
            "steps": 200,
            "batch_size": 16,
            "lr": lr,
            "warmup": 50,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "eval_every": 100,
            "eval_batches": 4,
            "checkpoint_every": 200,
            "log_every": 10,
        },
    }


def _vit(scheme: str, lr: float) -> dict:
    return {
        "model": {
            "arch": "encoder",
            "scheme": scheme,
            "input": "patches",
            "image_size": 8,
            "patch_size": 2,
            "channels": 1,
            "layers": 6,
            "width": 64,
            "heads": 4,
            "ffn": 256,
        },
        "objective": {"name": "classification", "options": {"pool": "cls"}},
        "data": {"name": "digits"},
        "train": {
            "steps": 200,
            "batch_size": 64,
            "lr": lr,
            "warmup": 20,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "eval_every": 100,
            "eval_batches": 4,
            "checkpoint_every": 200,
            "log_every": 10,
        },
    }


def grid_held_out() -> list[Point]:
    out = []
    for kind, make in (("gpt", _gpt), ("vit", _vit)):
        for scheme in SCHEMES:
            for lr in (1e-5, 1e-3, 1e-1):
                out.append(Point("held_out", f"{kind}_{scheme}_lr={_lr_name(lr)}", make(scheme, lr)))
    return out


GRIDS = {"quick": grid_quick, "lr": grid_lr, "held_out": grid_held_out}


# ---------------------------------------------------------------- training the points


def _finished(run_dir: Path) -> bool:
    from kilolayer.rundir import FINISHED, read_status

    return read_status(run_dir).get("status") in FINISHED


def train_points(points: list[Point], root: Path, jobs: int, log=print) -> None:
    """Train every point that has no finished run yet, ``jobs`` at a time, one thread each."""
    from kilolayer.config import dump_yaml, load_config

    todo = [p for p in points if not _finished(p.run_dir(root))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running: list[tuple[Point, subprocess.Popen, float]] = []
    while todo or running:
        while todo and len(running) < jobs:
            p = todo.pop(0)
            cfg_path = root / "configs" / p.grid / f"{p.name}.yaml"
            cfg_path.parent.mkdir(parents=True, exist_ok=True)
            cfg_path.write_text(dump_yaml(load_config(p.config)))
            log_path = root / "logs" / p.grid / f"{p.name}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable,
                "-m",
                "kilolayer",
                "train",
                str(cfg_path),
                "--out",
                str(p.run_dir(root)),
                "--resume",
                "--quiet",
            ]
            with open(log_path, "w") as logf:
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
            running.append((p, proc, time.time()))
        time.sleep(1.0)
        for item in list(running):
            p, proc, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                log(f"[train] {p.grid}/{p.name}: exit {proc.returncode} ({time.time() - t0:.0f}s)")


# ---------------------------------------------------------------- forecasting and scoring


def forecast_point(p: Point, root: Path, steps: int | None, log=print) -> dict:
    """The forecast's measurements for a point, cached in OUT/forecasts/<steps>/<grid>/<name>.json (the rule
    is re-applied to cached measurements; they are re-measured when the measurement code's VERSION changes)."""
    from kilolayer.config import load_config
    from kilolayer.doctor.forecast import VERSION, measure

    path = root / "forecasts" / (str(steps) if steps else "auto") / p.grid / f"{p.name}.json"
    if path.exists():
        cached = json.loads(path.read_text())
        if cached.get("version") == VERSION:
            return cached
    m = measure(load_config(p.config), steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(m))
    log(f"[forecast] {p.grid}/{p.name}: {m['steps_run']} steps in {m['seconds']:.0f}s")
    return m


def score(points: list[Point], root: Path, quick_runs: Path | None, steps: int | None, log=print) -> dict:
    from kilolayer.config import load_config
    from kilolayer.doctor.forecast import RULE, decide
    from kilolayer.doctor.outcome import OUTCOMES, outcome

    rows = []
    for p in points:
        run = quick_runs / p.name if (p.grid == "quick" and quick_runs) else p.run_dir(root)
        truth = outcome(run, load_config(p.config))
        if truth.label is None:
            log(f"[score] {p.grid}/{p.name}: {truth.why}; left out")
            continue
        m = forecast_point(p, root, steps, log)
        verdict, reason, _ = decide(m)
        rows.append(
            {
                "grid": p.grid,
                "point": p.name,
                "run": str(run),
                "outcome": truth.label,
                "why": truth.why,
                "forecast": verdict,
                "reason": reason,
                "seconds": m["seconds"],
                "steps": m["steps_run"],
            }
        )
    summary = {}
    for grid in sorted({r["grid"] for r in rows}) + ["all"]:
        rs = [r for r in rows if grid == "all" or r["grid"] == grid]
        per = {}
        for label in OUTCOMES:
            of = [r for r in rs if r["outcome"] == label]
            per[label] = {"n": len(of), "correct": sum(r["forecast"] == label for r in of)}
        summary[grid] = {
            "n": len(rs),
            "correct": sum(r["forecast"] == r["outcome"] for r in rs),
            "per_class": per,
            "confusion": {
                a: {b: sum(r["outcome"] == a and r["forecast"] == b for r in rs) for b in OUTCOMES} for a in OUTCOMES
            },
        }
    return {"steps": steps or "auto", "rule": RULE, "rows": rows, "summary": summary}


def _pct(c: int, n: int) -> str:
    return f"{c}/{n} ({100 * c / n:.0f}%)" if n else "-"


def markdown(result: dict) -> str:
    from kilolayer.doctor.outcome import OUTCOMES

    lines = [
        f"Forecast with --steps {result['steps']}.",
        "",
        "| grid | points | correct | " + " | ".join(OUTCOMES) + " |",
        "|---|---|---|" + "---|" * len(OUTCOMES),
    ]
    for grid, s in result["summary"].items():
        cells = [_pct(s["per_class"][k]["correct"], s["per_class"][k]["n"]) for k in OUTCOMES]
        lines.append(f"| {grid} | {s['n']} | {_pct(s['correct'], s['n'])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Confusion (all grids; rows: outcome, columns: forecast):",
        "",
        "| outcome \\ forecast | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---|" * len(OUTCOMES),
    ]
    conf = result["summary"]["all"]["confusion"]
    for a in OUTCOMES:
        lines.append(f"| {a} | " + " | ".join(str(conf[a][b]) for b in OUTCOMES) + " |")
    misses = [r for r in result["rows"] if r["forecast"] != r["outcome"]]
    lines += ["", f"Misses ({len(misses)}):", ""]
    lines += [
        f"- `{r['grid']}/{r['point']}`: outcome **{r['outcome']}** ({r['why']}); forecast **{r['forecast']}** "
        f"({r['reason']})"
        for r in misses
    ] or ["- none"]
    secs = [r["seconds"] for r in result["rows"]]
    if secs:
        lines += [
            "",
            f"Forecast time per point: median {sorted(secs)[len(secs) // 2]:.0f} s, max {max(secs):.0f} s "
            f"(one thread).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/doctor_calibration", help="where runs and results go")
    parser.add_argument("--grid", nargs="+", choices=list(GRIDS), default=list(GRIDS), help="grids to use")
    parser.add_argument("--jobs", type=int, default=2, help="training processes at once (one thread each)")
    parser.add_argument(
        "--quick-runs",
        metavar="DIR",
        help="read the quick grid's runs from this directory (a quick study's runs/deepnet)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps each forecast replays (default: the forecast's own, through the warm-up)",
    )
    parser.add_argument("--train-only", action="store_true", help="train the points, do not forecast")
    parser.add_argument("--forecast-only", action="store_true", help="score the runs already trained")
    args = parser.parse_args(argv)
    root = Path(args.out)
    points = [p for g in args.grid for p in GRIDS[g]()]
    quick_runs = Path(args.quick_runs) if args.quick_runs else None
    if not args.forecast_only:
        train_points([p for p in points if not (p.grid == "quick" and quick_runs)], root, args.jobs)
    if args.train_only:
        return 0
    import torch

    torch.set_num_threads(1)
    result = score(points, root, quick_runs, args.steps)
    tag = str(args.steps) if args.steps else "auto"
    (root / f"calibration_{tag}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (root / f"calibration_{tag}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
