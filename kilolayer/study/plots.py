"""Plots for study reports (matplotlib, Agg): loss curves, model update, token cosine per layer."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SCHEME_COLORS = {
    "post_ln": "tab:red",
    "pre_ln": "tab:blue",
    "deepnorm": "tab:green",
    "ds_init": "tab:orange",
    "admin": "tab:purple",
    "rezero": "tab:brown",
    "sub_ln": "tab:pink",
    "sandwich_ln": "tab:gray",
    "normformer": "tab:olive",
    "layerscale": "tab:cyan",
    "t_fixup": "black",
}


def _save(fig, path: Path) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def loss_curves(results, path: Path) -> bool:
    """Validation loss vs step; one panel per depth, one line per scheme (and seed)."""
    rs = [r for r in results if r.evals]
    if not rs:
        return False
    depths = sorted({r.point.config.model.layers for r in rs})
    fig, axes = plt.subplots(1, len(depths), figsize=(4.2 * len(depths), 3.4), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], depths):
        for r in sorted((r for r in rs if r.point.config.model.layers == d), key=lambda r: r.point.name):
            scheme = r.point.config.model.scheme
            steps = [e["step"] for e in r.evals]
            loss = [e["loss"] for e in r.evals]
            label = f"{scheme} (seed {r.point.config.train.seed})" + (" diverged" if r.status == "diverged" else "")
            ax.plot(steps, loss, marker="o", ms=3, color=SCHEME_COLORS.get(scheme), label=label)
        cfg = next(r for r in rs if r.point.config.model.layers == d).point.config.model
        ax.set_title(f"{d}L-{cfg.decoder_layers}L" if cfg.arch == "encoder_decoder" else f"{d} layers")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (nats/token)")
    axes[0][-1].legend(fontsize=7)
    return _save(fig, path)


def update_curves(results, path: Path) -> bool:
    """Model update vs step, one line per (scheme, depth): the first seed of each."""
    first = {}
    for r in sorted((r for r in results if r.diagnostics), key=lambda r: r.point.config.train.seed):
        first.setdefault((r.point.config.model.scheme, r.point.config.model.layers), r)
    rs = list(first.values())
    if not rs:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in sorted(rs, key=lambda r: (r.point.config.model.scheme, r.point.config.model.layers)):
        m = r.point.config.model
        ax.plot(
            [d["step"] for d in r.diagnostics],
            [d["update"] for d in r.diagnostics],
            color=SCHEME_COLORS.get(m.scheme),
            alpha=0.35 + 0.65 * m.layers / max(x.point.config.model.layers for x in rs),
            label=f"{m.scheme} {m.layers}L",
        )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("||F(x, θ_t) − F(x, θ_0)|| (mean per token)")
    ax.set_title("Early model update on a fixed probe batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def smoothness_curves(results, path: Path) -> bool:
    """Token cosine per layer (depth normalised to [0, 1]): one column per shape, one row per input kind
    (image patches, tokens), one line per group (mean over seeds)."""
    rs = [r for r in results if r.smoothness and r.smoothness.get("cosine")]
    if not rs:
        return False
    shapes = sorted({(r.point.config.model.layers, r.point.config.model.width) for r in rs})
    kinds = sorted({r.point.config.model.input for r in rs})
    fig, axes = plt.subplots(
        len(kinds), len(shapes), figsize=(4.6 * len(shapes), 3.6 * len(kinds)), sharey=True, squeeze=False
    )
    for row, kind in zip(axes, kinds):
        mine = [r for r in rs if r.point.config.model.input == kind]
        groups = sorted({r.point.group for r in mine})
        for ax, (layers, width) in zip(row, shapes):
            for g in groups:
                curves = [
                    r.smoothness["cosine"]
                    for r in mine
                    if r.point.group == g
                    and (r.point.config.model.layers, r.point.config.model.width) == (layers, width)
                ]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
                x = [i / (n - 1) if n > 1 else 0 for i in range(n)]
                style = ":" if "untrained" in g else "-"
                ax.plot(
                    x, mean, style, marker="o", ms=3, label=f"{g} ({len(curves)} seed{'s' if len(curves) > 1 else ''})"
                )
            ax.set_title(f"{'images' if kind == 'patches' else 'text'}: {layers} layers x {width}")
            ax.set_xlabel("layer / depth (0 = embeddings)")
            ax.grid(alpha=0.3)
        row[0].set_ylabel("mean token cosine similarity")
        row[-1].legend(fontsize=7)
    return _save(fig, path)


QUALITY = ("accuracy", "label_recall_i2t")  # the first of these a group's evaluation has is its task metric
LOSS_PANEL = ("mae", "mlm", "next_token")  # token-level pre-training: validation loss vs depth


def depth_curves(results, path: Path) -> bool:
    """Mean +- sd over seeds vs depth: each group's task metric (left), and the token-level validation losses
    relative to the shallowest shape's (right), so objectives with different loss scales share an axis."""
    done = [r for r in results if r.ok and r.eval]
    groups = sorted({r.point.group for r in done})
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    drew = False
    all_depths = sorted({r.point.config.model.layers for r in done})
    for g in groups:
        rs = [r for r in done if r.point.group == g]
        depths = sorted({r.point.config.model.layers for r in rs})
        if len(depths) < 2:
            continue
        metric = next((k for k in QUALITY if k in rs[0].eval), None)
        panels = ([(acc_ax, metric)] if metric else []) + ([(loss_ax, "loss")] if g in LOSS_PANEL else [])
        for ax, key in panels:
            xs, means, sds = [], [], []
            base = [float(r.eval[key]) for r in rs if r.point.config.model.layers == depths[0] and key in r.eval]
            scale = statistics.fmean(base) if key == "loss" and base and statistics.fmean(base) else 1.0
            for d in depths:
                vals = [
                    float(r.eval[key]) / scale
                    for r in rs
                    if r.point.config.model.layers == d and key in r.eval and math.isfinite(float(r.eval[key]))
                ]
                if vals:
                    xs.append(d)
                    means.append(statistics.fmean(vals))
                    sds.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
            ax.errorbar(xs, means, yerr=sds, marker="o", ms=3, capsize=2, label=f"{g} ({key})")
            drew = True
    if not drew:
        plt.close(fig)
        return False
    loss_ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax, title in (
        (acc_ax, "task metric (validation)"),
        (loss_ax, "token-level loss relative to the shallowest shape"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_depths, [str(d) for d in all_depths])
        ax.minorticks_off()
        ax.set_xlabel("layers (width shrinks to keep parameters matched)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
    return _save(fig, path)
