"""The side studies behind ``bamboo_cpu``'s recipe and its measurements (docs/results.md, "Bamboo on real data"):

    OMP_NUM_THREADS=1 python -m benchmarks.bamboo_cpu_probes lr --out runs/bamboo_cpu_lr
    OMP_NUM_THREADS=1 python -m benchmarks.bamboo_cpu_probes mean_pool --out runs/bamboo_cpu_mean_pool

``lr``: each trained group of ``bamboo_cpu`` but the fine-tuning ones, at its deep shape (8 x 48) on seed 7 (a
seed the study does not use), learning rate 1e-3 and 3e-3, 600 steps, no analyses: the learning rates of
``BAMBOO_CPU_LR`` are the better of the two by the last validation loss. ``--full-mnist`` drops the study's
5,000-image subset (the probe behind ``BAMBOO_CPU_LR`` ran on the full training split).

``mean_pool``: the study's supervised group, seed 0, with its tokens mean-pooled instead of a CLS token, and the
same smoothness analysis, beside the CLS-pooled classifier.

Each writes its spec to ``OUT/spec.yaml`` and runs it as an ordinary study (``kilolayer study``) with ``--jobs``.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import yaml

from kilolayer.study.builtin import bamboo_cpu

PROBED = ("supervised", "contrastive", "mae", "text_classify", "mlm", "next_token")
DEEP = [8, 48, 3, 192]  # the study's deep shape, as its grid key's values
SHAPES = "model.layers,model.width,model.heads,model.ffn"


def lr_probe(full_mnist: bool = False) -> dict:
    groups = []
    for g in bamboo_cpu()["groups"]:
        if g["name"] not in PROBED:
            continue
        g = copy.deepcopy(g)
        g["grid"] = {SHAPES: [list(DEEP)], "train.lr": [1e-3, 3e-3]}
        g["seeds"], g["analyses"] = [7], []
        g["base"]["train"]["steps"] = 600
        if full_mnist:
            g["base"]["data"]["options"].pop("train_size", None)
        groups.append(g)
    return {
        "name": "bamboo_cpu_lr",
        "description": "learning-rate probe of bamboo_cpu's objectives: 8 x 48, seed 7, lr 1e-3 and 3e-3, 600 steps",
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


def main(argv=None) -> int:
    from kilolayer.cli import main as kilolayer

    p = argparse.ArgumentParser(prog="python -m benchmarks.bamboo_cpu_probes", description=__doc__.split("\n\n")[0])
    p.add_argument("probe", choices=("lr", "mean_pool"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--full-mnist", action="store_true", help="lr: the full MNIST training split")
    a = p.parse_args(argv)
    spec = lr_probe(a.full_mnist) if a.probe == "lr" else mean_pool()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return kilolayer(["study", str(a.out / "spec.yaml"), "--out", str(a.out), "--jobs", str(a.jobs)])


if __name__ == "__main__":
    raise SystemExit(main())
