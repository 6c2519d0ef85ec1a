"""Write the small sample files the "your own data" example configs (configs/own_*.yaml) train on.

    python examples/data/make_samples.py

Everything is generated from a fixed seed, so the files in the repository are what this script writes:

* ``corpus.txt``: 400 lines of simple English sentences (``text_bytes``);
* ``reviews.tsv``: 120 ``label<TAB>text`` lines, labels ``good`` and ``bad`` (``text`` with ``labels: true``);
* ``de.txt`` / ``en.txt``: 150 German sentences and their English translations, line by line (``parallel``);
* ``stripes/``: 8x8 grey PNGs, 24 of horizontal and 24 of vertical stripes, one sub-folder per class
  (``image_folder``), and ``stripes/captions.txt``: one ``name<TAB>caption`` line per image
  (``image_captions``);
* ``stripes_idx/``: the same kind of images as MNIST's four IDX files (``idx``), 48 to train and 16 to test.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent

NOUNS = [("der hund", "the dog"), ("die katze", "the cat"), ("das kind", "the child"), ("der vogel", "the bird")]
NOUNS += [("die frau", "the woman"), ("der mann", "the man")]
VERBS = [("schläft", "sleeps"), ("läuft", "runs"), ("singt", "sings"), ("isst", "eats"), ("spielt", "plays")]
ADVERBS = [("", ""), ("heute", "today"), ("oft", "often"), ("nicht", "not"), ("gern", "gladly")]


def sentences(rng: random.Random, count: int) -> list[str]:
    subjects = ["the dog", "a cat", "my sister", "the old man", "our teacher", "a small bird", "the farmer"]
    verbs = ["sees", "likes", "paints", "finds", "carries", "remembers", "follows"]
    objects = ["the river", "a red apple", "the long road", "an open window", "the green hill", "a quiet song"]
    tails = ["", " in the morning", " after dinner", " every day", " near the house", " with great care"]
    return [
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}{rng.choice(tails)}." for _ in range(count)
    ]


def reviews(rng: random.Random, count: int) -> list[str]:
    good = ["a wonderful", "a delightful", "an excellent", "a lovely", "a brilliant"]
    bad = ["a dreadful", "a boring", "an awful", "a tiresome", "a clumsy"]
    things = ["film", "book", "meal", "concert", "journey"]
    out = []
    for i in range(count):
        label = "good" if i % 2 == 0 else "bad"
        words = good if label == "good" else bad
        out.append(f"{label}\tit was {rng.choice(words)} {rng.choice(things)}, {rng.choice(words)} time")
    return out


def stripes(rng: random.Random, horizontal: bool) -> list[list[int]]:
    """An 8x8 grey image of stripes two pixels wide, at a random phase, with noise."""
    phase = rng.randrange(4)
    image = []
    for y in range(8):
        row = []
        for x in range(8):
            on = ((y if horizontal else x) + phase) // 2 % 2 == 0
            row.append(max(0, min(255, (200 if on else 40) + rng.randint(-30, 30))))
        image.append(row)
    return image


def write_png(path: Path, image: list[list[int]]) -> None:
    from PIL import Image

    im = Image.new("L", (8, 8))
    im.putdata([v for row in image for v in row])
    im.save(path)


def write_idx(path: Path, data: bytes, dims: tuple[int, ...]) -> None:
    path.write_bytes(bytes([0, 0, 0x08, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + data)


def main() -> None:
    rng = random.Random(0)
    (HERE / "corpus.txt").write_text("\n".join(sentences(rng, 400)) + "\n")
    (HERE / "reviews.tsv").write_text("\n".join(reviews(rng, 120)) + "\n")
    pairs = [
        (" ".join(w for w in (n[0], v[0], a[0]) if w), " ".join(w for w in (n[1], v[1], a[1]) if w))
        for n in NOUNS
        for v in VERBS
        for a in ADVERBS
    ]
    rng.shuffle(pairs)
    (HERE / "de.txt").write_text("\n".join(de for de, _ in pairs) + "\n")
    (HERE / "en.txt").write_text("\n".join(en for _, en in pairs) + "\n")

    captions = []
    for kind in ("horizontal", "vertical"):
        folder = HERE / "stripes" / kind
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(24):
            write_png(folder / f"{i:02d}.png", stripes(rng, kind == "horizontal"))
            captions.append(f"{kind}/{i:02d}.png\t{rng.choice(['thin', 'grey', 'noisy'])} {kind} stripes")
    (HERE / "stripes" / "captions.txt").write_text("\n".join(captions) + "\n")

    idx = HERE / "stripes_idx"
    idx.mkdir(exist_ok=True)
    for part, count in (("train", 48), ("t10k", 16)):
        labels = [i % 2 for i in range(count)]
        pixels = bytes(v for y in labels for row in stripes(rng, y == 0) for v in row)
        write_idx(idx / f"{part}-images-idx3-ubyte", pixels, (count, 8, 8))
        write_idx(idx / f"{part}-labels-idx1-ubyte", bytes(labels), (count,))


if __name__ == "__main__":
    main()
