"""The built-in studies: ``quick`` (what ``make demo`` runs), ``deepnet`` and ``bamboo``.

Group names carry roles the findings look for: ``deepnet`` (schemes x depths),
``untrained``, ``supervised``, ``mae`` and ``finetune`` (MAE then fine-tuning).
"""

from __future__ import annotations

import copy


def _deepnet_base(steps: int, width: int, eval_every: int, diag_until: int) -> dict:
    return {
        "model": {"arch": "encoder_decoder", "width": width, "heads": 4, "ffn": 4 * width, "vocab_size": 13,
                  "max_len": 16},
        "objective": {"name": "seq2seq", "options": {"decode_samples": 32}},
        "data": {"name": "synthetic", "task": "reverse", "options": {"vocab": 10, "min_len": 4, "max_len": 12,
                                                                     "eval_size": 128}},
        # one learning rate and warm-up for every scheme and depth: that is the comparison
        "train": {"steps": steps, "batch_size": 32, "lr": 1e-3, "warmup": 100, "schedule": "inverse_sqrt",
                  "clip": 0.0, "eval_every": eval_every, "eval_batches": 4, "checkpoint_every": steps,
                  "log_every": 10, "diagnostics_every": 5, "diagnostics_until": diag_until},
    }


def _digits_model(layers: int, width: int, image_size: int) -> dict:
    return {"arch": "encoder", "scheme": "pre_ln", "input": "patches", "image_size": image_size, "patch_size": 2,
            "channels": 1, "cls_token": True, "layers": layers, "width": width, "heads": width // 64,
            "ffn": 4 * width}


def _bamboo_groups(shapes, image_size, seeds, sup_steps, mae_steps, ft_steps, mask_ratio) -> list[dict]:
    def base(objective: dict, steps: int, lr: float) -> dict:
        return {
            "model": _digits_model(shapes[0][0], shapes[0][1], image_size),
            "objective": objective,
            "data": {"name": "digits", "options": {}},
            "train": {"steps": steps, "batch_size": 64, "lr": lr, "warmup": max(1, steps // 20), "schedule": "cosine",
                      "min_lr_ratio": 0.05, "weight_decay": 0.05, "eval_every": max(1, steps // 4),
                      "eval_batches": 3, "checkpoint_every": steps, "log_every": 25, "betas": [0.9, 0.95]},
        }

    grid = {"model.layers,model.width,model.heads,model.ffn": [[l, w, w // 64, 4 * w] for l, w in shapes]}
    classify = {"name": "classification", "options": {"pool": "cls"}}
    untrained = base(classify, 0, 1e-3)
    untrained["train"].update(eval_every=0, checkpoint_every=0)
    return [
        {"name": "untrained", "description": "the same encoders before training: the smoothness baseline",
         "base": untrained, "grid": grid, "seeds": seeds[:1], "analyses": ["smoothness"]},
        {"name": "supervised", "description": "sequence-level: classification from scratch (ViT)",
         "base": base(classify, sup_steps, 1e-3), "grid": grid, "seeds": seeds, "analyses": ["smoothness"]},
        {"name": "mae", "description": "token-level: masked autoencoding (MAE)",
         "base": base({"name": "mae", "options": {"mask_ratio": mask_ratio, "decoder_layers": 2,
                                                  "decoder_width": 64, "decoder_heads": 2}}, mae_steps, 1.5e-3),
         "grid": grid, "seeds": seeds, "analyses": ["smoothness"]},
        {"name": "finetune", "description": "the MAE encoders fine-tuned for classification",
         "after": "mae", "init_from": "mae",
         "base": base(classify, ft_steps, 5e-4), "grid": grid, "seeds": seeds, "analyses": ["smoothness"]},
    ]


def quick() -> dict:
    deep = _deepnet_base(steps=200, width=64, eval_every=50, diag_until=50)
    return {
        "name": "quick",
        "description": (
            "Both papers at laptop scale. DeepNet: Post-LN, Pre-LN and DeepNorm encoder-decoders (2L-2L, 6L-6L, "
            "18L-18L, width 64) learn to reverse digit strings with the same learning rate and warm-up. "
            "Bamboo: on scikit-learn's digits (8x8, 2x2 patches = 16 tokens), supervised ViT vs MAE + fine-tuning "
            "at a shallow-wide (4 x 128) and a parameter-matched deep-narrow (16 x 64) shape, 2 seeds, with "
            "token-similarity curves. Small on purpose: the report says which settings to scale up."
        ),
        "expected_minutes": 12,  # measured: 12 min 8 s with --jobs 2 on the 2-core dev machine
        "groups": [
            {"name": "deepnet", "description": "schemes x depths, same lr/warm-up",
             "base": deep,
             "grid": {"model.scheme": ["post_ln", "pre_ln", "deepnorm"],
                      "model.layers,model.decoder_layers": [[2, 2], [6, 6], [18, 18]]},
             "seeds": [0]},
            *_bamboo_groups([(4, 128), (16, 64)], image_size=8, seeds=[0, 1], sup_steps=300, mae_steps=400,
                            ft_steps=200, mask_ratio=0.5),
        ],
        "findings": ["deepnet_postln", "deepnet_preln", "deepnet_update", "bamboo_smoothing", "bamboo_depth"],
    }


def deepnet() -> dict:
    base = _deepnet_base(steps=1000, width=64, eval_every=100, diag_until=200)
    thousand = copy.deepcopy(base)
    thousand["model"].update(scheme="deepnorm", layers=500, decoder_layers=500, width=64, heads=4, ffn=256,
                             checkpoint_activations=True)
    thousand["train"].update(steps=50, batch_size=16, eval_every=25, checkpoint_every=25, diagnostics_every=0)
    return {
        "name": "deepnet",
        "description": (
            "DeepNet's depth sweep: 6L-6L to 100L-100L encoder-decoders (width 64) with post_ln, pre_ln, deepnorm, "
            "ds_init, admin, rezero and sub_ln at one learning rate and warm-up, 2 seeds, stability diagnostics "
            "for the first 200 steps; plus a 1,000-layer (500L-500L) DeepNorm model trained for 50 steps with "
            "activation checkpointing."
        ),
        "expected_minutes": None,
        "groups": [
            {"name": "deepnet", "base": base,
             "grid": {"model.scheme": ["post_ln", "pre_ln", "deepnorm", "ds_init", "admin", "rezero", "sub_ln"],
                      "model.layers,model.decoder_layers": [[6, 6], [18, 18], [50, 50], [100, 100]]},
             "seeds": [0, 1]},
            {"name": "thousand_layers", "base": thousand, "seeds": [0]},
        ],
        "findings": ["deepnet_postln", "deepnet_preln", "deepnet_update"],
    }


def bamboo() -> dict:
    return {
        "name": "bamboo",
        "description": (
            "Bamboo's depth-vs-width question on digits upscaled to 16x16 (2x2 patches = 64 tokens, so MAE at "
            "mask ratio 0.75 still sees 16 patches): supervised ViT vs MAE + fine-tuning at three shapes with "
            "the same block parameters (4 x 256, 16 x 128, 64 x 64), trained about 10x longer than `quick`, "
            "3 seeds, with smoothness curves against the untrained baseline."
        ),
        "expected_minutes": None,
        "groups": _bamboo_groups([(4, 256), (16, 128), (64, 64)], image_size=16, seeds=[0, 1, 2], sup_steps=3000,
                                 mae_steps=6000, ft_steps=2000, mask_ratio=0.75),
        "findings": ["bamboo_smoothing", "bamboo_depth"],
    }


BUILTIN = {"quick": quick, "deepnet": deepnet, "bamboo": bamboo}
