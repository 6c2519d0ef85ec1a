"""image_folder and image_captions: reading, resizing, splits, and one clear line for every bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.data.vocab import decode
from kilolayer.errors import ConfigError, InputError

COLOURS = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}


def write_image(path, colour, seed):
    rng = np.random.default_rng(seed)
    arr = np.clip(np.array(colour)[None, None, :] * 0.8 + rng.integers(0, 50, (12, 10, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(arr).save(path)


def make_folder(root, per_class=10):
    for k, (c, colour) in enumerate(COLOURS.items()):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            write_image(root / c / f"{i:03d}.png", colour, 100 * k + i)
    (root / "red" / "notes.txt").write_text("not an image, ignored")
    return root


def source(name, path, options=None, seed=0, **model):
    m = dict(input="patches", channels=3, image_size=8, patch_size=4)
    m.update(model)
    cfg = {"model": m, "data": {"name": name, "path": str(path), "options": options or {}}, "train": {"seed": seed}}
    return load_source(load_config(cfg))


def test_image_folder_reads_classes_and_resizes(tmp_path):
    root = make_folder(tmp_path / "imgs")
    s = source("image_folder", root, {"normalize": False})
    assert s.classes == ["blue", "green", "red"] and s.num_classes == 3
    x, y = s.columns["inputs"], s.columns["labels"]
    assert x.shape == (30, 3, 8, 8) and float(x.min()) >= 0 and float(x.max()) <= 1
    dominant = x.mean(dim=(2, 3)).argmax(1)  # channel index: red 0, green 1, blue 2
    assert torch.equal(dominant, torch.tensor([2, 1, 0])[y])
    grey = source("image_folder", root, channels=1)
    assert grey.columns["inputs"].shape == (30, 1, 8, 8)
    b = grey.train_batch(0, 4)
    assert set(b) == {"inputs", "labels"} and b["inputs"].dtype == torch.float32


def test_image_folder_splits_are_disjoint_stratified_and_repeatable(tmp_path):
    root = make_folder(tmp_path / "imgs")
    a = source("image_folder", root, {"val_fraction": 0.2, "test_fraction": 0.2})
    b = source("image_folder", root, {"val_fraction": 0.2, "test_fraction": 0.2})
    assert a.splits == b.splits
    parts = [set(v) for v in a.splits.values()]
    assert sum(map(len, parts)) == 30 == len(set().union(*parts))
    assert torch.equal(torch.bincount(a.columns["labels"][a.examples("validation")]), torch.tensor([2, 2, 2]))
    assert torch.equal(a.train_batch(3, 8)["inputs"], b.train_batch(3, 8)["inputs"])
    train = a.columns["inputs"][a.examples("train")]
    assert torch.allclose(train.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5)  # normalised by training stats


def test_image_folder_bad_inputs_name_the_path(tmp_path):
    with pytest.raises(InputError, match=f"^{tmp_path / 'nope'}: no such folder"):
        source("image_folder", tmp_path / "nope")
    (tmp_path / "flat").mkdir()
    with pytest.raises(InputError, match="no class sub-folders"):
        source("image_folder", tmp_path / "flat")
    root = make_folder(tmp_path / "imgs", per_class=3)
    (root / "zebra").mkdir()
    (root / "zebra" / "readme.md").write_text("no images here")
    with pytest.raises(InputError, match=f"^{root / 'zebra'}: empty class folder"):
        source("image_folder", root)
    (root / "zebra" / "bad.png").write_bytes(b"\x89PNG but not really")
    with pytest.raises(InputError) as err:
        source("image_folder", root)
    assert str(err.value).startswith(f"{root / 'zebra' / 'bad.png'}: cannot read image")
    assert "\n" not in str(err.value)


def test_image_folder_config_checks(tmp_path):
    root = make_folder(tmp_path / "imgs", per_class=3)
    with pytest.raises(ConfigError, match="^model.channels=4: images load as grey"):
        source("image_folder", root, channels=4)
    with pytest.raises(ConfigError, match="^data.path: data.name='image_folder' needs a folder"):
        load_source(load_config({"model": {"input": "patches", "image_size": 8}, "data": {"name": "image_folder"}}))


def captions_folder(root, n=12, tsv=True):
    root.mkdir()
    lines = []
    for i in range(n):
        colour = list(COLOURS)[i % 3]
        write_image(root / f"img{i:02d}.png", COLOURS[colour], i)
        lines.append(f"img{i:02d}.png\ta {colour} square" if tsv else f"a {colour} square")
    (root / "captions.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize("tsv", [True, False])
def test_image_captions_pairs_images_with_captions(tmp_path, tsv):
    root = captions_folder(tmp_path / "caps", tsv=tsv)
    s = source("image_captions", root, {"val_fraction": 0.25, "test_fraction": 0.25})
    b = s.collate(list(range(len(s))), "train")
    assert set(b) == {"images", "tokens", "padding_mask"}
    for img, tokens in zip(b["images"], b["tokens"]):
        colour = decode(tokens).split(" ")[1]
        assert int(img.mean(dim=(1, 2)).argmax()) == {"red": 0, "green": 1, "blue": 2}[colour]
    assert (len(s), s.eval_size, s.split_size("test")) == (6, 3, 3)
    assert s.text_vocab == 262 > int(b["tokens"].max())  # byte captions: what a text tower must hold


def test_image_captions_bad_inputs(tmp_path):
    root = captions_folder(tmp_path / "caps", n=6, tsv=False)
    (root / "captions.txt").write_text("one\ntwo\nthree\n")
    with pytest.raises(InputError, match=r"captions.txt: 3 captions for 6 images in"):
        source("image_captions", root)
    (root / "captions.txt").write_text("img00.png\tfine\nimg99.png\tmissing\n")
    with pytest.raises(InputError, match=r"captions.txt:2: no image 'img99.png' in"):
        source("image_captions", root)
    (root / "captions.txt").write_text("img00.png\tfine\nimg01.png\t\n")
    with pytest.raises(InputError, match=r"captions.txt:2: empty caption"):
        source("image_captions", root)
    (root / "captions.txt").unlink()
    with pytest.raises(InputError, match=r"captions.txt: no such captions file"):
        source("image_captions", root)


def test_an_image_folder_of_one_class_is_refused(tmp_path):
    root = tmp_path / "one"
    (root / "cat").mkdir(parents=True)
    for i in range(4):
        write_image(root / "cat" / f"{i}.png", (200, 10, 10), i)
    with pytest.raises(InputError, match=f"^{root}: one class sub-folder \\(cat\\); a classifier needs at least two"):
        source("image_folder", root)
