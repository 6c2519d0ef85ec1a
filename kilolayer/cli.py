"""The ``kilolayer`` command.

Every error a user can cause ends as one line ``kilolayer: error: ...`` and a
non-zero exit (2 for bad input, 3 for a diverged training run).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from kilolayer.analysis import cli as analysis_cli
from kilolayer.doctor import cli as doctor_cli
from kilolayer.errors import ConfigError, KilolayerError
from kilolayer.study import cli as study_cli
from kilolayer.train import cli as train_cli

# The command groups that live beside their code; each has register(subparsers). Plain imports: they cost
# little beside torch, which kilolayer/__init__ loads anyway.
SUBCOMMANDS = (train_cli, study_cli, analysis_cli, doctor_cli)


def _model_source(source: str, sets: list[str]):
    from kilolayer.config import load_config

    return load_config(source, sets).model


#: ``kilolayer configs --params``'s head size when none is given
DEFAULT_HEAD_DIM = 64


def _fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _schemes_text(cfg) -> str:
    from kilolayer.nn.transformer import scheme_for

    parts = []
    for side, consts in scheme_for(cfg).describe().items():
        inner = ", ".join(f"{k}={v}" if isinstance(v, str) else f"{k}={v:.4g}" for k, v in consts.items())
        parts.append(f"{side}: {inner}")
    return "; ".join(parts) or "-"


def cmd_describe(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from kilolayer.nn.budget import budget
    from kilolayer.presets import DESCRIPTIONS

    table = Table(title="kilolayer describe")
    for col in (
        "model",
        "arch",
        "enc layers",
        "dec layers",
        "width",
        "heads",
        "ffn",
        "scheme",
        "scheme constants",
        "params",
        "seq",
        "FLOPs/token (train)",
    ):
        table.add_column(col, overflow="fold")
    notes = []
    for source in args.sources:
        cfg = _model_source(source, args.set)
        b = budget(cfg, args.seq_len)
        table.add_row(
            source,
            cfg.arch,
            str(cfg.encoder_depth or "-"),
            str(cfg.decoder_depth or "-"),
            str(cfg.width),
            str(cfg.heads),
            str(cfg.ffn),
            cfg.scheme,
            _schemes_text(cfg),
            _fmt_count(b.parameters),
            str(b.seq_len),
            _fmt_count(b.flops_per_token),
        )
        if source in DESCRIPTIONS:
            notes.append(f"{source}: {DESCRIPTIONS[source]}")
    console = Console(width=max(160, Console().width))
    console.print(table)
    for n in notes:
        console.print(n)
    return 0


def cmd_configs(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from kilolayer.config import ModelConfig
    from kilolayer.nn.budget import budget, count_parameters, matched_configs, parse_count

    if args.like is None and args.params is None:
        raise ConfigError("configs: give --like PRESET|CONFIG.yaml or --params COUNT")
    if args.head_dim is not None and args.head_dim < 1:
        raise ConfigError(f"--head-dim={args.head_dim}: expected a head size of at least 1")
    if args.like is not None:
        base = _model_source(args.like, args.set)
        head_dim = args.head_dim or base.head_dim  # the model's own head size unless one is asked for
    else:
        head_dim = args.head_dim or DEFAULT_HEAD_DIM
        base = ModelConfig(
            arch=args.arch,
            layers=2,
            width=head_dim * 2,
            heads=2,
            ffn=head_dim * 8,
            decoder_layers=2 if args.arch == "encoder_decoder" else 0,
        )
    target = parse_count(args.params) if args.params is not None else count_parameters(base)
    rows = matched_configs(
        base, params=target if args.params is not None else None, tolerance=args.tolerance, head_dim=head_dim
    )
    title = f"configs within {args.tolerance:.0%} of {_fmt_count(target)} parameters"
    if args.like:
        title += f", shaped like {args.like} (head size {head_dim}, FFN ratio {base.ffn / base.width:g})"
    table = Table(title=title)
    for col in ("layers", "dec layers", "width", "heads", "ffn", "params", "diff", "FLOPs/token"):
        table.add_column(col, justify="right")
    for c in rows:
        b = budget(c)
        table.add_row(
            str(c.layers),
            str(c.decoder_layers or "-"),
            str(c.width),
            str(c.heads),
            str(c.ffn),
            _fmt_count(b.parameters),
            f"{(b.parameters - target) / target:+.1%}",
            _fmt_count(b.flops_per_token),
        )
    Console(width=max(120, Console().width)).print(table)
    if not rows:
        print("no configuration matches; widen --tolerance or change --head-dim")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kilolayer",
        description="Configure, train and diagnose deep Transformers (DeepNorm; depth vs width by objective).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("describe", help="table of a model: layers, width, scheme constants, parameters, FLOPs/token")
    p.add_argument("sources", nargs="+", metavar="PRESET|CONFIG.yaml", help="preset names or config files")
    p.add_argument("--set", action="append", default=[], metavar="key.path=value", help="override a config key")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length for FLOPs/token (default: model.max_len)")
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser("configs", help="parameter-matched deeper-narrower variants of a model")
    p.add_argument("--like", metavar="PRESET|CONFIG.yaml", help="the model to match")
    p.add_argument("--params", metavar="COUNT", help="match this parameter count instead (e.g. 86M)")
    p.add_argument(
        "--arch",
        default="encoder",
        choices=["encoder", "decoder", "encoder_decoder"],
        help="with --params: the architecture (default encoder, 256-token vocabulary)",
    )
    p.add_argument(
        "--head-dim",
        type=int,
        help=f"head size of every variant (default: that of --like, else {DEFAULT_HEAD_DIM})",
    )
    p.add_argument("--tolerance", type=float, default=0.03, help="relative parameter tolerance (default 0.03)")
    p.add_argument("--set", action="append", default=[], metavar="key.path=value", help="override a config key")
    p.set_defaults(func=cmd_configs)

    p = sub.add_parser("presets", help="list the model presets")
    p.set_defaults(func=cmd_presets)

    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def cmd_presets(args) -> int:
    from kilolayer.presets import DESCRIPTIONS

    for name, text in DESCRIPTIONS.items():
        print(f"{name:22s} {text}")
    return 0


#: commands that compute in this process take their thread count from the policy (``train`` applies it itself)
COMPUTING = ("doctor", "analyze", "evaluate", "search", "generate")


@contextlib.contextmanager
def _threads(args):
    """The thread policy's count (:mod:`kilolayer.train.host.threads`) while a computing command runs; the doctor of a
    run replays its steps at the count the run recorded, where its losses are the run's bit for bit."""
    if args.command not in COMPUTING:
        yield
        return
    from kilolayer.train.host import thread_policy, torch_threads
    from kilolayer.train.run import recorded_threads

    target = Path(getattr(args, "target", "") or "")
    recorded = recorded_threads(target) if args.command == "doctor" and target.is_dir() else None
    with torch_threads(thread_policy(recorded=recorded).count):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _threads(args):
            return int(args.func(args) or 0)
    except KilolayerError as err:
        print(f"kilolayer: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("kilolayer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # output piped into e.g. `head`: the files are written; stop quietly (the streams write to /dev/null, so
        # the interpreter's last flush cannot fail either)
        from kilolayer.rundir import silence

        silence(sys.stdout)
        silence(sys.stderr)
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
