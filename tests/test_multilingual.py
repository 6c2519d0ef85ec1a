"""The study report of a many-to-many translation run: a table of every direction (BLEU, chrF, the copy and nearest
baselines, the model's margin over the nearest pair, the averages over directions) and a heat map of the model's chrF,
rendered from a constructed per-direction record as ``kilolayer evaluate`` and the test_scores analysis write it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from kilolayer import rundir
from kilolayer.objectives.directions import averages
from kilolayer.study.directions_report import direction_rows, directions_section
from kilolayer.study.report import PNG_SIGNATURE, _table, render_html, render_markdown

LANGS = ("en", "de", "ja")
SYSTEMS = ("model", "copy", "nearest")


def score(system: str, s: str, t: str) -> dict:
    """Made-up scores that tell every cell apart: the model's chrF is 10 x the direction's number + 5."""
    k = LANGS.index(s) * 3 + LANGS.index(t)
    chrf = {"model": 10 * k + 5, "copy": 2.0 + k / 10, "nearest": 6.0 + k}[system]
    out = {"chrf": float(chrf)}
    if t != "ja":  # Japanese without MeCab: chrF alone
        out["bleu"] = {"model": 4.0 * k, "copy": 0.5, "nearest": 1.0 + k / 2}[system]
    return out


def record() -> dict:
    rows = {
        f"{s}-{t}": {
            "source": s,
            "target": t,
            "pairs": 8,
            "tokenize": None if t == "ja" else "13a",
            **{name: score(name, s, t) for name in SYSTEMS},
        }
        for s in LANGS
        for t in LANGS
        if s != t
    }
    table = {"directions": rows, "averages": averages(rows, SYSTEMS)}
    return {"split": "test", "samples": 48, "step": 800, "checkpoint": "step_00000800", "directions": table}


def result(key: str, test: dict | None = None):
    point = SimpleNamespace(key=key, run_dir=lambda out: Path(out) / "runs" / key)
    return SimpleNamespace(point=point, test=test)


def test_the_direction_table_has_every_direction_its_baselines_margin_and_averages():
    headers, rows = direction_rows(record()["directions"])
    assert headers == [
        "source",
        "target",
        "pairs",
        "model BLEU",
        "model chrF",
        "copy BLEU",
        "copy chrF",
        "nearest BLEU",
        "nearest chrF",
        "model - nearest BLEU",
        "model - nearest chrF",
    ]
    by = {(r[0], r[1]): r for r in rows}
    # de-en: k = 3; model BLEU 12, chrF 35; nearest BLEU 2.5, chrF 9
    assert by["de", "en"][2:] == ["8", "12.0", "35.0", "0.5", "2.3", "2.5", "9.0", "+9.5", "+26.0"]
    # into Japanese: chrF alone, so BLEU and its margin are "-"
    assert by["en", "ja"][3:5] == ["-", "25.0"] and by["en", "ja"][9] == "-"
    means = {r[1]: r for r in rows if r[0] == "mean"}
    assert list(means) == ["all (6)", "into English (2)", "out of English (2)", "neither (2)"]
    # into English: de-en (chrF 35) and ja-en (k = 6: 65)
    assert means["into English (2)"][4] == "50.0" and means["into English (2)"][10] == "+39.5"
    assert means["neither (2)"][4] == "65.0"  # de-ja (k = 5) and ja-de (k = 7): 55 and 75
    assert len(rows) == 6 + 4


def test_a_table_of_more_directions_than_a_page_holds_shows_its_averages(tmp_path, monkeypatch):
    from kilolayer.study import directions_report

    monkeypatch.setattr(directions_report, "MAX_ROWS", 5)
    _, rows = direction_rows(record()["directions"])
    assert [r[0] for r in rows] == ["mean"] * 4
    text = "\n".join(directions_section([result("g/a", record())], tmp_path, _table))
    assert "6 directions: the averages here, every one in the heat map." in text


def test_the_report_shows_the_table_and_a_heat_map_embedded_in_its_html(tmp_path):
    out = tmp_path
    lines = directions_section([result("g/a", record()), result("g/b")], out, _table)
    text = "\n".join(lines)
    assert text.count("### ") == 1 and "### g/a" in text and "g/b" not in text  # b has no per-direction scores
    assert "test split, 48 pairs, checkpoint at step 800, from the test_scores analysis" in text
    assert "| de | en | 8 | 12.0 | 35.0 |" in text
    png = out / "report_files" / "directions_g_a.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 5000
    page = render_html(f"# r\n\n{text}\n", out)
    assert page.count("data:image/png;base64,") == 1 and "<td>+26.0</td>" in page


def test_the_report_reads_kilolayer_evaluates_scores_file_where_no_analysis_scored_the_run(tmp_path):
    run = tmp_path / "runs" / "g" / "b"
    run.mkdir(parents=True)
    rundir.write_json(run / rundir.scores_name("validation"), {**record(), "split": "validation"})
    text = "\n".join(directions_section([result("g/b")], tmp_path, _table))
    assert "validation split, 48 pairs" in text and "from kilolayer evaluate --split validation" in text
    # a record of one direction's pairs, as a one-to-one source's, has no table
    rundir.write_json(run / rundir.scores_name("validation"), {"split": "validation", "metrics": {"bleu": 1.0}})
    assert directions_section([result("g/b")], tmp_path, _table) == []
    # kilolayer evaluate --samples: the table and its heat map say the pairs are the split's first, not all of it
    part = {**record(), "split": "test", "samples": 48, "of": 4096}
    rundir.write_json(run / rundir.scores_name("test"), part)
    text = "\n".join(directions_section([result("g/b")], tmp_path, _table))
    assert "test split, the first 48 of its 4,096 pairs (the directions taken in turn), checkpoint at step" in text
    assert "(source per row, target per column, the first 48 of 4,096 pairs)" in text


def test_the_study_report_places_the_directions_after_its_runs(tmp_path):
    from kilolayer.config import load_config

    config = load_config(
        {
            "model": {"arch": "encoder_decoder", "layers": 1, "decoder_layers": 1, "width": 16, "heads": 2,
                      "vocab_size": 13, "max_len": 16},
            "objective": {"name": "seq2seq"},
            "data": {"name": "synthetic", "task": "reverse", "options": {"vocab": 10}},
        }
    )  # fmt: skip
    r = result("g/a", record())
    r.point.config, r.point.analyses = config, []
    r.__dict__.update(seconds=1.0, ran=True, status="completed", step=800, reason="", eval={}, precision="fp32")
    r.precision_reason, r.command = "", "kilolayer train ..."
    spec = SimpleNamespace(name="multi", description="d", claims_left_out=[])
    md = render_markdown(spec, [r], [], tmp_path, 1.0)
    assert md.index("## Runs") < md.index("## Translation by direction") < md.index("## Commands")
    assert json.dumps("report_files/directions_g_a.png")[1:-1] in md


# ------------------------------------------------------------------ the studies


def test_the_cpu_slice_compares_schemes_at_deepnet_mt_depths_setting_and_shapes_at_equal_parameters():
    from kilolayer.nn.budget import count_parameters
    from kilolayer.study.spec import expand, load_spec

    spec = load_spec("deepnet_multilingual_cpu")
    cfgs = [p.config for p in expand(spec)]
    assert len(cfgs) == 8 and {c.model.scheme for c in cfgs} == {"post_ln", "deepnorm"}
    assert {c.train.seed for c in cfgs} == {0, 1}
    # six languages, two in non-Latin scripts, every direction
    options = {json.dumps(c.data.options, sort_keys=True) for c in cfgs}
    assert len(options) == 1 and cfgs[0].data.options["languages"] == ["en", "de", "fr", "ru", "ja", "zh-cn"]
    assert cfgs[0].data.options["directions"] == "all"
    # deepnet_mt_depth's 18L-18L, width 64, lr and warm-up; one step budget and no early stop: equal budgets
    depth = [p.config for p in expand(load_spec("deepnet_mt_depth")) if p.config.model.layers == 18][0]
    deep = [c for c in cfgs if c.model.layers == 18]
    assert {(c.model.width, c.train.lr, c.train.warmup, c.train.batch_size) for c in deep} == {
        (depth.model.width, depth.train.lr, depth.train.warmup, depth.train.batch_size)
    }
    assert len({(c.train.steps, c.train.batch_size) for c in cfgs}) == 1 and all(c.train.patience == 0 for c in cfgs)
    sizes = sorted({(c.model.layers, c.model.width, count_parameters(c.model)) for c in cfgs})
    assert [s[:2] for s in sizes] == [(6, 96), (18, 64)]
    assert abs(sizes[0][2] / sizes[1][2] - 1) < 0.01 and 3.0e6 < sizes[1][2] < 3.3e6  # 3.13M and 3.14M
    assert {c.model.width // c.model.heads for c in cfgs} == {16}
    assert [c.name for c in spec.claims] == ["deepnet_postln", "deepnet_update", "deepnet_multilingual_depth"]


def test_the_gpu_study_sets_a_deep_narrow_model_against_a_wide_one_of_the_papers_parameter_ratio():
    from kilolayer.nn.budget import count_parameters
    from kilolayer.study.spec import expand, load_spec

    spec = load_spec("deepnet_multilingual")
    points = expand(spec)
    grid = {(p.config.model.scheme, p.config.model.layers) for p in points if p.group == "deepnet"}
    assert grid == {(s, d) for s in ("post_ln", "pre_ln", "deepnorm") for d in (12, 24, 50, 100)}
    deeper, wide = (next(p.config.model for p in points if p.group == g) for g in ("deeper", "wide"))
    assert (deeper.layers, deeper.width, wide.layers, wide.width) == (200, 256, 48, 1024)
    ratio = count_parameters(wide) / count_parameters(deeper)
    assert 3.5 < ratio < 4.2  # the paper's 12B / 3.2B = 3.75 at 48 against 200 layers
    assert len({(p.config.train.steps, p.config.train.lr, p.config.train.batch_size) for p in points}) == 1
    claim = next(c for c in spec.claims if c.name == "deepnet_multilingual_wide")
    assert claim.paper_effect == 5.0 and claim.margin < claim.paper_effect
