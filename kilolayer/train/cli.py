"""``kilolayer train`` and ``kilolayer evaluate``."""

from __future__ import annotations

from pathlib import Path

from kilolayer.rundir import SCORED_SPLITS


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
        choose_threads=True,
    )
    if os.environ.get("RANK", "0") == "0":
        print(f"{result['status']} at step {result['step']}: {args.out}")
    return 0


def cmd_evaluate(args) -> int:
    from kilolayer.rundir import scores_name
    from kilolayer.train.logging import eval_line
    from kilolayer.train.score import score_run

    record = score_run(args.run, args.split, args.device)
    what = f"{record['split']} ({record['samples']} samples, {record['checkpoint']})"
    print(eval_line(what, record["metrics"], record.get("baselines", {})))
    print(f"wrote {Path(args.run) / scores_name(record['split'])}")
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
        metavar="N|auto",
        help="intra-op threads (train.threads), fixed for the run; default: every usable core, and a resume "
        "reuses the count its run recorded; auto: follow the machine's load (not bit-reproducible)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "evaluate",
        help="score a run's chosen checkpoint on all of a split; writes RUN/scores_SPLIT.json",
        description="Score a run's chosen checkpoint (the newest intact one; with early stopping, the best) on "
        "every sample of a split with the metrics its evaluations report; a seq2seq run decodes every pair and is "
        "scored beside its baselines (the source copied; the nearest training pair's target, or the reference's "
        "tokens shuffled). Writes RUN/scores_SPLIT.json.",
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory")
    p.add_argument(
        "--split",
        choices=SCORED_SPLITS,
        help="the split to score (default: the one the run evaluates on); test needs a source that holds one "
        "(data.options.eval_split)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    p.set_defaults(func=cmd_evaluate)
