"""Start a task's backbone from another run's weights (``train.init_from``): fine-tuning or a linear probe.

Typical use: pretrain with ``objective.name: mae``, then train ``classification``
with ``train.init_from: MAE_RUN`` (full fine-tuning) or additionally
``train.freeze_backbone: true`` (a linear probe: only the head learns). Only the
``backbone.*`` tensors of the checkpoint that stands for the run are copied
(:func:`kilolayer.rundir.chosen_checkpoint`: its newest intact one; with early
stopping, its best); the objective's heads start fresh. The two backbones must
match exactly (same tensors, same shapes); anything else is one line naming the
run and the first difference. The run trained so records in its status.json
``init_from: {path, step}``: the source run directory and the step it loaded.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from kilolayer import rundir
from kilolayer.config import read_yaml
from kilolayer.errors import InputError
from kilolayer.train.checkpoint import misfit, read_weights

_SHAPE_KEYS = ("arch", "scheme", "layers", "width", "heads", "ffn", "input", "image_size", "patch_size", "channels")


def _describe(model: dict) -> str:
    return " ".join(f"{k}={model[k]}" for k in _SHAPE_KEYS if k in model)


def pretrained_checkpoint(run_dir: str | Path) -> Path:
    """``model.safetensors`` of the checkpoint that stands for the run at ``run_dir``: its newest intact one,
    or its best one if it trained with early stopping (a damaged one is reported in one line on stderr)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise InputError(f"{run}: no such run directory (train.init_from)")
    if not (run / rundir.CONFIG).is_file():
        raise InputError(f"{run}: not a kilolayer run directory (no config.yaml) (train.init_from)")
    found = rundir.chosen_checkpoint(run, rundir.run_patience(run))
    if found is None:
        raise InputError(
            f"{run}: the run has no complete checkpoint (checkpoints/step_NNNNNNNN/COMPLETE) (train.init_from)"
        )
    return found / "model.safetensors"


def load_pretrained(task: nn.Module, run_dir: str | Path, freeze: bool = False) -> dict:
    """Copy the backbone weights of the run at ``run_dir`` into ``task.backbone``; with ``freeze``,
    stop the backbone's gradients (``requires_grad=False``) so only the objective's heads train.

    Returns what was loaded: ``run``, ``checkpoint``, ``step``, ``tensors``, ``frozen``.
    """
    run = Path(run_dir)
    path = pretrained_checkpoint(run)
    weights = read_weights(path)
    pretrained = {k[len("backbone.") :]: v for k, v in weights.items() if k.startswith("backbone.")}
    if not pretrained:
        raise InputError(f"{path}: holds no backbone.* tensors (train.init_from)")
    own = task.backbone.state_dict()
    run_model = read_yaml(run / rundir.CONFIG).get("model") or {}
    here = task.backbone.config.model_dump() if hasattr(task.backbone, "config") else {}
    models = f"(run model: {_describe(run_model)}; this model: {_describe(here)})"
    found = misfit(pretrained, own)
    if found is not None:
        kind, key = found
        if kind == "shape":
            where = f"has shape {tuple(pretrained[key].shape)} in the run, {tuple(own[key].shape)} here"
        else:
            where = "is not in the run" if kind == "missing" else "is not in this model"
        raise InputError(f"init_from {run}: the backbones differ: backbone.{key} {where} {models}")
    task.backbone.load_state_dict(pretrained, strict=True)
    if freeze:
        task.backbone.requires_grad_(False)
    step = rundir.checkpoint_step(path.parent)
    return {"run": str(run), "checkpoint": str(path), "step": step, "tensors": len(pretrained), "frozen": freeze}
