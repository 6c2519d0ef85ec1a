"""Sequence-level classification: learns digits and text, pools correctly, validates its options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from objective_helpers import SMALL_PACKAGES, config, evaluate, setup, train

from kilolayer.errors import ConfigError
from kilolayer.objectives.common import pool


@pytest.mark.slow
def test_digits_test_accuracy_after_short_run():
    # 200 AdamW steps of batch 64 on a 2-layer, 32-wide ViT (4x4 grid of 2x2 patches):
    # held-out test accuracy measured 0.89-0.94 over train seeds 0-4 (chance 0.10)
    cfg = config("classification", "digits", seed=0)
    task, source = setup(cfg)
    assert task.objective.num_classes == 10  # inferred from the data source
    before = evaluate(task, source, split="test")
    train(task, source, 200, lr=3e-3, batch_size=64)
    after = evaluate(task, source, split="test")
    assert after["accuracy"] > 0.85, after
    assert after["loss"] < before["loss"] - 1.0


def letters_file(path, n=400, seed=0):
    """label<TAB>text lines of 4-24 letters: class 'low' draws from a-m, class 'high' from n-z."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(n):
        length = int(torch.randint(4, 25, (1,), generator=g))
        offset = 0 if i % 2 == 0 else 13
        text = "".join(chr(97 + offset + int(c)) for c in torch.randint(0, 13, (length,), generator=g))
        lines.append(f"{'low' if i % 2 == 0 else 'high'}\t{text}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_text_classification_with_padding_learns(tmp_path):
    path = str(letters_file(tmp_path / "t.txt"))
    cfg = config("classification", "text", data_options={"labels": True, "add_cls": True}, path=path)
    task, source = setup(cfg)
    assert task.objective.num_classes == 2 and task.objective.pool == "mean"
    assert source.train_batch(0, 32)["padding_mask"].any()  # lengths vary, so batches are padded
    before = evaluate(task, source)
    train(task, source, 30, lr=3e-3, batch_size=32)
    after = evaluate(task, source)
    # measured: about 0.69 -> under 0.1 and accuracy 1.0 on the 40 validation lines
    assert after["loss"] < before["loss"] - 0.4, (before, after)
    assert after["accuracy"] > 0.9


def test_evaluate_matches_direct_computation():
    cfg = config("classification", "digits")
    task, source = setup(cfg)
    task.eval()
    batches = list(source.eval_batches(64))
    with torch.no_grad():
        logits = torch.cat([task.objective.logits(task.backbone, b) for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    got = task.objective.evaluate(task.backbone, batches)
    assert got["accuracy"] == pytest.approx(float((logits.argmax(-1) == labels).float().mean()))
    assert got["loss"] == pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-5)


def test_pooling_ignores_padding_and_cls():
    hidden = torch.randn(2, 5, 3)
    mask = torch.tensor([[False, False, True, True, True], [False] * 5])
    hidden[0, 2:] = float("nan")  # what attention may leave at fully padded rows must not leak
    mean = pool(hidden, mask, "mean")
    assert torch.allclose(mean[0], hidden[0, :2].mean(0))
    assert torch.allclose(mean[1], hidden[1].mean(0))
    assert torch.equal(pool(hidden, None, "cls"), hidden[:, 0])
    assert torch.allclose(pool(hidden[1:], None, "mean", skip_first=True), hidden[1, 1:].mean(0, keepdim=True))


def _reads_first_two_features(objective) -> None:
    """Make logits 0 and 1 the pooled features' first two numbers (the rest 0): no norm, unit weights, no bias."""
    objective.norm = torch.nn.Identity()
    with torch.no_grad():
        objective.head.weight.zero_()
        objective.head.weight[0, 0] = objective.head.weight[1, 1] = 1.0
        objective.head.bias.zero_()


def test_mean_pooled_head_reads_the_mean_of_the_final_content_tokens():
    # a patch model with a CLS token: 16 patch tokens + CLS; the backbone's output is given, not computed
    hidden = torch.zeros(1, 17, 32)
    hidden[0, 0, :2] = 100.0  # the CLS token
    hidden[0, 1:, 0] = torch.arange(1.0, 17.0)  # patch tokens 1..16: mean 8.5
    hidden[0, 1:, 1] = torch.tensor([4.0] * 8 + [-2.0] * 8)  # mean 1.0
    batch = {"inputs": torch.zeros(1, 1, 8, 8), "labels": torch.tensor([0])}
    logits = {}
    for how in ("mean", "cls"):
        task, _ = setup(config("classification", "digits", options={"pool": how}))
        assert task.objective.pool == how
        _reads_first_two_features(task.objective)
        logits[how] = task.objective.logits(lambda x, mask: hidden, batch)
    assert logits["mean"][:, :2].tolist() == [[8.5, 1.0]]  # the CLS token is not in the mean
    assert logits["cls"][:, :2].tolist() == [[100.0, 100.0]]
    assert not logits["mean"][:, 2:].any()


def test_mean_pooled_text_head_leaves_padding_out():
    cfg = config("classification", "stdlib_packages", data_options=SMALL_PACKAGES, options={"pool": "mean"})
    task, _ = setup(cfg)
    _reads_first_two_features(task.objective)
    hidden = torch.zeros(2, 4, 32)
    hidden[:, :, 0] = torch.tensor([[1.0, 2.0, 3.0, 1e6], [5.0, 7.0, 9.0, 11.0]])
    batch = {
        "tokens": torch.zeros(2, 4, dtype=torch.long),
        "padding_mask": torch.tensor([[False, False, False, True], [False] * 4]),
        "labels": torch.tensor([0, 1]),
    }
    assert task.objective.logits(lambda x, mask: hidden, batch)[:, 0].tolist() == [2.0, 8.0]


def test_default_pooling():
    assert setup(config("classification", "digits"))[0].objective.pool == "cls"
    assert setup(config("classification", "digits", model={"cls_token": False}))[0].objective.pool == "mean"
    text = config("classification", "stdlib_packages", data_options={"max_per_class": 20, "packages": ["email", "xml"]})
    assert setup(text)[0].objective.pool == "mean"


@pytest.mark.parametrize(
    "options, model, message",
    [
        ({"pool": "cls"}, {"cls_token": False}, "objective.options.pool='cls': model.cls_token is false"),
        ({"pool": "max"}, {}, "objective.options.pool='max'"),
        ({"bogus": 1}, {}, "objective.options.bogus: unknown key"),
        ({"num_classes": 1}, {}, "objective.options.num_classes=1"),
    ],
)
def test_bad_options_give_one_line(options, model, message):
    with pytest.raises(ConfigError) as err:
        setup(config("classification", "digits", options=options, model=model))
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)
