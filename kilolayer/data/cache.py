"""Decode a dataset once, keep its tensors in a cache file, load that file afterwards.

The cache folder is ``$KILOLAYER_CACHE`` if set, else ``$XDG_CACHE_HOME/kilolayer``
(``~/.cache/kilolayer``). A file is written to a temporary name in that folder
and renamed into place, so a crash or a second process never leaves a half-written
file under the final name. Files load with ``weights_only=True`` (tensors, strings,
numbers, lists and dicts only). A folder that cannot be written only costs the
decoding again next time. A cache file that cannot be read, or that loads but
does not hold what the caller declares (its keys, each tensor's dtype and number
of dimensions, the caller's own ``check``), or whose bytes no longer match the
SHA-256 written with them (a damaged disk, a stray write: ``torch.load`` itself
reads a flipped byte of tensor data without complaint), is decoded anew and
replaced, with a one-line warning.

A temporary file is named ``.NAME.PID@HOST.XXXXXXXX.tmp``. One left behind by a
writer that was killed (``kill -9``, a power cut) is removed by the next call
for the same ``NAME``, load or write, when it is stale: its writer ran on this
host and no longer runs, or it was last modified more than an hour ago
(``STALE_SECONDS``; the only rule for one from another host, or without a pid
in its name). A live writer's file is never touched.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

STALE_SECONDS = 3600  # a temporary file untouched this long is a dead writer's (a write takes seconds)


@dataclass(frozen=True)
class TensorOf:
    """What a cached value must be: a tensor of one of ``dtypes`` (any if empty) with ``ndim`` dimensions
    (any if None)."""

    dtypes: tuple[torch.dtype, ...] = ()
    ndim: int | None = None

    def problem(self, value) -> str | None:
        if not isinstance(value, torch.Tensor):
            return f"a {type(value).__name__}, expected a tensor"
        if self.dtypes and value.dtype not in self.dtypes:
            wanted = " or ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"a tensor of {str(value.dtype).removeprefix('torch.')}, expected {wanted}"
        if self.ndim is not None and value.dim() != self.ndim:
            return f"a tensor of {value.dim()} dimensions {list(value.shape)}, expected {self.ndim}"
        return None


INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def cache_dir() -> Path:
    """The folder that holds decoded datasets."""
    if os.environ.get("KILOLAYER_CACHE"):
        return Path(os.environ["KILOLAYER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kilolayer"


def _warn(message: str) -> None:
    print(f"kilolayer: warning: {' '.join(message.split())}", file=sys.stderr, flush=True)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: it exists
        return True
    return True


def remove_stale_temporaries(name: str, folder: Path | None = None) -> list[Path]:
    """Remove the stale temporary files of cache entry ``name`` (see the module's docstring); the removed."""
    folder = cache_dir() if folder is None else folder
    # .NAME.PID@HOST.XXXXXXXX.tmp, or .NAME.XXXXXXXX.tmp without the writer's pid
    pattern = re.compile(re.escape(f".{name}.") + r"(?:(\d+)@([A-Za-z0-9-]*)\.)?[a-z0-9_]+\.tmp")
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now, host = time.time(), _host()
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if not match:
            continue
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > STALE_SECONDS
            dead = match[1] is not None and match[2] == host and not _running(int(match[1]))
            if old or dead:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue  # gone already, or not ours to remove
    return removed


def problem(
    data, expect: Mapping[str, TensorOf | type] | None = None, check: Callable[[dict], None] | None = None
) -> str | None:
    """Why ``data`` is not what the cache entry must hold, or None: a dict with every key of ``expect``, each
    value a ``TensorOf`` it satisfies or an instance of the type given, and ``check(data)`` raising nothing."""
    if not isinstance(data, dict):
        return f"a {type(data).__name__}, expected a dict"
    expect = expect or {}
    missing = [k for k in expect if k not in data]
    if missing:
        return f"no {', '.join(map(repr, missing))} (holds {', '.join(map(repr, data)) or 'nothing'})"
    for key, want in expect.items():
        value = data[key]
        if isinstance(want, TensorOf):
            why = want.problem(value)
        else:
            why = None if isinstance(value, want) else f"a {type(value).__name__}, expected {want.__name__}"
        if why:
            return f"{key!r} is {why}"
    if check is not None:
        try:
            check(data)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            return str(err) or type(err).__name__
    return None


#: the key under which a cache file keeps the SHA-256 of what it holds (:func:`digest`)
DIGEST_KEY = "kilolayer_sha256"


def digest(data) -> str:
    """SHA-256 of ``data``: every tensor's dtype, shape and bytes, and every other value's repr, in key order.

    torch.load reads a flipped byte in a tensor's data without complaint; this is what finds it."""
    h = hashlib.sha256()

    def feed(value) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"tensor {t.dtype} {list(t.shape)};".encode())
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        elif isinstance(value, dict):
            h.update(f"dict {len(value)};".encode())
            for key in sorted(value, key=repr):
                h.update(f"{key!r}:".encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            h.update(f"{type(value).__name__} {len(value)};".encode())
            for item in value:
                feed(item)
        else:
            h.update(f"{value!r};".encode())

    feed(data)
    return h.hexdigest()


def _verify(data, expect, check) -> str | None:
    """Why a loaded cache file cannot be used, or None: its checksum (when it has one) first, then what it
    must hold (:func:`problem`), then a file without a checksum."""
    saved = data.pop(DIGEST_KEY, None) if isinstance(data, dict) else None
    if saved is not None and saved != digest(data):
        return "does not match its SHA-256 checksum (a damaged byte)"
    why = problem(data, expect, check)
    if why is None and saved is None:
        return "has no checksum (written by an older kilolayer)"
    return why


def cached(
    name: str,
    build: Callable[[], dict],
    expect: Mapping[str, TensorOf | type] | None = None,
    check: Callable[[dict], None] | None = None,
) -> dict:
    """The dict of tensors (and plain values) cached as ``name``.pt, built by ``build()`` on the first call.

    ``name`` must change whenever what ``build`` returns would (e.g. it names the package version or
    the source files' sizes and times). ``expect`` and ``check`` declare what the entry holds (see
    :func:`problem`): a loaded file that does not is rebuilt and replaced, with a one-line warning; built
    data that does not is returned uncached, for the caller's own checks to report.
    """
    path = cache_dir() / f"{name}.pt"
    remove_stale_temporaries(name, path.parent)
    if path.is_file():
        try:
            data = torch.load(path, weights_only=True)
        except Exception as err:  # only a cache: a damaged byte can surface as any of a dozen errors
            why = f"unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'})"
        else:
            why = _verify(data, expect, check)
            if why is None:
                return data
        _warn(f"{path}: cache file {why}; decoding the data again and replacing it")
    data = build()
    if problem(data, expect, check) is not None:
        return data  # never cached; the caller's checks name what is wrong with it
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.{os.getpid()}@{_host()}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save({**data, DIGEST_KEY: digest(data)}, f)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache holds public data
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only or full cache folder: the data is still returned
    return data
