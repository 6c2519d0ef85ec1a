"""digits and digit_captions: fixed stratified splits, normalisation, upscaling, captions, config checks."""

from __future__ import annotations

import pytest
import torch

from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.data.digits import TEMPLATES, WORDS
from kilolayer.data.vocab import PAD, decode
from kilolayer.errors import ConfigError


def digits(name="digits", seed=0, options=None, **model):
    m = dict(input="patches", channels=1, image_size=8, patch_size=2)
    m.update(model)
    return load_source(
        load_config({"model": m, "data": {"name": name, "options": options or {}}, "train": {"seed": seed}})
    )


def test_splits_are_disjoint_stratified_and_cover_everything():
    s = digits()
    parts = {k: set(v) for k, v in s.splits.items()}
    assert sum(len(p) for p in parts.values()) == 1797 == len(set().union(*parts.values()))
    assert (len(s), s.eval_size, s.split_size("test")) == (1259, 179, 359)
    labels = s.columns["labels"]
    for split, frac in (("validation", 0.1), ("test", 0.2)):
        counts = torch.bincount(labels[s.examples(split)], minlength=10)
        totals = torch.bincount(labels, minlength=10)
        assert torch.all((counts - frac * totals).abs() <= 1)  # every class in proportion


def test_same_seed_same_splits_and_batches():
    a, b = digits(seed=3), digits(seed=3)
    assert a.splits == b.splits
    for step in (0, 19, 40):  # 40 * 32 > 1259: into the second epoch
        x, y = a.train_batch(step, 32), b.train_batch(step, 32)
        assert torch.equal(x["inputs"], y["inputs"]) and torch.equal(x["labels"], y["labels"])
    other = digits(seed=4)
    assert other.splits == a.splits  # train.seed shuffles the order, never the split
    assert not torch.equal(other.train_batch(0, 32)["labels"], a.train_batch(0, 32)["labels"])
    assert digits(options={"split_seed": 1}).splits != a.splits


def test_pixels_are_normalised_with_training_statistics():
    s = digits()
    train = s.columns["inputs"][s.examples("train")]
    assert float(train.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(train.std()) == pytest.approx(1.0, abs=1e-4)
    assert len(torch.unique(s.columns["inputs"])) == 17  # sixteen grey levels and zero, still distinct


def test_upscale_repeats_pixels():
    small, big = digits(), digits(image_size=32, patch_size=8)
    assert big.columns["inputs"].shape == (1797, 1, 32, 32)
    x = big.columns["inputs"][:5]
    assert torch.equal(x[:, :, ::4, ::4], small.columns["inputs"][:5])
    assert torch.equal(x, x[:, :, ::4, ::4].repeat_interleave(4, 2).repeat_interleave(4, 3))
    assert digits(image_size=16, options={"upscale": 2}).columns["inputs"].shape[-1] == 16


@pytest.mark.parametrize(
    "model, options, message",
    [
        ({"image_size": 12, "patch_size": 4}, {}, "model.image_size=12: digits are 8x8"),
        ({"image_size": 16}, {"upscale": 4}, "data.options.upscale=4 gives 32x32 images but model.image_size=16"),
        ({"channels": 3}, {}, "model.channels=3: data.name='digits' gives grey images"),
        ({"input": "tokens"}, {}, "data.name='digits' gives images: set model.input: patches"),
        ({}, {"upscale": 0}, "data.options.upscale=0"),
        ({}, {"flip": True}, "data.options.flip: unknown key"),
    ],
)
def test_config_mismatch_is_one_line(model, options, message):
    with pytest.raises(ConfigError) as err:
        digits(options=options, **model)
    assert str(err.value).startswith(message), str(err.value)


def test_eval_split_option_selects_test():
    s = digits(options={"eval_split": "test"})
    assert s.eval_size == 359
    assert torch.equal(next(s.eval_batches(359))["labels"], s.columns["labels"][s.examples("test")])


def test_captions_describe_the_label_with_varied_templates():
    s = digits("digit_captions")
    b = s.train_batch(0, 64)
    assert set(b) == {"images", "tokens", "padding_mask", "labels"}
    assert torch.equal(b["tokens"] == PAD, b["padding_mask"])
    texts = [decode(t) for t in b["tokens"]]
    for text, y in zip(texts, b["labels"].tolist()):
        assert WORDS[y] in text.split(" ") or str(y) in text or WORDS[y] + "," in text, text
    used = {
        TEMPLATES.index(t)
        for t in TEMPLATES
        for text in texts
        if text in {t.format(word=w, digit=d) for d, w in enumerate(WORDS)}
    }
    assert len(used) >= 6
    again = digits("digit_captions")
    assert torch.equal(again.train_batch(0, 64)["tokens"], b["tokens"])  # captions are fixed per image
    images = digits().columns["inputs"]
    assert torch.equal(s.columns["images"], images)
