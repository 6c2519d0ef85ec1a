"""What a run of a study is as evidence: whether it can be read at all, its chance level, whether it learned or
failed, and whether it was still improving at its budget. Every claim reads runs through these, and the doctor
shares the one "learned nothing" rule (:func:`kilolayer.analysis.chance.learned_something`).

A run here is what the study collects of a point (:class:`kilolayer.study.runner.Result`): ``point`` (its group,
grid values and config), ``status``, ``reason``, ``step``, ``eval`` (the evaluation that stands for it),
``evals``, ``diagnostics``, ``smoothness`` and ``test`` (its test split scored whole, when it has been).
"""

from __future__ import annotations

import math

from kilolayer.analysis.chance import LEARNED_NOTHING, chance_of_run, learned_something


def chance(r, out) -> dict:
    """The chance level of run ``r``'s evaluation data (cached on the result and in its run directory);
    ``{"loss": nan}`` for an objective of the user's that defines none."""
    c = getattr(r, "chance", None)
    if c is None:
        try:
            c = chance_of_run(r.point.run_dir(out), r.point.config)
        except NotImplementedError:
            c = {"loss": float("nan")}
        r.chance = c
    return c


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
    if r is None or r.status != "completed" or "loss" not in r.eval:
        return False
    return learned_something(float(r.eval["loss"]), chance(r, out).get("loss"))


def failed(r, out) -> bool | None:
    """Whether a run failed to train: diverged, or completed having learned nothing. None when its data has no
    chance level; False for a run that is not a result (failed, missing: not evidence either way)."""
    if r is None:
        return False
    if r.status == "diverged":
        return True
    if r.status != "completed" or "loss" not in r.eval:
        return False
    got = learned(r, out)
    return None if got is None else not got


def loss_ratio(r, out) -> float | None:
    """A run's standing evaluation loss as a multiple of its chance loss (None without either)."""
    c = chance(r, out).get("loss")
    loss = r.eval.get("loss") if r is not None else None
    if loss is None or c is None or not math.isfinite(c) or c <= 0:
        return None
    return float(loss) / c


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def improvement(r, key: str, lower_is_better: bool = False, relative: bool = False) -> float:
    """How much run ``r`` was still improving ``key`` at the end of its training, by the larger of two signs
    (0 when neither shows a gain; a fraction of the earlier value if ``relative``):

    * over the last quarter of its steps: the best of its evaluations in that quarter against the best of as
      many evaluations just before it (one against one when the quarter holds one evaluation) — windows of equal
      size, so a single noisy evaluation at either end neither flags a flat run nor hides a gain;
    * after the evaluation that stands for it (its best checkpoint under early stopping): a later evaluation
      against the standing one, so what the run reports is below what it went on to reach."""
    evs = [e for e in (r.evals if r is not None else []) if _finite(e.get(key))]
    if len(evs) < 2:
        return 0.0
    pick = min if lower_is_better else max

    def gain(new: float, old: float) -> float:
        g = old - new if lower_is_better else new - old
        return g / abs(old) if relative and old else g

    last = evs[-1]["step"]
    later = [float(e[key]) for e in evs if e["step"] > 0.75 * last]
    earlier = [float(e[key]) for e in evs if e["step"] <= 0.75 * last][-len(later) :] or [float(evs[0][key])]
    best = gain(pick(later), pick(earlier))
    standing = r.eval if isinstance(r.eval, dict) else {}
    if _finite(standing.get(key)) and "step" in standing:
        after = [float(e[key]) for e in evs if e["step"] > standing["step"]]
        if after:
            best = max(best, gain(pick(after), float(standing[key])))
    return max(best, 0.0)


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


__all__ = [
    "LEARNED_NOTHING",
    "chance",
    "failed",
    "improvement",
    "improving_summary",
    "learned",
    "loss_ratio",
    "not_evidence",
    "still_improving",
]
