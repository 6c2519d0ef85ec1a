"""Checkpoints: atomic, self-checking, loaded without unpickling arbitrary objects.

Layout of one checkpoint, ``RUN/checkpoints/step_00000100/``:

* ``model.safetensors``: the whole task's weights (backbone + objective heads);
* ``optimizer.pt``: optimizer and scheduler state (tensors and plain containers only,
  loaded with ``weights_only=True``);
* ``rng.pt``: torch CPU/CUDA generator states;
* ``state.json``: step, Python/NumPy RNG states and the trainer's own counters;
* ``extra.safetensors``: trainer tensors such as the diagnostics' reference output;
* ``COMPLETE``: written last. A directory is built under a temporary name and
  renamed into place, so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kilolayer.errors import InputError

STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: dict[str, torch.Tensor],
    optimizer: dict,
    rng: dict,
    state: dict,
    extra: Optional[dict[str, torch.Tensor]] = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep`` complete ones."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(run_dir, step)
    tmp = root / f".step_{step:08d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in model.items()}, str(tmp / "model.safetensors"))
    torch.save(optimizer, tmp / "optimizer.pt")
    torch.save(rng, tmp / "rng.pt")
    if extra:
        save_file({k: v.contiguous() for k, v in extra.items()}, str(tmp / "extra.safetensors"))
    _write_json(tmp / "state.json", state)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    (tmp / "COMPLETE").write_text(str(step))
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "COMPLETE").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def remove_partial(run_dir: Path) -> None:
    """Delete leftovers of an interrupted save."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step_") or (STEP_DIR.match(p.name) and not (p / "COMPLETE").exists()):
                shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise InputError(f"{path}: missing") from None
    except (SafetensorError, OSError, ValueError) as err:
        raise InputError(f"{path}: unreadable or truncated safetensors file ({str(err).splitlines()[0][:120]})") from None


def _torch_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputError(f"{path}: missing") from None
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a bad file
        raise InputError(f"{path}: unreadable or truncated ({err.__class__.__name__})") from None


def check_fits(path: Path, weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """One line naming the first key that is missing, unexpected or of another shape."""
    for k, v in expected.items():
        if k not in weights:
            raise InputError(f"{path}: does not fit this model: missing {k!r}")
        if tuple(weights[k].shape) != tuple(v.shape):
            raise InputError(
                f"{path}: does not fit this model: {k!r} has shape {tuple(weights[k].shape)}, expected {tuple(v.shape)}"
            )
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise InputError(f"{path}: does not fit this model: unexpected {extra[0]!r}")


def load_checkpoint(path: Path) -> dict:
    """Read every part of a checkpoint directory; one clear line if any part is bad."""
    path = Path(path)
    out = {
        "model": read_weights(path / "model.safetensors"),
        "optimizer": _torch_load(path / "optimizer.pt"),
        "rng": _torch_load(path / "rng.pt"),
        "extra": read_weights(path / "extra.safetensors") if (path / "extra.safetensors").exists() else {},
    }
    try:
        out["state"] = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{path / 'state.json'}: unreadable ({err.__class__.__name__})") from None
    return out


def load_run(run_dir: "str | Path", device: str = "cpu"):
    """(config, task) of a finished or running kilolayer run, with its newest weights, in eval mode."""
    from kilolayer.config import load_config
    from kilolayer.objectives import build_task

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir}: not a kilolayer run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise InputError(f"{run_dir}: the run has no complete checkpoint yet")
    task = build_task(config)
    weights = read_weights(ckpt / "model.safetensors")
    check_fits(ckpt / "model.safetensors", weights, task.state_dict())
    task.load_state_dict(weights)
    return config, task.to(device).eval()
