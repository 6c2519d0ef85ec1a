"""Analysing a deep kilolayer backbone holds one layer's activations, not one per layer (docs/models.md#python-api)."""

import weakref

import pytest
import torch

from kilolayer import build_model
from kilolayer.analysis.smoothness import smoothness, token_cosine


class LiveCounter:
    """Counts layer outputs still alive (CPython frees a tensor when its last reference goes)."""

    def __init__(self):
        self.live = self.peak = 0

    def _gone(self, _ref):
        self.live -= 1

    def hook(self, _module, _inputs, output):
        self.live += 1
        self.peak = max(self.peak, self.live)
        self._refs.append(weakref.ref(output, self._gone))

    def attach(self, model):
        self._refs = []
        return [layer.register_forward_hook(self.hook) for layer in model.encoder.layers]


def _deep(layers):
    torch.manual_seed(0)
    return build_model(
        dict(arch="encoder", scheme="deepnorm", layers=layers, width=8, heads=2, ffn=16, vocab_size=32, max_len=16)
    )


def _batch():
    tokens = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(4, 12, dtype=torch.bool)
    pad[1, 9:] = True
    return {"inputs": tokens, "padding_mask": pad}


def _peak(model, analyse):
    counter = LiveCounter()
    handles = counter.attach(model)
    try:
        with torch.no_grad():
            result = analyse(model)
    finally:
        for h in handles:
            h.remove()
    return counter.peak, result


@pytest.mark.slow
def test_smoothness_memory_does_not_grow_with_depth():
    shallow, deep = _deep(10), _deep(1000)
    peak_10, r10 = _peak(shallow, lambda m: smoothness(m, [_batch()]))
    peak_1000, r1000 = _peak(deep, lambda m: smoothness(m, [_batch()]))
    assert len(r10["layers"]) == 11 and len(r1000["layers"]) == 1001
    metrics = ("cosine", "cosine_centred", "cosine_same_minus_different", "rank_residual", "effective_rank", "hc_ratio")
    assert all(len(r1000[k]) == 1001 for k in metrics)
    # at most the current and the previous layer's output are alive at once, at any depth
    assert peak_10 <= 2 and peak_1000 <= 2

    # the counter does see a leak: an observer that keeps every hidden state holds all 1,000
    kept = []

    def leaky(m):
        batch = _batch()
        m(**batch, observe=lambda i, h: kept.append(h))

    peak_leak, _ = _peak(deep, leaky)
    assert peak_leak == 1000


def test_observer_matches_a_direct_computation():
    model = _deep(3).eval()
    batch = _batch()
    result = smoothness(model, [batch])
    hidden = []
    with torch.no_grad():
        model(**batch, observe=lambda i, h: hidden.append(h.clone()))
    direct = [token_cosine(h, batch["padding_mask"]).mean().item() for h in hidden]
    assert result["cosine"] == pytest.approx(direct, rel=1e-6)
