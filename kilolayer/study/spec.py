"""Study specs: groups of grids over config keys, expanded into ordinary training points.

A spec (YAML or a built-in name)::

    name: my_study
    description: what it asks
    groups:
      - name: deepnet
        base: {model: {...}, objective: {...}, data: {...}, train: {...}}   # or a config file, relative to the spec
        set: {train.steps: 200}     # overrides of base's keys
        grid:                       # the product of these
          model.scheme: [post_ln, deepnorm]
          model.layers,model.decoder_layers: [[6, 6], [18, 18]]   # keys tied together
        seeds: [0, 1]               # train.seed values (default [0])
        analyses: [smoothness]      # run on each finished point (kilolayer.study.analyses.ANALYSES)
      - name: finetune
        after: pretrain             # runs once the named group is done
        init_from: pretrain         # train.init_from = the pretrain point with the same grid values
        ...
    findings: [deepnet_depth, ...]  # names in kilolayer.study.findings.FINDINGS
    claims:                         # claims as data (kilolayer.verdicts.claims), or built-in ones by name
      - name: deeper_is_better
        runs: deepnet
        ...

Each point is a plain ``kilolayer train`` run directory ``OUT/runs/<group>/<point>``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from kilolayer.config import (
    Config,
    absolute_paths,
    apply_sets,
    format_validation_error,
    load_config,
    parse_set,
    read_yaml,
    to_yaml,
)
from kilolayer.errors import ConfigError, InputError
from kilolayer.study.analyses import ANALYSES
from kilolayer.study.claim_plots import CLAIM_PLOTS
from kilolayer.train.run import check_early_stopping, check_steps
from kilolayer.verdicts.claims import Claim, cannot_decide, check_claim, check_logged, parse_claim


class GroupSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=r"^[A-Za-z0-9_\-]+$")
    description: str = ""
    base: dict[str, Any] | str = Field(
        default_factory=dict, description="the config: a mapping, or a config file's path relative to the spec file"
    )
    set: dict[str, Any] = Field(default_factory=dict, description="overrides of base's keys, dotted")
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    analyses: list[str] = Field(default_factory=list)
    analysis_data: dict[str, Any] | None = Field(
        None,
        description="the data section the analyses read instead of each run's own (measure every group of a "
        "modality on the same inputs)",
    )
    after: str | None = None
    init_from: str | None = None

    @field_validator("grid")
    @classmethod
    def _grid(cls, grid):
        for key, values in grid.items():
            if not values:
                raise ValueError(f"grid.{key}: empty list of values")
            if "train.seed" in (k.strip() for k in key.split(",")):
                raise ValueError(f"grid.{key}: seeds are the group's `seeds` list, not a grid key")
            width = len(key.split(","))
            if width > 1:
                for v in values:
                    if not isinstance(v, list) or len(v) != width:
                        raise ValueError(
                            f"grid.{key}: each value must be a list of {width} values (keys tied together)"
                        )
        return grid

    @field_validator("base")
    @classmethod
    def _base(cls, base):
        # a path left unresolved by load_spec (a spec built in Python): relative to the working directory
        return read_yaml(base) if isinstance(base, str) else base

    @field_validator("analyses")
    @classmethod
    def _analyses(cls, names):
        for n in names:
            if n not in ANALYSES:
                raise ValueError(ANALYSES.unknown(n))
        return names


class StudySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    expected_minutes: float | None = Field(None, description="wall-clock on a 2-core CPU machine")
    expected_basis: str = Field("", description="how expected_minutes was obtained: measured, or estimated")
    groups: list[GroupSpec] = Field(..., min_length=1)
    findings: list[str] = Field(default_factory=list)
    claims: list[Any] = Field(default_factory=list)
    _left_out: list[str] = PrivateAttr(default_factory=list)

    @property
    def claims_left_out(self) -> list[str]:
        """The claims of a named set that the spec left out, each with why (``"NAME (of SET): this spec has no
        group G"``)."""
        return list(self._left_out)

    @property
    def claims_undecidable(self) -> list[str]:
        """The claims that too few seeds leave inconclusive whatever the runs show, each with why."""
        groups = {g.name: g for g in self.groups}
        return [why for c in self.claims if (why := cannot_decide(c, groups))]

    @model_validator(mode="after")
    def _claims(self):
        """Each claim parsed and checked against the groups: a bad claim is refused before anything trains."""
        groups = {g.name: g for g in self.groups}
        from kilolayer.study.builtin import builtin_claim_sets, builtin_claims

        # a built-in claim named under findings is that claim
        known, sets = builtin_claims(), builtin_claim_sets()
        moved = [f for f in self.findings if (f in known or f in sets) and not any(c == f for c in self.claims)]
        self.findings = [f for f in self.findings if f not in moved]
        self.claims = [c for raw in [*moved, *self.claims] for c in _members(raw, sets, known, groups, self._left_out)]
        parsed, names = [], set()
        for i, raw in enumerate(self.claims):
            where = f"claims[{i}]"
            claim = raw if isinstance(raw, Claim) else parse_claim(_named(raw, where), where)
            check_claim(claim, groups, where + (f" ({claim.name})" if claim.name else ""))
            for plot in claim.plots:
                if plot not in CLAIM_PLOTS:
                    raise ValueError(f"{where}.plots: {plot!r} is unknown; allowed: {', '.join(sorted(CLAIM_PLOTS))}")
            if claim.name in names:
                raise ValueError(f"{where}.name={claim.name!r}: two claims of the spec have this name")
            names.add(claim.name)
            parsed.append(claim)
        self.claims = parsed
        return self


def _members(raw: Any, sets: dict, known: dict, groups: dict, left_out: list[str]) -> list:
    """``raw``, or where it names a set of built-in claims, those of its claims whose groups the spec has; each
    claim of the set left out is added to ``left_out`` with the groups it lacks."""
    if not (isinstance(raw, str) and raw in sets):
        return [raw]
    found = [name for name in sets[raw] if all(g in groups for g in _group_names(known[name]))]
    if not found:
        needed = sorted({g for name in sets[raw] for g in _group_names(known[name])})
        raise ValueError(f"claims: {raw!r} reads groups this spec does not have ({', '.join(needed)})")
    for name in sets[raw]:
        lacking = [g for g in dict.fromkeys(_group_names(known[name])) if g not in groups]
        if lacking:
            plural = "groups" if len(lacking) > 1 else "group"
            left_out.append(f"{name} (of {raw}): this spec has no {plural} {', '.join(lacking)}")
    return found


def _group_names(claim: dict) -> list[str]:
    runs = claim.get("runs")
    return ([runs] if isinstance(runs, str) else list(runs or [])) + (
        [claim["relative_to"]] if claim.get("relative_to") else []
    )


def _named(raw: Any, where: str) -> Any:
    """A claim's mapping: ``raw`` itself, or the built-in claim it names (a string, or ``{use: NAME, ...}`` whose
    other fields replace the built-in's, e.g. ``runs`` to bind it to a group of this spec)."""
    name = raw if isinstance(raw, str) else raw.get("use") if isinstance(raw, dict) else None
    if name is None:
        return raw
    from kilolayer.study.builtin import builtin_claim_sets, builtin_claims

    known, sets = builtin_claims(), builtin_claim_sets()
    if name in sets:
        raise ValueError(
            f"{where}={name!r}: names a set of built-in claims ({', '.join(sets[name])}); use one of them to rebind "
            "its runs"
        )
    if name not in known:
        raise ValueError(f"{where}={name!r}: no built-in claim of that name; built-in: {', '.join(sorted(known))}")
    extra = {k: v for k, v in raw.items() if k != "use"} if isinstance(raw, dict) else {}
    return {**known[name], **extra}


@dataclass
class Point:
    """One training run of a study."""

    group: str
    name: str
    values: dict[str, Any]  # grid values (dotted keys) + train.seed
    config: Config
    init_from_point: str | None = None  # "<group>/<name>" whose run initialises this one
    analyses: list[str] = field(default_factory=list)
    analysis_data: dict[str, Any] | None = None  # the data section analyses read (None: the run's own)

    def run_dir(self, out: Path) -> Path:
        return Path(out) / "runs" / self.group / self.name

    def setting(self, key: str) -> Any:
        """The value of the dotted config key ``key`` (``train.lr``) in this point's config."""
        value: Any = self.config
        for part in key.split("."):
            value = getattr(value, part)
        return value

    @property
    def key(self) -> str:
        return f"{self.group}/{self.name}"


def _short(key: str) -> str:
    return key.split(".")[-1]


def _sets(values: dict[str, Any]) -> list[str]:
    """``key.path=value`` strings of a mapping of dotted keys (YAML flow values, as ``--set`` reads them)."""
    return [f"{k}={to_yaml(v, default_flow_style=True).strip().removesuffix('...').strip()}" for k, v in values.items()]


def point_name(values: dict[str, Any]) -> str:
    parts = []
    for k, v in values.items():
        parts.append(f"{_short(k)}={v}")
    return "_".join(parts).replace("/", "-") or "base"


def dependencies(spec: StudySpec, points: list[Point]) -> dict[str, set[str]]:
    """Which points each point waits for: its ``init_from`` point, and all of its ``after`` group when that
    is not the group it is initialised from (then the one source point is enough)."""
    groups = {g.name: g for g in spec.groups}
    members: dict[str, list[str]] = {}
    for p in points:
        members.setdefault(p.group, []).append(p.key)
    deps = {}
    for p in points:
        g = groups[p.group]
        need = {p.init_from_point} if p.init_from_point else set()
        if g.after is not None and g.after != g.init_from:
            need |= set(members.get(g.after, []))
        deps[p.key] = need
    return deps


class Queue:
    """A study's points not yet started, in the spec's order. :meth:`take` gives those whose every dependency
    (:func:`dependencies`) has ended, first in order first; every executor and the estimate's replay of the local
    runner start points from one, so a point waits only for the points it needs."""

    def __init__(self, spec: StudySpec, points: list[Point]):
        self.deps = dependencies(spec, points)
        self.waiting = list(points)
        self.ended: set[str] = set()

    def __len__(self) -> int:
        return len(self.waiting)

    def take(self, limit: int | None = None) -> list[Point]:
        """Up to ``limit`` (every one when None) ready points; they leave the queue."""
        ready = [p for p in self.waiting if self.deps[p.key] <= self.ended][:limit]
        taken = {p.key for p in ready}
        self.waiting = [p for p in self.waiting if p.key not in taken]
        return ready

    def end(self, key: str) -> None:
        """``key`` has ended (finished, failed or given up): the points that wait for it may start."""
        self.ended.add(key)


def expand(spec: StudySpec) -> list[Point]:
    """All points of a spec, groups in order; validates every config up front (one line if any is bad)."""
    names = [g.name for g in spec.groups]
    if len(set(names)) != len(names):
        raise ConfigError(f"groups: duplicate group names in {names}")
    points: list[Point] = []
    by_group: dict[str, list[Point]] = {}
    for g in spec.groups:
        if g.after is not None and g.after not in by_group:
            raise ConfigError(f"groups.{g.name}.after={g.after!r}: no earlier group of that name")
        if g.init_from is not None and g.init_from not in by_group:
            raise ConfigError(f"groups.{g.name}.init_from={g.init_from!r}: no earlier group of that name")
        keys = list(g.grid)
        combos = list(itertools.product(*(g.grid[k] for k in keys))) if keys else [()]
        mine = []
        for combo in combos:
            for seed in g.seeds:
                values: dict[str, Any] = {}
                for key, value in zip(keys, combo):
                    subkeys = key.split(",")
                    vals = value if len(subkeys) > 1 else [value]
                    for sk, sv in zip(subkeys, vals):
                        values[sk.strip()] = sv
                values["train.seed"] = seed
                sets = _sets(values)
                data = apply_sets(g.base, [*_sets(g.set), *sets])
                try:
                    cfg = load_config(data)
                    check_steps(cfg)
                    check_early_stopping(cfg)
                except ConfigError as err:
                    raise ConfigError(f"groups.{g.name} point {point_name(values)}: {err}") from None
                p = Point(
                    g.name, point_name(values), values, cfg, analyses=list(g.analyses), analysis_data=g.analysis_data
                )
                if g.init_from is not None:
                    p.init_from_point = _match(p, by_group[g.init_from], g.init_from)
                mine.append(p)
        seen: set[str] = set()
        for p in mine:
            if p.name in seen:
                raise ConfigError(f"groups.{g.name}: two points are both named {p.name!r} (one run directory)")
            seen.add(p.name)
        by_group[g.name] = mine
        points += mine
    for i, claim in enumerate(spec.claims):  # what the points' configs say each claim's runs will log
        try:
            check_logged(claim, points, f"claims[{i}] ({claim.name})")
        except ValueError as err:
            raise ConfigError(str(err)) from None
    return points


def check_data(points: list[Point]) -> None:
    """Every data set the points train on, and every one their analyses read, is there: each distinct data
    section is loaded once with the first point that names it, so a package or file that is missing is one
    line naming that point before any run starts, not a failure per run an hour into a study. A check of
    availability: a setting that fits one point's data but not another's model still fails at that run."""
    from kilolayer.train.score import for_split

    seen: set[tuple[str, str]] = set()
    for p in points:
        base = p.config
        if p.analysis_data is not None:
            base = load_config({**p.config.model_dump(), "data": p.analysis_data})
        configs = [p.config] if base is p.config else [p.config, base]
        if "test_scores" in p.analyses:  # it scores the test split, which not every data set has
            configs.append(for_split(base, "test"))
        try:
            for cfg in configs:
                _load_once(cfg, seen)
        except ConfigError as err:
            if cfg is configs[-1] and "test_scores" in p.analyses and str(err).startswith("data.options.eval_split:"):
                raise ConfigError(
                    f"groups.{p.group}.analyses: test_scores scores the test split, which "
                    f"data.name={base.data.name!r} does not have (it evaluates on its validation split only)"
                ) from None
            raise ConfigError(f"groups.{p.group} point {p.name}: {err}") from None
        except InputError as err:
            raise ConfigError(f"groups.{p.group} point {p.name}: {err}") from None


def _load_once(cfg, seen: set) -> None:
    """Load ``cfg``'s data unless an equal data section (and model input) was loaded already."""
    from kilolayer.data import load_source

    key = (cfg.data.model_dump_json(), cfg.model.input)
    if key not in seen:
        seen.add(key)
        load_source(cfg)


def _match(p: Point, candidates: list[Point], group: str) -> str:
    """The candidate whose grid values agree with p's on every key they share."""
    best = [c for c in candidates if all(p.values.get(k) == v for k, v in c.values.items() if k in p.values)]
    if len(best) != 1:
        raise ConfigError(
            f"groups.{p.group} point {p.name}: init_from={group!r} matches {len(best)} points; "
            "give both groups the same grid keys"
        )
    return best[0].key


def load_spec(source: str | Path, sets: list[str] | None = None) -> StudySpec:
    """A built-in study by name, or a YAML spec file. A group's ``base`` that is a path is read relative to the
    spec file; ``sets`` (``kilolayer study --set KEY=VALUE``) apply to every group, after its own ``set``."""
    from kilolayer.study.builtin import BUILTIN

    src = str(source)
    if src in BUILTIN:
        data, root = BUILTIN[src](), None
    else:
        p = Path(src)
        if not p.is_file():
            raise ConfigError(f"{BUILTIN.unknown(src)}; nor is it a spec file (see kilolayer study --list)")
        data, root = read_yaml(p), p.parent
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping with name, groups and findings or claims")
    for i, g in enumerate(data.get("groups") or []):
        if isinstance(g, dict):
            _resolve_base(g, i, root, sets or [])
    try:
        spec = StudySpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, "study")) from None
    from kilolayer.study.findings import FINDINGS

    for f in spec.findings:
        FINDINGS.get(f)
    return spec


def _resolve_base(group: dict, index: int, root: Path | None, sets: list[str]) -> None:
    """A group's ``base`` given as a config file read in place (relative to the spec's folder), and the study's
    ``--set`` values applied to it: every group then holds its config as a mapping. Its paths come out absolute
    as :func:`kilolayer.config.load_config` makes them: a config file's relative to that file's folder, a
    mapping written in the spec relative to the spec's."""
    base = group.get("base", {})
    where = f"groups[{index}]" + (f" ({group['name']})" if isinstance(group.get("name"), str) else "")
    if isinstance(base, str):
        path = Path(base) if Path(base).is_absolute() or root is None else root / base
        if not path.is_file():
            raise ConfigError(f"{where}.base={base!r}: no such config file ({path})")
        base = read_yaml(path)
        if not isinstance(base, dict):
            raise ConfigError(f"{where}.base={base!r}: expected a config mapping in {path}")
        base = absolute_paths(base, path.parent)
    elif isinstance(base, dict) and root is not None:
        base = absolute_paths(base, root)
    group["base"] = base
    if sets:  # after the group's own set, before its grid values
        own = group.get("set") or {}
        if not isinstance(own, dict):
            raise ConfigError(f"{where}.set: expected a mapping of dotted keys to values")
        given = {".".join(path): value for path, value in map(parse_set, sets)}
        grid = group.get("grid") if isinstance(group.get("grid"), dict) else {}
        varied = {k.strip() for key in grid for k in str(key).split(",")}
        for key in given:
            if key in varied:  # the grid would override it at every point: refused rather than ignored
                name = group["name"] if isinstance(group.get("name"), str) else where
                raise ConfigError(f"{key} is a grid key of group {name}; --set applies to every group's base")
        group["set"] = {**own, **given}
