"""Codecs: text to a data source's ids and back, for prompting a trained model and reading what it writes.

A codec knows the source's special ids (``bos``, ``eos``, ``pad``; None where the source has none) and saves
itself into a folder as ``tokenizer.json`` (plus the tokenizer's own files where it has them), so that an
exported model reads and writes text without its data. Sequence-to-sequence sources give theirs with
``codec()``, token sources through their tokenizer's ``codec()`` (:func:`kilolayer.data.text.codec_for`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path

from kilolayer.data import vocab
from kilolayer.errors import InputError

FILE = "tokenizer.json"


class Codec(ABC):
    """``encode(text) -> ids``, ``decode(ids) -> text`` (up to the first ``eos``, special ids left out)."""

    kind = ""
    bos: int | None = None
    eos: int | None = None
    pad: int | None = None

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids) -> str: ...

    def specials(self) -> dict:
        return {"bos": self.bos, "eos": self.eos, "pad": self.pad}

    def state(self, folder: Path) -> dict:
        """What ``tokenizer.json`` holds besides ``kind`` (writing any file of the tokenizer's own into ``folder``)."""
        return self.specials()

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        (folder / FILE).write_text(json.dumps({"kind": self.kind, **self.state(folder)}, indent=1) + "\n")

    def _until_eos(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        return ids[: ids.index(self.eos)] if self.eos in ids else ids


class SymbolCodec(Codec):
    """One symbol per id, joined by ``joiner``: a synthetic task's digits, a corpus's words. A prompt splits at
    whitespace; a piece that is not a symbol is ``unk`` where the vocabulary has one, else read character by
    character if each is a symbol ("31415" is five digits), else an error naming the piece."""

    kind = "symbols"

    def __init__(self, symbols: dict[int, str], joiner=" ", bos=None, eos=None, pad=None, unk=None):
        self.symbols, self.joiner, self.unk = {int(i): s for i, s in symbols.items()}, joiner, unk
        self.bos, self.eos, self.pad = bos, eos, pad
        self.ids = {s: i for i, s in self.symbols.items()}

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in text.split():
            if piece in self.ids:
                out.append(self.ids[piece])
            elif self.unk is not None:
                out.append(self.unk)
            elif all(c in self.ids for c in piece):
                out += [self.ids[c] for c in piece]
            else:
                known = " ".join(sorted(self.ids)[:20])
                raise InputError(f"prompt: {piece!r} is not in the vocabulary ({known})")
        return out

    def decode(self, ids) -> str:
        skip = (self.bos, self.pad)
        return self.joiner.join(self.symbols[i] for i in self._until_eos(ids) if i not in skip and i in self.symbols)

    def state(self, folder):
        return {**self.specials(), "unk": self.unk, "joiner": self.joiner, "symbols": self.symbols}


class ByteCodec(Codec):
    """UTF-8 bytes (ids 0-255), with the special ids of :mod:`kilolayer.data.vocab` unless a source gives others."""

    kind = "bytes"

    def __init__(self, bos=vocab.BOS, eos=vocab.EOS, pad=vocab.PAD):
        self.bos, self.eos, self.pad = bos, eos, pad

    def encode(self, text: str) -> list[int]:
        return vocab.encode(text)

    def decode(self, ids) -> str:
        return vocab.decode(self._until_eos(ids))


class TokenizerCodec(Codec):
    """A Hugging Face ``tokenizers.Tokenizer`` (a subword vocabulary trained on the data), saved as
    ``tokenizer.bpe.json``; ids at or below ``last_special`` are left out of the text."""

    kind = "tokenizers"
    BPE_FILE = "tokenizer.bpe.json"

    def __init__(self, tokenizer, bos=None, eos=None, pad=None, last_special=-1):
        self.tokenizer, self.last_special = tokenizer, last_special
        self.bos, self.eos, self.pad = bos, eos, pad

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([i for i in self._until_eos(ids) if i > self.last_special])

    def state(self, folder):
        (folder / self.BPE_FILE).write_text(self.tokenizer.to_str())
        return {**self.specials(), "last_special": self.last_special}


class HFCodec(Codec):
    """A Hugging Face ``transformers`` tokenizer from a local directory, saved into ``tokenizer/``."""

    kind = "hf"
    DIR = "tokenizer"

    def __init__(self, tok, eos=None, pad=None):
        self.tok, self.eos, self.pad = tok, eos, pad

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tok.decode(self._until_eos(ids), skip_special_tokens=True)

    def state(self, folder):
        self.tok.save_pretrained(str(folder / self.DIR))
        return self.specials()


def read_codec(folder: str | Path) -> Codec | None:
    """The codec saved in ``folder`` by :meth:`Codec.save`; None if it holds none."""
    path = Path(folder) / FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
        kind = state.pop("kind")
        if kind == "symbols":
            return SymbolCodec(**state)
        if kind == "bytes":
            return ByteCodec(**state)
        if kind == "tokenizers":
            from tokenizers import Tokenizer

            return TokenizerCodec(Tokenizer.from_file(str(path.parent / TokenizerCodec.BPE_FILE)), **state)
        if kind == "hf":
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path.parent / HFCodec.DIR), local_files_only=True)
            return HFCodec(tok, eos=state["eos"], pad=state["pad"])
    except ImportError as err:
        raise InputError(f"{path}: reading this tokenizer needs {err.name} (pip install 'kilolayer[hf]')") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{path}: unreadable tokenizer ({err.__class__.__name__}: {str(err)[:120]})") from None
    raise InputError(f"{path}: unknown tokenizer kind {kind!r}; expected symbols, bytes, tokenizers or hf")
