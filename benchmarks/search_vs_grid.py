"""``kilolayer search`` against the full grid it replaces, on six tasks whose best shapes may differ.

    OMP_NUM_THREADS=1 python -m benchmarks.search_vs_grid --out runs/search_vs_grid

For each task (:data:`OBJECTIVES`: MAE, classification and CLIP on the bundled digits, next-byte and
masked-byte prediction on the standard-library corpus; and next-byte prediction of repeated strings, a task two
layers learn far sooner than one (:data:`REPEATS`); one torch thread, the settings in :data:`COMMON`), the
same parameter-matched shapes that ``kilolayer search`` generates (:func:`kilolayer.study.search.shape.shapes`) are

1. trained to the full budget for two seeds: the grid's best shape (lowest mean final evaluation loss) and its
   seed-to-seed noise (the mean over shapes of |seed 0 - seed 1|);
2. searched by :func:`kilolayer.study.search.run_search` at the same budget, seed 0, with the doctor's
   pre-screen and successive halving (reduction factor 3).

The search's pick is *the grid's best* when it is that shape, *within noise* when its grid mean is no further
from the best's than the grid's seed-to-seed noise, else *worse*. Compute
(:meth:`kilolayer.study.search.result.Search.compute`): model FLOPs (each shape's training FLOPs per sample at full
length x batch size x steps) of the search's trials (the pre-screen's replays they start from included) plus
the pre-screen's other steps, against one seed of the full grid. For each two objectives it says whether their
best shapes differ beyond seed noise: whether each one's best does worse on the other's grid than that grid's
best by more than its noise. Writes ``OUT/search_vs_grid.json`` and ``OUT/search_vs_grid.md``; finished runs
are kept and a re-run only reads them back (its times are then those of the first run, as recorded).
``--grid-from JSON`` reads the grids it holds from an earlier output with the same settings (an objective it
lacks is trained) and runs only the searches (the grid's training is deterministic on one thread: a completed
trial must reproduce its shape's seed-0 loss bit for bit, recorded as ``search_reproduces_grid``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

from kilolayer import rundir
from kilolayer.config import load_config
from kilolayer.study import search as S

#: the byte objectives: 64-byte windows at width 64, so a byte grid costs about what a digits grid does
TEXT = ["model.width=64", "model.max_len=64", "data.options.seq_len=63"]
#: next-byte prediction of a line that repeats a random string of random length ("qzkfe|qzkfe"): after the bar, each
#: byte is a copy of the one L + 1 places back, L the string's length. Two layers learn the copy within a few thousand
#: steps (a first-layer head can find the bar, a second-layer head copy from the offset that gives); one layer learns it
#: too, far more slowly (presumably from heads at fixed offsets). Some of the deeper shapes learn it abruptly, at a step
#: that varies with the seed, so this grid trains 3,000 steps rather than 360. Its corpus (:data:`CORPORA`) is written
#: to OUT.
REPEATS = [
    "model.width=64",
    "model.max_len=32",
    "data.name=text",
    "data.options={}",
    "train.steps=3000",
    "train.eval_every=50",
]
#: the objectives: (name, config, --set overrides of their own)
OBJECTIVES = (
    ("mae", "configs/digits_mae.yaml", []),
    ("classification", "configs/digits_vit.yaml", []),
    ("contrastive", "configs/digits_clip.yaml", []),
    ("next_token", "configs/stdlib_gpt.yaml", TEXT),
    ("mlm", "configs/stdlib_mlm.yaml", TEXT),
    ("next_token_repeats", "configs/stdlib_gpt.yaml", REPEATS),
)
#: every objective: head size 4 (widths in steps of 4: ten shapes on digits, seven on bytes, whose embedding
#: takes its share), a short budget on one thread
COMMON = [
    "model.heads=16",
    "train.steps=360",
    "train.eval_every=20",
    "train.eval_batches=8",
    "train.batch_size=32",
    "train.warmup=30",
    "train.checkpoint_every=120",
    "train.log_every=40",
    "train.threads=1",
]
PARAMS, DEPTHS, TOLERANCE, ETA, SEEDS = 60_000, (1, 24), 0.1, 3, (0, 1)


def repeats_corpus(path: Path, lines: int = 20_000, seed: int = 0) -> None:
    """Write ``lines`` lines ``s|s`` to ``path``, each ``s`` 4-14 random lowercase letters (seeded). A file
    already there must be that corpus: it is left as it is, and any other file stops the benchmark."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    rows = ("".join(rng.choices(letters, k=rng.randint(4, 14))) for _ in range(lines))
    text = "".join(f"{s}|{s}\n" for s in rows)
    if path.exists():
        if path.read_text(errors="replace") != text:
            raise SystemExit(f"{path}: exists and is not the repeated-string corpus this benchmark writes; move it")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


#: objectives that read a corpus this benchmark writes: name -> (its file under OUT, the function that writes it)
CORPORA = {"next_token_repeats": ("repeats.txt", repeats_corpus)}


def objective_config(name: str, config_path: str, sets: list[str], out: Path):
    """The objective's config: ``config_path`` with :data:`COMMON` and ``sets``, reading its corpus from OUT (written
    there first) if it has one. The path is set on the loaded config, never parsed as a --set value."""
    config = load_config(config_path, [*COMMON, *sets])
    if name in CORPORA:
        file, write = CORPORA[name]
        write(out / file)
        config = load_config({**config.model_dump(), "data": {**config.data.model_dump(), "path": str(out / file)}})
    return config


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def final_loss(run: Path, metric: str) -> float:
    r = rundir.RunDir(run)
    evals = [e for e in r.metrics() if e.get("split") == "eval"]
    return float(r.final_eval(evals, on_damaged=lambda _: None).get(metric, math.nan))


def timed(record: dict, key: str, fn):
    """Run ``fn`` and record its wall and CPU seconds under ``key`` unless ``record`` already has them."""
    w, c = time.perf_counter(), time.process_time()
    value = fn()
    if key not in record:
        record[key] = {"wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c}
    return value


def grid(config, shapes, out: Path, times: dict, log) -> dict:
    """{shape: [final loss per seed]} of every shape trained to the full budget."""
    from kilolayer.train.run import train

    losses = {}
    for seed in SEEDS:

        def one_seed(seed=seed):
            for s in shapes:
                run = out / f"{s.name}-seed{seed}"
                if rundir.RunDir(run).state != "completed":
                    cfg = S.trial_config(config, s, config.train.lr)
                    cfg = load_config({**cfg.model_dump(), "train": {**cfg.train.model_dump(), "seed": seed}})
                    train(cfg, run, resume=True, quiet=True)
                    log(f"[grid] {run.name}: {final_loss(run, 'loss'):.4f}")

        timed(times, f"grid_seed{seed}", one_seed)
        for s in shapes:
            losses.setdefault(s.name, []).append(final_loss(out / f"{s.name}-seed{seed}", "loss"))
    return losses


def recorded_grid(path: Path, name: str, sets: list[str], shapes) -> tuple[dict, dict] | None:
    """({shape: [loss per seed]}, the grid's times) of objective ``name`` in a JSON this benchmark wrote, which
    must have measured the same settings and shapes; None if it has no grid of ``name``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--grid-from {path}: expected a search_vs_grid.json this benchmark wrote ({e})") from None
    rows = data["objectives"] if isinstance(data, dict) else data
    row = next((r for r in rows if r["objective"] == name), None)
    if row is None:
        return None
    if row["sets"] != sets or row["shapes"] != [s.name for s in shapes]:
        raise SystemExit(f"{path}: no grid of {name} with these settings and shapes")
    times = {k: v for k, v in row["times"].items() if k.startswith("grid_")}
    return {k: v["losses"] for k, v in row["grid"].items()}, times


def compare(name: str, config_path: str, sets: list[str], out: Path, log=print, grid_from: Path | None = None) -> dict:
    config = objective_config(name, config_path, sets, out)
    shapes = S.shapes(config, PARAMS, DEPTHS, TOLERANCE)
    record_path = out / name / "times.json"
    record_path.parent.mkdir(parents=True, exist_ok=True)
    times = rundir.read_json(record_path, {}) or {}
    recorded = recorded_grid(grid_from, name, [*COMMON, *sets], shapes) if grid_from is not None else None
    if recorded is not None:
        losses, grid_times = recorded
        times.update(grid_times)
    else:
        losses = grid(config, shapes, out / name / "grid", times, log)
    rundir.write_json(record_path, times)
    settings = S.Settings(params=PARAMS, depths=DEPTHS, tolerance=TOLERANCE, reduction_factor=ETA)
    search = timed(times, "search", lambda: S.run_search(config, out / name / "search", settings, log=log))
    rundir.write_json(record_path, times)

    bs, steps = config.train.batch_size, config.train.steps
    means = {k: statistics.fmean(v) for k, v in losses.items()}
    noise = statistics.fmean(abs(v[0] - v[1]) for v in losses.values())
    best = min(means, key=means.get)
    done = [t for t in search.ranked if t.state == "completed"]
    pick = done[0].shape.name if done else None
    tied = search.comparison is not None and search.comparison.tied
    if pick is None:
        verdict = "no pick"
    elif pick == best:
        verdict = "the grid's best"
    elif means[pick] - means[best] <= noise:
        verdict = "within noise"
    else:
        verdict = "worse"
    grid_flops = sum(steps * s.step_flops(bs) for s in shapes)
    spent = search.compute()
    # the trivial baseline: train only the shallowest shape (the first), one seed
    shallow = shapes[0]
    if means[shallow.name] == means[best]:
        shallow_verdict = "the grid's best"
    elif means[shallow.name] - means[best] <= noise:
        shallow_verdict = "within noise"
    else:
        shallow_verdict = "worse"
    # does the grid's best differ from the runner-up by more than the seed noise?
    ordered = sorted(means, key=means.get)
    runner_up = ordered[1] if len(ordered) > 1 else None
    best_gap = means[runner_up] - means[best] if runner_up else math.nan
    return {
        "objective": name,
        "config": config_path,
        "sets": [*COMMON, *sets],
        "corpus": CORPORA[name][0] if name in CORPORA else None,  # under OUT, read as data.path
        "shapes": [s.name for s in shapes],
        "grid": {k: {"losses": v, "mean": means[k]} for k, v in losses.items()},
        "grid_best": best,
        "seed_noise": noise,
        "search_pick": pick,
        "search_tied_with": done[1].shape.name if tied else None,
        "search_trials": {t.shape.name: {"state": t.state, "step": t.step, "value": t.value} for t in search.trials},
        "search_prescreen": {
            sc.shape: {"verdict": sc.verdict, "raced": sc.kept, "reason": sc.reason} for sc in search.screens
        },
        "verdict": verdict,
        "grid_flops_one_seed": grid_flops,
        "search_compute": spent,
        "search_rung_decisions": search.decisions,
        # a completed trial is trained as the grid's seed 0 is: its loss must be that run's, bit for bit
        "search_reproduces_grid": all(
            t.value == losses[t.shape.name][0] for t in search.trials if t.state == "completed"
        ),
        "grid_from": str(grid_from) if recorded is not None else None,
        "shallowest": shallow.name,
        "shallowest_verdict": shallow_verdict,
        "shallowest_flops": steps * shallow.step_flops(bs),
        "grid_runner_up": runner_up,
        "grid_best_gap": best_gap,
        "grid_best_beyond_noise": bool(best_gap > noise),
        "times": times,
    }


def table(rows: list[dict], threads: int) -> str:
    def cs(t: dict) -> str:
        return f"{t['wall_s']:.0f} s wall / {t['cpu_s']:.0f} s CPU"

    lines = [
        "| objective | grid best (mean loss, seeds 0 / 1) | runner-up, gap vs seed noise | search pick (its grid "
        "mean) | pick is | search FLOPs / grid: total (race; pre-screen's other steps) | shallowest only: shape, "
        "is, FLOPs / grid | grid time, one seed | search time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        best, pick = r["grid_best"], r["search_pick"]
        b = r["grid"][best]
        g = r["grid_flops_one_seed"]
        c = r["search_compute"]
        total, race, extra = (c[k]["flops"] / g for k in ("total", "race", "extra"))
        pick_text = f"{pick} ({r['grid'][pick]['mean']:.4f})" if pick else "-"
        if r["search_tied_with"]:
            pick_text += f", within noise of {r['search_tied_with']} (no pick written)"
        gap = (
            f"{r['grid_runner_up']}, {r['grid_best_gap']:.4f} vs {r['seed_noise']:.4f}: "
            + ("beyond noise" if r["grid_best_beyond_noise"] else "within noise")
            if r["grid_runner_up"]
            else "-"
        )
        shallow = f"{r['shallowest']}, {r['shallowest_verdict']}, {r['shallowest_flops'] / g:.0%}"
        lines.append(
            f"| {r['objective']} | {best} ({b['mean']:.4f}: {b['losses'][0]:.4f} / {b['losses'][1]:.4f}) | "
            f"{gap} | {pick_text} | {r['verdict']} | **{total:.1%}** ({race:.1%}; {extra:.1%}) | "
            f"{shallow} | {cs(r['times']['grid_seed0'])} | {cs(r['times']['search'])} |"
        )
    lines += ["", f"CPU: {cpu_model()}; {threads} torch thread; shapes per objective and every loss: the JSON."]
    return "\n".join(lines) + "\n"


def grid_table(rows: list[dict]) -> str:
    lines = ["| objective | " + " | ".join(rows[0]["shapes"]) + " |", "|---|" + "---|" * len(rows[0]["shapes"])]
    for r in rows:
        cells = []
        for s in r["shapes"]:
            g, t = r["grid"].get(s), r["search_trials"].get(s)
            cell = f"{g['mean']:.4f}" if g else "-"
            if t and t["state"] != "completed":
                cell += f" ({t['state']} at {t['step']})"
            elif not t and s in r.get("search_prescreen", {}):
                cell += f" (dropped: forecast to {r['search_prescreen'][s]['verdict'].removesuffix('s')})"
            cells.append(f"**{cell}**" if s == r["grid_best"] else cell)
        lines.append(f"| {r['objective']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def differ(rows: list[dict]) -> list[dict]:
    """For each two objectives: does each one's grid best do worse on the other's grid than that grid's best, by
    more than its seed noise? Their best shapes differ beyond noise when it does on both grids; a shape the
    other grid lacks is compared by depth (the other grid's shape of the same depth, if one)."""

    def on(row: dict, shape: str) -> str | None:
        if shape in row["grid"]:
            return shape
        depth = shape.split("x")[0]
        return next((s for s in row["shapes"] if s.split("x")[0] == depth), None)

    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            sides = []
            for mine, other in ((a, b), (b, a)):
                shape = on(other, mine["grid_best"])
                gap = other["grid"][shape]["mean"] - other["grid"][other["grid_best"]]["mean"] if shape else math.nan
                sides.append(
                    {
                        "best_of": mine["objective"],
                        "on": other["objective"],
                        "as": shape,
                        "gap": gap,
                        "noise": other["seed_noise"],
                        "beyond_noise": bool(gap > other["seed_noise"]),
                    }
                )
            out.append(
                {
                    "objectives": [a["objective"], b["objective"]],
                    "bests": [a["grid_best"], b["grid_best"]],
                    "sides": sides,
                    "differ_beyond_noise": all(x["beyond_noise"] for x in sides),
                }
            )
    return out


def differ_lines(pairs: list[dict]) -> str:
    lines = []
    for p in pairs:
        parts = [
            f"{x['best_of']}'s best as {x['as'] or '-'} on {x['on']}: {x['gap']:+.4f} vs noise {x['noise']:.4f} "
            f"({'beyond' if x['beyond_noise'] else 'within'})"
            for x in p["sides"]
        ]
        verdict = "differ beyond seed noise" if p["differ_beyond_noise"] else "do not differ beyond seed noise on both"
        head = f"- {' vs '.join(p['objectives'])}: bests {' / '.join(p['bests'])}, {verdict}; "
        lines.append(head + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/search_vs_grid", help="where the runs and the table go")
    p.add_argument(
        "--grid-from",
        type=Path,
        help="read the grids' losses and times from a JSON this benchmark wrote with the same settings instead of "
        "training them again (the search's completed trials are checked to reproduce them bit for bit)",
    )
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    t0, c0 = time.perf_counter(), time.process_time()
    rows = [compare(name, path, sets, out, grid_from=args.grid_from) for name, path, sets in OBJECTIVES]
    pairs = differ(rows)
    md = table(rows, torch.get_num_threads()) + "\n" + grid_table(rows) + "\n" + differ_lines(pairs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "search_vs_grid.json").write_text(json.dumps({"objectives": rows, "pairs": pairs}, indent=2) + "\n")
    (out / "search_vs_grid.md").write_text(md)
    print(md)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"this invocation: {wall:.0f} s wall, {cpu:.0f} s CPU (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
