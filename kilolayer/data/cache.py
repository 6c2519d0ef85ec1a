"""Decode a dataset once, keep its tensors in a cache file, load that file afterwards.

The cache folder is ``$KILOLAYER_CACHE`` if set, else ``$XDG_CACHE_HOME/kilolayer``
(``~/.cache/kilolayer``). A file is written to a temporary name in that folder
and renamed into place, so a crash or a second process never leaves a half-written
file under the final name. Files load with ``weights_only=True`` (tensors, strings,
numbers, lists and dicts only). A folder that cannot be written only costs the
decoding again next time; a cache file that cannot be read is decoded anew and
replaced.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch


def cache_dir() -> Path:
    """The folder that holds decoded datasets."""
    if os.environ.get("KILOLAYER_CACHE"):
        return Path(os.environ["KILOLAYER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kilolayer"


def cached(name: str, build: Callable[[], dict]) -> dict:
    """The dict of tensors (and plain values) cached as ``name``.pt, built by ``build()`` on the first call.

    ``name`` must change whenever what ``build`` returns would (e.g. it names the package version or
    the source files' sizes and times).
    """
    path = cache_dir() / f"{name}.pt"
    if path.is_file():
        try:
            return torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile):
            pass  # unreadable (e.g. from an older torch): decode again and replace it
    data = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(data, f)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache holds public data
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only or full cache folder: the data is still returned
    return data
