"""What became of a run, by one stated rule, and the chance level it is judged against.

* **diverges**: status.json says ``diverged`` (a non-finite loss, or the smoothed loss above
  ``train.diverge_factor`` x its running minimum after warm-up: the engine's rule, kilolayer.train.policies);
* **stalls**: completed, with a final evaluation loss above ``LEARNED_NOTHING`` x the data's chance level — the study
  report's "learned nothing" rule (kilolayer/analysis/chance.py: the loss of the best predictor that
  ignores the input, on the run's own evaluation targets);
* **trains**: completed, with a final evaluation loss at or below ``LEARNED_NOTHING`` x chance.

Failed, interrupted and running runs, a run with no loss logged, and a run whose data has no chance level
have no outcome (``None``): :func:`kilolayer.analysis.chance.learned_something` is the one rule, shared with
the study's verdicts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from kilolayer.analysis.chance import LEARNED_NOTHING, chance_of_run, learned_something
from kilolayer.config import Config
from kilolayer.rundir import logged_number, read_metrics, read_status

OUTCOMES = ("trains", "stalls", "diverges")


def chance(config: Config, run_dir: str | Path | None = None) -> dict:
    """The chance level of ``config``'s evaluation data (loss, and accuracy where the objective has one): the
    study's cache in RUN/analysis/chance/chance.json when it holds the current method's value, else computed
    and kept in memory only (the doctor never writes into a run directory)."""
    try:
        return chance_of_run(run_dir, config, write=False)
    except NotImplementedError:  # an objective of the user's that defines no chance level
        return {"loss": math.nan}


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
    evals = [logged_number(r.get("loss")) for r in records if r.get("split") == "eval" and "loss" in r]
    trains = [logged_number(r.get("loss")) for r in records if r.get("split") == "train" and "loss" in r]
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
    learned = learned_something(final, level)
    if learned is None:
        return Outcome(
            None, status, final, level, f"final eval loss {final:.3g}; no chance level, so no outcome: {status}"
        )
    if not learned:
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
