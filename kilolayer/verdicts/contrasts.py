"""Contrasts: how a claim turns a group's runs into one difference per seed, registered by kind.

Each kind is a small pydantic model of its fields (what a claim writes under its kind's name), which checks
them against the group's grid before anything trains, and reduces the runs of one seed to *d*, positive when
the claim holds. The kinds:

* ``compare``: the measure at ``key`` = ``claimed_better`` against ``key`` = ``against``, matched on every
  other grid key and averaged over them (or the worst of them, for a claim that must hold at each);
* ``ratio``: the same pairs, *d* = ln(claimed larger / other); its margin is a factor (1.5: at least 1.5x);
* ``slope``: the least-squares slope of the measure per doubling of ``key``, ``claimed`` to increase or
  decrease, averaged over the other grid keys; with ``than``, minus the slope of that group's runs;
* ``survived``: of the settings of ``over``, how many ``claimed_better`` trained through (learned) minus how
  many ``against`` did: count data, decided by the exact sign test.

A claim that reads several groups compares them by the key ``group`` (each run's group name).

Adding a kind is one class registered with :func:`register_contrast` (or an entry point,
``kilolayer.contrasts``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from kilolayer.registry import Registry

CONTRASTS: Registry[type] = Registry("kilolayer.contrasts", "contrast", group="kilolayer.contrasts")


def register_contrast(cls: type) -> type:
    CONTRASTS.register(cls.kind)(cls)
    return cls


def same(a, b) -> bool:
    """Grid values compare as numbers when both are (so 8 and 8.0, or 0.001 and 1e-3, are one value), else as
    their JSON (so a YAML list and a tuple are one value)."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
        return float(a) == float(b)
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def shown(values) -> str:
    return ", ".join(json.dumps(v, default=str) for v in values)


class Contrast(BaseModel):
    """Base of every kind. ``judge`` (a :class:`kilolayer.verdicts.claims.Judging`) reads values and records
    what is not evidence."""

    model_config = ConfigDict(extra="forbid")
    kind: ClassVar[str]
    count: ClassVar[bool] = False  # count-valued differences (decided by the sign test)
    two_sided: ClassVar[bool] = True  # has a claimed-better and an against side (requirements apply)

    key: str

    def keys(self) -> list[str]:
        """The config keys the group must vary."""
        return [self.key]

    def check(self, grid: dict[str, list], where: str) -> None:
        """Raise ValueError naming the field when a value is not in the group's grid (``grid``: key -> values)."""

    def margin_of(self, margin: float) -> float:
        """The margin in the unit of *d* (a ratio's factor becomes its logarithm)."""
        return margin

    def unit(self, measure) -> str:
        return measure.unit

    def rounding(self, judge) -> float:
        """How far float rounding can move *d*, given the most it moved one value read (``judge.rounding``): *d* is
        a difference of two values, or a mean or the least of such differences."""
        return 2 * judge.rounding

    # each kind defines per_seed(runs, judge) -> {seed: d} and describe(measure, better) -> the rule's words

    # the two sides of a two-sided contrast: (claimed better value, against value)
    def sides(self) -> tuple[Any, Any] | None:
        return None


def _check_values(grid, key, field, values, where) -> None:
    allowed = grid.get(key, [])
    for name, value in zip(field, values):
        if not any(same(value, a) for a in allowed):
            raise ValueError(
                f"{where}.{name}={json.dumps(value, default=str)}: not a value of {key} in the group "
                f"(allowed: {shown(allowed)})"
            )


def _cells(runs: list, judge, key: str, skip: tuple = ()) -> dict:
    """Runs by seed, then by the values of the other grid keys (the group's, less ``key``'s tie and ``skip``)."""
    others = [k for k in judge.other_keys(key) if k not in skip]
    cells: dict = defaultdict(lambda: defaultdict(list))
    for r in runs:
        # the pseudo key GROUP is no grid value of a point: a run's group is its group's name
        combo = json.dumps([r.point.group if k == GROUP else r.point.values.get(k) for k in others], default=str)
        cells[judge.seed(r)][combo].append(r)
    return cells


def _at(judge, key: str, combo: str) -> str:
    """Where a cell of :func:`_cells` is, to name its runs: " at model.layers=12, ..." ("" when no other key varies)."""
    others = [f"{k}={v}" for k, v in zip(judge.other_keys(key), json.loads(combo))]
    return f" at {', '.join(others)}" if others else ""


GROUP = "group"  # the key that tells apart the groups of a claim that reads several


def grid_value(r, key: str):
    """A run's value of ``key`` as its grid gave it (what a claim's values are checked against), else its config's;
    for :data:`GROUP`, its group's name."""
    if key == GROUP:
        return r.point.group
    return r.point.values[key] if key in r.point.values else r.point.setting(key)


def on_shared_steps(a, b) -> tuple:
    """Runs ``a`` and ``b`` with their diagnostics cut to the steps both logged (a diverged run stops logging)."""
    steps = {d.get("step") for d in a.diagnostics} & {d.get("step") for d in b.diagnostics}
    return tuple(replace(r, diagnostics=[d for d in r.diagnostics if d.get("step") in steps]) for r in (a, b))


def _count(rs: list, key: str, value) -> int:
    return sum(same(grid_value(r, key), value) for r in rs)


def _pick(rs: list, key: str, value) -> Any:
    found = [r for r in rs if same(grid_value(r, key), value)]
    return found[0] if found else None


class _TwoSides(Contrast):
    claimed_better: Any
    against: Any

    def check(self, grid, where):
        if same(self.claimed_better, self.against):
            raise ValueError(f"{where}.against: the same value as claimed_better ({self.against!r})")
        _check_values(grid, self.key, ("claimed_better", "against"), (self.claimed_better, self.against), where)

    def sides(self):
        return self.claimed_better, self.against

    def per_seed(self, runs, judge):
        out = {}
        for seed, combos in _cells(runs, judge, self.key).items():
            parts = []
            for combo, rs in combos.items():
                at = _at(judge, self.key, combo)
                label = f"{self.key}={self.claimed_better} / {self.against}, seed {seed}{at}"
                crowded = [v for v in (self.claimed_better, self.against) if _count(rs, self.key, v) > 1]
                if crowded:  # runs that differ in keys the group's grid does not name: no pair to compare
                    judge.excluded.append(
                        f"{label} (several runs of {self.key}={crowded[0]} that the grid does not tell apart)"
                    )
                    parts = None
                    break
                a = _pick(rs, self.key, self.claimed_better)
                b = _pick(rs, self.key, self.against)
                if judge.measure.shared_steps and a is not None and b is not None:
                    a, b = on_shared_steps(a, b)
                va, vb = (
                    judge.value(a, f"{self.key}={self.claimed_better} seed {seed}{at}", side="better"),
                    judge.value(b, f"{self.key}={self.against} seed {seed}{at}", side="against"),
                )
                if va is None or vb is None:
                    parts = None
                    break
                d = self.difference(va, vb, judge.lower_is_better)
                # on a score of the trained model, a side that diverged never wins against one that did not
                if d is not None and judge.measure.quality and a.status == "diverged" and b.status != "diverged":
                    d = min(d, 0.0)
                elif d is not None and judge.measure.quality and b.status == "diverged" and a.status != "diverged":
                    d = max(d, 0.0)
                if d is None or not math.isfinite(d):
                    judge.excluded.append(f"{label} (no finite difference of {va:g} and {vb:g})")
                    parts = None
                    break
                parts.append(d)
            if parts:
                out[seed] = judge.combine(parts)
        return out

    def _pair_text(self, measure, better: str) -> str:
        first, second = (
            (self.against, self.claimed_better)
            if better == "lower"
            else (
                self.claimed_better,
                self.against,
            )
        )
        return f"{self.key}={first} minus that of {self.key}={second}"


@register_contrast
class Compare(_TwoSides):
    kind: ClassVar[str] = "compare"

    def difference(self, better, against, lower_is_better):
        return against - better if lower_is_better else better - against

    def describe(self, measure, better):
        return f"d = {measure.what} of {self._pair_text(measure, better)} ({better} is better)"


@register_contrast
class Ratio(_TwoSides):
    kind: ClassVar[str] = "ratio"

    def difference(self, better, against, lower_is_better):
        if better <= 0 or against <= 0:
            return None
        return math.log(against / better) if lower_is_better else math.log(better / against)

    def margin_of(self, margin):
        return math.log(margin)

    def unit(self, measure):
        return " (ln ratio)"

    def rounding(self, judge):
        # ln(a / b) moves by the relative rounding of a plus that of b
        return 2 * judge.relative_rounding

    def describe(self, measure, better):
        big, small = (self.against, self.claimed_better) if better == "lower" else (self.claimed_better, self.against)
        return f"d = ln({measure.what} of {self.key}={big} / that of {self.key}={small})"


@register_contrast
class Slope(Contrast):
    kind: ClassVar[str] = "slope"
    two_sided: ClassVar[bool] = False
    claimed: Literal["increases", "decreases"]
    than: str | None = None  # a group of the claim: d is the slope of the others' runs minus the slope of its runs

    def check(self, grid, where):
        values = grid.get(self.key, [])
        if len(values) < 2:
            raise ValueError(f"{where}.key={self.key}: a slope needs at least 2 values of it in the group")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
            raise ValueError(
                f"{where}.key={self.key}: a slope per doubling needs positive numbers (got {shown(values)})"
            )
        groups = grid.get(GROUP, [])
        if self.than is not None and self.than not in groups:
            raise ValueError(
                f"{where}.than={self.than!r}: not one of the claim's groups"
                + (f" (its groups: {', '.join(groups)})" if groups else "; give runs as a list of 2 or more groups")
            )

    def _fit(self, rs, judge, seed) -> float | None:
        xs, ys = [], []
        for r in sorted(rs, key=lambda r: grid_value(r, self.key)):
            v = judge.value(r, f"{r.point.key}")
            if v is None:
                return None
            xs.append(math.log2(grid_value(r, self.key)))
            ys.append(v)
        if len(set(xs)) < 2:
            return None
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        fitted = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if not math.isfinite(fitted):
            judge.excluded.append(f"seed {seed} (no finite slope: values {', '.join(f'{y:g}' for y in ys)})")
            return None
        return fitted

    def per_seed(self, runs, judge):
        sign = 1.0 if self.claimed == "increases" else -1.0
        # the values of key each group's runs have in any seed: a cell without one of them lacks a run
        values: dict = defaultdict(list)
        for r in runs:
            if not any(same(grid_value(r, self.key), v) for v in values[r.point.group]):
                values[r.point.group].append(grid_value(r, self.key))
        others = judge.other_keys(self.key)
        out = {}
        for seed, combos in _cells(runs, judge, self.key).items():
            mine, theirs = {}, {}  # the other keys' values but the group's -> slope
            for combo, rs in combos.items():
                lacking = [v for v in values[rs[0].point.group] if _count(rs, self.key, v) == 0]
                if lacking:  # named, as a missing run of a comparison is
                    judge.value(None, f"{self.key}={lacking[0]} seed {seed}{_at(judge, self.key, combo)}")
                    mine = None
                    break
                fitted = self._fit(rs, judge, seed)
                if fitted is None:
                    mine = None
                    break
                cell = json.dumps([v for k, v in zip(others, json.loads(combo)) if k != GROUP])
                (theirs if self.than is not None and rs[0].point.group == self.than else mine)[cell] = fitted
            if not mine:
                continue
            if self.than is not None:  # each cell against the than group's at the same other settings
                unmatched = sorted(set(mine) ^ set(theirs))
                if unmatched:
                    lacks = self.than if unmatched[0] in mine else f"other than {self.than}"
                    keys = [k for k in others if k != GROUP]
                    at = ", ".join(f"{k}={v}" for k, v in zip(keys, json.loads(unmatched[0])))
                    judge.value(None, f"group {lacks}, seed {seed}" + (f" at {at}" if at else ""))
                    continue
                cells = [sign * (mine[c] - theirs[c]) for c in mine]
            else:
                cells = [sign * m for m in mine.values()]
            out[seed] = judge.combine(cells)  # signed first: the worst cell is the least in the claim's direction
        return out

    def unit(self, measure):
        return f"{measure.unit} per doubling"

    def rounding(self, judge):
        # a least-squares slope moves by at most e * sum|x - mean x| / sum (x - mean x)^2 when each value moves by e
        xs = [math.log2(v) for v in {grid_value(r, self.key) for r in judge.read.values()}]
        mx = statistics.fmean(xs) if xs else 0.0
        spread = sum((x - mx) ** 2 for x in xs)
        gain = sum(abs(x - mx) for x in xs) / spread if spread > 0 else 0.0
        return judge.rounding * gain * (2 if self.than is not None else 1)

    def describe(self, measure, better):
        text = f"d = the least-squares slope of {measure.what} against log2({self.key}) (its change per doubling)"
        if self.than is not None:
            text += f" minus the same slope of group {self.than}'s runs"
        sign = "as is" if self.claimed == "increases" else "negated"
        than = f" more than group {self.than}'s" if self.than is not None else ""
        return f"{text}, {sign}: the claim is that it {self.claimed}{than}"


@register_contrast
class Survived(_TwoSides):
    kind: ClassVar[str] = "survived"
    count: ClassVar[bool] = True
    over: str

    def keys(self):
        return [self.key, self.over]

    def check(self, grid, where):
        super().check(grid, where)
        if len(grid.get(self.over, [])) < 2:
            raise ValueError(f"{where}.over={self.over}: needs at least 2 values of it in the group")

    def unit(self, measure):
        return " settings"

    def rounding(self, judge):
        return 0.0  # counts: decided by the sign test whatever their spread

    def per_seed(self, runs, judge):
        out = {}
        for seed, combos in _cells(runs, judge, self.key, skip=(self.over,)).items():
            total, complete = 0, True
            for rs in combos.values():
                for side, value in ((1, self.claimed_better), (-1, self.against)):
                    mine = [r for r in rs if same(grid_value(r, self.key), value)]
                    for r in mine:
                        trained = judge.trained(r, f"{r.point.key}")
                        if trained is None:
                            complete = False
                        else:
                            total += side * int(trained)
            if complete and combos:
                out[seed] = float(total)
        return out

    def describe(self, measure, better):
        return (
            f"d = the number of settings of {self.over} in which {self.key}={self.claimed_better} trained (completed "
            f"and learned: {measure.what} at most 0.9 x chance, not diverged) minus the number in which "
            f"{self.key}={self.against} did"
        )
