"""``kilolayer train``, ``kilolayer evaluate``, and using what a run trained: ``kilolayer generate`` and
``kilolayer export``."""

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
        require_steps=True,
    )
    if os.environ.get("RANK", "0") == "0":
        print(f"{result['status']} at step {result['step']}: {args.out}")
    return 0


def cmd_evaluate(args) -> int:
    from kilolayer.rundir import scores_name
    from kilolayer.train.device import resolve_device
    from kilolayer.train.logging import eval_line
    from kilolayer.train.score import score_run

    resolve_device(args.device)
    record = score_run(args.run, args.split, args.device, args.samples)
    of = f" of {record['of']}" if "of" in record else ""
    what = f"{record['split']} ({record['samples']}{of} samples, {record['checkpoint']})"
    print(eval_line(what, record["metrics"], record.get("baselines", {})))
    if record.get("directions"):
        from kilolayer.objectives.directions import table_lines

        print("\n".join(table_lines(record["directions"])))
    print(f"wrote {Path(args.run) / scores_name(record['split'])}")
    return 0


def cmd_generate(args) -> int:
    from kilolayer.objectives.decoding import Decoding
    from kilolayer.train.device import resolve_device
    from kilolayer.train.trained import load

    decoding = Decoding(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        beams=args.beams,
        length_penalty=args.length_penalty,
        seed=args.seed,
    )
    trained = load(args.run, device=resolve_device(args.device))
    print(trained.generate(args.prompt, decoding))
    return 0


def cmd_export(args) -> int:
    from kilolayer.train.trained import export

    print(f"wrote {export(args.run, args.out)}")
    return 0


def add_threads_option(p, whose: str = "") -> None:
    """``--threads N|auto``: train.threads of a run (``whose``: of each run a command starts, e.g. each point of
    a study), declared here once for ``kilolayer train``, ``study`` and ``search``."""
    default = (
        "default: OMP_NUM_THREADS if set, else every usable core"
        if not whose
        else "default: the usable cores shared among the runs at once (ray: --cpus-per-run / --nproc-per-run)"
    )
    p.add_argument(
        "--threads",
        metavar="N|auto",
        help=f"intra-op threads of {whose or 'the run'} (train.threads): a count, fixed for the run ({default}, "
        "and a resume reuses the count its run recorded), or auto: follow the machine's load (not bit-reproducible)",
    )


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
    add_threads_option(p)
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "evaluate",
        help="score a run's chosen checkpoint on a split; writes RUN/scores_SPLIT.json",
        description="Score a run's chosen checkpoint (the newest intact one; with early stopping, the best) on "
        "every sample of a split (or its first --samples) with the metrics its evaluations report; a seq2seq run "
        "decodes every pair it scores and is scored beside its baselines (the source copied; the nearest training "
        "pair's target, or the reference's tokens shuffled). Writes RUN/scores_SPLIT.json.",
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory")
    p.add_argument(
        "--split",
        choices=SCORED_SPLITS,
        help="the split to score (default: the one the run evaluates on); test needs a source that holds one "
        "(data.options.eval_split)",
    )
    p.add_argument(
        "--samples",
        type=int,
        metavar="N",
        help="score the first N samples (rounded up to whole evaluation batches) in the order the run's "
        "evaluations read them, where a many-to-many source takes its directions in turn (default: every one)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if available")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser(
        "generate",
        help="the text a trained causal LM or seq2seq model writes for a prompt",
        description="Print the text a run's model (its standing checkpoint) or an export writes for --prompt: a "
        "causal LM's continuation (greedy; sampling with --temperature, --top-k, --top-p, --seed), a seq2seq "
        "model's output (greedy; beam search with --beams). A seq2seq prompt is the source, written as the data "
        "writes it (a synthetic task's symbols separated by spaces, e.g. '3 1 4 1 5').",
    )
    p.add_argument("run", metavar="RUN", help="a run directory or a folder written by kilolayer export")
    p.add_argument("--prompt", required=True, help="the text to continue (causal LM) or translate (seq2seq)")
    p.add_argument("--max-new-tokens", type=int, help="most tokens to write (default: 64; seq2seq: source + 8)")
    p.add_argument("--temperature", type=float, help="0 = greedy; above 0 samples (default 0, or 1 with top-k/p)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample among the most likely tokens whose probability reaches p")
    p.add_argument("--seed", type=int, help="seed of the sampling, for the same text again")
    p.add_argument("--beams", type=int, default=1, help="seq2seq: beam search with this many beams (default 1)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam search ranks log-probability / length**this")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"], help="default: cpu")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "export",
        help="write a run's model as model.safetensors + config.yaml + tokenizer files, loadable without the run",
        description="Write the model of a run (its standing checkpoint) to --out: model.safetensors (backbone and "
        "heads), config.yaml and tokenizer.json (+ the tokenizer's own files). kilolayer.load(OUT) and kilolayer "
        "generate OUT read it without the run directory or its data.",
    )
    p.add_argument("run", metavar="RUN", help="a run directory")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (must not exist, or be empty)")
    p.set_defaults(func=cmd_export)
