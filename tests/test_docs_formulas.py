"""The reference pages in docs/ against the code: DeepNorm's table of values and every name they cite.

docs/deepnet.md holds a table of alpha and beta at a few depths between two HTML-comment markers; each
row is recomputed with ``deepnorm_constants``. Both pages name the functions that implement each formula
as backticked dotted paths (``kilolayer.nn.deepnorm.deepnorm_constants``); each must still resolve, so a
rename in the code fails here instead of leaving the page pointing at nothing.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from kilolayer.nn.deepnorm import deepnorm_constants

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = ("deepnet.md", "bamboo.md")
START, END = "<!-- deepnorm-table:start -->", "<!-- deepnorm-table:end -->"
COLUMNS = ["arch", "N", "M", "side", "alpha", "beta"]


def _table_rows() -> list[dict[str, str]]:
    """The rows of the marked table in docs/deepnet.md, as {column: cell text}."""
    text = (DOCS / "deepnet.md").read_text(encoding="utf-8")
    assert text.count(START) == 1 and text.count(END) == 1, "docs/deepnet.md: expected one marked table"
    block = text.split(START, 1)[1].split(END, 1)[0]
    lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, f"docs/deepnet.md table header: {header}"
    assert set(lines[1].replace("|", "").strip()) <= set("-: "), "second line must be the separator row"
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS), f"malformed row: {line}"
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def _decimals(cell: str) -> int:
    return len(cell.split(".", 1)[1]) if "." in cell else 0


def _row_id(row: dict[str, str]) -> str:
    return f"{row['arch']}-N{row['N']}-M{row['M']}-{row['side']}"


ROWS = _table_rows()


def test_table_has_every_architecture_and_side():
    sides = {(r["arch"], r["side"]) for r in ROWS}
    assert sides == {
        ("encoder", "encoder"),
        ("decoder", "decoder"),
        ("encoder_decoder", "encoder"),
        ("encoder_decoder", "decoder"),
    }
    pairs = {(r["N"], r["M"]) for r in ROWS if r["arch"] == "encoder_decoder"}
    for n, m in pairs:
        got = {r["side"] for r in ROWS if r["arch"] == "encoder_decoder" and (r["N"], r["M"]) == (n, m)}
        assert got == {"encoder", "decoder"}, f"encoder-decoder N={n} M={m} lists only {got}"


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_table_value_matches_deepnorm_constants(row):
    constants = deepnorm_constants(row["arch"], int(row["N"]), int(row["M"]))
    alpha, beta = constants[row["side"]]
    for name, value in (("alpha", alpha), ("beta", beta)):
        cell = row[name]
        places = _decimals(cell)
        assert places >= 3, f"{name} = {cell}: give at least 3 decimals"
        # the page shows the value rounded to its number of decimals
        assert abs(float(cell) - value) <= 0.5 * 10**-places + 1e-12, f"{name}: page {cell}, code {value!r}"


def test_rounded_encoder_factors_follow_the_exact_derivation():
    """0.81 and 0.87 are Appendix B's 27^(-1/16) and 27^(1/16) / sqrt(2), rounded as the page says."""
    assert round(27 ** (-1 / 16), 2) == 0.81
    assert round(27 ** (1 / 16) / 2**0.5, 2) == 0.87
    assert deepnorm_constants("encoder_decoder", 1, 1)["encoder"] == pytest.approx((0.81, 0.87), rel=1e-14)


NAME = re.compile(r"`(kilolayer(?:\.\w+)+)`")


def _cited_names() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        text = (DOCS / page).read_text(encoding="utf-8")
        out += [(page, name) for name in sorted(set(NAME.findall(text)))]
    return out


def _resolve(dotted: str):
    """Import the longest importable module prefix of ``dotted``, then follow attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_pages_cite_some_names():
    pages = {page for page, _ in _cited_names()}
    assert pages == set(PAGES)


@pytest.mark.parametrize("page, name", _cited_names(), ids=lambda x: x)
def test_cited_name_exists(page, name):
    try:
        _resolve(name)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"docs/{page} cites `{name}`, which does not resolve: {exc}")
