"""CLIP-style contrastive training: image tower (the backbone) + text tower, symmetric InfoNCE.

The backbone built from ``model`` is the image tower (``model.input: patches``).
The text tower is a second kilolayer encoder built here from
``objective.options.text_model`` (a ``model`` section of its own: depth, width,
scheme, ...; unspecified keys take the defaults below). Each tower's pooled
output goes through a linear projection to ``embed_dim`` and is L2-normalised;
the logits are ``exp(logit_scale) * img @ txt.T`` with ``logit_scale`` learned,
starting at log(1/0.07); like CLIP, the parameter itself is clamped to ln 100 before
each training step, so it can always move back down.
Loss: the mean of image->text and text->image cross-entropy with the diagonal
as targets.

Batch: ``{"images": float (B, C, H, W), "tokens": long (B, T), "padding_mask":
bool (B, T)}``, optional ``labels``. Evaluation embeds the whole evaluation
split and reports ``loss`` (per-batch InfoNCE), ``recall_i2t`` / ``recall_t2i``
(recall@1 of the exact partner among all evaluation examples) and, if the
batches carry labels, ``label_recall_i2t`` / ``label_recall_t2i`` (the top match
has the same label; meaningful when many captions are alike, as for digits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field, ValidationError
from torch import nn

from kilolayer.config import ModelConfig, NumbersNotBools, format_validation_error
from kilolayer.data.base import Source
from kilolayer.data.options import parse_options
from kilolayer.data.vocab import BYTE_VOCAB
from kilolayer.errors import ConfigError
from kilolayer.nn.transformer import build_model
from kilolayer.objectives.base import Objective, batch_size, register_objective
from kilolayer.objectives.common import pool, token_count

TEXT_MODEL_DEFAULTS = dict(
    arch="encoder",
    input="tokens",
    layers=4,
    width=128,
    heads=4,
    vocab_size=BYTE_VOCAB,
    max_len=64,
)


class ContrastiveOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")

    text_model: dict[str, Any] = Field(default_factory=dict)
    embed_dim: int = Field(128, ge=1)
    image_pool: Literal["cls", "mean"] | None = None
    text_pool: Literal["cls", "mean"] = "mean"
    logit_scale_init: float = Field(math.log(1 / 0.07), description="log of the initial inverse temperature")
    max_logit_scale: float = Field(100.0, gt=0, description="the scale exp(logit_scale) is clamped to at most this")


def text_model_config(image: ModelConfig, given: dict) -> ModelConfig:
    """The text tower's model section: defaults, the image tower's scheme/activation/eps, then ``given``."""
    data = dict(
        TEXT_MODEL_DEFAULTS,
        scheme=image.scheme,
        activation=image.activation,
        norm_eps=image.norm_eps,
        dropout=image.dropout,
    )
    data.update(given)
    data.setdefault("ffn", 4 * data["width"])
    try:
        cfg = ModelConfig.model_validate(data)
    except ValidationError as err:
        msg = format_validation_error(err, "objective.options.text_model", ModelConfig)
        raise ConfigError(
            msg.replace("model.", "objective.options.text_model.") if msg.startswith("model.") else msg
        ) from None
    if cfg.arch != "encoder" or cfg.input != "tokens":
        raise ConfigError(
            "objective.options.text_model: the text tower is an encoder over tokens (arch: encoder, input: tokens)"
        )
    return cfg


def info_nce(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE of L2-normalised embeddings (B, E): pair i is the positive of row and column i."""
    logits = scale * img @ txt.t()
    target = torch.arange(len(img), device=img.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))


@register_objective
class Contrastive(Objective):
    name = "contrastive"
    metrics = ("loss", "recall_i2t", "recall_t2i", "label_recall_i2t", "label_recall_t2i")
    archs = ("encoder",)

    def __init__(self, config, backbone: nn.Module, source: Source | None):
        super().__init__(config, backbone, source)
        opts = parse_options(ContrastiveOptions, config.objective.options, "objective.options")
        m = backbone.config
        if m.input != "patches":
            raise ConfigError(
                f"model.input={m.input!r}: the contrastive image tower takes patches; set model.input: patches"
            )
        self.image_cls = m.cls_token
        self.image_seq_len = m.seq_len
        self.image_pool = opts.image_pool or ("cls" if m.cls_token else "mean")
        if self.image_pool == "cls" and not m.cls_token:
            raise ConfigError("objective.options.image_pool='cls': model.cls_token is false; use image_pool: mean")
        self.text_pool = opts.text_pool
        self.text_config = text_model_config(m, opts.text_model)
        needed = getattr(source, "text_vocab", None)
        if needed and self.text_config.vocab_size < needed:
            raise ConfigError(
                f"objective.options.text_model.vocab_size={self.text_config.vocab_size}: the captions of "
                f"data.name={config.data.name!r} need at least {needed}"
            )
        self.text = build_model(self.text_config)
        self.image_proj = nn.Linear(m.width, opts.embed_dim, bias=False)
        self.text_proj = nn.Linear(self.text_config.width, opts.embed_dim, bias=False)
        with torch.no_grad():
            self.image_proj.weight.normal_(0.0, m.width**-0.5)
            self.text_proj.weight.normal_(0.0, self.text_config.width**-0.5)
        self.logit_scale = nn.Parameter(torch.tensor(float(opts.logit_scale_init)))
        self.max_logit_scale = opts.max_logit_scale

    def scale(self) -> torch.Tensor:
        """exp(logit_scale), at most ``max_logit_scale``."""
        return self.logit_scale.exp().clamp(max=self.max_logit_scale)

    def clamp_logit_scale(self) -> None:
        """Clamp the parameter itself to ln(max_logit_scale), as CLIP does after each step: clamping only
        the output would leave a parameter past the cap with zero gradient for the rest of training."""
        with torch.no_grad():
            self.logit_scale.clamp_(max=math.log(self.max_logit_scale))

    def embed_images(self, backbone: nn.Module, images: torch.Tensor) -> torch.Tensor:
        h = pool(backbone(images), None, self.image_pool, skip_first=self.image_cls)
        return F.normalize(self.image_proj(h).float(), dim=-1)

    def embed_text(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        h = pool(self.text(tokens, padding_mask), padding_mask, self.text_pool)
        return F.normalize(self.text_proj(h).float(), dim=-1)

    def forward(self, backbone: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
        img = self.embed_images(backbone, batch["images"])
        txt = self.embed_text(batch["tokens"], batch.get("padding_mask"))
        if self.training:
            self.clamp_logit_scale()  # the previous optimizer step may have pushed it past the cap
        scale = self.logit_scale.exp()
        loss = info_nce(img, txt, scale)
        with torch.no_grad():
            sim = img @ txt.t()
            target = torch.arange(len(img), device=img.device)
            acc = 0.5 * ((sim.argmax(1) == target).float().mean() + (sim.argmax(0) == target).float().mean())
        return loss, {"accuracy": acc, "logit_scale": scale.detach()}

    @torch.no_grad()
    def evaluate(self, backbone: nn.Module, batches: Iterable[dict]) -> dict:
        imgs, txts, labels = [], [], []
        total = count = 0.0
        scale = self.scale()
        for batch in batches:
            img = self.embed_images(backbone, batch["images"])
            txt = self.embed_text(batch["tokens"], batch.get("padding_mask"))
            total += float(info_nce(img, txt, scale)) * len(img)
            count += len(img)
            imgs.append(img)
            txts.append(txt)
            if "labels" in batch:
                labels.append(batch["labels"])
        if not imgs:
            return {"loss": float("nan")}
        img, txt = torch.cat(imgs), torch.cat(txts)
        sim = img @ txt.t()
        target = torch.arange(len(img), device=img.device)
        i2t, t2i = sim.argmax(1), sim.argmax(0)
        out = {
            "loss": total / count,
            "recall_i2t": float((i2t == target).float().mean()),
            "recall_t2i": float((t2i == target).float().mean()),
        }
        if len(labels) == len(imgs):
            y = torch.cat(labels).to(img.device)
            out["label_recall_i2t"] = float((y[i2t] == y).float().mean())
            out["label_recall_t2i"] = float((y[t2i] == y).float().mean())
        return out

    @torch.no_grad()
    def chance(self, backbone: nn.Module, batches: Iterable[dict]) -> dict:
        """Scores that ignore the input are uniform over a batch of B pairs: InfoNCE ln B (the mean over
        batches, weighted by B as in ``evaluate``) and retrieval recall 1/N over the N evaluation pairs."""
        sizes = [len(batch["images"]) for batch in batches]
        n = sum(sizes)
        if not n:
            return {"loss": float("nan"), "accuracy": float("nan")}
        return {"loss": sum(b * math.log(b) for b in sizes) / n, "accuracy": 1.0 / n}

    def represent(self, backbone: nn.Module, batch: dict) -> torch.Tensor:
        return backbone(batch["images"])

    def analysis_inputs(self, batch: dict):
        return {"inputs": batch["images"], "padding_mask": None}, None

    def train_flops(self, batch: dict) -> float:
        """The image tower on each image's patches, the text tower on the captions' tokens, both projections
        once per sample, and the B x B similarity matrix."""
        B = batch_size(batch)
        text_tokens = token_count(batch["tokens"], batch.get("padding_mask"))
        towers = self.backbone_flops(B, self.image_seq_len)
        towers += self.backbone_flops(B, text_tokens / B, model=self.text_config)
        projections = 6.0 * B * (self.image_proj.weight.numel() + self.text_proj.weight.numel())
        return towers + projections + 6.0 * B * B * self.image_proj.out_features

    def loss_weight(self, batch: dict) -> int:
        """The batch's pairs: InfoNCE is the mean over them of each image's and each caption's cross-entropy."""
        return len(batch["images"])

    def tokens(self, batch: dict) -> int:
        images = batch["images"]
        return images.shape[0] * self.image_seq_len + token_count(batch["tokens"], batch.get("padding_mask"))
