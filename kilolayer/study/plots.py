"""Plots for study reports (matplotlib, Agg): loss curves, model update, gradient norms, token cosine per layer."""

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
    "post_ln_init": "darkred",
    "r_fixup": "darkgoldenrod",
    "dlcl": "navy",
    "branchnorm": "lime",
}


def _save(fig, path: Path) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _panel_title(r, key: str) -> str:
    m = r.point.config.model
    if key == "model.layers":
        return f"{m.layers}L-{m.decoder_layers}L" if m.arch == "encoder_decoder" else f"{m.layers} layers"
    return f"{key.split('.')[-1]} {r.point.setting(key):g}"


def loss_curves(results, path: Path, by: str = "model.layers") -> bool:
    """Validation loss vs step; one panel per value of the config key ``by`` (depth unless told), one line per
    scheme (and seed)."""
    rs = [r for r in results if r.evals]
    if not rs:
        return False
    values = sorted({r.point.setting(by) for r in rs})
    fig, axes = plt.subplots(1, len(values), figsize=(4.2 * len(values), 3.4), sharey=True, squeeze=False)
    for ax, v in zip(axes[0], values):
        mine = sorted((r for r in rs if r.point.setting(by) == v), key=lambda r: r.point.name)
        for r in mine:
            scheme = r.point.config.model.scheme
            steps = [e["step"] for e in r.evals]
            loss = [e["loss"] for e in r.evals]
            label = f"{scheme} (seed {r.point.config.train.seed})" + (" diverged" if r.status == "diverged" else "")
            ax.plot(steps, loss, marker="o", ms=3, color=SCHEME_COLORS.get(scheme), label=label)
        ax.set_title(_panel_title(mine[0], by))
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


def _log_gradients(r) -> tuple[list[str], list[float]] | None:
    """A run's layer names and each layer's mean ln gradient norm over every diagnostics step it logged."""
    from kilolayer.analysis.stability import mean_log_gradients, read_diagnostics
    from kilolayer.errors import InputError

    try:
        lines = [d for d in read_diagnostics(r.diagnostics, r.point.key) if d.layers]
    except InputError:
        return None
    logs = mean_log_gradients(lines, [d.step for d in lines]) if lines else None
    return (lines[0].layers, logs) if logs is not None else None


def _exp(values) -> list[float]:
    return [math.exp(v) if math.isfinite(v) else math.nan for v in values]


def layer_gradient_curves(results, path: Path) -> bool:
    """DeepNet's Figure 3(a): the gradient norm of every layer (geometric mean over the run's diagnostics steps),
    bottom to top, one line per scheme, at the deepest setting and first seed."""
    rs = [r for r in results if r.diagnostics]
    if not rs:
        return False
    deepest = max(r.point.config.model.layers for r in rs)
    seed = min(r.point.config.train.seed for r in rs)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    drew = None
    for r in sorted(rs, key=lambda r: r.point.config.model.scheme):
        if r.point.config.model.layers != deepest or r.point.config.train.seed != seed:
            continue
        got = _log_gradients(r)
        if got is None:
            continue
        names, logs = got
        scheme = r.point.config.model.scheme
        ax.plot(range(len(names)), _exp(logs), marker="o", ms=3, color=SCHEME_COLORS.get(scheme), label=scheme)
        drew = names
    if drew is None:
        plt.close(fig)
        return False
    stacks = [n.split(".")[0] for n in drew]
    for i in range(1, len(stacks)):
        if stacks[i] != stacks[i - 1]:
            ax.axvline(i - 0.5, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel(" then ".join(dict.fromkeys(stacks)) + " layers, bottom to top")
    ax.set_ylabel("||dL/dθ_layer|| (geometric mean)")
    ax.set_title(f"Gradient norm per layer over the early steps (seed {seed})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def last_layer_gradient_curves(results, path: Path) -> bool:
    """DeepNet's Figure 3(b): the top layer's gradient norm (geometric mean over each run's diagnostics steps) vs
    depth, one line per scheme (geometric mean over seeds), each seed a point."""
    points: dict[str, dict[int, list[float]]] = {}
    for r in results:
        got = _log_gradients(r) if r.diagnostics else None
        if got is not None and math.isfinite(got[1][-1]):
            m = r.point.config.model
            points.setdefault(m.scheme, {}).setdefault(m.layers, []).append(got[1][-1])
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.8))
    depths = sorted({d for by_depth in points.values() for d in by_depth})
    for scheme, by_depth in sorted(points.items()):
        xs = sorted(by_depth)
        colour = SCHEME_COLORS.get(scheme)
        ax.plot(xs, [math.exp(statistics.fmean(by_depth[d])) for d in xs], marker="o", color=colour, label=scheme)
        for d in xs:
            ax.scatter([d] * len(by_depth[d]), _exp(by_depth[d]), s=10, color=colour, alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("layers per side")
    ax.set_ylabel("last layer's ||dL/dθ|| (geometric mean)")
    ax.set_title("The last layer's gradient norm over the early steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
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
        # one colour and style per group in every panel of the row, every group in the row's legend
        untrained = {r.point.group for r in mine if r.point.config.train.untrained}  # dotted: the baselines
        look = {g: dict(ls=":" if g in untrained else "-", color=f"C{i}") for i, g in enumerate(groups)}
        for g in groups:
            seeds = len({r.point.values.get("train.seed") for r in mine if r.point.group == g})
            row[-1].plot([], [], marker="o", ms=3, label=f"{g} ({seeds} seed{'s' if seeds > 1 else ''})", **look[g])
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
                ax.plot(x, mean, marker="o", ms=3, **look[g])
            ax.set_title(f"{'images' if kind == 'patches' else 'text'}: {layers} layers x {width}")
            ax.set_xlabel("layer / depth (0 = embeddings)")
            ax.grid(alpha=0.3)
        row[0].set_ylabel("mean token cosine similarity")
        row[-1].legend(fontsize=7)
    return _save(fig, path)


QUALITY = ("accuracy", "label_recall_i2t")  # the first of these a group's evaluation has is its task metric
LOSS_PANEL = ("mae", "mlm", "causal_lm")  # token-level objectives: their validation loss vs depth


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
        panels = ([(acc_ax, metric)] if metric else []) + (
            [(loss_ax, "loss")] if rs[0].point.config.objective.name in LOSS_PANEL else []
        )
        for ax, key in panels:
            # the task metric on the test split where every run was scored on it (as the verdicts read it)
            test = key != "loss" and all(key in ((r.test or {}).get("metrics") or {}) for r in rs)
            score = {r.point.key: (r.test["metrics"] if test else r.eval).get(key) for r in rs}
            xs, means, sds = [], [], []
            base = [float(score[r.point.key]) for r in rs if r.point.config.model.layers == depths[0] and key in r.eval]
            scale = statistics.fmean(base) if key == "loss" and base and statistics.fmean(base) else 1.0
            for d in depths:
                vals = [
                    float(score[r.point.key]) / scale
                    for r in rs
                    if r.point.config.model.layers == d
                    and score[r.point.key] is not None
                    and math.isfinite(float(score[r.point.key]))
                ]
                if vals:
                    xs.append(d)
                    means.append(statistics.fmean(vals))
                    sds.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
            label = f"{g} ({key}{', test' if test else ''})"
            ax.errorbar(xs, means, yerr=sds, marker="o", ms=3, capsize=2, label=label)
            drew = True
    if not drew:
        plt.close(fig)
        return False
    loss_ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax, title in (
        (acc_ax, "task metric"),
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


def direction_heatmap(table: dict, path: Path, system: str = "model", metric: str = "chrf") -> bool:
    """One cell per direction of a many-to-many run's ``table``
    (:func:`kilolayer.objectives.directions.direction_table`): ``system``'s ``metric``, source language per row,
    target per column, each cell labelled with its score where there are at most 12 languages. The colour scale
    runs from 0 to the best cell, so that the directions of a model that is still learning are told apart."""
    rows = [r for r in (table.get("directions") or {}).values() if metric in (r.get(system) or {})]
    if not rows:
        return False
    langs = list(dict.fromkeys(lang for r in rows for lang in (r["source"], r["target"])))
    at = {lang: i for i, lang in enumerate(langs)}
    n = len(langs)
    grid = [[math.nan] * n for _ in range(n)]
    for r in rows:
        grid[at[r["source"]]][at[r["target"]]] = float(r[system][metric])
    top = max(max(v for row in grid for v in row if math.isfinite(v)), 1e-9)
    fig, ax = plt.subplots(figsize=(1.6 + 0.55 * n, 1.0 + 0.5 * n))
    image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=top)
    ax.set_xticks(range(n), langs, rotation=90 if n > 12 else 0)
    ax.set_yticks(range(n), langs)
    ax.set_xlabel("target")
    ax.set_ylabel("source")
    if n <= 12:
        for i in range(n):
            for j in range(n):
                if math.isfinite(grid[i][j]):
                    light = grid[i][j] < 0.6 * top  # viridis is dark at the bottom of its scale
                    ax.text(j, i, f"{grid[i][j]:.0f}", ha="center", va="center", fontsize=7,
                            color="white" if light else "black")  # fmt: skip
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04).set_label(f"{system} {metric}", fontsize=8)
    return _save(fig, path)
