"""``kilolayer doctor``: diagnose a run, or forecast a config before training it.

kilolayer doctor RUN_DIR [--json]
kilolayer doctor CONFIG [--set key=value ...] --forecast [--steps K] [--json]
"""

from __future__ import annotations

import json
from pathlib import Path

from kilolayer.errors import ConfigError, InputError


def _is_run(path: Path) -> bool:
    return path.is_dir()


def cmd_doctor(args) -> int:
    target = Path(args.target)
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: must be at least 1")
    from kilolayer.train.device import resolve_device

    args.device = resolve_device(args.device)
    if args.forecast:
        from kilolayer.config import load_config
        from kilolayer.doctor.forecast import forecast

        if _is_run(target):
            if not (target / "config.yaml").is_file():
                raise InputError(f"{target}: a directory without config.yaml; give a config file, a preset or a run")
            config = load_config(target / "config.yaml", args.set)
        else:
            config = load_config(args.target, args.set)
        result = forecast(config, steps=args.steps, device=args.device)
    else:
        if args.set:
            raise ConfigError("--set changes a config to forecast: use it with --forecast (a run's config is fixed)")
        if not target.exists():
            raise InputError(f"{target}: no such run directory (to forecast a config, add --forecast)")
        if not target.is_dir():
            raise InputError(f"{target}: a file, not a run directory; to forecast a config, add --forecast")
        from kilolayer.doctor.diagnose import diagnose

        result = diagnose(target, smoothness_samples=args.samples, device=args.device)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print("\n".join(result.lines))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="say why a run stalled, diverged or trained (RUN_DIR), or forecast a config before training it "
        "(CONFIG --forecast)",
        description="Diagnose a training run from its status, losses and DeepNet's diagnostics (logged, or "
        "measured from its seed and checkpoints): vanishing bottom gradients, the first update "
        "against DeepNorm's, LayerNorm inputs growing with layer, over-smoothed tokens, a loss that "
        "never beat the data's chance level. With --forecast, replay the first steps of a config in "
        "memory and forecast trains / stalls / diverges by a stated rule. Writes nothing.",
    )
    p.add_argument("target", metavar="RUN_DIR|CONFIG", help="a run directory, or (with --forecast) a config or preset")
    p.add_argument("--forecast", action="store_true", help="forecast the config instead of diagnosing a run")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="key.path=value",
        help="with --forecast: override a config key (repeatable)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="with --forecast: optimiser steps to replay (default: through the warm-up and 10 steps "
        "at the peak learning rate; at least 40, at most 200)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=128,
        help="samples for token similarity when the run has no smoothness analysis (0 = skip)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(func=cmd_doctor)
