"""Measures: what a claim reads of each run, registered by name.

A measure knows its unit, which direction is better, what a diverged run scores on it, which evaluation key
says whether a run was still improving, and how to read a run on a split. Scores that an evaluation logs are
read on the test split when every compared run was scored on it (the ``test_scores`` analysis: the checkpoint
chosen on validation, scored on test), else on validation, and the rule says that the same split chose and
scored. Adding a measure is one :func:`register_measure` call (or an entry point, ``kilolayer.measures``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from kilolayer.registry import Registry
from kilolayer.verdicts.evidence import chance

VALIDATION, TEST = "validation", "test"


@dataclass(frozen=True)
class Measure:
    """``read(run, out, split)`` gives a run's value (None: it has none, so it is not evidence);
    ``on_diverged(run, out)`` what a diverged run scores (None: a diverged run is not evidence here)."""

    name: str
    what: str  # the rule's words for it: "evaluation loss at the standing checkpoint"
    unit: str  # " nats", " points", "" — appended to numbers
    better: str  # "lower" | "higher"
    read: Callable
    on_diverged: Callable | None = None
    diverged_text: str = "a diverged run is not evidence"
    fraction: bool = False  # a value in [0, 1]: a margin is a fraction below 1
    split_key: str | None = None  # the evaluation key read on validation / test; None: not a split score
    test_only: bool = False
    convergence: tuple[str, float, bool] | None = None  # (evaluation key, tolerance, relative)
    note: Callable | None = None  # note(runs, out, split) -> lines the report states beside the verdict
    quality: bool = True  # a score of the trained model: a run that diverged never beats one that did not
    columns: tuple = ()  # (header, read) pairs the report's table shows beside the measure, for the reader
    shared_steps: bool = False  # two runs compared are read over the diagnostics steps both logged
    analysis: str | None = None  # the study analysis whose result it reads: every group it reads must list it
    diagnostics: bool = False  # reads the stability diagnostics a run logs only with train.diagnostics_every
    positive: bool = False  # every value is above 0 (a loss, a norm): a ratio of two is defined
    # basis(run, out, split): what the run's value covers, where that can differ between runs (the directions a
    # translation score averages); runs compared on different bases make a verdict inconclusive. None: the same
    basis: Callable | None = None

    @property
    def lower_is_better(self) -> bool:
        return self.better == "lower"


MEASURES: Registry[Measure] = Registry("kilolayer.measures", "measure", group="kilolayer.measures")


def register_measure(measure: Measure) -> Measure:
    MEASURES.register(measure.name)(measure)
    return measure


def convergence_of(measure: Measure, r) -> tuple[str, float, bool]:
    """The (evaluation key, tolerance, relative) that says whether run ``r`` was still improving: the measure's
    own, else that of the measure which chose the run's checkpoint (its ``train.early_stop_metric``)."""
    if measure.convergence is not None:
        return measure.convergence
    return selection_convergence(r)


def selection_convergence(r) -> tuple[str, float, bool]:
    """The (evaluation key, tolerance, relative) of the measure that chose run ``r``'s checkpoint (its
    ``train.early_stop_metric``; the evaluation loss for a key no measure reads)."""
    chosen = r.point.config.train.early_stop_metric
    found = next((m for m in MEASURES.values() if m.split_key == chosen and m.convergence), None)
    return (found or MEASURES["eval_loss"]).convergence


def has_test(r, key: str) -> bool:
    return bool(r is not None and r.test and key in (r.test.get("metrics") or {}))


def split_score(key: str) -> Callable:
    def read(r, out, split: str) -> float | None:
        source = (r.test or {}).get("metrics", {}) if split == TEST else r.eval
        value = source.get(key)
        try:
            value = float(value)
        except (TypeError, ValueError):
            return None
        return value if math.isfinite(value) else None

    return read


def _chance_of(key: str) -> Callable:
    def score(r, out) -> float | None:
        value = chance(r, out).get(key)
        return float(value) if value is not None else None

    return score


def _loss_vs_chance(r, out, split: str) -> float | None:
    loss = split_score("loss")(r, out, split)
    c = chance(r, out).get("loss")
    if loss is None or c is None or not math.isfinite(c) or c <= 0:
        return None
    return loss / c


def direction_means(r) -> dict | None:
    """``{system: scores}`` of a many-to-many run's test record: each system's (the model's, the baselines') mean
    over every direction scored (:func:`kilolayer.objectives.directions.averages`, BLEU over the directions with a
    BLEU tokenizer); None for a run of one direction, or not scored on test."""
    table = (r.test or {}).get("directions") if r is not None else None
    if not table:
        return None
    return {system: groups["all"] for system, groups in (table.get("averages") or {}).items() if "all" in groups}


def translation_read(key: str) -> Callable:
    """A translation score: on test, a many-to-many run's mean over its directions, as the multilingual literature
    reports it (a direction without the score, such as BLEU into a language without a tokenizer, is left out of
    the mean; a run none of whose directions has it has no value); else the evaluation's score of the pooled
    pairs (one direction's, for a one-to-one run)."""
    pooled = split_score(key)

    def read(r, out, split: str) -> float | None:
        means = direction_means(r) if split == TEST else None
        if means is None:
            return pooled(r, out, split)
        value = (means.get("model") or {}).get(key)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    return read


def translation_basis(key: str) -> Callable:
    """What a run's translation score covers: on test, a many-to-many run's mean over the directions that have the
    score (BLEU needs a tokenizer of the target language, which may be missing where the run was scored); else
    the pooled pairs."""

    def basis(r, out, split: str) -> str:
        means = direction_means(r) if split == TEST else None
        if means is None:
            return "the pooled pairs"
        rows = (r.test.get("directions") or {}).get("directions") or {}
        having = sorted(d for d, row in rows.items() if key in (row.get("model") or {}))
        return f"the mean over {len(having)} directions ({', '.join(having)})"

    return basis


def baselines_note(runs, out, split: str) -> list[str]:
    """Beside a translation score: what copying the source and the nearest training pair's target score on the
    same evaluation pairs (each run's baselines.json, or its test scores'; a many-to-many run's means over its
    directions), and how many runs translate (BLEU and chrF both above the better of the two)."""
    from kilolayer.objectives.baselines import translates
    from kilolayer.rundir import read_baselines

    texts, verdicts = [], []
    for r in runs:
        means = direction_means(r) if split == TEST else None
        if means is not None:
            scores = means.get("model") or {}
            found = {name: means[name] for name in ("copy", "nearest") if name in means} or None
        elif split == TEST:
            scores, found = (r.test or {}).get("metrics") or {}, (r.test or {}).get("baselines")
        else:
            scores, found = r.eval, read_baselines(r.point.run_dir(out)).get("baselines")
        if not found:
            continue
        text = "; ".join(
            f"{name} " + ", ".join(f"{label} {s[k]:.2f}" for k, label in (("bleu", "BLEU"), ("chrf", "chrF")) if k in s)
            for name, s in found.items()
        )
        if text not in texts:
            texts.append(text)
        v = translates(scores, found) if r.status == "completed" else None
        if v is not None:
            verdicts.append(v.translates)
    if not texts:
        return []
    means = any(direction_means(r) is not None for r in runs) if split == TEST else False
    pairs = f"{split} pairs, means over each run's directions" if means else f"{split} pairs"
    note = f"Baselines on the same {pairs}: {' / '.join(texts)}."
    if verdicts:
        note += (
            f" {sum(verdicts)} of {len(verdicts)} completed runs translate (BLEU and chrF above the better of "
            "copying and the nearest training pair's target" + (", the means' point estimates" if means else "") + ")."
        )
    return [note]


def translation_score(key: str, label: str) -> Measure:
    """A corpus score of greedy decoding (``bleu``, ``chrf``): a diverged run scores 0, what a model that produces
    nothing scores, and the baselines of the same pairs are quoted beside the verdict."""
    return Measure(
        key,
        f"{label} at the standing checkpoint (greedy decoding, sacrebleu; on test, a many-to-many run's mean over "
        "its directions)",
        f" {label}",
        "higher",
        translation_read(key),
        lambda r, out: 0.0,
        f"a diverged run scores {label} 0, what a model that produces nothing scores",
        split_key=key,
        convergence=(key, 0.5, False),
        note=baselines_note,
        basis=translation_basis(key),
    )


def _first_update(r, out, split: str) -> float | None:
    ups = [d.get("update") for d in r.diagnostics if d.get("step") == 1] or [d.get("update") for d in r.diagnostics[:1]]
    return float(ups[0]) if ups and ups[0] is not None else None


def _last(metric: str) -> Callable:
    def read(r, out, split: str) -> float | None:
        values = (r.smoothness or {}).get(metric)
        return float(values[-1]) if values and values[-1] is not None else None

    return read


def smoothness_note(runs, out, split: str) -> list[str]:
    """How token similarity was measured, read from the smoothness results themselves: which tokens, which
    state, and on which inputs (a split that also chose the checkpoints is named as such)."""
    choices, inputs, blank = set(), set(), []
    for r in runs:
        s = r.smoothness or {}
        if s:
            choices.add((s.get("exclude_special"), s.get("after_final_norm")))
            # a *_captions source holds the same images, split alike, as its plain one
            inputs.add((str(s.get("input", "?")).removesuffix("_captions"), s.get("split", "validation")))
            if s.get("exclude_blank") and isinstance(s.get("blank_share"), (int, float)):
                blank.append(float(s["blank_share"]))
    notes = []
    for special, after in sorted(choices, key=str):
        tokens = "CLS and special tokens excluded" if special else "all tokens, CLS and special tokens included"
        state = "after the final LayerNorm" if after else "the last block's output, before the final LayerNorm"
        notes.append(
            f"Token similarity: {tokens}; the last layer is {state} "
            "(`kilolayer analyze smoothness --include-special / --after-final-norm` switch these). Centred: after "
            "subtracting the evaluated set's mean token; same - other sample: the mean cosine of one sample's "
            "tokens minus that of different samples' (docs/analysis.md)."
        )
    if blank:
        low, high = f"{min(blank):.0%}", f"{max(blank):.0%}"
        notes.append(
            "Tokens of blank patches (every pixel equal) are left out of the token metrics: "
            f"{low if low == high else f'{low}-{high}'} of the patch tokens here (`--include-blank` keeps them)."
        )
    for source, split in sorted(inputs):
        chose = (
            ", the split that also chose each run's checkpoint (give the group analysis_data on its test split for "
            "an unbiased read)"
            if split == VALIDATION
            else ", a split no checkpoint was chosen on"
        )
        notes.append(f"Measured on the {split} split of {source}{chose}.")
    return notes


def _top_gradient(share: float | None) -> Callable:
    """The geometric mean, over the run's logged diagnostics steps (the early window; a diverged run's before it
    diverged) and over the top stack's last layer (``share`` None) or its top ``share`` of layers, of the
    gradient norm."""

    def read(r, out, split: str) -> float | None:
        from kilolayer.analysis.stability import read_diagnostics, top_stack
        from kilolayer.errors import InputError

        try:
            lines = [d for d in read_diagnostics(r.diagnostics, r.point.key) if d.layers]
        except InputError:
            return None
        logs = []
        for d in lines:
            stack = top_stack(d.layers)
            top = stack[-1:] if share is None else stack[-max(1, math.ceil(len(stack) * share)) :]
            norms = [d.grad_norm[i] for i in top]
            if not all(math.isfinite(v) and v > 0 for v in norms):
                return None  # a zero or non-finite norm has no logarithm
            logs += [math.log(v) for v in norms]
        return math.exp(sum(logs) / len(logs)) if logs else None

    return read


for _m in (
    Measure(
        "eval_loss",
        "evaluation loss at the standing checkpoint",
        " nats",
        "lower",
        split_score("loss"),
        _chance_of("loss"),
        "a diverged run scores the chance loss",
        split_key="loss",
        convergence=("loss", 0.02, True),
        positive=True,
    ),
    Measure(
        "loss_vs_chance",
        "evaluation loss as a multiple of the chance loss, at the standing checkpoint",
        " x chance",
        "lower",
        _loss_vs_chance,
        lambda r, out: 1.0,
        "a diverged run scores 1 (chance)",
        split_key="loss",
        convergence=("loss", 0.02, True),
        positive=True,
    ),
    Measure(
        "accuracy",
        "accuracy at the standing checkpoint",
        "",
        "higher",
        split_score("accuracy"),
        _chance_of("accuracy"),
        "a diverged run scores the chance accuracy (the majority class)",
        fraction=True,
        split_key="accuracy",
        convergence=("accuracy", 0.01, False),
    ),
    *(translation_score(key, label) for key, label in (("bleu", "BLEU"), ("chrf", "chrF"))),
    Measure(
        "first_update",
        "first model update ||F(x, theta_1) - F(x, theta_0)|| on the fixed probe batch",
        "",
        "higher",
        _first_update,
        lambda r, out: _first_update(r, out, VALIDATION),  # measured at step 1, before any divergence
        "a diverged run keeps its first update (measured at step 1)",
        quality=False,
        diagnostics=True,
        positive=True,
    ),
    Measure(
        "last_layer_cosine",
        "mean token cosine similarity at the last layer (the smoothness analysis)",
        "",
        "higher",
        _last("cosine"),
        None,
        "a diverged run has no representation to measure and is not evidence",
        fraction=True,
        analysis="smoothness",
        note=smoothness_note,
        quality=False,
        columns=(("centred", _last("cosine_centred")), ("same - other sample", _last("cosine_same_minus_different"))),
    ),
    Measure(
        "top_layer_gradient",
        "geometric mean over the logged diagnostics steps of the gradient norm of the top stack's last layer",
        "",
        "higher",
        _top_gradient(None),
        lambda r, out: _top_gradient(None)(r, out, VALIDATION),  # logged before it diverged
        "a diverged run keeps the gradients it logged before it diverged, and the run it is compared with is read "
        "over the same steps",
        quality=False,
        shared_steps=True,
        diagnostics=True,
        positive=True,
    ),
    Measure(
        "top_third_gradient",
        "geometric mean over the logged diagnostics steps and the top third of the top stack's layers of the "
        "gradient norm",
        "",
        "higher",
        _top_gradient(1 / 3),
        lambda r, out: _top_gradient(1 / 3)(r, out, VALIDATION),  # logged before it diverged
        "a diverged run keeps the gradients it logged before it diverged, and the run it is compared with is read "
        "over the same steps",
        quality=False,
        shared_steps=True,
        diagnostics=True,
        positive=True,
    ),
):
    register_measure(_m)
register_measure(
    replace(
        MEASURES["accuracy"],
        name="test_accuracy",
        what="accuracy on the whole test split, of the checkpoint chosen on validation",
        test_only=True,
        analysis="test_scores",
    )
)
