"""The versions of Debian packages extracted into a folder (or installed, under ``/``).

:mod:`kilolayer.data.debian` fetches and extracts packages and records their versions in
``ROOT/kilolayer-packages.json``; the sources that read packages' files (:mod:`kilolayer.data.parallel`) read
the versions back here to key their caches.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

MANIFEST = "kilolayer-packages.json"  # package -> version, written by fetch_packages


def read_manifest(root: Path) -> dict[str, str]:
    try:
        manifest = json.loads((Path(root) / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def package_versions(root: Path, names) -> dict[str, str]:
    """Each package's version: from the manifest :func:`fetch_packages` writes, else the first line of its
    Debian changelog under ``root`` (so ``/`` works for installed packages), else ``unknown``."""
    manifest = read_manifest(root)
    out = {}
    for name in names:
        version = manifest.get(name)
        if version is None:
            try:
                with gzip.open(
                    Path(root) / "usr/share/doc" / name / "changelog.Debian.gz", "rt", errors="replace"
                ) as f:
                    m = re.match(r"\S+ \(([^)]+)\)", f.readline())
                version = m.group(1) if m else None
            except OSError:
                version = None
        out[name] = version or "unknown"
    return out
