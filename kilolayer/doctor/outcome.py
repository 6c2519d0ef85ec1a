"""What became of a run, by one stated rule, and the chance level it is judged against.

* **diverges**: status.json says ``diverged`` (a non-finite loss, or the smoothed loss above
  ``train.diverge_factor`` x its running minimum after warm-up: the engine's rule, kilolayer.train.policies);
* **stalls**: completed, with a standing evaluation loss above ``LEARNED_NOTHING`` x the data's chance level — the
  study report's "learned nothing" rule (kilolayer/analysis/chance.py: the loss of the best predictor that
  ignores the input, on the run's own evaluation targets);
* **trains**: completed, with a standing evaluation loss at or below ``LEARNED_NOTHING`` x chance.

The standing evaluation is the one of the checkpoint that stands for the run (with early stopping, its best step's).
Failed, interrupted and running runs, a run with no evaluation loss logged, and a run whose data has no chance level
have no outcome (``None``). The run's record (:class:`kilolayer.record.RunRecord`) decides each of these, the same
record the study's verdicts read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from kilolayer.analysis.chance import LEARNED_NOTHING
from kilolayer.config import Config
from kilolayer.record import OUTCOMES, RunRecord, run_chance

__all__ = ["OUTCOMES", "Outcome", "chance", "outcome"]


def chance(config: Config, run_dir: str | Path | None = None) -> dict:
    """The chance level of ``config``'s evaluation data (loss, and accuracy where the objective has one): the
    run's cache in RUN/analysis/chance/chance.json when it holds the current method's value, else computed and
    kept in memory only (the doctor never writes into a run directory)."""
    return run_chance(run_dir, config, write=False)


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


def outcome(run_dir: str | Path, config: Config, record: RunRecord | None = None) -> Outcome:
    """The outcome of the run in ``run_dir`` (see module docstring), from its record (read here unless given)."""
    r = RunRecord.read(run_dir, config, read_only=True) if record is None else record
    status, final, level = r.status, r.eval_loss, r.chance_level()["loss"]
    label = r.outcome()
    if r.diverged:
        why = f"diverged at step {r.step}: {r.reason}".rstrip(": ")
    elif status != "completed":
        why = f"{status} at step {r.step}: no outcome yet"
    elif not r.judged:  # nothing to judge (metrics.jsonl missing, or no evaluation logged): not a stall
        why = f"completed, but metrics.jsonl holds no {'evaluation ' if r.train_losses else ''}loss: no outcome"
    elif label is None:
        why = f"standing eval loss {final:.3g}; no chance level, so no outcome: {status}"
    else:
        rule = f"> {LEARNED_NOTHING}" if label == "stalls" else f"<= {LEARNED_NOTHING}"
        why = f"standing eval loss {final:.3g} = {final / level:.2f} x chance {level:.3g} ({rule})"
    return Outcome(label, status, final, level, why)
