"""What a seq2seq model's scores sit beside: predictors that do not translate, scored on the very pairs and
references the model is scored on, with the same detokenizer and the same
:func:`~kilolayer.objectives.text_scores.text_scores`.

* ``copy``: the source itself as the hypothesis.
* ``shuffle``: the reference's own tokens in a seeded random order: every token right, the order lost. On digit
  strings such a hypothesis keeps a sizeable BLEU, so BLEU there says little; token accuracy and exact match are
  the measures that fit those tasks.
* ``nearest``: the target of the training pair whose source is nearest to the evaluation source, by the cosine of
  their character n-gram TF-IDF vectors (scikit-learn's ``TfidfVectorizer(analyzer="char_wb")`` fitted on the
  training sources): retrieval, no translation. A model whose BLEU and chrF are not above it has not learned to
  translate (:func:`translates`).

A source names the ones that apply (``Seq2SeqSource.baselines``). A many-to-many source (one with
``direction(d)``, whose pairs carry their direction) is searched direction by direction: the nearest training pair
of the same source and target language. Each baseline's scores are those of
``text_scores`` plus ``token_accuracy``: the share of the reference's tokens, its end token included, that the
hypothesis has at the same position. A model's teacher-forced ``token_accuracy`` is read against it on symbol
tasks; on text a shift by one token loses every later one, so BLEU and chrF are the measures there.

The nearest-neighbour search is a sparse product of every evaluation source with every training source; its
outcome (the chosen training pair of each evaluation pair) is cached (:mod:`kilolayer.data.cache`) under a hash
of the texts it compared and of this recipe.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kilolayer.data.cache import TensorOf, cached
from kilolayer.data.synthetic import Seq2SeqSource
from kilolayer.objectives.text_scores import paired_difference, text_scores

Pairs = list[tuple[list[int], list[int]]]

NGRAMS = (2, 4)  # character n-gram lengths, within words padded with a space (char_wb)
CHUNK = 128  # evaluation sources per sparse product (its result is nearly dense: a column per training source)
SHUFFLE_SEED = 0
RECIPE = f"char_wb{NGRAMS}"  # in the cache key: change it with the vectorizer's settings


def copy_hypotheses(source: Seq2SeqSource, pairs: Pairs) -> list[list[int]]:
    return [list(s) for s, _ in pairs]


def shuffle_hypotheses(source: Seq2SeqSource, pairs: Pairs) -> list[list[int]]:
    rng = np.random.default_rng(SHUFFLE_SEED)
    return [[t[i] for i in rng.permutation(len(t))] for _, t in pairs]


def nearest_hypotheses(source: Seq2SeqSource, pairs: Pairs) -> list[list[int]]:
    queries = [source.detokenize(s) for s, _ in pairs]
    # a source may search a larger pool of texts, its answers limited to some of them (a many-to-many direction
    # searches every training text of its source language, answering with its own pairs): its directions then
    # share one fit
    pool = getattr(source, "nearest_pool", lambda: None)()
    if pool is not None:
        texts, among, target = pool
        return [list(target(j)) for j in nearest(texts, queries, among)]
    train = source.train_pairs()
    if not train:
        raise ValueError(f"{type(source).__name__}: the nearest-neighbour baseline needs a training split")
    chosen = nearest([source.detokenize(s) for s, _ in train], queries)
    return [list(train[j][1]) for j in chosen]


HYPOTHESES: dict[str, Callable[[Seq2SeqSource, Pairs], list[list[int]]]] = {
    "copy": copy_hypotheses,
    "shuffle": shuffle_hypotheses,
    "nearest": nearest_hypotheses,
}


_FITTED: dict[str, tuple] = {}  # the last corpus's vectorizer and matrix, while searches of that corpus follow


def _fitted(corpus: list[str]) -> tuple:
    """(vectorizer, corpus matrix transposed) of ``corpus``, kept for the next search of the same corpus."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    key = hashlib.sha256(repr((RECIPE, corpus)).encode()).hexdigest()
    if key not in _FITTED:
        _FITTED.clear()
        vectorizer = TfidfVectorizer(analyzer="char_wb", ngram_range=NGRAMS, dtype=np.float32)
        _FITTED[key] = (vectorizer, vectorizer.fit_transform(corpus).T.tocsr())
    return _FITTED[key]


def nearest(corpus: list[str], queries: list[str], among: list[int] | None = None) -> list[int]:
    """For each query, the index of the text of ``corpus`` nearest to it by character n-gram TF-IDF cosine (the
    first of equals), cached; ``among``: the indices an answer may take (default: all of them)."""

    def search() -> dict:
        vectorizer, known = _fitted(corpus)
        if among is not None:
            known = known[:, among]
        asked = vectorizer.transform(queries)
        found = [
            np.asarray((asked[i : i + CHUNK] @ known).argmax(axis=1)).ravel() for i in range(0, len(queries), CHUNK)
        ]
        index = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        if among is not None:
            index = np.asarray(among, dtype=np.int64)[index]
        return {"index": torch.as_tensor(index, dtype=torch.int64)}

    def check(data: dict) -> None:
        index = data["index"]
        if index.numel() != len(queries) or (
            index.numel() and not 0 <= int(index.min()) <= int(index.max()) < len(corpus)
        ):
            raise ValueError(
                f"'index' does not hold one position in [0, {len(corpus)}) per each of {len(queries)} queries"
            )

    searched = (RECIPE, corpus, queries) if among is None else (RECIPE, corpus, queries, among)
    key = hashlib.sha256(repr(searched).encode()).hexdigest()[:20]
    return cached(f"nearest-{key}", search, {"index": TensorOf((torch.int64,), 1)}, check)["index"].tolist()


def positional_accuracy(hyps: list[list[int]], refs: list[list[int]], eos: int) -> float:
    """The share of the references' tokens, each one's end token included, that the hypotheses (ended alike)
    have at the same position."""
    right = total = 0
    for h, r in zip(hyps, refs):
        h, r = list(h) + [eos], list(r) + [eos]
        right += sum(a == b for a, b in zip(h, r))
        total += len(r)
    return right / max(total, 1)


def baseline_hypotheses(
    source: Seq2SeqSource, pairs: Pairs, directions: list[int] | None = None
) -> dict[str, list[list[int]]]:
    """``{name: hypothesis ids of each pair}`` of each baseline ``source`` names; given each pair's direction, the
    baselines of the pairs of a direction are those of ``source.direction(d)``."""
    try:
        if directions is None:
            return {name: HYPOTHESES[name](source, pairs) for name in source.baselines}
        out = {name: [None] * len(pairs) for name in source.baselines}
        for d in sorted(set(directions)):  # in order, so that the directions out of one language follow each other
            at = [i for i, x in enumerate(directions) if x == d]
            view = source.direction(d)
            for name in source.baselines:
                for i, h in zip(at, HYPOTHESES[name](view, [pairs[i] for i in at])):
                    out[name][i] = h
        return out
    finally:
        _FITTED.clear()  # the fit serves one set of baselines, not the rest of the run


def baseline_scores(
    source: Seq2SeqSource,
    pairs: Pairs,
    model: list[str] | None = None,
    hypotheses: dict[str, list[list[int]]] | None = None,
) -> dict[str, dict]:
    """``{name: scores}`` of each baseline ``source`` names, on ``pairs`` (source ids, target ids without the end
    token), the references being the targets through ``source.detokenize``. Given ``model``, the model's decoded
    hypotheses of the same pairs, each baseline also holds ``model_minus``: the model's BLEU and chrF minus the
    baseline's with a 95% paired bootstrap interval (:func:`~kilolayer.objectives.text_scores.paired_difference`).
    ``hypotheses``: the baselines' ids already found (:func:`baseline_hypotheses`)."""
    refs = [source.detokenize(t) for _, t in pairs]
    hypotheses = hypotheses or baseline_hypotheses(source, pairs)
    out = {}
    for name in source.baselines:
        ids = hypotheses[name]
        hyps = [source.detokenize(h) for h in ids]
        scores = text_scores(hyps, refs)
        out[name] = {**scores, "token_accuracy": positional_accuracy(ids, [t for _, t in pairs], source.eos)}
        if model is not None and len(model) == len(refs):
            out[name]["model_minus"] = paired_difference(model, hyps, refs)
    return out


@dataclass(frozen=True)
class Verdict:
    """A model's BLEU and chrF against the bar of its baselines on the same pairs (on each score, the better of
    copying the source and the nearest training pair's target): it translates only when both are above."""

    translates: bool
    bleu: float
    chrf: float
    bar_bleu: float
    bar_chrf: float
    paired: bool = False  # decided by the paired bootstrap's lower ends, not by the point scores
    low_bleu_margin: float | None = None  # the least lower end of the model's paired BLEU advantage over a baseline
    low_chrf_margin: float | None = None

    @property
    def bleu_margin(self) -> float:
        return self.bleu - self.bar_bleu

    @property
    def chrf_margin(self) -> float:
        return self.chrf - self.bar_chrf

    def as_dict(self) -> dict:
        return {**asdict(self), "bleu_margin": self.bleu_margin, "chrf_margin": self.chrf_margin}

    def __str__(self) -> str:
        side = "translates" if self.translates else "does not translate"
        text = (
            f"{side}: BLEU {self.bleu:.2f} vs {self.bar_bleu:.2f} ({self.bleu_margin:+.2f}), chrF {self.chrf:.2f} "
            f"vs {self.bar_chrf:.2f} ({self.chrf_margin:+.2f}), the better of copying and the nearest training "
            "pair's target"
        )
        if self.paired:
            text += (
                f"; paired bootstrap on the same sentences, 95% lower ends of the advantage: BLEU "
                f"{self.low_bleu_margin:+.2f}, chrF {self.low_chrf_margin:+.2f}"
            )
        return text


def translates(metrics: dict, baselines: dict) -> Verdict | None:
    """Whether a model translates: its ``bleu`` and ``chrf`` both above the better of the ``nearest`` and
    ``copy`` entries of ``baselines`` (name -> scores, on the same pairs) on that score, and by how much. Beating
    retrieval is not enough where the target is close to the source: copying must be beaten too. None without a
    decoded score or a nearest-neighbour baseline to set it beside.

    Where every baseline holds the model's paired difference from it (``model_minus``, on the same sentences), the
    model translates only when the 95% paired bootstrap interval of its advantage lies above zero against both
    baselines on both scores: a point estimate inside the noise of the sentences drawn is no advantage."""
    near = baselines.get("nearest") or {}
    if not all(k in metrics and k in near for k in ("bleu", "chrf")):
        return None
    bars = [b for b in (near, baselines.get("copy")) if b and all(k in b for k in ("bleu", "chrf"))]
    bar_bleu = max(float(b["bleu"]) for b in bars)
    bar_chrf = max(float(b["chrf"]) for b in bars)
    bleu, chrf = float(metrics["bleu"]), float(metrics["chrf"])
    paired = [b.get("model_minus") for b in bars]
    if all(p and "bleu_low" in p and "chrf_low" in p for p in paired):
        low_bleu = min(float(p["bleu_low"]) for p in paired)
        low_chrf = min(float(p["chrf_low"]) for p in paired)
        return Verdict(low_bleu > 0 and low_chrf > 0, bleu, chrf, bar_bleu, bar_chrf, True, low_bleu, low_chrf)
    return Verdict(bleu > bar_bleu and chrf > bar_chrf, bleu, chrf, bar_bleu, bar_chrf)
