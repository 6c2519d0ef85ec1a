"""Translation scored per direction (source language -> target language), as a many-to-many model is judged: each
direction's corpus BLEU and chrF for the model and each baseline on the same sentences, and the averages over
directions the multilingual literature reports (all, into English, out of English, neither side English).

BLEU is sacrebleu's with the tokenizer of the target language (:func:`bleu_tokenizer`): ``zh`` for Chinese,
``ja-mecab`` and ``ko-mecab`` where MeCab and its dictionary are installed (``pip install 'sacrebleu[ja]'``), none
for Khmer and Dzongkha (written without spaces; sacrebleu has no offline segmenter for them) and for Japanese or
Korean without MeCab: those directions are scored by chrF alone, and the table says so (``tokenize``: null).
chrF is sacrebleu's default (character n-grams, the same for every script).
"""

from __future__ import annotations

from functools import cache

ENGLISH = "en"
#: averages over directions: the name and which (source, target) it takes
GROUPS = {
    "all": lambda s, t: True,
    "into_english": lambda s, t: t == ENGLISH,
    "out_of_english": lambda s, t: s == ENGLISH,
    "neither": lambda s, t: ENGLISH not in (s, t),
}
WORDS_WITHOUT_SPACES = {"km", "dz"}  # no segmenter: chrF alone


@cache
def usable(tokenize: str) -> bool:
    """Whether sacrebleu's BLEU runs with ``tokenize`` here (ja-mecab and ko-mecab need extra packages)."""
    from sacrebleu.metrics import BLEU

    try:
        BLEU(tokenize=tokenize).corpus_score(["a b"], [["a b"]])
    except Exception:  # sacrebleu raises ImportError, RuntimeError or its own errors for a missing tokenizer
        return False
    return True


def bleu_tokenizer(lang: str) -> str | None:
    """sacrebleu's BLEU tokenizer for references in ``lang`` (a code as ``lo_multi``'s: ``zh-cn``, ``ja``, ``de``),
    or None where BLEU is not computed (chrF alone)."""
    base = lang.split("-")[0]
    if base == "zh":
        return "zh"
    if base in ("ja", "ko"):
        return f"{base}-mecab" if usable(f"{base}-mecab") else None
    if base in WORDS_WITHOUT_SPACES:
        return None
    return "13a"


def corpus_scores(hyps: list[str], refs: list[str], tokenize: str | None) -> dict[str, float]:
    """``chrf`` and, with a tokenizer, ``bleu`` of ``hyps`` against ``refs`` (corpus level, 0-100)."""
    from sacrebleu.metrics import BLEU, CHRF

    out = {"chrf": CHRF().corpus_score(hyps, [refs]).score}
    if tokenize is not None:
        out["bleu"] = BLEU(tokenize=tokenize).corpus_score(hyps, [refs]).score
    return out


def averages(rows: dict[str, dict], systems) -> dict[str, dict]:
    """``{system: {group: {"bleu", "chrf", "directions", "bleu_directions"}}}``: the mean over the directions of
    each :data:`GROUPS` entry that has any (BLEU over those with a BLEU tokenizer)."""
    out = {}
    for system in systems:
        out[system] = {}
        for group, takes in GROUPS.items():
            chosen = [r[system] for r in rows.values() if takes(r["source"], r["target"])]
            if not chosen:
                continue
            bleus = [c["bleu"] for c in chosen if "bleu" in c]
            entry = {"chrf": sum(c["chrf"] for c in chosen) / len(chosen), "directions": len(chosen)}
            if bleus:
                entry.update(bleu=sum(bleus) / len(bleus), bleu_directions=len(bleus))
            out[system][group] = entry
    return out


def direction_table(
    directions: list[tuple[str, str]], of_pair: list[int], refs: list[str], systems: dict[str, list[str]]
) -> dict:
    """The scores of each direction with pairs: ``{"directions": {"en-de": {"source", "target", "pairs",
    "tokenize", <system>: {"bleu", "chrf"}, ...}}, "averages": ...}`` (:func:`averages`). ``of_pair``: each pair's
    index into ``directions``; ``systems``: name -> a hypothesis per pair (the model's, the baselines')."""
    rows = {}
    for d, (s, t) in enumerate(directions):
        at = [i for i, x in enumerate(of_pair) if x == d]
        if not at:
            continue
        tokenize = bleu_tokenizer(t)
        row = {"source": s, "target": t, "pairs": len(at), "tokenize": tokenize}
        for name, hyps in systems.items():
            row[name] = corpus_scores([hyps[i] for i in at], [refs[i] for i in at], tokenize)
        rows[f"{s}-{t}"] = row
    return {"directions": rows, "averages": averages(rows, systems)}


def table_lines(table: dict) -> list[str]:
    """``table`` (:func:`direction_table`) as aligned text: one line per direction, then the averages; BLEU is
    ``-`` where the direction is scored by chrF alone."""
    rows = table["directions"]
    if not rows:
        return []
    systems = [k for k in next(iter(rows.values())) if k not in ("source", "target", "pairs", "tokenize")]
    head = f"{'direction':<20} {'pairs':>6} " + " ".join(f"{s + ' BLEU':>13} {s + ' chrF':>13}" for s in systems)
    lines = [head + "  BLEU tokenizer"]

    def cell(scores: dict, key: str) -> str:
        return f"{scores[key]:13.2f}" if key in scores else f"{'-':>13}"

    for name, row in rows.items():
        scores = " ".join(f"{cell(row[s], 'bleu')} {cell(row[s], 'chrf')}" for s in systems)
        tok = row["tokenize"] or "none: chrF alone"
        lines.append(f"{name:<20} {row['pairs']:>6} {scores}  {tok}")
    for group in GROUPS:
        if group not in table["averages"].get(systems[0], {}):
            continue
        n = table["averages"][systems[0]][group]["directions"]
        scores = " ".join(
            f"{cell(table['averages'][s][group], 'bleu')} {cell(table['averages'][s][group], 'chrf')}" for s in systems
        )
        lines.append(f"{'mean ' + group:<20} {'':>6} {scores}  over {n} directions")
    return lines
