"""``kilolayer analyze``: over-smoothing curves and DeepNet's stability plots.

kilolayer analyze smoothness (--run DIR | --hf MODEL_DIR) [--text FILE | --images DIR | --data NAME] --out DIR
kilolayer analyze smoothness --compare A.json B.json ... --out DIR
kilolayer analyze stability --run DIR [--run DIR2 ...] --out DIR
"""

from __future__ import annotations

import json
from pathlib import Path

from kilolayer.errors import InputError


def _table(result: dict) -> str:
    from kilolayer.analysis.smoothness import METRICS

    metrics = [m for m in METRICS if m in result]
    widths = [max(10, len(m)) for m in metrics]
    head = "layer " + " ".join(f"{m:>{w}s}" for m, w in zip(metrics, widths))
    rows = [head]
    for i, layer in enumerate(result["layers"]):
        cells = " ".join(f"{result[m][i]:{w}.4f}" for m, w in zip(metrics, widths))
        rows.append(f"{layer:5d} {cells}")
    return "\n".join(rows)


def _out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        reason = err.strerror or err.__class__.__name__
        raise InputError(f"--out {out}: cannot create the directory ({reason})") from None
    return out


def cmd_smoothness(args) -> int:
    from kilolayer.analysis.plots import compare

    if args.compare:
        if args.text or args.images or args.data:
            raise InputError("--compare takes smoothness.json files only (no --text/--images/--data)")
        paths = compare(args.compare, _out_dir(args.out) / "smoothness_compare", depth=args.depth, svg=args.svg)
        print("wrote " + ", ".join(map(str, paths)))
        return 0
    if args.samples < 1 or args.batch_size < 1:
        raise InputError(f"--samples {args.samples} / --batch-size {args.batch_size}: must be positive")
    from kilolayer.train.device import resolve_device

    args.device = resolve_device(args.device)
    if args.hf:
        from kilolayer.analysis.hf import smoothness_of_hf

        if args.data:
            raise InputError(
                "--data NAME names a kilolayer data source and works with --run; "
                "for --hf give --text FILE or --images DIR"
            )
        if args.include_special or args.after_final_norm or args.include_blank:
            raise InputError(
                "--include-special / --include-blank / --after-final-norm work with --run; for --hf use --exclude-cls "
                "(a Hugging Face model's last hidden state is what the model returns)"
            )
        result = smoothness_of_hf(
            args.hf,
            text=args.text,
            images=args.images,
            samples=args.samples,
            batch_size=args.batch_size,
            exclude_first=args.exclude_cls,
            device=args.device,
        )
    else:
        from kilolayer.analysis.smoothness import smoothness_of_run

        if args.text or args.images:
            raise InputError(
                "--run analyses a kilolayer data source: use --data NAME (default: the run's own "
                "data); --text/--images work with --hf"
            )
        result = smoothness_of_run(
            args.run,
            data=args.data,
            samples=args.samples,
            batch_size=args.batch_size,
            exclude_first=args.exclude_cls,
            exclude_special=not args.include_special,
            exclude_blank=not args.include_blank,
            after_final_norm=args.after_final_norm,
            device=args.device,
        )
    if args.name:
        result["name"] = args.name
    # what was left out of the metrics: --exclude-cls, or (for --run, by default) CLS and special tokens
    result["exclude_cls"] = bool(args.exclude_cls or result.get("exclude_special"))
    from kilolayer.analysis.plots import save_smoothness

    paths = save_smoothness(result, _out_dir(args.out), depth=args.depth, svg=args.svg)
    print(f"{result['name']}: {result['depth']} layers, {result['samples']} samples ({result['input']})")
    print(_table(result))
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def cmd_stability(args) -> int:
    from kilolayer.analysis.plots import plot_stability
    from kilolayer.analysis.smoothness import json_safe
    from kilolayer.analysis.stability import read_runs, summary

    runs = read_runs(args.run)
    out = _out_dir(args.out)
    paths = plot_stability(runs, out / "stability", steps=args.steps or None, svg=args.svg)
    json_path = out / "stability.json"
    json_path.write_text(json.dumps(json_safe(summary(runs)), indent=1) + "\n")
    for name, s in summary(runs).items():
        print(
            f"{name}: diagnostics at {len(s['steps'])} steps, update {s['update'][0]:.4g} (step "
            f"{s['steps'][0]}) -> {s['update'][-1]:.4g} (step {s['steps'][-1]})"
        )
    print("wrote " + ", ".join(map(str, [*paths, json_path])))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("analyze", help="over-smoothing curves and training-stability plots")
    sub = p.add_subparsers(dest="analysis", metavar="ANALYSIS")
    sub.required = True

    s = sub.add_parser(
        "smoothness",
        help="token similarity, rank collapse and Fourier metrics per layer (a run, a Hugging Face model, "
        "or --compare saved results)",
    )
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a kilolayer training run directory (newest checkpoint)")
    src.add_argument("--hf", metavar="MODEL_DIR", help="a Hugging Face model directory on disk")
    src.add_argument("--compare", nargs="+", metavar="JSON", help="overlay these smoothness.json files")
    inputs = s.add_mutually_exclusive_group()
    inputs.add_argument("--text", metavar="FILE", help="text file, one sample per line (with --hf)")
    inputs.add_argument("--images", metavar="DIR", help="image directory, searched recursively (with --hf)")
    inputs.add_argument("--data", metavar="NAME", help="kilolayer data source (with --run; default: the run's)")
    s.add_argument("--samples", type=int, default=128, help="samples to analyse (default 128)")
    s.add_argument("--batch-size", type=int, default=32, help="samples per forward pass (default 32)")
    s.add_argument("--exclude-cls", action="store_true", help="leave token 0 (CLS) out of the token metrics")
    s.add_argument(
        "--include-special",
        action="store_true",
        help="with --run: keep the CLS token and special-token ids in the metrics (default: left out)",
    )
    s.add_argument(
        "--include-blank",
        action="store_true",
        help="with --run on images: keep the tokens of blank patches (every pixel equal) in the metrics "
        "(default: left out)",
    )
    s.add_argument(
        "--after-final-norm",
        action="store_true",
        help="with --run: take the last layer after the stack's final LayerNorm (default: the last "
        "block's output before it)",
    )
    s.add_argument(
        "--depth",
        choices=["auto", "layer", "relative"],
        default="auto",
        help="x axis: layer index, or depth / L (auto: relative when depths differ)",
    )
    s.add_argument("--name", help="the name in legends and smoothness.json (default: the directory's name)")
    s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    s.add_argument("--svg", action="store_true", help="also write SVG")
    s.add_argument("--out", required=True, metavar="DIR", help="output directory")
    s.set_defaults(func=cmd_smoothness)

    t = sub.add_parser("stability", help="DeepNet's gradient-norm, model-update and LayerNorm-input plots")
    t.add_argument(
        "--run",
        action="append",
        required=True,
        metavar="DIR",
        help="a run directory with diagnostics in metrics.jsonl; repeat to overlay runs",
    )
    t.add_argument(
        "--steps",
        type=int,
        nargs="+",
        metavar="STEP",
        help="steps for the per-layer panels (default: first, middle, last diagnostics)",
    )
    t.add_argument("--svg", action="store_true", help="also write SVG")
    t.add_argument("--out", required=True, metavar="DIR", help="output directory")
    t.set_defaults(func=cmd_stability)
