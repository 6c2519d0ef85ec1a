"""``stdlib_bytes``: Python's own standard-library source files as a real byte-level corpus.

Files are split into train/validation by a hash of their relative path (so the
split never changes between runs or machines with the same Python), then each
split is one long byte string. A training sample is a random window drawn by a
generator seeded with (seed, step, rank); the evaluation set is fixed windows
spread evenly over the validation bytes.
"""

from __future__ import annotations

import sysconfig
import zlib
from functools import lru_cache
from pathlib import Path

import torch
from pydantic import ConfigDict, Field

from kilolayer.config import NumbersNotBools
from kilolayer.data.base import Source, register_source
from kilolayer.data.vocab import BYTE_VOCAB
from kilolayer.errors import ConfigError, InputError


class StdlibOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")
    seq_len: int = Field(0, ge=0, description="window length; 0 = model.max_len - 1")
    max_bytes: int = Field(0, ge=0, description="cap on corpus bytes per split (0 = all)")
    eval_windows: int = Field(256, ge=1)
    valid_percent: int = Field(10, ge=1, le=50)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=4)
def stdlib_corpus(valid_percent: int = 10) -> tuple[bytes, bytes, int]:
    """(train bytes, validation bytes, number of files). Test suites and site-packages are left out."""
    root = stdlib_dir()
    train, valid, n = [], [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "test/", "idlelib/idle_test/")) or "/tests/" in rel:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        n += 1
        (valid if zlib.crc32(rel.encode()) % 100 < valid_percent else train).append(data)
    return b"\n".join(train), b"\n".join(valid), n


class WindowSource(Source):
    """Windows of ``seq_len + 1`` tokens of a stream, training ones at random offsets of ``self.train``
    (``len(self)`` offsets)."""

    train: torch.Tensor
    seq_len: int

    def _windows(self, stream: torch.Tensor, starts) -> dict:
        idx = torch.as_tensor(starts, dtype=torch.long)[:, None] + torch.arange(self.seq_len + 1)[None, :]
        return {"tokens": stream[idx].long()}

    def train_batch(self, step: int, batch_size: int, rank: int = 0, world: int = 1) -> dict:
        # draw the global batch, then take this process's share: the same data whatever the world size
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self), (batch_size,), generator=g)
        per = batch_size // world
        return self._windows(self.train, starts[rank * per : (rank + 1) * per])


class ByteWindows(WindowSource):
    """Random windows of ``seq_len + 1`` bytes from a train byte string; fixed windows for evaluation."""

    def __init__(self, train: bytes, valid: bytes, seq_len: int, eval_windows: int, seed: int, where: str):
        super().__init__(seed)
        if len(train) <= seq_len + 1 or len(valid) <= seq_len + 1:
            raise InputError(
                f"{where}: corpus too small for windows of {seq_len + 1} bytes "
                f"(train {len(train)} bytes, validation {len(valid)} bytes)"
            )
        self.train = torch.frombuffer(bytearray(train), dtype=torch.uint8)
        self.valid = torch.frombuffer(bytearray(valid), dtype=torch.uint8)
        self.seq_len = seq_len
        span = len(valid) - seq_len - 1
        count = min(eval_windows, span)
        self.eval_starts = [i * span // count for i in range(count)]

    def __len__(self) -> int:
        return len(self.train) - self.seq_len - 1

    @property
    def eval_size(self) -> int:
        return len(self.eval_starts)

    def collate(self, indices: list[int], split: str) -> dict:
        if split == "train":
            return self._windows(self.train, indices)
        return self._windows(self.valid, [self.eval_starts[i] for i in indices])

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the training bytes' unigram distribution: the loss of the best context-free model."""
        p = torch.bincount(self.train.long(), minlength=256).double()
        p = p[p > 0] / p.sum()
        return float(-(p * p.log()).sum())


def byte_window_len(config, opts_len: int) -> int:
    seq = opts_len or config.model.max_len - 1
    if seq + 1 > config.model.max_len + 1 or seq < 1:
        raise ConfigError(f"data.options.seq_len={seq}: must be between 1 and model.max_len={config.model.max_len}")
    if config.model.vocab_size < BYTE_VOCAB:
        raise ConfigError(f"model.vocab_size={config.model.vocab_size}: byte data needs at least {BYTE_VOCAB}")
    return seq


@register_source("stdlib_bytes")
def stdlib_bytes(config) -> ByteWindows:
    from kilolayer.data.options import parse_options

    opts = parse_options(StdlibOptions, config.data.options, "data.options")
    seq = byte_window_len(config, opts.seq_len)
    train, valid, _ = stdlib_corpus(opts.valid_percent)
    train, valid = capped(train, valid, opts.max_bytes, seq)
    return ByteWindows(train, valid, seq, opts.eval_windows, config.train.seed, f"stdlib ({stdlib_dir()})")


def capped(train: bytes, valid: bytes, max_bytes: int, seq: int) -> tuple[bytes, bytes]:
    """``data.options.max_bytes``: the first ``max_bytes`` of the training bytes and an eighth as many of the
    validation bytes (at least four windows); 0 keeps all."""
    if not max_bytes:
        return train, valid
    return train[:max_bytes], valid[: max(max_bytes // 8, 4 * (seq + 1))]


@register_source("text_bytes", reads=("path",))
def text_bytes(config) -> ByteWindows:
    """A user's text file (``data.path``) as a byte corpus: its first (100 - ``valid_percent``)% of bytes train, the
    rest is validation (there is no test split)."""
    from kilolayer.data.options import parse_options

    opts = parse_options(StdlibOptions, config.data.options, "data.options")
    seq = byte_window_len(config, opts.seq_len)
    if not config.data.path:
        raise ConfigError("data.path: text_bytes needs a text file")
    p = Path(config.data.path)
    if not p.exists():
        raise InputError(f"{p}: no such file (data.path)")
    try:
        data = p.read_bytes()
    except OSError as err:
        raise InputError(f"{p}: cannot read ({err.strerror or err.__class__.__name__}; data.path)") from None
    if not data.strip():
        raise InputError(f"{p}: the file is empty")
    cut = len(data) * (100 - opts.valid_percent) // 100
    train, valid = capped(data[:cut], data[cut:], opts.max_bytes, seq)
    return ByteWindows(train, valid, seq, opts.eval_windows, config.train.seed, str(p))
