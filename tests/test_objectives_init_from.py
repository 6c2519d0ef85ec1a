"""train.init_from: copy a pretrained run's backbone into a classification task (fine-tune or linear probe)."""

from __future__ import annotations

import pytest
import torch
from objective_helpers import config, fake_run, setup, tiny_decoder, tiny_lm, train

from kilolayer.errors import InputError
from kilolayer.train.init_from import load_pretrained


def pretrained(tmp_path, model=None, steps=3, name="mae_run", step=10):
    cfg = config("mae", "digits", model=model)
    task, source = setup(cfg)
    train(task, source, steps)
    return fake_run(tmp_path / name, cfg, task, step=step), task


def test_copies_exactly_the_backbone_weights(tmp_path):
    run, mae = pretrained(tmp_path)
    task, _ = setup(config("classification", "digits"), seed=7)
    head = {k: v.clone() for k, v in task.objective.state_dict().items()}
    info = load_pretrained(task, run, freeze=False)
    source_weights = mae.backbone.state_dict()
    mine = task.backbone.state_dict()
    assert set(mine) == set(source_weights) and info["tensors"] == len(mine)
    for k, v in mine.items():
        assert torch.equal(v, source_weights[k]), k
    for k, v in task.objective.state_dict().items():  # the head is not touched
        assert torch.equal(v, head[k]), k
    assert all(p.requires_grad for p in task.parameters())
    assert info["step"] == 10 and not info["frozen"]


def test_freeze_leaves_only_the_head_trainable(tmp_path):
    run, _ = pretrained(tmp_path)
    task, _ = setup(config("classification", "digits"))
    load_pretrained(task, run, freeze=True)
    assert not any(p.requires_grad for p in task.backbone.parameters())
    assert all(p.requires_grad for p in task.objective.parameters())


def test_newest_complete_checkpoint_wins(tmp_path):
    run, _ = pretrained(tmp_path, step=10)
    cfg = config("mae", "digits")
    newer, _ = setup(cfg, seed=3)
    fake_run(tmp_path / "other", cfg, newer, step=30)
    (tmp_path / "other" / "checkpoints" / "step_00000030").rename(run / "checkpoints" / "step_00000030")
    half, _ = setup(cfg, seed=4)
    fake_run(tmp_path / "half", cfg, half, step=40, complete=False)
    (tmp_path / "half" / "checkpoints" / "step_00000040").rename(run / "checkpoints" / "step_00000040")
    task, _ = setup(config("classification", "digits"))
    assert load_pretrained(task, run)["step"] == 30
    for k, v in task.backbone.state_dict().items():
        assert torch.equal(v, newer.backbone.state_dict()[k]), k


@pytest.mark.parametrize(
    "model, message",
    [
        (
            {"width": 64, "ffn": 128},
            "the backbones differ: backbone.embed.cls has shape (1, 1, 32) in the run, (1, 1, 64) here",
        ),
        (
            {"layers": 3},
            "the backbones differ: backbone.encoder.layers.2.self_attn.branch.qkv.weight is not in the run",
        ),
        (
            {"cls_token": False},
            "the backbones differ: backbone.embed.positions has shape (17, 32) in the run, (16, 32) here",
        ),
    ],
)
def test_rejects_a_mismatched_run_in_one_line(tmp_path, model, message):
    run, _ = pretrained(tmp_path, steps=0)
    task, _ = setup(config("classification", "digits", model=model))
    with pytest.raises(InputError) as err:
        load_pretrained(task, run)
    text = str(err.value)
    assert text.startswith(f"init_from {run}: {message}"), text
    assert "run model: arch=encoder scheme=pre_ln layers=2 width=32" in text and "\n" not in text


def test_rejects_what_is_not_a_run(tmp_path):
    task, _ = setup(config("classification", "digits"))
    with pytest.raises(InputError, match="no such run directory"):
        load_pretrained(task, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"not a kilolayer run directory \(no config.yaml\)"):
        load_pretrained(task, tmp_path / "empty")
    run, _ = pretrained(tmp_path, steps=0)
    (run / "checkpoints" / "step_00000010" / "COMPLETE").unlink()
    with pytest.raises(InputError, match="has no complete checkpoint"):
        load_pretrained(task, run)
    (run / "checkpoints" / "step_00000010" / "COMPLETE").write_text("10")
    (run / "checkpoints" / "step_00000010" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InputError, match="model.safetensors: unreadable or truncated safetensors file"):
        load_pretrained(task, run)


def test_a_run_started_from_a_branchnorm_run_starts_the_schedule_again(tmp_path):
    """The source run's step buffers (3 of BranchNorm's T = 4 updates) are loaded with its weights, then set back
    to 0: before its first update the new run's branches are normalised to unit variance, and its schedule
    counts its own updates."""
    from kilolayer.config import load_config
    from kilolayer.nn.branchnorm import BranchNormScale
    from kilolayer.train.checkpoint import read_weights
    from kilolayer.train.engine import Engine
    from kilolayer.train.run import train as run_training

    model = {**tiny_decoder("branchnorm"), "branchnorm_steps": 4}
    source = {**tiny_lm(steps=3, batch_size=4, lr=3e-3), "model": model}
    run_training(load_config(source), tmp_path / "src", quiet=True)
    loaded = read_weights(tmp_path / "src" / "checkpoints" / "step_00000003" / "model.safetensors")
    assert {int(v) for k, v in loaded.items() if k.endswith("branch_scale.step")} == {3}

    engine = Engine(load_config({**source, "train": {**source["train"], "init_from": str(tmp_path / "src")}}))
    scales = [m for m in engine.task.modules() if isinstance(m, BranchNormScale)]
    assert len(scales) == 2 * 2 and {int(s.step) for s in scales} == {0}
    assert engine.init_from["step"] == 3
    y = 3.0 * torch.randn(2, 5, 32)
    torch.testing.assert_close(scales[0](y).var(-1, unbiased=False), torch.ones(2, 5), rtol=1e-4, atol=1e-4)
    engine.update(1, engine.train_step(1))
    assert {int(s.step) for s in scales} == {1}
    var = y.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(scales[0](y), y * (var + 1e-5) ** -0.375)  # lambda_1 = 1/4
