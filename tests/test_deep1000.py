"""DeepNet's headline depth: a 1,000-layer (500L-500L) DeepNorm encoder-decoder builds and trains a step on CPU.

Runs in a fresh process so its peak resident memory (``ru_maxrss``) is this
model's alone; prints it next to the baseline after ``import kilolayer``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, math, resource, time
import torch
torch.set_num_threads(1)  # tiny matmuls: threads only add synchronisation
import kilolayer
from kilolayer import build_model, deepnorm_constants

def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB

base = rss_mb()
t0 = time.time()
torch.manual_seed(0)
model = build_model(dict(arch="encoder_decoder", scheme="deepnorm", layers=500, decoder_layers=500, width=32,
                         heads=2, ffn=64, vocab_size=64, max_len=16))
t1 = time.time()
src, tgt = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 10))
src_pad = torch.zeros(2, 12, dtype=torch.bool)
src_pad[1, 9:] = True
out = model(src, tgt, src_padding_mask=src_pad)
loss = out.pow(2).mean() + out[:, :, 0].mean()
loss.backward()
t2 = time.time()

grads = [p.grad for p in model.parameters()]
enc0 = model.encoder.layers[0].self_attn.branch.qkv.weight.grad
dec_last = model.decoder.layers[-1].ffn.branch.fc2.weight.grad
print(json.dumps(dict(
    layers=len(model.encoder.layers) + len(model.decoder.layers),
    parameters=sum(p.numel() for p in model.parameters()),
    out_shape=list(out.shape),
    out_finite=bool(torch.isfinite(out).all()),
    out_token_std=float(out.std(dim=-1).mean()),
    grads_missing=sum(g is None for g in grads),
    grads_finite=all(bool(torch.isfinite(g).all()) for g in grads if g is not None),
    enc0_grad_norm=float(enc0.norm()),
    dec_last_grad_norm=float(dec_last.norm()),
    enc_alpha=model.encoder.layers[0].ffn.alpha,
    dec_alpha=model.decoder.layers[0].cross_attn.alpha,
    want=deepnorm_constants("encoder_decoder", 500, 500),
    build_s=t1 - t0, step_s=t2 - t1, baseline_rss_mb=base, peak_rss_mb=rss_mb(),
)))
"""


@pytest.mark.integration
@pytest.mark.slow
def test_1000_layer_deepnorm_encoder_decoder():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"\n500L-500L DeepNorm, width 32: {r['parameters']:,} parameters; build {r['build_s']:.1f}s, "
        f"forward+backward {r['step_s']:.1f}s; peak RSS {r['peak_rss_mb']:.0f} MiB "
        f"(after import: {r['baseline_rss_mb']:.0f} MiB)"
    )
    assert r["layers"] == 1000
    assert r["out_shape"] == [2, 10, 32]
    assert r["out_finite"]
    # Post-LN output: every token vector normalised (std ~1 with LN weight 1, bias 0)
    assert r["out_token_std"] == pytest.approx(1.0, abs=0.05)
    assert r["grads_missing"] == 0 and r["grads_finite"]
    # the gradient reaches the bottom of the encoder through 1,000 layers (and the top of the decoder)
    assert 1e-8 < r["enc0_grad_norm"] < 1e3
    assert 1e-8 < r["dec_last_grad_norm"] < 1e3
    assert r["enc_alpha"] == pytest.approx(r["want"]["encoder"][0])
    assert r["dec_alpha"] == pytest.approx(r["want"]["decoder"][0])
    # ~10.7M parameters: the model itself is ~45 MB; anything near 2 GB means activations or copies leak
    assert r["peak_rss_mb"] - r["baseline_rss_mb"] < 1500
