"""``lo_multi``: many-to-many translation between the languages of LibreOffice's help, N-way aligned.

LibreOffice's help ships as one Debian package per language (``libreoffice-help-<code>``, the 34 of
:data:`LANGUAGES`); its pages have the same paths in every language and a paragraph carries the same
``par_id``/``hd_id`` in each, so one paragraph (a *row*) holds its text in every language at once.
``data.options.languages`` picks the languages (``all``: every one), ``directions`` the (source, target) pairs
trained and evaluated: ``all`` (every ordered pair), ``english_centric`` (into and out of ``en``) or a list. The
packages are read from the folder ``de_en`` reads (``data.options.root``, else ``$KILOLAYER_PARALLEL_ROOT``, else
the cache), which ``python -m kilolayer.data.debian fetch lo_multi:en,de,ja`` fills.

``data.options.catalogues`` adds LibreOffice's UI strings (menus, dialogs, messages), train only: the gettext
catalogues of ``libreoffice-l10n-<code>``, keyed by (catalogue, context, English string) as a paragraph is by its
id, so one string is a row in every language that translates it (English is the key itself; a plural's singular
form).

Cleaning: each text by :func:`kilolayer.data.parallel.clean_text` (a catalogue's accelerators removed). A text whose
near-key equals the English text of its row is untranslated (a package falls back to English where its translators
have not been) and is left out of the row, so the English pages are read whatever the languages. A pair of a
direction is dropped by :func:`kilolayer.data.parallel.pair_problem`, lengths counted in display columns (a wide CJK
character is two), so that Chinese is not dropped for being written in fewer characters.

Splits: whole pages are held out in every language at once by :func:`kilolayer.data.lo_help.split_pages` (per
help module, in a hash order of ``split_seed``): no paragraph of a validation or test page trains in any
language. Then, as for ``de_en``, a row one of whose texts has the near-key of a test text in its language is
dropped from validation and train, one of a validation text from train (a catalogue row too); a pair repeated
within a split and direction is kept once.

Tokens: one joint BPE vocabulary (:func:`kilolayer.data.parallel.train_tokenizer`) trained on the training texts
of every language, language l's texts repeated or cut so that its share is proportional to n_l ** (1 /
``vocab_temperature``). The special ids are ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3, then one tag
``<2xx>`` per language in ``languages`` order. A pair's source is the target language's tag, then the source
text: the tag tells the decoder which language to write (Johnson et al. 2017; M2M-100 tags languages alike).

Batches: a training sample's direction is drawn with probability proportional to n_d ** (1 / ``temperature``) (n_d:
the direction's training pairs; 5 by default), then one pair of it uniformly, from a generator seeded by
(``train.seed``, step), so a batch is a function of its step. Evaluation pairs take the directions in turn (each
direction's pairs in a hash order), so the first k pairs hold every direction alike. Every batch carries
``direction`` (B,): the index of its pair's direction in ``source.directions``. See docs/data.md.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from collections import Counter
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from pydantic import ConfigDict, Field

from kilolayer.config import NumbersNotBools
from kilolayer.data import lo_help
from kilolayer.data import parallel as P
from kilolayer.data.base import register_source
from kilolayer.data.cache import TensorOf, cache_dir, cached
from kilolayer.data.codec import TokenizerCodec
from kilolayer.data.options import parse_options
from kilolayer.data.packages import package_versions
from kilolayer.data.synthetic import Seq2SeqSource, stream
from kilolayer.errors import ConfigError, InputError

NAME = "lo_multi"
FORMAT = 1  # bump when reading, cleaning or splitting changes what a build gives
TOKENIZER = "bpe3-tags-"  # the tokenizer recipe, in its file name
SPLITS = P.SPLITS
ENGLISH = "en"
#: language code (data.options.languages) -> the folder of its pages under usr/share/libreoffice/help
LANGUAGES = {
    code: code.split("-")[0] + ("-" + code.split("-")[1].upper() if "-" in code else "")
    for code in (
        "ca cs da de dz el en en-gb es et eu fi fr gl hi hu id it ja km ko nl om pl pt pt-br ru sk sl sv tr vi "
        "zh-cn zh-tw"
    ).split()
}
LANGUAGES[ENGLISH] = "en-US"


def package(lang: str) -> str:
    """The Debian package of ``lang``'s help (English's is ``libreoffice-help-en-us``)."""
    return f"libreoffice-help-{'en-us' if lang == ENGLISH else lang}"


def pages_dir(lang: str) -> str:
    """The folder (under the root) of ``lang``'s help pages."""
    return f"{P.HELP}/{LANGUAGES[lang]}/text"


def catalogue_package(lang: str) -> str:
    """The Debian package of ``lang``'s UI catalogues (English has none: its strings are the catalogues' keys)."""
    return f"libreoffice-l10n-{lang}"


def catalogue_dir(lang: str) -> str:
    """The folder (under the root) of ``lang``'s catalogues, named by locale (``zh_CN``, ``pt_BR``)."""
    return P.LO_MO.format(lang=LANGUAGES[lang].replace("-", "_"))


def packages(langs, catalogues: bool = True) -> dict[str, str]:
    """Package -> the folder that shows it is extracted, for ``langs`` and English (always read): the help pages,
    and with ``catalogues`` the UI catalogues of each language but English."""
    out = {package(lang): pages_dir(lang) for lang in dict.fromkeys([ENGLISH, *langs])}
    if catalogues:
        out.update({catalogue_package(lang): catalogue_dir(lang) for lang in langs if lang != ENGLISH})
    return out


def tag(lang: str) -> str:
    """The token that asks for output in ``lang``."""
    return f"<2{lang}>"


# the East Asian blocks of wide and full-width characters (Hangul, CJK, kana, full-width forms; the emoji and
# symbols that Unicode also calls wide are left at one column)
WIDE = re.compile(
    "[\u1100-\u115f\u2e80-\u303e\u3041-\u33ff\u3400-\u4dbf\u4e00-\u9fff\ua000-\ua4cf\uac00-\ud7a3"
    "\uf900-\ufaff\ufe30-\ufe4f\uff00-\uff60\uffe0-\uffe6\U00020000-\U0003fffd]"
)


def width(text: str) -> int:
    """Display columns: a wide or full-width character of Chinese, Japanese or Korean (:data:`WIDE`) counts two."""
    return len(text) + len(WIDE.findall(text))


class LOMultiOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")

    root: str | None = Field(None, description=f"extracted packages; default ${P.ENV_ROOT}, else the cache")
    languages: list[str] | Literal["all"] = Field(description="language codes (two or more), or all")
    directions: Literal["all", "english_centric"] | list[tuple[str, str]] = "all"
    temperature: float = Field(5.0, gt=0, description="training directions drawn in proportion to n ** (1/T)")
    vocab: int = Field(16000, ge=len(P.SPECIALS) + 1, le=1_000_000, description="BPE ids, tags included")
    vocab_temperature: float = Field(5.0, gt=0, description="each language's share of the BPE training texts")
    catalogues: bool = Field(False, description="also train on the UI strings of libreoffice-l10n-<code>")
    split_seed: int = 0
    val_fraction: float = Field(0.03, ge=0.0, lt=1.0)
    test_fraction: float = Field(0.05, gt=0.0, lt=1.0)
    min_chars: int = Field(2, ge=1)
    max_chars: int = Field(300, ge=1)
    max_ratio: float = Field(3.0, ge=1.0)
    eval_split: Literal["validation", "test"] = "validation"


def resolve_languages(opts: LOMultiOptions) -> list[str]:
    """The languages in the order given (``all``: :data:`LANGUAGES`'); one line for an unknown, repeated or lone one."""
    langs = list(LANGUAGES) if opts.languages == "all" else list(opts.languages)
    bad = [lang for lang in langs if lang not in LANGUAGES]
    if bad:
        raise ConfigError(
            f"data.options.languages: unknown {', '.join(map(repr, bad))}; allowed: {', '.join(LANGUAGES)} (or all)"
        )
    if len(set(langs)) != len(langs):
        raise ConfigError(f"data.options.languages: {langs} names a language twice")
    if len(langs) < 2:
        few = "no language" if not langs else "one language"
        raise ConfigError(f"data.options.languages: {langs} is {few}; {NAME} translates between two or more")
    return langs


def resolve_directions(opts: LOMultiOptions, langs: list[str]) -> list[tuple[str, str]]:
    """The (source, target) directions: every ordered pair of ``langs``, those with English on one side, or the
    list given (each of two different languages of ``langs``, none twice)."""
    if opts.directions == "all":
        return list(itertools.permutations(langs, 2))
    if opts.directions == "english_centric":
        if ENGLISH not in langs:
            raise ConfigError(f"data.options.directions=english_centric: data.options.languages has no {ENGLISH!r}")
        return [(s, t) for s, t in itertools.permutations(langs, 2) if ENGLISH in (s, t)]
    out = [tuple(d) for d in opts.directions]
    for s, t in out:
        if s not in langs or t not in langs or s == t:
            raise ConfigError(
                f"data.options.directions: [{s}, {t}] is not two different languages of data.options.languages "
                f"({', '.join(langs)})"
            )
    if len(set(out)) != len(out) or not out:
        raise ConfigError(f"data.options.directions: {[list(d) for d in out]} is empty or names a direction twice")
    return out


def fetch_command(langs, root: Path) -> str:
    fetch_root = "" if root == P.default_root() else f" --root {root}"
    return f"python -m kilolayer.data.debian fetch {NAME}:{','.join(langs)}{fetch_root}"


def check_packages(root: Path, langs: list[str], catalogues: bool = False) -> dict[str, str]:
    """Package -> folder of the packages ``langs`` need (with their ``catalogues``); one line naming the missing
    languages and the command that fetches them when any is absent."""
    missing = [lang for lang in dict.fromkeys([ENGLISH, *langs]) if not (root / pages_dir(lang)).is_dir()]
    if missing:
        raise ConfigError(
            f"data.options.languages: the help of {', '.join(missing)} ({' '.join(map(package, missing))}) is not "
            f"extracted under {root}; fetch it with: {fetch_command(missing, root)}"
        )
    missing = [lang for lang in langs if catalogues and lang != ENGLISH and not catalogue_files(root, lang)]
    if missing:
        raise ConfigError(
            f"data.options.catalogues: the UI catalogues of {', '.join(missing)} "
            f"({' '.join(map(catalogue_package, missing))}) are not extracted under {root}; fetch them with: "
            f"{fetch_command(missing, root)}"
        )
    return packages(langs, catalogues)


# ------------------------------------------------------------------ the corpus


def page_paths(root: Path, langs: list[str]) -> list[str]:
    """Every page (path relative to a language's ``text`` folder) that English or one of ``langs`` has."""
    found = set()
    for lang in dict.fromkeys([ENGLISH, *langs]):
        base = root / pages_dir(lang)
        found.update(p.relative_to(base).as_posix() for p in base.rglob("*.html"))
    return sorted(found)


def read_rows(root: Path, langs: list[str], page: str, opts: LOMultiOptions, dropped: dict, raw: Counter) -> list:
    """The rows of ``page``: for each paragraph id (English's order first), {language: cleaned text} of the
    languages that have it translated; each text left out is counted under its rule in ``dropped[language]``."""
    texts = {}
    for lang in dict.fromkeys([ENGLISH, *langs]):
        path = root / pages_dir(lang) / page
        texts[lang] = P.help_paragraphs(path) if path.is_file() else {}
    english = {k: P.near_key(P.normalise(v.replace("%PRODUCTNAME", "LibreOffice"))) for k, v in texts[ENGLISH].items()}
    ids = list(dict.fromkeys(itertools.chain.from_iterable(texts[lang] for lang in texts)))
    rows = []
    for pid in ids:
        row = {}
        for lang in langs:
            if pid not in texts[lang]:
                continue
            raw[lang] += 1
            text = P.clean_text(texts[lang][pid], opts)
            if isinstance(text, P.Dropped):
                dropped[lang][str(text)] += 1
            elif lang != ENGLISH and english.get(pid) == P.near_key(text):
                dropped[lang]["untranslated"] += 1
            else:
                row[lang] = text
        rows.append(row)
    return rows


def catalogue_files(root: Path, lang: str) -> list[Path]:
    return sorted((root / catalogue_dir(lang)).glob("*.mo"))


#: a UI string whose near-key has at least this many characters is kept out of training when it is contained in a
#: held-out text of its language (the catalogues' extended tips are often a help paragraph shortened); a shorter
#: one, a label such as "Open File", is not evidence of a copy
CONTAINED = 30


def contained(key: str, held: str) -> bool:
    """Whether near-key ``key`` of :data:`CONTAINED` characters or more occurs in ``held``, the held-out near-keys
    of its language joined by newlines."""
    return len(key) >= CONTAINED and key in held


def catalogue_rows(root: Path, langs: list[str], opts: LOMultiOptions, dropped: dict, raw: Counter) -> list[dict]:
    """The rows of the UI catalogues: for each (catalogue, context, English string) that a language translates,
    {language: cleaned text} (English's is the string itself); each text left out is counted under its rule in
    ``dropped[language]``, an untranslated one (the near-key of the English, kept or not) as ``untranslated``."""
    found: dict[tuple, dict[str, str]] = {}
    for lang in langs:
        if lang == ENGLISH:
            continue
        for path in catalogue_files(root, lang):
            for ctx, msgid, _plural, forms in P.read_mo(path):
                if forms and forms[0]:
                    found.setdefault((path.name, ctx or "", msgid), {})[lang] = forms[0]
    rows = []
    for (_, _, msgid), texts in sorted(found.items()):
        english = P.clean_text(msgid, opts, catalogue=True)
        # the English's near-key whether or not its own text is kept, as a page's untranslated check reads it
        key = P.near_key(P.normalise((P.strip_accelerators(msgid) or msgid).replace("%PRODUCTNAME", "LibreOffice")))
        row = {}
        for lang in langs:
            text = english if lang == ENGLISH else texts.get(lang)
            if text is None:
                continue
            raw[lang] += 1
            if lang != ENGLISH:
                text = P.clean_text(text, opts, catalogue=True)
            if isinstance(text, P.Dropped):
                dropped[lang][str(text)] += 1
            elif lang != ENGLISH and P.near_key(text) == key:
                dropped[lang]["untranslated"] += 1
            else:
                row[lang] = text
        rows.append(row)
    return rows


def build_corpus(root: Path, langs: list[str], opts: LOMultiOptions) -> dict:
    """Rows of every split, ``{split: [[text in each of langs, "" where it has none], ...]}``, the pages of each
    split (``{split}_pages``) and ``stats``: texts read and kept per language and split, texts and rows dropped by
    rule, rows and pages per split; with ``catalogues``, ``stats["catalogues"]`` counts the UI strings alike (read,
    dropped, kept in train) and the training rows are the pages' first, then the catalogues'."""
    dropped = {lang: Counter() for lang in langs}
    raw: Counter = Counter()
    row_drops: Counter = Counter()
    by_page = {}
    for page in page_paths(root, langs):
        rows = []
        for row in read_rows(root, langs, page, opts, dropped, raw):
            if len(row) >= 2:
                rows.append(row)
            else:
                row_drops["fewer_than_two_languages"] += 1
        if rows:
            by_page[page] = rows
    ui: list[dict] = []
    ui_dropped = {lang: Counter() for lang in langs}
    ui_raw: Counter = Counter()
    ui_drops: Counter = Counter()
    if opts.catalogues:
        for row in catalogue_rows(root, langs, opts, ui_dropped, ui_raw):
            if len(row) >= 2:
                ui.append(row)
            else:
                ui_drops["fewer_than_two_languages"] += 1
    split_of = lo_help.split_pages(list(by_page), opts.split_seed, opts.val_fraction, opts.test_fraction)
    held = {lang: set() for lang in langs}  # near-keys of the texts of the splits already kept
    out: dict = {}
    texts = {lang: dict.fromkeys(SPLITS, 0) for lang in langs}
    ui_texts = dict.fromkeys(langs, 0)
    for split in ("test", "validation", "train"):
        kept, pages = [], [p for p in by_page if split_of[p] == split]
        candidates = [(row, False) for page in pages for row in by_page[page]]
        joined = {lang: "\n".join(held[lang]) for lang in langs} if split == "train" and ui else {}
        for row, from_ui in candidates + [(row, True) for row in ui if split == "train"]:
            if any(P.near_key(text) in held[lang] for lang, text in row.items()):
                (ui_drops if from_ui else row_drops)["near_duplicate_across_splits"] += 1
                continue
            if from_ui and any(contained(P.near_key(text), joined[lang]) for lang, text in row.items()):
                ui_drops["contained_in_held_out"] += 1
                continue
            kept.append(row)
            for lang in row:
                if from_ui:
                    ui_texts[lang] += 1
                else:
                    texts[lang][split] += 1
        for row in kept:
            for lang, text in row.items():
                held[lang].add(P.near_key(text))
        out[split] = [[row.get(lang, "") for lang in langs] for row in kept]
        out[f"{split}_pages"] = pages
    out["stats"] = {
        "raw": {lang: raw[lang] for lang in langs},
        "texts": texts,
        "dropped": {lang: dict(sorted(c.items())) for lang, c in dropped.items()},
        "rows_dropped": dict(sorted(row_drops.items())),
        "rows": {split: len(out[split]) for split in SPLITS},
        "pages": {split: len(out[f"{split}_pages"]) for split in SPLITS},
    }
    if opts.catalogues:
        out["stats"]["catalogues"] = {
            "raw": {lang: ui_raw[lang] for lang in langs},
            "texts": ui_texts,
            "dropped": {lang: dict(sorted(c.items())) for lang, c in ui_dropped.items()},
            "rows_dropped": dict(sorted(ui_drops.items())),
            "rows": len(ui) - ui_drops["near_duplicate_across_splits"] - ui_drops["contained_in_held_out"],
        }
    return out


CORPUS_ENTRY = {**dict.fromkeys(SPLITS, list), **{f"{s}_pages": list for s in SPLITS}, "stats": dict}


def _checker(n_langs: int):
    def check(corpus: dict) -> None:
        for split in SPLITS:
            for i, row in enumerate(corpus[split]):
                if not (isinstance(row, list) and len(row) == n_langs and all(type(t) is str for t in row)):
                    raise ValueError(f"{split!r} row {i} is {row!r:.60}, expected {n_langs} strings")

    return check


def fingerprint(root: Path, langs: list[str], opts: LOMultiOptions, versions: dict) -> str:
    """A short hash of what a build depends on: the pages read (path, size, time), versions, languages, options."""
    h = hashlib.sha256(f"{FORMAT}|{langs}|{sorted(versions.items())}".encode())
    # without catalogues, the hash of a corpus built before the option existed
    unused = {"root", "vocab", "vocab_temperature", "eval_split", "directions", "temperature", "languages"}
    corpus_opts = opts.model_dump(exclude=unused | (set() if opts.catalogues else {"catalogues"}))
    h.update(json.dumps(corpus_opts, sort_keys=True).encode())
    for lang in dict.fromkeys([ENGLISH, *langs]):
        base = root / pages_dir(lang)
        files = [(base, path) for path in sorted(base.rglob("*.html"))]
        if opts.catalogues and lang != ENGLISH:
            files += [(root, path) for path in catalogue_files(root, lang)]
        for folder, path in files:
            st = path.stat()
            h.update(f"{lang}|{path.relative_to(folder).as_posix()}|{st.st_size}|{st.st_mtime_ns}".encode())
    if opts.catalogues:
        h.update(f"ui|{CONTAINED}".encode())  # the rule that keeps UI strings out of training
    return h.hexdigest()[:16]


@lru_cache(maxsize=4)
def load_corpus(root: str, langs: tuple[str, ...], opts_json: str) -> tuple[str, dict, dict]:
    """(cache key, corpus, record) of ``langs`` under ``root``; built once and cached (:func:`build_corpus`), the
    record (package versions and counts) beside it as ``<key>.json``."""
    opts = LOMultiOptions.model_validate_json(opts_json)
    rootp, langs = Path(root), list(langs)
    versions = package_versions(rootp, check_packages(rootp, langs, opts.catalogues))
    key = f"{NAME}-{fingerprint(rootp, langs, opts, versions)}"
    corpus = cached(key, lambda: build_corpus(rootp, langs, opts), CORPUS_ENTRY, _checker(len(langs)))
    record = {**corpus["stats"], "data": NAME, "root": str(rootp), "packages": versions, "languages": langs}
    P.keep_record(key, record)
    return key, corpus, record


# ------------------------------------------------------------------ directions


def direction_rows(corpus: dict, langs: list[str], directions, opts: LOMultiOptions) -> tuple[dict, dict]:
    """({split: {direction: [row index, ...]}}, {direction: {rule: pairs dropped}}): the rows that give a pair
    of each direction, after :func:`kilolayer.data.parallel.pair_problem` (in :func:`width` columns) and, within
    a split and direction, one pair per (source, target) near-key."""
    index = {lang: i for i, lang in enumerate(langs)}
    rows: dict = {}
    dropped = {f"{s}-{t}": Counter() for s, t in directions}
    for split in SPLITS:
        texts = {text for row in corpus[split] for text in row}
        keys = {text: P.near_key(text) for text in texts}  # once per text, not once per direction
        widths = {text: width(text) for text in texts}
        rows[split] = {}
        for s, t in directions:
            a, b, seen, kept = index[s], index[t], set(), []
            for i, row in enumerate(corpus[split]):
                if not row[a] or not row[b]:
                    continue
                why = P.pair_problem(row[a], row[b], opts.max_ratio, widths.__getitem__, keys.__getitem__)
                if why is None and (keys[row[a]], keys[row[b]]) in seen:
                    why = "duplicate"
                if why:
                    dropped[f"{s}-{t}"][why] += 1
                    continue
                seen.add((keys[row[a]], keys[row[b]]))
                kept.append(i)
            rows[split][(s, t)] = kept
    return rows, {d: dict(sorted(c.items())) for d, c in dropped.items()}


def temperature_weights(sizes: list[int], temperature: float) -> list[float]:
    """Probabilities in proportion to n ** (1/T) of each of ``sizes`` (0 for an empty one): a training draw's
    direction, a language's share of the BPE texts."""
    weights = [n ** (1 / temperature) if n else 0.0 for n in sizes]
    total = sum(weights)
    return [w / total for w in weights]


# ------------------------------------------------------------------ tokenizer


def weighted_texts(rows: list[list[str]], langs: list[str], temperature: float, seed: int) -> list[str]:
    """The BPE training texts: language l's n_l texts repeated or cut (in a seeded order) to
    N * q_l, q_l proportional to (n_l / N) ** (1 / ``temperature``), N the texts of all languages."""
    by_lang = [[row[i] for row in rows if row[i]] for i in range(len(langs))]
    total = sum(len(t) for t in by_lang)
    q = temperature_weights([len(t) for t in by_lang], temperature)
    out = []
    for lang, texts, share in zip(langs, by_lang, q):
        if not texts:
            continue
        order = list(range(len(texts)))
        random.Random(f"{seed}|{lang}").shuffle(order)
        out += [texts[order[k % len(texts)]] for k in range(round(share * total))]
    return out


def load_tokenizer(key: str, corpus: dict, langs: list[str], opts: LOMultiOptions):
    """The joint BPE tokenizer with the language tags, cached as ``<key>-bpe3-tags-<vocab>-t<T>.json``."""

    def build():
        texts = weighted_texts(corpus["train"], langs, opts.vocab_temperature, opts.split_seed)
        return P.train_tokenizer(texts, opts.vocab, P.corpus_alphabet(corpus), tuple(tag(lang) for lang in langs))

    path = cache_dir() / f"{key}-{TOKENIZER}{opts.vocab}-t{opts.vocab_temperature:g}.json"
    return P.cached_tokenizer(path, build)


def encoded_rows(key: str, corpus: dict, langs: list[str], tok) -> dict[str, list[list[list[int]]]]:
    """``{split: [[ids of the row's text in each language], ...]}`` (no ids where a row has no text), cached beside
    the vocabulary: per split and language, the ids end to end and each text's length."""
    names = [(split, i, f"{split}_{lang}") for split in SPLITS for i, lang in enumerate(langs)]

    def build() -> dict:
        out = {}
        for split, i, name in names:
            found = tok.encode_batch([row[i] for row in corpus[split]]) if corpus[split] else []
            ids = [e.ids if row[i] else [] for e, row in zip(found, corpus[split])]
            out[name] = torch.as_tensor([x for e in ids for x in e], dtype=torch.int32)
            out[f"{name}_len"] = torch.as_tensor([len(e) for e in ids], dtype=torch.int32)
        return out

    def check(data: dict) -> None:
        for split, _, name in names:
            if (
                data[f"{name}_len"].numel() != len(corpus[split])
                or int(data[f"{name}_len"].sum()) != data[name].numel()
            ):
                raise ValueError(f"{name}: the lengths do not match the corpus's {len(corpus[split])} rows")
            if data[name].numel() and not 0 <= int(data[name].min()) <= int(data[name].max()) < tok.get_vocab_size():
                raise ValueError(f"{name} holds ids outside [0, {tok.get_vocab_size()})")

    tok_hash = hashlib.sha256(tok.to_str().encode()).hexdigest()[:12]
    entry = {n: TensorOf((torch.int32,), 1) for _, _, name in names for n in (name, f"{name}_len")}
    data = cached(f"{key}-{TOKENIZER}{tok_hash}-ids", build, entry, check)
    out = {split: [[None] * len(langs) for _ in corpus[split]] for split in SPLITS}
    for split, i, name in names:
        flat, lengths = data[name].tolist(), data[f"{name}_len"].tolist()
        for r, (end, n) in enumerate(zip(itertools.accumulate(lengths), lengths)):
            out[split][r][i] = flat[end - n : end]
    return out


# ------------------------------------------------------------------ the source


class DirectionView:
    """One direction of a :class:`MultiCorpus`, as the baselines of its pairs read a source
    (:data:`kilolayer.objectives.baselines.HYPOTHESES`): its special ids, training pairs, nearest-neighbour pool
    and detokenizer. It trains nothing, so it has no batches of its own."""

    baselines = ("copy", "nearest")

    def __init__(self, corpus: MultiCorpus, d: int):
        self.corpus, self.d = corpus, d
        self.bos, self.eos, self.pad = corpus.bos, corpus.eos, corpus.pad

    def train_pairs(self):
        return [self.corpus.pair("train", self.d, r) for r in self.corpus.rows["train"][self.d]]

    def nearest_pool(self) -> tuple[list[str], list[int], Callable[[int], list[int]]]:
        """What the nearest-neighbour baseline searches: every training text of the source language (one fit shared
        by the directions out of it), answers among this direction's rows, and a row's target ids."""
        s, t = (self.corpus.index[lang] for lang in self.corpus.directions[self.d])
        rows = self.corpus.encoded["train"]
        return self.corpus.train_texts(s), self.corpus.rows["train"][self.d], lambda r: rows[r][t]

    def detokenize(self, ids) -> str:
        return self.corpus.detokenize(ids)


class MultiCorpus(P.ParallelCorpus):
    """Encoded rows of the three splits and, per direction, the rows that give one of its pairs."""

    def __init__(self, langs, directions, encoded, rows, tokenizer, eval_split: str, temperature: float, seed: int):
        Seq2SeqSource.__init__(self, seed)
        self.languages, self.directions = list(langs), list(directions)
        self.encoded, self.tokenizer, self.eval_split = encoded, tokenizer, eval_split
        self.vocab_size = tokenizer.get_vocab_size()
        self.index = {lang: i for i, lang in enumerate(langs)}
        self._texts: dict[int, list[str]] = {}
        self.tags = [tokenizer.token_to_id(tag(lang)) for lang in langs]
        # rows[split][d]: the rows of direction d (position in self.directions)
        self.rows = {split: [rows[split][d] for d in self.directions] for split in SPLITS}
        self.sizes = [len(r) for r in self.rows["train"]]
        self.probabilities = torch.as_tensor(temperature_weights(self.sizes, temperature), dtype=torch.float64)
        self.offsets = [0, *itertools.accumulate(self.sizes)]
        # the evaluation's pairs: the directions in turn, each one's rows in a hash order
        ranked = [
            sorted(rs, key=lambda r, d=d: hashlib.sha256(f"{seed}|{d}|{r}".encode()).digest())
            for d, rs in enumerate(self.rows[eval_split])
        ]
        self.eval_items = [
            (d, ranked[d][k]) for k in range(max(map(len, ranked), default=0)) for d in range(len(ranked))
            if k < len(ranked[d])
        ]  # fmt: skip

    @property
    def direction_names(self) -> list[str]:
        return [f"{s}-{t}" for s, t in self.directions]

    def __len__(self) -> int:
        return self.offsets[-1]

    @property
    def eval_size(self) -> int:
        return len(self.eval_items)

    def pair(self, split: str, d: int, row: int) -> tuple[list[int], list[int]]:
        """(target tag + source ids, target ids) of ``row`` of ``split`` in direction ``d``."""
        s, t = (self.index[lang] for lang in self.directions[d])
        ids = self.encoded[split][row]
        return [self.tags[t], *ids[s]], list(ids[t])

    def batch_items(self, split: str, items) -> dict:
        """The batch of ``items`` ((direction, row) of ``split``), with each pair's ``direction``."""
        batch = self.batch_of([self.pair(split, d, r) for d, r in items])
        batch["direction"] = torch.as_tensor([d for d, _ in items], dtype=torch.long)
        return batch

    def train_items(self, step: int, batch_size: int) -> list[tuple[int, int]]:
        """(direction, row) of each sample of global batch ``step``: a direction drawn by
        :attr:`probabilities`, then a row of it uniformly."""
        g = stream(NAME, self.seed, step)
        d = torch.multinomial(self.probabilities, batch_size, replacement=True, generator=g)
        u = torch.rand(batch_size, generator=g, dtype=torch.float64)
        sizes = torch.as_tensor(self.sizes, dtype=torch.float64)[d]
        k = (u * sizes).long().tolist()
        return [(di, self.rows["train"][di][ki]) for di, ki in zip(d.tolist(), k)]

    def train_batch(self, step: int, batch_size: int, rank: int = 0, world: int = 1) -> dict:
        share = batch_size // world
        items = self.train_items(step, batch_size)[rank * share : (rank + 1) * share]
        return self.batch_items("train", items)

    def collate(self, indices, split):
        if split == "eval":
            return self.batch_items(self.eval_split, [self.eval_items[i] for i in indices])
        items = []
        for i in indices:  # a position among every direction's training pairs, end to end
            d = next(d for d in range(len(self.sizes)) if i < self.offsets[d + 1])
            items.append((d, self.rows["train"][d][i - self.offsets[d]]))
        return self.batch_items("train", items)

    def train_pairs(self):
        """None: a nearest training pair is searched within each direction (:meth:`direction`)."""
        return None

    def direction(self, d: int) -> DirectionView:
        return DirectionView(self, d)

    def train_texts(self, lang: int) -> list[str]:
        """Each training row's text in language ``lang`` (position in :attr:`languages`) as decoded from its ids
        ("" where it has none)."""
        if lang not in self._texts:
            self._texts[lang] = [self.detokenize(ids[lang]) if ids[lang] else "" for ids in self.encoded["train"]]
        return self._texts[lang]

    def codec(self):
        return TokenizerCodec(self.tokenizer, bos=P.BOS, eos=P.EOS, pad=P.PAD, last_special=P.EOS)


def make_source(config) -> MultiCorpus:
    opts = parse_options(LOMultiOptions, config.data.options, "data.options")
    m = config.model
    if m.arch != "encoder_decoder":
        raise ConfigError(f"model.arch={m.arch!r}: data.name={NAME!r} needs an encoder_decoder")
    if m.input != "tokens":
        raise ConfigError(f"model.input={m.input!r}: data.name={NAME!r} gives tokens; set model.input: tokens")
    langs = resolve_languages(opts)
    directions = resolve_directions(opts, langs)
    root = P.resolve_root(opts.root)
    key, corpus, record = load_corpus(str(root), tuple(langs), opts.model_dump_json())
    tok = load_tokenizer(key, corpus, langs, opts)
    if m.vocab_size < tok.get_vocab_size():
        raise ConfigError(
            f"model.vocab_size={m.vocab_size}: data.name={NAME!r} has {tok.get_vocab_size()} BPE ids "
            f"(data.options.vocab={opts.vocab}); set model.vocab_size: {tok.get_vocab_size()}"
        )
    encoded = encoded_rows(key, corpus, langs, tok)
    rows, dropped = direction_rows(corpus, langs, directions, opts)
    limit = m.max_len - 1  # the decoder reads BOS + target and predicts target + EOS; the source has its tag
    index = {lang: i for i, lang in enumerate(langs)}
    too_long = {}
    for split in SPLITS:
        for s, t in directions:
            ids = encoded[split]
            kept = [
                r for r in rows[split][(s, t)] if len(ids[r][index[s]]) + 1 <= limit and len(ids[r][index[t]]) <= limit
            ]
            too_long[f"{s}-{t}"] = too_long.get(f"{s}-{t}", 0) + len(rows[split][(s, t)]) - len(kept)
            rows[split][(s, t)] = kept
    empty = [
        f"{s}-{t} ({split})" for split in ("train", opts.eval_split) for s, t in directions if not rows[split][(s, t)]
    ]
    if empty:
        raise InputError(f"{root}: data.name={NAME!r} found no pairs of {', '.join(empty)}")
    source = MultiCorpus(langs, directions, encoded, rows, tok, opts.eval_split, opts.temperature, config.train.seed)
    pairs = {f"{s}-{t}": {split: len(rows[split][(s, t)]) for split in SPLITS} for s, t in directions}
    record.update(
        key=key,
        vocab=tok.get_vocab_size(),
        directions=pairs,
        pairs_dropped=dropped,
        too_long=too_long,
        sampling={n: round(float(p), 6) for n, p in zip(source.direction_names, source.probabilities)},
        total={split: sum(v[split] for v in pairs.values()) for split in SPLITS},
    )
    source.record = record
    return source


@register_source(NAME, path_options=("root",))
def lo_multi(config) -> MultiCorpus:
    """Many-to-many translation between the languages of LibreOffice's help (N-way aligned paragraphs)."""
    return make_source(config)


# ------------------------------------------------------------------ the sizes, printed


def sizes_table(record: dict) -> str:
    """The corpus sizes of a source's ``record`` as markdown: texts per language and split (and the UI strings that
    train, with ``catalogues``), then the training pairs of each direction (source language per row, target per
    column) and the pairs of every split."""
    langs, directions = record["languages"], record["directions"]
    ui = record.get("catalogues")
    head = "| language | train | validation | test | untranslated |" + (" UI strings (train) |" if ui else "")
    lines = [head, "|---" * (6 if ui else 5) + "|"]
    for lang in langs:
        n = record["texts"][lang]
        untranslated = record["dropped"][lang].get("untranslated", 0)
        extra = f" {ui['texts'][lang]:,} |" if ui else ""
        lines.append(f"| `{lang}` | {n['train']:,} | {n['validation']:,} | {n['test']:,} | {untranslated:,} |{extra}")
    lines += ["", "| source \\ target | " + " | ".join(f"`{t}`" for t in langs) + " |", "|---" * (len(langs) + 1) + "|"]
    for s in langs:
        cells = [f"{directions[f'{s}-{t}']['train']:,}" if f"{s}-{t}" in directions else "-" for t in langs]
        lines.append(f"| `{s}` | " + " | ".join(cells) + " |")
    total, rows, pages = record["total"], record["rows"], record["pages"]
    per_split = lambda counts: " / ".join(f"{counts[s]:,}" for s in SPLITS)
    lines += [
        "",
        f"{len(directions)} directions; pairs (train / validation / test): {per_split(total)}; rows "
        f"{per_split(rows)}; pages {per_split(pages)}.",
    ]
    return "\n".join(lines)
