"""``repeat``: for a causal LM, each sequence is ``half`` random tokens followed by the same tokens again.

The first half cannot be predicted (its loss stays at ln(vocab)); each token of the second half is the token
``half`` positions back, so a model that has learnt to attend there predicts it exactly. A perfect model's mean
loss over the sequence's ``2 * half - 1`` predictions is ``(half - 1) * ln(vocab) / (2 * half - 1)``.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from kilolayer.data.base import Source
from kilolayer.data.options import parse_options
from kilolayer.errors import ConfigError


class RepeatOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    vocab: int = Field(16, ge=2, le=65_536)
    half: int = Field(8, ge=1, le=4096, description="random tokens, then the same again (a sequence of 2 * half)")
    train_size: int = Field(4096, ge=1, le=1_000_000)
    eval_size: int = Field(128, ge=1, le=1_000_000)


class Repeat(Source):
    def __init__(self, opts: RepeatOptions, seed: int):
        super().__init__(seed)
        self.opts = opts

    def __len__(self) -> int:
        return self.opts.train_size

    @property
    def eval_size(self) -> int:
        return self.opts.eval_size

    def example(self, index: int, split: str) -> torch.Tensor:
        # one generator per (seed, split, index): an example does not depend on the batch it is drawn in
        stream = 2 * self.seed + (split == "eval")
        g = torch.Generator().manual_seed(stream * 1_000_003 + index)
        first = torch.randint(0, self.opts.vocab, (self.opts.half,), generator=g)
        return torch.cat([first, first])

    def collate(self, indices: list[int], split: str) -> dict:
        return {"tokens": torch.stack([self.example(i, split) for i in indices])}


def repeat(config) -> Repeat:
    """The ``repeat`` source for ``config`` (``data.options``: vocab, half, train_size, eval_size)."""
    opts = parse_options(RepeatOptions, config.data.options, "data.options")
    m = config.model
    if m.vocab_size < opts.vocab:
        raise ConfigError(f"model.vocab_size={m.vocab_size}: data.name='repeat' needs at least {opts.vocab}")
    if m.max_len < 2 * opts.half:
        raise ConfigError(f"model.max_len={m.max_len}: data.name='repeat' has sequences of {2 * opts.half} tokens")
    return Repeat(opts, config.train.seed)
