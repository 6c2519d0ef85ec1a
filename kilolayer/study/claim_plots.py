"""The plots a claim may ask for (``plots: [loss_curves, ...]``), drawn by the report from the runs the claim reads
(its groups' runs with its ``where`` values; for a plot marked ``whole_study``, every group's) into
``report_files/``. Each gives ``[(path, caption)]`` (empty when it has nothing to draw)."""

from __future__ import annotations

import json
from pathlib import Path

from kilolayer.registry import Registry

CLAIM_PLOTS: Registry = Registry("claims.plots", "claim plot")


def claim_plots(claim, results, out: Path) -> list[tuple[str, str]]:
    """The plots ``claim`` asks for, each drawn from the runs the claim reads (its groups' runs with its ``where``
    values, so a plot shows the cells its verdict compares), or, for a plot marked ``whole_study``, from every run
    of the study."""
    from kilolayer.verdicts.claims import claim_runs

    runs = claim_runs(claim, results)
    return [
        plot
        for name in claim.plots
        for plot in CLAIM_PLOTS[name](
            results if getattr(CLAIM_PLOTS[name], "whole_study", False) else runs, out, claim.name
        )
    ]


def _drawn(ok: bool, path: Path, caption: str) -> list[tuple[str, str]]:
    return [(str(path), caption)] if ok else []


def _panel_key(runs) -> str:
    """The grid key the runs vary besides the scheme (one panel per value of it), else the depth."""
    varied = [
        k
        for k in dict.fromkeys(k for r in runs for k in r.point.values)
        if k not in ("model.scheme", "train.seed") and len({json.dumps(r.point.values.get(k)) for r in runs}) > 1
    ]
    return varied[0].split(",")[0] if varied else "model.layers"


@CLAIM_PLOTS.register("loss_curves")
def loss_curves(runs, out: Path, stem: str) -> list[tuple[str, str]]:
    from kilolayer.study.plots import loss_curves as draw

    path, by = out / "report_files" / f"{stem}_loss.png", _panel_key(runs)
    return _drawn(draw(runs, path, by=by), path, f"validation loss vs step, one panel per {by}")


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


@CLAIM_PLOTS.register("layer_gradients")
def layer_gradients(runs, out: Path, stem: str) -> list[tuple[str, str]]:
    from kilolayer.study.plots import layer_gradient_curves as draw

    path = out / "report_files" / f"{stem}_gradients.png"
    caption = "gradient norm per layer, geometric mean over the early diagnostics steps (deepest setting, first seed)"
    return _drawn(draw(runs, path), path, caption)


@CLAIM_PLOTS.register("last_layer_gradients")
def last_layer_gradients(runs, out: Path, stem: str) -> list[tuple[str, str]]:
    from kilolayer.study.plots import last_layer_gradient_curves as draw

    path = out / "report_files" / f"{stem}_gradients.png"
    caption = "the last decoder layer's gradient norm vs depth, geometric mean over the early diagnostics steps"
    return _drawn(draw(runs, path), path, caption)


@CLAIM_PLOTS.register("smoothness")
def smoothness(runs, out: Path, stem: str) -> list[tuple[str, str]]:
    """Token cosine per layer of every group of the study with a smoothness analysis (the claim's and the others
    of its modality), by objective and shape."""
    from kilolayer.study.plots import smoothness_curves as draw

    path = out / "report_files" / f"{stem}_smoothness.png"
    caption = "token cosine similarity per layer (mean over seeds), by objective and shape"
    return _drawn(draw([r for r in runs if r.smoothness], path), path, caption)


smoothness.whole_study = True  # drawn from every group of the study, not only the claim's


@CLAIM_PLOTS.register("depth")
def depth(runs, out: Path, stem: str) -> list[tuple[str, str]]:
    from kilolayer.study.plots import depth_curves as draw

    path = out / "report_files" / f"{stem}_depth.png"
    caption = (
        "task metric (on the test split where every run was scored on it) and validation loss vs depth at matched "
        "parameters (mean over seeds)"
    )
    return _drawn(draw(runs, path), path, caption)


depth.whole_study = True
