"""A user's images: a folder of class sub-folders, or a folder of images with captions.

``image_folder``: ``data.path`` holds one sub-folder per class (class ids follow
the sorted folder names); batches are ``{"inputs": float (B, C, H, W),
"labels": long (B,)}``. ``image_captions``: ``data.path`` holds images and a
captions file (``data.options.captions``, default ``captions.txt`` in that
folder) with either one ``name<TAB>caption`` line per image, or one caption per
line matching the images in sorted file-name order; batches are ``{"images",
"tokens", "padding_mask"}`` with byte tokens (or ``data.options.tokenizer``).

Images are read once, converted to grey (``model.channels: 1``) or RGB (3),
resized to ``model.image_size`` square (bilinear), scaled to [0, 1] and
normalised per channel with the training split's mean and standard deviation
(``normalize: false`` keeps [0, 1]). Files whose suffix is not an image suffix
(and hidden files) are ignored; an image suffix that PIL cannot read is an
error naming the file. Splits as in :mod:`kilolayer.data.memory` (stratified by
class for ``image_folder``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from kilolayer.config import Config
from kilolayer.data.base import register_source
from kilolayer.data.memory import MemorySource, SplitOptions, split_indices
from kilolayer.data.options import parse_options
from kilolayer.data.text import encode_all, make_tokenizer
from kilolayer.errors import ConfigError, InputError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


def check_image_model(config: Config) -> None:
    m, name = config.model, config.data.name
    if m.input != "patches":
        raise ConfigError(f"model.input={m.input!r}: data.name={name!r} gives images; set model.input: patches")
    if m.channels not in (1, 3):
        raise ConfigError(f"model.channels={m.channels}: images load as grey (1) or RGB (3)")


def image_folder_path(config: Config) -> Path:
    if config.data.path is None:
        raise ConfigError(f"data.path: data.name={config.data.name!r} needs a folder")
    p = Path(config.data.path)
    if not p.is_dir():
        raise InputError(f"{p}: no such folder (data.path)")
    return p


def list_images(folder: Path) -> list[Path]:
    """Image files directly in ``folder``, sorted by name."""
    return sorted(
        f for f in folder.iterdir() if f.is_file() and not f.name.startswith(".") and f.suffix.lower() in IMAGE_SUFFIXES
    )


def image_to_tensor(im, size: int, channels: int) -> torch.Tensor:
    """A PIL image -> uint8 (channels, size, size), grey or RGB, resized bilinearly."""
    from PIL import Image

    im = im.convert("L" if channels == 1 else "RGB").resize((size, size), Image.Resampling.BILINEAR)
    t = torch.from_numpy(np.array(im, dtype=np.uint8))
    return t[None] if channels == 1 else t.permute(2, 0, 1).contiguous()


def read_image(path: Path, size: int, channels: int) -> torch.Tensor:
    """uint8 (channels, size, size); one line naming ``path`` if it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return image_to_tensor(im, size, channels)
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        reason = str(err).split("\n")[0] or type(err).__name__
        raise InputError(f"{path}: cannot read image ({reason})") from None


def to_float(images: torch.Tensor, train: torch.Tensor, normalize: bool) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float in [0, 1], normalised per channel by the ``train`` rows' statistics."""
    x = images.float() / 255.0
    if normalize:
        t = x[train]
        mean = t.mean(dim=(0, 2, 3), keepdim=True)
        std = t.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
        x = (x - mean) / std
    return x


class ImageFolderOptions(SplitOptions):
    normalize: bool = True


class ImageCaptionOptions(SplitOptions):
    normalize: bool = True
    captions: str = "captions.txt"
    tokenizer: str | None = None
    max_len: int = Field(64, ge=1, description="longest caption in tokens (the text tower's max_len)")


def class_folders(root: Path) -> list[str]:
    """The class sub-folder names of ``root``, sorted (class id = position)."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise InputError(f"{root}: no class sub-folders (expected one folder of images per class)")
    return classes


@register_source("image_folder", reads=("path",))
def image_folder(config: Config) -> MemorySource:
    opts = parse_options(ImageFolderOptions, config.data.options, "data.options")
    check_image_model(config)
    root = image_folder_path(config)
    classes = class_folders(root)
    if len(classes) < 2:  # one class: every label is 0, and the loss is 0 from the first step
        raise InputError(
            f"{root}: one class sub-folder ({classes[0]}); a classifier needs at least two (one folder per class)"
        )
    files, labels = [], []
    for c, name in enumerate(classes):
        found = list_images(root / name)
        if not found:
            raise InputError(f"{root / name}: empty class folder (no image files)")
        files += found
        labels += [c] * len(found)
    size, ch = config.model.image_size, config.model.channels
    raw = torch.stack([read_image(f, size, ch) for f in files])
    y = torch.as_tensor(labels, dtype=torch.long)
    splits = split_indices(len(files), opts.split_seed, opts.val_fraction, opts.test_fraction, y)
    source = MemorySource(
        config.train.seed,
        {"inputs": to_float(raw, splits["train"], opts.normalize), "labels": y},
        splits,
        opts.eval_split,
        num_classes=len(classes),
        where=f"data.path={root}",
    )
    source.classes = classes
    source.files = files
    return source


def read_captions(root: Path, captions: str) -> tuple[list[Path], list[str]]:
    """(image files, captions) from the captions file, in either of its two formats."""
    cap = Path(captions) if Path(captions).is_absolute() else root / captions
    if not cap.is_file():
        raise InputError(f"{cap}: no such captions file (data.options.captions)")
    try:
        lines = [(n, ln.rstrip("\r")) for n, ln in enumerate(cap.read_text(encoding="utf-8").split("\n"), 1)]
    except UnicodeDecodeError as err:
        raise InputError(f"{cap}: not UTF-8 text (bad byte at offset {err.start})") from None
    lines = [(n, ln) for n, ln in lines if ln.strip()]
    if not lines:
        raise InputError(f"{cap}: no captions")
    if "\t" in lines[0][1]:
        files, texts = [], []
        for n, ln in lines:
            if "\t" not in ln:
                raise InputError(f"{cap}:{n}: expected name<TAB>caption like the first line")
            name, text = ln.split("\t", 1)
            if not text.strip():
                raise InputError(f"{cap}:{n}: empty caption")
            f = root / name.strip()
            if not f.is_file():
                raise InputError(f"{cap}:{n}: no image {name.strip()!r} in {root}")
            files.append(f)
            texts.append(text)
        return files, texts
    files = list_images(root)
    if len(files) != len(lines):
        raise InputError(
            f"{cap}: {len(lines)} captions for {len(files)} images in {root} "
            "(one line per image in sorted file-name order, or name<TAB>caption lines)"
        )
    return files, [ln for _, ln in lines]


@register_source("image_captions", reads=("path",), path_options=("tokenizer",))
def image_captions(config: Config) -> MemorySource:
    opts = parse_options(ImageCaptionOptions, config.data.options, "data.options")
    check_image_model(config)
    root = image_folder_path(config)
    files, texts = read_captions(root, opts.captions)
    tok = make_tokenizer(opts.tokenizer)
    size, ch = config.model.image_size, config.model.channels
    raw = torch.stack([read_image(f, size, ch) for f in files])
    splits = split_indices(len(files), opts.split_seed, opts.val_fraction, opts.test_fraction)
    columns = {
        "images": to_float(raw, splits["train"], opts.normalize),
        "tokens": encode_all(texts, tok, opts.max_len, False),
    }
    source = MemorySource(
        config.train.seed, columns, splits, opts.eval_split, pad_id=tok.pad_id, where=f"data.path={root}"
    )
    source.files = files
    source.text_vocab = tok.vocab_size
    return source
