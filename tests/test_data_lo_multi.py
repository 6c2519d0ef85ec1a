"""lo_multi: N-way aligned help pages of three languages generated in the packages' format; every direction drawn
in training at the temperature's rate, the tag deciding the output language (an oracle that reads it scores 100,
one that writes another language does not), held-out pages training in no language (nor a UI string of the
catalogues that matches one), the per-direction table of ``kilolayer evaluate``, and the one-line refusals of bad
options."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_data_parallel import write_mo

from kilolayer.config import load_config
from kilolayer.data import debian, load_source
from kilolayer.data import lo_multi as M
from kilolayer.errors import ConfigError
from kilolayer.objectives import directions as D
from kilolayer.objectives import text_scores

PAGE = """<!DOCTYPE html>
<html lang="{lang}"><head><meta charset="utf-8"><title>t</title></head>
<body><div id="DisplayArea">
{paragraphs}
</div></body></html>
"""
LANGS = ("en", "de", "fr")
MODULES = ("scalc", "swriter")
PAGES = 6  # per module: split_pages holds out one test and one validation page of each
PARAGRAPHS = 4
WORDS = {
    "en": ("Paint the {c} box {k} on page {p}.", ["red", "green", "blue", "black", "white", "brown"]),
    "de": ("Male die {c} Kiste {k} auf Seite {p}.", ["rote", "grüne", "blaue", "schwarze", "weiße", "braune"]),
    "fr": ("Peins la boîte {c} {k} sur la page {p}.", ["rouge", "verte", "bleue", "noire", "blanche", "marron"]),
}
# on every page: kept once, in the first split of test, validation, train that holds it
SHARED = {"en": "Choose Tools - Options.", "de": "Wählen Sie Extras - Optionen.", "fr": "Choisissez Outils - Options."}


def text(lang: str, module: str, page: int, k: int) -> str:
    pattern, colours = WORDS[lang]
    return pattern.format(c=colours[(page + k) % len(colours)], k=k, p=f"{module[1:]} {page}")


def paragraphs(lang: str, module: str, page: int) -> dict[str, str]:
    """par_id -> text of a page: French has the first paragraph only (its directions are smaller), and its
    second paragraph is left in English (untranslated)."""
    out = {}
    for k in range(PARAGRAPHS):
        if lang == "fr" and k > 1:
            continue
        out[f"par_id{k}"] = text("en" if (lang, k) == ("fr", 1) else lang, module, page, k)
    out["par_id99"] = SHARED[lang]
    return out


# (context, English, {language: translation}) of the UI catalogues: one German only, one left in English by the
# German catalogue (untranslated), one with accelerators, one with a format string in every language (dropped), one
# equal to a paragraph of every page, test pages included, and one new in English and French whose German is that
# paragraph's (both kept out of training), and one whose English is dropped (two accelerators) but still shows
# German's copy of it untranslated
CATALOGUE = [
    ("STR_OPEN", "Open File", {"de": "Datei öffnen", "fr": "Ouvrir le fichier"}),
    ("STR_SAVE", "Save ~As", {"de": "Speichern ~unter", "fr": "Enregistrer ~sous"}),
    ("STR_PREVIEW", "Print Preview", {"de": "Print Preview", "fr": "Aperçu avant impression"}),
    ("STR_CLOSE", "Close Window", {"de": "Fenster schließen"}),
    ("STR_FILES", "%1 files", {"de": "%1 Dateien", "fr": "%1 fichiers"}),
    ("STR_OPTIONS", SHARED["en"], {"de": SHARED["de"], "fr": SHARED["fr"]}),
    ("STR_TOOLS", "Pick the instruments", {"de": SHARED["de"], "fr": "Choisis les instruments"}),
    ("STR_NOW", "Save &As &Now", {"de": "Save As Now", "fr": "Enregistrer maintenant"}),
]


def build_fixture(root: Path, catalogues: bool = True) -> None:
    for lang in LANGS[1:] if catalogues else ():
        entries = [(ctx, en, None, [tr[lang]]) for ctx, en, tr in CATALOGUE if lang in tr]
        write_mo(root / M.catalogue_dir(lang) / "sw.mo", entries)
    for lang in LANGS:
        for module in MODULES:
            for page in range(PAGES):
                body = "\n".join(
                    f'<p id="{pid}" class="paragraph">{t}</p>' for pid, t in paragraphs(lang, module, page).items()
                )
                path = root / M.pages_dir(lang) / module / "01" / f"{page:04d}.html"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(PAGE.format(lang=lang, paragraphs=body), encoding="utf-8")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("lo_multi") / "root"
    build_fixture(r)
    return r


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path_factory.getbasetemp() / "lo_multi_cache"))
    monkeypatch.delenv("KILOLAYER_PARALLEL_ROOT", raising=False)
    monkeypatch.setattr(text_scores, "RESAMPLES", 20)  # the intervals are tested elsewhere; here they cost time


def config(root, train=None, **options):
    options = {"root": str(root), "languages": list(LANGS), "vocab": 200, "val_fraction": 0.2, **options}
    return load_config(
        {
            "model": {
                "arch": "encoder_decoder",
                "layers": 1,
                "decoder_layers": 1,
                "width": 16,
                "heads": 2,
                "ffn": 32,
                "vocab_size": 200,
                "max_len": 48,
            },
            "objective": {"name": "seq2seq"},
            "data": {"name": "lo_multi", "options": options},
            "train": {"steps": 1, **(train or {})},
        }
    )


# ------------------------------------------------------------------ the corpus


def test_held_out_pages_train_in_no_language_and_counts_are_per_language_and_direction(root):
    source = load_source(config(root))
    key, corpus, _ = M.load_corpus(str(root), LANGS, M.LOMultiOptions(**config(root).data.options).model_dump_json())
    held = [p for split in ("validation", "test") for p in corpus[f"{split}_pages"]]
    assert len(held) == 4 and not set(held) & set(corpus["train_pages"])  # one of each per module
    held_texts = set()
    for page in held:
        module, _, name = page.split("/")
        for lang in LANGS:
            held_texts.update(paragraphs(lang, module, int(name[:4])).values())
    train_texts = {t for row in corpus["train"] for t in row if t}
    assert train_texts and not train_texts & held_texts
    # nor in any training pair of any direction, as the model reads it
    for d in range(len(source.directions)):
        for r in source.rows["train"][d]:
            src, tgt = source.pair("train", d, r)
            assert source.detokenize(src) not in held_texts and source.detokenize(tgt) not in held_texts
    record = source.record
    assert record["rows_dropped"]["near_duplicate_across_splits"] == 2 * PAGES - 2  # SHARED, kept on a test page
    assert record["dropped"]["fr"] == {"untranslated": 2 * PAGES}
    train_pages = len(corpus["train_pages"])
    assert record["texts"]["en"]["train"] == record["texts"]["de"]["train"] == PARAGRAPHS * train_pages
    assert record["texts"]["fr"]["train"] == train_pages
    assert record["directions"]["en-de"]["train"] == PARAGRAPHS * train_pages
    assert record["directions"]["fr-en"]["train"] == train_pages
    assert set(record["directions"]) == {f"{s}-{t}" for s in LANGS for t in LANGS if s != t}
    assert f"| `fr` | {train_pages:,} | {train_pages:,} | - |" in M.sizes_table(record)  # fr-en, fr-de


def test_the_vocabulary_samples_languages_at_its_temperature_and_tags_follow_the_specials(root):
    rows = [[f"e{i}", f"d{i}", f"f{i}" if i < 25 else ""] for i in range(100)]
    texts = M.weighted_texts(rows, list(LANGS), 5.0, 0)
    share = [100**0.2, 100**0.2, 25**0.2]  # of the 225 texts: 82, 82, 62 (in proportion to size: 100, 100, 25)
    for lang, q in zip("edf", share):
        assert sum(t.startswith(lang) for t in texts) == round(225 * q / sum(share))
    assert {t for t in texts if t.startswith("f")} == {f"f{i}" for i in range(25)}  # fr's 25 texts, repeated
    source = load_source(config(root))
    assert source.tags == [4, 5, 6] and source.tokenizer.id_to_token(5) == "<2de>"


def test_english_centric_and_listed_directions(root):
    assert load_source(config(root, directions="english_centric")).directions == [
        ("en", "de"),
        ("en", "fr"),
        ("de", "en"),
        ("fr", "en"),
    ]
    assert load_source(config(root, directions=[["de", "fr"]])).directions == [("de", "fr")]


def test_catalogues_add_n_way_ui_strings_to_training_only(root):
    opts = lambda **o: M.LOMultiOptions(**config(root, **o).data.options).model_dump_json()
    _, plain, _ = M.load_corpus(str(root), LANGS, opts())
    key, corpus, record = M.load_corpus(str(root), LANGS, opts(catalogues=True))
    assert {s: corpus[s] for s in ("validation", "test")} == {s: plain[s] for s in ("validation", "test")}
    assert corpus["train"][: len(plain["train"])] == plain["train"]  # the pages' rows first, unchanged
    assert corpus["train"][len(plain["train"]) :] == [
        ["Close Window", "Fenster schließen", ""],
        ["Open File", "Datei öffnen", "Ouvrir le fichier"],
        ["Print Preview", "", "Aperçu avant impression"],
        ["Save As", "Speichern unter", "Enregistrer sous"],
    ]
    ui = record["catalogues"]
    assert ui["dropped"]["de"] == {"format_string": 1, "untranslated": 2}
    assert ui["dropped"]["en"] == {"accelerator": 1, "format_string": 1}
    assert ui["rows_dropped"] == {"fewer_than_two_languages": 2, "near_duplicate_across_splits": 2} and ui["rows"] == 4
    assert (
        ui["texts"] == {"en": 4, "de": 3, "fr": 3}
        and record["texts"] == M.load_corpus(str(root), LANGS, opts())[2]["texts"]
    )
    table = M.sizes_table(load_source(config(root, catalogues=True)).record)
    assert "| UI strings (train) |" in table.splitlines()[0] and "| `de` |" in table and table.count(" 3 |") >= 2
    source = load_source(config(root, catalogues=True, directions=[["de", "fr"]]))
    pairs = {tuple(map(source.detokenize, source.pair("train", 0, r))) for r in source.rows["train"][0]}
    assert {("Datei öffnen", "Ouvrir le fichier"), ("Speichern unter", "Enregistrer sous")} <= pairs  # aligned by key


def test_a_ui_string_contained_in_a_held_out_text_of_its_language_does_not_train(tmp_path):
    """A catalogue's tip that is a test paragraph shortened (German only, 30 or more near-key characters) stays out
    of training; one of fewer characters, or contained in a training text only, trains."""
    root = tmp_path / "root"
    build_fixture(root, catalogues=False)
    opts = lambda **o: M.LOMultiOptions(**config(root, **o).data.options).model_dump_json()
    _, plain, _ = M.load_corpus(str(root), LANGS, opts())
    module, _, name = plain["test_pages"][0].split("/")
    held = text("de", module, int(name[:4]), 0)  # "Male die ... Kiste 0 auf Seite calc 3."
    trained = next(row[1] for row in plain["train"] if row[1].startswith("Male"))
    shortened = lambda t: t.rsplit(" ", 1)[0]  # its last word cut: contained, not equal
    assert len(M.P.near_key(shortened(held))) >= M.CONTAINED
    entries = [
        ("TIP_HELD", "A tip about boxes", shortened(held)),
        ("TIP_SHORT", "Paint boxes", "Male die"),
        ("TIP_TRAINED", "Another tip about boxes", shortened(trained)),
    ]
    write_mo(root / M.catalogue_dir("de") / "sw.mo", [(c, en, None, [de]) for c, en, de in entries])
    write_mo(root / M.catalogue_dir("fr") / "sw.mo", [])
    _, corpus, record = M.load_corpus(str(root), LANGS, opts(catalogues=True))
    ui_rows = corpus["train"][len(plain["train"]) :]
    assert [row[0] for row in ui_rows] == ["Paint boxes", "Another tip about boxes"]  # by context
    assert record["catalogues"]["rows_dropped"] == {"contained_in_held_out": 1}
    assert M.contained(M.P.near_key(shortened(held)), M.P.near_key(held))
    assert not M.contained("male die", "male die rote kiste")  # a label, not a copy


def test_the_corpus_key_follows_the_catalogues_only_when_they_are_read(tmp_path):
    root = tmp_path / "root"
    build_fixture(root)
    versions = {}
    key = lambda **o: M.fingerprint(root, list(LANGS), M.LOMultiOptions(**config(root, **o).data.options), versions)
    before, before_ui = key(), key(catalogues=True)
    assert before != before_ui and key(catalogues=False) == before
    write_mo(root / M.catalogue_dir("fr") / "sw.mo", [("STR_NEW", "New", None, ["Nouveau"])])
    assert key() == before and key(catalogues=True) != before_ui


def test_catalogues_not_fetched_name_the_command(tmp_path):
    bare = tmp_path / "root"
    build_fixture(bare, catalogues=False)
    with pytest.raises(ConfigError) as err:
        load_source(config(bare, catalogues=True))
    assert str(err.value).startswith("data.options.catalogues: the UI catalogues of de, fr (libreoffice-l10n-de ")
    assert f"fetch them with: python -m kilolayer.data.debian fetch lo_multi:de,fr --root {bare}" in str(err.value)
    assert load_source(config(bare))  # without them, the pages alone


# ------------------------------------------------------------------ training


def test_training_draws_every_direction_at_the_temperatures_rate(root, tmp_path):
    from kilolayer.train.run import train

    steps, batch = 150, 32
    cfg = config(root, train={"steps": 3, "batch_size": batch, "eval_every": 3, "eval_batches": 1})
    cfg = cfg.model_dump()
    cfg["train"]["peak_flops"] = 1e12
    cfg["objective"]["options"] = {"decode_samples": 0}  # the batches are the point here, not the scores
    result = train(cfg, tmp_path / "run", quiet=True)
    assert result["status"] == "completed"
    source = load_source(load_config(cfg))
    sizes = source.sizes
    n = steps * batch
    counts = torch.zeros(len(sizes))
    for step in range(steps):  # the batches a run of `steps` steps trains on (a batch is a function of its step)
        b = source.train_batch(step, batch)
        counts += torch.bincount(b["direction"], minlength=len(sizes))
        # each source starts with the tag of its direction's target language
        tags = torch.as_tensor([source.tags[source.index[source.directions[d][1]]] for d in b["direction"].tolist()])
        assert torch.equal(b["src"][:, 0], tags)

    def within(temperature: float) -> bool:
        total = sum(s ** (1 / temperature) for s in sizes)
        for c, s in zip(counts.tolist(), sizes):
            p = s ** (1 / temperature) / total
            if abs(c - n * p) > 4.5 * math.sqrt(n * p * (1 - p)):  # binomial; 4.5 sd: 1 in 100,000 per direction
                return False
        return True

    assert min(sizes) < max(sizes) / 3  # French's directions are small: the temperature matters
    assert within(5.0)
    assert not within(1.0)  # drawn in proportion to size, the small directions would be rarer than seen


# ------------------------------------------------------------------ the tag and the per-direction scores


def oracle(source, wrong: bool):
    """A greedy decoder that writes the reference of the language the tag asks for (``wrong``: of the language that
    is neither the tag's nor the source's)."""
    encoded = source.encoded[source.eval_split]
    by_source = {}
    for r, row in enumerate(encoded):
        for i, ids in enumerate(row):
            if ids:
                by_source[tuple(ids)] = (r, i)
    tag_lang = {t: i for i, t in enumerate(source.tags)}

    def greedy(backbone, src, mask, bos, eos, max_new):
        rows = []
        for ids in (s[~m].tolist() for s, m in zip(src, mask)):
            r, s = by_source[tuple(ids[1:])]
            t = tag_lang[ids[0]]
            if wrong:  # the third language where the row has it, else the source's
                t = next((i for i in range(len(source.languages)) if i not in (s, t) and encoded[r][i]), s)
            rows.append(encoded[r][t] + [eos])
        width = max(map(len, rows))
        return torch.as_tensor([x + [eos] * (width - len(x)) for x in rows])

    return greedy


def test_the_tag_decides_the_output_language_an_oracle_that_reads_it_scores_100(root, monkeypatch):
    from kilolayer.objectives import build_task

    cfg = config(root, directions=[["en", "de"], ["de", "en"], ["en", "fr"]])
    source = load_source(cfg)
    task = build_task(cfg, source).eval()
    batches = list(source.eval_batches(16))
    scores = {}
    for wrong in (False, True):
        monkeypatch.setattr(task.objective, "greedy", oracle(source, wrong))
        task.objective.evaluate(task.backbone, batches)
        scores[wrong] = task.objective.baselines(batches, paired=True)["directions"]
    right, other = scores[False]["directions"], scores[True]["directions"]
    assert set(right) == {"en-de", "de-en", "en-fr"}
    for name in right:
        assert right[name]["model"]["bleu"] == pytest.approx(100) and right[name]["model"]["chrf"] == pytest.approx(100)
        assert other[name]["model"]["bleu"] < 50 and other[name]["model"]["chrf"] < 70
        assert right[name]["tokenize"] == "13a" and {"copy", "nearest"} <= set(right[name])
    averages = scores[False]["averages"]["model"]
    assert averages["into_english"]["directions"] == 1 and averages["out_of_english"]["directions"] == 2
    assert "neither" not in averages and averages["all"]["bleu"] == pytest.approx(100)


def test_a_nearest_search_among_some_texts_answers_with_one_of_them():
    from kilolayer.objectives.baselines import nearest

    corpus = ["red box", "green box", "blue ball", "red ball"]
    assert nearest(corpus, ["red ball", "green box"]) == [3, 1]
    assert nearest(corpus, ["red ball", "green box"], among=[1, 2]) == [2, 1]


def test_bleu_tokenizer_per_target_language_and_chrf_alone_without_one(monkeypatch):
    assert D.bleu_tokenizer("zh-cn") == D.bleu_tokenizer("zh-tw") == "zh"
    assert D.bleu_tokenizer("de") == "13a" and D.bleu_tokenizer("km") is None
    monkeypatch.setattr(D, "usable", lambda tokenize: False)  # MeCab not installed
    assert D.bleu_tokenizer("ja") is None
    table = D.direction_table(
        [("en", "ja"), ("ja", "en")], [0, 1], ["テスト です", "a test"], {"model": ["テスト です", "a test"]}
    )
    assert "bleu" not in table["directions"]["en-ja"]["model"] and table["directions"]["en-ja"]["tokenize"] is None
    assert table["averages"]["model"]["all"] == {
        "chrf": pytest.approx(100),
        "directions": 2,
        "bleu": pytest.approx(0),  # the one direction with BLEU: a two-word sentence has no 4-gram
        "bleu_directions": 1,
    }
    assert "chrF alone" in D.table_lines(table)[1]


def test_evaluate_writes_the_direction_table(root, tmp_path, capsys):
    from kilolayer.train.cli import cmd_evaluate
    from kilolayer.train.run import train

    cfg = config(root, train={"steps": 2, "batch_size": 8, "eval_every": 2, "eval_batches": 1}).model_dump()
    cfg["train"]["peak_flops"] = 1e12
    train(cfg, tmp_path / "run", quiet=True)

    class Args:
        run, split, device, samples = str(tmp_path / "run"), "test", "cpu", 24

    import json

    # the first 24 pairs (3 batches of 8) in the evaluation's order, which takes the 6 directions in turn
    cmd_evaluate(Args)
    part = json.loads((tmp_path / "run" / "scores_test.json").read_text())
    assert part["samples"] == 24 and part["of"] > 24, part["of"]
    from collections import Counter

    from kilolayer.config import load_config
    from kilolayer.data import load_source
    from kilolayer.train.score import for_split

    src = load_source(for_split(load_config(tmp_path / "run" / "config.yaml"), "test"))
    first = Counter(src.direction_names[d] for d, _ in src.eval_items[:24])
    assert len(first) == 6 and {k: r["pairs"] for k, r in part["directions"]["directions"].items()} == first
    assert capsys.readouterr().out.startswith(f"test (24 of {part['of']} samples, ")
    Args.samples = None
    cmd_evaluate(Args)
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "run" / "scores_test.json").read_text())
    assert record["samples"] == part["of"] and "of" not in record
    table = record["directions"]
    assert set(table["directions"]) == {f"{s}-{t}" for s in LANGS for t in LANGS if s != t}
    assert sum(r["pairs"] for r in table["directions"].values()) == record["samples"]
    assert set(table["averages"]["nearest"]) == {"all", "into_english", "out_of_english", "neither"}
    assert "fr-de" in out and "mean into_english" in out


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "options, phrase",
    [
        ({"languages": ["en", "xx"]}, "unknown 'xx'; allowed: ca, cs, da, de"),
        ({"languages": ["de"]}, "is one language"),
        ({"languages": []}, "is no language"),
        ({"languages": ["en", "de", "en"]}, "names a language twice"),
        ({"languages": ["de", "fr"], "directions": "english_centric"}, "has no 'en'"),
        ({"directions": [["en", "ja"]]}, "is not two different languages"),
        ({"languages": ["en", "ja"]}, "fetch it with: python -m kilolayer.data.debian fetch lo_multi:ja --root"),
    ],
)
def test_bad_options_are_one_line_with_exit_code_2(root, options, phrase):
    with pytest.raises(ConfigError) as err:
        load_source(config(root, **options))
    assert phrase in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == 2


def test_sizes_prints_the_table_of_a_config_and_refuses_another_source(root, tmp_path, capsys):
    import yaml

    path = tmp_path / "multi.yaml"
    path.write_text(yaml.safe_dump(config(root).model_dump(mode="json")))
    assert debian.main(["sizes", str(path)]) == 0
    assert "| source \\ target | `en` | `de` | `fr` |" in capsys.readouterr().out
    assert debian.main(["sizes", str(path), "--set", "data.name=de_en"]) == 2
    assert "sizes reads a 'lo_multi' config" in capsys.readouterr().err


def test_fetch_names_the_packages_of_the_languages_after_the_colon():
    sources = debian.fetchable()
    assert debian.packages_of("lo_multi:de,zh-cn", sources) == {
        "libreoffice-help-en-us": "usr/share/libreoffice/help/en-US/text",
        "libreoffice-help-de": "usr/share/libreoffice/help/de/text",
        "libreoffice-help-zh-cn": "usr/share/libreoffice/help/zh-CN/text",
        "libreoffice-l10n-de": "usr/lib/libreoffice/program/resource/de/LC_MESSAGES",
        "libreoffice-l10n-zh-cn": "usr/lib/libreoffice/program/resource/zh_CN/LC_MESSAGES",
    }
    assert len(sources["lo_multi"]) == 34 + 33  # the help of each language, the catalogues of each but English
    assert "allowed: ca, cs" in debian.packages_of("lo_multi:de,xx", sources)
