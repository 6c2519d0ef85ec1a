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
    what: str  # the rule's words for it: "final evaluation loss"
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

    @property
    def lower_is_better(self) -> bool:
        return self.better == "lower"


MEASURES: Registry[Measure] = Registry("kilolayer.measures", "measure")


def register_measure(measure: Measure) -> Measure:
    MEASURES.register(measure.name)(measure)
    return measure


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


def baselines_note(runs, out, split: str) -> list[str]:
    """Beside a translation score: what copying the source and the nearest training pair's target score on the
    same evaluation pairs (each run's baselines.json, or its test scores'), and how many runs translate (BLEU and
    chrF both above the better of the two)."""
    from kilolayer.objectives.baselines import translates
    from kilolayer.rundir import read_baselines

    texts, verdicts = [], []
    for r in runs:
        if split == TEST:
            scores, found = (r.test or {}).get("metrics") or {}, (r.test or {}).get("baselines")
        else:
            scores, found = r.eval, read_baselines(r.point.run_dir(out)).get("baselines")
        if not found:
            continue
        text = "; ".join(f"{name} BLEU {s['bleu']:.2f}, chrF {s['chrf']:.2f}" for name, s in found.items())
        if text not in texts:
            texts.append(text)
        v = translates(scores, found) if r.status == "completed" else None
        if v is not None:
            verdicts.append(v.translates)
    if not texts:
        return []
    note = f"Baselines on the same {split} pairs: {' / '.join(texts)}."
    if verdicts:
        note += (
            f" {sum(verdicts)} of {len(verdicts)} completed runs translate (BLEU and chrF above the better of "
            "copying and the nearest training pair's target)."
        )
    return [note]


def translation_score(key: str, label: str) -> Measure:
    """A corpus score of greedy decoding (``bleu``, ``chrf``): a diverged run scores 0, what a model that produces
    nothing scores, and the baselines of the same pairs are quoted beside the verdict."""
    return Measure(
        key,
        f"final {label} (greedy decoding, sacrebleu)",
        f" {label}",
        "higher",
        split_score(key),
        lambda r, out: 0.0,
        f"a diverged run scores {label} 0, what a model that produces nothing scores",
        split_key=key,
        convergence=(key, 0.5, False),
        note=baselines_note,
    )


def _first_update(r, out, split: str) -> float | None:
    ups = [d.get("update") for d in r.diagnostics if d.get("step") == 1] or [d.get("update") for d in r.diagnostics[:1]]
    return float(ups[0]) if ups and ups[0] is not None else None


def _last_layer_cosine(r, out, split: str) -> float | None:
    cos = (r.smoothness or {}).get("cosine")
    return float(cos[-1]) if cos else None


def _top_layer_gradient(r, out, split: str) -> float | None:
    from kilolayer.analysis.stability import read_diagnostics, top_stack
    from kilolayer.errors import InputError

    try:
        lines = [d for d in read_diagnostics(r.diagnostics, r.point.key) if d.layers]
    except InputError:
        return None
    values = [d.grad_norm[top_stack(d.layers)[-1]] for d in lines]
    values = [v for v in values if math.isfinite(v) and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


for _m in (
    Measure(
        "eval_loss",
        "final evaluation loss",
        " nats",
        "lower",
        split_score("loss"),
        _chance_of("loss"),
        "a diverged run scores the chance loss",
        split_key="loss",
        convergence=("loss", 0.02, True),
    ),
    Measure(
        "loss_vs_chance",
        "final evaluation loss as a multiple of the chance loss",
        " x chance",
        "lower",
        _loss_vs_chance,
        lambda r, out: 1.0,
        "a diverged run scores 1 (chance)",
        split_key="loss",
        convergence=("loss", 0.02, True),
    ),
    Measure(
        "accuracy",
        "final accuracy",
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
    ),
    Measure(
        "last_layer_cosine",
        "token cosine similarity at the last layer (the smoothness analysis)",
        "",
        "higher",
        _last_layer_cosine,
        None,
        "a diverged run has no representation to measure and is not evidence",
        fraction=True,
    ),
    Measure(
        "top_layer_gradient",
        "geometric mean over the logged diagnostics steps of the gradient norm of the top stack's last layer",
        "",
        "higher",
        _top_layer_gradient,
        lambda r, out: _top_layer_gradient(r, out, VALIDATION),  # logged before it diverged
        "a diverged run keeps the gradients it logged before it diverged",
        quality=False,
    ),
):
    register_measure(_m)
register_measure(
    replace(
        MEASURES["accuracy"],
        name="test_accuracy",
        what="accuracy on the whole test split, of the checkpoint chosen on validation",
        test_only=True,
    )
)
