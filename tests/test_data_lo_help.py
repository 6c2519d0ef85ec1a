"""lo_help: LibreOffice help paragraphs labelled by module. On a fixture in the help's format: the cleaning and
de-duplication rules with their counts, whole pages held out per module, the same split at every call and no text
in two splits, both objectives on the same texts, the chance level, one-line errors; and, where the real package is
extracted, its counts."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from helpers import AMBIGUOUS, REPEATED, SHORT_HEADINGS, build_fixture

from kilolayer.analysis.chance import chance_level
from kilolayer.config import load_config
from kilolayer.data import lo_help as L
from kilolayer.data import load_source
from kilolayer.data import parallel as P
from kilolayer.errors import ConfigError
from kilolayer.objectives import build_task


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(P.ENV_ROOT, raising=False)
    L.load_corpus.cache_clear()
    r = tmp_path / "root"
    build_fixture(r)
    yield r
    L.load_corpus.cache_clear()


def config(root, objective="classification", seed=0, model_len=64, **options):
    options = {"root": str(root), "modules": ["swriter", "scalc", "simpress"], **options}
    return load_config(
        {
            "model": {"arch": "encoder", "input": "tokens", "layers": 1, "width": 32, "heads": 2, "ffn": 64}
            | {"vocab_size": 262, "max_len": model_len},
            "objective": {"name": objective},
            "data": {"name": "lo_help", "options": options},
            "train": {"steps": 0, "seed": seed, "batch_size": 8, "eval_batches": 100},
        }
    )


def split_texts(source) -> dict[str, list[str]]:
    out = {}
    for split in L.SPLITS:
        rows = source.examples(split)
        out[split] = [bytes(source.columns["tokens"][i]).decode() for i in rows]
    return out


def test_cleaning_and_deduplication_counts(root):
    source = load_source(config(root))
    rec = source.record
    assert rec["dropped"] == {"duplicate": 2, "several_modules": 1, "short": SHORT_HEADINGS}
    assert rec["raw"] == {"scalc": 41, "shared": 17, "simpress": 20, "swriter": 42}
    texts = [t for ts in split_texts(source).values() for t in ts]
    assert texts.count(REPEATED) == 1 and AMBIGUOUS not in texts
    assert all("%PRODUCTNAME" not in t for t in texts) and any(t.endswith("of LibreOffice Writer.") for t in texts)
    # shared pages are read (their texts make AMBIGUOUS ambiguous) but are not a class here
    assert not any("shared page" in t for t in texts)
    assert source.classes == ["Writer", "Calc", "Impress"] and source.num_classes == 3


def test_whole_pages_are_held_out_within_each_module(root):
    rec = load_source(config(root, val_fraction=0.2, test_fraction=0.2)).record
    # round(0.2 * pages) pages of each module to test and to validation
    assert rec["pages"] == {
        "swriter": {"train": 6, "validation": 2, "test": 2},
        "scalc": {"train": 6, "validation": 2, "test": 2},
        "simpress": {"train": 3, "validation": 1, "test": 1},
    }
    assert sum(rec["texts"]["swriter"].values()) == 31  # 10 pages x 3 + the repeated sentence once
    source = load_source(config(root, val_fraction=0.2, test_fraction=0.2))
    for split, texts in split_texts(source).items():
        pages = {(t.split()[0], t.split()[2]) for t in texts if " page " in t}
        assert len(pages) == sum(rec["pages"][m][split] for m in rec["pages"])  # every text of a page together


def test_same_split_at_every_call_and_no_text_in_two_splits(root):
    first = split_texts(load_source(config(root)))
    labels = load_source(config(root)).columns["labels"]
    L.load_corpus.cache_clear()  # the second build reads the cache file; a third builds afresh
    again = load_source(config(root, seed=7))
    assert split_texts(again) == first and torch.equal(again.columns["labels"], labels)
    for f in (Path(os.environ["KILOLAYER_CACHE"])).glob("lo_help-*.pt"):
        f.unlink()
    L.load_corpus.cache_clear()
    assert split_texts(load_source(config(root))) == first
    keys = {s: {P.near_key(t) for t in texts} for s, texts in first.items()}
    assert keys["train"] and keys["validation"] and keys["test"]
    assert not keys["train"] & keys["validation"] and not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]


def test_train_size_is_a_stratified_subset_of_train_and_leaves_evaluation_alone(root):
    full = load_source(config(root))
    texts = split_texts(full)
    y = full.columns["labels"][full.examples("train")]
    size = len(texts["train"]) // 2
    sub = load_source(config(root, train_size=size))
    again = load_source(config(root, train_size=size, seed=3))
    kept = split_texts(sub)
    assert kept == split_texts(again)  # the subset depends on split_seed, not the training seed
    assert kept["validation"] == texts["validation"] and kept["test"] == texts["test"]
    assert len(kept["train"]) == size and set(kept["train"]) <= set(texts["train"])
    counts = torch.bincount(sub.columns["labels"][sub.examples("train")], minlength=3)
    share = torch.bincount(y, minlength=3).double() * size / len(y)
    assert ((counts - share).abs() < 1).all()  # each module in proportion (largest remainders)
    other = split_texts(load_source(config(root, train_size=size, split_seed=1)))["train"]
    assert other != kept["train"]
    with pytest.raises(
        ConfigError, match=rf"^data.options.train_size={len(y) + 1}: the training split has {len(y)} texts$"
    ):
        load_source(config(root, train_size=len(y) + 1))
    with pytest.raises(ConfigError, match=r"^data.options.train_size=2: too few texts to keep every module"):
        load_source(config(root, train_size=2))  # three modules


def test_texts_cut_to_the_same_ids_stay_in_the_first_split(root):
    # cut at 12 bytes, every Writer text reads "Writer page " (and Impress ones "Impress page"): those of test
    # stay, the others leave validation and train; Calc's keep their page number and stay
    source = load_source(config(root, max_len=12, model_len=12))
    kept = split_texts(source)
    assert all(len(t.encode()) <= 12 for ts in kept.values() for t in ts)
    assert source.record["repeated_after_cut"] == {"test": 0, "validation": 6, "train": 33}
    ids = {s: {tuple(source.columns["tokens"][i]) for i in source.examples(s)} for s in L.SPLITS}
    assert not ids["train"] & ids["test"] and not ids["validation"] & ids["test"]
    assert not ids["train"] & ids["validation"]


def test_labels_follow_the_module_and_each_split_mixes_modules(root):
    source = load_source(config(root))
    names = dict(zip(source.classes, range(3)))
    for split, texts in split_texts(source).items():
        y = source.columns["labels"][source.examples(split)].tolist()
        for text, label in zip(texts, y):
            if text != REPEATED:
                assert names[text.split()[0]] == label
        assert len(set(y)) == 3  # every module has pages in every split


def test_classification_and_mlm_read_the_same_texts(root):
    batches = {}
    for objective in ("classification", "mlm"):
        cfg = config(root, objective)
        source = load_source(cfg)
        task = build_task(cfg, source)
        batch = source.collate([0, 1, 2], "eval")
        loss, _ = task(source.train_batch(0, 8))
        assert math.isfinite(loss.item())
        batches[objective] = batch
    assert torch.equal(batches["classification"]["tokens"], batches["mlm"]["tokens"])


def test_chance_level_is_the_majority_share_and_label_entropy(root):
    cfg = config(root)
    source = load_source(cfg)
    y = source.columns["labels"][source.examples("validation")]
    p = torch.bincount(y).double() / len(y)
    chance = chance_level(cfg)
    assert chance["accuracy"] == pytest.approx(float(p.max()))
    assert chance["loss"] == pytest.approx(float(-(p[p > 0] * p[p > 0].log()).sum()))


def test_cls_id_goes_first_with_add_cls(root):
    source = load_source(config(root, add_cls=True, model_len=16))
    tokens = source.collate([0, 1], "train")["tokens"]
    assert tokens[:, 0].tolist() == [L.ByteTokenizer.cls_id] * 2 and tokens.shape[1] <= 16


@pytest.mark.parametrize(
    "options, model, message",
    [
        ({"modules": ["swriter", "word"]}, {}, "data.options.modules.1='word': input should be 'sbasic'"),
        ({"modules": ["swriter", "swriter"]}, {}, "data.options.modules: ['swriter', 'swriter'] names a module twice"),
        ({"max_len": 100}, {}, "data.options.max_len=100: longer than model.max_len=64"),
        ({}, {"vocab_size": 200}, "model.vocab_size=200: byte tokens with special ids need at least 262"),
    ],
)
def test_bad_options_give_one_line(root, options, model, message):
    cfg = config(root, **options)
    if model:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update=model)})
    with pytest.raises(ConfigError) as err:
        load_source(cfg)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_missing_package_is_one_line_with_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    L.load_corpus.cache_clear()
    with pytest.raises(ConfigError) as err:
        load_source(config(tmp_path / "none"))
    msg = str(err.value)
    assert "\n" not in msg and L.PACKAGE in msg
    assert f"python -m kilolayer.data.debian fetch lo_help --root {tmp_path / 'none'}" in msg


# ------------------------------------------------------------------ the real package


def real_root() -> Path:
    return Path(os.environ.get(P.ENV_ROOT) or P.default_root())


@pytest.mark.slow
@pytest.mark.skipif(
    not (real_root() / L.TEXT).is_dir(),
    reason="the LibreOffice help is not extracted (python -m kilolayer.data.debian fetch lo_help)",
)
def test_real_package_counts():
    corpus, rec = L.load_corpus(str(real_root()), L.LOHelpOptions().model_dump_json())
    totals = {s: sum(rec["texts"][m][s] for m in rec["texts"]) for s in L.SPLITS}
    # measured with libreoffice-help-en-us 4:7.4.7-1+deb12u14 (docs/data.md, "LibreOffice help by module")
    if rec["packages"] == {L.PACKAGE: "4:7.4.7-1+deb12u14"}:
        assert totals == {"train": 15271, "validation": 1617, "test": 1820}
        assert rec["texts"]["scalc"] == {"train": 5171, "validation": 436, "test": 362}
    else:
        assert totals["train"] > 5_000 and totals["validation"] > 500
    keys = {s: {P.near_key(t) for t in corpus[s]} for s in L.SPLITS}
    assert not keys["train"] & keys["validation"] and not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]
