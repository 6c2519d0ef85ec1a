"""Sequence-level classification (ViT / BERT-classifier style): pool the final hidden states, one linear head.

Batch: ``{"inputs": images float (B, C, H, W) or token ids long (B, T),
"labels": long (B,)}`` plus ``padding_mask`` for tokens (``images`` or
``tokens`` are accepted in place of ``inputs``). Options (``objective.options``):

* ``pool``: ``cls`` (the first token: the CLS token of a patch model, or a CLS
  id the text source put first) or ``mean`` (over non-padding tokens; a
  patch model's CLS token is left out, so every content token gets the same
  gradient from the head). Default: ``cls`` for a patch model with a CLS
  token, else ``mean``.
* ``num_classes``: default, the data source's number of classes.
* ``head_norm``: LayerNorm on the pooled features before the linear head
  (default true; makes a frozen-backbone linear probe far better conditioned).

Evaluation reports ``loss`` and ``accuracy`` over the evaluation split.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field
from torch import nn

from kilolayer.config import NumbersNotBools
from kilolayer.data.base import Source
from kilolayer.data.options import parse_options
from kilolayer.errors import ConfigError
from kilolayer.objectives.base import Objective, batch_size, head_weights, register_objective
from kilolayer.objectives.common import batch_inputs, pool, token_count


class ClassificationOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")

    pool: Literal["cls", "mean"] | None = None
    num_classes: int | None = Field(None, ge=2)
    head_norm: bool = True


@register_objective
class Classification(Objective):
    name = "classification"
    metrics = ("loss", "accuracy")
    archs = ("encoder",)

    def __init__(self, config, backbone: nn.Module, source: Source | None):
        super().__init__(config, backbone, source)
        opts = parse_options(ClassificationOptions, config.objective.options, "objective.options")
        m = backbone.config  # model.arch is checked against ``archs`` by build_objective
        self.patches = m.input == "patches"
        self.seq_len = m.seq_len
        self.cls_token = self.patches and m.cls_token
        self.pool = opts.pool or ("cls" if self.cls_token else "mean")
        if self.pool == "cls" and self.patches and not m.cls_token:
            raise ConfigError("objective.options.pool='cls': model.cls_token is false; use pool: mean")
        self.num_classes = opts.num_classes or (source.num_classes if source is not None else None)
        if not self.num_classes:
            given = "is not given" if source is None else "does not give class labels"
            raise ConfigError(f"objective.options.num_classes: required; data.name={config.data.name!r} {given}")
        self.norm = nn.LayerNorm(m.width, eps=m.norm_eps) if opts.head_norm else nn.Identity()
        self.head = nn.Linear(m.width, self.num_classes)
        with torch.no_grad():
            self.head.weight.normal_(0.0, 0.02)
            self.head.bias.zero_()

    def _inputs(self, batch: dict):
        if self.patches:  # "images" when the source pairs images with captions
            return batch_inputs(batch, "inputs", "images"), None
        return batch_inputs(batch, "inputs", "tokens"), batch.get("padding_mask")

    def features(self, backbone: nn.Module, batch: dict) -> torch.Tensor:
        """Pooled final hidden states (B, width)."""
        x, mask = self._inputs(batch)
        hidden = backbone(x, mask)
        return pool(hidden, mask, self.pool, skip_first=self.cls_token)

    def logits(self, backbone: nn.Module, batch: dict) -> torch.Tensor:
        return self.head(self.norm(self.features(backbone, batch)))

    def forward(self, backbone: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
        logits = self.logits(backbone, batch)
        labels = batch["labels"]
        loss = F.cross_entropy(logits.float(), labels)
        accuracy = (logits.argmax(-1) == labels).float().mean()
        return loss, {"accuracy": float(accuracy)}

    @torch.no_grad()
    def evaluate(self, backbone: nn.Module, batches: Iterable[dict]) -> dict:
        total_loss = correct = count = 0.0
        for batch in batches:
            logits = self.logits(backbone, batch)
            labels = batch["labels"]
            total_loss += float(F.cross_entropy(logits.float(), labels, reduction="sum"))
            correct += float((logits.argmax(-1) == labels).sum())
            count += len(labels)
        return {"loss": total_loss / max(count, 1), "accuracy": correct / max(count, 1)}

    def represent(self, backbone: nn.Module, batch: dict) -> torch.Tensor:
        x, mask = self._inputs(batch)
        return backbone(x, mask)

    def analysis_inputs(self, batch: dict):
        x, mask = self._inputs(batch)
        return {"inputs": x, "padding_mask": mask}, mask

    def eval_targets(self, batch: dict, index: int) -> torch.Tensor:
        return batch["labels"]

    def train_flops(self, batch: dict) -> float:
        # the head runs once per sample, on the pooled features (its input gradient is needed even over a frozen
        # backbone: the head's LayerNorm trains)
        B = batch_size(batch)
        return self.backbone_flops(B, self.tokens(batch) / B) + 6.0 * head_weights(self) * B

    def loss_weight(self, batch: dict) -> int:
        """The samples: one label each."""
        return len(batch["labels"])

    def tokens(self, batch: dict) -> int:
        x, mask = self._inputs(batch)
        if self.patches:
            return x.shape[0] * self.seq_len
        return token_count(x, mask)
