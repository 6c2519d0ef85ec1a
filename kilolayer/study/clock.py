"""A study directory's wall-clock record: one entry per ``kilolayer study`` invocation on it (when it began, how
long it took, how many points it trained and on what), kept in ``invocations.json``, so that a report rendered
again by an invocation that trains nothing still says what the study took."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from kilolayer import rundir

FILE = "invocations.json"


def record(out: Path, started: _dt.datetime, seconds: float, trained: int, executor: str) -> None:
    """Add this invocation to ``out``'s record (atomically; an unreadable record is started afresh)."""
    entry = {
        "started": started.isoformat(timespec="seconds"),
        "seconds": round(float(seconds), 1),
        "trained": int(trained),
        "executor": executor,
    }
    rundir.write_json(Path(out) / FILE, {"invocations": [*invocations(out), entry]})


def invocations(out: Path) -> list[dict]:
    """The recorded invocations, oldest first; entries that are not a record of one are passed over."""
    found = rundir.read_json(Path(out) / FILE, {})
    entries = found.get("invocations", []) if isinstance(found, dict) else []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("seconds"), (int, float))]


def wall_line(out: Path, seconds_now: float) -> str:
    """The report's wall-clock clause: this invocation's time and, where earlier invocations or this one trained
    points, the time of the invocations that trained, summed (a study interrupted and resumed counts each part)."""
    now = f"this invocation took {seconds_now / 60:.1f} min wall-clock"
    training = [e for e in invocations(out) if e.get("trained", 0) > 0]
    if not training:
        return now
    total = sum(e["seconds"] for e in training)
    runners = sorted({str(e.get("executor", "?")) for e in training})
    of = "the invocation" if len(training) == 1 else f"the {len(training)} invocations"
    return f"{now}; {of} that trained points took {total / 60:.1f} min ({', '.join(runners)})"
