"""What a run of a study is as evidence: whether it can be read at all, its chance level, whether it learned or
failed, and whether it was still improving at its budget. Every claim reads runs through these; each fact is
decided once, by the run's record (:class:`kilolayer.record.RunRecord`), which the doctor reads too.

A run here is what the study collects of a point (:class:`kilolayer.study.runner.Result`: the record of its run
directory with its ``point``, the group, grid values and config): ``status``, ``reason``, ``step``, ``eval`` (the
evaluation that stands for it), ``evals``, ``diagnostics``, ``smoothness`` and ``test`` (its test split scored
whole, when it has been).
"""

from __future__ import annotations

import math

from kilolayer.analysis.chance import LEARNED_NOTHING, chance_of_run


def chance(r, out) -> dict:
    """The chance level of run ``r``'s evaluation data (cached on the result and in its run directory under the
    study's folder ``out``); ``{"loss": nan}`` for an objective of the user's that defines none."""
    if r.chance is None and r.path is None:  # a result made up in memory: its point's run directory keeps the cache
        r.path = r.point.run_dir(out)
    return r.chance_level(compute=chance_of_run)


def _judged(r, out):
    """``r``, with its chance level read through the study's folder where its verdict needs one."""
    if r.judged:
        chance(r, out)
    return r


def not_evidence(r, what: str) -> str | None:
    """Why run ``r`` (the ``what`` of a comparison) cannot be evidence, or None if it can: completed with a
    finite evaluation loss, or diverged (a result)."""
    if r is None:
        return f"{what} (missing)"
    if r.status == "diverged":
        return None
    if r.status != "completed":
        # the reason's first clause (the runs table has the whole text and the command to continue)
        reason = r.reason.split(";")[0].strip()
        if len(reason) > 80:
            reason = reason[:80].rsplit(" ", 1)[0] + "…"
        why = f": {reason}" if reason else ""
        return f"{r.point.key} ({r.status}{why})"
    if "loss" not in r.eval:
        return f"{r.point.key} (completed without an evaluation)"
    if not math.isfinite(float(r.eval["loss"])):
        return f"{r.point.key} (evaluation loss {r.eval['loss']})"
    return None


def learned(r, out) -> bool | None:
    """Whether a run learned: a completed run at most LEARNED_NOTHING x its chance loss. A diverged or
    unfinished run did not; None when its data has no chance level (nobody can say)."""
    return False if r is None else _judged(r, out).learned()


def failed(r, out) -> bool | None:
    """Whether a run failed to train: diverged, or completed having learned nothing. None when its data has no
    chance level; False for a run that is not a result (failed, missing: not evidence either way)."""
    return False if r is None else _judged(r, out).failed()


def loss_ratio(r, out) -> float | None:
    """A run's standing evaluation loss as a multiple of its chance loss (None without either)."""
    c = chance(r, out).get("loss")
    loss = r.eval.get("loss") if r is not None else None
    if loss is None or c is None or not math.isfinite(c) or c <= 0:
        return None
    return float(loss) / c


def improvement(r, key: str, lower_is_better: bool = False, relative: bool = False) -> float:
    """How much run ``r`` was still improving ``key`` at the end of its training
    (:meth:`kilolayer.record.RunRecord.improvement`); 0 for a missing run."""
    return 0.0 if r is None else r.improvement(key, lower_is_better, relative)


def still_improving(r, key: str, tol: float, lower_is_better: bool = False, relative: bool = False) -> bool:
    """Whether :func:`improvement` exceeds ``tol``: the run had not converged in ``key`` at its budget."""
    return improvement(r, key, lower_is_better, relative) > tol


def improving_summary(runs, key: str, tol: float, lower_is_better: bool, relative: bool) -> tuple[str, list]:
    """One line for the report: how many of ``runs`` (completed ones) were still improving ``key`` by more than
    ``tol`` at their budget, and the largest gain; and those runs."""
    done = list({r.point.key: r for r in runs if r is not None and r.status == "completed"}.values())
    if not done:
        return "", []
    gains = {r.point.key: improvement(r, key, lower_is_better, relative) for r in done}
    moving = [r for r in done if gains[r.point.key] > tol]
    by = f"{tol:.0%}" if relative else f"{tol:g}"
    if not moving:
        return f"0 of {len(done)} runs still improving {key} by more than {by}", []
    top = max(moving, key=lambda r: gains[r.point.key])
    amount = f"{gains[top.point.key]:.1%}" if relative else f"{gains[top.point.key]:.3g}"
    return (
        f"{len(moving)} of {len(done)} runs still improving {key} by more than {by} at their budget "
        f"(most: {top.point.key}, {amount} in its last quarter or after its standing evaluation)",
        moving,
    )


def pretraining_problem(r, results, out) -> str | None:
    """Why the pre-training behind fine-tuned run ``r`` makes ``r`` no evidence, or None: the pre-training must
    have completed, and ``r`` started from its chosen checkpoint (or, with no ``init_from`` record, after it)."""
    from kilolayer.rundir import RunDir, checkpoint_step

    key = getattr(r.point, "init_from_point", None) if r is not None else None
    if key is None or r.status not in ("completed", "diverged"):
        return None
    src = next((x for x in results if x.point.key == key), None)
    if src is None or src.status != "completed":
        state = "missing" if src is None else src.status
        return f"{r.point.key} (its pre-training run {key} is {state})"
    mine, theirs = RunDir(r.point.run_dir(out)), RunDir(src.point.run_dir(out))
    record = mine.init_from
    if record is not None:
        chosen = theirs.checkpoint(on_damaged=lambda _: None)
        if chosen is None or checkpoint_step(chosen) != int(record["step"]):
            now = "none" if chosen is None else checkpoint_step(chosen)
            return f"{r.point.key} (fine-tuned from step {record['step']} of {key}, whose chosen checkpoint is {now})"
        return None
    started, finished = mine.status.get("started"), theirs.status.get("finished")
    if not (isinstance(started, str) and isinstance(finished, str) and started >= finished):
        return f"{r.point.key} (started before its pre-training run {key} finished)"
    return None


__all__ = [
    "LEARNED_NOTHING",
    "chance",
    "failed",
    "improvement",
    "improving_summary",
    "learned",
    "loss_ratio",
    "not_evidence",
    "pretraining_problem",
    "still_improving",
]
