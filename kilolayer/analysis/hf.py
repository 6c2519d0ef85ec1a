"""Hugging Face models on disk as subjects of the smoothness analysis.

Loads any model directory with the Auto classes, offline: BERT-like encoders,
ViT and ViT-MAE (masking off, patches kept in grid order), CLIP (the vision
tower for images, the text tower for text), decoders such as GPT-2 and OPT.
Inputs are a text file (one sample per line, the model's own tokenizer) or an
image directory (the model's own image processor).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Before transformers/huggingface_hub read it: never reach for a hub.
os.environ["HF_HUB_OFFLINE"] = "1"

import torch

from kilolayer.errors import InputError

# Every Auto*.from_pretrained call: files on disk only, and never the model directory's own Python code
# (on a terminal, transformers would otherwise offer to run it).
LOAD_OPTIONS = {"local_files_only": True, "trust_remote_code": False}

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else err.__class__.__name__


def _transformers():
    try:
        import transformers
    except ImportError:
        raise InputError("--hf needs the Hugging Face extra: pip install 'kilolayer[hf]'") from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


@dataclass
class HFSubject:
    """A loaded model (the tower that takes ``kind`` inputs) and its preprocessor."""

    path: Path
    model: torch.nn.Module
    model_type: str
    kind: str  # "text" | "images"
    preprocess: object
    patch_size: int | None = None
    max_length: int | None = None

    @property
    def name(self) -> str:
        return self.path.resolve().name


def _accepts(model: torch.nn.Module, argument: str) -> bool:
    return argument in inspect.signature(model.forward).parameters


def load_hf(model_dir: str | Path, kind: str, device: str = "cpu") -> HFSubject:
    """Load the model in ``model_dir`` for ``kind`` ("text" or "images") inputs, in eval mode."""
    t = _transformers()
    path = Path(model_dir)
    if not path.is_dir():
        raise InputError(f"--hf {path}: no such directory")
    if not (path / "config.json").is_file():
        raise InputError(f"--hf {path}: not a Hugging Face model directory (no config.json)")
    try:
        config = t.AutoConfig.from_pretrained(path, **LOAD_OPTIONS)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError... for a bad config
        raise InputError(f"--hf {path}: cannot read config.json ({_first_line(err)})") from None
    if getattr(config, "model_type", "") == "vit_mae":
        config.mask_ratio = 0.0  # MAE masks 75% of patches by default; analyse the whole image
    try:
        model = t.AutoModel.from_pretrained(path, config=config, **LOAD_OPTIONS)
    except Exception as err:
        raise InputError(f"--hf {path}: cannot load the model ({_first_line(err)})") from None

    tower_name = "vision_model" if kind == "images" else "text_model"
    if hasattr(model, tower_name):  # CLIP-like dual encoders
        model = getattr(model, tower_name)
    argument = "pixel_values" if kind == "images" else "input_ids"
    if not _accepts(model, argument):
        other = "--text" if kind == "images" else "--images"
        raise InputError(f"--hf {path}: a {config.model_type} model does not take {kind}; use {other}")
    tower_config = getattr(model, "config", config)

    if kind == "images":
        try:
            preprocess = t.AutoImageProcessor.from_pretrained(path, **LOAD_OPTIONS)
        except Exception as err:
            raise InputError(f"--hf {path}: no usable image processor ({_first_line(err)})") from None
        patch = getattr(tower_config, "patch_size", None)
        patch = patch[0] if isinstance(patch, (tuple, list)) else patch
        return HFSubject(path, model.to(device).eval(), config.model_type, kind, preprocess, patch_size=patch)

    try:
        tokenizer = t.AutoTokenizer.from_pretrained(path, **LOAD_OPTIONS)
    except Exception as err:
        raise InputError(f"--hf {path}: no usable tokenizer ({_first_line(err)})") from None
    if tokenizer.pad_token is None:  # GPT-2, OPT-style tokenizers: padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    # the shortest real limit; tokenizers without one report a huge model_max_length
    limits = [tokenizer.model_max_length] + [
        getattr(tower_config, k, None) for k in ("max_position_embeddings", "n_positions")
    ]
    limits = [int(x) for x in limits if isinstance(x, int) and 0 < x < 1_000_000]
    max_length = min(limits) if limits else None
    return HFSubject(path, model.to(device).eval(), config.model_type, kind, tokenizer, max_length=max_length)


# ---------------------------------------------------------------- inputs


def read_lines(path: str | Path, limit: int | None = None) -> list[str]:
    """The non-blank lines of a UTF-8 text file (at most ``limit``)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--text {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--text {path}: not UTF-8 text") from None
    except OSError as err:
        raise InputError(f"--text {path}: cannot read ({err.__class__.__name__})") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise InputError(f"--text {path}: no non-empty lines (expected one sample per line)")
    return lines[:limit] if limit else lines


def read_images(path: str | Path, limit: int | None = None) -> tuple[list, list[str]]:
    """(RGB PIL images, names of files skipped as unreadable) from a directory, searched recursively in
    sorted order; stops after ``limit`` images."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_dir():
        raise InputError(f"--images {path}: no such directory")
    images, skipped = [], []
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
        if limit and len(images) >= limit:
            break
        try:
            with Image.open(f) as im:
                images.append(im.convert("RGB"))
        except (UnidentifiedImageError, OSError, ValueError):
            skipped.append(f.name)
    if not images:
        what = f"{len(skipped)} files, none an image (e.g. {skipped[0]})" if skipped else "no files"
        raise InputError(f"--images {path}: no readable images ({what}; expected {', '.join(sorted(IMAGE_SUFFIXES))})")
    return images, skipped


def batches(subject: HFSubject, samples: list, batch_size: int, device: str = "cpu") -> Iterator[tuple[dict, object]]:
    """``(model kwargs, padding mask or None)`` for each batch of text lines or images."""
    model = subject.model
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        if subject.kind == "text":
            enc = subject.preprocess(
                chunk,
                padding=True,
                truncation=subject.max_length is not None,
                max_length=subject.max_length,
                return_tensors="pt",
            )
            kwargs = {k: v.to(device) for k, v in enc.items() if _accepts(model, k)}
            yield kwargs, (enc["attention_mask"] == 0).to(device)
        else:
            pixels = subject.preprocess(images=chunk, return_tensors="pt")["pixel_values"].to(device)
            kwargs = {"pixel_values": pixels}
            if subject.model_type == "vit_mae":
                # MAE shuffles patches by argsort(noise); increasing noise keeps them in grid order
                n = (pixels.shape[-2] // subject.patch_size) * (pixels.shape[-1] // subject.patch_size)
                kwargs["noise"] = torch.arange(n, dtype=torch.float32, device=device).expand(len(chunk), n)
            yield kwargs, None


def image_grid(subject: HFSubject, samples: list) -> int | None:
    """Patches per side for a square patch grid, from the processor's actual output size."""
    if subject.kind != "images" or not subject.patch_size:
        return None
    h, w = subject.preprocess(images=samples[:1], return_tensors="pt")["pixel_values"].shape[-2:]
    if h != w or h % subject.patch_size:
        return None
    return h // subject.patch_size


def smoothness_of_hf(
    model_dir: str | Path,
    *,
    text: str | Path | None = None,
    images: str | Path | None = None,
    samples: int = 128,
    batch_size: int = 32,
    exclude_first: bool = False,
    device: str = "cpu",
) -> dict:
    """:func:`kilolayer.analysis.smoothness.smoothness` of a Hugging Face model directory on a text file
    or an image directory, with metadata (``source``, ``path``, ``name``, ``input``, ``depth``, ``grid``)."""
    from kilolayer.analysis.smoothness import smoothness

    if (text is None) == (images is None):
        raise InputError("--hf: give exactly one of --text FILE or --images DIR")
    if samples < 1 or batch_size < 1:
        raise InputError(f"--samples {samples} / --batch-size {batch_size}: must be positive")
    kind = "text" if text is not None else "images"
    # read inputs first: a bad file is reported before the (slower) model load
    skipped: list[str] = []
    if kind == "text":
        data = read_lines(text, samples)
    else:
        data, skipped = read_images(images, samples)
    subject = load_hf(model_dir, kind, device)
    grid = image_grid(subject, data)
    result = smoothness(
        subject.model, batches(subject, data, batch_size, device), grid=grid, exclude_first=exclude_first
    )
    result.update(
        source="hf",
        path=str(Path(model_dir).resolve()),
        name=subject.name,
        input=f"{kind}:{Path(text if text is not None else images).resolve()}",
        depth=len(result["layers"]) - 1,
        grid=grid,
        model=subject.model_type,
    )
    if skipped:
        result["skipped_files"] = len(skipped)
    return result


__all__ = ["HFSubject", "load_hf", "read_lines", "read_images", "batches", "image_grid", "smoothness_of_hf"]
