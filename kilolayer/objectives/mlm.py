"""Masked-token prediction (BERT): a token-level objective for an encoder over tokens.

Each non-padding, non-special token is selected with probability
``mask_prob`` (0.15); a selected token is replaced by the MASK id with
probability ``mask_fraction`` (0.8), by a random token with probability
``random_fraction`` (0.1), else kept. The head (dense, GELU, LayerNorm,
vocabulary projection, as BERT) predicts the original token at the selected
positions only; unselected positions carry no loss. Every sample selects at
least one token when it has any candidate (its smallest draw), as BERT's
``max(1, ...)`` per sequence.

Training masks are drawn on the CPU keyed by ``train.seed`` and each sample's
index in the run's sample stream
(:func:`~kilolayer.objectives.common.keyed_bits`), so a sample is masked the
same way at any number of processes or micro-batches, on a resume, and on CPU
and GPU; evaluation uses fixed generators, the same masks at every evaluation.
Ids: by default those of the data source's tokenizer
(``data.options.tokenizer``, else bytes with MASK = 259 from
:mod:`kilolayer.data.vocab`); random replacements are drawn from
``[0, random_high)`` (the 256 byte values for byte data). Evaluation reports
``loss`` and ``accuracy`` over selected tokens.

Batch: ``{"tokens": long (B, T), "padding_mask": bool (B, T)}`` (``inputs`` is
accepted for ``tokens``; no padding mask means no padding).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field
from torch import nn

from kilolayer.config import NumbersNotBools
from kilolayer.data.base import Source
from kilolayer.data.options import parse_options
from kilolayer.data.text import tokenizer_for
from kilolayer.errors import ConfigError
from kilolayer.objectives.base import Objective, batch_size, head_weights, register_objective
from kilolayer.objectives.common import (
    batch_inputs,
    eval_generator,
    keyed_bits,
    keyed_uniform,
    sample_keys,
    token_count,
)

IGNORE = -100
DRAWN = "mlm_drawn"  # the batch key under which :meth:`MLM.prepare` leaves the step's masking


def selected(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat indices of the positions ``targets`` scores, i.e. not ``IGNORE``; the ids there)."""
    flat = targets.reshape(-1)
    index = (flat != IGNORE).nonzero().squeeze(1)
    return index, flat.index_select(0, index)


class MLMOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")

    mask_prob: float = Field(0.15, gt=0.0, le=1.0)
    mask_fraction: float = Field(0.8, ge=0.0, le=1.0)
    random_fraction: float = Field(0.1, ge=0.0, le=1.0)
    mask_id: int | None = Field(None, ge=0, description="default: the data tokenizer's MASK id")
    random_high: int | None = Field(None, ge=1, description="random replacements come from [0, random_high)")
    special_ids: list[int] | None = Field(None, description="ids never selected; default: the tokenizer's")


@register_objective
class MLM(Objective):
    name = "mlm"
    metrics = ("loss", "accuracy")
    archs = ("encoder",)

    def __init__(self, config, backbone: nn.Module, source: Source | None):
        super().__init__(config, backbone, source)
        opts = parse_options(MLMOptions, config.objective.options, "objective.options")
        m = backbone.config
        if m.input != "tokens":
            raise ConfigError(f"model.input={m.input!r}: mlm predicts tokens; set model.input: tokens")
        if opts.mask_fraction + opts.random_fraction > 1.0:
            raise ConfigError(
                f"objective.options.random_fraction={opts.random_fraction}: mask_fraction + random_fraction "
                f"= {opts.mask_fraction + opts.random_fraction:g} exceeds 1"
            )
        needs_tokenizer = opts.mask_id is None or opts.random_high is None or opts.special_ids is None
        tok = tokenizer_for(config) if needs_tokenizer else None
        self.mask_id = opts.mask_id if opts.mask_id is not None else tok.mask_id
        if self.mask_id is None:
            raise ConfigError(f"objective.options.mask_id: required; the tokenizer in {tok.name} has no mask token")
        self.random_high = opts.random_high if opts.random_high is not None else tok.random_high
        specials = opts.special_ids if opts.special_ids is not None else tok.special_ids
        V = m.vocab_size
        if self.mask_id >= V:
            raise ConfigError(f"objective.options.mask_id={self.mask_id}: outside model.vocab_size={V}")
        if self.random_high > V:
            raise ConfigError(f"objective.options.random_high={self.random_high}: exceeds model.vocab_size={V}")
        self.mask_prob, self.mask_fraction, self.random_fraction = (
            opts.mask_prob,
            opts.mask_fraction,
            opts.random_fraction,
        )
        self.seed = config.train.seed
        self.register_buffer("special_ids", torch.as_tensor(sorted(set(specials)), dtype=torch.long), persistent=False)
        self.head = nn.Sequential(
            nn.Linear(m.width, m.width), nn.GELU(), nn.LayerNorm(m.width, eps=m.norm_eps), nn.Linear(m.width, V)
        )
        with torch.no_grad():
            for lin in (self.head[0], self.head[3]):
                lin.weight.normal_(0.0, 0.02)
                lin.bias.zero_()

    @property
    def vocab_share(self) -> float:
        return self.mask_prob  # the head scores the selected tokens only

    def draws(
        self, shape: torch.Size, generator: torch.Generator | None = None, samples: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(selection draw, replacement draw, random id), each of ``shape`` (B, T) on the CPU: from ``generator``,
        or keyed by ``train.seed`` and each sample's key in ``samples`` (B,)."""
        if samples is None:
            pick = torch.rand(shape, generator=generator)
            how = torch.rand(shape, generator=generator)
            return pick, how, torch.randint(0, self.random_high, shape, generator=generator)
        length = shape[1]
        pick = keyed_uniform(self.seed, samples, 0, length)
        how = keyed_uniform(self.seed, samples, 1, length)
        # [0, random_high) from 32 random bits: (bits * random_high) >> 32 (random_high <= vocab_size < 2**31)
        return pick, how, (keyed_bits(self.seed, samples, 2, length) * self.random_high) >> 32

    def corrupt(
        self,
        tokens: torch.Tensor,
        padding_mask: torch.Tensor | None,
        generator: torch.Generator | None = None,
        samples: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(model inputs, targets): targets hold the original id at selected positions and -100 elsewhere. The
        draws come from ``generator``, or are keyed by each sample's key in ``samples`` (:meth:`draws`)."""
        device = tokens.device
        pick, how, random_ids = (t.to(device) for t in self.draws(tokens.shape, generator, samples))
        candidate = ~torch.isin(tokens, self.special_ids.to(device))
        if padding_mask is not None:
            candidate &= ~padding_mask
        selected = (pick < self.mask_prob) & candidate
        # a sample with nothing selected would teach nothing: it takes its candidate with the smallest draw (per
        # sample, not per batch, so that a sample's selection never depends on the batch it is in)
        empty = ~selected.any(1) & candidate.any(1)
        if empty.any():
            first = pick.masked_fill(~candidate, 2.0).argmin(1)
            selected[empty, first[empty]] = True
        to_mask = selected & (how < self.mask_fraction)
        to_random = selected & (how >= self.mask_fraction) & (how < self.mask_fraction + self.random_fraction)
        inputs = tokens.masked_fill(to_mask, self.mask_id)
        inputs = torch.where(to_random, random_ids, inputs)
        targets = tokens.masked_fill(~selected, IGNORE)
        return inputs, targets

    def masked_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean cross-entropy, number correct) over the selected positions; others never reach the head."""
        return self.selected_loss(hidden, *selected(targets))

    def selected_loss(
        self, hidden: torch.Tensor, index: torch.Tensor, gold: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean cross-entropy, number correct) at the flat positions ``index`` of ``hidden`` (B, T, width), whose
        original ids are ``gold``. An index list rather than a boolean mask: a compiled graph takes its length as
        a dynamic size, where selecting by a mask would split the graph."""
        if gold.numel() == 0:
            return hidden.sum() * 0.0, torch.zeros((), device=hidden.device)
        logits = self.head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)).float()
        return F.cross_entropy(logits, gold), (logits.argmax(-1) == gold).sum()

    def draw(
        self, batch: dict, generator: torch.Generator | None = None, samples: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(model inputs, flat indices of the selected positions, their original ids) for one masking, drawn as
        :meth:`corrupt` says."""
        tokens = batch_inputs(batch, "tokens", "inputs")
        inputs, targets = self.corrupt(tokens, batch.get("padding_mask"), generator, samples)
        return (inputs, *selected(targets))

    def prepare(self, batch: dict) -> dict:
        """The batch with its masking under ``mlm_drawn``, keyed by its samples' indices in the run's sample
        stream (:func:`~kilolayer.objectives.common.sample_keys`)."""
        if DRAWN in batch:
            return batch
        tokens = batch_inputs(batch, "tokens", "inputs")
        return {**batch, DRAWN: self.draw(batch, samples=sample_keys(batch, tokens.shape[0]))}

    def _step(self, backbone, batch, drawn):
        inputs, index, gold = drawn
        return self.selected_loss(backbone(inputs, batch.get("padding_mask")), index, gold)

    def forward(self, backbone: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
        batch = self.prepare(batch)
        loss, correct = self._step(backbone, batch, batch[DRAWN])
        return loss, {"accuracy": correct / max(batch[DRAWN][2].numel(), 1)}

    @torch.no_grad()
    def evaluate(self, backbone: nn.Module, batches: Iterable[dict]) -> dict:
        total = correct = count = 0.0
        for i, batch in enumerate(batches):
            drawn = self.draw(batch, eval_generator(i))
            loss, right = self._step(backbone, batch, drawn)
            n = drawn[2].numel()
            total += float(loss) * n
            correct += float(right)
            count += n
        return {"loss": total / max(count, 1), "accuracy": correct / max(count, 1)}

    def represent(self, backbone: nn.Module, batch: dict) -> torch.Tensor:
        return backbone(batch_inputs(batch, "tokens", "inputs"), batch.get("padding_mask"))

    def analysis_inputs(self, batch: dict):
        mask = batch.get("padding_mask")
        return {"inputs": batch_inputs(batch, "tokens", "inputs"), "padding_mask": mask}, mask

    def eval_targets(self, batch: dict, index: int) -> torch.Tensor:
        _, targets = self.corrupt(
            batch_inputs(batch, "tokens", "inputs"), batch.get("padding_mask"), eval_generator(index)
        )
        return targets[targets != IGNORE]

    def train_flops(self, batch: dict) -> float:
        """The encoder on every token; the head on the selected ones: those of a prepared batch, else about the
        expected number (``mask_prob`` of each sample's candidates, at least one where it has any)."""
        tokens, B = self.tokens(batch), batch_size(batch)
        if DRAWN in batch:
            selected = batch[DRAWN][2].numel()
        else:
            ids, mask = batch_inputs(batch, "tokens", "inputs"), batch.get("padding_mask")
            candidate = ~torch.isin(ids, self.special_ids.to(ids.device))
            if mask is not None:
                candidate &= ~mask
            count = candidate.sum(1).double()
            selected = float(torch.where(count > 0, (self.mask_prob * count).clamp(min=1.0), 0.0).sum())
        return self.backbone_flops(B, tokens / B) + 6.0 * head_weights(self) * selected

    def tokens(self, batch: dict) -> int:
        return token_count(batch_inputs(batch, "tokens", "inputs"), batch.get("padding_mask"))

    def loss_weight(self, batch: dict) -> int:
        """The selected tokens: those :meth:`prepare` drew for ``batch``, a prepared batch."""
        return batch[DRAWN][2].numel()
