"""The data-source interface: every split is deterministic in (seed, step).

A training batch is a pure function of the step (and of rank/world for
multi-process runs), so resuming a run needs no saved iterator state beyond
the step, and a resumed run sees exactly the batches an uninterrupted one
would. Adding a source is one module with one ``@register_source`` function.

Each training sample has an index in the run's sample stream: ``step * batch_size`` plus its place in the
global batch, whatever process or micro-batch it lands in. The trainer adds it to every training batch
(:func:`with_sample_index`), and random masks are keyed by it, so that they too do not depend on the number
of processes or micro-batches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

import torch

from kilolayer.registry import SOURCES

#: the batch key of each training sample's index in the run's sample stream, (B,) int64
SAMPLE_INDEX = "sample_index"


def sample_index(step: int, batch_size: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """The indices in the run's sample stream of the samples that ``Source.train_batch(step, batch_size, rank,
    world)`` holds: rank ``rank``'s contiguous share of global batch ``step``, step * batch_size + rank * share
    + 0, 1, ..."""
    share = batch_size // world
    return torch.arange(share, dtype=torch.int64) + (step * batch_size + rank * share)


def with_sample_index(batch: dict, step: int, batch_size: int, rank: int = 0, world: int = 1) -> dict:
    """``batch``, ``Source.train_batch(step, batch_size, rank, world)``'s, with :func:`sample_index` under
    :data:`SAMPLE_INDEX`."""
    return {**batch, SAMPLE_INDEX: sample_index(step, batch_size, rank, world)}


def register_source(
    name: str, reads: tuple[str, ...] = (), path_options: tuple[str, ...] = ()
) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(config) -> Source`` under ``name`` (what ``data.name`` selects).

    ``reads`` names the fields of the ``data`` section besides ``name`` and ``options`` that the source reads
    (``task``, ``path``): a run's config.yaml leaves out the others while they hold their defaults.
    ``path_options`` names the keys of ``data.options`` that are a file or folder: loading a config makes them
    absolute, as it does ``data.path`` (:func:`kilolayer.config.absolute_paths`).
    """

    def register(fn: Callable) -> Callable:
        fn.data_fields, fn.path_options = tuple(reads), tuple(path_options)
        return SOURCES.register(name)(fn)

    return register


class Source(ABC):
    """A dataset with a train split sampled by step and a fixed evaluation split.

    Subclasses implement ``__len__`` (train examples), ``collate(indices, split)`` and
    ``eval_size``.
    """

    num_classes: int | None = None  # the number of label classes, for sources whose batches carry ``labels``
    # sources of images with captions: the caption ids (padding included) lie below this; the contrastive
    # objective checks its text tower's vocabulary against it when the run is built
    text_vocab: int | None = None
    # the split the evaluation batches come from; sources with ``data.options.eval_split`` set their own
    eval_split: str = "validation"

    def __init__(self, seed: int):
        self.seed = seed

    @abstractmethod
    def __len__(self) -> int:
        """Number of training examples."""

    @property
    @abstractmethod
    def eval_size(self) -> int:
        """Number of evaluation examples."""

    @abstractmethod
    def collate(self, indices: list[int], split: str) -> dict:
        """The batch (a dict of tensors) of examples ``indices`` of ``split`` (train|eval)."""

    def epoch_order(self, epoch: int) -> torch.Tensor:
        cached = getattr(self, "_order", None)
        if cached is None or cached[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = cached = (epoch, torch.randperm(len(self), generator=g))
        return cached[1]

    def train_batch(self, step: int, batch_size: int, rank: int = 0, world: int = 1) -> dict:
        """The global batch of ``step`` is examples [step*B, (step+1)*B) of the epoch-shuffled order;
        rank r of ``world`` takes its contiguous share."""
        n = len(self)
        start = step * batch_size
        per = batch_size // world
        idx = []
        for pos in range(start + rank * per, start + (rank + 1) * per):
            epoch, k = divmod(pos, n)
            idx.append(int(self.epoch_order(epoch)[k]) if n > 1 else 0)
        return self.collate(idx, "train")

    def log_fields(self, since: int, step: int) -> dict:
        """Counts the source adds to a train record: over training batches ``since .. step - 1`` (those since
        the previous record; batch ``s`` is step ``s + 1``'s). Default: none."""
        return {}

    def eval_batches(self, batch_size: int, limit: int | None = None) -> Iterator[dict]:
        n = self.eval_size if limit is None else min(limit, self.eval_size)
        for start in range(0, n, batch_size):
            yield self.collate(list(range(start, min(n, start + batch_size))), "eval")
