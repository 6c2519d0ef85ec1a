"""Named model presets (the ``model`` section only).

Published shapes (Transformer base/big, BERT-base, ViT-S/16, ViT-B/16, GPT-2
small), DeepNet's depths with Transformer-base widths, and deep-narrow
variants parameter-matched to a published shape. The deep-narrow presets
follow :func:`kilolayer.nn.budget.matched_configs` rules (head size 64, same FFN
ratio); they are not the Bamboo paper's table.

Plain data, importing nothing: a preset is the fields of a ``model`` section,
which :func:`kilolayer.config.load_config` validates when a preset is used
(``kilolayer train NAME``, ``kilolayer describe NAME``).
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {}  # name -> the model section's fields
DESCRIPTIONS: dict[str, str] = {}


def preset(name: str, description: str, **fields) -> None:
    PRESETS[name] = fields
    DESCRIPTIONS[name] = description


_MT = dict(
    arch="encoder_decoder", vocab_size=32000, max_len=256, positions="sinusoidal", embed_scale=True, activation="relu"
)
preset(
    "transformer_base",
    "Transformer base (Vaswani et al. 2017), 6L-6L x 512, Post-LN",
    scheme="post_ln",
    layers=6,
    decoder_layers=6,
    width=512,
    heads=8,
    ffn=2048,
    **_MT,
)
preset(
    "transformer_big",
    "Transformer big (Vaswani et al. 2017), 6L-6L x 1024, Post-LN",
    scheme="post_ln",
    layers=6,
    decoder_layers=6,
    width=1024,
    heads=16,
    ffn=4096,
    **_MT,
)
for n in (6, 18, 50, 100, 200, 250, 500):
    preset(
        f"deepnet_{n}l{n}l",
        f"DeepNet depth {n}L-{n}L ({2 * n} layers) at Transformer-base widths, DeepNorm",
        scheme="deepnorm",
        layers=n,
        decoder_layers=n,
        width=512,
        heads=8,
        ffn=2048,
        **_MT,
    )

preset(
    "bert_base",
    "BERT-base (Devlin et al. 2019), 12 x 768, Post-LN",
    arch="encoder",
    scheme="post_ln",
    layers=12,
    width=768,
    heads=12,
    ffn=3072,
    vocab_size=30522,
    max_len=512,
)
preset(
    "gpt2_small",
    "GPT-2 small (Radford et al. 2019), 12 x 768, Pre-LN",
    arch="decoder",
    scheme="pre_ln",
    layers=12,
    width=768,
    heads=12,
    ffn=3072,
    vocab_size=50257,
    max_len=1024,
)

_VIT = dict(arch="encoder", scheme="pre_ln", input="patches", image_size=224, patch_size=16, channels=3, cls_token=True)
preset("vit_s16", "ViT-S/16 (DeiT-S), 12 x 384, Pre-LN", layers=12, width=384, heads=6, ffn=1536, **_VIT)
preset(
    "vit_b16", "ViT-B/16 (Dosovitskiy et al. 2021), 12 x 768, Pre-LN", layers=12, width=768, heads=12, ffn=3072, **_VIT
)

# Deep-narrow, parameter-matched to the shallow-wide shape (ours, not the paper's table):
# 12 layers x 768 and 48 layers x 384 have the same block parameters (12 L d^2).
preset(
    "vit_b16_deep48",
    "deep-narrow 48 x 384 matched to ViT-B/16's block parameters (ours, not Bamboo's table)",
    layers=48,
    width=384,
    heads=6,
    ffn=1536,
    **_VIT,
)
preset(
    "vit_s16_deep48",
    "deep-narrow 48 x 192 matched to ViT-S/16's block parameters (ours, not Bamboo's table)",
    layers=48,
    width=192,
    heads=3,
    ffn=768,
    **_VIT,
)
preset(
    "bert_base_deep48",
    "deep-narrow 48 x 384 with BERT-base's block parameters (ours, not Bamboo's table)",
    arch="encoder",
    scheme="post_ln",
    layers=48,
    width=384,
    heads=6,
    ffn=1536,
    vocab_size=30522,
    max_len=512,
)
preset(
    "gpt2_small_deep48",
    "deep-narrow 48 x 384 with GPT-2 small's block parameters (ours, not Bamboo's table)",
    arch="decoder",
    scheme="pre_ln",
    layers=48,
    width=384,
    heads=6,
    ffn=1536,
    vocab_size=50257,
    max_len=1024,
)
