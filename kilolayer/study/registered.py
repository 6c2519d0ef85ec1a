"""Claims fixed before their runs are seen: each claim's deciding fields and, for each group it reads, the step
budget, the seeds, the grid and the settings its runs share are recorded in the study's folder
(``OUT/claims.json``) when a study starts, before anything of that invocation trains.

A claim first recorded when some of the runs it reads had already finished, or whose deciding fields or budgets
differ from the recorded ones once some of its runs had finished, was set by someone who could have seen its
numbers: the report labels it *post hoc* and says what changed and how many of its runs had finished. A claim
revised while none of its runs had finished is not post hoc. The text fields (claim, title, source, plots,
scale-up) decide nothing and are not compared.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE = "claims.json"
DECIDING = ("runs", "measure", "margin", "paper_effect", "better", "where", "requires", "relative_to", "combine")
FINISHED = ("completed", "diverged")


def deciding(claim, points) -> dict:
    """The fields that decide ``claim``'s verdict (its contrast under its kind's name) and, from the study's
    ``points``, what each group it reads runs: its step budget, seeds, grid and the settings its runs share (the
    config's explicitly set values; more seeds, another grid value under ``where: max`` or another learning rate
    change the verdict as a margin does)."""
    data = claim.data()
    fields = {k: data[k] for k in (*DECIDING, claim.kind) if k in data}
    groups = [*claim.groups(), *([claim.relative_to] if claim.relative_to else [])]
    mine = {g: [p for p in points if p.group == g] for g in groups}
    fields["budget"] = {g: sorted({p.config.train.steps for p in ps}) for g, ps in mine.items()}
    fields["seeds"] = {g: sorted({p.config.train.seed for p in ps}) for g, ps in mine.items()}
    fields["grid"] = {g: _grid(ps) for g, ps in mine.items()}
    fields["settings"] = {g: _shared(ps) for g, ps in mine.items()}
    return json.loads(json.dumps(fields, default=str))


def _grid(points) -> list[dict]:
    """The grid values of ``points`` (seed left out), each setting once, in a fixed order."""
    values = {_json({k: v for k, v in p.values.items() if k != "train.seed"}) for p in points}
    return [json.loads(v) for v in sorted(values)]


def _json(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _flat(value, prefix: str = "") -> dict:
    """A nested mapping as ``{"a.b.c": leaf}``."""
    if not isinstance(value, dict):
        return {prefix: value}
    out = {}
    for k, v in value.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _shared(points) -> dict:
    """The explicitly set config values that every one of ``points`` has alike: the grid, the seed and the step
    budget are recorded apart, and absolute paths (where the data or a source run lies) are left out, since a
    study re-run from another folder or machine trains the same."""
    flats = [_flat(p.config.model_dump(mode="json", exclude_defaults=True)) for p in points]
    if not flats:
        return {}
    return {
        k: v
        for k, v in sorted(flats[0].items())
        if k not in ("train.seed", "train.steps")
        and not (isinstance(v, str) and v.startswith("/"))
        and all(f.get(k, object()) == v for f in flats)
    }


def _read(out: Path) -> dict:
    try:
        data = json.loads((Path(out) / FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _finished(claim, points, out: Path) -> tuple[int, int]:
    """How many of the runs ``claim`` reads have finished in ``out`` (completed or diverged), of how many."""
    from kilolayer.rundir import RunDir

    groups = [*claim.groups(), *([claim.relative_to] if claim.relative_to else [])]
    mine = [p for p in points if p.group in groups]
    done = sum(RunDir(p.run_dir(out)).status.get("status") in FINISHED for p in mine)
    return done, len(mine)


def record_claims(spec, points, out: Path) -> None:
    """Record each claim of ``spec`` in ``out`` before the study trains: its deciding fields the first time it is
    seen, and each later change of them, with how many of its runs had finished at that moment."""
    out = Path(out)
    record = _read(out)
    for claim in spec.claims:
        now = deciding(claim, points)
        done, total = _finished(claim, points, out)
        entry = record.get(claim.name)
        if not isinstance(entry, dict) or "fields" not in entry:
            record[claim.name] = {"fields": now, "finished": done, "of": total, "changes": []}
        elif _differs(entry["fields"], now):
            entry.setdefault("changes", []).append({"from": entry["fields"], "to": now, "finished": done, "of": total})
            entry["fields"] = now
        else:
            entry["fields"] = now  # fields an older record lacks, filled in
    if record:
        tmp = out / f".{FILE}.tmp"
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, out / FILE)


def _differs(before: dict, after: dict) -> bool:
    """Whether the recorded fields ``before`` differ from ``after`` in a field both hold (a record written by an
    older kilolayer lacks the fields it did not record, and those are not a change)."""
    return any(before[k] != after[k] for k in before.keys() & after.keys())


def _changed(before: dict, after: dict) -> str:
    """The fields that differ, each as ``field old -> new``; a group's settings by the keys that differ."""
    parts = []
    for key in dict.fromkeys([*before, *after]):
        if key not in before or key not in after or before[key] == after[key]:
            continue
        if key == "settings" and isinstance(before[key], dict) and isinstance(after[key], dict):
            old, new = _flat(before[key]), _flat(after[key])
            for k in dict.fromkeys([*old, *new]):
                if old.get(k, "(none)") != new.get(k, "(none)"):
                    parts.append(f"{k} {_json(old.get(k, '(none)'))} -> {_json(new.get(k, '(none)'))}")
            continue
        parts.append(f"{key} {_json(before[key])} -> {_json(after[key])}")
    return "; ".join(parts)


def post_hoc(claim, points, out: Path) -> str:
    """Why ``claim``'s verdict is post hoc in the study in ``out``, or "" when it was fixed before any of its runs
    finished (or the folder holds no record of it: a study not run by ``kilolayer study``)."""
    entry = _read(out).get(claim.name)
    if not isinstance(entry, dict) or "fields" not in entry:
        return ""
    texts = []
    if entry.get("finished"):
        texts.append(f"first recorded after {entry['finished']} of its {entry.get('of', '?')} runs had finished")
    for change in entry.get("changes") or []:
        if change.get("finished"):
            texts.append(
                f"changed after {change['finished']} of its {change.get('of', '?')} runs had finished "
                f"({_changed(change.get('from') or {}, change.get('to') or {})})"
            )
    now = deciding(claim, points)
    if _differs(entry["fields"], now):  # a report written from a spec the study never ran
        texts.append(f"differs from what the study recorded ({_changed(entry['fields'], now)})")
    return "; ".join(texts)
