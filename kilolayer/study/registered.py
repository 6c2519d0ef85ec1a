"""Claims fixed before their runs are seen: each claim's deciding fields and its groups' step budgets are recorded
in the study's folder (``OUT/claims.json``) when a study starts, before anything of that invocation trains.

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
    """The fields that decide ``claim``'s verdict (its contrast under its kind's name), and the step budget of each
    group it reads, from the study's ``points``."""
    data = claim.data()
    fields = {k: data[k] for k in (*DECIDING, claim.kind) if k in data}
    groups = [*claim.groups(), *([claim.relative_to] if claim.relative_to else [])]
    fields["budget"] = {g: sorted({p.config.train.steps for p in points if p.group == g}) for g in groups}
    return json.loads(json.dumps(fields, default=str))


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
        elif entry["fields"] != now:
            entry.setdefault("changes", []).append({"from": entry["fields"], "to": now, "finished": done, "of": total})
            entry["fields"] = now
    if record:
        tmp = out / f".{FILE}.tmp"
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, out / FILE)


def _changed(before: dict, after: dict) -> str:
    """The fields that differ, each as ``field old -> new``."""
    parts = []
    for key in dict.fromkeys([*before, *after]):
        if before.get(key) != after.get(key):
            old, new = (json.dumps(d.get(key), sort_keys=True) if key in d else "(none)" for d in (before, after))
            parts.append(f"{key} {old} -> {new}")
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
    if entry["fields"] != now:  # a report written from a spec the study never ran
        texts.append(f"differs from what the study recorded ({_changed(entry['fields'], now)})")
    return "; ".join(texts)
