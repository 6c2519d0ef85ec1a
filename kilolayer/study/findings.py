"""Findings: what a paper claims, what the runs measured, and a verdict from one stated rule.

The rule, the same for every finding, is :data:`RULE` (shown in every report) and :func:`decide`: each finding
reduces its runs to one difference per seed, positive when the claim holds, and a one-sided Student-t bound on
their mean decides. Failed or missing runs are never evidence; a diverged run scores the chance level of its data
(:mod:`kilolayer.analysis.chance`). Nothing is decided in advance: the verdicts come from the numbers.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from kilolayer.analysis.chance import LEARNED_NOTHING
from kilolayer.registry import Registry
from kilolayer.verdicts.evidence import chance, learned, not_evidence, still_improving
from kilolayer.verdicts.rule import INCONCLUSIVE, NOT_HELD, Finding, Verdict, decide

FINDINGS: Registry[Callable] = Registry("study.findings", "finding")


def register_finding(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn(results, out) -> Finding | list[Finding] | None`` under ``name`` (None: the study lacks its
    groups; a list: one verdict per modality or pair, never pooled)."""
    return FINDINGS.register(name)


def evaluate_findings(names, results, out) -> list[Finding]:
    """Every finding of ``names`` that the results support, lists flattened, in order."""
    found = []
    for name in names:
        f = FINDINGS.get(name)(results, out)
        found += f if isinstance(f, list) else [f] if f is not None else []
    for f in found:
        if not f.rows and f.verdict.per_seed:  # show the numbers the verdict was computed from
            f.headers, f.rows = ["seed", "d"], [[s, f"{d:+.4g}"] for s, d in sorted(f.verdict.per_seed.items())]
    return found


# ---------------------------------------------------------------- evidence


def _group(results, name):
    return [r for r in results if r.point.group == name]


def _val(r, key):
    return r.point.values.get(key)


def _depth(r) -> int:
    return int(r.point.config.model.layers)


def _seed(r):
    return r.point.config.train.seed


def _seeds(rs):
    return sorted({_seed(r) for r in rs})


def _fmt(x, nd=3):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def loss_of(r, out) -> float:
    """Final validation loss; a diverged run scores its data's chance loss (NaN, hence not evidence, for an
    objective without a chance level)."""
    if r.status == "diverged":
        return float(chance(r, out)["loss"])
    return float(r.eval["loss"])


def accuracy_of(r, out) -> float | None:
    """The accuracy that stands for a run: on its test split scored whole when it has been (the ``test_scores``
    analysis; :func:`on_one_split` keeps it only when every compared run has it), else its standing validation
    evaluation's; a diverged run scores its data's chance accuracy (the majority class)."""
    if r.status == "diverged":
        return chance(r, out).get("accuracy")
    scores = (r.test or {}).get("metrics") or {}
    for source in (scores, r.eval):
        for k in ("accuracy", "test_accuracy"):
            if k in source:
                value = float(source[k])
                return value if math.isfinite(value) else None
    return None


def on_one_split(rs: list) -> list:
    """The results as compared: with their test scores when every completed run has them, else all on
    validation (a difference of one run's test BLEU and another's validation BLEU measures nothing)."""
    if all(r.test and r.test.get("metrics") for r in rs if r is not None and r.status == "completed"):
        return rs
    return [replace(r, test=None) if r is not None else None for r in rs]


def _status_cell(r, value: str) -> str:
    if r is None:
        return "missing"
    if r.status == "diverged":
        return f"diverged@{r.step}"
    if r.status != "completed":
        return r.status
    return value


class Evidence:
    """Per-seed parts of a comparison, the runs that are not evidence, and the runs that learned nothing."""

    def __init__(self, unlearned_decides_against: bool = False):
        self.parts: dict = defaultdict(list)
        self.excluded: list[str] = []
        self.unlearned: list[str] = []
        self.unlearned_decides_against = unlearned_decides_against

    def check(self, runs: dict, out, must_learn=()) -> bool:
        """Record why any of ``runs`` (what -> run) is not evidence; True if all are. Runs named in
        ``must_learn`` are checked for having learned something."""
        bad = [why for what, r in runs.items() if (why := not_evidence(r, what))]
        self.excluded += [b for b in bad if b not in self.excluded]
        if bad:
            return False
        for what in must_learn:
            r = runs[what]
            if learned(r, out) is not True and r.point.key not in self.unlearned:
                self.unlearned.append(r.point.key)
        return True

    def add(self, seed, value: float | None, what: str = "") -> None:
        """Add one part of seed ``seed``'s difference; a missing or non-finite value (e.g. an evaluation
        without the metric) makes the seed not evidence, named by ``what``."""
        if value is None or not math.isfinite(value):
            self.excluded.append(f"{what or f'seed {seed}'} (no finite value: {value})")
            self.parts.pop(seed, None)
            self.parts[seed] = [float("nan")]
            return
        if not any(math.isnan(x) for x in self.parts[seed]):
            self.parts[seed].append(value)

    def per_seed(self) -> dict:
        # a seed missing any part is not a complete replicate (it is named in ``excluded``)
        return {s: statistics.fmean(v) for s, v in self.parts.items() if v and not any(math.isnan(x) for x in v)}

    def decide(self, margin: float, unit: str = "") -> Verdict:
        v = decide(
            self.per_seed(),
            margin,
            unit,
            not_evidence=tuple(self.excluded),
            unlearned=tuple(self.unlearned),
            unlearned_decides_against=self.unlearned_decides_against,
        )
        v.per_seed = self.per_seed()
        return v


def slope(depths: list[int], values: list[float]) -> float:
    """Least-squares slope of ``values`` against log2(depth): change per doubling of depth."""
    x = [math.log2(d) for d in depths]
    mx, my = statistics.fmean(x), statistics.fmean(values)
    sxx = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, values)) / sxx if sxx else float("nan")


# ---------------------------------------------------------------- DeepNet

DEEPNET = "Wang et al. 2022, DeepNet (arXiv 2203.00555)"


def _other_axes(rs) -> list[str]:
    """The grid keys that tell apart several runs of one scheme, depth and seed (a one-run comparison would pick
    among them blindly); empty when each has one run."""
    cells: dict[tuple, list] = defaultdict(list)
    for r in rs:
        cells[(_val(r, "model.scheme"), _depth(r), _seed(r))].append(r)
    crowded = [c for c in cells.values() if len(c) > 1]
    if not crowded:
        return []
    keys = sorted({k for r in rs for k in r.point.values} - {"model.scheme", "model.layers", "train.seed"})

    def differs(key, runs):
        return len({json.dumps(r.point.values.get(key), sort_keys=True, default=str) for r in runs}) > 1

    return [k for k in keys if any(differs(k, c) for c in crowded)] or ["no grid key (a point repeated)"]


def _several_settings(v: Verdict, axes: list[str], seeds: int) -> Verdict:
    """``v`` made inconclusive, its numbers dropped: they came from runs picked blindly among several differing
    in ``axes``."""
    reason = (
        f"the deepnet group has several runs of one scheme, depth and seed, differing in {', '.join(axes)}, so "
        f"the rule's one-run comparison is not defined; give each setting of {', '.join(axes)} a group of its own"
    )
    if seeds < 2:
        reason += "; with one seed no verdict is decided either"
    return Verdict(INCONCLUSIVE, margin=v.margin, reason=reason)


def _run(rs, scheme: str, depth: int, seed):
    """The run of ``scheme`` at ``depth`` layers per side with ``seed``, or None."""
    return _pick([r for r in rs if _val(r, "model.scheme") == scheme], depth, seed)


def _depth_label(r, d: int) -> str:
    return f"{d}L-{d}L" if r.point.config.model.arch == "encoder_decoder" else f"{d}L"


def _chance_note(runs, out, unit=" nats") -> list[str]:
    """The chance levels of ``runs``' data: one value, or one per group (and seed, where they differ by seed)."""
    runs = [r for r in runs if r is not None and r.status in ("completed", "diverged")]
    if not runs:
        return []
    several_groups = len({r.point.group for r in runs}) > 1
    levels: dict[tuple, list] = {}
    for r in runs:
        c = chance(r, out)
        text = f"loss {c['loss']:.3f}{unit}" + (
            f", accuracy {c['accuracy']:.3f}" if c.get("accuracy") is not None else ""
        )
        seeds = levels.setdefault((r.point.group if several_groups else "", text), [])
        if _seed(r) not in seeds:
            seeds.append(_seed(r))
    texts = {text for _, text in levels}
    parts = []
    for (group, text), seeds in levels.items():
        label = [group] if group else []
        if len(texts) > len({g for g, _ in levels}):  # the same group has different levels by seed
            label.append(f"seed {', '.join(map(str, sorted(seeds)))}")
        parts.append(f"{text}" + (f" ({', '.join(label)})" if label else ""))
    return [
        f"Chance level (the best predictor that ignores the input, on these evaluation targets): {'; '.join(parts)}."
    ]


SECTION3 = DEEPNET + ", section 3"
# Figure 3(b): the last layer's gradient at several depths, a group of its own beside the 18L-18L `deepnet` group
DEPTH_GRADIENTS = "depth_gradients"
# "the last several layers" of Figure 3(a): the top third of the top stack (the decoder), 6 of 18 layers
TOP_SHARE = 1 / 3
SECTION3_SCALE = (
    "The paper's models are 18L-18L translation Transformers (IWSLT-14 De-En, width 512); train at that width on "
    "real translation data, with 3+ seeds."
)


def _has_schemes(rs, *schemes) -> bool:
    return set(schemes) <= {_val(r, "model.scheme") for r in rs}


def _diagnostics(r):
    """A run's diagnostics lines with per-layer gradient norms, parsed; None where they cannot be read."""
    from kilolayer.analysis.stability import read_diagnostics
    from kilolayer.errors import InputError

    try:
        return [d for d in read_diagnostics(r.diagnostics, r.point.key) if d.layers]
    except InputError:
        return None


def _shared_log_gradients(ev: Evidence, runs: dict, out) -> tuple[list[int], dict] | None:
    """For ``runs`` (what -> run): the diagnostics steps they all logged (the early window; a diverged run's
    lines before it diverged count) and, per run, its layer names and each layer's mean ln gradient norm over
    those steps. None, with the reason recorded in ``ev``, when a run is not evidence or has no usable lines."""
    from kilolayer.analysis.stability import mean_log_gradients

    if not ev.check(runs, out):
        return None
    lines = {}
    for what, r in runs.items():
        found = _diagnostics(r)
        if not found:
            ev.excluded.append(f"{r.point.key} ({'unreadable' if found is None else 'no'} gradient diagnostics)")
            return None
        lines[what] = found
    steps = sorted(set.intersection(*({d.step for d in found} for found in lines.values())))
    logs = {}
    for what, found in lines.items():
        values = mean_log_gradients(found, steps)
        if values is None:
            ev.excluded.append(f"{what} (no diagnostics step shared with the runs it is compared with)")
            return None
        logs[what] = (found[0].layers, values)
    return steps, logs


def _window(steps: list[int]) -> str:
    return f"steps {steps[0]}-{steps[-1]} ({len(steps)} lines)" if steps else "-"


def _top_layers(names: list[str]) -> list[int]:
    from kilolayer.analysis.stability import top_stack

    stack = top_stack(names)
    return stack[-max(1, math.ceil(len(stack) * TOP_SHARE)) :]


@register_finding("deepnet_init_gradient")
def deepnet_init_gradient(results, out):
    rs = _group(results, "deepnet")
    if not _has_schemes(rs, "post_ln", "post_ln_init"):
        return None
    deepest = max(_depth(r) for r in rs)
    ev, rows, top = Evidence(), [], []
    for seed in _seeds(rs):
        a, b = f"post_ln_init seed {seed}", f"post_ln seed {seed}"
        runs = {a: _run(rs, "post_ln_init", deepest, seed), b: _run(rs, "post_ln", deepest, seed)}
        got = _shared_log_gradients(ev, runs, out)
        if got is None:
            continue
        steps, logs = got
        (names, la), (names_b, lb) = logs[a], logs[b]
        if names != names_b:
            ev.excluded.append(f"seed {seed} (the two runs' layers differ)")
            continue
        top = _top_layers(names)
        ga, gb = statistics.fmean(la[i] for i in top), statistics.fmean(lb[i] for i in top)
        # a zero or non-finite norm in the window has no logarithm: the seed is not evidence, named
        ev.add(seed, ga - gb, f"top-layer gradient norms of seed {seed}")
        rows.append([seed, _window(steps), f"{math.exp(ga):.4g}", f"{math.exp(gb):.4g}", f"{math.exp(ga - gb):.3g}"])
    v = ev.decide(math.log(1.25), " (ln ratio)")
    if others := _other_axes(rs):
        v = _several_settings(v, others, len(_seeds(rs)))
    layers = f"its top {len(top)} decoder layers" if top else "the top third of its decoder layers"
    return Finding(
        "deepnet_init_gradient",
        "Post-LN-init's top layers get larger gradients than Post-LN's",
        "Post-LN-init (Post-LN with layer l's weights divided by N - l + 1 after Xavier) has an even larger gradient "
        "norm in the last several layers than Post-LN, although its weights have been scaled down (18L-18L; "
        "section 3, Figure 3(a)); from this and Figure 3(b) the paper concludes that exploding gradients in the top "
        "layers are not the root cause of Post-LN's instability.",
        SECTION3,
        f"d = ln(geometric mean gradient norm of post_ln_init's top layers / that of post_ln's), the top layers being "
        f"the top third of the decoder ({layers} at {_depth_label(rs[0], deepest)}), the mean taken over those layers "
        "and every diagnostics step both runs logged (the early window; a diverged run's steps before it diverged "
        "count), at the deepest setting, per seed; margin ln 1.25 (Post-LN-init's at least 1.25x Post-LN's).",
        v,
        ["seed", "window", "post_ln_init top-layer gradient", "post_ln top-layer gradient", "ratio"],
        rows,
        _plot(
            _layer_gradients,
            rs,
            out,
            "deepnet_init_gradient.png",
            "gradient norm per layer, geometric mean over the early diagnostics steps (first seed)",
        ),
        SECTION3_SCALE,
    )


@register_finding("deepnet_init_gradient_depth")
def deepnet_init_gradient_depth(results, out):
    rs = _group(results, DEPTH_GRADIENTS)
    if not _has_schemes(rs, "post_ln", "post_ln_init"):
        return None
    depths = sorted({_depth(r) for r in rs})
    ev, rows = Evidence(), []
    for seed in _seeds(rs):
        ds, row = [], [seed]
        for depth in depths:
            label = _depth_label(rs[0], depth)
            a, b = f"post_ln_init {label} seed {seed}", f"post_ln {label} seed {seed}"
            runs = {a: _run(rs, "post_ln_init", depth, seed), b: _run(rs, "post_ln", depth, seed)}
            got = _shared_log_gradients(ev, runs, out)
            if got is None:
                ds.append(None)
                row.append("-")
                continue
            _, logs = got
            (names, la), (_, lb) = logs[a], logs[b]
            last = _top_layers(names)[-1]
            ds.append(la[last] - lb[last])
            row.append(f"{math.exp(la[last]):.3g} / {math.exp(lb[last]):.3g}")
        rows.append(row)
        if None not in ds:
            # a zero or non-finite norm in the window has no logarithm: the seed is not evidence, named
            d = min(ds) if all(math.isfinite(x) for x in ds) else math.nan
            ev.add(seed, d, f"last-layer gradient norms of seed {seed}")
    v = ev.decide(math.log(1.5), " (ln ratio)")
    if others := _other_axes(rs):
        v = _several_settings(v, others, len(_seeds(rs)))
    shown = ", ".join(_depth_label(rs[0], d) for d in depths)
    return Finding(
        "deepnet_init_gradient_depth",
        "Post-LN-init's last-layer gradient is larger than Post-LN's at every depth",
        "The gradient norm of Post-LN-init in the last decoder layer is still much larger than that of Post-LN, "
        "regardless of model depth (6L-6L to 24L-24L; section 3, Figure 3(b)).",
        SECTION3,
        "d = the smallest, over the depths (" + shown + "), of ln(geometric mean gradient norm of post_ln_init's "
        "last decoder layer / that of post_ln's) over every diagnostics step both runs logged (the early window), "
        "per seed: positive only if Post-LN-init's is the larger at every depth. Margin ln 1.5 (much larger: "
        "at least 1.5x at every depth). A missing depth leaves the seed out.",
        v,
        ["seed"] + [f"{_depth_label(rs[0], d)}: post_ln_init / post_ln" for d in depths],
        rows,
        _plot(
            _last_layer_gradients,
            rs,
            out,
            "deepnet_init_gradient_depth.png",
            "the last decoder layer's gradient norm vs depth, geometric mean over the early diagnostics steps",
        ),
        SECTION3_SCALE,
    )


ROBUST_AXES = {"robust_lr": "train.lr", "robust_batch": "train.batch_size", "robust_width": "model.width"}
ROBUST_LABEL = {"train.lr": "learning rate", "train.batch_size": "batch size", "model.width": "width"}


def _robust_axis(rs, out, group: str, key: str) -> Finding:
    values = sorted({r.point.setting(key) for r in rs})
    schemes = sorted({_val(r, "model.scheme") for r in rs}, key=lambda s: (s not in ("post_ln", "deepnorm"), s))
    seeds = _seeds(rs)

    def run(scheme, value, seed):
        return next(
            (r for r in rs if _val(r, "model.scheme") == scheme and r.point.setting(key) == value and _seed(r) == seed),
            None,
        )

    ev = Evidence()
    unstable_post_ln = 0
    deepnorm_fails = {}  # seed -> the settings at which DeepNorm was not stable
    for seed in seeds:
        runs = {f"{s} {key}={x} seed {seed}": run(s, x, seed) for s in ("post_ln", "deepnorm") for x in values}
        if ev.check(runs, out):
            stable = {s: sum(learned(run(s, x, seed), out) is True for x in values) for s in ("post_ln", "deepnorm")}
            unstable_post_ln += len(values) - stable["post_ln"]
            deepnorm_fails[seed] = [x for x in values if learned(run("deepnorm", x, seed), out) is not True]
            ev.add(seed, stable["deepnorm"] - stable["post_ln"])
    v = ev.decide(0.5, " settings")
    # the paper's claim is absolute ("without difficulty in all the largest settings"): DeepNorm unstable at a
    # setting in every seed contradicts it, whatever Post-LN did there
    if len(deepnorm_fails) >= 2 and len(deepnorm_fails) == len(seeds) and all(deepnorm_fails.values()):
        failed_at = sorted({x for xs in deepnorm_fails.values() for x in xs})
        v = replace(
            v,
            verdict=NOT_HELD,
            reason=f"DeepNorm was not stable at {ROBUST_LABEL[key]} {', '.join(f'{x:g}' for x in failed_at)} in "
            f"every seed (d per seed {', '.join(f'{d:+g}' for d in v.per_seed.values())})",
        )
    elif v.verdict == INCONCLUSIVE and ev.per_seed() and not unstable_post_ln:
        v.reason += (
            f"; Post-LN was stable at every {ROBUST_LABEL[key]} in every seed: the sweep did not reach a setting "
            "where it fails"
        )
    rows = []
    for s in schemes:
        row = [s]
        for x in values:
            cells = []
            for seed in seeds:
                r = run(s, x, seed)
                cell = _status_cell(r, _fmt(r.eval.get("loss")) if r is not None else "")
                if r is not None and r.status == "completed":
                    cell += " (stable)" if learned(r, out) is True else " (learned nothing)"
                cells.append(cell)
            row.append(" / ".join(cells))
        rows.append(row)
    label = ROBUST_LABEL[key]
    shown = ", ".join(f"{x:g}" for x in values)
    return Finding(
        f"deepnet_robust:{group}",
        f"DeepNorm stays stable where Post-LN does not (larger {label})",
        "DeepNet can be trained without difficulty in all the largest settings of learning rate, batch size and "
        "hidden dimension, each raised with the others fixed (18L-18L on WMT-17 En-De; section 5, Figure 7). "
        "Tested here beside Post-LN at the same settings: DeepNorm stays stable where Post-LN does not.",
        DEEPNET + ", section 5",
        f"A run is stable when it completed without diverging and learned (final validation loss at most "
        f"{LEARNED_NOTHING:g} x chance). d = (the number of {label} settings ({shown}) at which deepnorm was stable) "
        "minus (the number at which post_ln was), per seed, the other settings at the base; a diverged or unlearned "
        "DeepNorm counts against the claim. Margin 0.5 settings: held needs DeepNorm stable at more settings than "
        "Post-LN in every seed, alike enough for the bounds. The paper's claim is absolute, so DeepNorm unstable "
        "at any setting in every seed (2 or more) is did not hold, whatever Post-LN did.",
        v,
        ["scheme"] + [f"{label} {x:g}" for x in values],
        rows,
        _plot(
            lambda runs, path: _loss_curves(runs, path, key),
            rs,
            out,
            f"deepnet_robust_{group}.png",
            f"validation loss vs step, one panel per {label}",
        ),
        "DeepNet's sweep is of 18L-18L models on WMT-17; a depth where Post-LN already fails at the base setting "
        "cannot show where it starts to fail, so this sweep starts from one where it trains. Scale to width 512, real "
        "translation data and 3+ seeds.",
        notes=[
            f"Each cell: the final validation loss of seed {' / '.join(map(str, seeds))}, in that order; (stable): "
            f"completed and learned; (learned nothing): completed above {LEARNED_NOTHING:g} x chance."
        ]
        + _chance_note([r for r in rs if r.ok][:1], out),
    )


@register_finding("deepnet_robust")
def deepnet_robust(results, out):
    found = [
        _robust_axis(rs, out, group, key)
        for group, key in ROBUST_AXES.items()
        if _has_schemes(rs := _group(results, group), "post_ln", "deepnorm")
    ]
    return found or None


# ---------------------------------------------------------------- Bamboo


def _pick(rs, layers, seed):
    return next((r for r in rs if _depth(r) == layers and _seed(r) == seed), None)


def _untrained(base, layers, seed):
    """The untrained model of this shape and seed, or of this shape with any seed."""
    return _pick(base, layers, seed) or next((r for r in base if _depth(r) == layers), None)


# (sequence-level group, token-level group, modality) pairs compared for over-smoothing, and each
# modality's untrained baseline group. Each pair is of encoders (a causal decoder's tokens differ from a
# bidirectional encoder's by architecture, not only by objective: next_token is judged by its loss, LOSS_GROUPS)
SMOOTHING_PAIRS = [
    ("supervised", "mae", "images"),
    ("contrastive", "mae", "images"),
    ("text_classify", "mlm", "text"),
]
UNTRAINED = {"images": "untrained", "text": "text_untrained"}
# (trained from scratch, pre-trained then fine-tuned, what the pre-training was, modality) on one downstream task
DEPTH_PAIRS = [("supervised", "finetune", "MAE", "images"), ("text_classify", "mlm_finetune", "MLM", "text")]
# token-level objectives whose validation loss is compared across depths
LOSS_GROUPS = ["next_token", "mlm"]
PAPER = "Xue et al. 2023, A Study on Transformer Configuration and Training Objective (arXiv 2205.10505)"


def _last(r, metric: str) -> float | None:
    if r is None or not r.smoothness or not r.smoothness.get(metric):
        return None
    return float(r.smoothness[metric][-1])


def _finite_value(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def report_convergence(
    v: Verdict,
    runs: list,
    key: str,
    tol: float,
    lower_is_better: bool = False,
    relative: bool = False,
    what: str = "runs",
) -> Verdict:
    """Runs are compared at the budget the study gave them, as Bamboo and DeepNet compare them (fixed
    schedules): if any of ``runs`` was :func:`still_improving`, the reason says how many ``what`` were and that the
    comparison stands at their budget. The verdict is not changed. Returns ``v``."""
    runs = list({r.point.key: r for r in runs if r is not None and r.ok}.values())
    moving = [r for r in runs if still_improving(r, key, tol, lower_is_better, relative)]
    if not moving:
        return v
    by = f"{tol:.0%}" if relative else f"{tol:g}"
    v.reason += (
        f"; {len(moving)} of {len(runs)} {what} were still improving {key} by more than {by} (in their last "
        "quarter of steps, or after the evaluation that stands for them): the comparison is at their budget"
    )
    return v


# the convergence rule's margin per measure: (tolerance, lower is better, relative)
CONVERGENCE_TOLERANCE = {"loss": (0.02, True, True), "accuracy": (0.01, False, False)}


def report_convergence_as_selected(v: Verdict, runs: list) -> Verdict:
    """:func:`report_convergence` on the measure that chose each run's standing checkpoint (its
    ``train.early_stop_metric``: a pre-training loss, a classifier's accuracy), for a finding that compares
    something else, such as token similarity. A classifier stopped on its accuracy stands past its loss minimum
    (its loss turns up while its accuracy still rises), so its loss is not the measure that says whether it
    converged. Returns ``v``, changed."""
    by_metric: dict[str, list] = {}
    for r in runs:
        if r is not None:
            metric = r.point.config.train.early_stop_metric
            by_metric.setdefault(metric if metric in CONVERGENCE_TOLERANCE else "loss", []).append(r)
    for metric, rs in sorted(by_metric.items()):
        tol, lower, relative = CONVERGENCE_TOLERANCE[metric]
        report_convergence(v, rs, metric, tol, lower_is_better=lower, relative=relative)
    return v


def _shape(r) -> str:
    return f"{_depth(r)} x {r.point.config.model.width}"


def _shapes(rs) -> list[int]:
    return sorted({_depth(r) for r in rs})


def _measurement_note(runs) -> list[str]:
    """How token similarity was measured, read from the smoothness results themselves."""
    choices, inputs, blank = set(), set(), []
    for r in runs:
        s = r.smoothness if r is not None else None
        if s:
            choices.add((s.get("exclude_special"), s.get("after_final_norm")))
            # a *_captions source holds the same images, split alike, as its plain one
            inputs.add(str(s.get("input", "?")).removesuffix("_captions"))
            if s.get("exclude_blank") and isinstance(s.get("blank_share"), (int, float)):
                blank.append(float(s["blank_share"]))
    notes = []
    for special, after in sorted(choices, key=str):
        tokens = (
            "CLS and special tokens excluded"
            if special
            else "all tokens, CLS and special tokens included"
            if special is False
            else "token set not recorded"
        )
        state = (
            "the last layer's state after the final LayerNorm"
            if after
            else "the last block's output before the final LayerNorm"
            if after is False
            else "last-layer state not recorded"
        )
        notes.append(
            f"Token similarity: {tokens}; 'last layer' is {state} "
            "(`kilolayer analyze smoothness --include-special / --after-final-norm` switch these)."
        )
    if blank:
        low, high = f"{min(blank):.0%}", f"{max(blank):.0%}"
        notes.append(
            "Tokens of blank patches (every pixel equal) are left out of the token metrics: "
            f"{low if low == high else f'{low}-{high}'} of the patch tokens here (`--include-blank` keeps them)."
        )
    if len(inputs) == 1:
        notes.append(f"Every run above was measured on the same inputs: the validation split of {inputs.pop()}.")
    elif inputs:
        notes.append(f"The runs were measured on different inputs: {', '.join(sorted(inputs))}.")
    return notes


def _cosine_evidence(ev: Evidence, r, what: str, out) -> float | None:
    """The last-layer cosine of ``r`` if it can be evidence (recording why not in ``ev`` otherwise)."""
    if not ev.check({what: r}, out, must_learn=[what]):
        return None
    if r.status == "diverged":
        ev.excluded.append(f"{r.point.key} (diverged: no final representation to measure)")
        return None
    c = _last(r, "cosine")
    if c is None or not math.isfinite(c):
        ev.excluded.append(f"{r.point.key} (no smoothness analysis)")
        return None
    return c


def _untrained_cosine(ev: Evidence, base, layers: int, seed) -> float | None:
    u = _untrained(base, layers, seed)
    c = _last(u, "cosine") if u is not None and u.ok else None
    if c is None:
        ev.excluded.append(f"untrained model at {layers} layers ({'no smoothness analysis' if u else 'missing'})")
    return c


def _smoothing_level(results, out, seq: str, tok: str, modality: str) -> Finding:
    a_rs, b_rs, base = _group(results, seq), _group(results, tok), _group(results, UNTRAINED[modality])
    depths = sorted(set(_shapes(a_rs)) | set(_shapes(b_rs)))
    level, rows = Evidence(), []
    for seed in sorted(set(_seeds(a_rs)) | set(_seeds(b_rs))):
        for layers in depths:
            a, b = _pick(a_rs, layers, seed), _pick(b_rs, layers, seed)
            u = _untrained(base, layers, seed)
            ca = _cosine_evidence(level, a, f"{seq} {layers} layers seed {seed}", out)
            cb = _cosine_evidence(level, b, f"{tok} {layers} layers seed {seed}", out)
            if ca is not None and cb is not None:
                level.add(seed, ca - cb)
            cu = _last(u, "cosine")
            rows.append(
                [
                    _shape(a or b),
                    seed,
                    _fmt(cu),
                    _status_cell(a, _fmt(_last(a, "cosine"))),
                    _status_cell(b, _fmt(_last(b, "cosine"))),
                    _fmt(_last(a, "cosine_centred")),
                    _fmt(_last(b, "cosine_centred")),
                    _fmt(_last(a, "cosine_same_minus_different")),
                    _fmt(_last(b, "cosine_same_minus_different")),
                ]
            )
    v = report_convergence_as_selected(level.decide(0.05), a_rs + b_rs)
    shapes = ", ".join(_shape(r) for r in sorted({_depth(r): r for r in a_rs + b_rs}.values(), key=_depth))
    notes = [
        "Last-layer token similarity three ways: raw cosine (the verdict's), centred (after subtracting the "
        "evaluated set's mean token, so a direction shared by every token does not count) and same - other sample "
        "(the mean cosine of tokens of one sample minus that of tokens of different samples: how much of the "
        "similarity is the sample's own); docs/analysis.md gives the formulas."
    ]
    notes += _measurement_note(a_rs + b_rs + base) + _chance_note(
        [next((r for r in g if r.ok), None) for g in (a_rs, b_rs)], out, ""
    )
    return Finding(
        f"bamboo_smoothing:{seq}:{tok}",
        f"Sequence-level training over-smooths tokens more than token-level ({modality}: {seq} vs {tok})",
        "A sequence-level objective (supervised classification, CLIP) makes token representations converge in "
        "the top layers (token cosine high); a token-level objective (MAE, masked tokens, next token) keeps them "
        "distinct (cosine low).",
        PAPER,
        f"d = last-layer mean token cosine of {seq} minus that of {tok}, same shape, seed and validation inputs, "
        f"averaged over the shapes ({shapes}) within each seed; both models must have learned (a model that did "
        "not, or diverged and has no representation, leaves the verdict inconclusive). Margin 0.05.",
        v,
        [
            "layers x width",
            "seed",
            "cosine untrained",
            f"cosine {seq}",
            f"cosine {tok}",
            f"centred {seq}",
            f"centred {tok}",
            f"same - other sample {seq}",
            f"same - other sample {tok}",
        ],
        rows,
        notes=notes,
        scale_up="Compare at matched convergence (train the token-level model until its fine-tuning accuracy "
        "plateaus), with more tokens per input and 3+ seeds.",
    )


def _excess_slopes(results, out, group: str, modality: str, ev: Evidence) -> tuple[dict, list]:
    """Per seed, the slope per doubling of depth of (last-layer cosine of ``group`` - the untrained model's);
    and the table rows."""
    rs, base = _group(results, group), _group(results, UNTRAINED[modality])
    depths = _shapes(rs)
    slopes, rows = {}, []
    for seed in _seeds(rs):
        excess = []
        for layers in depths:
            c = _cosine_evidence(ev, _pick(rs, layers, seed), f"{group} {layers} layers seed {seed}", out)
            cu = _untrained_cosine(ev, base, layers, seed)
            excess.append(c - cu if None not in (c, cu) else None)
        rows.append([group, seed] + [_fmt(x) for x in excess])
        if len(depths) >= 2 and None not in excess:
            slopes[seed] = slope(depths, excess)
    return slopes, rows


def _smoothing_trend(results, out, seq: str, toks: list[str], modality: str) -> Finding:
    ev = Evidence()
    slopes, rows = _excess_slopes(results, out, seq, modality, ev)
    for seed, d in slopes.items():
        ev.add(seed, d)
    depths = _shapes(_group(results, seq))
    v = ev.decide(0.02)
    if len(depths) < 2:
        v = Verdict(INCONCLUSIVE, reason=f"one shape only ({depths}): no trend with depth to fit")
    context = []
    for tok in toks:  # what the paired token-level objective did, for the reader (not part of d)
        t_slopes, t_rows = _excess_slopes(results, out, tok, modality, Evidence())
        rows += t_rows
        if t_slopes:
            context.append(f"{tok}: {statistics.fmean(t_slopes.values()):+.3g} per doubling")
    if context:
        v.reason += "; for comparison, token-level " + ", ".join(context)
    report_convergence_as_selected(v, _group(results, seq))
    shape_of = {_depth(r): _shape(r) for r in _group(results, seq)}
    return Finding(
        f"bamboo_smoothing_trend:{seq}",
        f"Sequence-level over-smoothing grows with depth ({modality}: {seq}, relative to the untrained model)",
        "Over-smoothing is what makes depth stop paying off for sequence-level objectives: as the same "
        "parameters are spread over more, narrower layers, training makes the last layer's tokens more similar "
        "than the same untrained network has them, while token-level objectives do not.",
        PAPER,
        f"d = least-squares slope, per doubling of depth, of (last-layer token cosine of {seq} - that of the "
        f"untrained model of the same shape) over every shape ({', '.join(shape_of[d] for d in depths)}), per "
        f"seed; the model must have learned, and a missing untrained baseline leaves it inconclusive. Margin 0.02 "
        "per doubling. The token-level groups' slopes are shown for comparison.",
        v,
        ["group", "seed"] + [f"{shape_of[d]}: cosine - untrained" for d in depths],
        rows,
    )


@register_finding("bamboo_smoothing")
def bamboo_smoothing(results, out):
    found, trends = [], {}
    for seq, tok, modality in SMOOTHING_PAIRS:
        if _group(results, seq) and _group(results, tok):
            found.append(_smoothing_level(results, out, seq, tok, modality))
            trends.setdefault((seq, modality), []).append(tok)
    found += [_smoothing_trend(results, out, seq, toks, modality) for (seq, modality), toks in trends.items()]
    if not found:
        return None
    found[0].plots = _smoothness_plot(results, out, "bamboo_smoothness.png")
    return found


def pretraining_problem(r, results, out) -> str | None:
    """Why the pre-training behind fine-tuned run ``r`` makes ``r`` no evidence, or None: the pre-training must
    have completed, and ``r`` started from its chosen checkpoint (or, with no ``init_from`` record, after it)."""
    from kilolayer.rundir import RunDir, checkpoint_step

    key = getattr(r.point, "init_from_point", None) if r is not None else None
    if key is None or r.status not in ("completed", "diverged"):
        return None
    src = next((x for x in results if x.point.key == key), None)
    if src is None or src.status != "completed":
        state = "missing" if src is None else src.status
        return f"{r.point.key} (its pre-training run {key} is {state})"
    mine, theirs = RunDir(r.point.run_dir(out)), RunDir(src.point.run_dir(out))
    record = mine.init_from
    if record is not None:
        chosen = theirs.checkpoint(on_damaged=lambda _: None)
        if chosen is None or checkpoint_step(chosen) != int(record["step"]):
            now = "none" if chosen is None else checkpoint_step(chosen)
            return f"{r.point.key} (fine-tuned from step {record['step']} of {key}, whose chosen checkpoint is {now})"
        return None
    started, finished = mine.status.get("started"), theirs.status.get("finished")
    if not (isinstance(started, str) and isinstance(finished, str) and started >= finished):
        return f"{r.point.key} (started before its pre-training run {key} finished)"
    return None


# Bamboo's depth effect after MAE pre-training: +0.9 points of ImageNet accuracy from 12 x 768 to 48 x 384, two
# doublings of depth; a margin must sit below it, or the rule could not confirm the paper's own effect
PAPER_DEPTH_EFFECT = 0.0045
DEPTH_MARGIN = 0.003


def _depth_pair(results, out, scratch: str, tuned: str, pre: str, modality: str) -> list[Finding]:
    # scored on the test split when every classifier compared has been: a checkpoint chosen on validation
    # accuracy scores a little high on it, by a margin that grows with the number of evaluations it was chosen from
    compared = on_one_split(_group(results, scratch) + _group(results, tuned))
    sup, ft = [r for r in compared if r.point.group == scratch], [r for r in compared if r.point.group == tuned]
    split = "test" if any(r.test for r in compared) else "validation"
    depths = sorted(set(_shapes(sup)) | set(_shapes(ft)))
    absolute, relative = Evidence(), Evidence()
    rows = []
    for seed in sorted(set(_seeds(sup)) | set(_seeds(ft))):
        acc_s, acc_f, row = [], [], [seed]
        for layers in depths:
            s, f = _pick(sup, layers, seed), _pick(ft, layers, seed)
            deepest = layers == depths[-1]
            rel_ok = relative.check(
                {f"{scratch} {layers} layers seed {seed}": s, f"{tuned} {layers} layers seed {seed}": f},
                out,
                must_learn=[f"{tuned} {layers} layers seed {seed}"] if deepest else [],
            )
            abs_ok = absolute.check(
                {f"{tuned} {layers} layers seed {seed}": f},
                out,
                must_learn=[f"{tuned} {layers} layers seed {seed}"] if deepest else [],
            )
            if (why := pretraining_problem(f, results, out)) is not None:
                for e in (absolute, relative):
                    if why not in e.excluded:
                        e.excluded.append(why)
                abs_ok = rel_ok = False
            a_s = accuracy_of(s, out) if rel_ok else None
            a_f = accuracy_of(f, out) if abs_ok else None
            for ok, r, value, evs in ((rel_ok, s, a_s, [relative]), (abs_ok, f, a_f, [absolute, relative])):
                if ok and value is None:  # completed, but its evaluation has no finite accuracy
                    for e in evs:
                        e.excluded.append(f"{r.point.key} (no finite accuracy in its evaluation)")
            acc_s.append(a_s)
            acc_f.append(a_f)
            row.append(f"{_status_cell(s, _fmt(a_s))} / {_status_cell(f, _fmt(a_f))}")
        rows.append(row)
        if len(depths) >= 2 and None not in acc_f:
            absolute.add(seed, slope(depths, acc_f))
            if None not in acc_s:
                relative.add(seed, slope(depths, acc_f) - slope(depths, acc_s))
    # the pre-training behind the fine-tuned runs is held to the convergence rule of the token-level losses
    keys = {getattr(r.point, "init_from_point", None) for r in ft}
    pre_runs = [r for r in results if r.point.key in keys]
    v_abs, v_rel = absolute.decide(DEPTH_MARGIN), relative.decide(DEPTH_MARGIN)
    for v in (v_abs, v_rel):
        report_convergence(v, sup + ft, "accuracy", 0.01)
        report_convergence(v, pre_runs, "loss", 0.02, lower_is_better=True, relative=True, what="pre-training runs")
    if len(depths) < 2:
        v_abs = v_rel = Verdict(INCONCLUSIVE, reason=f"one shape only ({depths}): no trend with depth to fit")
    shape_of = {_depth(r): _shape(r) for r in sup + ft}
    headers = ["seed"] + [f"{shape_of[d]}: scratch / {pre} + FT" for d in depths]
    label = f"{modality}: {pre} + fine-tuning vs {scratch}"
    shapes = ", ".join(shape_of[d] for d in depths)
    common = (
        f"Accuracy on the same downstream task, on its {split} split"
        + (
            " scored whole (every run's checkpoint was chosen on validation)"
            if split == "test"
            else " (the evaluation that stands for each run)"
        )
        + "; a diverged run scores the chance accuracy (majority class); "
        f"the deepest fine-tuned model must have learned. Slopes are least-squares fits against log2(depth) "
        f"over every shape ({shapes}), per seed. Margin {DEPTH_MARGIN:g} accuracy per doubling, below the paper's own "
        f"effect ({PAPER_DEPTH_EFFECT:g}: +0.9 points from 12 x 768 to 48 x 384, two doublings)."
    )
    scale = (
        "Real images at ImageNet scale are where the paper measured +0.9 points; small data saturates and hides "
        "depth effects. Use a larger data set, and pre-train until the fine-tuned accuracy plateaus."
    )
    notes = _chance_note([r for r in ft if r.ok][:1], out, "")
    return [
        Finding(
            f"bamboo_depth:{tuned}",
            f"Deeper-narrower pays off after token-level pre-training ({label})",
            f"At matched parameters, a deeper, narrower model pre-trained with {pre} and fine-tuned beats a "
            "shallower, wider one (Bamboo-B 84.2% vs MAE ViT-B 83.3% ImageNet top-1).",
            PAPER,
            f"d = slope of the {pre} + fine-tuned accuracy per doubling of depth. " + common,
            v_abs,
            headers,
            rows,
            notes=notes,
            scale_up=scale,
        ),
        Finding(
            f"bamboo_depth_relative:{tuned}",
            f"Depth helps token-level pre-training more than training from scratch ({label})",
            f"Going deeper and narrower helps the {pre}-pre-trained model more than the same model trained on the "
            "task from scratch, whose tokens over-smooth with depth.",
            PAPER,
            f"d = (slope of the {pre} + fine-tuned accuracy) minus (slope of the from-scratch accuracy), per "
            "doubling of depth. " + common,
            v_rel,
            scale_up=scale,
        ),
    ]


@register_finding("bamboo_depth")
def bamboo_depth(results, out):
    found = []
    for scratch, tuned, pre, modality in DEPTH_PAIRS:
        if _group(results, scratch) and _group(results, tuned):
            found += _depth_pair(results, out, scratch, tuned, pre, modality)
    if not found:
        return None
    found[0].plots = _depth_plot(results, out, "bamboo_depth.png")
    return found


@register_finding("bamboo_depth_tokens")
def bamboo_depth_tokens(results, out):
    found = []
    for name in LOSS_GROUPS:
        rs = _group(results, name)
        depths = _shapes(rs)
        if not rs:
            continue
        ev, rows = Evidence(), []
        for seed in _seeds(rs):
            losses, row = [], [seed]
            for layers in depths:
                r = _pick(rs, layers, seed)
                what = f"{name} {layers} layers seed {seed}"
                ok = ev.check({what: r}, out, must_learn=[what] if layers == depths[-1] else [])
                x = loss_of(r, out) if ok else None
                losses.append(x)
                row.append(_status_cell(r, _fmt(x)))
            rows.append(row)
            if None not in losses:
                ev.add(seed, -slope(depths, losses))
        v = report_convergence(ev.decide(0.01, " nats"), rs, "loss", 0.02, lower_is_better=True, relative=True)
        if len(depths) < 2:
            v = Verdict(INCONCLUSIVE, reason=f"one shape only ({depths}): no trend with depth to fit")
        shape_of = {_depth(r): _shape(r) for r in rs}
        found.append(
            Finding(
                f"bamboo_depth_tokens:{name}",
                f"Token-level objectives reach a lower loss deeper and narrower ({name})",
                "Token-level objectives do not over-smooth, so at matched parameters a deeper, narrower Transformer "
                "reaches a lower loss (Bamboo's argument for next-token and masked-token pre-training).",
                PAPER,
                "d = minus the least-squares slope of the final validation loss per doubling of depth, over every "
                f"shape ({', '.join(shape_of[d] for d in depths)}), per seed; a diverged run scores the chance loss; "
                "the deepest model must have learned. Margin 0.01 nats per doubling.",
                v,
                ["seed"] + [shape_of[d] for d in depths],
                rows,
                notes=_chance_note([r for r in rs if r.ok][:1], out),
                scale_up="Token-level gains from depth show up with enough data and steps for the deep model to "
                "converge; train to a plateau and report tokens seen.",
            )
        )
    return found or None


# ---------------------------------------------------------------- plots


def _plot(draw, rs, out, fname: str, caption: str) -> list[tuple[str, str]]:
    """``[(path, caption)]`` of the plot ``draw(rs, path)`` made under report_files/, or [] if it drew none."""
    path = out / "report_files" / fname
    return [(str(path), caption)] if draw(rs, path) else []


def _loss_curves(rs, path, by: str) -> bool:
    from kilolayer.study.plots import loss_curves

    return loss_curves(rs, path, by=by)


def _layer_gradients(rs, path) -> bool:
    from kilolayer.study.plots import layer_gradient_curves

    return layer_gradient_curves(rs, path)


def _last_layer_gradients(rs, path) -> bool:
    from kilolayer.study.plots import last_layer_gradient_curves

    return last_layer_gradient_curves(rs, path)


def _smoothness_plot(results, out, fname):
    from kilolayer.study.plots import smoothness_curves

    names = {*UNTRAINED.values(), *(g for pair in SMOOTHING_PAIRS for g in pair[:2]), "finetune", "mlm_finetune"}
    rs = [r for r in results if r.point.group in names and r.smoothness]
    caption = "token cosine similarity per layer (mean over seeds), by objective and shape"
    return _plot(smoothness_curves, rs, out, fname, caption)


def _depth_plot(results, out, fname):
    from kilolayer.study.plots import depth_curves

    caption = "task metric and validation loss vs depth at matched parameters (mean over seeds)"
    return _plot(depth_curves, results, out, fname, caption)
