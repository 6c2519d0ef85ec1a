"""``kilolayer train``."""

from __future__ import annotations


def cmd_train(args) -> int:
    from kilolayer.train.run import train

    if args.config is None and not args.resume:
        from kilolayer.errors import ConfigError

        raise ConfigError("train: give a CONFIG (file or preset), or --resume an existing --out directory")
    import os

    sets = [*args.set, *([f"train.threads={args.threads}"] if args.threads is not None else [])]
    result = train(
        args.config,
        args.out,
        resume=args.resume,
        sets=sets,
        quiet=args.quiet,
        overwrite=args.overwrite,
        auto_threads=True,
    )
    if os.environ.get("RANK", "0") == "0":
        print(f"{result['status']} at step {result['step']}: {args.out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model; writes config.yaml, metrics.jsonl, status.json, checkpoints/ and tensorboard/ to --out",
        description="Train a model. One training process per --out (a second is refused). A diverged run "
        "(non-finite loss, or loss above train.diverge_factor x its running minimum after warm-up) is "
        "recorded as status 'diverged' and exits with code 3; SIGINT/SIGTERM save a checkpoint at the "
        "next step, record 'interrupted' and exit 130/143; any other error records 'failed'. "
        "Multi-process: torchrun --nproc-per-node K -m kilolayer train CONFIG --out DIR "
        "(train.parallel: ddp|fsdp).",
    )
    p.add_argument("config", nargs="?", metavar="CONFIG", help="a YAML config file or a preset name")
    p.add_argument("--out", required=True, metavar="DIR", help="the run directory")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="key.path=value",
        help="override a config key (repeatable), e.g. --set train.steps=200",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest intact checkpoint; train.* values given now "
        "(--set or CONFIG) apply from there on",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in --out (its config, metrics, status and checkpoints) with a new one",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="intra-op threads (train.threads); a resume reuses the count its run recorded unless given",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_train)
