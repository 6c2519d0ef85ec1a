"""``de_en`` and ``fr_en``: human-translated sentence pairs from Debian packages, with a local BPE vocabulary.

Three kinds of text, read from extracted Debian packages (no download at run time): ``help``, LibreOffice's help
pages (a paragraph carries the same ``par_id``/``hd_id`` in both languages); ``ding``, the example sentences of
the Ding dictionary (``de_en`` only); ``mo``, gettext catalogues. The packages are read from
``data.options.root``, else ``$KILOLAYER_PARALLEL_ROOT``, else ``$KILOLAYER_CACHE/parallel/root``, which
``python -m kilolayer.data.debian fetch de_en fr_en`` fills (``apt-get download`` + ``dpkg -x``).

A pair is dropped, and counted under its rule, when either side fails :func:`clean_pair`. Help pages and Ding
lines are held out whole for ``test`` and ``validation`` (catalogues are train only); a pair whose source or
target is a near-duplicate (:func:`near_key`) of one in ``test`` is dropped from ``validation`` and ``train``,
one of ``validation`` from ``train``, and a repeated pair within a split is kept once.

Tokens: a joint BPE vocabulary of ``vocab`` ids (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3) trained on both
sides of the training split (the same packages and options give a byte-identical file); pairs with a side longer
than ``model.max_len - 1`` tokens are left out of every split. Batches are those of the ``synthetic`` tasks;
``detokenize`` turns output ids back into text for sacrebleu's BLEU and chrF. See docs/data.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import struct
import unicodedata
from collections import Counter
from collections.abc import Callable
from functools import lru_cache
from html.parser import HTMLParser
from pathlib import Path
from typing import Literal

import torch
from pydantic import ConfigDict, Field

from kilolayer.config import NumbersNotBools
from kilolayer.data.base import register_source
from kilolayer.data.cache import TensorOf, cache_dir, cached
from kilolayer.data.codec import TokenizerCodec
from kilolayer.data.options import parse_options
from kilolayer.data.packages import package_versions
from kilolayer.data.synthetic import Seq2SeqSource
from kilolayer.errors import ConfigError, InputError
from kilolayer.files import write_atomic

FORMAT = 2  # bump when the extraction or cleaning changes what a build gives
TOKENIZER = "bpe3-"  # the tokenizer recipe, in its file name: change it when train_tokenizer changes
PAIRS = {"de_en": "de", "fr_en": "fr"}  # data.name -> the source language (the target is English)
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPLITS = ("train", "validation", "test")
KINDS = ("help", "ding", "mo")

HELP = "usr/share/libreoffice/help"
DING = "usr/share/trans/de-en"
LO_MO = "usr/lib/libreoffice/program/resource/{lang}/LC_MESSAGES"
GCC_MO = "usr/share/locale/{lang}/LC_MESSAGES"
GCC_CATALOGUES = ("gcc-12.mo", "cpplib-12.mo")
ENV_ROOT = "KILOLAYER_PARALLEL_ROOT"


def packages(lang: str, kind: str) -> dict[str, str]:
    """The Debian packages that ``kind`` of ``lang`` reads, each with a path (under the root) that shows it is there."""
    return {
        "help": {
            "libreoffice-help-en-us": f"{HELP}/en-US/text",
            f"libreoffice-help-{lang}": f"{HELP}/{lang}/text",
        },
        "ding": {"trans-de-en": DING},
        "mo": {
            f"libreoffice-l10n-{lang}": LO_MO.format(lang=lang),
            "gcc-12-locales": f"{GCC_MO.format(lang=lang)}/{GCC_CATALOGUES[0]}",
        },
    }[kind]


def all_packages(name: str) -> dict[str, str]:
    """Every package ``name`` (de_en | fr_en) can read, with its marker path."""
    out: dict[str, str] = {}
    for kind in KINDS:
        if kind != "ding" or PAIRS[name] == "de":
            out.update(packages(PAIRS[name], kind))
    return out


class ParallelOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")

    root: str | None = Field(None, description=f"extracted packages; default ${ENV_ROOT}, else the cache")
    sources: list[Literal["help", "ding", "mo"]] | None = Field(None, description="default: all the pair has")
    vocab: int = Field(8000, ge=len(SPECIALS) + 1, le=1_000_000, description="BPE vocabulary size")
    split_seed: int = 0
    valid_percent: float = Field(3.0, ge=0, le=50)
    test_percent: float = Field(5.0, gt=0, le=50)
    min_chars: int = Field(2, ge=1)
    max_chars: int = Field(300, ge=1)
    max_ratio: float = Field(3.0, ge=1.0)
    eval_split: Literal["validation", "test"] = "validation"


# ------------------------------------------------------------------ reading the packages


def read_mo(path: str | Path) -> list[tuple[str | None, str, str | None, list[str]]]:
    """The entries of a gettext ``.mo`` file: (context or None, msgid, msgid_plural or None, translations).

    The header (empty msgid) is left out. Strings are decoded as UTF-8 (the charset every catalogue read
    here declares); an undecodable entry is skipped.
    """
    data = Path(path).read_bytes()
    if len(data) < 20:
        raise InputError(f"{path}: too short for a .mo file")
    magic = struct.unpack("<I", data[:4])[0]
    end = {0x950412DE: "<", 0xDE120495: ">"}.get(magic)
    if end is None:
        raise InputError(f"{path}: not a .mo file (magic {magic:#x})")
    _, n, orig_at, trans_at = struct.unpack(end + "4I", data[4:20])
    if max(orig_at, trans_at) + 8 * n > len(data):
        raise InputError(f"{path}: truncated .mo file ({n} entries do not fit in {len(data)} bytes)")
    out = []
    for k in range(n):
        olen, ooff = struct.unpack(end + "2I", data[orig_at + 8 * k : orig_at + 8 * k + 8])
        tlen, toff = struct.unpack(end + "2I", data[trans_at + 8 * k : trans_at + 8 * k + 8])
        if max(ooff + olen, toff + tlen) > len(data):
            raise InputError(f"{path}: truncated .mo file (entry {k} points past the end)")
        try:
            orig = data[ooff : ooff + olen].decode("utf-8")
            trans = data[toff : toff + tlen].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not orig:
            continue  # the header
        ctx, _, msgid = orig.rpartition("\x04") if "\x04" in orig else (None, "", orig)
        msgid, _, plural = msgid.partition("\x00")
        out.append((ctx, msgid, plural or None, trans.split("\x00")))
    return out


def mo_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(translation, msgid) pairs of a catalogue: singular, and plural with the second form where there is one."""
    pairs = []
    for _, msgid, plural, forms in read_mo(path):
        if forms and forms[0]:
            pairs.append((forms[0], msgid))
        if plural and len(forms) > 1 and forms[1]:
            pairs.append((forms[1], plural))
    return pairs


class _HelpPage(HTMLParser):
    """Text of the elements whose id starts ``par_id``/``hd_id``, in the default variant of switched text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.texts: dict[str, str] = {}
        self.open: list[list] = []  # [id, tag, depth, parts]
        self.skip: list[list] = []  # [tag, depth] of an element whose text is not shown by default

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for entry in self.open:
            entry[2] += entry[1] == tag
        for entry in self.skip:
            entry[1] += entry[0] == tag
        # switched text (OS, module): hidden spans with a class are the non-default cases
        if tag in ("script", "style") or ("hidden" in a and a.get("class")):
            self.skip.append([tag, 1])
        ident = a.get("id") or ""
        if ident.startswith(("par_id", "hd_id")):
            self.open.append([ident, tag, 1, []])

    def handle_endtag(self, tag):
        for entry in self.skip:
            entry[1] -= entry[0] == tag
        self.skip = [e for e in self.skip if e[1] > 0]
        still = []
        for entry in self.open:
            entry[2] -= entry[1] == tag
            if entry[2] > 0:
                still.append(entry)
            else:
                self.texts.setdefault(entry[0], "".join(entry[3]))
        self.open = still

    def handle_data(self, data):
        if not self.skip:
            for entry in self.open:
                entry[3].append(data)


def help_paragraphs_from_text(html: str) -> dict[str, str]:
    """``par_id``/``hd_id`` -> text (the first occurrence of an id) of one help page's HTML."""
    page = _HelpPage()
    page.feed(html)
    page.close()
    return page.texts


def help_paragraphs(path: str | Path) -> dict[str, str]:
    return help_paragraphs_from_text(Path(path).read_text(encoding="utf-8", errors="replace"))


ANNOTATION = re.compile(r"\s*(\{[^}]*\}|\[[^\]]*\])")
DICT_WORDS = re.compile(r"\b(jd[mnrs]|etw|sb|sth|so)\.|…")


def ding_sentences(line: str) -> list[tuple[str, str]]:
    """The (German, English) example sentences of one Ding line: sub-entries paired by position, annotations
    (``{m}``, ``[ugs.]``) removed, the first of ``;``-separated alternatives, both sides ending in ``.!?``
    with at least three words and no dictionary placeholders (``jdm.``, ``sth.``, ``…``)."""
    if line.startswith("#") or " :: " not in line:
        return []
    de, en = line.rstrip("\n").split(" :: ", 1)
    out = []
    for d, e in zip(de.split(" | "), en.split(" | ")):
        d, e = (ANNOTATION.sub("", s).split("; ")[0].strip() for s in (d, e))
        if all(s.rstrip("\"'”“’").endswith((".", "!", "?")) and len(s.split()) >= 3 for s in (d, e)):
            if not (DICT_WORDS.search(d) or DICT_WORDS.search(e)):
                out.append((d, e))
    return out


# ------------------------------------------------------------------ cleaning

FORMAT_STRING = re.compile(
    r"%(\d+\$)?[-+#0']*(\d+|\*)?(\.(\d+|\*))?(hh|h|ll|l|L|q|j|z|t|I64|w)?[diouxXeEfFgGaAcspnq<>%]"
    r"|%\d|%[A-Z]{2,}|\{\w*\}|\$\(?[A-Z][A-Z0-9_]*\)?|\$\{|%\{"
)
MARKUP = re.compile(r"<[A-Za-z/!?][^<>]*>|&(#\d+|#x[0-9a-fA-F]+|[A-Za-z]\w*);")
LETTER = re.compile(r"[^\W\d_]")


class Dropped(str):
    """The name of the rule that drops a text (what :func:`clean_text` gives instead of the text)."""


def normalise(text: str) -> str:
    """NFKC with whitespace collapsed: the text a pair keeps."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def near_key(text: str) -> str:
    """The key under which two texts count as near-duplicates: lower-cased letters and digits only."""
    return "".join(ch for ch in text.casefold() if ch.isalnum())


def strip_accelerators(text: str) -> str | None:
    """A catalogue string without its keyboard accelerator (``~`` anywhere; a single ``&`` or ``_`` before a
    letter); None when more than one candidate makes it ambiguous (an identifier, not a label)."""
    text = text.replace("~", "").replace("&&", "\x00")
    for mark in ("&", "_"):
        found = re.findall(re.escape(mark) + r"(?=\w)", text)
        if len(found) > 1:
            return None
        text = re.sub(re.escape(mark) + r"(?=\w)", "", text)
    return text.replace("\x00", "&")


def clean_text(text: str, opts, catalogue: bool = False) -> str:
    """One side's cleaned text, or the :class:`Dropped` name of the rule that drops it (``opts``: ``min_chars``,
    ``max_chars``)."""
    text = text.replace("%PRODUCTNAME", "LibreOffice")
    if catalogue:
        text = strip_accelerators(text)
        if text is None:
            return Dropped("accelerator")
    if FORMAT_STRING.search(text):
        return Dropped("format_string")
    if MARKUP.search(text):
        return Dropped("markup")
    text = normalise(text)
    if not LETTER.search(text):
        return Dropped("no_letter")
    if not opts.min_chars <= len(text) <= opts.max_chars:
        return Dropped("length")
    return text


def pair_problem(src: str, tgt: str, max_ratio: float, length=len, key=None) -> str | None:
    """The rule that drops a pair of cleaned texts (``ratio``: ``length``s too far apart; ``identical``: the same
    near-key, an untranslated text), or None. ``key``: :func:`near_key`, or a lookup of it already computed."""
    short, long = sorted((length(src), length(tgt)))
    if (long + 10) / (short + 10) > max_ratio:
        return "ratio"
    key = key or near_key
    if key(src) == key(tgt):
        return "identical"
    return None


def clean_pair(src: str, tgt: str, opts: ParallelOptions, catalogue: bool = False) -> tuple[str, str] | str:
    """The cleaned (source, target), or the name of the rule that drops the pair."""
    texts = []
    for text in (src, tgt):
        text = clean_text(text, opts, catalogue)
        if isinstance(text, Dropped):
            return str(text)
        texts.append(text)
    return pair_problem(texts[0], texts[1], opts.max_ratio) or (texts[0], texts[1])


# ------------------------------------------------------------------ gathering and splitting


def default_root() -> Path:
    return cache_dir() / "parallel" / "root"


def resolve_root(root: str | None) -> Path:
    """The folder of extracted packages: ``root`` (``data.options.root``), else ``$KILOLAYER_PARALLEL_ROOT``, else
    the cache's."""
    return Path(root or os.environ.get(ENV_ROOT) or default_root())


def kinds_of(name: str, opts: ParallelOptions) -> list[str]:
    lang = PAIRS[name]
    available = [k for k in KINDS if k != "ding" or lang == "de"]
    if opts.sources is None:
        return available
    bad = [k for k in opts.sources if k not in available]
    if bad:
        raise ConfigError(f"data.options.sources: {name} has no {', '.join(bad)} text; allowed: {', '.join(available)}")
    return [k for k in KINDS if k in opts.sources]


def check_packages(name: str, root: Path, kinds: list[str]) -> dict[str, str]:
    """Package -> marker path for the packages ``kinds`` need; one line naming the missing ones and the fetch
    command when any is absent."""
    needed = {}
    for kind in kinds:
        needed.update(packages(PAIRS[name], kind))
    missing = [p for p, marker in needed.items() if not (root / marker).exists()]
    if missing:
        fetch_root = "" if root == default_root() else f" --root {root}"
        raise ConfigError(
            f"data.name={name!r}: the Debian packages {' '.join(missing)} are not extracted under {root}; fetch them "
            f"with: python -m kilolayer.data.debian fetch {name}{fetch_root} "
            f"(apt-get download {' '.join(missing)}, then dpkg -x each .deb into that folder)"
        )
    return needed


def _files(root: Path, name: str, kinds: list[str]) -> dict[str, list[Path]]:
    lang = PAIRS[name]
    files: dict[str, list[Path]] = {}
    if "help" in kinds:
        files["help"] = sorted((root / HELP / "en-US" / "text").rglob("*.html"))
    if "ding" in kinds:
        files["ding"] = [root / DING]
    if "mo" in kinds:
        files["mo"] = sorted((root / LO_MO.format(lang=lang)).glob("*.mo")) + [
            p for c in GCC_CATALOGUES if (p := root / GCC_MO.format(lang=lang) / c).is_file()
        ]
    return files


def fingerprint(root: Path, name: str, kinds: list[str], opts: ParallelOptions, versions: dict) -> str:
    """A short hash of everything a build depends on: the files read (path, size, time), versions and options."""
    h = hashlib.sha256(f"{FORMAT}|{name}|{sorted(versions.items())}".encode())
    corpus = opts.model_dump(exclude={"root", "vocab", "eval_split"})
    h.update(json.dumps(corpus, sort_keys=True).encode())
    lang = PAIRS[name]
    for kind, paths in _files(root, name, kinds).items():
        for p in paths:
            others = [p] + ([root / HELP / lang / p.relative_to(root / HELP / "en-US")] if kind == "help" else [])
            for q in others:
                try:
                    st = q.stat()
                    h.update(f"{q.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}".encode())
                except OSError:
                    h.update(f"{q.relative_to(root)}|-".encode())
    return h.hexdigest()[:16]


def raw_pairs(root: Path, name: str, kinds: list[str]) -> list[tuple[str, str, str, str]]:
    """(kind, group, source text, English text) of every pair the packages hold, before cleaning; ``group``
    is what a split holds out together (a help page, a dictionary line, a catalogue)."""
    lang = PAIRS[name]
    out = []
    files = _files(root, name, kinds)
    for en_path in files.get("help", []):
        rel = en_path.relative_to(root / HELP / "en-US")
        other = root / HELP / lang / rel
        if not other.is_file():
            continue
        en, xx = help_paragraphs(en_path), help_paragraphs(other)
        group = rel.as_posix()
        out += [("help", group, xx[k], en[k]) for k in en if k in xx]
    for path in files.get("ding", []):
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                out += [("ding", str(n), de, en) for de, en in ding_sentences(line)]
    for path in files.get("mo", []):
        out += [("mo", path.name, xx, en) for xx, en in mo_pairs(path)]
    return out


def split_of(kind: str, group: str, opts: ParallelOptions) -> str:
    """Help pages and dictionary lines are held out by a hash of (split_seed, kind, group); catalogues train."""
    if kind == "mo":
        return "train"
    digest = hashlib.sha256(f"{opts.split_seed}|{kind}|{group}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64 * 100
    return "test" if u < opts.test_percent else "validation" if u < opts.test_percent + opts.valid_percent else "train"


def build_corpus(root: Path, name: str, kinds: list[str], opts: ParallelOptions) -> dict:
    """Cleaned, de-duplicated, split pairs: ``{split: [[source, target], ...]}`` plus ``stats`` (counts by
    kind and split, and how many pairs each cleaning rule dropped)."""
    by_split: dict[str, list] = {s: [] for s in SPLITS}
    dropped: Counter = Counter()
    raw = Counter()
    for kind, group, src, tgt in raw_pairs(root, name, kinds):
        raw[kind] += 1
        cleaned = clean_pair(src, tgt, opts, catalogue=kind == "mo")
        if isinstance(cleaned, str):
            dropped[cleaned] += 1
            continue
        by_split[split_of(kind, group, opts)].append((kind, group, *cleaned))
    held: dict[str, set] = {"src": set(), "tgt": set()}  # near-keys of the splits already kept
    out: dict = {}
    counts = {kind: dict.fromkeys(SPLITS, 0) for kind in kinds}
    for split in ("test", "validation", "train"):
        seen, kept = set(), []
        for kind, _group, src, tgt in by_split[split]:
            ks, kt = near_key(src), near_key(tgt)
            if ks in held["src"] or kt in held["tgt"]:
                dropped["near_duplicate_across_splits"] += 1
                continue
            if (ks, kt) in seen:
                dropped["duplicate"] += 1
                continue
            seen.add((ks, kt))
            kept.append((kind, src, tgt))
            counts[kind][split] += 1
        for _, src, tgt in kept:
            held["src"].add(near_key(src))
            held["tgt"].add(near_key(tgt))
        if split != "train":
            # a fixed shuffled order, so the first evaluation batches mix pages and lines
            kept.sort(key=lambda p: hashlib.sha256(f"{opts.split_seed}|{p[1]}|{p[2]}".encode()).digest())
        out[split] = [[src, tgt] for _, src, tgt in kept]
    out["stats"] = {"raw": dict(raw), "pairs": counts, "dropped": dict(sorted(dropped.items()))}
    return out


# ------------------------------------------------------------------ tokenizer


def train_tokenizer(texts, vocab: int, alphabet: str = "", tags: tuple[str, ...] = ()):
    """A joint BPE tokenizer of ``vocab`` ids trained on ``texts``: NFKC, split at spaces (kept as ``▁``) and
    around punctuation; the characters of ``alphabet`` are single tokens even where ``texts`` lack them; ``tags``
    are special tokens with the ids after :data:`SPECIALS`'. BPE's merges depend only on the texts, so the same
    texts give the same vocabulary file."""
    try:
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    except ImportError:
        raise ConfigError(
            "data.name de_en/fr_en/lo_multi: the subword vocabulary needs the tokenizers library "
            "(pip install 'kilolayer[mt]', or pip install 'tokenizers>=0.15')"
        ) from None
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    # words at spaces, then punctuation on its own, so 'gesagt,' and 'gesagt' share their pieces
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation("isolated")])
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[*SPECIALS, *tags], initial_alphabet=sorted(set(alphabet)), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [PAD, BOS, EOS, UNK]
    return tok


def _write_cached(path: Path, text: str) -> None:
    with contextlib.suppress(OSError):  # a read-only cache: the caller keeps what it built
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)


def keep_record(key: str, record: dict) -> None:
    """``record`` (a corpus's package versions and counts) beside its cache as ``<key>.json``, written once."""
    path = cache_dir() / f"{key}.json"
    if not path.is_file():
        _write_cached(path, json.dumps(record, indent=2, sort_keys=True) + "\n")


def corpus_alphabet(corpus: dict) -> str:
    """Every character but white space in the texts of every split, for a tokenizer to keep as tokens: no reference
    decodes with a character lost to <unk> (what a held-out text adds is its character inventory, nothing more)."""
    return "".join(
        sorted({ch for split in SPLITS for row in corpus[split] for text in row for ch in text if not ch.isspace()})
    )


def cached_tokenizer(path: Path, build: Callable):
    """The tokenizer saved at ``path``; where there is none, or one that does not load, ``build()``'s, saved there
    (atomically)."""
    from tokenizers import Tokenizer

    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # tokenizers raises its own exception type; rebuild and replace
            pass
    tok = build()
    _write_cached(path, tok.to_str(pretty=True))
    return tok


def load_tokenizer(key: str, corpus: dict, vocab: int):
    """The BPE tokenizer of ``corpus``'s training split, cached as ``<key>-bpe3-<vocab>.json`` beside the data."""

    def build():  # merges from the training split
        return train_tokenizer((text for pair in corpus["train"] for text in pair), vocab, corpus_alphabet(corpus))

    return cached_tokenizer(cache_dir() / f"{key}-{TOKENIZER}{vocab}.json", build)


# ------------------------------------------------------------------ the source


#: what a cached corpus holds: each split's [source, target] pairs and the build's counts
CORPUS_ENTRY = {**dict.fromkeys(SPLITS, list), "stats": dict}
STATS_KEYS = ("raw", "pairs", "dropped")


def _check_pairs(corpus: dict) -> None:
    """Every pair of a cached corpus is two strings, and its counts are all there (else the file is rebuilt)."""
    for split in SPLITS:
        for i, pair in enumerate(corpus[split]):
            if not (type(pair) in (list, tuple) and len(pair) == 2 and type(pair[0]) is str and type(pair[1]) is str):
                raise ValueError(f"{split!r} pair {i} is {pair!r:.60}, expected [source, target] strings")
    missing = [k for k in STATS_KEYS if not isinstance(corpus["stats"].get(k), dict)]
    if missing:
        raise ValueError(f"'stats' has no {', '.join(map(repr, missing))}")


#: what the cached ids of a corpus hold: per split and side, int32 ids end to end and each sentence's length
IDS_ENTRY = {
    f"{split}_{side}{part}": TensorOf((torch.int32,), 1)
    for split in SPLITS
    for side in ("src", "tgt")
    for part in ("", "_len")
}


def _ids_checker(corpus: dict, vocab: int):
    """The check of a corpus's cached ids: per split as many sentences on each side as the corpus has pairs,
    lengths that are not negative and add up to the ids, and every id in [0, vocab)."""

    def check(data: dict) -> None:
        for split in SPLITS:
            for side in ("src", "tgt"):
                flat, lengths = data[f"{split}_{side}"], data[f"{split}_{side}_len"]
                if lengths.numel() != len(corpus[split]):
                    raise ValueError(
                        f"{split}_{side}_len has {lengths.numel()} sentences, the corpus {len(corpus[split])} pairs"
                    )
                if lengths.numel() and int(lengths.min()) < 0:
                    raise ValueError(f"{split}_{side}_len has a negative length")
                if int(lengths.sum()) != flat.numel():
                    raise ValueError(f"{split}_{side}_len does not add up to the {flat.numel()} ids of {split}_{side}")
                if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
                    raise ValueError(f"{split}_{side} holds ids outside [0, {vocab})")

    return check


@lru_cache(maxsize=4)
def load_corpus(name: str, root: str, opts_json: str) -> tuple[str, dict, dict]:
    """(cache key, corpus, record) of ``name`` under ``root``; builds and caches on the first call."""
    opts = ParallelOptions.model_validate_json(opts_json)
    kinds = kinds_of(name, opts)

    rootp = Path(root)
    needed = check_packages(name, rootp, kinds)
    versions = package_versions(rootp, needed)
    key = f"{name}-{fingerprint(rootp, name, kinds, opts, versions)}"
    corpus = cached(key, lambda: build_corpus(rootp, name, kinds, opts), CORPUS_ENTRY, _check_pairs)
    record = {**corpus["stats"], "data": name, "root": str(rootp), "packages": versions}
    record["total"] = {s: len(corpus[s]) for s in SPLITS}
    keep_record(key, record)
    return key, corpus, record


class ParallelCorpus(Seq2SeqSource):
    """Encoded pairs of the three splits; ids from the BPE tokenizer (PAD 0, BOS 1, EOS 2)."""

    bos, eos, pad = BOS, EOS, PAD
    baselines = ("copy", "nearest")

    def __init__(self, splits: dict, tokenizer, eval_split: str, seed: int):
        super().__init__(seed)
        self.splits, self.tokenizer, self.eval_split = splits, tokenizer, eval_split
        self.vocab_size = tokenizer.get_vocab_size()

    def __len__(self) -> int:
        return len(self.splits["train"])

    def train_pairs(self):
        return self.splits["train"]

    @property
    def eval_size(self) -> int:
        return len(self.splits[self.eval_split])

    def collate(self, indices, split):
        data = self.splits[self.eval_split if split == "eval" else split]
        return self.batch_of([data[i] for i in indices])

    def detokenize(self, ids) -> str:
        """The text of output ids up to the first EOS (special ids skipped), as the tokenizer decodes it."""
        ids = [int(i) for i in ids]
        if EOS in ids:
            ids = ids[: ids.index(EOS)]
        return self.tokenizer.decode([i for i in ids if i > UNK or i == UNK])

    def codec(self):
        """Text to ids and back through the BPE vocabulary (as :meth:`detokenize` reads ids)."""
        return TokenizerCodec(self.tokenizer, bos=BOS, eos=EOS, pad=PAD, last_special=EOS)


def _encode(tok, pairs: list) -> list[tuple[list[int], list[int]]]:
    if not pairs:
        return []
    src = tok.encode_batch([p[0] for p in pairs])
    tgt = tok.encode_batch([p[1] for p in pairs])
    return [(s.ids, t.ids) for s, t in zip(src, tgt)]


def encoded_splits(key: str, corpus: dict, tok, vocab: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Every split's pairs as ids, cached beside the vocabulary (encoding all pairs costs far more than reading
    them back): per split and side, the ids end to end and each sentence's length."""

    def build() -> dict:
        out = {}
        for split in SPLITS:
            encoded = _encode(tok, corpus[split])
            for side, name in ((0, "src"), (1, "tgt")):
                out[f"{split}_{name}"] = torch.as_tensor([i for e in encoded for i in e[side]], dtype=torch.int32)
                out[f"{split}_{name}_len"] = torch.as_tensor([len(e[side]) for e in encoded], dtype=torch.int32)
        return out

    # the ids belong to this very tokenizer (one retrained from the same texts may differ: another tokenizers
    # version), so its content names the entry
    tok_hash = hashlib.sha256(tok.to_str().encode()).hexdigest()[:12]
    data = cached(
        f"{key}-{TOKENIZER}{vocab}-{tok_hash}-ids", build, IDS_ENTRY, _ids_checker(corpus, tok.get_vocab_size())
    )
    splits = {}
    for split in SPLITS:
        sides = []
        for name in ("src", "tgt"):
            flat, lengths = data[f"{split}_{name}"].tolist(), data[f"{split}_{name}_len"].tolist()
            ends = list(itertools.accumulate(lengths))
            sides.append([flat[e - n : e] for e, n in zip(ends, lengths)])
        splits[split] = list(zip(*sides))
    return splits


def make_source(name: str, config) -> ParallelCorpus:
    opts = parse_options(ParallelOptions, config.data.options, "data.options")
    m = config.model
    if m.arch != "encoder_decoder":
        raise ConfigError(f"model.arch={m.arch!r}: data.name={name!r} needs an encoder_decoder")
    if m.input != "tokens":
        raise ConfigError(f"model.input={m.input!r}: data.name={name!r} gives tokens; set model.input: tokens")
    root = resolve_root(opts.root)
    key, corpus, record = load_corpus(name, str(root), opts.model_dump_json())
    if not corpus["train"] or not corpus[opts.eval_split]:
        raise InputError(
            f"{root}: data.name={name!r} found no {'train' if not corpus['train'] else opts.eval_split} pairs"
        )
    tok = load_tokenizer(key, corpus, opts.vocab)
    if m.vocab_size < tok.get_vocab_size():
        raise ConfigError(
            f"model.vocab_size={m.vocab_size}: data.name={name!r} has {tok.get_vocab_size()} BPE ids "
            f"(data.options.vocab={opts.vocab}); set model.vocab_size: {tok.get_vocab_size()}"
        )
    limit = m.max_len - 1  # the decoder reads BOS + target and predicts target + EOS
    splits, too_long = {}, {}
    for split, encoded in encoded_splits(key, corpus, tok, opts.vocab).items():
        splits[split] = [(s, t) for s, t in encoded if len(s) <= limit and len(t) <= limit]
        too_long[split] = len(encoded) - len(splits[split])
    if not splits["train"] or not splits[opts.eval_split]:
        raise ConfigError(f"model.max_len={m.max_len}: every {name} pair of a split is longer than {limit} tokens")
    source = ParallelCorpus(splits, tok, opts.eval_split, config.train.seed)
    source.record = {**record, "vocab": tok.get_vocab_size(), "too_long": too_long, "key": key}
    return source


@register_source("de_en", path_options=("root",))
def de_en(config) -> ParallelCorpus:
    """German -> English (LibreOffice help, Ding's example sentences, gettext catalogues)."""
    return make_source("de_en", config)


@register_source("fr_en", path_options=("root",))
def fr_en(config) -> ParallelCorpus:
    """French -> English (LibreOffice help and gettext catalogues; Ding has no French)."""
    return make_source("fr_en", config)
