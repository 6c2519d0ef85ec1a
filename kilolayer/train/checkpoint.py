"""Checkpoints: atomic, self-checking, loaded without unpickling arbitrary objects.

Layout of one checkpoint, ``RUN/checkpoints/step_00000100/``:

* ``model.safetensors``: the whole task's weights (backbone + objective heads);
* ``optimizer.pt``: optimizer and scheduler state (tensors and plain containers only,
  loaded with ``weights_only=True``);
* ``rng.pt``: torch CPU/CUDA generator states;
* ``state.json``: step, Python/NumPy RNG states and the trainer's own counters;
* ``extra.safetensors``: trainer tensors such as the diagnostics' reference output;
* ``manifest.json``: the size and SHA-256 of each file above (checked on resume and load);
* ``COMPLETE``: written last. A directory is built under a temporary name and
  renamed into place, so a crash mid-save leaves the previous checkpoint intact.

Where checkpoints live and which are complete or intact is :mod:`kilolayer.rundir`'s business.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kilolayer import rundir
from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.errors import InputError
from kilolayer.files import atomic_folder, plain_mode
from kilolayer.objectives import build_task

# the checkpoint listing lives in kilolayer.rundir; re-exported for the trainer and tests that import it here
from kilolayer.rundir import (  # noqa: F401
    STEP_DIR,
    checkpoint_dir,
    complete_checkpoints,
    latest_checkpoint,
    remove_partial,
)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


def _write_error(path: Path, err: BaseException) -> rundir.RunDirError:
    """One line for a failed write: the file and the operating system's reason. safetensors and torch.save
    wrap it in their own exceptions (torch's says only 'unexpected pos ...' on a full disk, hence the check
    of the free space)."""
    if isinstance(err, OSError) and err.errno:
        return rundir.os_error(err, path)
    text = " ".join(str(err).split())
    code = re.search(r"(?:os error|code:) (\d+)", text)
    if code:
        reason = os.strerror(int(code.group(1)))
    elif _nearly_full(path):
        reason = os.strerror(errno.ENOSPC)
    else:
        reason = text[:160] or err.__class__.__name__
    return rundir.RunDirError(f"{path}: cannot write: {reason}")


def _nearly_full(path: Path) -> bool:
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free < (1 << 20)
    return False


def _torch_save(obj, path: Path) -> None:
    # our own file object, closed even when torch fails mid-write (torch's own would stay open until
    # garbage collection and keep a full disk full)
    with open(path, "wb") as f:
        torch.save(obj, f)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: dict[str, torch.Tensor],
    optimizer: dict,
    rng: dict,
    state: dict,
    extra: dict[str, torch.Tensor] | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` atomically (with its manifest of checksums) and keep only the newest
    ``keep`` complete ones. A failed write (e.g. a full disk) removes the partial directory and raises
    a one-line :class:`~kilolayer.rundir.RunDirError`; the previous checkpoints are untouched."""
    final = checkpoint_dir(run_dir, step)
    target = final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_folder(final) as tmp:
            try:
                target = tmp / "model.safetensors"
                save_weights(model, target)
                target = tmp / "optimizer.pt"
                _torch_save(optimizer, target)
                target = tmp / "rng.pt"
                _torch_save(rng, target)
                if extra:
                    target = tmp / "extra.safetensors"
                    save_weights(extra, target)
                target = tmp / "state.json"
                _write_json(target, state)
                target = tmp / rundir.MANIFEST
                rundir.write_manifest(tmp)
                target = tmp / rundir.COMPLETE
                (tmp / rundir.COMPLETE).write_text(str(step))
            except (OSError, SafetensorError, RuntimeError) as err:
                # name the file where it would have been (judged before the partial copy's space is freed)
                raise _write_error(final / target.name, err) from None
            target = final
    except OSError as err:  # making the folder, or renaming it into place
        raise _write_error(target, err) from None
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise InputError(f"{path}: missing") from None
    except (SafetensorError, OSError, ValueError) as err:
        raise InputError(
            f"{path}: unreadable or truncated safetensors file ({str(err).splitlines()[0][:120]})"
        ) from None


def _torch_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputError(f"{path}: missing") from None
    except Exception as err:  # any unpickling failure means a bad file
        raise InputError(f"{path}: unreadable or truncated ({err.__class__.__name__})") from None


def misfit(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """Where ``weights`` do not fit a model whose state is ``expected``: ("missing", key), ("shape", key) or
    ("unexpected", key), the first in that order; None where they fit."""
    for k, v in expected.items():
        if k not in weights:
            return "missing", k
        if tuple(weights[k].shape) != tuple(v.shape):
            return "shape", k
    extra = sorted(set(weights) - set(expected))
    return ("unexpected", extra[0]) if extra else None


def check_fits(path: Path, weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """One line naming the first key that is missing, unexpected or of another shape (:func:`misfit`)."""
    found = misfit(weights, expected)
    if found is None:
        return
    kind, k = found
    if kind == "shape":
        detail = f"{k!r} has shape {tuple(weights[k].shape)}, expected {tuple(expected[k].shape)}"
    else:
        detail = f"{kind} {k!r}"
    raise InputError(f"{path}: does not fit this model: {detail}")


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


def load_run(run_dir: str | Path, device: str = "cpu", checkpoint: str | Path | None = None):
    """(config, task) of a finished or running kilolayer run, with the weights of ``checkpoint`` (default: the
    one that stands for the run, :func:`kilolayer.rundir.chosen_checkpoint`: the newest intact one; with early
    stopping, the best), in eval mode. A damaged checkpoint is reported in one line on stderr."""
    config, _, task, _ = open_run(run_dir, device, checkpoint)
    return config, task


def open_run(run_dir: str | Path, device: str = "cpu", checkpoint: str | Path | None = None):
    """:func:`load_run` with the data source the task was built for and the checkpoint's step:
    (config, source, task, step)."""
    run_dir = Path(run_dir)
    if not (run_dir / rundir.CONFIG).is_file():
        raise InputError(f"{run_dir}: not a kilolayer run directory (no config.yaml)")
    config = load_config(run_dir / rundir.CONFIG)
    ckpt = standing_checkpoint(run_dir, checkpoint, config.train.patience)
    source = load_source(config)
    task = build_task(config, source)  # the heads are sized for the run's data (e.g. its classes)
    step = load_run_weights(run_dir, task, ckpt)
    return config, source, task.to(device).eval(), step


def standing_checkpoint(
    run_dir: str | Path, checkpoint: str | Path | None = None, patience: int | None = None, on_damaged=rundir.warn
) -> Path:
    """``checkpoint`` if given, else the checkpoint that stands for the run under ``patience`` (its own
    ``train.patience`` unless given): :func:`kilolayer.rundir.chosen_checkpoint`. An InputError if the run has
    no complete checkpoint."""
    if checkpoint is None:
        if patience is None:
            patience = rundir.run_patience(run_dir)
        checkpoint = rundir.chosen_checkpoint(run_dir, patience, on_damaged)
    if checkpoint is None:
        raise InputError(f"{run_dir}: the run has no complete checkpoint yet")
    return Path(checkpoint)


def load_run_weights(
    run_dir: str | Path, task: torch.nn.Module, checkpoint: str | Path | None = None, on_damaged=rundir.warn
) -> int:
    """Load into ``task`` the weights of the run's checkpoint ``checkpoint`` (default: the one that stands for the
    run, :func:`standing_checkpoint`) and return that checkpoint's own step, so that no reader pairs one
    checkpoint's weights with another's step. Every reader of a run's weights (analyses, ``kilolayer evaluate``,
    the search, the doctor) loads them here; one line naming the first key that does not fit ``task``."""
    ckpt = standing_checkpoint(run_dir, checkpoint, on_damaged=on_damaged)
    load_weights(ckpt / "model.safetensors", task)
    return rundir.checkpoint_step(ckpt)


def save_weights(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write ``tensors`` to the safetensors file ``path`` with the mode of the run's other files."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    plain_mode(path)


def load_weights(path: str | Path, task: torch.nn.Module) -> None:
    """Load the safetensors file ``path`` (a checkpoint's or an export's weights) into ``task``; one line naming the
    first key that does not fit it."""
    weights = read_weights(Path(path))
    check_fits(Path(path), weights, task.state_dict())
    task.load_state_dict(weights)
