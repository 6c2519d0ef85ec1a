"""``kilolayer evaluate``: a run's chosen checkpoint scored on a split, with the metrics its evaluations report and,
for seq2seq, the baselines beside them, written to ``RUN/scores_SPLIT.json``.

The run's own config is used, with its evaluation pointed at ``split`` (``data.options.eval_split``, for the sources
that hold a test split) and stretched over every sample of it, or over its first ``samples`` in the order its
evaluations read them (a many-to-many source takes its directions in turn, so every direction gets its share);
a seq2seq run decodes every pair scored, whatever its ``decode_samples`` (a cap that saves time while training).
The checkpoint is the one that stands for the run (:func:`kilolayer.rundir.chosen_checkpoint`: the newest intact
one; with early stopping, the best).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kilolayer import rundir
from kilolayer.config import Config, load_config
from kilolayer.data import load_source
from kilolayer.errors import ConfigError, InputError
from kilolayer.objectives.baselines import translates
from kilolayer.train import distributed as D
from kilolayer.train.checkpoint import load_run_weights, standing_checkpoint
from kilolayer.train.engine import Engine
from kilolayer.train.run import recorded_precision


def for_split(config: Config, split: str | None, decode: int | None = None) -> Config:
    """``config`` with every evaluation pair decoded (the first ``decode`` when given) and, when ``split`` is given
    and is not the one it evaluates on, ``data.options.eval_split`` set to it."""
    objective = config.objective.model_dump()
    objective["options"] = {k: v for k, v in objective["options"].items() if k != "decode_samples"}
    if decode is not None and config.objective.name == "seq2seq":
        objective["options"]["decode_samples"] = decode
    data = config.data.model_dump()
    if split is not None and split != data["options"].get("eval_split", "validation"):
        data["options"] = {**data["options"], "eval_split": split}
    return load_config({**config.model_dump(), "objective": objective, "data": data})


def score_run(run_dir: str | Path, split: str | None = None, device: str = "auto", samples: int | None = None) -> dict:
    """Score the run in ``run_dir`` on all of ``split`` (default: the split it evaluates on), or on its first
    ``samples`` rounded up to whole evaluation batches, and write the record to ``scores_SPLIT.json`` there:
    ``data``, ``split``, ``samples`` (those scored), ``of`` (the split's, where fewer were scored), ``checkpoint``,
    ``step``, ``metrics`` (those of its evaluations), and for seq2seq ``baselines`` (name -> scores on the same
    pairs), beside a nearest-neighbour baseline ``translates`` (:func:`kilolayer.objectives.baselines.translates`)
    and, for a many-to-many source, ``directions`` (:func:`kilolayer.objectives.directions.direction_table`).
    A record of more samples is not replaced by one of fewer."""
    run_dir = Path(run_dir)
    if split is not None and split not in rundir.SCORED_SPLITS:
        raise InputError(f"--split {split}: expected one of {', '.join(rundir.SCORED_SPLITS)}")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
        raise InputError(f"--samples {samples}: expected a whole number of samples, at least 1")
    if not (run_dir / rundir.CONFIG).is_file():
        raise InputError(f"{run_dir}: not a kilolayer run directory (no config.yaml)")
    config = load_config(run_dir / rundir.CONFIG)
    ckpt = standing_checkpoint(run_dir, patience=config.train.patience)
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use cpu or auto")
    try:
        source = load_source(for_split(config, split))
    except ConfigError as err:
        if str(err).startswith("data.options.eval_split:"):
            raise InputError(
                f"--split {split}: data.name={config.data.name!r} has no {split} split (it evaluates on its "
                f"validation split only)"
            ) from None
        raise
    size = config.train.batch_size
    scored = source.eval_size if samples is None else min(source.eval_size, -(-samples // size) * size)
    if scored < source.eval_size and config.objective.name == "contrastive":
        raise InputError(
            f"--samples {samples}: contrastive recall ranks each sample among those scored, so a part of the split "
            "is no estimate of the whole; score every sample (leave out --samples)"
        )
    target = run_dir / rundir.scores_name(source.eval_split)
    _keep_larger(target, scored, source.eval_size, ckpt.name, samples, size)
    config = for_split(config, split, None if scored == source.eval_size else scored)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    # scored at the precision the run trained and evaluated at (an auto run's recorded one)
    recorded = recorded_precision(run_dir, ckpt) if config.train.precision == "auto" else None
    dev = torch.device("cuda" if use_cuda else "cpu")
    engine = Engine(config, D.Dist(device=dev), fresh=False, source=source, precision=recorded and recorded.value)
    step = load_run_weights(run_dir, engine.task, ckpt)
    batches = max(1, math.ceil(scored / size))
    record = {
        "data": config.data.name,
        "split": source.eval_split,
        "samples": scored,
        **({"of": source.eval_size} if scored < source.eval_size else {}),
        "checkpoint": ckpt.name,
        "step": step,
        "metrics": engine.evaluate(batches),
    }
    found = engine.baselines(batches, paired=True)
    if found.get("baselines"):
        record["baselines"] = found["baselines"]
        verdict = translates(record["metrics"], found["baselines"])
        if verdict is not None:
            record["translates"] = verdict.as_dict()
    if found.get("directions"):
        record["directions"] = found["directions"]
    _keep_larger(target, scored, source.eval_size, ckpt.name, samples, size)  # another scoring may have ended since
    rundir.write_json(target, record)
    return record


def _keep_larger(target: Path, scored: int, total: int, checkpoint: str, samples: int | None, size: int) -> None:
    """Refuse to replace ``target``'s score of more samples of the same checkpoint with one of ``scored``, a part of
    the split's ``total`` (a score of an older checkpoint, or of the whole split, replaces it)."""
    before = rundir.read_json(target, None)
    if scored == total or not isinstance(before, dict) or before.get("checkpoint") != checkpoint:
        return
    held = before.get("samples")
    if isinstance(held, int) and held > scored:
        asked = f"{scored:,}"
        if samples != scored:
            asked += f" ({samples:,} rounded up to whole batches of {size})"
        raise InputError(
            f"--samples {samples}: {target} holds a score of {held:,} samples of the same checkpoint ({checkpoint}), "
            f"more than the {asked} asked for; move it away to replace it"
        )
