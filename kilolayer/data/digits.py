"""scikit-learn's 1,797 handwritten 8x8 digits (ships with the package, works offline).

``digits`` gives ``{"inputs": float (B, 1, H, W), "labels": long (B,)}``;
``digit_captions`` pairs the same images with byte-tokenised captions made
from the label with varied templates ("a handwritten seven", "the digit 7",
...) for CLIP-style training: ``{"images", "tokens", "padding_mask", "labels"}``.

Split: stratified by class, seeded by ``data.options.split_seed`` (default 0,
independent of ``train.seed``): 10% validation (179 images), 20% test (359),
the rest (1,259) train. Pixels are scaled from 0..16 to [0, 1], then
normalised with the training split's mean and standard deviation. Option
``upscale`` (an integer, nearest neighbour) makes larger images so that e.g.
``model.image_size: 32, patch_size: 8`` gives a 4x4 patch grid; by default it
is ``model.image_size / 8``.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kilolayer.config import Config
from kilolayer.data.base import register_source
from kilolayer.data.memory import MemorySource, SplitOptions, split_indices
from kilolayer.data.options import parse_options
from kilolayer.data.vocab import BYTE_VOCAB, PAD, encode
from kilolayer.errors import ConfigError

NUM_CLASSES = 10
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = [
    "a handwritten {word}",
    "the digit {digit}",
    "a picture of the number {word}",
    "an 8 by 8 image of a {digit}",
    "{word}",
    "a scan of a handwritten {digit}",
    "the number {word}, written by hand",
    "a small grey digit: {digit}",
    "a blurry {word}",
    "digit {digit} ({word})",
]


class DigitsOptions(SplitOptions):
    upscale: int | None = Field(None, ge=1, description="integer nearest-neighbour factor; default image_size/8")
    test_fraction: float = Field(0.2, ge=0.0, lt=1.0)


def caption(label: int, template: int) -> str:
    """The caption of a digit ``label`` with template number ``template``."""
    return TEMPLATES[template % len(TEMPLATES)].format(word=WORDS[label], digit=label)


def _check_model(config: Config, opts: DigitsOptions) -> int:
    m, name = config.model, config.data.name
    if m.input != "patches":
        raise ConfigError(f"data.name={name!r} gives images: set model.input: patches (model.input={m.input!r})")
    if m.channels != 1:
        raise ConfigError(f"model.channels={m.channels}: data.name={name!r} gives grey images; set model.channels: 1")
    if opts.upscale is None:
        if m.image_size % 8:
            raise ConfigError(
                f"model.image_size={m.image_size}: digits are 8x8; use a multiple of 8 "
                "(data.options.upscale scales them)"
            )
        return m.image_size // 8
    if 8 * opts.upscale != m.image_size:
        raise ConfigError(
            f"data.options.upscale={opts.upscale} gives {8 * opts.upscale}x{8 * opts.upscale} images "
            f"but model.image_size={m.image_size}"
        )
    return opts.upscale


def load_digits(opts: DigitsOptions, upscale: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(images float (1797, 1, 8u, 8u) normalised, labels long (1797,), splits)."""
    from sklearn.datasets import load_digits as sk_load_digits

    raw = sk_load_digits()
    labels = torch.as_tensor(raw.target, dtype=torch.long)
    images = torch.as_tensor(raw.images, dtype=torch.float32)[:, None] / 16.0
    splits = split_indices(len(labels), opts.split_seed, opts.val_fraction, opts.test_fraction, labels)
    train = images[splits["train"]]
    images = (images - train.mean()) / train.std()
    if upscale > 1:
        images = images.repeat_interleave(upscale, dim=2).repeat_interleave(upscale, dim=3)
    return images.contiguous(), labels, splits


@register_source("digits")
def digits(config: Config) -> MemorySource:
    opts = parse_options(DigitsOptions, config.data.options, "data.options")
    images, labels, splits = load_digits(opts, _check_model(config, opts))
    return MemorySource(
        config.train.seed,
        {"inputs": images, "labels": labels},
        splits,
        opts.eval_split,
        num_classes=NUM_CLASSES,
        where="data.name='digits'",
    )


@register_source("digit_captions")
def digit_captions(config: Config) -> MemorySource:
    opts = parse_options(DigitsOptions, config.data.options, "data.options")
    images, labels, splits = load_digits(opts, _check_model(config, opts))
    # one fixed template per image, drawn with the split seed
    g = torch.Generator().manual_seed(opts.split_seed + 1)
    templates = torch.randint(len(TEMPLATES), (len(labels),), generator=g)
    captions = [encode(caption(int(y), int(t))) for y, t in zip(labels, templates)]
    source = MemorySource(
        config.train.seed,
        {"images": images, "tokens": captions, "labels": labels},
        splits,
        opts.eval_split,
        pad_id=PAD,
        num_classes=NUM_CLASSES,
        where="data.name='digit_captions'",
    )
    source.text_vocab = BYTE_VOCAB
    return source
