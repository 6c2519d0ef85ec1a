"""Atomic writes: a file or folder is built under a temporary name beside its final one and renamed into place,
so a reader, a crash or a second writer never sees it half-written.

A temporary is named ``.STEM.PID@HOST.XXXXXXXX.tmp``: the final name's stem, the writer's process id and host,
and a random part, so two writers never share one and a leftover names the writer that left it (which lets
:func:`kilolayer.data.cache.remove_stale_temporaries` tell a dead writer's file from a live one's). Its data is
flushed to disk (``fsync``) before the rename and the folder after it; on any error the temporary is removed and
the error raised. Permissions are those of a plain ``open``: the process's umask applies.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path


def host() -> str:
    """This machine's name as temporary names carry it (letters, digits and '-')."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64]


def _temporary(path: Path) -> Iterator[Path]:
    """Fresh temporary names beside ``path``."""
    while True:
        yield path.with_name(f".{path.stem}.{os.getpid()}@{host()}.{secrets.token_hex(4)}.tmp")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(path: Path) -> None:
    with contextlib.suppress(OSError):  # a folder that cannot be opened or synced (some file systems)
        _fsync(path)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A new empty file beside ``path`` for a writer that opens files by name (``torch.save``, safetensors):
    when the block ends normally it is synced and renamed to ``path``; when it raises, it is removed."""
    path = Path(path)
    for tmp in _temporary(path):
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """A new empty folder beside ``path``: when the block ends normally its files are synced and it replaces
    ``path`` (a folder already there is removed first); when it raises, it is removed."""
    path = Path(path)
    for tmp in _temporary(path):
        try:
            tmp.mkdir()
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                _fsync(f)
        _fsync_folder(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_folder(path.parent)


def umask() -> int:
    """The process's umask (read without changing it where /proc tells it)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_mode(path: str | Path) -> None:
    """Give the file ``path`` the mode a plain ``open`` would have: for writers that create their files
    private (safetensors writes 0600), so that every file of a run or an export reads alike."""
    os.chmod(path, 0o666 & ~umask())


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` atomically: readers see the old file or the new one."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
