"""The search report: DIR/report.md and a self-contained DIR/report.html, written with the study report's
machinery (:mod:`kilolayer.study.report`: its tables, escaping and safe HTML), and the trials' curves."""

from __future__ import annotations

import datetime as _dt
import math
import os
from pathlib import Path

from kilolayer.study.report import _fenced, _table, _text, machine, render_html, versions
from kilolayer.study.search.result import Search, TrialResult
from kilolayer.study.search.shape import default_depths, percent


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.3g}"


def _value(v: float | None) -> str:
    return f"{v:.5g}" if v is not None and math.isfinite(v) else "-"


def curves_plot(search: Search, path: Path) -> bool:
    """The metric at each evaluation of every trial; a cross where a trial was pruned, diverged or left off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = [t for t in search.trials if t.curve]
    if not trials:
        return False
    depths = sorted({t.shape.layers for t in search.trials})
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for t in sorted(trials, key=lambda t: t.number):
        color = cmap(depths.index(t.shape.layers) / max(1, len(depths) - 1))
        steps, values = zip(*t.curve)
        style = "-" if t.state == "completed" else "--"
        label = f"#{t.number} {t.shape.name}" + (f" lr {t.lr:.2g}" if search.settings.lr_factor else "")
        ax.plot(steps, values, style, marker="o", ms=3, color=color, label=f"{label} ({t.state})")
        if t.state != "completed":
            ax.plot(steps[-1], values[-1], "x", ms=9, mew=2, color=color)
    ax.set_xlabel("step")
    ax.set_ylabel(f"evaluation {search.settings.metric}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(trials) > 8 else 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


NOISE = "evaluation-batch noise, one seed"


def _margins(search: Search) -> list[str]:
    """A line for each rung whose cut between the last trial kept and the best one pruned was inside the noise."""
    names = {t.number: t.shape.name for t in search.trials}
    out = []
    for d in search.decisions:
        m = d.get("margin")
        if m and m["within_noise"]:
            out.append(
                f"At rung {d['level']} (step {d['step']}) the cut between {_text(names.get(m['kept'], '?'))} "
                f"(trial {m['kept']}, kept) and {_text(names.get(m['pruned'], '?'))} (trial {m['pruned']}, pruned) "
                f"was within the noise: {m['difference']:+.3g} on {m['batches']} evaluation batches, bound "
                f"+/-{m['bound']:.3g} ({NOISE}); the pruned shape may be as good."
            )
    return out


def _recommendation(search: Search) -> list[str]:
    done = [t for t in search.ranked if t.state == "completed"]
    metric = search.settings.metric
    incomplete = _continue_hint(search)
    if not done:
        if not any(sc.kept for sc in search.screens):
            return ["The pre-screen dropped every shape, so nothing was trained and there is no recommendation.", ""]
        return ["No trial completed, so there is no recommendation yet." + incomplete, ""]
    c = search.comparison
    top = done[0]
    margins = _margins(search)
    if c is not None and c.tied:
        a, b = done[:2]
        return [
            f"**Within noise: no pick.** The top two, {_text(a.shape.name)} (trial {a.number}, {metric} "
            f"{_value(a.value)}) and {_text(b.shape.name)} (trial {b.number}, {_value(b.value)}), differ by "
            f"{c.difference:+.4g} on the same {c.batches} evaluation batches, within the noise bound +/-"
            f"{c.bound:.3g} ({NOISE}: two-sided 95% Student-t on the per-batch differences, standard error "
            f"{c.stderr:.3g}; other seeds were not run). Both configs are written out (`tied-{a.shape.name}.yaml`, "
            f"`tied-{b.shape.name}.yaml`); more evaluation batches (`train.eval_batches`), more steps or other "
            f"seeds would separate them.",
            "",
            *[line for m in margins for line in (m, "")],
        ]
    m = top.shape.model
    layers = f"{m.layers} layer{'s' * (m.layers != 1)}"
    lines = [
        f"**Recommended: {_text(top.shape.name)}** — {layers} x width {m.width} ({m.heads} heads, FFN "
        f"{m.ffn}), {top.shape.parameters:,} parameters, {_count(top.shape.flops_per_token)} training FLOPs per "
        f"token, lr {top.lr:.3g}: {metric} {_value(top.value)} at step {top.step} (trial {top.number}). Its config "
        f"is written to `best.yaml`: `kilolayer train best.yaml --out RUN` trains it.",
        "",
    ]
    if search.stopped_by_budget:
        lines += [f"**The search is incomplete**:{incomplete} This is the best of the trials completed so far.", ""]
    if c is not None:
        b = done[1]
        if c.agrees:
            lines += [
                f"It beats the runner-up {_text(b.shape.name)} (trial {b.number}, {_value(b.value)}) by "
                f"{abs(c.difference):.4g} on the same {c.batches} evaluation batches, beyond the noise bound "
                f"+/-{c.bound:.3g} ({NOISE}: two-sided 95% Student-t on the per-batch differences; other seeds "
                f"were not run).",
                "",
            ]
        else:
            lines += [
                f"**The re-evaluation disagrees with the ranking**: on the same {c.batches} evaluation batches the "
                f"runner-up {_text(b.shape.name)} (trial {b.number}, {_value(b.value)}) scores better by "
                f"{abs(c.difference):.4g} (noise bound +/-{c.bound:.3g}, {NOISE}), so this pick is not reliable; "
                f"treat the two as undecided and train both with other seeds.",
                "",
            ]
    elif len(done) < 2:
        lines += [
            "**Only one trial completed**: successive halving kept one trial to the end, so the recommendation "
            "rests on the rung decisions below, judged at partial training (each on one seed), and was not "
            "compared with another shape at full length.",
            "",
        ]
    else:
        lines += ["One evaluation batch: the noise between the top two was not measured (train.eval_batches >= 2).", ""]
    for line in margins:
        lines += [line, ""]
    if not margins and len(done) < 2 and any(d.get("pruned") for d in search.decisions):
        if any(d.get("margin") is None and d.get("pruned") for d in search.decisions):
            lines += ["The noise at the rung cuts was not measured (one evaluation batch, or no checkpoint).", ""]
        else:
            lines += [f"Every rung's cut was beyond the noise ({NOISE}).", ""]
    return lines


def _continue_hint(search: Search) -> str:
    if search.stopped_by_budget:
        return f" The search stopped because {search.stopped_by_budget}; a larger budget continues it."
    return ""


def _compute(search: Search) -> list[str]:
    bs = search.config.train.batch_size
    steps = search.config.train.steps
    c = search.compute()
    grid = c["grid"]
    minutes = sum(t.seconds for t in search.trials) / 60
    forecast_s = sum(sc.seconds for sc in search.screens)

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.0%}" if b else "-"

    def row(label: str, key: str) -> list:
        steps_, flops = c[key]["steps"], c[key]["flops"]
        return [label, f"{steps_:,}", _count(flops), ratio(flops, grid["flops"])]

    rows = [
        row("**total** (race + the pre-screen's other steps)", "total"),
        row("race (the trials' steps)", "race"),
        row("pre-screen: steps replayed", "prescreen"),
        row("of which the trials' first steps (in the race)", "reused"),
        row("pre-screen: other steps", "extra"),
        ["full grid", f"{grid['steps']:,}", _count(grid["flops"]), "100%"],
    ]
    return [
        f"A full grid trains each of the {search.planned} planned trials for all {steps:,} steps, with no "
        f"pre-screen. Model FLOPs: each shape's training FLOPs per sample at full length "
        f"(docs/bamboo.md#model-flops-and-mfu) x batch size {bs} x steps (evaluations not counted). A shape's "
        f"trial at the config's lr starts from the pre-screen's replay of it, where that ends before the first "
        f"rung: those steps are counted once, in the race.",
        "",
        _table(["", "optimizer steps", "model FLOPs", "FLOPs / full grid"], rows),
        f"Training time: {minutes:.1f} min over all trials; the pre-screen's forecasts took {forecast_s:.0f} s.",
        "",
        *_plan(search),
    ]


def _deviations(search: Search) -> str:
    devs = [sh.deviation for sh in search.shapes]
    return f"{min(devs):+.2%} to {max(devs):+.2%}" if devs else "-"


def _plan(search: Search) -> list[str]:
    """The time plan as it was made, and what the search spent against it."""
    p = search.plan
    if p is None:
        return []
    minutes = p.minutes or search.settings.minutes
    spent = search.seconds_spent()
    if spent <= minutes * 60:
        against = f"within the {minutes:g} minutes"
    else:
        against = f"{(spent - minutes * 60) / 60:.1f} min over the {minutes:g} minutes"
    rerun = (
        f" This run was given --minutes {search.settings.minutes:g}; the trials keep the plan's length."
        if search.settings.minutes is not None and p.minutes and search.settings.minutes != p.minutes
        else ""
    )
    return [
        f"Time plan (--minutes {minutes:g}): finding the shapes and measuring each one's set-up, step and "
        f"evaluation took {p.probe_seconds:.0f} s; the trials' length was then set to {p.steps:,} steps (the "
        f"config's {p.config_steps:,}), the longest whose pre-screen and race were estimated to fit the "
        f"{p.seconds / 60:.1f} minutes left. Estimated in all: {p.total / 60:.1f} min; spent: {spent / 60:.1f} min "
        f"({against}: planning, the pre-screen, the trials' training, the rung cuts and the top two's "
        f"comparison).{rerun}",
        "",
    ]


def _trial_row(rank: int, t: TrialResult, lr_searched: bool) -> list:
    m = t.shape.model
    return [
        rank,
        t.number,
        t.shape.name,
        m.heads,
        f"{t.shape.parameters:,}",
        _count(t.shape.flops_per_token),
        *([f"{t.lr:.3g}"] if lr_searched else []),
        t.step,
        _value(t.value),
        "pruned, continued outside the search" if t.continued else t.state,
    ]


def render_markdown(search: Search, out: Path, plot: Path | None) -> str:
    cfg, s = search.config, search.settings
    tc = cfg.train
    metric = s.metric
    better = "higher" if search.direction == "maximize" else "lower"
    kept = sum(sc.kept for sc in search.screens)
    eta = s.reduction_factor
    span = "{}..{}".format(*(s.depths or default_depths(cfg.model)))
    lr_text = (
        f"searched jointly, log-uniform in [{tc.lr / s.lr_factor:.3g}, {tc.lr * s.lr_factor:.3g}] (Optuna's TPE "
        f"sampler, seed {tc.seed}; each shape first at the config's {tc.lr:.3g})"
        if s.lr_factor
        else f"the config's, {tc.lr:.3g}"
    )
    lines = [
        f"# kilolayer search: {_text(cfg.objective.name)} on {_text(cfg.data.name)} at {_count(s.params)} parameters",
        "",
        f"- **date**: {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- **machine**: {machine()}",
        f"- **versions**: {versions()}",
        f"- **objective**: {_text(metric)} on the evaluation split, {better} is better; each trial up to {tc.steps:,} "
        f"steps, evaluated every {tc.eval_every}, seed {tc.seed}",
        f"- **shapes**: {len(search.shapes)}, one per depth {span}, each at the width, heads and FFN closest to "
        f"{s.params:,} parameters (deviation {_deviations(search)}; the config's head size "
        f"{cfg.model.width // cfg.model.heads} and FFN ratio kept where a shape within {percent(s.tolerance)} "
        f"allows); {kept} raced after the pre-screen",
        f"- **learning rate**: {lr_text}",
        f"- **trials**: {len(search.trials)} started of {search.planned} planned",
        f"- **race**: successive halving judged synchronously (reduction factor {eta}; rungs at steps "
        f"{', '.join(map(str, search.rungs)) or '-'}): every trial still in the race trains to a rung and waits "
        f"there; once all have reached it, the best max(n // {eta}, 1) by {_text(metric)} go on and the rest are "
        f"pruned (Optuna's successive-halving arithmetic on Optuna's trial records; ties by shape name), so no "
        f"decision depends on the order of the trials",
        "",
        "## Recommendation",
        "",
        *_recommendation(search),
        *[f"- {_text(n)}" for n in search.notes],
        *([""] if search.notes else []),
    ]
    lr_searched = bool(s.lr_factor)
    headers = ["rank", "trial", "shape", "heads", "params", "FLOPs/token", *(["lr"] if lr_searched else [])]
    headers += ["steps", _text(metric), "status"]
    lines += [
        "## Leaderboard",
        "",
        "Completed trials first, by their final evaluation (with early stopping: its best); then the others by the "
        "step they reached. *shape*: layers x width.",
        "",
        _table(headers, [_trial_row(i + 1, t, lr_searched) for i, t in enumerate(search.ranked)]),
        "",
    ]
    if plot is not None:
        rel = os.path.relpath(plot, out)
        caption = f"evaluation {metric} of every trial; a cross where it stopped before its last step"
        lines += [f"![{_text(caption)}]({rel})", "", f"*{_text(caption)}*", ""]
    lines += [
        "## Where each trial stopped",
        "",
        _table(
            ["trial", "shape", "status", "at step", "by which rule"],
            [[t.number, t.shape.name, t.state, t.step, t.reason or "-"] for t in sorted(search.trials, key=_num)],
        ),
        "",
        "## Pre-screen",
        "",
        "Each shape's first steps replayed in memory by `kilolayer doctor CONFIG --forecast` (rule: docs/doctor.md); "
        "a shape forecast to diverge is not raced, nor one forecast to stall when another shape is forecast "
        "clearly better (its projected evaluation loss at least 0.1 x chance lower): a stall depends on the step "
        "budget, and when every shape is forecast near chance it does not rank them"
        + (" (kept here: --keep-forecast-failures)" if s.keep_forecast_failures else "")
        + ".",
        "",
        _table(
            [
                "shape",
                "layers",
                "width",
                "heads",
                "FFN",
                "params",
                "vs budget",
                "FLOPs/token",
                "forecast",
                "raced",
                "the doctor's reason",
            ],
            [
                [
                    sh.name,
                    sh.layers,
                    sh.model.width,
                    sh.model.heads,
                    sh.model.ffn,
                    f"{sh.parameters:,}",
                    f"{sh.deviation:+.2%}",
                    _count(sh.flops_per_token),
                    sc.verdict,
                    "yes" if sc.kept else "**dropped**",
                    sc.reason + (f" ({sc.note})" if sc.note else ""),
                ]
                for sh, sc in zip(search.shapes, search.screens)
            ],
        ),
        "",
        "## Compute",
        "",
        *_compute(search),
        "",
        "## Commands",
        "",
        "Every trial is an ordinary run directory: `kilolayer doctor RUN` diagnoses it, `kilolayer train --resume "
        "--out RUN` continues it (a pruned trial to its full budget). Re-running this search continues it.",
        "",
    ]
    lines += _fenced([f"kilolayer doctor {t.run}" for t in sorted(search.trials, key=_num)])
    return "\n".join(lines) + "\n"


def _num(t: TrialResult) -> int:
    return t.number


def write_report(search: Search) -> tuple[Path, Path]:
    """report.md, report.html and report_files/curves.png in the search's directory."""
    out = search.out
    plot = out / "report_files" / "curves.png"
    drawn = curves_plot(search, plot)
    md = render_markdown(search, out, plot if drawn else None)
    md_path, html_path = out / "report.md", out / "report.html"
    md_path.write_text(md)
    html_path.write_text(render_html(md, out))
    return md_path, html_path
