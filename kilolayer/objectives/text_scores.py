"""Decoded text scored against its references: sacrebleu's corpus BLEU and chrF (its defaults) and exact match,
each with a 95% bootstrap interval over the sentences.

The interval is scipy's percentile bootstrap (see :func:`_interval`), ``RESAMPLES`` resamples of the sentences drawn
by a NumPy generator of fixed seed: the same pairs give the same interval, and nothing is drawn from torch's or
NumPy's global random state (an evaluation must leave training's random streams where they were). A resample's
corpus score is computed from its sentences' sufficient statistics (n-gram matches and lengths), as sacrebleu's own
bootstrap computes it; sacrebleu's public result keeps only the resamples' mean and a half-width, not the interval's
ends.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 1000
SEED = 0
#: the scores :func:`text_scores` gives, each with ``_low`` and ``_high``
SCORES = ("bleu", "chrf", "exact_match")


def _interval(statistic, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``statistic`` of all ``n`` sentences and the ends of its 95% percentile bootstrap interval over them (the
    fixed-seed generator of the module docstring); one sentence: every resample is the sentence itself.

    This is ``scipy.stats.bootstrap(..., method="percentile", vectorized=False)`` with that generator: the same
    draws, and the same linear quantiles to float rounding (tests/test_seq2seq_scores.py compares them). It is
    written out in NumPy because importing ``scipy.stats`` costs every training process that scores text about
    a second."""
    point = statistic(np.arange(n))
    if n < 2:
        return point, point, point
    rows = np.random.default_rng(SEED).integers(0, n, (RESAMPLES, n))
    resampled = np.stack([statistic(r) for r in rows])
    low, high = np.quantile(resampled, [0.025, 0.975], axis=0)
    return point, low, high


def text_scores(hyps: list[str], refs: list[str]) -> dict[str, float]:
    """``bleu`` and ``chrf`` (0-100), ``exact_match`` (the share of hypotheses equal to their reference), each with
    the ends of its 95% interval as ``<name>_low`` and ``<name>_high``; {} without pairs."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")
    n = len(hyps)
    if not n:
        return {}
    metrics = (BLEU(), CHRF())
    # one row of counts per sentence; a corpus score is a function of their sum
    stats = [np.asarray(m._extract_corpus_statistics(hyps, [refs]), dtype=np.int64) for m in metrics]
    exact = np.array([h == r for h, r in zip(hyps, refs)], dtype=np.float64)

    def scores(rows: np.ndarray) -> np.ndarray:
        corpus = [m._compute_score_from_stats(s[rows].sum(0).tolist()).score for m, s in zip(metrics, stats)]
        return np.array([*corpus, exact[rows].mean()], dtype=np.float64)

    point, low, high = _interval(scores, n)
    out = {}
    for i, name in enumerate(SCORES):
        out.update({name: float(point[i]), f"{name}_low": float(low[i]), f"{name}_high": float(high[i])})
    return out


#: the corpus scores :func:`paired_difference` compares
PAIRED = ("bleu", "chrf")


def paired_difference(hyps: list[str], others: list[str], refs: list[str]) -> dict[str, float]:
    """``hyps``' corpus score minus ``others``' on the same references, for BLEU and chrF, with a 95% paired
    bootstrap interval: each resample draws the same sentences for both, so the sentence-to-sentence spread that
    both share cancels (Koehn 2004). Keys ``bleu``, ``bleu_low``, ``bleu_high`` and the same for ``chrf``; {}
    without pairs."""
    from sacrebleu.metrics import BLEU, CHRF

    if not len(hyps) == len(others) == len(refs):
        raise ValueError(f"{len(hyps)} and {len(others)} hypotheses for {len(refs)} references")
    n = len(refs)
    if not n:
        return {}
    metrics = (BLEU(), CHRF())
    stats = [
        [np.asarray(m._extract_corpus_statistics(h, [refs]), dtype=np.int64) for m in metrics] for h in (hyps, others)
    ]

    def difference(rows: np.ndarray) -> np.ndarray:
        a, b = (
            [m._compute_score_from_stats(s[rows].sum(0).tolist()).score for m, s in zip(metrics, side)]
            for side in stats
        )
        return np.array(a, dtype=np.float64) - np.array(b, dtype=np.float64)

    point, low, high = _interval(difference, n)
    out = {}
    for i, name in enumerate(PAIRED):
        out.update({name: float(point[i]), f"{name}_low": float(low[i]), f"{name}_high": float(high[i])})
    return out
