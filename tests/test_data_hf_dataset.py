"""hf_dataset: datasets saved with save_to_disk, columns named in data.options."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.data.vocab import decode
from kilolayer.errors import ConfigError, InputError

datasets = pytest.importorskip("datasets")


def source(path, options, seed=0, **model):
    m = dict(input="patches", channels=1, image_size=8, patch_size=4)
    m.update(model)
    cfg = {"model": m, "data": {"name": "hf_dataset", "path": str(path), "options": options}, "train": {"seed": seed}}
    return load_source(load_config(cfg))


def image_dataset(n=40):
    rng = np.random.default_rng(0)
    images = [(rng.integers(0, 60, (6, 6)) + 150 * (i % 2)).astype(np.uint8) for i in range(n)]
    features = datasets.Features(
        {
            "img": datasets.Image(),
            "digit": datasets.ClassLabel(names=["dark", "bright"]),
            "caption": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_dict(
        {
            "img": images,
            "digit": [i % 2 for i in range(n)],
            "caption": [["a dark one", "a bright one"][i % 2] for i in range(n)],
        },
        features=features,
    )


def test_images_with_class_labels(tmp_path):
    image_dataset().save_to_disk(str(tmp_path / "ds"))
    a = source(tmp_path / "ds", {"image": "img", "label": "digit", "val_fraction": 0.2, "test_fraction": 0.2})
    b = source(tmp_path / "ds", {"image": "img", "label": "digit", "val_fraction": 0.2, "test_fraction": 0.2})
    assert a.num_classes == 2 and a.splits == b.splits
    assert (len(a), a.eval_size, a.split_size("test")) == (24, 8, 8)
    parts = [set(v) for v in a.splits.values()]
    assert len(set().union(*parts)) == 40
    batch = a.train_batch(0, 8)
    assert set(batch) == {"inputs", "labels"} and batch["inputs"].shape == (8, 1, 8, 8)
    bright = batch["inputs"].mean(dim=(1, 2, 3)) > 0
    assert torch.equal(bright, batch["labels"] == 1)


def test_images_with_captions_give_contrastive_batches(tmp_path):
    image_dataset().save_to_disk(str(tmp_path / "ds"))
    s = source(tmp_path / "ds", {"image": "img", "text": "caption", "label": "digit"})
    batch = s.train_batch(0, 6)
    assert set(batch) == {"images", "tokens", "padding_mask", "labels"}
    for tokens, y in zip(batch["tokens"], batch["labels"].tolist()):
        assert decode(tokens) == ["a dark one", "a bright one"][y]
    assert s.text_vocab == 262 > int(batch["tokens"].max())  # byte captions: what a text tower must hold


def test_dataset_dict_keeps_its_own_splits(tmp_path):
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"s": [f"train {i}" for i in range(30)], "y": ["a", "b", "c"] * 10}),
            "test": datasets.Dataset.from_dict({"s": [f"test {i}" for i in range(6)], "y": ["a", "b", "c"] * 2}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    s = source(tmp_path / "dd", {"text": "s", "label": "y"}, input="tokens", vocab_size=262, max_len=16)
    assert s.num_classes == 3
    test_texts = {decode(s.columns["tokens"][i]) for i in s.examples("test")}
    assert test_texts == {f"test {i}" for i in range(6)}
    val_texts = {decode(s.columns["tokens"][i]) for i in s.examples("validation")}
    assert len(val_texts) == 3 and all(t.startswith("train") for t in val_texts)  # cut from train, 10%
    assert set(s.train_batch(0, 4)) == {"tokens", "padding_mask", "labels"}


def test_bad_inputs(tmp_path):
    image_dataset(8).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(
        ConfigError, match=r"^data.options.label='nope': no such column in .* \(columns: img, digit, caption\)"
    ):
        source(tmp_path / "ds", {"image": "img", "label": "nope"})
    with pytest.raises(ConfigError, match="^data.options.image / data.options.text: name at least one column"):
        source(tmp_path / "ds", {"label": "digit"})
    with pytest.raises(InputError, match=f"^{tmp_path / 'missing'}: no such folder"):
        source(tmp_path / "missing", {"image": "img"})
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("hi")
    with pytest.raises(InputError, match="junk: not a dataset saved with save_to_disk"):
        source(tmp_path / "junk", {"image": "img"})
    datasets.DatasetDict({"validation": image_dataset(4)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match="^data.options.train_split='train': .* has splits validation"):
        source(tmp_path / "dd", {"image": "img"})


def test_undecodable_image_bytes_name_the_dataset(tmp_path):
    broken = datasets.Dataset.from_dict(
        {"img": [{"bytes": b"not an image", "path": None}]}, features=datasets.Features({"img": datasets.Image()})
    )
    broken.save_to_disk(str(tmp_path / "broken"))
    with pytest.raises(InputError, match=f"^{tmp_path / 'broken'}: cannot decode the images of column 'img'"):
        source(tmp_path / "broken", {"image": "img"})
