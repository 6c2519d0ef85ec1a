"""A many-to-many translation run's scores per direction, as the study report shows them: a table of each
direction's BLEU and chrF beside copying the source and the nearest training pair's target, with the model's
margin over the nearest pair, and a heat map of the model's chrF (source x target).

The scores are those a run's evaluation wrote (``directions``: :func:`kilolayer.objectives.directions.
direction_table`): the study's ``test_scores`` analysis, else ``kilolayer evaluate RUN --split test``'s
``RUN/scores_test.json``, else its ``--split validation``'s, each scored on the whole split or on its first pairs
(``--samples``), as its record says.
"""

from __future__ import annotations

import re
from pathlib import Path

from kilolayer import rundir
from kilolayer.objectives.directions import GROUPS

MAX_ROWS = 80  # directions shown one per row; a larger table shows its averages (its heat map shows every one)
BASELINES = ("copy", "nearest")


def scored_directions(r, out: Path) -> tuple[str, dict] | None:
    """(what scored it, the score record) of the result ``r`` whose evaluation wrote per-direction scores; None
    for a run without them (a source of one direction, or a run not scored)."""
    if r.test and r.test.get("directions"):
        return "the test_scores analysis", r.test
    for split in ("test", "validation"):
        found = rundir.read_json(r.point.run_dir(out) / rundir.scores_name(split), None)
        if isinstance(found, dict) and found.get("directions"):
            return f"kilolayer evaluate --split {split}", found
    return None


def _number(scores: dict, key: str) -> str:
    return f"{scores[key]:.1f}" if key in scores else "-"


def _difference(a: dict, b: dict, key: str) -> str:
    return f"{a[key] - b[key]:+.1f}" if key in a and key in b else "-"


def direction_rows(table: dict) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of ``table``: one row per direction (up to :data:`MAX_ROWS`), then one per average over
    directions (:data:`kilolayer.objectives.directions.GROUPS`: source ``mean``, target the group and its number of
    directions; BLEU averaged over those with a BLEU tokenizer). BLEU is ``-`` where the direction is scored by
    chrF alone; the model's columns are left out of a record of the baselines alone."""
    found = table.get("directions") or {}
    first = next(iter(found.values()), {})
    systems = [s for s in ("model", *BASELINES) if s in first]
    headers = ["source", "target", "pairs"]
    for s in systems:
        headers += [f"{s} BLEU", f"{s} chrF"]
    margin = "model" in systems and "nearest" in systems
    if margin:
        headers += ["model - nearest BLEU", "model - nearest chrF"]

    def cells(scores: dict) -> list[str]:
        out = [c for s in systems for c in (_number(scores[s], "bleu"), _number(scores[s], "chrf"))]
        if margin:
            out += [_difference(scores["model"], scores["nearest"], k) for k in ("bleu", "chrf")]
        return out

    rows = []
    if len(found) <= MAX_ROWS:
        rows = [[r["source"], r["target"], str(r["pairs"]), *cells(r)] for r in found.values()]
    means = table.get("averages") or {}
    for group in GROUPS:
        if all(group in means.get(s, {}) for s in systems) and systems:
            at = {s: means[s][group] for s in systems}
            named = group.replace("_", " ").replace("english", "English")
            rows.append(["mean", f"{named} ({at[systems[0]]['directions']})", "", *cells(at)])
    return headers, rows


def directions_section(results, out: Path, table_md) -> list[str]:
    """The report's lines for every result with per-direction scores (``table_md``: the report's Markdown table
    of headers and rows), each with its heat map in ``report_files/``; none when no result has them."""
    from kilolayer.study.plots import direction_heatmap

    lines = []
    for r in results:
        found = scored_directions(r, out)
        if found is None:
            continue
        scored_by, record = found
        table = record["directions"]
        headers, rows = direction_rows(table)
        pairs = f"{record.get('samples', '?')} pairs"
        if "of" in record:  # kilolayer evaluate --samples: the first pairs in the evaluation's order
            pairs = f"the first {record['samples']:,} of its {record['of']:,} pairs (the directions taken in turn)"
        step = record.get("step", "?")
        what = f"{record.get('split', '?')} split, {pairs}, checkpoint at step {step}, from {scored_by}"
        lines += [f"### {r.point.key}", "", f"{what}.", ""]
        if len(table["directions"]) > MAX_ROWS:
            lines += [f"{len(table['directions'])} directions: the averages here, every one in the heat map.", ""]
        lines.append(table_md(headers, rows))
        path = out / "report_files" / f"directions_{re.sub(r'[^A-Za-z0-9_.=-]', '_', r.point.key)}.png"
        if direction_heatmap(table, path):
            part = f", the first {record['samples']:,} of {record['of']:,} pairs" if "of" in record else ""
            caption = f"{r.point.key}: the model's chrF per direction (source per row, target per column{part})"
            lines += [f"![{caption}]({path.relative_to(out).as_posix()})", "", f"*{caption}*", ""]
    if not lines:
        return []
    intro = (
        "Each many-to-many run scored per direction: corpus BLEU and chrF of greedy decoding (sacrebleu; BLEU with "
        "the target language's tokenizer, `-` where the direction is scored by chrF alone), beside copying the "
        "source and the nearest training pair's target on the same pairs; *model - nearest*: the model's margin "
        "over the nearest pair (a model that translates is above it). The means are over directions: all, into "
        "English, out of English, and those with English on neither side."
    )
    return ["## Translation by direction", "", intro, "", *lines]
