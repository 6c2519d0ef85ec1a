"""The side studies behind ``bamboo_cpu``'s recipe and its measurements (docs/results.md, "Bamboo on real data"):

    OMP_NUM_THREADS=1 python -m benchmarks.bamboo_cpu_probes recipe --out runs/bamboo_cpu_recipe
    OMP_NUM_THREADS=1 python -m benchmarks.bamboo_cpu_probes mean_pool --out runs/bamboo_cpu_mean_pool
    OMP_NUM_THREADS=1 python -m benchmarks.bamboo_cpu_probes by_loss --out runs/bamboo_cpu_by_loss \
        --study runs/bamboo_cpu

``recipe``: the candidate settings the recipe was chosen from, on seed 7 (a seed the study does not use), trained
without early stopping for a fixed number of steps so that whole validation curves compare: MAE at 64 images a
step and lr 3e-3, at 256 and 3e-3, and at 256 and 1e-2 (the study's, kilolayer/studies/bamboo_cpu.yaml), at
both shapes; at the deep shape (8 x 48), the text classifier on all eight modules' training paragraphs, on the four
largest modules' and on a stratified 5,000 of those at lr 1e-3 and 3e-3, and on Basic's and Writer's (the study's) at
1e-3; next-byte prediction and MLM on the eight modules, the four modules' 5,000 and the study's two (MLM at lr
1e-3, 1e-3 and the study's 2e-3). ``summary`` prints each probe's best validation loss and step, its best loss's
change over the last quarter of the steps it ran (the convergence rule's measure: the quarter's best against the
best of as many evaluations before it) and its seconds of training per 100 steps.

``mean_pool``: the study's supervised group, seed 0, with its tokens mean-pooled instead of a CLS token, and the
same smoothness analysis, beside the CLS-pooled classifier.

``by_loss``: the study's sequence-level classifiers (supervised, text_classify), every shape and seed, stopped
on their validation loss instead of their accuracy. Training does not depend on the stopping measure, so each
is its study twin up to the step it stops, and its checkpoint is the twin's at the lowest validation loss: it
measures how much of the classifiers' token similarity is the later, accuracy-chosen checkpoint's rather than
the objective's. With ``--study`` it prints, per shape, both checkpoints' steps and last-layer cosines and the
over-smoothing difference against MAE or MLM at either.

Each writes its spec to ``OUT/spec.yaml`` and runs it as an ordinary study (``kilolayer study``) with ``--jobs``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import yaml

from kilolayer.data.lo_help import DEFAULT_MODULES
from kilolayer.study.builtin import BUILTIN

DEEP = [8, 48, 3, 192]  # the study's shapes, as its grid key's values
WIDE = [2, 96, 6, 384]
SHAPES = "model.layers,model.width,model.heads,model.ffn"
SEED = 7
TEXT = "data.options.modules,data.options.train_size"
ALL_TEXT = [list(DEFAULT_MODULES), None]  # every module but shared, every training paragraph
FOUR = ["sbasic", "scalc", "swriter", "simpress"]  # the four modules with over 1,000 training paragraphs
FOUR_TEXT = [FOUR, 5000]  # a stratified 5,000 of their training paragraphs
bamboo_cpu = BUILTIN["bamboo_cpu"]  # the study's spec, a new dict on every call
STUDY_DATA = next(g for g in bamboo_cpu()["groups"] if g["name"] == "text_classify")["base"]["data"]
STUDY_TEXT = [STUDY_DATA["options"]["modules"], None]  # Basic and Writer, every training paragraph
# group -> (steps, grid key, the candidate values of that key, shapes); 2,048 validation images per MAE
# evaluation at either batch size
RECIPE = {
    "mae": (
        1500,
        "train.batch_size,train.lr,train.eval_batches",
        [[64, 3e-3, 32], [256, 3e-3, 8], [256, 1e-2, 8]],
        [DEEP, WIDE],
    ),
    "text_classify": (
        1500,
        f"{TEXT},train.lr",
        [[*ALL_TEXT, 1e-3], [FOUR, None, 1e-3], [*FOUR_TEXT, 1e-3], [*FOUR_TEXT, 3e-3], [*STUDY_TEXT, 1e-3]],
        [DEEP],
    ),
    "next_token": (2500, TEXT, [ALL_TEXT, FOUR_TEXT, STUDY_TEXT], [DEEP]),
    "mlm": (2500, f"{TEXT},train.lr", [[*ALL_TEXT, 1e-3], [*FOUR_TEXT, 1e-3], [*STUDY_TEXT, 2e-3]], [DEEP]),
}


def recipe() -> dict:
    groups = []
    for g in bamboo_cpu()["groups"]:
        if g["name"] not in RECIPE:
            continue
        steps, key, values, shapes = RECIPE[g["name"]]
        g = copy.deepcopy(g)
        g["grid"] = {SHAPES: [list(s) for s in shapes], key: copy.deepcopy(values)}
        g["seeds"], g["analyses"] = [SEED], []
        g["base"]["train"].update(steps=steps, patience=0, checkpoint_every=steps)
        if g["base"]["data"]["name"] == "lo_help":  # the study's text options are what the grid sets
            g["base"]["data"]["options"] = {}
            g.pop("analysis_data", None)
        groups.append(g)
    return {
        "name": "bamboo_cpu_recipe",
        "description": "the candidate settings behind bamboo_cpu's recipe: seed 7, fixed steps, whole curves",
        "groups": groups,
        "findings": [],
    }


def mean_pool() -> dict:
    g = copy.deepcopy(next(g for g in bamboo_cpu()["groups"] if g["name"] == "supervised"))
    g["name"] = "supervised_mean"
    g["description"] = "bamboo_cpu's supervised ViT with its tokens mean-pooled instead of a CLS token"
    g["base"]["objective"]["options"]["pool"] = "mean"
    g["base"]["model"]["cls_token"] = False
    g["seeds"] = [0]
    return {
        "name": "bamboo_cpu_mean_pool",
        "description": "bamboo_cpu's supervised group, mean-pooled, seed 0",
        "groups": [g],
        "findings": [],
    }


# the sequence-level classifier groups and the loss min_delta each stops on in ``by_loss`` (under 1% of the
# loss each plateaus at), with the token-level group its token similarity is compared with
BY_LOSS = {"supervised": (0.001, "mae"), "text_classify": (0.01, "mlm")}


def by_loss() -> dict:
    groups = []
    for g in bamboo_cpu()["groups"]:
        if g["name"] not in BY_LOSS:
            continue
        g = copy.deepcopy(g)
        g["description"] = f"bamboo_cpu's {g['name']} group stopped on its validation loss"
        g["name"] = f"{g['name']}_by_loss"
        g["base"]["train"].update(early_stop_metric="loss", min_delta=BY_LOSS[g["name"].removesuffix("_by_loss")][0])
        groups.append(g)
    return {
        "name": "bamboo_cpu_by_loss",
        "description": "bamboo_cpu's classifiers stopped on their validation loss: their lowest-loss checkpoints",
        "groups": groups,
        "findings": [],
    }


def _standing(run: Path) -> tuple[int, float] | None:
    """(standing step, last-layer token cosine) of a finished run, or None."""
    try:
        status = json.loads((run / "status.json").read_text())
        cosine = json.loads((run / "analysis" / "smoothness" / "smoothness.json").read_text())["cosine"][-1]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return int(status.get("best_step") or status["step"]), float(cosine)


def by_loss_summary(out: Path, study: Path) -> str:
    """Per group and shape, means over the seeds both runs of which finished: the accuracy-chosen checkpoint's
    step and last-layer cosine (the study's run), the loss-chosen one's (this probe's), and the over-smoothing
    difference (classifier minus the token-level model of the same shape and seed) at either."""
    from kilolayer.study.spec import expand, load_spec

    lines = [
        "| group | shape | seeds | step: by accuracy / by loss | cosine: by accuracy / by loss "
        "| d against the token-level model: by accuracy / by loss |",
        "|---|---|---|---|---|---|",
    ]
    rows: dict[tuple[str, str], list] = {}
    for p in expand(load_spec(out / "spec.yaml")):
        group = p.group.removesuffix("_by_loss")
        twin = study / "runs" / group / p.name
        token = study / "runs" / BY_LOSS[group][1] / p.name
        a, b, t = _standing(twin), _standing(p.run_dir(out)), _standing(token)
        if a is None or b is None or t is None:
            continue
        shape = f"{p.config.model.layers} x {p.config.model.width}"
        rows.setdefault((group, shape), []).append((a, b, t))
    for (group, shape), xs in rows.items():
        (step_a, cos_a), (step_b, cos_b), (_, cos_t) = ([statistics.fmean(v) for v in zip(*side)] for side in zip(*xs))
        lines.append(
            f"| {group} | {shape} | {len(xs)} | {step_a:.0f} / {step_b:.0f} | {cos_a:.3f} / {cos_b:.3f} "
            f"| {cos_a - cos_t:+.3f} / {cos_b - cos_t:+.3f} |"
        )
    return "\n".join(lines)


def curve_summary(metrics: Path) -> dict:
    """Best validation loss and its step; the change of the best loss over the last quarter of the steps run
    (the best after 0.75 x the last step against the best of as many evaluations up to it, relative; negative
    is a new best), the measure of the convergence rule (findings.still_improving); and training seconds per
    100 steps."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("split") == "eval" and "loss" in r]
    train = [r for r in records if r.get("split") == "train" and "train_s" in r]
    best = min(evals, key=lambda r: r["loss"])
    last = evals[-1]["step"]
    after = [r["loss"] for r in evals if r["step"] > 0.75 * last]
    before = [r["loss"] for r in evals if r["step"] <= 0.75 * last][-len(after) :] or [evals[0]["loss"]]
    per_step = sum(r["train_s"] for r in train) / max(1, train[-1]["step"]) if train else float("nan")
    return {
        "best_loss": best["loss"],
        "best_step": best["step"],
        "last_step": last,
        "last_quarter": (min(after) - min(before)) / abs(min(before)),
        "s_per_100_steps": 100 * per_step,
    }


def setting(values: dict) -> str:
    """A probe point's grid values, short: ``8 x 48, batch_size 256, lr 0.01`` (a module list as its count)."""
    parts = [f"{values['model.layers']} x {values['model.width']}"]
    for key, value in values.items():
        name = key.rsplit(".", 1)[-1]
        if name in ("layers", "width", "heads", "ffn", "seed", "eval_batches"):
            continue
        parts.append(f"{name} {len(value) if isinstance(value, list) else 'all' if value is None else value}")
    return ", ".join(parts)


def summary(out: Path) -> str:
    lines = [
        "| group | setting | best val. loss (step) | best's change over the last quarter | s / 100 steps |",
        "|---|---|---|---|---|",
    ]
    from kilolayer.study.spec import expand, load_spec

    for p in expand(load_spec(out / "spec.yaml")):
        metrics = p.run_dir(out) / "metrics.jsonl"
        if not metrics.exists():
            continue
        s = curve_summary(metrics)
        lines.append(
            f"| {p.group} | {setting(p.values)} | {s['best_loss']:.3f} ({s['best_step']}) "
            f"| {s['last_quarter']:+.1%} to step {s['last_step']} | {s['s_per_100_steps']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    from kilolayer.cli import main as kilolayer

    p = argparse.ArgumentParser(prog="python -m benchmarks.bamboo_cpu_probes", description=__doc__.split("\n\n")[0])
    p.add_argument("probe", choices=("recipe", "mean_pool", "by_loss", "summary"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--study", type=Path, help="by_loss: the bamboo_cpu study folder whose runs it compares with")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    if a.probe == "summary":
        if not (a.out / "spec.yaml").is_file():
            print(f"--out {a.out}: no spec.yaml there; run the recipe probe into it first", file=sys.stderr)
            return 2
        print(summary(a.out))
        return 0
    if a.study is not None and not (a.study / "runs").is_dir():
        print(
            f"--study {a.study}: no bamboo_cpu study there (no runs/ folder); run the study into it first",
            file=sys.stderr,
        )
        return 2
    spec = {"recipe": recipe, "mean_pool": mean_pool, "by_loss": by_loss}[a.probe]()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    rc = kilolayer(["study", str(a.out / "spec.yaml"), "--out", str(a.out), "--jobs", str(a.jobs)])
    if a.probe == "recipe" and rc == 0:
        print(summary(a.out))
    if a.probe == "by_loss" and rc == 0 and a.study is not None:
        print(by_loss_summary(a.out, a.study))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
