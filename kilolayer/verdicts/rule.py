"""The rule that turns one difference per seed into a verdict, the same for every claim.

The seed is the unit of replication. A claim reduces its runs to one difference *d* per seed, positive when the
claim holds. Continuous differences are decided by one-sided Student-t bounds on their mean; count-valued ones
(settings survived) and any set of seeds whose differences vary by no more than float rounding are decided by an
exact one-sided sign test, because a t-bound of (next to) zero width says nothing about seed noise (two agreeing
seeds are a sign test at p = 0.25, never 5%).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from kilolayer.analysis.chance import LEARNED_NOTHING

HELD, NOT_HELD, INCONCLUSIVE = "held", "did not hold", "inconclusive"
VERDICTS = (HELD, NOT_HELD, INCONCLUSIVE)
LEVEL = 0.95  # one-sided confidence of each bound, and 1 - the sign test's level
# How far float rounding can move a value read from a run, relative to its size. The values are float32 results
# (2^-24, about 6e-8, relative per rounding) averaged over batches, layers or steps, which adds a few roundings;
# 1e-6 is above what rounding gives and far below any difference that training with another seed makes. Seeds whose
# differences vary by less than the rounding this allows have not measured seed noise: no t-bound is drawn from them.
ROUNDING = 1e-6

RULE = (
    "The seed is the unit of replication: each claim reduces its runs to one difference *d* per seed, positive "
    "when the claim holds (settings averaged, or a trend fitted, within the seed). Runs are compared at the "
    "budget the study gave them, as the papers compare them; how many were still improving is reported beside "
    "every verdict (for fine-tuned runs, their pre-training runs too), and decides only a claim stated about "
    "converged models. With *n* seeds, mean *m* and standard "
    "deviation *sd*, the one-sided 95% Student-t bounds are *m* ∓ t(0.95, n−1)·*sd*/√n: **held** if the lower "
    "bound exceeds the margin, **did not hold** if the upper bound is below minus the margin, otherwise "
    "**inconclusive** — always with fewer than 2 seeds. Count-valued differences, and seeds whose differences "
    "are equal up to float rounding of the values read (zero-variance bounds decide nothing), are decided by an "
    "exact one-sided sign test at 5% "
    "instead: *held* needs enough seeds beyond the margin for p ≤ 0.05 (5 of 5, 6 of 6, 7 of 7 or 7 of 8, …). "
    "A failed or missing run is never evidence "
    "(inconclusive, named); a diverged run scores what its measure says (the chance loss for a loss), so it "
    "counts against what diverged; a run whose loss stays above "
    f"{LEARNED_NOTHING:g} x chance learned nothing. A claim that a setting trains needs it to have learned in "
    "every seed; a claim that another fails where it trains needs that one to have failed (diverged, or learned "
    "nothing) in every seed, else it is inconclusive and says which seed learned."
)


def t_quantile(df: int, level: float = LEVEL) -> float:
    """Student-t quantile ``t(level, df)`` (one-sided) for 0 < ``level`` < 1: the function scipy.stats.t.ppf
    computes, from scipy.special, which imports in a fraction of scipy.stats's second."""
    from scipy.special import stdtrit

    return float(stdtrit(df, level))


def t_bound(values: list[float], level: float = LEVEL) -> tuple[float, float, float]:
    """``(mean, standard error, half-width)`` of ``values`` (at least two): mean ∓ half-width are the one-sided
    ``level`` Student-t bounds on their mean, t(level, n−1)·sd/√n (together, a two-sided 2·level − 1 interval)."""
    n = len(values)
    se = statistics.stdev(values) / math.sqrt(n)
    return statistics.fmean(values), se, t_quantile(n - 1, level) * se


def sign_test_p(agreeing: int, n: int) -> float:
    """One-sided exact sign test: P(X >= agreeing) for X ~ Binomial(n, 1/2)."""
    if n <= 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(agreeing, n + 1)) / 2**n


def seeds_for_sign_test(level: float = LEVEL) -> int:
    """The fewest seeds, all agreeing, that a one-sided sign test at ``1 - level`` accepts (5 at 5%)."""
    n = 1
    while sign_test_p(n, n) > 1 - level:
        n += 1
    return n


@dataclass
class Verdict:
    verdict: str
    mean: float = float("nan")
    lower: float = float("nan")  # one-sided LEVEL bounds on the mean per-seed difference (t-bounds only)
    upper: float = float("nan")
    n: int = 0  # seeds
    margin: float = float("nan")
    reason: str = ""
    per_seed: dict = field(default_factory=dict)  # seed -> d, shown in the report
    test: str = "t"  # "t" (Student-t bounds) or "sign" (exact sign test)
    p: float = float("nan")  # the sign test's p-value for the side it decided (sign test only)


def _num(x: float, unit: str = "") -> str:
    return f"{x:+.3g}{unit}"


def _shown(names) -> str:
    names = list(names)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _sign_decision(v: Verdict, values: list[float], margin: float, unit: str, level: float, why: str) -> str:
    n = len(values)
    above = sum(d > margin for d in values)
    below = sum(d < -margin for d in values)
    p_for, p_against = sign_test_p(above, n), sign_test_p(below, n)
    v.test = "sign"
    need = seeds_for_sign_test(level)
    desc = (
        f"{why}: {above} of {n} seeds beyond +margin and {below} beyond -margin ({margin:.3g}{unit}); one-sided "
        f"sign test p = {min(p_for, p_against):.3g}"
    )
    if p_for <= 1 - level:
        v.verdict, v.p = HELD, p_for
    elif p_against <= 1 - level:
        v.verdict, v.p = NOT_HELD, p_against
    else:
        v.p = min(p_for, p_against)
        desc += f" (deciding at {1 - level:.0%} needs {need} agreeing seeds of {need}, or more seeds)"
    return desc


def decide(
    per_seed: dict | list,
    margin: float,
    unit: str = "",
    *,
    count: bool = False,
    not_evidence: tuple = (),
    unlearned: tuple = (),
    unlearned_decides_against: bool = False,
    level: float = LEVEL,
    rounding: float = 0.0,
) -> Verdict:
    """The verdict of :data:`RULE` from one difference per seed (a dict seed -> d, or a list).

    ``count``: the differences are counts (settings survived), decided by the exact sign test.
    ``rounding``: how far float rounding of the values read can move each *d* (:data:`ROUNDING` carried through
    the contrast); differences whose standard deviation is no larger are decided by the sign test, as equal ones.
    ``not_evidence``: runs that failed or are missing (named in the reason; the verdict is inconclusive).
    ``unlearned``: runs the claim needs to have learned that did not. They are named, and the verdict becomes
    inconclusive, unless it is "did not hold" and ``unlearned_decides_against`` (a claim such as "DeepNorm
    trains" is contradicted by a DeepNorm that learned nothing)."""
    items = list(per_seed.items()) if isinstance(per_seed, dict) else list(enumerate(per_seed))
    # a seed without a finite d is not evidence, named as a failed run is
    lost = [f"seed {s} (d {d})" for s, d in items if d is None or not math.isfinite(float(d))]
    not_evidence = (*not_evidence, *lost)
    values = [float(d) for _, d in items if d is not None and math.isfinite(float(d))]
    n = len(values)
    m = statistics.fmean(values) if values else float("nan")
    v = Verdict(INCONCLUSIVE, m, n=n, margin=margin)
    if count and n:
        desc = f"mean d {_num(m, unit)} over {n} seeds; " + _sign_decision(v, values, margin, unit, level, "count data")
    elif n >= 2 and statistics.stdev(values) <= max(rounding, 1e-9 * max(1.0, abs(m))):  # equal up to rounding
        spread = max(values) - min(values)
        desc = (
            f"d {_num(m, unit)} in every one of {n} seeds"
            if spread == 0
            else f"d {_num(m, unit)} in every one of {n} seeds up to {spread:.2g}{unit}, within float rounding of "
            f"the values read ({max(rounding, 1e-9):.2g}{unit})"
        )
        desc += "; " + _sign_decision(v, values, margin, unit, level, "zero-variance t-bounds decide nothing")
    elif n >= 2:
        _, _, half = t_bound(values, level)
        v.lower, v.upper = m - half, m + half
        desc = (
            f"mean d {_num(m, unit)} over {n} seeds, one-sided {level:.0%} bounds [{v.lower:+.3g}, {v.upper:+.3g}]"
            f"{unit}, margin {margin:.3g}{unit}"
        )
        if v.lower > margin:
            v.verdict = HELD
        elif v.upper < -margin:
            v.verdict = NOT_HELD
        else:
            desc += "; the bounds straddle the margin"
    elif n == 1:
        direction = "in the claim's direction" if m > 0 else "against the claim" if m < 0 else "no difference"
        desc = f"one seed: d {_num(m, unit)} ({direction}); seed noise is unknown, so one seed cannot decide"
    else:
        desc = "no seed with every run the comparison needs"
    if not_evidence:
        v.verdict = INCONCLUSIVE
        desc = f"not evidence: {_shown(not_evidence)}" + (f"; the other runs give {desc}" if n else "")
    if unlearned:
        desc += f"; {_shown(unlearned)} learned nothing (loss above {LEARNED_NOTHING:g} x chance, or no chance level)"
        if v.verdict == HELD or (v.verdict == NOT_HELD and not unlearned_decides_against):
            v.verdict = INCONCLUSIVE
            desc += ", and the claim needs it to"
    v.reason = desc
    v.per_seed = dict(per_seed) if isinstance(per_seed, dict) else dict(enumerate(per_seed))
    return v


@dataclass
class Finding:
    """A claim as the report shows it: what it says, where it comes from, the rule, the verdict and the
    measured table, plots and notes."""

    name: str
    title: str
    claim: str
    reference: str
    rule: str
    verdict: Verdict
    headers: list[str] = field(default_factory=list)
    rows: list[list] = field(default_factory=list)
    plots: list[tuple[str, str]] = field(default_factory=list)  # (path, caption)
    scale_up: str = ""
    notes: list[str] = field(default_factory=list)  # measurement choices and chance levels, stated in the report
    improving: str = ""  # how many of the runs read were still improving at their budget, and by how much
    post_hoc: str = ""  # why the claim was set after some of its runs had finished ("" when it was not)
