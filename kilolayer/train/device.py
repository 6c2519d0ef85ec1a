"""The torch device a command or a loader runs on, checked here once: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``
(where this machine has that CUDA device), ``mps`` (where Apple's backend is built and available)."""

from __future__ import annotations

import torch

from kilolayer.errors import ConfigError

CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(choice: str, field: str = "--device") -> str:
    """The device ``choice`` names on this machine (``auto``: cuda where available, else cpu); one line naming
    ``field`` when there is no such device here, rather than a traceback from the first tensor moved to it."""
    choice = str(choice).strip()
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(choice)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{field} {choice}: not a torch device; expected {CHOICES}") from None
    if device.type == "cpu":
        return choice
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{field} {choice}: no CUDA device is available here; use cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{field} {choice}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        return choice
    if device.type == "mps" and torch.backends.mps.is_available():
        return choice
    raise ConfigError(f"{field} {choice}: no {device.type} device is available here; expected {CHOICES}")
