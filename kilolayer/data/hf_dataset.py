"""A Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (needs ``pip install 'kilolayer[hf]'``).

``data.name: hf_dataset``, ``data.path: DIR``; ``data.options`` names the
columns: ``image``, ``text`` and/or ``label``. The batch follows the columns:

* image + label            -> ``{"inputs", "labels"}``  (classification)
* image + text (+ label)   -> ``{"images", "tokens", "padding_mask"(, "labels")}``  (contrastive)
* text (+ label)           -> ``{"tokens", "padding_mask"(, "labels")}``  (mlm, classification, ...)

A ``DatasetDict`` gives its ``train_split`` (default ``train``) and, where it
has them, ``validation`` and ``test``; a missing split (or all of them, for a
plain ``Dataset``) is cut from the training part as in
:mod:`kilolayer.data.memory`. A ``ClassLabel`` column keeps its ids; other
label values map to ids by sorted value. Images and text are prepared as in
:mod:`kilolayer.data.images` and :mod:`kilolayer.data.text`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from kilolayer.config import Config
from kilolayer.data.base import register_source
from kilolayer.data.images import check_image_model, image_to_tensor, to_float
from kilolayer.data.memory import MemorySource, SplitOptions, split_indices
from kilolayer.data.options import parse_options
from kilolayer.data.text import check_vocab, encode_all, label_ids, make_tokenizer
from kilolayer.errors import ConfigError, InputError


class HFDatasetOptions(SplitOptions):
    image: str | None = None
    text: str | None = None
    label: str | None = None
    train_split: str = "train"
    tokenizer: str | None = None
    max_len: int | None = Field(None, ge=1, description="default: model.max_len for text-only data, else 64")
    add_cls: bool = False
    normalize: bool = True


def load_dataset_dir(path: str | None):
    if path is None:
        raise ConfigError("data.path: data.name='hf_dataset' needs a folder written by Dataset.save_to_disk")
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"{p}: no such folder (data.path)")
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.name='hf_dataset' needs Hugging Face datasets: pip install 'kilolayer[hf]'") from None
    try:
        return datasets.load_from_disk(str(p))
    except Exception as err:  # datasets raises several kinds for a folder that is not a saved dataset
        raise InputError(f"{p}: not a dataset saved with save_to_disk ({type(err).__name__})") from None


def _as_pil(value, where: str):
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    try:
        return Image.fromarray(np.asarray(value).astype(np.uint8))
    except (TypeError, ValueError) as err:
        raise InputError(f"{where}: cannot read an image from a {type(value).__name__} ({err})") from None


@register_source("hf_dataset", reads=("path",), path_options=("tokenizer",))
def hf_dataset(config: Config) -> MemorySource:
    import datasets

    opts = parse_options(HFDatasetOptions, config.data.options, "data.options")
    if not (opts.image or opts.text):
        raise ConfigError("data.options.image / data.options.text: name at least one column of the saved dataset")
    path = config.data.path
    loaded = load_dataset_dir(path)
    if isinstance(loaded, datasets.DatasetDict):
        if opts.train_split not in loaded:
            raise ConfigError(
                f"data.options.train_split={opts.train_split!r}: {path} has splits {', '.join(loaded.keys())}"
            )
        parts = {"train": loaded[opts.train_split]}
        parts.update({s: loaded[s] for s in ("validation", "test") if s in loaded})
    else:
        parts = {"train": loaded}
    columns_have = parts["train"].column_names
    for key in ("image", "text", "label"):
        col = getattr(opts, key)
        if col is not None and col not in columns_have:
            raise ConfigError(
                f"data.options.{key}={col!r}: no such column in {path} (columns: {', '.join(columns_have)})"
            )

    # every example of every part in one table; splits are index ranges into it
    order = [s for s in ("train", "validation", "test") if s in parts]
    offsets, n = {}, 0
    for s in order:
        offsets[s], n = n, n + len(parts[s])
    ranges = {s: torch.arange(offsets[s], offsets[s] + len(parts[s])) for s in order}

    def column(col):
        return [v for s in order for v in parts[s][col]]

    columns: dict = {}
    labels, num_classes = None, None
    if opts.label:
        feature = parts["train"].features[opts.label]
        values = column(opts.label)
        if isinstance(feature, datasets.ClassLabel):
            labels, num_classes = torch.as_tensor(values, dtype=torch.long), feature.num_classes
        else:
            labels, names = label_ids(values)
            num_classes = len(names)
        columns["labels"] = labels

    # cut the splits the dataset lacks from its training part
    missing_val, missing_test = "validation" not in parts, "test" not in parts
    if missing_val or missing_test:
        train = ranges["train"]
        cut = split_indices(
            len(train),
            opts.split_seed,
            opts.val_fraction if missing_val else 0.0,
            opts.test_fraction if missing_test else 0.0,
            None if labels is None else labels[train],
        )
        ranges["train"] = train[cut["train"]]
        if missing_val:
            ranges["validation"] = train[cut["validation"]]
        if missing_test:
            ranges["test"] = train[cut["test"]]

    if opts.image:
        check_image_model(config)
        size, ch = config.model.image_size, config.model.channels
        try:  # datasets decodes stored image bytes lazily, here
            values = column(opts.image)
        except (OSError, ValueError) as err:
            raise InputError(f"{path}: cannot decode the images of column {opts.image!r} ({err})") from None
        raw = torch.stack(
            [image_to_tensor(_as_pil(v, f"{path} [{opts.image}] row {i}"), size, ch) for i, v in enumerate(values)]
        )
        columns["images" if opts.text else "inputs"] = to_float(raw, ranges["train"], opts.normalize)
    tok = make_tokenizer(opts.tokenizer)
    if opts.text:
        if not opts.image:
            if config.model.input != "tokens":
                raise ConfigError(
                    f"model.input={config.model.input!r}: text-only data gives tokens; set model.input: tokens"
                )
            check_vocab(config.model.vocab_size, tok)
        max_len = opts.max_len or (config.model.max_len if not opts.image else 64)
        columns["tokens"] = encode_all([str(t) for t in column(opts.text)], tok, max_len, opts.add_cls)
    source = MemorySource(
        config.train.seed,
        columns,
        ranges,
        opts.eval_split,
        pad_id=tok.pad_id,
        num_classes=num_classes,
        where=f"data.path={path}",
    )
    if opts.text and opts.image:
        source.text_vocab = tok.vocab_size
    return source
