"""Claims as data: what a paper (or a user) claims, which runs decide it, and how, written in a study spec::

    claims:
      - name: deeper_is_better
        claim: The deeper, narrower model reaches a lower validation loss at the same budget
        source: my own hypothesis
        runs: shapes                      # a group of the spec, or a list of groups (told apart by the key `group`)
        measure: eval_loss                # a registered measure (kilolayer.verdicts.measures)
        compare: {key: model.layers, claimed_better: 8, against: 2}   # a registered contrast and its fields
        margin: 0.02                      # in the measure's unit (a ratio's: a factor)
        margin_reason: why this margin
        paper_effect: 0.05                # the paper's own effect in the same unit; the margin must be below it
        where: {model.layers: max}        # only the runs with these values (max / min of the group's)
        requires: [winner_learns, loser_fails, all_learn, converged]
        relative_to: untrained            # a group whose measure at the same settings is subtracted (a baseline)
        combine: worst                    # the cells of a seed: their mean (default), or the worst (must hold at each)

:func:`parse_claim` and :func:`check_claim` refuse a bad claim with one line naming its field before anything
trains; :func:`judge` reads the study's runs and returns the :class:`~kilolayer.verdicts.rule.Finding` the report
shows, its rule text generated from these fields.
"""

from __future__ import annotations

import difflib
import json
import math
import statistics
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kilolayer.config import format_validation_error
from kilolayer.verdicts.contrasts import CONTRASTS, GROUP, grid_value, same, shown
from kilolayer.verdicts.evidence import (
    LEARNED_NOTHING,
    chance,
    failed,
    improving_summary,
    learned,
    loss_ratio,
    not_evidence,
    pretraining_problem,
)
from kilolayer.verdicts.measures import (
    MEASURES,
    TEST,
    VALIDATION,
    Measure,
    convergence_of,
    has_test,
    selection_convergence,
)
from kilolayer.verdicts.rule import HELD, INCONCLUSIVE, NOT_HELD, ROUNDING, Finding, decide, seeds_for_sign_test

REQUIREMENTS = {
    "winner_learns": f"the claimed-better side must have learned (loss at most {LEARNED_NOTHING:g} x chance) in "
    "every seed: one that learned nothing makes a held inconclusive, and leaves a did not hold standing",
    "loser_fails": "the other side must have failed (diverged, or loss above "
    f"{LEARNED_NOTHING:g} x chance) in every seed, else the claim is inconclusive (a did not hold stands only where "
    "the claimed-better side learned nothing)",
    "all_learn": f"every run compared must have learned (loss at most {LEARNED_NOTHING:g} x chance): one that learned "
    "nothing says nothing about what training does, and makes the verdict inconclusive either way",
    "converged": "the claim is about converged models: a run still improving its measure at its budget makes it "
    "inconclusive",
}


class Claim(BaseModel):
    """One claim of a study spec (its contrast is parsed into ``contrast`` by :func:`parse_claim`)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    name: str = Field(..., pattern=r"^[A-Za-z0-9_\-]+$")
    claim: str
    source: str
    title: str = ""
    runs: str | list[str]
    measure: str
    margin: float
    margin_reason: str = ""
    paper_effect: float | None = None
    better: Literal["lower", "higher"] | None = None
    where: dict[str, Any] = Field(default_factory=dict)
    requires: list[str] = Field(default_factory=list)
    relative_to: str | None = None
    combine: Literal["mean", "worst"] = "mean"
    plots: list[str] = Field(default_factory=list)  # drawn by the report (kilolayer.study.claim_plots)
    scale_up: str = ""
    contrast: Any = Field(None, exclude=True)

    @field_validator("margin", "paper_effect", mode="before")
    @classmethod
    def _number(cls, value):
        if isinstance(value, bool):
            raise ValueError("expected a number, not true or false")
        return value

    @property
    def kind(self) -> str:
        return self.contrast.kind

    def groups(self) -> list[str]:
        """The spec's groups the claim reads."""
        return [self.runs] if isinstance(self.runs, str) else list(self.runs)

    def the_measure(self) -> Measure:
        return MEASURES[self.measure]

    def direction(self) -> str:
        return self.better or self.the_measure().better

    def data(self) -> dict:
        """The claim as its spec writes it (its contrast under its kind's name)."""
        out = self.model_dump(exclude_defaults=True, exclude={"contrast"})
        out[self.kind] = self.contrast.model_dump()
        return out


def parse_claim(data: Any, where: str) -> Claim:
    """A claim from its spec mapping; ValueError, one line naming the field, when it is malformed."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping (name, claim, source, runs, measure, a contrast, margin)")
    kinds = [k for k in data if k in CONTRASTS]
    if len(kinds) != 1:
        found = f"found {', '.join(kinds)}" if kinds else "found none"
        near = [k for k in data if k not in Claim.model_fields and difflib.get_close_matches(k, list(CONTRASTS), 1)]
        if near and not kinds:
            found += f"; did you mean {difflib.get_close_matches(near[0], list(CONTRASTS), 1)[0]} for {near[0]}?"
        raise ValueError(f"{where}: give exactly one contrast, one of {', '.join(sorted(CONTRASTS))} ({found})")
    kind = kinds[0]
    body = {k: v for k, v in data.items() if k != kind}
    for field in ("margin", "paper_effect"):
        if isinstance(body.get(field), bool):
            raise ValueError(f"{where}.{field}={body[field]}: expected a number, not true or false")
    runs = body.get("runs")
    if isinstance(runs, list) and (len(runs) < 2 or len(set(map(str, runs))) < len(runs)):
        raise ValueError(f"{where}.runs={runs}: a list names 2 or more different groups (or give one group's name)")
    try:
        claim = Claim.model_validate(body)
    except ValidationError as err:
        raise ValueError(_with_choices(format_validation_error(err, where, Claim), kinds)) from None
    if not isinstance(data[kind], dict):
        raise ValueError(f"{where}.{kind}: expected a mapping of its fields")
    try:
        claim.contrast = CONTRASTS[kind].model_validate(data[kind])
    except ValidationError as err:
        raise ValueError(format_validation_error(err, f"{where}.{kind}", CONTRASTS[kind])) from None
    return claim


def _with_choices(message: str, kinds: list[str]) -> str:
    if message.endswith(": unknown key") or ": unknown key;" in message:
        return message + f"; a contrast is one of {', '.join(sorted(CONTRASTS))}"
    return message


def grid_values(group) -> dict[str, list]:
    """A group's grid as dotted key -> its values (keys tied together split into their own lists)."""
    out: dict[str, list] = {}
    for key, values in group.grid.items():
        subkeys = [k.strip() for k in key.split(",")]
        for i, sk in enumerate(subkeys):
            column = [v[i] if len(subkeys) > 1 else v for v in values]
            out[sk] = [v for j, v in enumerate(column) if not any(same(v, w) for w in column[:j])]
    return out


def ties(group, key: str) -> list[str]:
    """The grid keys that move together with ``key`` (itself included)."""
    for k in group.grid:
        subkeys = [s.strip() for s in k.split(",")]
        if key in subkeys:
            return subkeys
    return [key]


class Runs:
    """The groups a claim reads, seen as one: their grids merged, and with several groups the key :data:`GROUP`
    whose values are their names."""

    def __init__(self, groups: list):
        self.groups = groups
        self.name = " + ".join(g.name for g in groups)
        self.grid: dict[str, list] = {}
        for g in groups:
            for key, values in g.grid.items():
                mine = self.grid.setdefault(key, [])
                mine += [v for v in values if not any(same(v, w) for w in mine)]
        if len(groups) > 1:
            self.grid[GROUP] = [g.name for g in groups]
        self.analyses = set.intersection(*(set(g.analyses) for g in groups))


def runs_of(claim: Claim, groups: dict) -> Runs:
    """The :class:`Runs` of ``claim`` from the spec's ``groups`` (name -> group)."""
    return Runs([groups[name] for name in claim.groups()])


def check_claim(claim: Claim, groups: dict, where: str) -> None:
    """Refuse, with one line naming the field, a claim the spec cannot decide: an unknown group, measure or
    requirement; a key its group does not vary or a value not in its grid; a margin in the wrong unit or sign,
    or not below the paper's own effect."""
    for name in [*claim.groups(), *([claim.relative_to] if claim.relative_to else [])]:
        if name not in groups:
            field = "relative_to" if name == claim.relative_to else "runs"
            raise ValueError(
                f"{where}.{field}={name!r}: no group of that name in the spec (groups: {', '.join(groups)})"
            )
    if claim.relative_to in claim.groups():
        raise ValueError(f"{where}.relative_to={claim.relative_to!r}: a baseline group other than the claim's runs")
    group = runs_of(claim, groups)
    if claim.measure not in MEASURES:
        raise ValueError(f"{where}.measure={claim.measure!r}: unknown measure; allowed: {', '.join(sorted(MEASURES))}")
    measure = MEASURES[claim.measure]
    grid = grid_values(group)
    kind = f"{where}.{claim.kind}"
    for field, key in zip(("key", "over"), claim.contrast.keys()):
        if key not in grid:
            varied = ", ".join(grid) or "nothing but the seed"
            raise ValueError(f"{kind}.{field}={key}: group {group.name!r} does not vary it (it varies {varied})")
    claim.contrast.check(grid, kind)
    for key, value in claim.where.items():
        if value in ("max", "min") and not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in grid.get(key, [])
        ):
            raise ValueError(f"{where}.where.{key}={value}: max and min need numbers (its values: {shown(grid[key])})")
        if key not in grid and value in ("max", "min"):
            continue  # a key the group does not vary: every run has its one value, and max and min are it
        if key not in grid:
            raise ValueError(
                f"{where}.where.{key}: group {group.name!r} does not vary it (it varies {', '.join(grid)})"
            )
        if value not in ("max", "min") and not any(same(value, v) for v in grid[key]):
            raise ValueError(
                f"{where}.where.{key}={json.dumps(value)}: not a value of it in the group (allowed: max, min, "
                f"{shown(grid[key])})"
            )
        if any(key in ties(group, k) for k in claim.contrast.keys()):
            raise ValueError(
                f"{where}.where.{key}: the contrast varies this key (or one tied to it); it cannot also be fixed"
            )
    for name in claim.requires:
        if name not in REQUIREMENTS:
            raise ValueError(f"{where}.requires: {name!r} is unknown; allowed: {', '.join(REQUIREMENTS)}")
        if name in ("winner_learns", "loser_fails") and (not claim.contrast.two_sided or claim.kind == "survived"):
            raise ValueError(f"{where}.requires: {name} needs a contrast that compares two runs (compare, ratio)")
    if claim.better is not None and claim.kind not in ("compare", "ratio"):
        raise ValueError(f"{where}.better: only with compare or ratio (a {claim.kind} has its own direction)")
    if claim.kind == "survived" and claim.contrast.over in ties(group, claim.contrast.key):
        raise ValueError(f"{kind}.over={claim.contrast.over}: moves together with {claim.contrast.key} in the grid")
    if claim.kind == "survived" and claim.measure not in ("eval_loss", "loss_vs_chance"):
        raise ValueError(
            f"{where}.measure={claim.measure}: survived counts the settings a run learned in, which "
            "is read on its loss: use eval_loss or loss_vs_chance"
        )
    _check_margin(claim, measure, grid, where)
    _check_pairing(claim, groups, where)
    if claim.kind == "slope" and len(claim.groups()) > 1 and (claim.contrast.than is None or len(claim.groups()) > 2):
        raise ValueError(
            f"{kind}: a slope reads one group, or two with than: GROUP (d: the other's slope minus that group's); "
            f"runs names {len(claim.groups())}{'' if claim.contrast.than else ' and no than'}"
        )
    if claim.better is not None and claim.better != measure.better and measure.quality:
        raise ValueError(
            f"{where}.better={claim.better}: {claim.measure} is a score ({measure.better} is better, and a diverged "
            "run never wins on it); state the claim the other way round, swapping claimed_better and against"
        )
    if claim.kind == "survived" and "all_learn" in claim.requires:
        raise ValueError(f"{where}.requires: all_learn with survived, which counts the settings each side learned in")
    if claim.kind == "ratio" and not measure.positive:
        raise ValueError(
            f"{where}.measure={claim.measure}: a ratio needs a measure above 0, and {claim.measure} can be 0 "
            f"({measure.diverged_text}); use compare"
        )
    if len(set(claim.requires)) < len(claim.requires):
        raise ValueError(f"{where}.requires={claim.requires}: a requirement named twice")
    if measure.analysis is not None:
        reading = [*claim.groups(), *([claim.relative_to] if claim.relative_to else [])]
        lacking = [name for name in reading if measure.analysis not in groups[name].analyses]
        if lacking:
            raise ValueError(
                f"{where}.measure={claim.measure}: reads the {measure.analysis} analysis; add {measure.analysis} "
                f"to the analyses of {'group' if len(lacking) == 1 else 'groups'} "
                f"{', '.join(repr(name) for name in lacking)}"
            )


def cannot_decide(claim: Claim, groups: dict) -> str | None:
    """Why ``claim`` can reach no verdict but inconclusive with the seeds its groups run, or None: one seed
    says nothing of seed noise, and count data need :func:`seeds_for_sign_test` agreeing seeds."""
    seeds = set.intersection(*(set(groups[name].seeds) for name in claim.groups()))
    need = seeds_for_sign_test() if claim.contrast.count else 2
    if len(seeds) >= need:
        return None
    why = (
        f"count data are decided by a one-sided sign test at 5%, which needs {need} agreeing seeds"
        if claim.contrast.count
        else "one seed cannot tell a difference from seed noise"
    )
    return f"{claim.name}: its runs share {len(seeds)} seed(s) and {why}, so it can only read inconclusive"


def _check_pairing(claim: Claim, groups: dict, where: str) -> None:
    """Refuse groups whose runs cannot be paired: several groups that run different seeds (or, compared with each
    other, different grids), or a baseline that lacks a seed or a grid value of the runs it is subtracted from."""
    names = claim.groups()
    seeds = {n: sorted(set(groups[n].seeds)) for n in names}
    if len({tuple(v) for v in seeds.values()}) > 1:
        each = "; ".join(f"{n}: {shown(v)}" for n, v in seeds.items())
        raise ValueError(f"{where}.runs: its groups run different seeds ({each}); runs are paired by seed")
    if len(names) > 1 and claim.contrast.keys()[0] == GROUP:
        grids = {n: grid_values(groups[n]) for n in names}

        def settings(grid: dict) -> dict:  # each key's values as a set: the order a grid lists them in is no setting
            return {k: sorted(json.dumps(v, sort_keys=True, default=str) for v in vs) for k, vs in grid.items()}

        first = names[0]
        for n in names[1:]:
            if settings(grids[n]) != settings(grids[first]):
                raise ValueError(
                    f"{where}.runs: groups {first!r} and {n!r} vary different settings ({first}: "
                    f"{json.dumps(grids[first], default=str)}; {n}: {json.dumps(grids[n], default=str)}); groups "
                    "compared with each other are paired at the same settings"
                )
    if claim.relative_to:
        base = groups[claim.relative_to]
        missing = sorted(set(seeds[names[0]]) - set(base.seeds))
        if missing:
            raise ValueError(
                f"{where}.relative_to={claim.relative_to}: it runs no seed {shown(missing)}; each run is measured "
                "from the baseline run of its own seed"
            )
        mine = grid_values(runs_of(claim, groups))
        for key, values in grid_values(base).items():
            lacking = [v for v in mine.get(key, []) if not any(same(v, w) for w in values)]
            if key not in mine or lacking:
                what = (
                    f"no {key}={json.dumps(lacking[0], default=str)}"
                    if lacking
                    else f"varies {key}, which the claim's runs do not"
                )
                raise ValueError(
                    f"{where}.relative_to={claim.relative_to}: {what}; each run is measured from the baseline run "
                    "at its own settings"
                )
        reads_test = MEASURES[claim.measure].split_key and all("test_scores" in groups[n].analyses for n in names)
        if reads_test and "test_scores" not in base.analyses:
            raise ValueError(
                f"{where}.relative_to={claim.relative_to}: add test_scores to its analyses, as the claim's groups "
                "have: the claim reads their test scores, and the baseline's must be on the same split"
            )


def check_logged(claim: Claim, points: list, where: str) -> None:
    """Refuse, with one line naming the field, a claim whose measure its runs never log: a score the evaluation of
    a group's objective does not return (as each built-in objective declares), or the stability diagnostics of a
    group that does not log them (``train.diagnostics_every`` 0). Checked on the study's points, whose configs
    say both, before anything trains."""
    from kilolayer.registry import OBJECTIVES

    measure = claim.the_measure()
    reading = [*claim.groups(), *([claim.relative_to] if claim.relative_to else [])]
    for p in (p for p in points if p.group in reading):
        objective = p.config.objective
        logs = OBJECTIVES.get(objective.name).logs(objective.options)
        if measure.split_key and logs is not None and measure.split_key not in logs:
            readable = [m.name for m in MEASURES.values() if m.split_key in logs and not m.diagnostics]
            raise ValueError(
                f"{where}.measure={claim.measure}: group {p.group!r} trains {objective.name}, whose evaluation logs "
                f"{', '.join(logs)} (no {measure.split_key}); measures it can read: {', '.join(readable)}"
            )
        if measure.diagnostics and not p.config.train.diagnostics_every:
            raise ValueError(
                f"{where}.measure={claim.measure}: reads the stability diagnostics, which group {p.group!r} does not "
                "log; set train.diagnostics_every in its set"
            )
        for key, value in ((k, v) for k, v in claim.where.items() if k != GROUP):
            try:
                setting = p.setting(key)
            except AttributeError:
                raise ValueError(f"{where}.where.{key}: not a config key of group {p.group!r}") from None
            if value in ("max", "min") and (isinstance(setting, bool) or not isinstance(setting, (int, float))):
                shown_setting = json.dumps(setting, default=str)
                raise ValueError(f"{where}.where.{key}={value}: max and min need numbers ({key} is {shown_setting})")


def _check_margin(claim: Claim, measure: Measure, grid: dict, where: str) -> None:
    m = claim.margin
    if not math.isfinite(m):
        raise ValueError(f"{where}.margin={m}: expected a finite number")
    if claim.kind == "ratio":
        if m < 1:
            raise ValueError(f"{where}.margin={m:g}: a ratio's margin is a factor of at least 1 (1.5: at least 1.5x)")
    elif m < 0:
        raise ValueError(f"{where}.margin={m:g}: expected a number >= 0; the claim's direction is set by its contrast")
    elif measure.fraction and m >= 1:
        raise ValueError(
            f"{where}.margin={m:g}: {measure.name} is a fraction in [0, 1], so is its margin (0.005 for half a point)"
        )
    elif claim.kind == "survived" and m >= len(grid.get(claim.contrast.over, [])):
        raise ValueError(
            f"{where}.margin={m:g}: a count of settings of {claim.contrast.over}; expected fewer "
            f"than its {len(grid[claim.contrast.over])} values"
        )
    if claim.paper_effect is not None and not (math.isfinite(claim.paper_effect) and claim.paper_effect > 0):
        raise ValueError(f"{where}.paper_effect={claim.paper_effect:g}: expected a finite number above 0")
    if claim.paper_effect is not None and not claim.paper_effect > m:
        raise ValueError(
            f"{where}.margin={m:g}: not below the paper's own effect (paper_effect={claim.paper_effect:g}), so the "
            "rule could not confirm it; choose a smaller margin"
        )


# ---------------------------------------------------------------- judging


class Judging:
    """One claim being judged: reads each run's value, and records what is not evidence, which claimed-better runs
    learned nothing and which against runs did not fail."""

    def __init__(self, claim: Claim, group: Runs, out, split: str, results: list = (), baseline=None):
        self.claim, self.group, self.out, self.split = claim, group, out, split
        self.results = list(results)
        self.baseline = baseline  # the group of relative_to, or None
        self.measure = claim.the_measure()
        self.lower_is_better = claim.direction() == "lower"
        self.excluded: list[str] = []
        self.unlearned: list[str] = []
        self.not_failed: list[str] = []  # against runs that learned
        self.unknown_failed: list[str] = []  # against runs whose data has no chance level: nobody can say
        self.read: dict = {}  # the runs the contrast read, by key
        self.used: dict = {}  # the value of each run read (before a baseline is subtracted), by key
        self.rounding = 0.0  # the most float rounding moved one value (ROUNDING of the values it came from)
        self.relative_rounding = 0.0  # the same, as a share of that value

    def other_keys(self, key: str) -> list[str]:
        fixed = {t for k in [key, *self.claim.where] for t in ties(self.group, k)}
        return [k for k in grid_values(self.group) if k not in fixed]

    @staticmethod
    def seed(r):
        return r.point.config.train.seed

    def combine(self, parts: list[float]) -> float:
        """One seed's cells as one value: their mean, or for a claim that must hold at each, the worst."""
        return min(parts) if self.claim.combine == "worst" else statistics.fmean(parts)

    def _baseline_of(self, r):
        """The baseline run at ``r``'s settings of the baseline group's grid and of its seed (another seed's
        initialisation would enter every difference as a constant that the bounds never see), or None."""
        keys = list(grid_values(self.baseline))
        return next(
            (
                b
                for b in self.results
                if b.point.group == self.baseline.name
                and self.seed(b) == self.seed(r)
                and all(same(grid_value(b, k), grid_value(r, k)) for k in keys)
            ),
            None,
        )

    def _exclude(self, why: str) -> None:
        if why not in self.excluded:
            self.excluded.append(why)

    def _evidence(self, r, what: str) -> bool:
        """Whether run ``r`` (the ``what`` of the comparison) is evidence; records it as read, or why it is not."""
        if r is not None:
            self.read[r.point.key] = r
        why = not_evidence(r, what) or pretraining_problem(r, self.results, self.out)
        if why:
            self._exclude(why)
        return not why

    def value(self, r, what: str, side: str | None = None) -> float | None:
        if not self._evidence(r, what):
            return None
        needs = "all_learn" in self.claim.requires or (side == "better" and "winner_learns" in self.claim.requires)
        if needs and learned(r, self.out) is not True:
            self.unlearned.append(r.point.key)
        if side == "against" and "loser_fails" in self.claim.requires:
            fails = failed(r, self.out)
            if fails is None:
                self.unknown_failed.append(r.point.key)
            elif not fails:
                ratio = loss_ratio(r, self.out)
                self.not_failed.append(f"{r.point.key}" + (f" ({ratio:.2f} x chance)" if ratio is not None else ""))
        m = self.measure
        if r.status == "diverged":
            v = m.on_diverged(r, self.out) if m.on_diverged is not None else None
            if v is None or not math.isfinite(v):
                self._exclude(
                    f"{r.point.key} (diverged, and {m.diverged_text.replace('a diverged run ', '', 1)}: "
                    f"no finite value here)"
                )
                return None
        else:
            v = m.read(r, self.out, self.split)
            if v is None or not math.isfinite(v):
                where = " on its test split" if self.split == TEST else ""
                self._exclude(f"{r.point.key} (no finite {m.name}{where})")
                return None
        raw, base = v, None
        self.used[r.point.key] = v
        if self.baseline is not None:  # a diverged run's score is measured from the same baseline
            b = self._baseline_of(r)
            base = m.read(b, self.out, self.split) if b is not None and b.ok else None
            if base is None or not math.isfinite(base):
                state = "missing" if b is None else f"{b.status}, no finite {m.name}" if b.ok else b.status
                self._exclude(f"the {self.baseline.name} baseline of {r.point.key} ({state})")
                return None
            v -= base
        self._rounded(v, raw, base)
        return v

    def _rounded(self, v: float, raw: float, base: float | None) -> None:
        """Record how far float rounding can have moved ``v`` (``raw``, less ``base`` where a baseline is)."""
        moved = ROUNDING * (abs(raw) + (abs(base) if base is not None else 0.0))
        self.rounding = max(self.rounding, moved)
        if v != 0:
            self.relative_rounding = max(self.relative_rounding, moved / abs(v))

    def trained(self, r, what: str) -> bool | None:
        if not self._evidence(r, what):
            return None
        got = learned(r, self.out)
        if got is None:
            self._exclude(f"{r.point.key} (no chance level: cannot say whether it learned)")
        return got


def claim_runs(claim: Claim, results: list) -> list:
    """The runs ``claim`` reads of a study's ``results``: its groups' runs with its ``where`` values."""
    return _runs_of(claim, results)[0]


def _runs_of(claim: Claim, results: list) -> tuple[list, dict]:
    """The runs of the claim's groups with its ``where`` values, and those values (``max``/``min`` resolved)."""
    runs = [r for r in results if r.point.group in claim.groups()]
    resolved = {}
    for key, value in claim.where.items():
        if value in ("max", "min"):
            values = [grid_value(r, key) for r in runs]
            found = (max if value == "max" else min)(values, key=lambda v: float(v)) if values else None
            resolved[key] = f"{found} (the group's {value})"
            value = found
        else:
            resolved[key] = value
        runs = [r for r in runs if same(grid_value(r, key), value)]
    return runs, resolved


def _split(measure: Measure, runs: list, group: Runs) -> str:
    """Test where the claim's groups score it (a run without its test score is then not evidence, named), or
    where every completed run was scored there; else validation."""
    if measure.test_only or (measure.split_key and "test_scores" in group.analyses):
        return TEST
    done = [r for r in runs if r.status == "completed"]
    if measure.split_key and done and all(has_test(r, measure.split_key) for r in done):
        return TEST
    return VALIDATION


def _split_text(measure: Measure, split: str) -> str:
    if not measure.split_key:
        return "read from what each run logged"
    if split == TEST:
        return "read on the whole test split, each run's checkpoint chosen on validation"
    return (
        "read on validation, the split that also chose each run's checkpoint (not every run compared was scored on "
        "a test split: add the test_scores analysis to its groups for an unbiased read)"
    )


def rule_text(
    claim: Claim, split: str, others: list[str], where: dict | None = None, tied: list[str] | None = None
) -> str:
    """The rule the report states, generated from the claim's fields (``where``: its values as resolved on the
    runs, e.g. ``max`` as the deepest setting; ``tied``: the grid keys that move with the contrast's key)."""
    measure, c = claim.the_measure(), claim.contrast
    unit = c.unit(measure)
    what = c.describe(measure, claim.direction())
    if claim.relative_to:
        what += f", each run's {claim.measure} less that of the group {claim.relative_to} run at its settings and seed"
    parts = [what + ", per seed"]
    if tied:
        parts[0] += f" ({c.key} moves together with {' and '.join(tied)} in the grid)"
    where = where if where is not None else claim.where
    if where:
        parts[0] += ", at " + ", ".join(f"{k} = {v}" for k, v in where.items())
    others = [k for k in others if k not in c.keys()]
    if others:
        how = (
            "the worst of them taken (the claim must hold at each)"
            if claim.combine == "worst"
            else "averaged over them"
        )
        parts[0] += f"; runs matched on {', '.join(others)} and {how}"
    parts.append(_split_text(measure, split))
    if c.kind != "survived":
        parts.append(measure.diverged_text)
    parts += [REQUIREMENTS[r] for r in claim.requires]
    margin = f"Margin {claim.margin:g}" + ("x" if c.kind == "ratio" else unit)
    if claim.margin_reason:
        margin += f": {claim.margin_reason}"
    if claim.paper_effect is not None:
        margin += f"; the paper's own effect is {claim.paper_effect:g}" + ("x" if c.kind == "ratio" else unit)
    text = "; ".join(parts) + f". {margin}."
    if c.count:
        text += " Count data: decided by the exact one-sided sign test."
    return text


def _table(claim: Claim, runs: list, judging: Judging) -> tuple[list, list]:
    sides = claim.contrast.sides()
    if sides is not None:  # the runs of the two sides compared
        runs = [r for r in runs if any(same(grid_value(r, claim.contrast.key), v) for v in sides)]
    shown_keys = [*claim.contrast.keys(), *ties(judging.group, claim.contrast.key)]
    shown_keys += judging.other_keys(claim.contrast.key)
    keys = list(dict.fromkeys(shown_keys))
    measure = judging.measure
    extra = [label for label, _ in measure.columns]
    if claim.relative_to:
        extra.append(f"{claim.measure} of {claim.relative_to}")
    headers = [*keys, "seed", claim.measure + (" (test)" if judging.split == TEST else ""), *extra]
    headers += ["loss / chance", "status"]
    rows = []

    def order(r):  # numbers by value (2 before 16), other values by their text
        values = [grid_value(r, k) for k in keys]
        return [(0, v, "") if isinstance(v, (int, float)) else (1, 0, json.dumps(v, default=str)) for v in values]

    for r in sorted(runs, key=lambda r: (order(r), judging.seed(r))):
        if r.status == "completed" or r.status == "diverged":
            # the value the verdict used (a shared_steps measure: over the steps both runs of its pair logged)
            v = judging.used.get(r.point.key)
            if v is None:
                v = (
                    judging.measure.read(r, judging.out, judging.split)
                    if r.status == "completed"
                    else (judging.measure.on_diverged(r, judging.out) if judging.measure.on_diverged else None)
                )
            value = "-" if v is None else f"{v:.4g}"
            ratio = loss_ratio(r, judging.out) if r.status == "completed" else None
            status = r.status if r.status == "completed" else f"diverged at step {r.step}"
        else:
            value, ratio, status = "-", None, r.status
        cells = [_number(read(r, judging.out, judging.split)) if r.ok else "-" for _, read in measure.columns]
        if claim.relative_to:
            b = judging._baseline_of(r)
            cells.append(_number(measure.read(b, judging.out, judging.split)) if b is not None and b.ok else "-")
        rows.append(
            [
                *(grid_value(r, k) for k in keys),
                judging.seed(r),
                value,
                *cells,
                "-" if ratio is None else f"{ratio:.2f}",
                status,
            ]
        )
    return headers, rows


def _number(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def _chance_note(runs, out) -> list[str]:
    """The chance levels of the runs' evaluation data; where they differ, each with the seeds it is of."""
    levels: dict[str, list] = {}
    for r in runs:
        if r.status in ("completed", "diverged"):
            c = chance(r, out)
            text = f"loss {c['loss']:.3f}" + (
                f", accuracy {c['accuracy']:.3f}" if c.get("accuracy") is not None else ""
            )
            seeds = levels.setdefault(text, [])
            if r.point.config.train.seed not in seeds:
                seeds.append(r.point.config.train.seed)
    if not levels:
        return []
    shown = (
        list(levels)
        if len(levels) == 1
        else [f"{text} (seed {', '.join(map(str, sorted(seeds)))})" for text, seeds in levels.items()]
    )
    return [
        f"Chance level (the best predictor that ignores the input, on these evaluation targets): {'; '.join(shown)}."
    ]


def _improving(runs: list, convergence) -> tuple[str, list]:
    """Whether ``runs`` were still improving at their budget, each on the (key, tolerance, relative) that
    ``convergence(run)`` gives; one line for the report, and the runs still improving."""
    by: dict[tuple, list] = {}
    for r in runs:
        by.setdefault(convergence(r), []).append(r)
    texts, moving = [], []
    for (key, tol, relative), rs in sorted(by.items()):
        text, moved = improving_summary(rs, key, tol, key == "loss", relative)
        texts += [text] if text else []
        moving += moved
    budgets = sorted({r.point.config.train.steps for r in runs})
    if texts and budgets:
        at = f"{budgets[0]:,}" if len(budgets) == 1 else f"{budgets[0]:,}-{budgets[-1]:,}"
        texts[0] = f"budget {at} steps: {texts[0]}"
    return "; ".join(texts), moving


def pretraining_of(runs: list, results: list) -> list:
    """The pre-training runs behind fine-tuned ``runs`` (each one's ``init_from`` point, followed back to a run
    trained from scratch), as found among ``results``."""
    by_key = {r.point.key: r for r in results}
    found: dict = {}
    todo = [r.point.init_from_point for r in runs if getattr(r.point, "init_from_point", None)]
    while todo:
        key = todo.pop()
        if key in found or key not in by_key:
            continue
        found[key] = by_key[key]
        todo += [found[key].point.init_from_point] if found[key].point.init_from_point else []
    return list(found.values())


def _pretraining_improving(runs: list, results: list) -> str:
    """Beside a claim on fine-tuned runs: how many of the pre-training runs behind them were still improving at
    their budget, each on the measure that chose its checkpoint (a fine-tuned model inherits what its
    pre-training had not finished learning)."""
    behind = pretraining_of(runs, results)
    text, _ = _improving(behind, selection_convergence)
    if not text:
        return ""
    groups = ", ".join(dict.fromkeys(r.point.group for r in behind))
    return f"their pre-training runs ({groups}), {text}"


def _mixed_bases(measure: Measure, judging: Judging, out, split: str) -> str:
    """Why the runs read cannot be compared where the measure covers different things in different runs (the
    directions a translation score averages), naming each basis and its runs; "" where they agree."""
    if measure.basis is None:
        return ""
    bases: dict[str, list[str]] = {}
    for key in judging.used:
        r = judging.read[key]
        if r.status != "diverged":  # a diverged run's value is the measure's for any basis
            bases.setdefault(measure.basis(r, out, split), []).append(key)
    if len(bases) < 2:
        return ""
    each = "; ".join(f"{basis} for {', '.join(keys)}" for basis, keys in bases.items())
    return f"the runs' {measure.name} covers different pairs, so their values are not comparable: {each}"


def judge(claim: Claim, results: list, groups, out) -> Finding:
    """The finding of ``claim`` from a study's ``results`` (``groups``: the spec's groups by name, or the one
    group the claim reads)."""
    groups = groups if isinstance(groups, dict) else {groups.name: groups}
    group = runs_of(claim, groups)
    runs, where = _runs_of(claim, results)
    measure = claim.the_measure()
    split = _split(measure, runs, group)
    baseline = groups[claim.relative_to] if claim.relative_to else None
    judging = Judging(claim, group, out, split, results, baseline)
    per_seed = claim.contrast.per_seed(runs, judging)
    unit = claim.contrast.unit(measure)
    v = decide(
        per_seed,
        claim.contrast.margin_of(claim.margin),
        unit,
        count=claim.contrast.count,
        not_evidence=tuple(judging.excluded),
        unlearned=tuple(dict.fromkeys(judging.unlearned)),
        # a claimed-better side that learned nothing contradicts the claim; a run of all_learn's says nothing
        unlearned_decides_against="all_learn" not in claim.requires,
        rounding=claim.contrast.rounding(judging),
    )
    if judging.not_failed or judging.unknown_failed:
        failing = claim.contrast.sides()[1]
        why = []
        if judging.not_failed:
            why.append(f"{', '.join(dict.fromkeys(judging.not_failed))} learned")
        if judging.unknown_failed:
            why.append(
                f"{', '.join(dict.fromkeys(judging.unknown_failed))} completed on data with no chance level, so "
                "nobody can say whether it failed"
            )
        v.reason += f"; the claim needs {claim.contrast.key}={failing} to fail in every seed, but {'; '.join(why)}"
        # the claim's premise is unmet: a held says nothing, and so does a did not hold, unless the claimed-better
        # side learned nothing (which contradicts the claim whatever the other side did)
        if v.verdict == HELD or (v.verdict == NOT_HELD and not judging.unlearned):
            v.verdict = INCONCLUSIVE
    mixed = _mixed_bases(measure, judging, out, split)
    if mixed:
        v.reason += f"; {mixed}"
        if v.verdict in (HELD, NOT_HELD):
            v.verdict = INCONCLUSIVE
    improving, moving = _improving(list(judging.read.values()), lambda r: convergence_of(measure, r))
    pretraining = _pretraining_improving(list(judging.read.values()), results)
    improving = "; ".join(t for t in (improving, pretraining) if t)
    unshown = [r for r in judging.read.values() if r.status == "completed" and len(r.evals) < 2]
    if "converged" in claim.requires and v.verdict in (HELD, NOT_HELD) and (moving or unshown):
        why = "some were still improving" if moving else f"{len(unshown)} had fewer than 2 evaluations"
        v.reason += f"; it would read '{v.verdict}', but the claim is about converged models and {why}"
        v.verdict = INCONCLUSIVE
    headers, rows = _table(claim, runs, judging)
    notes = _chance_note(runs, out)
    if measure.note is not None:
        notes += measure.note(list(judging.read.values()), out, split)
    if measure.shared_steps and claim.contrast.sides() is not None:
        notes.append(
            f"Each {claim.measure} in the table is read over the diagnostics steps that both runs of its pair "
            "logged, as the verdict compares them (a diverged run stops logging)."
        )
    if not runs:
        notes.append(f"No run of {claim.groups()} matches {claim.where}.")
    budgets = {g: sorted({r.point.config.train.steps for r in runs if r.point.group == g}) for g in claim.groups()}
    if len({tuple(b) for b in budgets.values() if b}) > 1:
        each = "; ".join(f"{g}: {', '.join(map(str, b))} steps" for g, b in budgets.items() if b)
        notes.append(f"The groups compared have different step budgets ({each}): each run is read at its own.")
    return Finding(
        claim.name,
        claim.title or claim.name,
        claim.claim,
        claim.source,
        rule_text(
            claim,
            split,
            judging.other_keys(claim.contrast.key),
            where,
            [k for k in ties(group, claim.contrast.key) if k != claim.contrast.key],
        ),
        v,
        headers,
        rows,
        scale_up=claim.scale_up,
        notes=notes,
        improving=improving,
    )
