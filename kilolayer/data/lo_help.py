"""``lo_help``: which LibreOffice module a paragraph of its English help comes from (sequence classification on
real text, and the same texts for masked-token prediction).

The help pages are those of the Debian package ``libreoffice-help-en-us``, read from the folder the ``de_en`` and
``fr_en`` sources use (``data.options.root``, else ``$KILOLAYER_PARALLEL_ROOT``, else the cache), which
``python -m kilolayer.data.debian fetch lo_help`` fills. A page's module is the first folder of its path under
``help/en-US/text`` (``swriter`` is Writer); a sample is one paragraph or heading of a page (the elements with a
``par_id``/``hd_id``, as :func:`kilolayer.data.parallel.help_paragraphs` reads them).

Texts are cleaned (``%PRODUCTNAME`` -> LibreOffice, NFKC, whitespace collapsed) and kept when they hold a letter
and at least ``min_chars`` characters. Then, over the pages of *every* module (``shared`` included, whether or not
it is among ``modules``), texts are compared by :func:`kilolayer.data.parallel.near_key` (lower-cased letters and
digits): a text found under two modules has no single label and is dropped; one repeated within a module is kept
once, on the first page (in path order) that holds it. Whole pages are then held out: within each module, pages
sorted by a hash of (``split_seed``, path) give their first ``test_fraction`` to test and the next
``val_fraction`` to validation (at least one page each where a module has three or more). So no text is in two
splits, the split depends on nothing but the package and these options, and every module has pages in every
split.

Tokens are UTF-8 bytes with the special ids of :mod:`kilolayer.data.vocab` (``model.vocab_size`` at least 262),
``[CLS]`` first with ``add_cls``, cut at ``max_len`` ids (default ``model.max_len``); a sample whose cut ids equal
those of a sample of a split ranked before its own (test, then validation, then train) is left out. ``train_size``
keeps a stratified subset of the training texts (each module in proportion; drawn with ``split_seed``). Batches:
``{"tokens", "padding_mask", "labels"}``. See docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from kilolayer.config import Config
from kilolayer.data import parallel
from kilolayer.data.base import register_source
from kilolayer.data.cache import TensorOf, cached
from kilolayer.data.memory import SPLITS, MemorySource, SplitOptions, stratified_subset
from kilolayer.data.options import parse_options
from kilolayer.data.packages import package_versions
from kilolayer.data.text import ByteTokenizer, check_vocab, encode_all
from kilolayer.errors import ConfigError, InputError

FORMAT = 1  # bump when reading, cleaning or splitting changes what a build gives
PACKAGE = "libreoffice-help-en-us"
TEXT = f"{parallel.HELP}/en-US/text"
PACKAGES = {PACKAGE: TEXT}  # what ``python -m kilolayer.data.debian fetch lo_help`` extracts
# the module folders of the help, with the application each documents
MODULES = {
    "sbasic": "Basic",
    "scalc": "Calc",
    "schart": "Chart",
    "sdatabase": "Base",
    "sdraw": "Draw",
    "shared": "shared",
    "simpress": "Impress",
    "smath": "Math",
    "swriter": "Writer",
}
Module = Literal["sbasic", "scalc", "schart", "sdatabase", "sdraw", "shared", "simpress", "smath", "swriter"]
# ``shared`` holds what every application shows (menus, dialogs, options): not one module's text
DEFAULT_MODULES = [m for m in MODULES if m != "shared"]


class LOHelpOptions(SplitOptions):
    root: str | None = Field(None, description=f"extracted packages; default ${parallel.ENV_ROOT}, else the cache")
    modules: list[Module] = Field(default_factory=lambda: list(DEFAULT_MODULES), min_length=2)
    min_chars: int = Field(20, ge=1, description="shorter texts (most are headings such as 'Example') are dropped")
    max_len: int | None = Field(None, ge=2, description="ids per sample, [CLS] included; default model.max_len")
    add_cls: bool = False
    train_size: int | None = Field(None, ge=1, description="a stratified subset of the training texts")


# ------------------------------------------------------------------ the corpus


def module_of(page: str) -> str:
    """The module of a page's path relative to ``help/en-US/text`` (``swriter/01/x.html`` -> ``swriter``)."""
    return page.split("/", 1)[0]


def clean(text: str, min_chars: int) -> str | None:
    """The text a sample keeps, or None when it is too short or has no letter."""
    text = parallel.normalise(text.replace("%PRODUCTNAME", "LibreOffice"))
    return text if len(text) >= min_chars and parallel.LETTER.search(text) else None


def page_rank(split_seed: int, page: str) -> bytes:
    return hashlib.sha256(f"{split_seed}|{page}".encode()).digest()


def held_out(fraction: float, pages: int) -> int:
    """Pages of a module's ``pages`` a split of ``fraction`` holds: round(fraction * pages), at least one when
    the fraction is not 0 and the module has three pages or more (so every split has every module)."""
    n = round(fraction * pages)
    return max(n, 1) if fraction > 0 and pages >= 3 else n


def split_pages(pages: list[str], split_seed: int, val_fraction: float, test_fraction: float) -> dict[str, str]:
    """Page -> split: within each module, pages in hash order give their first :func:`held_out` to test, the next
    to validation, the rest to train."""
    by_module: dict[str, list[str]] = {}
    for page in pages:
        by_module.setdefault(module_of(page), []).append(page)
    out = {}
    for group in by_module.values():
        group = sorted(group, key=lambda p: page_rank(split_seed, p))
        n_test, n_val = held_out(test_fraction, len(group)), held_out(val_fraction, len(group))
        for k, page in enumerate(group):
            out[page] = "test" if k < n_test else "validation" if k < n_test + n_val else "train"
    return out


def build_corpus(pages: dict[str, list[str]], opts: LOHelpOptions) -> dict:
    """``{split: [text, ...], f"{split}_labels": class ids (index into opts.modules), "stats": counts}`` from
    ``pages`` (path relative to ``help/en-US/text`` -> its paragraphs, every module's pages)."""
    dropped: Counter = Counter()
    raw: Counter = Counter()
    first: dict[str, tuple[str, str]] = {}  # near key -> (page, text) of its first occurrence
    modules_of: dict[str, set] = {}
    for page in sorted(pages):
        module = module_of(page)
        for text in pages[page]:
            raw[module] += 1
            text = clean(text, opts.min_chars)
            if text is None:
                dropped["short"] += 1
                continue
            key = parallel.near_key(text)
            modules_of.setdefault(key, set()).add(module)
            if key in first:
                dropped["duplicate"] += 1
            else:
                first[key] = (page, text)
    kept: dict[str, list[str]] = {}  # page -> its texts
    for key, (page, text) in first.items():
        if len(modules_of[key]) > 1:
            dropped["several_modules"] += 1
        elif module_of(page) in opts.modules:
            kept.setdefault(page, []).append(text)
    split_of = split_pages(list(kept), opts.split_seed, opts.val_fraction, opts.test_fraction)
    index = {m: i for i, m in enumerate(opts.modules)}
    rows: dict[str, list[tuple[str, int]]] = {s: [] for s in SPLITS}
    counts = {m: dict.fromkeys(SPLITS, 0) for m in opts.modules}
    page_counts = {m: dict.fromkeys(SPLITS, 0) for m in opts.modules}
    for page, texts in kept.items():
        split, module = split_of[page], module_of(page)
        rows[split] += [(text, index[module]) for text in texts]
        counts[module][split] += len(texts)
        page_counts[module][split] += 1
    out: dict = {}
    for split in SPLITS:
        # a fixed mixed order, so that the first evaluation batches hold every module
        rows[split].sort(key=lambda r: hashlib.sha256(f"{opts.split_seed}|{r[0]}".encode()).digest())
        out[split] = [text for text, _ in rows[split]]
        out[f"{split}_labels"] = torch.as_tensor([label for _, label in rows[split]], dtype=torch.long)
    out["stats"] = {
        "raw": dict(sorted(raw.items())),
        "dropped": dict(sorted(dropped.items())),
        "texts": counts,
        "pages": page_counts,
    }
    return out


CORPUS_ENTRY = {
    **dict.fromkeys(SPLITS, list),
    **{f"{s}_labels": TensorOf((torch.int64,), 1) for s in SPLITS},
    "stats": dict,
}


def _checker(classes: int):
    def check(corpus: dict) -> None:
        for split in SPLITS:
            texts, labels = corpus[split], corpus[f"{split}_labels"]
            if not all(type(t) is str for t in texts) or len(texts) != len(labels):
                raise ValueError(f"{split!r}: expected as many text strings as labels")
            if len(labels) and not (0 <= int(labels.min()) and int(labels.max()) < classes):
                raise ValueError(f"{split}_labels: expected class ids in [0, {classes})")

    return check


def read_pages(root: Path) -> dict[str, list[str]]:
    """Every English help page under ``root`` (path relative to ``help/en-US/text`` -> its texts in page order)."""
    base = root / TEXT
    return {
        path.relative_to(base).as_posix(): list(parallel.help_paragraphs(path).values())
        for path in sorted(base.rglob("*.html"))
    }


def fingerprint(root: Path, opts: LOHelpOptions, version: str) -> str:
    """A short hash of what a build depends on: the pages read (path, size, time), the version and the options."""
    h = hashlib.sha256(f"{FORMAT}|{version}".encode())
    h.update(
        json.dumps(
            opts.model_dump(exclude={"root", "max_len", "add_cls", "eval_split", "train_size"}), sort_keys=True
        ).encode()
    )
    base = root / TEXT
    for path in sorted(base.rglob("*.html")):
        st = path.stat()
        h.update(f"{path.relative_to(base).as_posix()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def check_package(root: Path) -> None:
    if not (root / TEXT).is_dir():
        fetch_root = "" if root == parallel.default_root() else f" --root {root}"
        raise ConfigError(
            f"data.name='lo_help': the Debian package {PACKAGE} is not extracted under {root}; fetch it with: "
            f"python -m kilolayer.data.debian fetch lo_help{fetch_root} (apt-get download {PACKAGE}, then dpkg -x "
            "the .deb into that folder)"
        )


@lru_cache(maxsize=4)
def load_corpus(root: str, opts_json: str) -> tuple[dict, dict]:
    """(corpus, record) of the help pages under ``root``; built once and cached (:func:`build_corpus`)."""
    opts = LOHelpOptions.model_validate_json(opts_json)
    rootp = Path(root)
    check_package(rootp)
    version = package_versions(rootp, [PACKAGE])[PACKAGE]
    key = f"lo_help-{fingerprint(rootp, opts, version)}"
    corpus = cached(key, lambda: build_corpus(read_pages(rootp), opts), CORPUS_ENTRY, _checker(len(opts.modules)))
    record = {**corpus["stats"], "root": str(rootp), "packages": {PACKAGE: version}, "key": key}
    return corpus, record


# ------------------------------------------------------------------ the source


def encode_splits(corpus: dict, max_len: int, add_cls: bool) -> tuple[dict, dict]:
    """({split: (ids cut at max_len, labels)}, {split: samples left out because their cut ids repeat a sample of
    a split ranked before theirs: test, validation, train})."""
    tok = ByteTokenizer()
    seen: set[tuple[int, ...]] = set()
    out, repeated = {}, {}
    for split in ("test", "validation", "train"):
        ids = encode_all(corpus[split], tok, max_len, add_cls)
        keep = [i for i, x in enumerate(ids) if tuple(x) not in seen]
        repeated[split] = len(ids) - len(keep)
        seen.update(tuple(x) for x in ids)
        out[split] = ([ids[i] for i in keep], corpus[f"{split}_labels"][keep])
    return out, repeated


@register_source("lo_help", path_options=("root",))
def lo_help(config: Config) -> MemorySource:
    """Which LibreOffice module (Writer, Calc, ...) a paragraph of English help text is from."""
    opts = parse_options(LOHelpOptions, config.data.options, "data.options")
    m = config.model
    if m.input != "tokens":
        raise ConfigError(f"model.input={m.input!r}: data.name='lo_help' gives tokens; set model.input: tokens")
    if len(set(opts.modules)) != len(opts.modules):
        raise ConfigError(f"data.options.modules: {opts.modules} names a module twice")
    tok = ByteTokenizer()
    check_vocab(m.vocab_size, tok)
    max_len = opts.max_len or m.max_len
    if max_len > m.max_len:
        raise ConfigError(f"data.options.max_len={max_len}: longer than model.max_len={m.max_len}")
    root = parallel.resolve_root(opts.root)
    corpus, record = load_corpus(str(root), opts.model_dump_json())
    splits, repeated = encode_splits(corpus, max_len, opts.add_cls)
    if opts.train_size is not None:
        ids, y = splits["train"]
        if opts.train_size > len(ids):
            raise ConfigError(f"data.options.train_size={opts.train_size}: the training split has {len(ids)} texts")
        keep = stratified_subset(torch.arange(len(ids)), y, opts.train_size, opts.split_seed + 1)
        if len(torch.unique(y[keep])) < len(torch.unique(y)):
            raise ConfigError(
                f"data.options.train_size={opts.train_size}: too few texts to keep every module in proportion"
            )
        splits["train"] = ([ids[i] for i in keep.tolist()], y[keep])
    empty = [s for s in ("train", opts.eval_split) if not len(splits[s][0])]
    if empty:
        raise InputError(f"{root / TEXT}: data.name='lo_help' found no {empty[0]} texts of {', '.join(opts.modules)}")
    tokens, labels, indices, start = [], [], {}, 0
    for split in SPLITS:
        ids, y = splits[split]
        tokens += ids
        labels.append(y)
        indices[split] = torch.arange(start, start + len(ids))
        start += len(ids)
    source = MemorySource(
        config.train.seed,
        {"tokens": tokens, "labels": torch.cat(labels)},
        indices,
        opts.eval_split,
        pad_id=tok.pad_id,
        num_classes=len(opts.modules),
        where="data.name='lo_help'",
    )
    source.classes = [MODULES[m] for m in opts.modules]
    source.record = {**record, "repeated_after_cut": repeated, "total": {s: len(splits[s][0]) for s in SPLITS}}
    return source
