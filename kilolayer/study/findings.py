"""Findings: what a paper claims, what the runs measured, and a verdict from a stated rule.

The verdict rule (:func:`verdict`) is the same for every finding: the claim is
turned into per-seed paired differences ``d`` that are positive when the
claim holds. With ``m`` their mean and ``se`` their standard error (0 for one
seed), the threshold is ``t = max(margin, 2 se)``:

* ``held`` if ``m > t``; ``did not hold`` if ``m < -t``;
* ``inconclusive`` otherwise (the difference is within noise or margin), or
  when a needed run is missing or failed.

Nothing is decided in advance: the verdicts come from the numbers.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

HELD, NOT_HELD, INCONCLUSIVE = "held", "did not hold", "inconclusive"


@dataclass
class Verdict:
    verdict: str
    mean: float = float("nan")
    threshold: float = float("nan")
    n: int = 0
    reason: str = ""


def verdict(diffs: list[float], margin: float, unit: str = "") -> Verdict:
    """Decide a claim from per-seed differences that are positive when it holds (see module docstring)."""
    diffs = [d for d in diffs if d is not None and not math.isnan(d)]
    if not diffs:
        return Verdict(INCONCLUSIVE, reason="no usable runs")
    n = len(diffs)
    m = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else 0.0
    t = max(margin, 2 * se)
    pairs = f"{n} paired comparison{'s' if n > 1 else ''}"
    desc = f"mean difference {m:+.3g}{unit} over {pairs}, threshold {t:.3g}{unit} (max of margin {margin:g}, 2 x s.e.)"
    if m > t:
        v = HELD
    elif m < -t:
        v = NOT_HELD
    else:
        v = INCONCLUSIVE
        desc += "; within noise"
    if n == 1 and v != INCONCLUSIVE:
        desc += "; one comparison only (one seed), so the noise across seeds is unknown"
    return Verdict(v, m, t, n, desc)


@dataclass
class Finding:
    name: str
    title: str
    claim: str
    reference: str
    rule: str
    verdict: Verdict
    headers: list[str] = field(default_factory=list)
    rows: list[list] = field(default_factory=list)
    plots: list[tuple[str, str]] = field(default_factory=list)  # (path, caption)
    scale_up: str = ""


FINDINGS: dict[str, Callable] = {}


def register_finding(name: str):
    """Register ``fn(results, out) -> Finding | None`` under ``name`` (None: the study lacks its groups).
    Findings find their runs by group name (see kilolayer/study/builtin.py)."""

    def deco(fn):
        FINDINGS[name] = fn
        return fn

    return deco


# ---------------------------------------------------------------- helpers


def _group(results, name):
    return [r for r in results if r.point.group == name]


def _val(r, key):
    return r.point.values.get(key)


def _depth(r) -> int:
    return int(r.point.config.model.layers)


def final_loss(r) -> float:
    """The last evaluation loss; a diverged or failed run counts as chance level (log vocabulary)."""
    if r.status == "completed" and "loss" in r.eval:
        return float(r.eval["loss"])
    return math.log(r.point.config.model.vocab_size)


def _seeds(rs):
    return sorted({_val(r, "train.seed") for r in rs})


def _fmt(x, nd=3):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


# ---------------------------------------------------------------- DeepNet


def _run(rs, scheme: str, depth: int, seed):
    """The run of ``scheme`` at ``depth`` layers per side with ``seed``, or None."""
    found = [r for r in rs if _depth(r) == depth and _val(r, "model.scheme") == scheme and _val(r, "train.seed") == seed]
    return found[0] if found else None


def _scheme_depth_table(rs):
    schemes = sorted({_val(r, "model.scheme") for r in rs})
    depths = sorted({_depth(r) for r in rs})
    rows = []
    for s in schemes:
        row = [s]
        for d in depths:
            cell = [r for r in rs if _val(r, "model.scheme") == s and _depth(r) == d]
            parts = []
            for r in cell:
                if r.status == "diverged":
                    parts.append(f"diverged@{r.step}")
                elif r.status != "completed":
                    parts.append(r.status)
                else:
                    em = r.eval.get("exact_match")
                    parts.append(f"{final_loss(r):.3f}" + (f" (EM {em:.2f})" if em is not None else ""))
            row.append(", ".join(parts) or "-")
        rows.append(row)
    headers = ["scheme"] + [f"{d}L-{d}L" if rs[0].point.config.model.arch == "encoder_decoder" else f"{d}L"
                            for d in depths]
    return headers, rows


def _scheme_vs(results, loser: str, winner: str, name: str, title: str, claim: str, margin: float):
    rs = _group(results, "deepnet")
    if not rs:
        return None
    headers, rows = _scheme_depth_table(rs)
    deepest = max(_depth(r) for r in rs)
    diffs = []
    for seed in _seeds(rs):
        a, b = _run(rs, loser, deepest, seed), _run(rs, winner, deepest, seed)
        if a and b:
            diffs.append(final_loss(a) - final_loss(b))
    v = verdict(diffs, margin, " nats")
    if not diffs:
        v.reason = f"the grid has no {loser} and {winner} runs at the same depth and seed"
    rule = (f"d = final validation loss of {loser} minus that of {winner} at the deepest setting ({deepest} layers "
            f"per side), per seed; a diverged or failed run counts as chance level (ln vocabulary). "
            f"Margin {margin} nats.")
    return Finding(name, title, claim, "Wang et al. 2022, DeepNet (arXiv 2203.00555)", rule, v, headers, rows)


@register_finding("deepnet_postln")
def deepnet_postln(results, out):
    f = _scheme_vs(
        results, "post_ln", "deepnorm", "deepnet_postln",
        "DeepNorm trains where Post-LN fails at depth",
        "At the same learning rate and warm-up, Post-LN's training degrades or diverges as depth grows, while "
        "DeepNorm (x <- LN(alpha x + G(x)) with its beta-scaled init) trains stably to a lower loss.",
        margin=0.05,
    )
    if f is None:
        return None
    f.scale_up = ("More depth (50L-50L, 100L-100L: the `deepnet` study), a real translation task, and 3+ seeds. "
                  "The paper's effect grows with depth; at 18L-18L on a toy task it can be small.")
    f.plots = _curves(results, "deepnet", out, "deepnet_loss.png")
    return f


@register_finding("deepnet_preln")
def deepnet_preln(results, out):
    f = _scheme_vs(
        results, "pre_ln", "deepnorm", "deepnet_preln",
        "DeepNorm matches or beats Pre-LN at depth",
        "DeepNorm keeps Post-LN's better quality: at depth it reaches a lower loss than Pre-LN "
        "(paper: BLEU 28.9 vs about 27.4 at 100L-100L on WMT-17 En-De, secondary source).",
        margin=0.02,
    )
    if f is None:
        return None
    f.scale_up = ("The paper's Pre-LN gap appears in final quality after long training on real MT data; "
                  "a few hundred steps on a synthetic task mostly measure optimisation speed. Train longer and "
                  "compare BLEU on held-out data.")
    return f


@register_finding("deepnet_update")
def deepnet_update(results, out):
    rs = [r for r in _group(results, "deepnet") if r.diagnostics]
    if not rs:
        return None
    deepest = max(_depth(r) for r in rs)
    rows, diffs = [], []
    for r in sorted(rs, key=lambda r: (_val(r, "model.scheme"), _depth(r))):
        ups = [d["update"] for d in r.diagnostics]
        rows.append([_val(r, "model.scheme"), _depth(r), _val(r, "train.seed"), _fmt(max(ups) if ups else None),
                     _fmt(ups[0] if ups else None)])
    for seed in _seeds(rs):
        a, b = _run(rs, "post_ln", deepest, seed), _run(rs, "deepnorm", deepest, seed)
        if a and b:
            ua, ub = a.diagnostics[0]["update"], b.diagnostics[0]["update"]
            diffs.append(math.log(ua / ub) if ua > 0 and ub > 0 else float("nan"))
    v = verdict(diffs, math.log(1.5))
    rule = ("d = ln(first model update ||F(x, theta_1) - F(x, theta_0)|| of post_ln / that of deepnorm) "
            f"on a fixed probe batch at the deepest setting ({deepest} layers per side); margin ln 1.5 "
            "(post_ln's update at least 1.5x DeepNorm's). The table also shows how it grows with depth.")
    plots = _update_plot(rs, out, "deepnet_update.png") + _stability_plot(rs, out)
    return Finding(
        "deepnet_update", "Post-LN's early updates are large; DeepNorm's stay bounded",
        "DeepNorm bounds the model update in the first steps by a constant, whereas Post-LN's update grows with "
        "depth and destabilises training (DeepNet, section 3 and its Figure 3).",
        "Wang et al. 2022, DeepNet (arXiv 2203.00555)", rule, v,
        ["scheme", "layers", "seed", "max update", "update at step 1"], rows, plots,
        "Log diagnostics every step over the first few hundred steps at 18L-18L and deeper.",
    )


# ---------------------------------------------------------------- Bamboo


def _accuracy(r) -> Optional[float]:
    if r is None or r.status != "completed":
        return None
    for k in ("accuracy", "test_accuracy"):
        if k in r.eval:
            return float(r.eval[k])
    return None


def _pick(rs, layers, seed):
    c = [r for r in rs if _depth(r) == layers and _val(r, "train.seed") == seed]
    return c[0] if c else None


# (sequence-level group, token-level group, modality) pairs compared for over-smoothing, and each
# modality's untrained baseline group
SMOOTHING_PAIRS = [("supervised", "mae", "images"), ("contrastive", "mae", "images"),
                   ("text_classify", "mlm", "text"), ("text_classify", "next_token", "text")]
UNTRAINED = {"images": "untrained", "text": "text_untrained"}
# (trained from scratch, pre-trained then fine-tuned, what the pre-training was) on the same downstream task
DEPTH_PAIRS = [("supervised", "finetune", "MAE"), ("text_classify", "mlm_finetune", "MLM")]
# token-level objectives whose validation loss (nats per byte) is compared across depths
LOSS_GROUPS = ["next_token", "mlm"]


def _last(r, metric: str) -> Optional[float]:
    if r is None or not r.smoothness or not r.smoothness.get(metric):
        return None
    return float(r.smoothness[metric][-1])


def still_improving(r, key: str, tol: float, lower_is_better: bool = False, relative: bool = False) -> bool:
    """Whether a run's evaluation ``key`` moved by more than ``tol`` (a fraction of its earlier value if
    ``relative``) in its good direction over the last quarter of training: a sign it had not converged, so
    comparisons at this step count are premature."""
    evs = [e for e in (r.evals if r is not None else []) if key in e]
    if len(evs) < 2:
        return False
    last = evs[-1]
    earlier = [e for e in evs if e["step"] <= 0.75 * last["step"]] or evs[:1]
    before = float(earlier[-1][key])
    gain = before - float(last[key]) if lower_is_better else float(last[key]) - before
    return gain > (tol * abs(before) if relative else tol)


def _convergence_note(runs: list, key: str, tol: float, lower_is_better: bool = False, relative: bool = False) -> str:
    runs = list({r.point.key: r for r in runs if r is not None and r.ok}.values())  # a group may be in two pairs
    moving = [r for r in runs if still_improving(r, key, tol, lower_is_better, relative)]
    if not moving:
        return ""
    by = f"{tol:.0%}" if relative else f"{tol:g}"
    return (f"; {len(moving)} of {len(runs)} runs were still improving {key} by more than {by} over their last "
            "quarter of steps, so they had not converged: train longer before trusting this comparison")


def _shape(r) -> str:
    return f"{_depth(r)} x {r.point.config.model.width}"


@register_finding("bamboo_smoothing")
def bamboo_smoothing(results, out):
    rows, diffs = [], []
    for seq, tok, modality in SMOOTHING_PAIRS:
        a_rs, b_rs = _group(results, seq), _group(results, tok)
        if not a_rs or not b_rs:
            continue
        base = _group(results, UNTRAINED[modality])
        for layers in sorted({_depth(r) for r in a_rs}):
            for seed in _seeds(a_rs):
                a, b = _pick(a_rs, layers, seed), _pick(b_rs, layers, seed)
                u = _pick(base, layers, seed) or _pick(base, layers, 0)
                ca, cb = _last(a, "cosine"), _last(b, "cosine")
                rows.append([f"{seq} vs {tok}", _shape(a) if a else layers, seed, _fmt(_last(u, "cosine")),
                             _fmt(ca), _fmt(cb), _fmt(_last(a, "cosine_centred")), _fmt(_last(b, "cosine_centred")),
                             _fmt(_last(a, "hc_ratio")), _fmt(_last(b, "hc_ratio"))])
                if ca is not None and cb is not None:
                    diffs.append(ca - cb)
    if not rows:
        return None
    v = verdict(diffs, 0.05)
    v.reason += _convergence_note([r for a, b, _ in SMOOTHING_PAIRS for r in _group(results, a) + _group(results, b)],
                                  "loss", 0.02, lower_is_better=True, relative=True)
    pairs = "; ".join(f"{a} vs {b}" for a, b, _ in SMOOTHING_PAIRS)
    rule = ("d = last-layer mean token cosine similarity of a sequence-level model minus that of a token-level "
            f"model of the same shape and seed, on the same validation inputs, over every pair present ({pairs}); "
            "margin 0.05. The table also gives the dataset-centred cosine and the HC ratio (high/low frequency "
            "energy; lower is smoother) of each.")
    plots = _smoothness_plot(results, out, "bamboo_smoothness.png")
    return Finding(
        "bamboo_smoothing", "Sequence-level training over-smooths tokens; token-level training does not",
        "A sequence-level objective (supervised classification, CLIP) makes token representations converge in "
        "the top layers (token cosine high); a token-level objective (MAE, masked tokens, next token) keeps them "
        "distinct (cosine low).",
        "Xue et al. 2023, A Study on Transformer Configuration and Training Objective (arXiv 2205.10505)",
        rule, v, ["sequence vs token level", "layers x width", "seed", "cosine untrained", "cosine seq",
                  "cosine token", "centred seq", "centred token", "HC seq", "HC token"],
        rows, plots,
        "Compare at matched convergence (train the token-level model until its probe or fine-tuning accuracy "
        "plateaus), with more tokens per input and 3+ seeds; the `bamboo` study does this for five objectives.",
    )


@register_finding("bamboo_depth")
def bamboo_depth(results, out):
    rows, diffs, used = [], [], []
    for scratch, tuned, pre in DEPTH_PAIRS:
        sup, ft = _group(results, scratch), _group(results, tuned)
        if not sup or not ft:
            continue
        depths = sorted({_depth(r) for r in sup})
        if len(depths) < 2:
            continue
        shallow, deep = depths[0], depths[-1]
        s_shape = _shape(_pick(sup, shallow, _seeds(sup)[0]))
        d_shape = _shape(_pick(sup, deep, _seeds(sup)[0]))
        used.append(f"{pre}: {d_shape} vs {s_shape}")
        for seed in _seeds(sup):
            s0, s1 = _accuracy(_pick(sup, shallow, seed)), _accuracy(_pick(sup, deep, seed))
            f0, f1 = _accuracy(_pick(ft, shallow, seed)), _accuracy(_pick(ft, deep, seed))
            rows.append([f"{scratch} vs {pre} + {tuned}", seed, s_shape, d_shape, _fmt(s0), _fmt(s1), _fmt(f0),
                         _fmt(f1)])
            if None not in (s0, s1, f0, f1):
                diffs.append((f1 - f0) - (s1 - s0))
    if not rows:
        return None
    v = verdict(diffs, 0.01)
    v.reason += _convergence_note([r for a, b, _ in DEPTH_PAIRS for r in _group(results, a) + _group(results, b)],
                                  "accuracy", 0.01)
    rule = ("d = (accuracy gain of the deepest-narrowest shape over the shallowest-widest) after token-level "
            "pre-training + fine-tuning minus the same gain for training the same task from scratch, per seed and "
            f"per pair ({'; '.join(used)}); margin 0.01. The plot shows every shape.")
    return Finding(
        "bamboo_depth", "Deeper-narrower pays off for token-level pre-training, not for supervised training",
        "At matched parameters, going deeper and narrower helps a model pre-trained with a token-level objective "
        "(MAE, masked tokens) more than one trained on the task from scratch, whose tokens over-smooth with depth.",
        "Xue et al. 2023 (arXiv 2205.10505): Bamboo-B 84.2% vs MAE ViT-B 83.3% ImageNet top-1",
        rule, v, ["comparison", "seed", "shallow", "deep", "scratch shallow", "scratch deep", "pre-trained shallow",
                  "pre-trained deep"], rows, _depth_plot(results, out, "bamboo_depth.png"),
        scale_up="Real images at ImageNet scale are where the paper measured +0.9 points; digits (1,797 8x8 images) "
                 "saturate near 100% accuracy, which hides depth effects. Use a larger image folder, and pre-train "
                 "until the fine-tuned accuracy plateaus.",
    )


@register_finding("bamboo_depth_tokens")
def bamboo_depth_tokens(results, out):
    rows, diffs = [], []
    for name in LOSS_GROUPS:
        rs = _group(results, name)
        depths = sorted({_depth(r) for r in rs})
        if len(depths) < 2:
            continue
        for seed in _seeds(rs):
            runs = [_pick(rs, d, seed) for d in depths]
            losses = [float(r.eval["loss"]) if r is not None and r.ok and "loss" in r.eval else None for r in runs]
            rows.append([name, seed] + [f"{_shape(r)}: {_fmt(x)}" if r is not None else "-"
                                        for r, x in zip(runs, losses)])
            if losses[0] is not None and losses[-1] is not None:
                diffs.append(losses[0] - losses[-1])
    if not rows:
        return None
    v = verdict(diffs, 0.02, " nats")
    v.reason += _convergence_note([r for g in LOSS_GROUPS for r in _group(results, g)], "loss", 0.02,
                                  lower_is_better=True)
    rule = ("d = final validation loss (nats per byte) of the shallowest-widest shape minus that of the "
            f"deepest-narrowest, per seed, for each token-level text objective present ({', '.join(LOSS_GROUPS)}); "
            "margin 0.02 nats. A failed or diverged run leaves its pair out.")
    width = max(len(r) for r in rows)
    return Finding(
        "bamboo_depth_tokens", "Token-level objectives reach a lower loss deeper and narrower",
        "Token-level objectives do not over-smooth, so at matched parameters a deeper, narrower Transformer "
        "reaches a lower loss (Bamboo's argument for next-token and masked-token pre-training).",
        "Xue et al. 2023 (arXiv 2205.10505)", rule, v,
        ["objective", "seed"] + [f"shape {i + 1}" for i in range(width - 2)], rows,
        scale_up="Token-level gains from depth show up with enough data and steps for the deep model to converge; "
                 "train to a plateau and report tokens seen.",
    )


# ---------------------------------------------------------------- plots


def _curves(results, group, out, fname):
    from kilolayer.study.plots import loss_curves

    rs = _group(results, group)
    path = out / "report_files" / fname
    if loss_curves(rs, path):
        return [(str(path), "validation loss vs step, one panel per depth")]
    return []


def _update_plot(rs, out, fname):
    from kilolayer.study.plots import update_curves

    path = out / "report_files" / fname
    if update_curves(rs, path):
        return [(str(path), "model update ||F(x, theta_t) - F(x, theta_0)|| vs step")]
    return []


def _stability_plot(rs, out):
    """DeepNet's per-layer diagnostics (gradient norms, LayerNorm inputs, update, loss) of every scheme at
    18 layers per side (the paper's Figure 3 setting), or the deepest setting below that; first seed."""
    from kilolayer.analysis.plots import plot_stability
    from kilolayer.analysis.stability import read_run

    depths = sorted({_depth(r) for r in rs})
    depth = 18 if 18 in depths else max([d for d in depths if d < 18] or depths)
    seed = _seeds(rs)[0]
    chosen = sorted((r for r in rs if _depth(r) == depth and _val(r, "train.seed") == seed),
                    key=lambda r: _val(r, "model.scheme") or "")
    if not chosen:
        return []
    runs = [read_run(r.point.run_dir(out), name=str(_val(r, "model.scheme"))) for r in chosen]
    paths = plot_stability(runs, out / "report_files" / "deepnet_stability")
    return [(str(p), f"{depth}-layer models (seed {seed}): gradient norm per layer and LayerNorm input size at "
                     "three steps, model update and loss vs step") for p in paths if str(p).endswith(".png")]


def _smoothness_plot(results, out, fname):
    from kilolayer.study.plots import smoothness_curves

    names = {*UNTRAINED.values(), *(g for pair in SMOOTHING_PAIRS for g in pair[:2]), "finetune", "mlm_finetune"}
    rs = [r for r in results if r.point.group in names and r.smoothness]
    path = out / "report_files" / fname
    if smoothness_curves(rs, path):
        return [(str(path), "token cosine similarity per layer (mean over seeds), by objective and shape")]
    return []


def _depth_plot(results, out, fname):
    from kilolayer.study.plots import depth_curves

    path = out / "report_files" / fname
    if depth_curves(results, path):
        return [(str(path), "task metric and validation loss vs depth at matched parameters (mean over seeds)")]
    return []
