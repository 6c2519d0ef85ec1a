"""``seq2seq``: the evaluation loss is the mean cross-entropy over every target token of the evaluation set."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kilolayer.config import load_config
from kilolayer.data import load_source
from kilolayer.objectives import build_task


def test_evaluation_loss_is_the_mean_over_target_tokens():
    """Batches whose sources and targets differ in length (``add``: two numbers in, their sum out) are weighted by
    their target tokens alone, so the evaluation loss is the per-token mean over the whole set, computed here
    independently from the logits of each row."""
    cfg = load_config(
        {
            "model": {"arch": "encoder_decoder", "layers": 1, "decoder_layers": 1, "width": 32, "heads": 2, "ffn": 64},
            "objective": {"name": "seq2seq", "options": {"decode_samples": 0}},
            "data": {"name": "synthetic", "task": "add", "options": {"min_len": 1, "max_len": 6, "eval_size": 40}},
        }
    )
    source = load_source(cfg)
    torch.manual_seed(0)
    task = build_task(cfg, source).eval()
    batches = list(source.eval_batches(7))  # 6 batches, the last of 5 rows
    got = task.objective.evaluate(task.backbone, batches)["loss"]
    nll, count, src_tokens = 0.0, 0, 0
    with torch.no_grad():
        for b in batches:
            h = task.backbone(b["src"], b["tgt_in"], b["src_padding_mask"], b["tgt_padding_mask"])
            logits = task.objective.head(h).double()
            keep = ~b["tgt_padding_mask"]
            nll += float(F.cross_entropy(logits[keep], b["tgt_out"][keep], reduction="sum"))
            count += int(keep.sum())
            src_tokens += int((~b["src_padding_mask"]).sum())
    assert src_tokens != count  # the two weightings differ on this data
    assert got == pytest.approx(nll / count, rel=1e-6)  # source + target weights would be 9e-5 off here
