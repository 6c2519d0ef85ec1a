"""The plots a claim may ask for (``plots: [loss_curves, ...]``), drawn by the report from the runs of the claim's
group into ``report_files/``. Each gives ``[(path, caption)]`` (empty when it has nothing to draw)."""

from __future__ import annotations

from pathlib import Path

from kilolayer.registry import Registry

CLAIM_PLOTS: Registry = Registry("claims.plots", "claim plot")


def _drawn(ok: bool, path: Path, caption: str) -> list[tuple[str, str]]:
    return [(str(path), caption)] if ok else []


@CLAIM_PLOTS.register("loss_curves")
def loss_curves(runs, out: Path, stem: str) -> list[tuple[str, str]]:
    from kilolayer.study.plots import loss_curves as draw

    path = out / "report_files" / f"{stem}_loss.png"
    return _drawn(draw(runs, path), path, "validation loss vs step, one panel per depth")


@CLAIM_PLOTS.register("update_curves")
def update_curves(runs, out: Path, stem: str) -> list[tuple[str, str]]:
    from kilolayer.study.plots import update_curves as draw

    path = out / "report_files" / f"{stem}_update.png"
    return _drawn(draw(runs, path), path, "model update ||F(x, theta_t) - F(x, theta_0)|| vs step")


@CLAIM_PLOTS.register("stability")
def stability(runs, out: Path, stem: str) -> list[tuple[str, str]]:
    """DeepNet's per-layer diagnostics of every scheme at 18 layers per side (Figure 3), or the deepest below, of
    the first seed."""
    from kilolayer.analysis.plots import plot_stability
    from kilolayer.analysis.stability import read_run

    runs = [r for r in runs if (r.point.run_dir(out) / "metrics.jsonl").is_file()]
    if not runs:
        return []
    depths = sorted({r.point.config.model.layers for r in runs})
    depth = 18 if 18 in depths else max([d for d in depths if d < 18] or depths)
    seed = min(r.point.config.train.seed for r in runs)
    chosen = sorted(
        (r for r in runs if r.point.config.model.layers == depth and r.point.config.train.seed == seed),
        key=lambda r: r.point.config.model.scheme,
    )
    read = [read_run(r.point.run_dir(out), name=r.point.config.model.scheme) for r in chosen]
    paths = plot_stability(read, out / "report_files" / f"{stem}_stability")
    caption = (
        f"{depth}-layer models (seed {seed}): gradient norm per layer and LayerNorm input size at three steps, "
        "model update and loss vs step"
    )
    return [(str(p), caption) for p in paths if str(p).endswith(".png")]
