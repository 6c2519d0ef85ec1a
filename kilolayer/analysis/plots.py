"""Figures: over-smoothing curves per layer and DeepNet's stability diagnostics (matplotlib, Agg), and the files of
one smoothness result (its JSON beside its plot).

Every figure has a title, labelled axes and a legend naming the runs, and is
written as PNG (and SVG on request).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kilolayer.analysis.smoothness import METRICS, write_smoothness
from kilolayer.analysis.stability import StabilityRun, pick_steps
from kilolayer.errors import InputError

# y-axis label per metric: units plus which way is "smoother"
Y_LABELS = {
    "cosine": "mean cos(h_i, h_j)\n(1 = all tokens alike)",
    "cosine_centred": "mean cos after removing\nthe set's mean token",
    "cosine_same_minus_different": "mean cos within a sample\nminus across samples",
    "rank_residual": "||X - 1 mean(X)|| / ||X||\n(0 = rank one)",
    "effective_rank": "exp(entropy of singular values)\n(1 = rank one)",
    "hc_ratio": "||X - mean token|| / ||X||\n(0 = all tokens equal)",
    "high_freq": "log amplitude at pi minus at 0\n(lower = smoother)",
}
LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D"]


def _save(fig, stem: Path, svg: bool) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png")]
    fig.savefig(paths[0], dpi=130, bbox_inches="tight")
    if svg:
        paths.append(stem.with_suffix(".svg"))
        fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def _finite(values) -> list[float]:
    return [v if isinstance(v, (int, float)) and math.isfinite(v) else math.nan for v in values]


# ---------------------------------------------------------------- smoothness


def read_smoothness(path: str | Path) -> dict:
    """A ``smoothness.json``, checked: ``layers`` and a same-length ``cosine`` list at least."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"--compare {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"--compare {path}: not a readable JSON file ({err.__class__.__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list) or "cosine" not in data:
        raise InputError(f"--compare {path}: not a smoothness.json (needs 'layers' and 'cosine' lists)")
    for name in METRICS:
        if name in data and (not isinstance(data[name], list) or len(data[name]) != len(data["layers"])):
            raise InputError(f"--compare {path}: '{name}' must be a list as long as 'layers'")
    data.setdefault("name", path.resolve().parent.name)
    return data


def plot_smoothness(
    results: list[dict], stem: str | Path, *, depth: str = "auto", svg: bool = False, title: str | None = None
) -> list[Path]:
    """One panel per metric against layer, one line per result (legend: each result's ``name``).

    ``depth``: "layer" (layer index), "relative" (layer / L, in [0, 1]) or "auto"
    (relative when the results differ in depth). Writes ``stem.png`` (and ``.svg``)."""
    if not results:
        raise InputError("nothing to plot")
    if depth not in ("auto", "layer", "relative"):
        raise InputError(f"depth={depth!r}: expected auto, layer or relative")
    depths = {len(r["layers"]) - 1 for r in results}
    relative = depth == "relative" or (depth == "auto" and len(depths) > 1)
    metrics = [m for m in METRICS if any(m in r for r in results)]
    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.5 * rows + 0.6), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, metric in enumerate(metrics):
        ax = axes[k // cols][k % cols]
        for i, r in enumerate(results):
            if metric not in r:
                continue
            layers = r["layers"]
            L = max(len(layers) - 1, 1)
            x = [layer / L for layer in layers] if relative else layers
            marker = "o" if len(layers) <= 40 else None
            ax.plot(
                x,
                _finite(r[metric]),
                marker=marker,
                markersize=3.5,
                linewidth=1.6,
                color=colours[i % len(colours)],
                label=f"{r.get('name', f'run {i + 1}')} ({L} layers)",
            )
        ax.set_title(METRICS[metric], fontsize=10)
        ax.set_xlabel("relative depth (layer / number of layers)" if relative else "layer (0 = embeddings)")
        ax.set_ylabel(Y_LABELS[metric], fontsize=9)
        if metric in ("cosine", "cosine_same_minus_different", "hc_ratio", "rank_residual"):  # 0 (and cosine's 1)
            low, high = ax.get_ylim()
            low, high = min(low, 0.0), max(high, 1.0) if metric == "cosine" else high
            ax.set_ylim(low, high + 0.04 * (high - low))
        if not relative and max(depths) <= 24:
            ax.set_xticks(range(0, max(depths) + 1, 1 if max(depths) <= 12 else 2))
        ax.grid(alpha=0.3)
    for k in range(len(metrics), rows * cols):
        axes[k // cols][k % cols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    spare = len(metrics) < rows * cols
    if spare:  # the legend fills the empty panel
        axes[-1][-1].legend(handles, labels, loc="center", frameon=False, title="model / run")
    else:
        fig.legend(
            handles, labels, loc="lower center", ncol=min(len(labels), 4), frameon=False, bbox_to_anchor=(0.5, -0.01)
        )
    if title is None:
        if len(results) == 1:
            r = results[0]
            title = f"Over-smoothing by layer: {r.get('name', '')} ({r.get('samples', '?')} samples)"
        else:
            title = "Over-smoothing by layer: " + " vs ".join(str(r.get("name", "?")) for r in results)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0 if spare else 0.06, 1, 1))
    return _save(fig, Path(stem), svg)


def save_smoothness(result: dict, out: str | Path, depth: str = "auto", svg: bool = False) -> list[Path]:
    """Write OUT/smoothness.json (``result``, NaN as null) and its plot; returns the paths written."""
    json_path = write_smoothness(result, out)
    return [json_path, *plot_smoothness([result], Path(out) / "smoothness", depth=depth, svg=svg)]


def compare(paths: list[str | Path], stem: str | Path, *, depth: str = "auto", svg: bool = False) -> list[Path]:
    """Overlay several ``smoothness.json`` files."""
    results = [read_smoothness(p) for p in paths]
    names = [r["name"] for r in results]
    for p, r in zip(paths, results):
        if names.count(r["name"]) > 1:  # two runs called "model": tell them apart by their folder
            r["name"] = f"{r['name']} ({Path(p).resolve().parent.name})"
    return plot_smoothness(results, stem, depth=depth, svg=svg)


# ---------------------------------------------------------------- stability


SIDE_ABBREVIATIONS = {"encoder": "enc", "decoder": "dec"}


def _short(name: str) -> str:
    """'decoder.layers.0.self_attn.pre_norm' -> 'dec.0.self_attn.pre_norm'."""
    side, *rest = name.split(".")
    return ".".join([SIDE_ABBREVIATIONS.get(side, side)] + [p for p in rest if p != "layers"])


def _side_ticks(ax, names: list[str]) -> None:
    """Name the ticks when there are few; otherwise separate and label the sides (encoder / decoder)."""
    sides = [n.split(".")[0] for n in names]
    starts = [i for i, s in enumerate(sides) if i == 0 or s != sides[i - 1]]
    for start in starts[1:]:
        ax.axvline(start - 0.5, color="grey", linewidth=0.8, linestyle="--")
    if len(names) <= 16:
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([_short(n) for n in names], rotation=45, ha="right", fontsize=7)
    elif len(starts) > 1:
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else len(names)
            ax.text(
                (start + end - 1) / 2,
                0.03,
                sides[start],
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=9,
                color="dimgrey",
                bbox=dict(facecolor="white", edgecolor="none", alpha=0.8),
            )


def _log_if_positive(ax, values: list[float]) -> None:
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        ax.set_yscale("log")


def plot_stability(
    runs: list[StabilityRun], stem: str | Path, *, steps: list[int] | None = None, svg: bool = False
) -> list[Path]:
    """DeepNet's diagnostics, runs overlaid (one colour each): gradient norm per layer and LayerNorm
    input size per LayerNorm at a few steps (one line style per step), model update and loss vs step."""
    if not runs:
        raise InputError("nothing to plot")
    steps = steps or pick_steps(runs)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.6))
    (ax_grad, ax_update), (ax_ln, ax_loss) = axes

    grads, lns, updates, losses = [], [], [], []
    for i, run in enumerate(runs):
        colour = colours[i % len(colours)]
        for j, step in enumerate(steps):
            d = run.at(step)
            style = dict(
                linestyle=LINESTYLES[j % len(LINESTYLES)],
                marker=MARKERS[j % len(MARKERS)],
                markersize=3.5,
                color=colour,
                label=f"{run.name}, step {d.step}",
            )
            ax_grad.plot(range(len(d.grad_norm)), _finite(d.grad_norm), **style)
            grads += _finite(d.grad_norm)
            if d.ln_input:
                ax_ln.plot(range(len(d.ln_input)), _finite(d.ln_input), **style)
                lns += _finite(d.ln_input)
        xs, ys = [d.step for d in run.diagnostics], _finite(d.update for d in run.diagnostics)
        ax_update.plot(xs, ys, color=colour, marker="o" if len(xs) <= 40 else None, markersize=3, label=run.name)
        updates += ys
        for split, style in (("train", "-"), ("eval", "--")):
            series = run.losses.get(split, [])
            if series:
                ys = _finite(v for _, v in series)
                ax_loss.plot(
                    [s for s, _ in series],
                    ys,
                    style,
                    color=colour,
                    label=f"{run.name} ({split})",
                    marker="o" if split == "eval" or len(series) <= 40 else None,
                    markersize=3,
                )
                losses += ys

    longest = max(runs, key=lambda r: len(r.diagnostics[0].layers)).diagnostics[0]
    ax_grad.set_title("(a) gradient norm per layer")
    ax_grad.set_xlabel("layer (bottom to top)")
    ax_grad.set_ylabel("||dL/d theta_layer||")
    _side_ticks(ax_grad, longest.layers)
    _log_if_positive(ax_grad, grads)

    ax_update.set_title("(b) model update ||F(x, theta_t) - F(x, theta_0)||")
    ax_update.set_xlabel("training step")
    ax_update.set_ylabel("update on a fixed probe batch")
    _log_if_positive(ax_update, updates)

    longest_ln = max(runs, key=lambda r: len(r.diagnostics[0].ln_names)).diagnostics[0]
    ax_ln.set_title("(c) LayerNorm input magnitude")
    ax_ln.set_xlabel("LayerNorm (bottom to top)")
    ax_ln.set_ylabel("mean |input|")
    if longest_ln.ln_names:
        _side_ticks(ax_ln, longest_ln.ln_names)
    else:
        ax_ln.text(
            0.5,
            0.5,
            "no LayerNorm inputs logged\n(e.g. ReZero, T-Fixup)",
            ha="center",
            va="center",
            transform=ax_ln.transAxes,
            color="grey",
        )
    _log_if_positive(ax_ln, lns)

    ax_loss.set_title("(d) loss")
    ax_loss.set_xlabel("training step")
    ax_loss.set_ylabel("loss")
    if losses:
        _log_if_positive(ax_loss, losses)
    else:
        ax_loss.text(0.5, 0.5, "no loss lines", ha="center", va="center", transform=ax_loss.transAxes, color="grey")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, frameon=False, handlelength=3.5)
    fig.suptitle("Training stability (DeepNet diagnostics): " + " vs ".join(r.name for r in runs), fontsize=12)
    fig.tight_layout()
    return _save(fig, Path(stem), svg)
