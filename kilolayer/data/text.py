"""A user's text file, one sample per line, as byte tokens or through a local Hugging Face tokenizer.

``data.name: text`` with ``data.path: FILE``. Batches are ``{"tokens": long
(B, T), "padding_mask": bool (B, T)}`` (True = padding), plus ``labels`` when
``data.options.labels`` is true and each line reads ``label<TAB>text`` (class
ids follow the sorted label names). Empty lines are skipped. Tokens are bytes
(ids 0-255, special ids from :mod:`kilolayer.data.vocab`, so
``model.vocab_size`` must be at least 262) unless ``data.options.tokenizer``
names a local tokenizer directory. Samples longer than ``max_len`` (default
``model.max_len``) are cut. ``add_cls`` puts the CLS id first, for
``objective.options.pool: cls``. Splits as in :mod:`kilolayer.data.memory`
(stratified by label when there are labels).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from pydantic import Field

from kilolayer.config import Config
from kilolayer.data import vocab
from kilolayer.data.base import SOURCES, register_source
from kilolayer.data.codec import ByteCodec, Codec, HFCodec
from kilolayer.data.memory import MemorySource, SplitOptions, split_indices
from kilolayer.data.options import parse_options
from kilolayer.errors import ConfigError, InputError


class ByteTokenizer:
    """UTF-8 bytes plus the special ids of :mod:`kilolayer.data.vocab`."""

    name = "bytes"
    vocab_size = vocab.BYTE_VOCAB
    pad_id, mask_id, cls_id = vocab.PAD, vocab.MASK, vocab.CLS
    special_ids = (vocab.PAD, vocab.BOS, vocab.EOS, vocab.MASK, vocab.CLS, vocab.SEP)
    random_high = 256  # MLM's random replacements are real bytes

    def encode(self, text: str | bytes) -> list[int]:
        return list(text) if isinstance(text, bytes) else vocab.encode(text)

    def codec(self) -> ByteCodec:
        return ByteCodec()


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (no hub access)."""

    def __init__(self, path: str):
        p = Path(path)
        if not p.is_dir():
            raise InputError(f"{p}: no such tokenizer directory (data.options.tokenizer)")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError(
                "data.options.tokenizer needs Hugging Face transformers: pip install 'kilolayer[hf]'"
            ) from None
        try:
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
        except Exception as err:  # transformers raises many kinds; the user needs the path and the kind
            raise InputError(f"{p}: cannot load a Hugging Face tokenizer ({type(err).__name__})") from None
        self.name = str(p)
        self.tok = tok
        self.vocab_size = len(tok)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.mask_id = tok.mask_token_id
        self.cls_id = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
        self.special_ids = tuple(tok.all_special_ids)
        self.random_high = self.vocab_size

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tok.encode(text, add_special_tokens=False)

    def codec(self) -> HFCodec:
        return HFCodec(self.tok, eos=self.tok.eos_token_id, pad=self.pad_id)


@lru_cache(maxsize=8)
def _hf_tokenizer(path: str) -> HFTokenizer:
    return HFTokenizer(path)


def make_tokenizer(path: str | None = None) -> ByteTokenizer | HFTokenizer:
    """Bytes, or the Hugging Face tokenizer in the local directory ``path``."""
    return ByteTokenizer() if not path else _hf_tokenizer(str(path))


def tokenizer_for(config: Config):
    """The tokenizer that ``config``'s data source uses: the source's own (e.g. PTB's words, given by a
    ``tokenizer(config)`` attribute of its registered function), else ``data.options.tokenizer``, else bytes."""
    own = getattr(SOURCES.get(config.data.name), "tokenizer", None)
    return own(config) if own is not None else make_tokenizer(config.data.options.get("tokenizer"))


def codec_for(config: Config, source) -> Codec | None:
    """The codec (text to ids and back) of ``config``'s data: a sequence-to-sequence ``source``'s own, else, for
    a model reading tokens, its tokenizer's (:func:`tokenizer_for`); None for a model of images, and for token
    data with no text vocabulary (a source without a codec or tokenizer of its own whose model's vocabulary is too
    small for byte tokens, e.g. symbols drawn at random: its ids are not the bytes of any text)."""
    if hasattr(source, "codec"):
        return source.codec()
    if config.model.input != "tokens":
        return None
    tok = tokenizer_for(config)
    if tok.name == "bytes" and config.model.vocab_size < tok.vocab_size:
        return None
    return tok.codec()


def check_vocab(size: int, tok, field: str = "model.vocab_size") -> None:
    """One line if a vocabulary of ``size`` (the config value at ``field``) cannot hold ``tok``'s ids."""
    if size < tok.vocab_size:
        what = "byte tokens with special ids" if tok.name == "bytes" else f"the tokenizer in {tok.name}"
        raise ConfigError(f"{field}={size}: {what} need at least {tok.vocab_size}")


class TextOptions(SplitOptions):
    tokenizer: str | None = None
    labels: bool = False
    max_len: int | None = Field(None, ge=1)
    add_cls: bool = False


def read_lines(path: str | Path, labelled: bool, tokenizer) -> tuple[list[bytes | str], list[str]]:
    """(texts, labels) of the non-empty lines of ``path``; one clear line on any problem."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such file (data.path)")
    try:
        raw = p.read_bytes()
    except OSError as err:
        raise InputError(f"{p}: cannot read ({err.strerror or type(err).__name__})") from None
    if tokenizer.name != "bytes":
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"{p}: not UTF-8 text (bad byte at offset {err.start})") from None
    texts, labels = [], []
    for n, line in enumerate(raw.split(b"\n"), 1):
        line = line.rstrip(b"\r")
        if not line.strip():
            continue
        if labelled:
            if b"\t" not in line:
                raise InputError(f"{p}:{n}: expected label<TAB>text (data.options.labels is true)")
            label, line = line.split(b"\t", 1)
            labels.append(label.decode("utf-8", errors="replace").strip())
        texts.append(line if tokenizer.name == "bytes" else line.decode("utf-8"))
    if not texts:
        raise InputError(f"{p}: no samples (every line is empty)")
    return texts, labels


def encode_all(texts, tokenizer, max_len: int, add_cls: bool) -> list[list[int]]:
    out = []
    for t in texts:
        ids = tokenizer.encode(t)
        if add_cls:
            ids = [tokenizer.cls_id] + ids
        out.append(ids[:max_len])
    return out


def label_ids(labels: list) -> tuple[torch.Tensor, list]:
    """Class ids by sorted label value, and the sorted names."""
    names = sorted(set(labels))
    index = {name: i for i, name in enumerate(names)}
    return torch.as_tensor([index[x] for x in labels], dtype=torch.long), names


@register_source("text", reads=("path",), path_options=("tokenizer",))
def text(config: Config) -> MemorySource:
    opts = parse_options(TextOptions, config.data.options, "data.options")
    m = config.model
    if m.input != "tokens":
        raise ConfigError(f"model.input={m.input!r}: data.name='text' gives tokens; set model.input: tokens")
    if config.data.path is None:
        raise ConfigError("data.path: data.name='text' needs a text file, one sample per line")
    tok = make_tokenizer(opts.tokenizer)
    check_vocab(m.vocab_size, tok)
    if tok.cls_id is None and opts.add_cls:
        raise ConfigError(f"data.options.add_cls: the tokenizer in {tok.name} has no CLS or BOS token")
    max_len = opts.max_len or m.max_len
    if max_len > m.max_len:
        raise ConfigError(f"data.options.max_len={max_len}: longer than model.max_len={m.max_len}")
    texts, names = read_lines(config.data.path, opts.labels, tok)
    columns: dict = {"tokens": encode_all(texts, tok, max_len, opts.add_cls)}
    labels, classes = label_ids(names) if opts.labels else (None, None)
    if labels is not None:
        columns["labels"] = labels
    splits = split_indices(len(texts), opts.split_seed, opts.val_fraction, opts.test_fraction, labels)
    source = MemorySource(
        config.train.seed,
        columns,
        splits,
        opts.eval_split,
        pad_id=tok.pad_id,
        num_classes=len(classes) if classes else None,
        where=f"data.path={config.data.path}",
    )
    source.classes = classes
    return source


# ---------------------------------------------------------------- built-in labelled text

STDLIB_PACKAGES = ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "unittest", "xml")


class StdlibPackagesOptions(SplitOptions):
    packages: list[str] = Field(default_factory=lambda: list(STDLIB_PACKAGES), min_length=2)
    seq_len: int | None = Field(None, ge=1, description="window length in bytes; default model.max_len")
    max_per_class: int = Field(1000, ge=3)
    add_cls: bool = False


def package_bytes(package: str) -> bytes:
    """The source files of a standard-library package (its tests left out), joined in path order."""
    from kilolayer.data.stdlib import stdlib_dir

    root = stdlib_dir() / package
    if not root.is_dir():
        raise ConfigError(f"data.options.packages: {package!r} is not a standard-library package ({root})")
    parts = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("test/", "tests/")) or "/test/" in rel or "/tests/" in rel:
            continue
        try:
            parts.append(path.read_bytes())
        except OSError:
            continue
    return b"\n".join(parts)


@register_source("stdlib_packages")
def stdlib_packages(config: Config) -> MemorySource:
    """Sequence classification on real text: which standard-library package a byte window comes from.

    Each package's files are cut into non-overlapping windows of ``seq_len`` bytes; up to
    ``max_per_class`` windows per package are drawn (seeded by ``split_seed``) and split
    stratified by package. Batches: ``{"tokens", "padding_mask", "labels"}``.
    """
    opts = parse_options(StdlibPackagesOptions, config.data.options, "data.options")
    m = config.model
    if m.input != "tokens":
        raise ConfigError(f"model.input={m.input!r}: data.name='stdlib_packages' gives tokens; set model.input: tokens")
    tok = ByteTokenizer()
    check_vocab(m.vocab_size, tok)
    seq = opts.seq_len or m.max_len - int(opts.add_cls)
    if seq + int(opts.add_cls) > m.max_len:
        raise ConfigError(f"data.options.seq_len={seq}: longer than model.max_len={m.max_len}")
    g = torch.Generator().manual_seed(opts.split_seed)
    windows, labels = [], []
    for c, package in enumerate(opts.packages):
        data = package_bytes(package)
        n = len(data) // seq
        if n < 3:
            raise ConfigError(f"data.options.packages: {package!r} has too little source for windows of {seq} bytes")
        for k in torch.randperm(n, generator=g)[: opts.max_per_class].sort().values.tolist():
            ids = list(data[k * seq : (k + 1) * seq])
            windows.append([tok.cls_id] + ids if opts.add_cls else ids)
            labels.append(c)
    y = torch.as_tensor(labels, dtype=torch.long)
    splits = split_indices(len(y), opts.split_seed, opts.val_fraction, opts.test_fraction, y)
    source = MemorySource(
        config.train.seed,
        {"tokens": windows, "labels": y},
        splits,
        opts.eval_split,
        pad_id=tok.pad_id,
        num_classes=len(opts.packages),
        where="data.name='stdlib_packages'",
    )
    source.classes = list(opts.packages)
    return source
