"""Your own data: each source that reads a user's files has an example config that trains on the sample in
examples/data/, lists every option of its source with a comment, and docs/data.md states every option and how
the splits are taken (the split sizes checked here on the samples)."""

from __future__ import annotations

import math
import re

import pytest
import yaml

from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.data.hf_dataset import HFDatasetOptions
from kilolayer.data.images import ImageCaptionOptions, ImageFolderOptions
from kilolayer.data.mnist import IdxOptions
from kilolayer.data.stdlib import StdlibOptions
from kilolayer.data.synthetic import ParallelFilesOptions
from kilolayer.data.text import TextOptions
from kilolayer.rundir import read_metrics, read_status
from kilolayer.train.run import train
from tests.helpers import ROOT

# each source that reads a user's files: its options model and its example config (None: documented only)
SOURCES = {
    "text_bytes": (StdlibOptions, "configs/own_text_bytes.yaml"),
    "text": (TextOptions, "configs/own_text.yaml"),
    "parallel": (ParallelFilesOptions, "configs/own_parallel.yaml"),
    "image_folder": (ImageFolderOptions, "configs/own_images.yaml"),
    "image_captions": (ImageCaptionOptions, "configs/own_image_captions.yaml"),
    "idx": (IdxOptions, "configs/own_idx.yaml"),
    "hf_dataset": (HFDatasetOptions, None),
}
EXAMPLES = [name for name, (_, path) in SOURCES.items() if path]


def own_data_section() -> str:
    text = (ROOT / "docs" / "data.md").read_text()
    return text[text.index("## Your own data") : text.index("\n## ", text.index("## Your own data") + 1)]


def options_bullet(name: str) -> str:
    """The docs' bullet that lists ``name``'s options."""
    section = own_data_section()
    found = re.search(rf"^- `{name}`: (.*?)(?=^- |\Z)", section, re.M | re.S)
    assert found, f"docs/data.md lists no options of {name}"
    return found.group(1)


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_example_config_trains_on_its_sample(name, tmp_path):
    config = load_config(ROOT / SOURCES[name][1], ["train.steps=2", "train.eval_every=2", "train.eval_batches=1"])
    assert config.data.name == name
    assert train(config, tmp_path / "run", quiet=True) == {"status": "completed", "step": 2}
    assert read_status(tmp_path / "run")["status"] == "completed"
    (final,) = [r for r in read_metrics(tmp_path / "run") if r["split"] == "eval"]
    assert final["step"] == 2 and math.isfinite(final["loss"])


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_example_config_lists_every_option_of_its_source_with_a_comment(name):
    model, path = SOURCES[name]
    text = (ROOT / path).read_text()
    options = yaml.safe_load(text)["data"]["options"]
    assert set(options) == set(model.model_fields)
    block = text[text.index("  options:\n") :]
    for key in model.model_fields:
        (line,) = [ln for ln in block.splitlines() if ln.strip().startswith(f"{key}:")]
        assert "  # " in line, f"{path}: data.options.{key} has no comment"
    # the values written are the defaults, or a value that the source accepts
    model.model_validate({k: v for k, v in options.items()})


@pytest.mark.parametrize("name", list(SOURCES))
def test_the_docs_state_every_option_of_each_source(name):
    model, path = SOURCES[name]
    bullet = options_bullet(name)
    for key in model.model_fields:
        assert f"`{key}`" in bullet, f"docs/data.md: {name}'s option {key} is not stated"
    row = next(ln for ln in own_data_section().splitlines() if ln.startswith(f"| `{name}` |"))
    assert (f"`{path}`" if path else "none (its options are below)") in row


def splits(name: str) -> dict[str, int]:
    config = load_config(ROOT / SOURCES[name][1])
    source = load_source(config)
    return {s: len(rows) for s, rows in getattr(source, "splits", {}).items()}


def test_the_splits_are_taken_as_the_docs_say():
    # text: 120 lines, 60 per label; 10% of each label to test, 10% to validation
    assert splits("text") == {"train": 96, "validation": 12, "test": 12}
    # image_folder: 24 images per class, round(2.4) = 2 of each to test and to validation
    assert splits("image_folder") == {"train": 40, "validation": 4, "test": 4}
    # image_captions: 48 pairs at random, round(4.8) = 5 to test and to validation
    assert splits("image_captions") == {"train": 38, "validation": 5, "test": 5}
    # idx: the 16 t10k images are the test split; 10% of each class of the 48 training images validate
    assert splits("idx") == {"train": 44, "validation": 4, "test": 16}

    # text_bytes: the last 10% of the file's bytes validate
    config = load_config(ROOT / SOURCES["text_bytes"][1])
    data = (ROOT / "examples" / "data" / "corpus.txt").read_bytes()
    source = load_source(config)
    cut = len(data) * 90 // 100
    assert bytes(source.train.tolist()) == data[:cut] and bytes(source.valid.tolist()) == data[cut:]

    # parallel: the first 5% of the 150 pairs, in file order, validate
    config = load_config(ROOT / SOURCES["parallel"][1])
    source = load_source(config)
    lines = (ROOT / "examples" / "data" / "de.txt").read_text().splitlines()
    assert len(source.valid) == 150 * 5 // 100 and len(source.train) == 150 - 7
    assert [bytes(s).decode() for s, _ in source.valid] == lines[:7]
