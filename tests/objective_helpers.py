"""Tiny configs and a plain AdamW loop shared by the objective tests."""

from __future__ import annotations

import random
import string
from pathlib import Path

import torch

from kilolayer.config import Config, load_config
from kilolayer.data import load_source
from kilolayer.objectives import build_task

TINY_IMAGE = dict(input="patches", channels=1, image_size=8, patch_size=2, width=32, heads=4, ffn=64, layers=2)
TINY_TEXT = dict(input="tokens", width=32, heads=4, ffn=64, layers=2, vocab_size=262, max_len=32)


def tiny_decoder(scheme: str = "pre_ln") -> dict:
    """The 2 x 32 byte-level decoder (262 ids: bytes + specials, 32 positions) of the training tests."""
    return {
        "arch": "decoder",
        "scheme": scheme,
        "layers": 2,
        "width": 32,
        "heads": 2,
        "ffn": 64,
        "vocab_size": 262,
        "max_len": 32,
    }


def tiny_lm(**train) -> dict:
    """A raw config of :func:`tiny_decoder` learning the next byte of Python's standard library (200 kB,
    32-byte windows, 16 evaluation windows), with ``train`` as its train section."""
    return {
        "model": tiny_decoder(),
        "objective": {"name": "causal_lm"},
        "data": {"name": "stdlib_bytes", "options": {"seq_len": 32, "max_bytes": 200_000, "eval_windows": 16}},
        "train": train,
    }


# one small task per objective (encoder-decoder: the reversal task), for tests that go through every objective
SMALL_PACKAGES = {"max_per_class": 20, "packages": ["xml", "email"]}
WHOLE_TASKS = {
    "decoder": tiny_lm(),
    "encoder_decoder": {
        "model": {"arch": "encoder_decoder", "layers": 3, "decoder_layers": 3, "width": 32, "heads": 4, "ffn": 64},
        "objective": {"name": "seq2seq"},
        "data": {"name": "synthetic", "task": "reverse"},
    },
    "classifier": {
        "model": TINY_TEXT,
        "objective": {"name": "classification"},
        "data": {"name": "stdlib_packages", "options": SMALL_PACKAGES},
    },
    "mlm": {
        "model": TINY_TEXT,
        "objective": {"name": "mlm"},
        "data": {"name": "stdlib_packages", "options": SMALL_PACKAGES},
    },
    "mae": {"model": TINY_IMAGE, "objective": {"name": "mae"}, "data": {"name": "digits"}},
    "contrastive": {
        "model": TINY_IMAGE,
        "objective": {"name": "contrastive", "options": {"embed_dim": 32, "text_model": {"layers": 1, "width": 32}}},
        "data": {"name": "digit_captions"},
    },
}

# every non-special token selected and masked: the targets do not depend on the random draws, so they are the same
# however the batch is divided (processes, micro-batches)
EVERY_TOKEN_MASKED = {"mask_prob": 1.0, "mask_fraction": 1.0, "random_fraction": 0.0}


def ragged_lines(path: Path, count: int = 64) -> Path:
    """``count`` lines of 2 to 30 random letters, each labelled a or b before a tab (seeded), written to
    ``path``: a batch of them is padded to its longest line."""
    rng = random.Random(0)
    lines = [
        f"{rng.choice('ab')}\t{''.join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 30)))}"
        for _ in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def ragged_task(objective: str, folder: Path) -> dict:
    """A raw config (no train section) of a tiny ``objective`` model whose batches are ragged, so that their parts
    hold different numbers of targets: ``seq2seq`` reverses 4 to 12 symbols (label smoothing 0.1, no greedy
    decoding); ``causal_lm``, ``classification`` and ``mlm`` (:data:`EVERY_TOKEN_MASKED`) read
    :func:`ragged_lines` written in ``folder``."""
    if objective == "seq2seq":
        return {
            **WHOLE_TASKS["encoder_decoder"],
            "objective": {"name": "seq2seq", "options": {"label_smoothing": 0.1, "decode_samples": 0}},
        }
    model = tiny_decoder() if objective == "causal_lm" else TINY_TEXT
    options = EVERY_TOKEN_MASKED if objective == "mlm" else {}
    lines = ragged_lines(Path(folder) / "lines.txt")
    return {
        "model": model,
        "objective": {"name": objective, "options": options},
        "data": {"name": "text", "path": str(lines), "options": {"labels": True}},
    }


def masked_task(objective: str, folder: Path) -> dict:
    """A raw config (no train section) of a tiny model under random masks: ``mlm`` with BERT's masking on
    :func:`ragged_lines` written in ``folder``, or ``mae`` on the digits."""
    if objective == "mae":
        return WHOLE_TASKS["mae"]
    return {**ragged_task("mlm", folder), "objective": {"name": "mlm"}}


def config(
    objective: str,
    data: str,
    options: dict | None = None,
    data_options: dict | None = None,
    model: dict | None = None,
    seed: int = 0,
    path: str | None = None,
) -> Config:
    base = TINY_IMAGE if data in ("digits", "digit_captions") else TINY_TEXT
    return load_config(
        {
            "model": {**base, **(model or {})},
            "objective": {"name": objective, "options": options or {}},
            "data": {"name": data, "options": data_options or {}, "path": path},
            "train": {"seed": seed},
        }
    )


def setup(cfg: Config, seed: int = 0):
    """(task, source) with the global RNG seeded as the trainer does."""
    source = load_source(cfg)
    torch.manual_seed(seed)
    return build_task(cfg, source), source


def train(task, source, steps: int, lr: float = 3e-3, batch_size: int = 32) -> list[float]:
    """Plain AdamW on the trainable parameters; returns the training losses."""
    opt = torch.optim.AdamW([p for p in task.parameters() if p.requires_grad], lr=lr)
    task.train()
    losses = []
    for step in range(steps):
        loss, _ = task(source.train_batch(step, batch_size))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def evaluate(task, source, limit: int | None = None, batch_size: int = 128, split: str = "eval") -> dict:
    task.eval()
    batches = source.eval_batches(batch_size, limit) if split == "eval" else source.split_batches(split, batch_size)
    out = task.objective.evaluate(task.backbone, batches)
    task.train()
    return out


def fake_run(run_dir, cfg: Config, task, step: int = 10, complete: bool = True):
    """A run directory as the trainer writes it: config.yaml and checkpoints/step_XXXXXXXX/ holding
    model.safetensors and (if ``complete``) COMPLETE."""
    from safetensors.torch import save_file

    from kilolayer.config import dump_yaml

    ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    save_file({k: v.detach().contiguous() for k, v in task.state_dict().items()}, str(ckpt / "model.safetensors"))
    if complete:
        (ckpt / "COMPLETE").write_text(str(step))
    return run_dir
