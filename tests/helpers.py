"""What several test modules need: the ``kilolayer`` command in a fresh interpreter, and study results made up
for the verdict tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``python -m kilolayer ARGS`` from the repository root, its output captured as text. It inherits
    OMP_NUM_THREADS=1 from tests/conftest.py, so its losses match an in-process run's bit for bit; ``kw`` goes
    to :func:`subprocess.run` (``env=`` replaces the environment)."""
    cmd = [sys.executable, "-m", "kilolayer", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout, **kw)


# the chance levels made-up study results carry, so that no data is loaded to compute them
CHANCE = {"loss": 2.4, "accuracy": 0.1}


def study_results(study: str, outcome, seeds=(0, 1)) -> list:
    """Results for the points of the built-in ``study`` with ``seeds``, nothing trained: ``outcome(point)`` gives
    ``(status, final evaluation, diagnostics records)``; a completed run ends at its step budget with that
    evaluation, a diverged one at step 30. Chance levels are :data:`CHANCE`."""
    from kilolayer.study.runner import Result
    from kilolayer.study.spec import expand, load_spec

    results = []
    for p in expand(load_spec(study)):
        if p.values["train.seed"] not in seeds:
            continue
        status, final, diagnostics = outcome(p)
        step = p.config.train.steps if status == "completed" else 30
        r = Result(
            point=p,
            status=status,
            reason="" if status in ("completed", "diverged") else "boom",
            step=step,
            eval=dict(final),
            evals=[{"step": step, "split": "eval", **final}] if final else [],
            diagnostics=diagnostics,
        )
        r.chance = dict(CHANCE)
        results.append(r)
    return results
