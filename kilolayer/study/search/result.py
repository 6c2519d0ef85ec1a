"""What a search found, as the report shows it: its trials read back from Optuna's storage and their run
directories (:func:`collect`), ranked, and the top two compared (:func:`compare_top`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from kilolayer import rundir
from kilolayer.config import Config
from kilolayer.errors import KilolayerError
from kilolayer.study.search.compare import Comparison, compare_runs
from kilolayer.study.search.plan import Plan
from kilolayer.study.search.screen import Screen
from kilolayer.study.search.settings import Settings
from kilolayer.study.search.shape import Shape


@dataclass
class TrialResult:
    """One trial, read back from Optuna's storage and its run directory."""

    number: int
    shape: Shape
    lr: float
    run: Path
    state: str  # completed | pruned | diverged | failed | unfinished
    step: int
    value: float | None
    reason: str
    curve: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    continued: bool = False  # pruned, then continued by hand past its rung: value and step are its run's own
    from_prescreen: int = 0  # its first steps: the pre-screen's replay of its config (counted in ``step``)


STATE_ORDER = {"completed": 0, "pruned": 1, "unfinished": 2, "diverged": 3, "failed": 4}


@dataclass
class Search:
    """Everything the report shows."""

    config: Config
    settings: Settings
    out: Path
    shapes: list[Shape]
    screens: list[Screen]
    trials: list[TrialResult]
    planned: int
    direction: str
    rung: int
    comparison: Comparison | None = None
    best: Path | None = None
    notes: list[str] = field(default_factory=list)
    stopped_by_budget: str = ""
    decisions: list[dict] = field(default_factory=list)  # each rung's judgement (:meth:`_Racer.judge`)
    rungs: list[int] = field(default_factory=list)
    plan: Plan | None = None  # the trials' length chosen for --minutes
    compare_seconds: float = 0.0  # the top two's comparison (:func:`compare_top`) in this run

    def seconds_spent(self) -> float:
        """Seconds the search has spent on what ``--minutes`` counts: planning, the pre-screen's forecasts, the
        trials' training, the rung cuts, and the top two's comparison."""
        probe = self.plan.probe_seconds if self.plan is not None else 0.0
        return (
            probe
            + sum(sc.seconds for sc in self.screens)
            + sum(t.seconds for t in self.trials)
            + sum(float(d.get("seconds", 0.0)) for d in self.decisions)
            + self.compare_seconds
        )

    def compute(self) -> dict:
        """What the search spent against a full grid of the planned trials (each trained for all train.steps,
        no pre-screen), in optimizer steps and model FLOPs (each shape's training FLOPs per sample at full
        length x batch size x steps): ``race`` (the trials' steps, those they started from the pre-screen
        included), ``prescreen`` (every step the forecasts replayed), ``reused`` (the replayed steps trials
        started from), ``extra`` (the pre-screen's other steps) and ``total`` = race + extra; ``grid``."""
        bs, steps = self.config.train.batch_size, self.config.train.steps
        flops = {s.name: s.step_flops(bs) for s in self.shapes}
        kept = [s for s, sc in zip(self.shapes, self.screens) if sc.kept]
        per_trial = self.planned / max(1, len(kept))  # trials per shape in a full grid of the planned trials
        out = {
            "race": (sum(t.step for t in self.trials), sum(t.step * flops[t.shape.name] for t in self.trials)),
            "prescreen": (sum(sc.steps for sc in self.screens), sum(sc.steps * flops[sc.shape] for sc in self.screens)),
            "reused": (
                sum(t.from_prescreen for t in self.trials),
                sum(t.from_prescreen * flops[t.shape.name] for t in self.trials),
            ),
            "grid": (self.planned * steps, per_trial * sum(steps * flops[s.name] for s in kept)),
        }
        out["extra"] = tuple(a - b for a, b in zip(out["prescreen"], out["reused"]))
        out["total"] = tuple(a + b for a, b in zip(out["race"], out["extra"]))
        return {k: {"steps": v[0], "flops": v[1]} for k, v in out.items()}

    @property
    def ranked(self) -> list[TrialResult]:
        sign = -1.0 if self.direction == "maximize" else 1.0

        def key(t: TrialResult):
            value = sign * t.value if t.value is not None and math.isfinite(t.value) else math.inf
            return STATE_ORDER[t.state], -t.step if t.state != "completed" else 0, value

        return sorted(self.trials, key=key)


def _final_value(run: Path, metric: str) -> float:
    r = rundir.RunDir(run)
    evals = [e for e in r.metrics() if e.get("split") == "eval"]
    record = r.final_eval(evals, on_damaged=lambda _: None)
    return float(record.get(metric, math.nan))


def collect(study, found: dict[str, Shape], out: Path, metric: str) -> list[TrialResult]:
    """Every started trial, from the study and its run directory. A pruned trial that was continued by hand
    (``kilolayer train --resume``) past the rung it was pruned at shows its run's own final evaluation, flagged
    as continued outside the search."""
    from optuna.trial import TrialState

    results = []
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING or "run" not in t.user_attrs or t.params.get("shape") not in found:
            continue
        run = out / t.user_attrs["run"]
        r = rundir.RunDir(run)
        status = r.status
        curve = []
        if run.is_dir():
            try:
                curve = [
                    (int(e["step"]), float(e[metric])) for e in r.metrics() if e.get("split") == "eval" and metric in e
                ]
            except KilolayerError:
                curve = []
        ended = t.user_attrs.get("ended", "")
        step = r.step if run.is_dir() else 0
        continued = False
        if t.state == TrialState.COMPLETE:
            state, value, reason = "completed", t.value, status.get("reason", "")
        elif t.state == TrialState.PRUNED:
            state = "diverged" if ended == "diverged" else "pruned"
            value = t.intermediate_values[t.last_step] if t.last_step is not None else None
            reason = t.user_attrs.get("reason", "")
            stopped = t.user_attrs.get("pruned_step")
            if state == "pruned" and stopped is not None and step > stopped:
                continued = True
                try:
                    value = _final_value(run, metric)
                except KilolayerError:
                    pass
                reason = (
                    f"{reason}; then continued outside the search (kilolayer train --resume) to step {step} "
                    f"({status.get('status', '?')}): its own final evaluation is shown"
                )
        elif t.state == TrialState.FAIL:
            state, value, reason = "failed", None, t.user_attrs.get("reason", status.get("reason", ""))
        else:
            state = "unfinished"
            value = t.intermediate_values[t.last_step] if t.last_step is not None else None
            reason = status.get("reason", "not started")
        results.append(
            TrialResult(
                number=t.number,
                shape=found[t.params["shape"]],
                lr=float(t.params.get("lr", study.user_attrs.get("lr", math.nan))),
                run=run,
                state=state,
                step=step,
                value=value,
                reason=reason,
                curve=curve,
                seconds=float(t.user_attrs.get("seconds", 0.0)),
                continued=continued,
                from_prescreen=int(t.user_attrs.get("from_prescreen", 0)),
            )
        )
    return results


def compare_top(ranked: list[TrialResult], metric: str, maximize: bool = False) -> Comparison | None:
    """The top two completed trials compared batch by batch (:class:`Comparison`); None with fewer than two or a
    single evaluation batch (no spread to measure)."""
    done = [t for t in ranked if t.state == "completed"][:2]
    if len(done) < 2:
        return None
    found = compare_runs(done[0].run, done[1].run, metric)
    if found is None:
        return None
    mean, se, bound, n = found
    agrees = mean > 0 if maximize else mean < 0  # the re-evaluation ranks them as the leaderboard does
    return Comparison(done[0].number, done[1].number, metric, n, mean, se, bound, abs(mean) <= bound, agrees)
