"""de_en / fr_en: reading the packages' formats (LibreOffice help pages, Ding lines, gettext .mo with contexts
and plurals), the cleaning rules, counts and split hygiene on a fixture in those formats, the BPE vocabulary
trained deterministically, a tiny training run, one-line errors for missing packages; and, where the real
packages are extracted, their counts."""

from __future__ import annotations

import io
import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch
import yaml
from helpers import cli

from kilolayer.config import load_config
from kilolayer.data import cache as C
from kilolayer.data import load_source
from kilolayer.data import parallel as P
from kilolayer.errors import ConfigError, InputError

# ------------------------------------------------------------------ the fixture, in the packages' formats


def write_mo(path: Path, entries: list[tuple[str | None, str, str | None, list[str]]]) -> None:
    """A gettext .mo file as msgfmt writes it: header entry, keys sorted, no hash table.

    Each entry is (context, msgid, msgid_plural, translations)."""
    header = "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n != 1);\n"
    pairs = [(b"", header.encode())]
    for ctx, msgid, plural, forms in entries:
        key = (f"{ctx}\x04" if ctx is not None else "") + msgid + (f"\x00{plural}" if plural else "")
        pairs.append((key.encode(), "\x00".join(forms).encode()))
    pairs.sort()
    n = len(pairs)
    orig_at, trans_at = 28, 28 + 8 * n
    data_at = 28 + 16 * n
    blob, orig, trans = b"", [], []
    for key, _ in pairs:
        orig.append((len(key), data_at + len(blob)))
        blob += key + b"\x00"
    for _, value in pairs:
        trans.append((len(value), data_at + len(blob)))
        blob += value + b"\x00"
    head = struct.pack("<7I", 0x950412DE, 0, n, orig_at, trans_at, 0, data_at)
    table = b"".join(struct.pack("<2I", *e) for e in orig) + b"".join(struct.pack("<2I", *e) for e in trans)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + table + blob)


HELP_PAGE = """<!DOCTYPE html>
<html lang="{lang}" dir="ltr"><head><meta charset="utf-8"><title>{title}</title>
<script type="text/javascript">var par_id = "not text";</script></head>
<body><div id="DisplayArea" itemprop="softwareHelp">
<a name="bm_id1"></a>
<h1 id="hd_id{n}01" dir="auto">{title}</h1>
<p id="par_id{n}02" class="paragraph" dir="auto">{body}</p>
{extra}
<div class="embedded"><p id="par_id999" class="paragraph">{shared}</p></div>
</div></body></html>
"""
WORDS_EN = ["red", "green", "blue", "yellow", "black", "white", "brown", "grey", "pink", "violet"]
WORDS_DE = ["rote", "grüne", "blaue", "gelbe", "schwarze", "weiße", "braune", "graue", "rosa", "violette"]
SHARED = (
    'Choose <span class="emph">Tools - Options</span>.',
    'Wählen Sie <span class="emph">Extras - Optionen</span>.',
)
SWITCH = (
    '<p id="par_id7" class="paragraph"><span class="switchinline"><span hidden="true" class="MAC">Command'
    '</span><span hidden="true">Ctrl</span></span>+F7 opens the <a href="x.html">thesaurus</a> &amp; more.</p>',
    '<p id="par_id7" class="paragraph"><span class="switchinline"><span hidden="true" class="MAC">Befehl'
    '</span><span hidden="true">Strg</span></span>+F7 öffnet den <a href="x.html">Thesaurus</a> &amp; mehr.</p>',
)
DING = """# Version :: devel 2023-01-30
# License :: GPL Version 2 or later; GNU General Public License
Abholung {f}; Abholen {n} (von jdm./etw.) | Abholung der Waren am Bahnhof | Die Ware liegt zur Abholung bereit. \
:: collection; pick-up (of sb./sth.) | collection of the goods from the station | The goods are ready for collection.
Aufenthalt {m} | Er ist unbekannten Aufenthalts. [adm.] | Wir bleiben nur kurz.; Wir bleiben nicht lange. \
:: whereabouts | His present whereabouts are unknown. | We are staying only briefly.
zurückgeben {vt} | Er gibt jdm. etw. zurück. :: to give back | He gives sth. back to sb.
Hund {m} | Hunde {pl} :: dog | dogs
"""
CATALOGUE = [
    ("menu|open", "~Open...", None, ["Ö~ffnen..."]),  # LibreOffice accelerator: kept without it
    ("dlg|label", "Save _As", None, ["Speichern _unter"]),  # GTK accelerator: kept without it
    (None, "Drag && Drop", None, ["Ziehen && Ablegen"]),  # && is a literal &: kept
    (None, "Insert %1 rows", None, ["%1 Zeilen einfügen"]),  # format_string
    (None, "Delete %s?", None, ["%s löschen?"]),  # format_string
    (None, "Value {0} is used", None, ["Wert {0} ist belegt"]),  # format_string
    (None, "<b>Warning</b> ahead", None, ["<b>Warnung</b> voraus"]),  # markup
    (None, "OK", None, ["OK"]),  # identical
    (None, "12345", None, ["12345"]),  # no_letter
    (None, "open_file_dialog", None, ["datei_oeffnen_dialog"]),  # accelerator (ambiguous)
    (None, "Page", "Pages", ["Seite", "Seiten"]),  # plural: two pairs
    (None, "%d file", "%d files", ["%d Datei", "%d Dateien"]),  # plural, both format_string
    ("a", "Copy", None, ["Kopieren"]),  # two contexts, one text: kept once (duplicate)
    ("b", "Copy", None, ["Kopieren"]),
    (None, "This is an extremely long English label for a short word", None, ["Kurz"]),  # ratio
    ("x", "%PRODUCTNAME Writer", None, ["%PRODUCTNAME Writer-Dokument"]),  # -> LibreOffice
]
GCC = [(None, "no input files", None, ["keine Eingabedateien"]), (None, "missing %qs", None, ["%qs fehlt"])]
N_PAGES = 10
N_DING = 12  # generated sentence lines besides the four above
VERSIONS = {
    "libreoffice-help-en-us": "4:7.4.7-1+deb12u14",
    "libreoffice-help-de": "4:7.4.7-1+deb12u14",
    "libreoffice-l10n-de": "4:7.4.7-1+deb12u14",
    "gcc-12-locales": "12.2.0-14+deb12u1",
    "trans-de-en": "1.9-6",
}


def build_fixture(root: Path) -> None:
    help_dir = root / P.HELP
    for n in range(N_PAGES):
        for lang, words, shared in (("en-US", WORDS_EN, SHARED[0]), ("de", WORDS_DE, SHARED[1])):
            en = lang == "en-US"
            # pages 3 and 4 share a title: one pair, kept once
            title = (
                ("General" if en else "Allgemein")
                if n in (3, 4)
                else (f"The {words[n]} page" if en else f"Die {words[n]} Seite")
            )
            body = f"Paints the {words[n]} shape." if en else f"Malt die {words[n]} Form."
            extra = ""
            if n == 0:
                extra = SWITCH[0] if en else SWITCH[1]
                # only in English: no pair; the same in both: untranslated
                extra += '<p id="par_id8">Only here.</p>' if en else ""
                extra += '<p id="par_id9">LibreOffice Calc</p>'
            page = HELP_PAGE.format(lang=lang, n=n, title=title, body=body, extra=extra, shared=shared)
            path = help_dir / lang / "text" / "shared" / f"page{n:02d}.html"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(page, encoding="utf-8")
    ding = DING + "".join(
        f"Satz {i} {{m}} | Das ist Satz Nummer {i} im Test. :: sentence {i} | This is sentence number {i} in the test."
        "\n"
        for i in range(N_DING)
    )
    (root / P.DING).parent.mkdir(parents=True, exist_ok=True)
    (root / P.DING).write_text(ding, encoding="utf-8")
    write_mo(root / P.LO_MO.format(lang="de") / "sw.mo", CATALOGUE)
    write_mo(root / P.GCC_MO.format(lang="de") / "gcc-12.mo", GCC)
    (root / "kilolayer-packages.json").write_text(json.dumps(VERSIONS))


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(P.ENV_ROOT, raising=False)
    P.load_corpus.cache_clear()
    r = tmp_path / "root"
    build_fixture(r)
    yield r
    P.load_corpus.cache_clear()


def config(root, name="de_en", vocab=120, max_len=64, **options):
    options = {"root": str(root), "vocab": vocab, "valid_percent": 25, "test_percent": 25, **options}
    return load_config(
        {
            "model": {
                "arch": "encoder_decoder",
                "layers": 1,
                "decoder_layers": 1,
                "width": 32,
                "heads": 2,
                "ffn": 64,
                "vocab_size": vocab,
                "max_len": max_len,
            },
            "objective": {"name": "seq2seq"},
            "data": {"name": name, "options": options},
            "train": {"steps": 1},
        }
    )


# ------------------------------------------------------------------ the formats


def test_mo_reader_gives_contexts_plurals_and_skips_the_header(tmp_path):
    path = tmp_path / "x.mo"
    write_mo(path, CATALOGUE)
    entries = P.read_mo(path)
    assert len(entries) == len(CATALOGUE)  # the header (empty msgid) is not an entry
    by_id = {(c, m): (p, f) for c, m, p, f in entries}
    assert by_id[("menu|open", "~Open...")] == (None, ["Ö~ffnen..."])
    assert by_id[(None, "Page")] == ("Pages", ["Seite", "Seiten"])
    pairs = P.mo_pairs(path)
    assert ("Seite", "Page") in pairs and ("Seiten", "Pages") in pairs
    assert pairs.count(("Kopieren", "Copy")) == 2  # one per context
    # big-endian files read the same
    data = path.read_bytes()
    n = struct.unpack("<I", data[8:12])[0]
    words = struct.unpack(f"<{7 + 4 * n}I", data[: 4 * (7 + 4 * n)])
    big = tmp_path / "big.mo"
    big.write_bytes(struct.pack(f">{len(words)}I", *words) + data[4 * len(words) :])
    assert P.read_mo(big) == entries
    cut = tmp_path / "cut.mo"
    cut.write_bytes(data[: len(data) - 20])
    with pytest.raises(InputError, match=r"cut.mo: truncated .mo file \(entry \d+ points past the end\)$"):
        P.read_mo(cut)
    text = tmp_path / "x.txt"
    text.write_text("x" * 40)
    with pytest.raises(InputError, match="x.txt: not a .mo file"):
        P.read_mo(text)


def test_help_page_paragraphs_take_the_default_variant_and_the_text_of_links():
    page = HELP_PAGE.format(lang="en-US", n=1, title="Title", body="Body <b>bold</b>.", extra=SWITCH[0], shared="S")
    got = P.help_paragraphs_from_text(page)
    assert got == {
        "hd_id101": "Title",
        "par_id102": "Body bold.",
        "par_id7": "Ctrl+F7 opens the thesaurus & more.",
        "par_id999": "S",
    }


def test_ding_line_pairs_sub_entries_by_position_and_keeps_sentences_only():
    lines = DING.splitlines()
    assert P.ding_sentences(lines[0]) == []  # a comment
    assert P.ding_sentences(lines[2]) == [
        ("Die Ware liegt zur Abholung bereit.", "The goods are ready for collection.")
    ]
    # annotations removed, the first of ';' alternatives
    assert P.ding_sentences(lines[3]) == [
        ("Er ist unbekannten Aufenthalts.", "His present whereabouts are unknown."),
        ("Wir bleiben nur kurz.", "We are staying only briefly."),
    ]
    assert P.ding_sentences(lines[4]) == []  # placeholders jdm./etw./sth./sb.
    assert P.ding_sentences(lines[5]) == []  # words, not sentences


@pytest.mark.parametrize(
    "src, tgt, catalogue, expected",
    [
        ("Ö~ffnen...", "~Open...", True, ("Öffnen...", "Open...")),
        ("Speichern _unter", "Save _As", True, ("Speichern unter", "Save As")),
        ("Ziehen && Ablegen", "Drag && Drop", True, ("Ziehen & Ablegen", "Drag & Drop")),
        ("datei_oeffnen_dialog", "open_file_dialog", True, "accelerator"),
        ("%1 Zeilen", "%1 rows", False, "format_string"),
        ("%1$s von %2$s", "%1$s of %2$s", False, "format_string"),
        ("%-10s Name", "%-10s name", False, "format_string"),
        ("Wert {0}", "Value {0}", False, "format_string"),
        ("Pfad $(ARG1)", "Path $(ARG1)", False, "format_string"),
        ("100% sicher", "100% sure", False, ("100% sicher", "100% sure")),  # a percent sign, not a format
        ("<b>Warnung</b>", "<b>Warning</b>", False, "markup"),
        ("A &amp; B", "A &amp; B", False, "markup"),
        ("OK", "ok", False, "identical"),
        ("Hallo, Welt!", "Hallo Welt", False, "identical"),  # punctuation and case ignored
        ("123", "123", False, "no_letter"),
        ("x", "y", False, "length"),
        ("Kurz", "This is an extremely long English label", False, "ratio"),
        ("%PRODUCTNAME  Writer", "%PRODUCTNAME\tWriter", False, "identical"),
        ("%PRODUCTNAME Hilfe", "%PRODUCTNAME Help", False, ("LibreOffice Hilfe", "LibreOffice Help")),
        ("Ｆｕｌｌ Breite", "Full  width", False, ("Full Breite", "Full width")),  # NFKC, spaces collapsed
    ],
)
def test_cleaning_rules(src, tgt, catalogue, expected):
    assert P.clean_pair(src, tgt, P.ParallelOptions(), catalogue=catalogue) == expected


# ------------------------------------------------------------------ counts and split hygiene


def test_counts_versions_and_split_hygiene_on_the_fixture(root):
    s = load_source(config(root))
    rec = s.record
    assert rec["packages"] == VERSIONS
    # raw: 10 pages x (title, body, shared) + page 0's switched and untranslated paragraphs (its English-only one
    # has no pair); Ding: 3 sentences + 12; catalogues: 16 entries + 2 plural forms, 2 gcc entries
    assert rec["raw"] == {"help": 32, "ding": 15, "mo": 20}
    # %1, %s, {0}, both forms of '%d file(s)', gcc's %qs ('%PRODUCTNAME Writer' is kept as 'LibreOffice Writer')
    assert rec["dropped"]["format_string"] == 6
    assert rec["dropped"]["markup"] == 1 and rec["dropped"]["accelerator"] == 1
    assert rec["dropped"]["identical"] == 2 and rec["dropped"]["no_letter"] == 1 and rec["dropped"]["ratio"] == 1
    # distinct pairs: help 10 bodies + 9 titles + shared + switched = 21; Ding 15; catalogues: Open, Save As,
    # Drag & Drop, Page, Pages, Copy, LibreOffice Writer, no input files = 8
    total = {kind: sum(rec["pairs"][kind].values()) for kind in ("help", "ding", "mo")}
    assert total == {"help": 21, "ding": 15, "mo": 8}
    # the shared paragraph 9 times, the repeated title, Copy in its second context
    assert rec["dropped"]["duplicate"] + rec["dropped"]["near_duplicate_across_splits"] == 11
    assert rec["pairs"]["mo"]["validation"] == rec["pairs"]["mo"]["test"] == 0  # catalogues are train only
    assert all(rec["pairs"][k][s] > 0 for k in ("help", "ding") for s in ("train", "test"))
    # the record lies beside the cached data
    saved = json.loads((Path(os.environ["KILOLAYER_CACHE"]) / f"{rec['key']}.json").read_text())
    assert saved["pairs"] == rec["pairs"] and saved["packages"] == VERSIONS

    corpus = P.load_corpus("de_en", str(root), P.ParallelOptions(**config(root).data.options).model_dump_json())[1]
    # a help page's pairs all sit in the split its file hashes to
    for n in range(N_PAGES):
        split = P.split_of(
            "help", f"text/shared/page{n:02d}.html", P.ParallelOptions(valid_percent=25, test_percent=25)
        )
        body = f"Paints the {WORDS_EN[n]} shape."
        assert [sp for sp in P.SPLITS if any(t == body for _, t in corpus[sp])] == [split]
    # the shared paragraph is kept once, in the first of test, validation, train that holds one of its pages
    splits = {
        P.split_of("help", f"text/shared/page{n:02d}.html", P.ParallelOptions(valid_percent=25, test_percent=25))
        for n in range(N_PAGES)
    }
    first = next(sp for sp in ("test", "validation", "train") if sp in splits)
    assert [sp for sp in P.SPLITS for _, t in corpus[sp] if t == "Choose Tools - Options."] == [first]
    # no near-duplicate across splits, on either side
    for side in (0, 1):
        keys = {sp: {P.near_key(p[side]) for p in corpus[sp]} for sp in P.SPLITS}
        assert not keys["train"] & keys["test"] and not keys["train"] & keys["validation"]
        assert not keys["validation"] & keys["test"]
    assert ["Öffnen...", "Open..."] in corpus["train"] and ["Ziehen & Ablegen", "Drag & Drop"] in corpus["train"]
    # the source: ids round-trip to the cleaned text, batches follow the seq2seq contract
    assert s.bos == P.BOS and s.eos == P.EOS and s.pad == P.PAD
    assert all(P.EOS not in ids for _, ids in s.splits["test"])
    for (_, tgt), (_, ids) in zip(corpus["test"], s.splits["test"]):
        assert s.detokenize(ids + [P.EOS, 7, 8]) == tgt
    b = s.collate([0, 1], "eval")
    assert (b["tgt_in"][:, 0] == P.BOS).all() and set(b) == {
        "src",
        "src_padding_mask",
        "tgt_in",
        "tgt_out",
        "tgt_padding_mask",
    }


def test_fr_en_reads_no_dictionary_and_names_its_own_packages(root):
    with pytest.raises(ConfigError) as err:
        load_source(config(root, name="fr_en"))
    msg = str(err.value)
    assert "libreoffice-help-fr" in msg and "libreoffice-l10n-fr" in msg and "trans-de-en" not in msg
    with pytest.raises(ConfigError, match="sources: fr_en has no ding text"):
        load_source(config(root, name="fr_en", sources=["ding"]))


def test_long_pairs_are_left_out_by_token_length(root):
    s = load_source(config(root, max_len=12))
    assert sum(s.record["too_long"].values()) > 0
    assert all(len(a) <= 11 and len(b) <= 11 for sp in P.SPLITS for a, b in s.splits[sp])
    with pytest.raises(ConfigError, match=r"^model.max_len=2: every de_en pair of a split is longer than 1 tokens$"):
        load_source(config(root, max_len=2))


# ------------------------------------------------------------------ the vocabulary


def test_bpe_vocabulary_is_deterministic_and_follows_the_training_split(root, tmp_path, monkeypatch):
    files = []
    for k, seed in enumerate((0, 0, 1)):
        monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / f"cache{k}"))
        P.load_corpus.cache_clear()
        s = load_source(config(root, split_seed=seed))
        (path,) = (tmp_path / f"cache{k}").glob("*-bpe3-*.json")
        files.append(path.read_bytes())
        assert s.vocab_size <= 120
        vocab = json.loads(files[-1])["model"]["vocab"]
        assert [vocab[t] for t in P.SPECIALS] == [0, 1, 2, 3]
    assert files[0] == files[1]  # same packages and split seed: byte-identical
    assert files[0] != files[2]  # another split seed trains on other pairs
    # a second load reads the cached file instead of training again
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache0"))
    P.load_corpus.cache_clear()
    (path,) = (tmp_path / "cache0").glob("*-bpe3-*.json")
    path.write_text(path.read_text())
    before = path.stat().st_mtime_ns
    load_source(config(root))
    assert path.stat().st_mtime_ns == before


def _damage(path: Path, change) -> None:
    """Rewritten by torch.save alone, without the checksum: what the content says is what must be caught."""
    data = torch.load(path, weights_only=True)
    data.pop(C.DIGEST_KEY)
    change(data)
    torch.save(data, path)


def _middle(data: dict, split: str, value) -> None:
    data[split][len(data[split]) // 2] = value


def _negative_lengths(d: dict) -> None:
    lengths = d["train_src_len"]
    lengths[0] += lengths[1] + 1  # the lengths still add up
    lengths[1] = -1


def _flip_byte(path: Path) -> None:
    # a damaged file header
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0xFF
    path.write_bytes(bytes(raw))


def _flip_data_bit(path: Path) -> None:
    # one bit inside the largest tensor's data: torch.load reads it without complaint, the checksum does not
    data = torch.load(path, weights_only=True)
    key = max((k for k, v in data.items() if isinstance(v, torch.Tensor)), key=lambda k: data[k].nbytes)
    raw, body = bytearray(path.read_bytes()), data[key].numpy().tobytes()
    at = raw.find(body)
    assert at > 0 and raw.count(body) == 1
    raw[at + len(body) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    assert not torch.equal(torch.load(path, weights_only=True)[key], data[key])


@pytest.mark.parametrize(
    ("entry", "change", "why"),
    [
        ("ids", lambda d: d["train_src_len"].__setitem__(0, d["train_src_len"][0] + 1), "does not add up"),
        ("ids", lambda d: d.pop("test_tgt"), "no 'test_tgt'"),
        ("ids", lambda d: d.__setitem__("validation_tgt", d["validation_tgt"].float()), "expected int32"),
        ("ids", lambda d: d["train_tgt"].__setitem__(0, 10_000), "ids outside [0, "),
        ("ids", lambda d: d["train_tgt"].__setitem__(0, -3), "ids outside [0, "),
        ("ids", _negative_lengths, "a negative length"),
        (
            "ids",  # the last train pair dropped on both sides, consistently
            lambda d: (
                [d.__setitem__(k, d[k][: -int(d[k + "_len"][-1])]) for k in ("train_src", "train_tgt")]
                + [d.__setitem__(k, d[k][:-1]) for k in ("train_src_len", "train_tgt_len")]
            ),
            "the corpus",
        ),
        ("corpus", lambda d: d.__setitem__("train", [[1, 2]]), "expected [source, target] strings"),
        ("corpus", lambda d: _middle(d, "train", [1, 2]), "expected [source, target] strings"),
        ("corpus", lambda d: _middle(d, "test", None), "expected [source, target] strings"),
        ("corpus", lambda d: d.pop("stats"), "no 'stats'"),
        ("corpus", lambda d: d.__setitem__("stats", {"raw": {}}), "'stats' has no 'pairs', 'dropped'"),
        ("corpus", "flip", "unreadable"),
        ("ids", "flip", "unreadable"),
        ("ids", "bit", "does not match its SHA-256 checksum"),
    ],
)
def test_a_damaged_cache_is_rebuilt_with_a_warning(root, capsys, entry, change, why):
    first = load_source(config(root))
    cache = Path(os.environ["KILOLAYER_CACHE"])
    key = first.record["key"]
    (path,) = [p for p in cache.glob(f"{key}*.pt") if p.stem.endswith("-ids") == (entry == "ids")]
    corpus_file = cache / f"{key}.pt"
    before = corpus_file.read_bytes()
    if change == "flip":
        _flip_byte(path)
    elif change == "bit":
        _flip_data_bit(path)
    else:
        _damage(path, change)
    if entry == "corpus":
        # without the tokenizer and the ids, the corpus is read to build them: nothing downstream hides it
        for p in [*cache.glob(f"{key}-*.json"), *cache.glob(f"{key}-*-ids.pt")]:
            p.unlink()
    P.load_corpus.cache_clear()
    capsys.readouterr()
    again = load_source(config(root))
    err = capsys.readouterr().err
    assert f"{path}: cache file" in err and why in err and "replacing it" in err, err
    assert again.splits == first.splits and again.record == first.record  # the same pairs, ids and counts
    assert corpus_file.read_bytes() == before or entry == "corpus"
    if entry == "corpus":
        assert torch.load(corpus_file, weights_only=True) == torch.load(io.BytesIO(before), weights_only=True)
    P.load_corpus.cache_clear()
    load_source(config(root))
    assert "cache file" not in capsys.readouterr().err  # the rebuilt file is read back without a word


def test_ids_belong_to_their_tokenizer(root):
    # another tokenizer (another tokenizers version retraining from the same texts) never reads these ids
    first = load_source(config(root))
    cache = Path(os.environ["KILOLAYER_CACHE"])
    (ids,) = cache.glob("*-ids.pt")
    (tok,) = cache.glob("*-bpe3-*.json")
    data = json.loads(tok.read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(t for t in vocab if vocab[t] > 3)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same size, other ids
    tok.write_text(json.dumps(data))
    P.load_corpus.cache_clear()
    again = load_source(config(root))
    assert len(list(cache.glob("*-ids.pt"))) == 2 and ids.is_file()  # a second entry, the first untouched
    assert again.vocab_size == first.vocab_size and again.splits != first.splits


def test_vocabulary_bigger_than_the_model_is_one_line(root):
    cfg = config(root)
    cfg.model.vocab_size = 10
    with pytest.raises(ConfigError, match=r"^model.vocab_size=10: data.name='de_en' has \d+ BPE ids"):
        load_source(cfg)


# ------------------------------------------------------------------ training


def test_tiny_training_lowers_validation_loss_with_a_finite_bleu(root, tmp_path):
    from kilolayer.train.run import train

    cfg = config(root).model_dump()
    # peak_flops given: MFU needs no measurement of this machine in the private cache
    cfg["train"].update(
        steps=60, batch_size=8, lr=3e-3, warmup=10, eval_every=30, eval_batches=2, log_every=10, peak_flops=1e12
    )
    train(cfg, tmp_path / "run", quiet=True)
    evals = [
        r
        for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if r["split"] == "eval"
    ]
    assert len(evals) >= 2
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.5
    assert math.isfinite(evals[-1]["bleu"]) and 0 <= evals[-1]["bleu"] <= 100


def test_bleu_is_scored_on_detokenized_text_and_a_perfect_decoder_scores_100(root, monkeypatch):
    # an oracle decoder that returns each reference's ids: BLEU and chrF 100 and exact match 1, and what sacrebleu
    # saw is the corpus text (detokenized BPE: no word-boundary marks, no ids)
    from kilolayer.objectives import build_task
    from kilolayer.objectives import seq2seq as S

    cfg = config(root)
    cfg.objective.options = {"decode_samples": 8}
    source = load_source(cfg)
    task = build_task(cfg, source)
    batches = list(source.eval_batches(4, 8))
    queue = [b["tgt_out"].masked_fill(b["tgt_padding_mask"], source.eos) for b in batches]
    monkeypatch.setattr(task.objective, "greedy", lambda *a, **k: queue.pop(0))
    seen = {}
    real = S.text_scores
    monkeypatch.setattr(S, "text_scores", lambda hyps, refs: seen.update(hyps=hyps) or real(hyps, refs))
    out = task.objective.evaluate(task.backbone, batches)
    assert out["bleu"] == pytest.approx(100.0) and out["chrf"] == pytest.approx(100.0) and out["exact_match"] == 1.0
    assert len(seen["hyps"]) == 8
    for h in seen["hyps"]:
        assert h and "\u2581" not in h and not h.replace(" ", "").isdigit(), h


# ------------------------------------------------------------------ missing packages


def test_missing_packages_are_one_line_naming_them_and_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as err:
        load_source(config(empty))
    msg = str(err.value)
    assert "\n" not in msg and f"under {empty}" in msg
    for package in VERSIONS:
        assert package in msg
    assert f"python -m kilolayer.data.debian fetch de_en --root {empty}" in msg
    # only the packages a chosen source needs
    with pytest.raises(ConfigError) as err:
        load_source(config(empty, sources=["ding"]))
    assert "trans-de-en" in str(err.value) and "libreoffice" not in str(err.value)


@pytest.mark.integration
def test_cli_exits_non_zero_with_one_line_when_packages_are_missing(tmp_path):
    cfg = config(tmp_path / "nothing").model_dump()
    cfg["data"]["options"].pop("root")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "KILOLAYER_CACHE": str(tmp_path / "cache"), P.ENV_ROOT: str(tmp_path / "nothing")}
    r = cli("train", path, "--out", tmp_path / "run", env=env)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kilolayer: error: data.name='de_en': the Debian packages")
    assert str(tmp_path / "nothing") in lines[0]


# ------------------------------------------------------------------ the real packages


def real_root() -> Path:
    return Path(os.environ.get(P.ENV_ROOT) or P.default_root())


@pytest.mark.slow
@pytest.mark.skipif(
    not all((real_root() / m).exists() for m in P.all_packages("de_en").values()),
    reason="the de_en packages are not extracted (python -m kilolayer.data.debian fetch de_en)",
)
def test_real_packages_counts_and_hygiene():
    root = str(real_root())
    opts = P.ParallelOptions()
    _, corpus, rec = P.load_corpus("de_en", root, opts.model_dump_json())
    # measured on Debian 12 with the versions below (docs/data.md, "Translation: de_en and fr_en")
    if rec["packages"] == {
        "libreoffice-help-en-us": "4:7.4.7-1+deb12u14",
        "libreoffice-help-de": "4:7.4.7-1+deb12u14",
        "trans-de-en": "1.9-6",
        "libreoffice-l10n-de": "4:7.4.7-1+deb12u14",
        "gcc-12-locales": "12.2.0-14+deb12u1",
    }:
        assert rec["pairs"] == {
            "help": {"train": 27853, "validation": 1350, "test": 2230},
            "ding": {"train": 17814, "validation": 616, "test": 1052},
            "mo": {"train": 17332, "validation": 0, "test": 0},
        }
    else:
        assert 40_000 < rec["total"]["train"] < 90_000 and rec["total"]["test"] > 2_000
    for side in (0, 1):
        keys = {sp: {P.near_key(p[side]) for p in corpus[sp]} for sp in P.SPLITS}
        assert not keys["train"] & keys["test"] and not keys["train"] & keys["validation"]
        assert not keys["validation"] & keys["test"]


# ------------------------------------------------------------------ the deepnet_mt studies


@pytest.mark.parametrize(
    "name, depths, points", [("deepnet_mt", [6, 18, 50, 100], 24), ("deepnet_mt_slice", [6, 18], 12)]
)
def test_deepnet_mt_studies_compare_three_schemes_at_one_lr_and_warmup(name, depths, points):
    from kilolayer.study.spec import expand, load_spec

    pts = expand(load_spec(name))
    assert len(pts) == points
    cfgs = [p.config for p in pts]
    assert {c.model.scheme for c in cfgs} == {"post_ln", "pre_ln", "deepnorm"}
    assert sorted({(c.model.layers, c.model.decoder_layers) for c in cfgs}) == [(d, d) for d in depths]
    assert {c.train.seed for c in cfgs} == {0, 1}
    assert len({(c.train.lr, c.train.warmup, c.train.schedule, c.train.steps) for c in cfgs}) == 1
    assert all(c.data.name == "de_en" and c.objective.name == "seq2seq" and c.train.patience > 0 for c in cfgs)
    assert all(c.model.vocab_size == c.data.options["vocab"] for c in cfgs)


def test_deepnet_mt_depth_compares_post_ln_and_deepnorm_at_two_depths_one_lr_and_warmup():
    from kilolayer.study.spec import expand, load_spec

    spec = load_spec("deepnet_mt_depth")
    cfgs = [p.config for p in expand(spec)]
    assert len(cfgs) == 6 and {c.model.scheme for c in cfgs} == {"post_ln", "deepnorm"}
    # 18L-18L decides (2 seeds); 6L-6L is the control: a failure at 18L-18L that 6L-6L does not share is depth's
    deep = {(c.model.layers, c.model.decoder_layers, c.train.seed) for c in cfgs}
    assert deep == {(18, 18, 0), (18, 18, 1), (6, 6, 0)}
    assert {(c.train.lr, c.train.warmup, c.train.steps, c.train.batch_size) for c in cfgs} == {(2e-3, 400, 800, 32)}
    assert all(c.data.name == "de_en" and c.train.patience > 0 for c in cfgs)
    # the loss verdict and the first-update verdict: the depth contrast on real data
    assert [c.name for c in spec.claims] == ["deepnet_postln", "deepnet_update"] and spec.findings == []
