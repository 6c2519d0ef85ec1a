"""How a generating objective picks tokens: the settings of one decoding and the choice of the next token.

``temperature`` 0 is greedy (the most likely token); above 0 the next token is drawn from
``softmax(logits / temperature)``, cut first to the ``top_k`` most likely tokens, then to the smallest set whose
probability reaches ``top_p`` (nucleus sampling). ``beams`` > 1 is beam search, where an objective has it; its
hypotheses are ranked by log-probability / length ** ``length_penalty`` (0 = the plain log-probability).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass

import torch

from kilolayer.errors import ConfigError


@dataclass(frozen=True)
class Decoding:
    """The settings of one decoding (see the module docstring). ``temperature`` None: 1 where ``top_k`` or
    ``top_p`` asks for sampling, else 0 (greedy). ``max_new_tokens`` None: the objective's default. ``seed``
    makes sampling reproducible."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    beams: int = 1
    length_penalty: float = 1.0
    seed: int | None = None

    @classmethod
    def of(cls, settings: dict) -> Decoding:
        """A decoding from keyword ``settings``; one line naming a keyword that is not a field (and the nearest
        one) rather than Python's TypeError."""
        fields = [f.name for f in dataclasses.fields(cls)]
        for key in settings:
            if key not in fields:
                near = difflib.get_close_matches(key, fields, n=1)
                hint = f"; did you mean {near[0]}?" if near else ""
                raise ConfigError(f"{key}: not a decoding setting{hint} (allowed: {', '.join(fields)})")
        return cls(**settings)

    def __post_init__(self):
        kinds = {"max_new_tokens": int, "top_k": int, "beams": int, "seed": int}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            wanted = kinds.get(f.name, float)
            ok = not isinstance(value, bool) and isinstance(value, (int,) if wanted is int else (int, float))
            if not ok:
                raise ConfigError(f"{f.name}={value!r}: expected {'an int' if wanted is int else 'a number'}")
            if wanted is float and not math.isfinite(value):
                raise ConfigError(f"{f.name}={value!r}: expected a finite number")
        checks = (
            ("max_new_tokens", self.max_new_tokens is None or self.max_new_tokens >= 1, "at least 1"),
            ("temperature", self.temperature is None or self.temperature >= 0, "0 (greedy) or more"),
            ("top_k", self.top_k is None or self.top_k >= 1, "at least 1"),
            ("top_p", self.top_p is None or 0 < self.top_p <= 1, "in (0, 1]"),
            ("beams", self.beams >= 1, "at least 1"),
            ("length_penalty", self.length_penalty >= 0, "0 or more"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)}: must be {expected}")
        if self.beams > 1 and self.sampling:
            raise ConfigError(f"beams={self.beams}: beam search is deterministic; leave out temperature/top_k/top_p")

    @property
    def sampling(self) -> bool:
        if self.temperature is None:
            return self.top_k is not None or self.top_p is not None
        return self.temperature > 0

    def generator(self, device) -> torch.Generator | None:
        """The random stream of a sampling decoding: seeded by ``seed``, or None (torch's global one)."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The next token of each row of ``logits`` (B, V): argmax when greedy, else a draw (module docstring)."""
        if not self.sampling:
            return logits.argmax(-1)
        logits = logits.float() / (self.temperature if self.temperature is not None else 1.0)
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token once the more likely ones already reach top_p (the most likely one always stays)
            drop = probs.cumsum(-1) - probs >= self.top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
