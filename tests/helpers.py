"""What several test modules need: the ``kilolayer`` command in a fresh interpreter."""

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
