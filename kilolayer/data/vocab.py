"""The byte-level vocabulary shared by the built-in text sources: bytes 0-255, then special ids."""

PAD = 256
BOS = 257
EOS = 258
MASK = 259
CLS = 260
SEP = 261
BYTE_VOCAB = 262  # model.vocab_size needed for byte data


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
