"""Small pieces several objectives share: batch inputs, pooling, random generators and keyed random draws."""

from __future__ import annotations

import torch

from kilolayer.data.base import SAMPLE_INDEX
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


_WORD = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 ``x`` in [0, 2**32) and a 32-bit ``c``, in two 16-bit halves: no int64
    product overflows."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _WORD


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection of [0, 2**32) in which every input bit flips about half the
    output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def keyed_bits(seed: int, samples: torch.Tensor, stream: int, length: int) -> torch.Tensor:
    """Random 32-bit words, (B, length) int64 in [0, 2**32) on the CPU, a pure function of (``seed``, each
    sample's key in ``samples`` (B,), ``stream``, position): a sample gets the same words in whatever batch,
    process or micro-batch it lands, so masks keyed by its index in the run's sample stream do not depend on
    how the global batch is divided. A counter-based hash (MurmurHash3's finaliser chained over the key's
    32-bit words; the positions hashed apart first, so that two samples never see shifted copies of one row),
    vectorised over the batch."""
    h = torch.tensor(0x9E3779B9, dtype=torch.int64)
    for word in (seed & _WORD, (seed >> 32) & _WORD, stream & _WORD):
        h = _fmix32(h ^ word)
    keys = samples.to("cpu", torch.int64)
    h = _fmix32(h ^ (keys & _WORD))
    h = _fmix32(h ^ ((keys >> 32) & _WORD))
    positions = _fmix32(torch.arange(length, dtype=torch.int64) ^ 0x7F4A7C15)
    return _fmix32(h[:, None] ^ positions[None, :])


def keyed_uniform(seed: int, samples: torch.Tensor, stream: int, length: int) -> torch.Tensor:
    """:func:`keyed_bits` as float32 uniform on [0, 1) (24 bits each: exact in float32)."""
    return (keyed_bits(seed, samples, stream, length) >> 8).to(torch.float32) * 2.0**-24


def sample_keys(batch: dict, size: int) -> torch.Tensor:
    """What a training batch's random masks are keyed by: each sample's index in the run's sample stream, as the
    trainer gives it (:data:`~kilolayer.data.base.SAMPLE_INDEX`); for a batch without one (a test's, an
    example's), ``size`` consecutive keys from an offset drawn from the global RNG, so that its masks follow
    the global seed."""
    if SAMPLE_INDEX in batch:
        return batch[SAMPLE_INDEX]
    return int(torch.randint(0, 2**62, (1,))) + torch.arange(size, dtype=torch.int64)


def eval_generator(index: int, base: int = 1234) -> torch.Generator:
    """A fixed generator for evaluation batch ``index``, so evaluations at different steps see the same masks."""
    return torch.Generator().manual_seed(base + index)


def token_count(x: torch.Tensor, padding_mask: torch.Tensor | None) -> int:
    return int(x.numel() if padding_mask is None else (~padding_mask).sum())
