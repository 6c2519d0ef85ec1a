"""``causal_lm``: next-token prediction (GPT/OPT) — a token-level objective.

Batches hold ``tokens`` (B, T+1); the model reads tokens[:, :-1] and predicts
tokens[:, 1:]. Positions whose target is padding carry no loss. It takes no ``objective.options``.
It generates: greedily or by sampling (:mod:`kilolayer.objectives.decoding`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import ConfigDict
from torch import nn

from kilolayer.config import NumbersNotBools
from kilolayer.data.base import Source
from kilolayer.data.options import parse_options
from kilolayer.errors import ConfigError, InputError
from kilolayer.objectives.base import Objective, register_objective
from kilolayer.objectives.decoding import Decoding


class CausalLMOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")  # none: a stray key is a one-line error, not silently ignored


@register_objective
class CausalLM(Objective):
    name = "causal_lm"
    metrics = ("loss", "bits_per_token")
    archs = ("decoder",)

    def __init__(self, config, backbone, source: Source | None):
        super().__init__(config, backbone, source)
        parse_options(CausalLMOptions, config.objective.options, "objective.options")
        m = config.model
        self.head = nn.Linear(m.width, m.vocab_size, bias=False)
        nn.init.normal_(self.head.weight, std=m.width**-0.5)

    def _split(self, batch):
        tokens = batch["tokens"]
        pad = batch.get("padding_mask")
        x, y = tokens[:, :-1], tokens[:, 1:]
        in_pad = pad[:, :-1] if pad is not None else None
        valid = ~pad[:, 1:] if pad is not None else None
        return x, y, in_pad, valid

    def forward(self, backbone, batch):
        x, y, in_pad, valid = self._split(batch)
        h = backbone(x, padding_mask=in_pad)
        logits = self.head(h).float()
        if valid is not None:
            y = y.masked_fill(~valid, -100)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        return loss, {}

    @torch.no_grad()
    def evaluate(self, backbone, batches):
        out = super().evaluate(backbone, batches)
        out["bits_per_token"] = out["loss"] / math.log(2)
        return out

    @torch.no_grad()
    def generate(
        self, backbone, prompt: list[int], decoding: Decoding, bos: int | None = None, eos: int | None = None
    ) -> list[int]:
        """The ids that follow ``prompt`` (at least one id): up to ``decoding.max_new_tokens`` (default 64), ending
        before ``eos`` if it is drawn (``bos`` is not used: the prompt is the start). The model reads the last
        ``model.max_len`` ids, the positions it knows."""
        if not prompt:
            raise InputError("prompt: gives no tokens; a causal LM continues at least one")
        if decoding.beams > 1:
            raise ConfigError(f"beams={decoding.beams}: causal_lm decodes greedily or by sampling, not by beam search")
        device = self.head.weight.device
        ids = torch.as_tensor([prompt], dtype=torch.long, device=device)
        generator, out = decoding.generator(device), []
        for _ in range(decoding.max_new_tokens or 64):
            h = backbone(ids[:, -self.config.model.max_len :])
            nxt = decoding.pick(self.head(h[:, -1]), generator)
            if eos is not None and int(nxt) == eos:
                break
            out.append(int(nxt))
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        return out

    def represent(self, backbone, batch):
        x, _, in_pad, _ = self._split(batch)
        return backbone(x, padding_mask=in_pad)

    def analysis_inputs(self, batch):
        x, _, in_pad, _ = self._split(batch)
        return {"tokens": x, "padding_mask": in_pad}, in_pad

    def eval_targets(self, batch, index):
        _, y, _, valid = self._split(batch)
        return y[valid] if valid is not None else y.reshape(-1)

    def tokens(self, batch):
        _, _, _, valid = self._split(batch)
        x = batch["tokens"]
        return int(valid.sum()) if valid is not None else x.shape[0] * (x.shape[1] - 1)
