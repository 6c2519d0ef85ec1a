"""Small pieces several objectives share: batch inputs, pooling, random generators."""

from __future__ import annotations

import torch

from kilolayer.errors import InputError


def batch_inputs(batch: dict, *keys: str) -> torch.Tensor:
    """The first of ``keys`` present in ``batch`` (sources name token inputs ``tokens``, images ``inputs``)."""
    for key in keys:
        if key in batch:
            return batch[key]
    raise InputError(f"batch: expected one of the keys {', '.join(keys)}; got {', '.join(batch) or 'none'}")


def pool(hidden: torch.Tensor, padding_mask: torch.Tensor | None, how: str, skip_first: bool = False) -> torch.Tensor:
    """(B, T, D) -> (B, D): the first token (``cls``) or the mean over non-padding tokens (``mean``).

    ``skip_first`` leaves a CLS token out of the mean (a ViT/MAE "global pool").
    """
    if how == "cls":
        return hidden[:, 0]
    if skip_first:
        hidden = hidden[:, 1:]
        padding_mask = None if padding_mask is None else padding_mask[:, 1:]
    if padding_mask is None:
        return hidden.mean(dim=1)
    # masked_fill, not a product: a fully padded row may hold NaN from attention
    summed = hidden.masked_fill(padding_mask[..., None], 0.0).sum(dim=1)
    return summed / (~padding_mask).sum(dim=1, keepdim=True).clamp_min(1).to(hidden.dtype)


def step_generator() -> torch.Generator:
    """A CPU generator seeded from the global RNG: random masks follow the trainer's seed and resume
    exactly from a checkpointed RNG state, and are the same on CPU and GPU."""
    seed = int(torch.randint(0, 2**62, (1,)))
    return torch.Generator().manual_seed(seed)


def eval_generator(index: int, base: int = 1234) -> torch.Generator:
    """A fixed generator for evaluation batch ``index``, so evaluations at different steps see the same masks."""
    return torch.Generator().manual_seed(base + index)


def token_count(x: torch.Tensor, padding_mask: torch.Tensor | None) -> int:
    return int(x.numel() if padding_mask is None else (~padding_mask).sum())
