"""In-memory sources: a small dataset held as tensors, cut into fixed seeded splits.

Every built-in image/text source (digits, image folders, text files, saved
``datasets``) loads its examples once, then hands them to :class:`MemorySource`.
The split depends only on ``split_seed`` (a data option, 0 by default), not on
``train.seed``, so runs with different training seeds evaluate on the same
examples; the train order is shuffled by ``train.seed`` as in :class:`Source`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import ConfigDict, Field

from kilolayer.config import NumbersNotBools
from kilolayer.data.base import Source
from kilolayer.errors import ConfigError

SPLITS = ("train", "validation", "test")


class SplitOptions(NumbersNotBools):
    """Options every in-memory source accepts (subclasses add their own)."""

    model_config = ConfigDict(extra="forbid")

    split_seed: int = 0
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    test_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    eval_split: Literal["validation", "test"] = "validation"


def stratified_subset(rows: torch.Tensor, labels: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """Exactly ``size`` of ``rows`` (sorted), each class in proportion (largest remainders get the rest)."""
    if size >= len(rows):
        return rows
    y = labels[rows]
    classes, counts = torch.unique(y, return_counts=True)
    share = counts.double() * size / len(rows)
    quota = share.floor().long()
    extra = size - int(quota.sum())
    quota[torch.argsort(share - quota, descending=True, stable=True)[:extra]] += 1
    g = torch.Generator().manual_seed(seed)
    picked = []
    for c, q in zip(classes, quota):
        members = rows[y == c]
        picked.append(members[torch.randperm(len(members), generator=g)[: int(q)]])
    return torch.cat(picked).sort().values


def split_indices(
    n: int, seed: int, val_fraction: float, test_fraction: float, labels: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Disjoint sorted index sets ``train``/``validation``/``test`` covering ``range(n)``.

    With ``labels`` the split is stratified: each class is shuffled on its own and
    contributes round(fraction * class size) examples to validation and test.
    """
    if val_fraction + test_fraction >= 1.0:
        raise ConfigError(
            f"data.options: val_fraction + test_fraction = {val_fraction + test_fraction:g} leaves no training data"
        )
    g = torch.Generator().manual_seed(seed)
    if labels is None:
        groups = [torch.arange(n)]
    else:
        groups = [torch.nonzero(labels == c).flatten() for c in torch.unique(labels)]
    parts: dict[str, list[torch.Tensor]] = {s: [] for s in SPLITS}
    for group in groups:
        perm = group[torch.randperm(len(group), generator=g)]
        n_test = round(test_fraction * len(group))
        n_val = round(val_fraction * len(group))
        parts["test"].append(perm[:n_test])
        parts["validation"].append(perm[n_test : n_test + n_val])
        parts["train"].append(perm[n_test + n_val :])
    return {s: torch.cat(p).sort().values for s, p in parts.items()}


def pad_tokens(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to the longest: (tokens long (B, T), padding_mask bool (B, T), True = pad)."""
    T = max(1, max((len(s) for s in seqs), default=1))
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.ones(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = False
    return tokens, mask


class MemorySource(Source):
    """Fixed splits of in-memory examples.

    ``columns`` maps a batch key to all examples' values: a tensor whose first
    dimension indexes examples, or a list of token-id lists (padded per batch
    with ``pad_id``; the batch then also has ``padding_mask``). ``splits`` maps
    train/validation/test to example indices. ``collate(indices, split)`` takes
    ``split`` in train|eval|validation|test; ``eval`` is ``eval_split``.
    """

    def __init__(
        self,
        seed: int,
        columns: dict[str, torch.Tensor | list[list[int]]],
        splits: dict[str, torch.Tensor],
        eval_split: str = "validation",
        pad_id: int = 0,
        num_classes: int | None = None,
        where: str = "data",
    ):
        super().__init__(seed)
        self.columns = columns
        self.splits = {s: [int(i) for i in idx] for s, idx in splits.items()}
        self.eval_split = eval_split
        self.pad_id = pad_id
        self.num_classes = num_classes
        if not self.splits.get("train"):
            raise ConfigError(f"{where}: no training examples after the split")
        if not self.splits.get(eval_split):
            raise ConfigError(
                f"{where}: the {eval_split} split is empty ({len(self.splits['train'])} training examples); "
                f"raise data.options.{'val' if eval_split == 'validation' else 'test'}_fraction or add data"
            )

    def __len__(self) -> int:
        return len(self.splits["train"])

    @property
    def eval_size(self) -> int:
        return len(self.splits[self.eval_split])

    def split_size(self, split: str) -> int:
        return len(self.splits[self.eval_split if split == "eval" else split])

    def examples(self, split: str) -> list[int]:
        """Dataset indices of the examples in ``split`` (sorted)."""
        return list(self.splits[self.eval_split if split == "eval" else split])

    def collate(self, indices: list[int], split: str) -> dict:
        rows = self.splits[self.eval_split if split == "eval" else split]
        idx = [rows[i] for i in indices]
        batch: dict = {}
        for key, col in self.columns.items():
            if isinstance(col, torch.Tensor):
                batch[key] = col[torch.as_tensor(idx, dtype=torch.long)]
            else:
                batch[key], batch["padding_mask"] = pad_tokens([col[i] for i in idx], self.pad_id)
        return batch

    def split_batches(self, split: str, batch_size: int):
        """All batches of ``split`` in order (e.g. the test split after training)."""
        n = self.split_size(split)
        for start in range(0, n, batch_size):
            yield self.collate(list(range(start, min(n, start + batch_size))), split)
