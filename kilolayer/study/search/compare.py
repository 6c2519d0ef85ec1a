"""Two runs' metric compared on the same evaluation batches, with the verdict rule's Student-t bound
(:func:`kilolayer.verdicts.rule.t_bound`): whether a rung's cut or the top two are within noise."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kilolayer import rundir
from kilolayer.config import load_config


@dataclass
class Comparison:
    """The top two completed trials' metric on the same evaluation batches: the mean difference, its standard
    error over batches, and whether it is within noise (|mean| below the two-sided 95% Student-t bound)."""

    first: int
    second: int
    metric: str
    batches: int
    difference: float
    stderr: float
    bound: float
    tied: bool
    agrees: bool = (
        True  # the difference has the sign of the ranking (False: the re-evaluation ranks them the other way)
    )


def per_batch_metric(run: Path, metric: str) -> list[float]:
    """``metric`` of the run's chosen checkpoint on each of its evaluation batches, masks and noise drawn from one
    fixed seed, so that two runs of one config are scored on the same draws."""
    import torch

    from kilolayer.train.checkpoint import load_run_weights, standing_checkpoint
    from kilolayer.train.engine import Engine, to_device

    config = load_config(run / rundir.CONFIG)
    ckpt = standing_checkpoint(run, patience=config.train.patience, on_damaged=lambda _: None)
    engine = Engine(config, fresh=False)
    load_run_weights(run, engine.task, ckpt)
    values = []
    with engine.evaluating():
        torch.manual_seed(config.train.seed)
        for batch in engine.eval_data():
            found = engine.objective.evaluate(engine.task.backbone, [to_device(batch, engine.env.device)])
            values.append(float(found[metric]))
    return values


def compare_runs(a: Path, b: Path, metric: str) -> tuple[float, float, float, int] | None:
    """``a``'s metric minus ``b``'s on the same evaluation batches (:func:`per_batch_metric`): (mean difference,
    its standard error over batches, the two-sided 95% Student-t bound, batches); None with one batch."""
    from kilolayer.verdicts.rule import t_bound

    diffs = [x - y for x, y in zip(per_batch_metric(a, metric), per_batch_metric(b, metric))]
    if len(diffs) < 2:
        return None
    return *t_bound(diffs, 0.975), len(diffs)
