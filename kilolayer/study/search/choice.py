"""The configs a search recommends: ``best.yaml``, or ``tied-<shape>.yaml`` for each of two within noise."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kilolayer import rundir
from kilolayer.config import load_config
from kilolayer.study.search.directory import CHOICE
from kilolayer.study.search.result import Search


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_choice(search: Search) -> None:
    """best.yaml: the recommended trial's config; when the top two are within noise, tied-<shape>.yaml for each
    of them instead (the report says so rather than pick). Only files the search wrote itself are replaced or
    removed (their names and hashes are in ``choice.json``): one edited since is kept as ``NAME.edited`` (a
    note in the report says so), and a file the search never wrote is left alone."""
    from kilolayer.config import dump_yaml
    from kilolayer.files import write_atomic

    out = search.out
    written: dict = rundir.read_json(out / CHOICE, {}) or {}

    def release(path: Path) -> None:
        """Make way for the search's own ``path``: remove it if the search wrote it as it is, keep an edited
        copy otherwise."""
        if not path.is_file():
            return
        if written.get(path.name) == _sha(path):
            path.unlink()
            return
        kept = path.with_name(path.name + ".edited")
        path.replace(kept)
        search.notes.append(f"{path.name} was not as the search wrote it: kept as {kept.name}")

    for name in list(written):
        release(out / name)
        written.pop(name)
    done = [t for t in search.ranked if t.state == "completed"]
    new: dict[str, Path] = {}
    c = search.comparison
    if done and c is not None and c.tied:
        new = {f"tied-{t.shape.name}.yaml": t.run for t in done[:2]}
    elif done:
        new = {"best.yaml": done[0].run}
    for name, run in new.items():
        path = out / name
        release(path)
        write_atomic(path, dump_yaml(load_config(run / rundir.CONFIG)))
        written[name] = _sha(path)
    if "best.yaml" in new:
        search.best = out / "best.yaml"
    rundir.write_json(out / CHOICE, written)
