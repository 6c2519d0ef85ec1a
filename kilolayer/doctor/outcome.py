"""What became of a run, by one stated rule, and the chance level it is judged against.

* **diverges**: status.json says ``diverged`` (a non-finite loss, or the smoothed loss above
  ``train.diverge_factor`` x its running minimum after warm-up: the engine's rule, kilolayer.train.policies);
* **stalls**: completed, with a final evaluation loss above 0.9 x the data's chance level — the study
  report's "learned nothing" rule (kilolayer/analysis/chance.py: the loss of the best predictor that
  ignores the input, on the run's own evaluation targets);
* **trains**: completed, with a final evaluation loss at or below 0.9 x chance.

Failed, interrupted and running runs, and a run with no loss logged, have no outcome (``None``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from kilolayer.config import Config
from kilolayer.rundir import read_json, read_metrics, read_status

OUTCOMES = ("trains", "stalls", "diverges")
LEARNED_NOTHING = 0.9  # final loss above this fraction of chance: learned nothing (the study report's rule)

_CHANCE: dict[str, dict] = {}


def _data_key(config: Config) -> str:
    from kilolayer.analysis.chance import data_key

    return data_key(config)


def chance(config: Config, run_dir: str | Path | None = None) -> dict:
    """``chance_level(config)`` (loss, and accuracy where the objective has one). Read from
    RUN/analysis/chance/chance.json when a study cached it there; otherwise computed and kept in memory
    only — this never writes into a run directory."""
    if run_dir is not None:
        cached = read_json(Path(run_dir) / "analysis" / "chance" / "chance.json")
        if isinstance(cached, dict) and "loss" in cached:
            return cached
    key = _data_key(config)
    if key not in _CHANCE:
        from kilolayer.analysis.chance import chance_level

        _CHANCE[key] = chance_level(config)
    return dict(_CHANCE[key])


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


@dataclass
class Outcome:
    """``label`` (one of OUTCOMES, or None), the evidence, and one line saying why."""

    label: str | None
    status: str
    final_loss: float
    chance: float
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


def outcome(run_dir: str | Path, config: Config, records: list[dict] | None = None) -> Outcome:
    """The outcome of the run in ``run_dir`` (see module docstring)."""
    st = read_status(run_dir)
    status = st.get("status", "missing")
    records = read_metrics(run_dir) if records is None else records
    evals = [_number(r.get("loss")) for r in records if r.get("split") == "eval" and "loss" in r]
    trains = [_number(r.get("loss")) for r in records if r.get("split") == "train" and "loss" in r]
    final = evals[-1] if evals else (trains[-1] if trains else math.nan)
    level = chance(config, run_dir)["loss"]
    if status == "diverged":
        return Outcome(
            "diverges",
            status,
            final,
            level,
            f"diverged at step {st.get('step', '?')}: {st.get('reason', '')}".rstrip(": "),
        )
    if status != "completed":
        return Outcome(None, status, final, level, f"{status} at step {st.get('step', 0)}: no outcome yet")
    if not evals and not trains:
        # nothing to judge (metrics.jsonl missing or empty): not a stall
        return Outcome(None, status, final, level, "completed, but metrics.jsonl holds no loss: no outcome")
    frac = final / level if level > 0 else math.nan
    if not math.isfinite(final) or not frac <= LEARNED_NOTHING:
        return Outcome(
            "stalls",
            status,
            final,
            level,
            f"final eval loss {final:.3g} = {frac:.2f} x chance {level:.3g} (> {LEARNED_NOTHING})",
        )
    return Outcome(
        "trains",
        status,
        final,
        level,
        f"final eval loss {final:.3g} = {frac:.2f} x chance {level:.3g} (<= {LEARNED_NOTHING})",
    )
