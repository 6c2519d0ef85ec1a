"""The objective interface. An objective owns its head(s), its loss and how a
data batch becomes model inputs; the trainer knows nothing objective-specific.

Adding an objective is one module with one ``@register_objective`` class.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kilolayer.data.base import Source
from kilolayer.registry import OBJECTIVES


def register_objective(cls: type[Objective]) -> type[Objective]:
    """Class decorator: register an objective under its ``name`` (what ``objective.name`` selects)."""
    return OBJECTIVES.register(cls.name)(cls)


class Objective(nn.Module):
    """Heads + loss. Subclasses set ``name`` and ``archs``, take what they need from the data source they are
    built for (``__init__(config, backbone, source)``), and implement the methods in ``REQUIRED``; a subclass
    missing one is refused when it is defined (``class Base(Objective, abstract=True)`` marks a shared base).
    ``source`` is None where no data is at hand and only the shapes matter (the memory estimate, tests of the
    model alone): the objective then takes its defaults and checks nothing about the data.

    * ``forward(backbone, batch) -> (loss, stats)``: ``loss`` a scalar tensor,
      ``stats`` values worth logging (e.g. accuracy on the batch): floats, or 0-dim tensors, which
      :class:`Task` reads out after the step (a value read out inside ``forward`` would split a compiled
      graph in two).
    * ``prepare(batch) -> batch`` (optional): what must run eagerly before ``forward`` when the task is
      compiled as a whole (``train.compile: model``): random draws from a CPU generator, index lists
      whose length depends on the data. ``forward`` must give the same result on a prepared batch as on
      the raw one, which it prepares itself; preparing a prepared batch returns it as it is (the trainer
      prepares each micro-batch, then counts its FLOPs and its ``loss_weight`` on what was drawn).
    * ``evaluate(backbone, batches) -> dict``: metrics over an evaluation set;
      must contain ``loss``.
    * ``represent(backbone, batch) -> Tensor``: the network output F(x, theta)
      on a probe batch, for DeepNet's model-update diagnostic.
    * ``tokens(batch) -> int``: tokens the backbone processes, for tokens/s.
    * ``train_flops(batch) -> float``: model FLOPs of one training step (forward and backward) on ``batch``,
      from its shapes (docs/bamboo.md#model-flops-and-mfu), for MFU. The default counts the backbone at the
      batch's mean tokens per sample (split evenly between source and target for an encoder-decoder) and the
      objective's matmul weights once per token; objectives whose heads run on other tokens override it.
    * ``chance(backbone, batches) -> dict``: the evaluation ``loss`` (and ``accuracy``, where the
      objective reports one) of the best predictor that ignores the input, on the same evaluation
      targets: the level a model that learned nothing sits at. Objectives with categorical targets
      implement ``eval_targets`` and inherit it.
    * ``generate(backbone, prompt, decoding, bos=None, eos=None) -> ids`` (optional, for objectives that write
      text): the ids the model writes for the id list ``prompt`` under a
      :class:`~kilolayer.objectives.decoding.Decoding`, without BOS or EOS; ``bos``/``eos`` are the data's.
    * ``baselines(batches) -> dict`` (optional): the scores of predictors that do not use what a model learns
      (seq2seq: the source copied, the nearest training pair's target), on the pairs ``evaluate`` scores, as
      ``{"pairs": N, "baselines": {name: scores}}``; {} where the objective has none.
    """

    name = ""
    archs: tuple[str, ...] = ()
    # the keys ``evaluate`` returns (None: not declared, as for a user's objective, so nothing is checked against
    # them); a study claim that reads a score its group's objective never logs is refused before anything trains
    metrics: tuple[str, ...] | None = None

    @classmethod
    def logs(cls, options: dict) -> tuple[str, ...] | None:
        """The keys ``evaluate`` returns with the objective's ``options`` (:attr:`metrics` unless they depend on
        them); None where the objective does not say."""
        return cls.metrics

    REQUIRED = ("forward", "represent", "tokens")

    def __init_subclass__(cls, abstract: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if abstract:
            return
        # nn.Module is not an ABC: without this, a missing method would surface mid-training
        for method in cls.REQUIRED:
            if getattr(cls, method) is getattr(Objective, method):
                raise TypeError(f"objective {cls.__name__}: does not implement {method}() (see Objective.REQUIRED)")

    def __init__(self, config, backbone: nn.Module, source: Source | None):
        super().__init__()
        self.config = config

    def forward(self, backbone: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
        """(scalar loss, stats) for one batch."""
        raise NotImplementedError(f"{type(self).__name__}.forward (required; checked at class definition)")

    def prepare(self, batch: dict) -> dict:
        """The training batch with this step's eager work done (see the class docstring). Default: as is."""
        return batch

    @torch.no_grad()
    def evaluate(self, backbone: nn.Module, batches: Iterable[dict]) -> dict:
        """Default: mean loss over the batches, each weighted by its ``loss_weight`` (the mean over all the
        evaluation targets, however the batches divide them)."""
        total = weight = 0.0
        for batch in batches:
            batch = self.prepare(batch)
            loss, _ = self(backbone, batch)
            w = self.loss_weight(batch)
            total, weight = total + float(loss) * w, weight + w
        return {"loss": total / max(weight, 1)}

    def represent(self, backbone: nn.Module, batch: dict) -> torch.Tensor:
        """F(x, theta) on a probe batch."""
        raise NotImplementedError(f"{type(self).__name__}.represent (required; checked at class definition)")

    def analysis_inputs(self, batch: dict) -> tuple[dict, torch.Tensor | None]:
        """(keyword arguments for ``backbone(**kwargs, observe=fn)`` — for an encoder-decoder, for
        ``backbone.encode(**kwargs, observe=fn)``, its encoder being what is analysed — and the padding mask
        (B, T) of the observed sequence, True = padding). Default: the batch's ``inputs``/``tokens`` and
        ``padding_mask``."""
        x = batch["inputs"] if "inputs" in batch else batch["tokens"]
        mask = batch.get("padding_mask")
        return {"inputs" if "inputs" in batch else "tokens": x, "padding_mask": mask}, mask

    def tokens(self, batch: dict) -> int:
        """Tokens the backbone processes in ``batch``."""
        raise NotImplementedError(f"{type(self).__name__}.tokens (required; checked at class definition)")

    def backbone_length(self, length: int) -> int:
        """Tokens per sample the backbone runs on in a training step whose samples are ``length`` tokens long
        (the memory estimate sizes the backbone's activations by it): all of them, unless an objective shows the
        backbone only part of each sample."""
        return length

    @property
    def vocab_share(self) -> float:
        """The share of token positions a vocabulary head scores in a training step (the memory estimate sizes
        the logits by it): all of them, unless an objective scores only some."""
        return 1.0

    def train_flops(self, batch: dict) -> float:
        """Model FLOPs of one training step on ``batch`` (see the class docstring)."""
        tokens, samples = self.tokens(batch), batch_size(batch)
        per = max(tokens / samples, 1.0)
        if self.config.model.arch == "encoder_decoder":
            return self.backbone_flops(samples, per / 2, per / 2) + 6.0 * head_weights(self) * tokens
        return self.backbone_flops(samples, per) + 6.0 * head_weights(self) * tokens

    def backbone_flops(self, samples: int, length: float, target: float | None = None, model=None) -> float:
        """Training FLOPs of ``samples`` sequences through the backbone (or the stack ``model`` configures): the
        encoder's ``length`` tokens, the decoder's ``target`` (default ``length``). A third of them when
        ``train.freeze_backbone`` keeps the task's own backbone out of the backward pass."""
        from kilolayer.nn.budget import training_flops

        cfg = model or self.config.model
        length = max(float(length), 1.0)
        flops = samples * training_flops(cfg, length, max(float(length if target is None else target), 1.0))
        if model is None and self.config.train.freeze_backbone:
            flops /= 3  # forward only: no gradients for the backbone's weights or inputs
        return flops

    def loss_weight(self, batch: dict) -> int:
        """How many targets ``forward``'s loss on ``batch`` (a prepared batch) is the mean over: the batch's
        weight where losses are averaged over batches (a training step's micro-batches and processes, the
        default evaluation). Default: ``tokens(batch)``."""
        return self.tokens(batch)

    def eval_targets(self, batch: dict, index: int) -> torch.Tensor | None:
        """The class ids evaluation batch ``index`` is scored on (1-D, long), or None if the targets are
        not categorical. ``index`` fixes any random masking exactly as ``evaluate`` does."""
        return None

    def baselines(self, batches: Iterable[dict], paired: bool = False) -> dict:
        """Scores of predictors that do not use what a model learns, on the evaluation batches (see the class
        docstring); ``paired``: beside each, the model's difference from it on the same samples, from the model's
        outputs of the last :meth:`evaluate` of these batches, where the objective keeps them. Default: none."""
        return {}

    def label_smoothing(self) -> tuple[float, int]:
        """(epsilon, number of classes) of the training loss's label smoothing; (0, 0) without it."""
        return 0.0, 0

    @torch.no_grad()
    def chance(self, backbone: nn.Module, batches: Iterable[dict]) -> dict:
        """Loss and accuracy of the best input-independent predictor on the evaluation targets: predicting
        their empirical distribution p gives cross-entropy H(p) (the entropy, in nats) and accuracy
        max(p). Under label smoothing epsilon over V classes (:meth:`label_smoothing`), the loss is
        cross-entropy against the smoothed target t = (1 - epsilon) p + epsilon / V, whose best prediction is
        t itself: H(t)."""
        counts = None
        for i, batch in enumerate(batches):
            y = self.eval_targets(batch, i)
            if y is None:
                raise NotImplementedError(f"{type(self).__name__}: no categorical evaluation targets")
            c = torch.bincount(y.reshape(-1).cpu().long())
            counts = c if counts is None else _add_counts(counts, c)
        if counts is None or int(counts.sum()) == 0:
            return {"loss": float("nan"), "accuracy": float("nan")}
        p = counts.double() / counts.sum()
        eps, classes = self.label_smoothing()
        if eps > 0:
            full = torch.zeros(max(classes, len(p)), dtype=torch.double)
            full[: len(p)] = p
            p = (1 - eps) * full + eps / len(full)
        accuracy = float(counts.max().double() / counts.sum())
        p = p[p > 0]
        return {"loss": float(-(p * p.log()).sum()), "accuracy": accuracy}


def head_weights(module: nn.Module) -> int:
    """Matmul weights of ``module``'s linear layers (an objective's heads; a decoder or tower of its own)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def batch_size(batch: dict) -> int:
    """The number of samples in ``batch``: the first dimension of its first tensor."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim():
            return max(int(value.shape[0]), 1)
    return 1


def _add_counts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if len(a) < len(b):
        a, b = b, a
    a = a.clone()
    a[: len(b)] += b
    return a


class Task(nn.Module):
    """Backbone + objective as one module, so DDP/FSDP and checkpoints see one tree."""

    def __init__(self, backbone: nn.Module, objective: Objective):
        super().__init__()
        self.backbone = backbone
        self.objective = objective

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """(loss, stats as floats) of one training batch: the objective's eager ``prepare``, then
        :meth:`compute`, the part ``train.compile: model`` compiles."""
        loss, stats = self.compute(self.objective.prepare(batch))
        return loss, {k: float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in stats.items()}

    def compute(self, batch: dict) -> tuple[torch.Tensor, dict]:
        return self.objective(self.backbone, batch)
