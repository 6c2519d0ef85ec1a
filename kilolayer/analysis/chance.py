"""Chance level: what a model that learned nothing scores, measured on a run's own evaluation data.

A fixed number such as ln(vocabulary) is the wrong yardstick: a seq2seq model on
the reverse task that learned only the token frequencies (10 digits and an end
token) sits at about 2.39 nats, well below ln 13 = 2.56. The chance level here is
the evaluation loss (and accuracy) of the best predictor that ignores the input,
on exactly the targets ``kilolayer train`` evaluates: their empirical entropy for
categorical targets (under the training loss's label smoothing where it has one, as
the evaluation loss is), the target variance for MAE, ln B for a contrastive batch of
B pairs (see each objective's ``chance``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kilolayer.config import Config
from kilolayer.files import write_atomic
from kilolayer.rundir import analysis_file


def chance_level(config: Config) -> dict:
    """``{"loss": ..., "accuracy": ... (where the objective has one)}`` of the best input-independent
    predictor on ``config``'s evaluation batches (the batches ``Engine.evaluate`` scores)."""
    from kilolayer.data import load_source
    from kilolayer.objectives import build_task

    tc = config.train
    source = load_source(config)
    torch.manual_seed(tc.seed)
    task = build_task(config, source)
    batches = source.eval_batches(tc.batch_size, tc.eval_batches * tc.batch_size)
    out = {k: float(v) for k, v in task.objective.chance(task.backbone, batches).items()}
    return {**out, "method": METHOD}


#: a completed run whose final evaluation loss is above this fraction of its chance loss learned nothing
LEARNED_NOTHING = 0.9

#: how the chance level is computed; a cached one of another method is computed again (2: categorical
#: targets under the objective's label smoothing)
METHOD = 2


# what the chance level does not depend on: the backbone's shape and scheme, and how training runs
SHAPE_KEYS = ("layers", "decoder_layers", "width", "heads", "ffn", "scheme", "checkpoint_activations")
_MEMO: dict[str, dict] = {}


def data_key(config: Config) -> str:
    """A key equal for configs whose evaluation targets (hence chance levels) are the same."""
    d = config.model_dump(mode="json")
    d["model"] = {k: v for k, v in d["model"].items() if k not in SHAPE_KEYS}
    d["train"] = {k: d["train"][k] for k in ("batch_size", "eval_batches", "seed")}
    return json.dumps(d, sort_keys=True)


def _cache_path(run_dir: str | Path) -> Path:
    return analysis_file(run_dir, "chance")


def chance_of_run(run_dir: str | Path | None, config: Config, write: bool = True) -> dict:
    """:func:`chance_level` of a run's config, cached in ``RUN/analysis/chance/chance.json`` (and in memory
    for configs that differ only in the backbone's shape, which the targets do not depend on). A cached value
    of another :data:`METHOD` is computed again. ``write=False`` reads the cache but never writes into the run
    directory (the doctor's way: it only reads runs)."""
    if run_dir is not None:
        try:
            cached = json.loads(_cache_path(run_dir).read_text())
            if isinstance(cached, dict) and cached.get("method") == METHOD:
                return cached
        except (OSError, ValueError):
            pass
    key = data_key(config)
    if key not in _MEMO:
        _MEMO[key] = chance_level(config)
    result = dict(_MEMO[key])
    if write and run_dir is not None:
        try:
            _cache_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(_cache_path(run_dir), json.dumps(result) + "\n")
        except OSError:
            pass  # a read-only study directory: compute again next time
    return result


def learned_something(final_loss: float, chance_loss: float | None) -> bool | None:
    """The one "learned nothing" rule: True when a final evaluation loss is at most :data:`LEARNED_NOTHING` x
    the chance loss, False when it is above (or not finite), None when the chance level is unknown (an
    objective without one, or a non-positive or non-finite value): then nobody can say, and every reader
    (doctor, verdicts, report) says so instead of guessing."""
    if chance_loss is None or not math.isfinite(chance_loss) or chance_loss <= 0:
        return None
    if not math.isfinite(final_loss):
        return False
    return final_loss <= LEARNED_NOTHING * chance_loss
