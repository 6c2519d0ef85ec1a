"""``synthetic``: seeded sequence-to-sequence tasks (copy, reverse, sort, add), and ``parallel`` text files.

Ids: 0 = PAD, 1 = BOS, 2 = EOS, then the task's symbols. ``add`` uses the
digits 0-9 and "+": "123+45" -> "168".

Evaluation is disjoint from training by construction. The evaluation pairs come from a generator keyed
("eval", seed) and training batch ``step`` from one keyed ("train", seed, step), so the two streams never
share a seed; and since short strings recur in any long stream, a training draw whose source equals an
evaluation source is rejected and drawn again. Each train record logs how many draws were rejected
(``eval_excluded``). The evaluation pairs are distinct, and a configuration whose evaluation inputs could be
half of what training draws or more, at any seed, is refused. A batch depends only on (seed, step),
whatever the world size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from pydantic import ConfigDict, Field, model_validator

from kilolayer.config import NumbersNotBools
from kilolayer.data import vocab
from kilolayer.data.base import Source, register_source
from kilolayer.data.codec import ByteCodec, SymbolCodec
from kilolayer.data.options import parse_options
from kilolayer.data.vocab import BYTE_VOCAB
from kilolayer.errors import ConfigError, InputError

PAD, BOS, EOS, FIRST = 0, 1, 2, 3


class SyntheticOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")
    vocab: int = Field(10, ge=2, le=100_000, description="symbols (copy/reverse/sort)")
    min_len: int = Field(4, ge=1)
    max_len: int = Field(12, ge=1)
    eval_size: int = Field(256, ge=1)

    @model_validator(mode="after")
    def _lens(self):
        if self.min_len > self.max_len:
            raise ValueError(
                f"data.options.min_len={self.min_len}: must not exceed data.options.max_len={self.max_len}"
            )
        return self


def pad_batch(seqs: list[list[int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T) padded with ``pad``, padding mask (B, T) True = padding)."""
    T = max(1, max(len(s) for s in seqs))
    # padded as lists, then one tensor: a copy per row costs more than the batch's data
    ids = torch.tensor([[*s, *[pad] * (T - len(s))] for s in seqs], dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs])
    return ids, torch.arange(T)[None, :] >= lengths[:, None]


def seq2seq_batch(pairs: list[tuple[list[int], list[int]]], bos: int, eos: int, pad: int) -> dict:
    src, src_mask = pad_batch([s for s, _ in pairs], pad)
    tgt_in, tgt_mask = pad_batch([[bos] + t for _, t in pairs], pad)
    tgt_out, _ = pad_batch([t + [eos] for _, t in pairs], pad)
    return {
        "src": src,
        "src_padding_mask": src_mask,
        "tgt_in": tgt_in,
        "tgt_out": tgt_out,
        "tgt_padding_mask": tgt_mask,
    }


class Seq2SeqSource(Source):
    """Shared by synthetic tasks and parallel files: pairs of id lists, batched with BOS/EOS/PAD.

    ``baselines`` names the predictors that do not translate which a model's decoding is scored beside
    (:mod:`kilolayer.objectives.baselines`): on symbol tasks the source copied and the reference's tokens shuffled;
    a source with a training split of its own (:meth:`train_pairs`) names the source copied and the nearest
    training pair's target instead."""

    bos, eos, pad = BOS, EOS, PAD
    baselines: tuple[str, ...] = ("copy", "shuffle")

    def train_pairs(self) -> list[tuple[list[int], list[int]]] | None:
        """The training split's pairs, where it is a list (the nearest-neighbour baseline searches it); None for a
        stream drawn step by step."""
        return None

    def batch_of(self, pairs) -> dict:
        return seq2seq_batch(pairs, self.bos, self.eos, self.pad)

    def detokenize(self, ids) -> str:
        """A readable string of output ids (stops at EOS), for BLEU and samples."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos:
                break
            if i not in (self.bos, self.pad):
                out.append(self.symbol(i))
        return self.joiner.join(out)

    joiner = " "

    def symbol(self, i: int) -> str:
        return str(i - FIRST)

    def codec(self):
        """Text to ids and back: the task's symbols, those :meth:`detokenize` writes."""
        symbols = {i: self.symbol(i) for i in range(FIRST, self.vocab_size)}
        return SymbolCodec(symbols, self.joiner, bos=self.bos, eos=self.eos, pad=self.pad)


def stream(*key) -> torch.Generator:
    """A generator seeded by a hash of ``key``: streams with different keys (the evaluation set, each training
    step) do not share a seed."""
    digest = hashlib.blake2b(repr(("kilolayer.synthetic", *key)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


MAX_HELD_OUT = 0.5  # the largest share of training draws the evaluation inputs may take (its bound, any seed)


class Synthetic(Seq2SeqSource):
    def __init__(self, task: str, opts: SyntheticOptions, seed: int):
        super().__init__(seed)
        self.task, self.opts = task, opts
        self.vocab = 11 if task == "add" else opts.vocab
        bound = self.held_out_bound()
        if bound >= MAX_HELD_OUT:
            raise ConfigError(
                f"data.options.eval_size={opts.eval_size}: evaluation inputs could be up to {bound:.0%} of what "
                f"data.task={task!r} draws for training; lower eval_size or widen vocab/min_len/max_len"
            )
        # distinct evaluation pairs (a pair's target is a function of its source): each is scored once
        g, self.eval_pairs, self.held_out = stream("eval", seed), [], set()
        while len(self.eval_pairs) < opts.eval_size:
            pair = self.example(g)
            if tuple(pair[0]) not in self.held_out:
                self.held_out.add(tuple(pair[0]))
                self.eval_pairs.append(pair)
        self.excluded: dict[int, int] = {}  # step -> training draws rejected as evaluation pairs
        self.batch_size = 0  # of the last training batch drawn (to recount a step's rejections)

    def _lengths(self) -> list[tuple[int, int]]:
        """(inputs a length can draw, their count) per length: V^n strings; for add, 10^k x 10^max(1, n-k) pairs
        of numbers, k = max(1, n // 2)."""
        out = []
        for n in range(self.opts.min_len, self.opts.max_len + 1):
            k = max(1, n // 2)
            out.append((n, 10**k * 10 ** max(1, n - k) if self.task == "add" else self.vocab**n))
        return out

    def held_out_bound(self) -> float:
        """An upper bound, whatever the seed, on the probability that one training draw equals one of
        ``eval_size`` distinct evaluation inputs: a length n is drawn with probability 1/L and then each of its
        inputs equally, so at most min(eval_size, count_n) / count_n of it is held out."""
        lengths = self._lengths()
        return sum(min(self.opts.eval_size, count) / count for _, count in lengths) / len(lengths)

    def held_out_share(self) -> float:
        """The probability that one training draw equals an evaluation input (before rejection)."""
        o = self.opts
        lengths = range(o.min_len, o.max_len + 1)
        total = 0.0
        for x in self.held_out:
            if self.task != "add":
                total += self.vocab ** -len(x) / len(lengths)
                continue
            plus = x.index(FIRST + 10)
            a = int("".join(str(i - FIRST) for i in x[:plus]))
            b = int("".join(str(i - FIRST) for i in x[plus + 1 :]))
            for n in lengths:  # add draws a below 10^k and b below 10^max(1, n-k), k = max(1, n//2)
                k = max(1, n // 2)
                ka, kb = 10**k, 10 ** max(1, n - k)
                if a < ka and b < kb:
                    total += 1 / (ka * kb * len(lengths))
        return total

    @property
    def vocab_size(self) -> int:
        return FIRST + self.vocab

    def symbol(self, i: int) -> str:
        return "+" if self.task == "add" and i == FIRST + 10 else str(i - FIRST)

    def example(self, g: torch.Generator) -> tuple[list[int], list[int]]:
        o = self.opts
        n = int(torch.randint(o.min_len, o.max_len + 1, (1,), generator=g))
        if self.task == "add":
            # two numbers whose digits total n (each at least 1 digit)
            k = max(1, n // 2)
            a = int(torch.randint(0, 10**k, (1,), generator=g))
            b = int(torch.randint(0, 10 ** max(1, n - k), (1,), generator=g))
            digits = lambda v: [FIRST + int(c) for c in str(v)]
            return digits(a) + [FIRST + 10] + digits(b), digits(a + b)
        x = (torch.randint(0, self.vocab, (n,), generator=g) + FIRST).tolist()
        y = {"copy": x, "reverse": x[::-1], "sort": sorted(x)}[self.task]
        return x, list(y)

    def __len__(self) -> int:
        return 1 << 62  # an endless stream

    @property
    def eval_size(self) -> int:
        return len(self.eval_pairs)

    def train_batch(self, step: int, batch_size: int, rank: int = 0, world: int = 1) -> dict:
        # draw the global batch, then take this process's share: the same data whatever the world size
        g = stream("train", self.seed, step)
        pairs, rejected = [], 0
        while len(pairs) < batch_size:
            pair = self.example(g)
            if tuple(pair[0]) in self.held_out:
                rejected += 1
            else:
                pairs.append(pair)
        self.excluded[step], self.batch_size = rejected, batch_size
        while len(self.excluded) > 4096:  # a process that never logs keeps a bounded record
            del self.excluded[next(iter(self.excluded))]
        per = batch_size // world
        return self.batch_of(pairs[rank * per : (rank + 1) * per])

    def log_fields(self, since: int, step: int) -> dict:
        """``eval_excluded``: training draws rejected as evaluation inputs in batches ``since .. step - 1``, those
        this process did not draw (before a resume) drawn again to count them."""
        for s in range(since, step):
            if s not in self.excluded and self.batch_size:
                self.train_batch(s, self.batch_size)
        fields = {"eval_excluded": sum(self.excluded.get(s, 0) for s in range(since, step))}
        self.excluded = {s: n for s, n in self.excluded.items() if s >= step}
        return fields

    def collate(self, indices, split):
        return self.batch_of([self.eval_pairs[i] for i in indices])


def _check_fits(config, vocab_size: int, longest: int, what: str) -> None:
    m = config.model
    if m.arch != "encoder_decoder":
        raise ConfigError(f"model.arch={m.arch!r}: {what} needs an encoder_decoder")
    if m.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size}: {what} needs at least {vocab_size}")
    if m.max_len < longest:
        raise ConfigError(f"model.max_len={m.max_len}: {what} has sequences of up to {longest} tokens")


@register_source("synthetic", reads=("task",))
def synthetic(config) -> Synthetic:
    opts = parse_options(SyntheticOptions, config.data.options, "data.options")
    src = Synthetic(config.data.task, opts, config.train.seed)
    longest = 2 * opts.max_len + 2 if config.data.task == "add" else opts.max_len + 1
    _check_fits(config, src.vocab_size, longest, f"data.task={config.data.task!r}")
    return src


class ParallelFilesOptions(NumbersNotBools):
    """``data.options`` of the ``parallel`` source: a user's two text files, aligned line by line."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field(..., description="source-language file, one sentence per line")
    target: str = Field(..., description="target-language file, aligned line by line")
    valid_percent: int = Field(5, ge=1, le=50)
    max_len: int = Field(0, ge=0, description="drop pairs longer than this many bytes (0 = model.max_len - 1)")


class Parallel(Seq2SeqSource):
    """Byte-level parallel text: ids are bytes; PAD/BOS/EOS from the shared byte vocabulary."""

    bos, eos, pad = vocab.BOS, vocab.EOS, vocab.PAD
    joiner = ""
    baselines = ("copy", "nearest")

    def __init__(self, pairs, valid_percent: int, seed: int):
        super().__init__(seed)
        cut = max(1, len(pairs) * valid_percent // 100)
        self.valid, self.train = pairs[:cut], pairs[cut:]
        if not self.train:
            raise InputError("parallel data: too few sentence pairs for a train and a validation split")

    def symbol(self, i: int) -> str:
        return bytes([i]).decode("latin-1")

    def codec(self):
        return ByteCodec(self.bos, self.eos, self.pad)

    def detokenize(self, ids) -> str:
        raw = bytes(
            int(i)
            for i in ids[: next((k for k, i in enumerate(ids) if int(i) == self.eos), len(ids))]
            if 0 <= int(i) < 256
        )
        return raw.decode("utf-8", errors="replace")

    def __len__(self):
        return len(self.train)

    def train_pairs(self):
        return self.train

    @property
    def eval_size(self):
        return len(self.valid)

    def collate(self, indices, split):
        data = self.train if split == "train" else self.valid
        return self.batch_of([data[i] for i in indices])


def _read_lines(path: str) -> list[str]:
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{p}: cannot read as UTF-8 text ({err.__class__.__name__})") from None


@register_source("parallel", path_options=("source", "target"))
def parallel(config) -> Parallel:
    """A user's parallel text: ``data.options.source`` and ``data.options.target``, aligned line by line."""
    opts = parse_options(ParallelFilesOptions, config.data.options, "data.options")
    src, tgt = _read_lines(opts.source), _read_lines(opts.target)
    if len(src) != len(tgt):
        raise InputError(f"{opts.target}: {len(tgt)} lines, but {opts.source} has {len(src)}; files must be aligned")
    limit = opts.max_len or config.model.max_len - 1
    pairs = [(list(s.encode()), list(t.encode())) for s, t in zip(src, tgt) if s.strip() and t.strip()]
    pairs = [(s, t) for s, t in pairs if len(s) <= limit and len(t) <= limit]
    if len(pairs) < 2:
        raise InputError(f"{opts.source}: fewer than 2 non-empty sentence pairs of at most {limit} bytes")
    _check_fits(config, BYTE_VOCAB, limit + 1, "parallel data")
    return Parallel(pairs, opts.valid_percent, config.train.seed)
