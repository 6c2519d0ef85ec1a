"""Checkpoints written before issue 13's residual refactor still load.

The refactor renamed two kinds of tensor: Admin's learned shortcut scale was the Residual's parameter
``...shortcut`` (now ``...shortcut.omega``) and LayerScale's branch scale ``...gain`` (now
``...branch_scale.weight``); nothing else changed, and the parameters kept their order. An old-format state
dict is made here by renaming a fresh model's keys back; an old run by rewriting a real run's checkpoints so.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from kilolayer import build_model, rundir
from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.nn.residual import old_keys, upgrade_state_dict
from kilolayer.objectives import build_task
from kilolayer.train.checkpoint import load_run, read_weights
from kilolayer.train.init_from import load_pretrained
from kilolayer.train.loop import train

MODEL = {"width": 16, "heads": 2, "ffn": 32, "vocab_size": 16, "max_len": 16}
S2S = {**MODEL, "arch": "encoder_decoder", "layers": 2, "decoder_layers": 2}


def _old_format(model: torch.nn.Module, state: dict | None = None) -> dict:
    """``model``'s state dict (or ``state``) under the names it had before issue 13."""
    back = {new: old for old, new in old_keys(model).items()}
    state = model.state_dict() if state is None else state
    return {back.get(key, key): value.clone() for key, value in state.items()}


def _perturbed(cfg: dict, seed: int) -> torch.nn.Module:
    """A model whose learned scales are not their initial constants, so a load that missed them shows."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_the_old_names_are_those_the_model_had():
    admin = old_keys(build_model({**S2S, "scheme": "admin"}))
    assert admin["encoder.layers.0.self_attn.shortcut"] == "encoder.layers.0.self_attn.shortcut.omega"
    assert admin["decoder.layers.1.cross_attn.shortcut"] == "decoder.layers.1.cross_attn.shortcut.omega"
    assert len(admin) == 2 * 2 + 2 * 3  # every sublayer of both sides
    scale = old_keys(build_model({**S2S, "scheme": "layerscale"}))
    assert scale["decoder.layers.0.ffn.gain"] == "decoder.layers.0.ffn.branch_scale.weight"
    assert len(scale) == 10
    for scheme in ("deepnorm", "post_ln", "pre_ln", "rezero", "t_fixup"):  # no tensor of theirs was renamed
        assert old_keys(build_model({**S2S, "scheme": scheme})) == {}


@pytest.mark.parametrize("scheme", ["admin", "layerscale"])
@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder_decoder"])
def test_an_old_state_dict_loads_to_identical_parameters(scheme, arch):
    cfg = {**MODEL, "arch": arch, "scheme": scheme, "layers": 2}
    if arch == "encoder_decoder":
        cfg["decoder_layers"] = 2
    saved = _perturbed(cfg, 0)
    old = _old_format(saved)
    suffix = ".shortcut" if scheme == "admin" else ".gain"
    assert sum(key.endswith(suffix) for key in old) == len(old_keys(saved)) > 0
    keys_before = list(old)

    # what the checkpoint readers do (resume, train.init_from, load_run): rename, then compare and load
    fresh = _perturbed(cfg, 1)
    upgraded = upgrade_state_dict(fresh, old)
    assert list(upgraded) == list(saved.state_dict())  # every tensor kept, in its order
    fresh.load_state_dict(upgraded)
    _same_parameters(fresh, saved)

    # a plain load_state_dict of the old dict renames by itself, strictly, leaving the caller's dict alone
    other = _perturbed(cfg, 2)
    other.load_state_dict(old)
    _same_parameters(other, saved)
    assert list(old) == keys_before


def test_a_current_state_dict_passes_unchanged():
    model = build_model({**S2S, "scheme": "admin"})
    state = model.state_dict()
    assert upgrade_state_dict(model, state) is state
    # a key present under both names is not renamed over the current one (the usual checks then refuse it)
    both = {**state, "encoder.layers.0.ffn.shortcut": torch.zeros(16)}
    assert upgrade_state_dict(model, both) is both
    with pytest.raises(RuntimeError, match="Unexpected key"):
        model.load_state_dict(both)


def _run_config(scheme: str) -> dict:
    return {
        "model": {**S2S, "scheme": scheme, "dropout": 0.1},
        "objective": {"name": "seq2seq", "options": {"decode_samples": 8}},
        "data": {"name": "synthetic", "task": "reverse", "options": {"min_len": 3, "max_len": 8, "eval_size": 16}},
        "train": {
            "steps": 6,
            "batch_size": 8,
            "lr": 1e-3,
            "warmup": 2,
            "eval_every": 0,
            "checkpoint_every": 2,
            "log_every": 1,
        },
    }


def _to_old_format(run_dir) -> None:
    """Rewrite every checkpoint of ``run_dir`` as the code before issue 13 wrote it (and its manifest)."""
    config = load_config(run_dir / rundir.CONFIG)
    task = build_task(config, load_source(config))
    for ckpt in rundir.complete_checkpoints(run_dir):
        weights = read_weights(ckpt / "model.safetensors")
        save_file(_old_format(task, weights), str(ckpt / "model.safetensors"))
        rundir.write_manifest(ckpt)
        assert rundir.verify_checkpoint(ckpt) is None


def _losses(run_dir) -> list[tuple[int, float]]:
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["split"] == "train"]


@pytest.mark.parametrize("scheme", ["admin", "layerscale"])
def test_an_old_run_resumes_bit_for_bit_loads_and_initialises_another(tmp_path, scheme):
    cfg = _run_config(scheme)
    full, old = tmp_path / "full", tmp_path / "old"
    train(cfg, full, quiet=True)
    train(cfg, old, quiet=True, sets=["train.steps=4"])
    _, expected = load_run(old)  # step 4, read before the rewrite
    _to_old_format(old)
    weights = read_weights(rundir.latest_checkpoint(old) / "model.safetensors")
    assert any(key.endswith(".shortcut" if scheme == "admin" else ".gain") for key in weights)

    # kilolayer analyze, the doctor and the study report read runs through load_run
    _, task = load_run(old)
    _same_parameters(task, expected)

    # train.init_from copies the old run's backbone
    config = load_config(cfg)
    fresh = build_task(config, load_source(config))
    load_pretrained(fresh, old)
    _same_parameters(fresh.backbone, expected.backbone)

    # --resume continues from the old checkpoint exactly as an uninterrupted run (weights and AdamW state)
    assert train(None, old, resume=True, quiet=True, sets=["train.steps=6"]) == {"status": "completed", "step": 6}
    assert _losses(old) == _losses(full) and len(_losses(full)) == 6


def test_an_optimizer_state_saved_by_parameter_name_is_renamed_too():
    """A distributed run saves the optimizer state by parameter name (torch.distributed.checkpoint)."""
    from kilolayer.train.checkpoint import upgrade_checkpoint

    model = build_model({**S2S, "scheme": "layerscale"})
    new_names = list(model.state_dict())
    old = _old_format(model)
    old_names = list(old)
    optim = {
        "state": {name: {"step": torch.tensor(1.0)} for name in old_names},
        "param_groups": [{"lr": 1e-3, "params": old_names}],
    }
    data = {"model": old, "optimizer": {"optimizer": optim, "scheduler": {}}, "state": {"step": 1}}
    up = upgrade_checkpoint(model, data)
    assert list(up["model"]) == new_names
    assert list(up["optimizer"]["optimizer"]["state"]) == new_names
    assert up["optimizer"]["optimizer"]["param_groups"][0]["params"] == new_names
    assert up["state"] == {"step": 1} and list(data["model"]) == old_names  # the input is left as it was
    # an index-keyed (single-process) optimizer state needs nothing: the parameters kept their order
    indexed = {**data, "optimizer": {"optimizer": {"state": {0: {}}, "param_groups": [{"params": [0]}]}}}
    assert upgrade_checkpoint(model, indexed)["optimizer"] == indexed["optimizer"]
