"""Parameter and FLOP budgets from a config alone, and the depth-width configurator.

``count_parameters(cfg)`` is exact: it equals ``sum(p.numel())`` of the built
model for every scheme. ``training_flops`` is docs/bamboo.md#model-flops-and-mfu: model
FLOPs of one training step = 6 x (matmul parameters x tokens they act on) +
12 x layers x heads x head size x query length x key length, summed over
self- and cross-attention. Non-matmul work (norms, activations, softmax) is
not counted, as in the PaLM/nanoGPT MFU convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kilolayer.config import ModelConfig, model_config
from kilolayer.errors import ConfigError
from kilolayer.nn.residual import Depth, Site, make_scheme


def _sublayer_params(cfg: ModelConfig, scheme, site: Site) -> tuple[int, int]:
    """(all parameters, matmul weights) of one residual sublayer."""
    d, f, b = cfg.width, cfg.ffn, int(cfg.bias)
    if site.kind == "ffn":
        matmul = 2 * d * f
        total = matmul + b * (f + d) + (2 * f if scheme.ffn_inner_norm(site) else 0)
        total += 2 if scheme.ffn_shifts(site) else 0
    else:
        matmul = 4 * d * d
        total = matmul + b * 4 * d
        total += 2 * d if scheme.attn_inner_norm(site) else 0
        total += cfg.heads if scheme.head_scale(site) else 0
    norms = int(scheme.pre_norm) + int(scheme.out_norm(site)) + int(scheme.post_norm)
    total += 2 * d * norms
    total += d if scheme.learned_shortcut else 0
    total += {"channel": d, "scalar": 1}.get(scheme.branch_scale, 0)
    total += 1 if scheme.branch_shift else 0
    return total, matmul


def _side_params(cfg: ModelConfig, scheme, side: str, n: int, cross: bool) -> tuple[int, int, int]:
    """(all parameters, matmul weights, cross-attention K/V weights) of one stack."""
    total = matmul = 0
    kinds = ["self_attn", "cross_attn", "ffn"] if cross else ["self_attn", "ffn"]
    for i in range(n):
        for kind in kinds:
            t, m = _sublayer_params(cfg, scheme, Site(side, i, kind))
            total, matmul = total + t, matmul + m
        total += 1 if scheme.branch_scale == "layer" else 0
    total += scheme.history.parameter_count(n, cfg.width)
    final = scheme.final_part(side, cfg.width, cfg.norm_eps)
    total += sum(p.numel() for p in final.parameters()) if final is not None else 0
    cross_kv = 2 * cfg.width * cfg.width * n if cross else 0
    return total, matmul, cross_kv


def _token_embedding_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.width + (cfg.max_len * cfg.width if cfg.positions == "learned" else 0)


@dataclass(frozen=True)
class Budget:
    parameters: int  # all trainable parameters of the backbone
    matmul_parameters: int  # weights of the matmuls each token passes through (incl. patch projection)
    embedding_parameters: int
    flops_per_token: float  # training FLOPs per token processed (fwd + bwd)
    seq_len: int
    tokens_per_sample: int


def count_parameters(cfg: ModelConfig | dict) -> int:
    """Exact number of parameters of ``build_model(cfg)``."""
    return _counts(model_config(cfg))[0]


def _scheme(cfg: ModelConfig):
    return make_scheme(
        cfg.scheme,
        Depth(cfg.arch, cfg.encoder_depth, cfg.decoder_depth),
        layerscale_init=cfg.layerscale_init,
        ds_init_variant=cfg.ds_init_variant,
    )


def training_flops(cfg: ModelConfig | dict, src_len: int | None = None, tgt_len: int | None = None) -> float:
    """Model FLOPs of one training step (forward + backward) for ONE sample.

    ``src_len`` is the encoder's length (tokens, or patches + CLS), ``tgt_len``
    the decoder's; each defaults to the model's full length.
    """
    cfg = model_config(cfg)
    scheme = _scheme(cfg)
    d = cfg.width
    flops = 0.0
    if cfg.encoder_depth:
        S = src_len or cfg.seq_len
        _, m, _ = _side_params(cfg, scheme, "encoder", cfg.encoder_depth, False)
        if cfg.input == "patches":
            n_patch = S - int(cfg.cls_token)
            m_embed = cfg.channels * cfg.patch_size**2 * d
            # the patch projection needs no input gradient: forward 2 + backward 2 per weight
            flops += 4 * m_embed * n_patch
        flops += 6 * m * S + 12 * cfg.encoder_depth * d * S * S
    if cfg.decoder_depth:
        T = tgt_len or cfg.max_len
        cross = cfg.arch == "encoder_decoder"
        S = src_len or cfg.seq_len
        _, m, kv = _side_params(cfg, scheme, "decoder", cfg.decoder_depth, cross)
        flops += 6 * (m - kv) * T + 12 * cfg.decoder_depth * d * T * T
        if cross:
            flops += 6 * kv * S + 12 * cfg.decoder_depth * d * T * S
    return float(flops)


def budget(cfg: ModelConfig | dict, seq_len: int | None = None) -> Budget:
    """Parameters and training FLOPs per token at ``seq_len`` (default: the model's full length).

    For an encoder-decoder, source and target both have ``seq_len`` tokens and
    "per token" counts both.
    """
    cfg = model_config(cfg)
    total, matmul, embed = _counts(cfg)
    if cfg.input == "patches":
        T = cfg.seq_len
    else:
        T = min(seq_len or cfg.max_len, cfg.max_len)
    tokens = 2 * T if cfg.arch == "encoder_decoder" else T
    flops = training_flops(cfg, T, T)
    return Budget(total, matmul, embed, flops / tokens, T, tokens)


def _counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(all parameters, matmul weights incl. the patch projection, embedding parameters)."""
    scheme = _scheme(cfg)
    d = cfg.width
    total = matmul = embed = 0
    if cfg.encoder_depth:
        t, m, _ = _side_params(cfg, scheme, "encoder", cfg.encoder_depth, False)
        total, matmul = total + t, matmul + m
        if cfg.input == "patches":
            proj = cfg.channels * cfg.patch_size**2 * d
            e = proj + d + (cfg.num_patches + int(cfg.cls_token)) * d + (d if cfg.cls_token else 0)
            matmul += proj
        else:
            e = _token_embedding_params(cfg)
        total, embed = total + e, embed + e
    if cfg.decoder_depth:
        t, m, _ = _side_params(cfg, scheme, "decoder", cfg.decoder_depth, cfg.arch == "encoder_decoder")
        e = _token_embedding_params(cfg)
        total, matmul, embed = total + t + e, matmul + m, embed + e
    return total, matmul, embed


# ---------------------------------------------------------------- configurator


def parse_count(text: str, flag: str = "--params") -> int:
    """A parameter count as a user writes it: '85M', '1.3B', '350k' or a plain integer."""
    t = text.strip().lower().replace("_", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}.get(t[-1:], None)
    try:
        value = float(t[:-1]) * mult if mult else float(t)
        if not math.isfinite(value) or abs(value) > 1e15:
            raise ValueError
        return int(value)
    except (ValueError, OverflowError):
        raise ConfigError(f"{flag} {text!r}: expected a count such as 86M, 1.3B or 350000 (at most 1e15)") from None


def _with(cfg: ModelConfig, layers: int, width: int, head_dim: int, ffn_ratio: float) -> ModelConfig:
    data = cfg.model_dump()
    data.update(layers=layers, width=width, heads=width // head_dim, ffn=max(1, round(ffn_ratio * width)))
    if cfg.arch == "encoder_decoder":
        data["decoder_layers"] = max(1, round(layers * cfg.decoder_layers / cfg.layers))
    return ModelConfig.model_validate(data)


def matched_configs(
    cfg: ModelConfig | dict,
    params: int | None = None,
    tolerance: float = 0.03,
    head_dim: int = 64,
    max_depth_factor: int = 8,
    deeper_only: bool = True,
    depths: range | None = None,
) -> list[ModelConfig]:
    """Configs shaped like ``cfg`` (same FFN ratio, head size ``head_dim``, width a multiple of it)
    whose parameter count is within ``tolerance`` of ``params`` (default: ``cfg``'s own).

    One config per width: for each width the depth that comes closest (among ``depths``, when given).
    Sorted by depth.
    """
    cfg = model_config(cfg)
    target = params if params is not None else count_parameters(cfg)
    ratio = cfg.ffn / cfg.width
    lo = cfg.layers if deeper_only and params is None else 1
    best: dict[int, tuple[float, ModelConfig]] = {}
    candidates = range(lo, cfg.layers * max_depth_factor + 1 if params is None else 257)
    for layers in depths if depths is not None else candidates:
        if count_parameters(_with(cfg, layers, head_dim, head_dim, ratio)) > target * (1 + tolerance):
            break  # the narrowest model at this depth is already over budget, and deeper ones more so
        # parameters grow with width; bisect over multiples of head_dim
        a, b = 1, 8192 // head_dim
        while a < b:
            mid = (a + b) // 2
            if count_parameters(_with(cfg, layers, mid * head_dim, head_dim, ratio)) < target:
                a = mid + 1
            else:
                b = mid
        for k in (a - 1, a):
            if k < 1:
                continue
            c = _with(cfg, layers, k * head_dim, head_dim, ratio)
            err = abs(count_parameters(c) - target) / target
            if err <= tolerance and (c.width not in best or err < best[c.width][0]):
                best[c.width] = (err, c)
    out = [c for _, c in best.values()]
    if deeper_only and params is None:
        out = [c for c in out if c.width <= cfg.width]
    return sorted(out, key=lambda c: (c.layers, -c.width))
