"""torchscale 0.3.0 as a test peer: import shim, config builders and weight copying.

torchscale is installed with ``--no-deps`` (plus fairscale 0.4.0). Its
``torchscale.component.droppath`` does ``from timm.models.layers import
drop_path``, and timm cannot be imported here because it needs torchvision,
which we do not install. Drop path is the only thing torchscale takes from
timm, and our comparisons run with ``drop_path_rate=0``, so
:func:`install_timm_stand_in` puts a three-module stand-in into
``sys.modules`` whose ``drop_path`` is the identity at rate 0 and refuses any
other rate (a silent no-op would make a nonzero-rate comparison meaningless).
"""

from __future__ import annotations

import sys
import types

import torch

from kilolayer.nn.attention import Attention
from kilolayer.nn.transformer import Stack


def _drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    if drop_prob:
        raise NotImplementedError(
            f"tests/peers.py timm stand-in: drop_path rate {drop_prob} is not supported (rate 0 only)"
        )
    return x


def install_timm_stand_in() -> None:
    """Make ``from timm.models.layers import drop_path`` resolve without the real timm."""
    if "timm.models.layers" in sys.modules:
        return
    timm = types.ModuleType("timm")
    models = types.ModuleType("timm.models")
    layers = types.ModuleType("timm.models.layers")
    layers.drop_path = _drop_path
    timm.__path__, models.__path__ = [], []  # mark as packages so submodule imports go through sys.modules
    timm.models, models.layers = models, layers
    sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers})


install_timm_stand_in()

from torchscale.architecture.config import DecoderConfig, EncoderConfig, EncoderDecoderConfig  # noqa: E402
from torchscale.architecture.decoder import Decoder as TSDecoder  # noqa: E402
from torchscale.architecture.encoder import Encoder as TSEncoder  # noqa: E402
from torchscale.architecture.encoder_decoder import EncoderDecoder as TSEncoderDecoder  # noqa: E402

# Flags that must be pinned whatever the scheme: torchscale's defaults include
# subln=True, which silently forces Pre-LN and turns DeepNorm off.
_COMMON = dict(
    activation_fn="gelu",
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    drop_path_rate=0.0,
    subln=False,
    no_scale_embedding=True,
    layernorm_embedding=False,
    layernorm_eps=1e-5,
    vocab_size=-1,
    no_output_layer=True,
    multiway=False,
    bert_init=False,
    rel_pos_buckets=0,
    max_rel_pos=0,
    xpos_rel_pos=False,
    moe_freq=0,
    checkpoint_activations=False,
    fsdp=False,
)


def torchscale_encoder(width: int, heads: int, ffn: int, layers: int, deepnorm: bool, activation: str = "gelu"):
    """A Post-LN (``deepnorm=False``) or DeepNorm encoder with no embeddings and no output layer."""
    args = EncoderConfig(
        encoder_embed_dim=width,
        encoder_attention_heads=heads,
        encoder_ffn_embed_dim=ffn,
        encoder_layers=layers,
        encoder_normalize_before=False,
        normalize_output=False,
        deepnorm=deepnorm,
        **{**_COMMON, "activation_fn": activation},
    )
    enc = TSEncoder(args)
    _check_built(enc.layers, deepnorm)
    return enc


def torchscale_decoder(width: int, heads: int, ffn: int, layers: int, deepnorm: bool, activation: str = "gelu"):
    """A Post-LN or DeepNorm decoder-only stack (causal, no cross-attention), no embeddings, no output layer."""
    args = DecoderConfig(
        decoder_embed_dim=width,
        decoder_attention_heads=heads,
        decoder_ffn_embed_dim=ffn,
        decoder_layers=layers,
        decoder_normalize_before=False,
        deepnorm=deepnorm,
        share_decoder_input_output_embed=False,
        **{**_COMMON, "activation_fn": activation},
    )
    dec = TSDecoder(args)
    _check_built(dec.layers, deepnorm)
    assert all(layer.encoder_attn is None for layer in dec.layers)
    return dec


def torchscale_encoder_decoder(
    width: int, heads: int, ffn: int, layers: int, decoder_layers: int, deepnorm: bool, activation: str = "gelu"
):
    """A Post-LN or DeepNorm encoder-decoder with no embeddings and no output layer."""
    args = EncoderDecoderConfig(
        encoder_embed_dim=width,
        encoder_attention_heads=heads,
        encoder_ffn_embed_dim=ffn,
        encoder_layers=layers,
        decoder_embed_dim=width,
        decoder_attention_heads=heads,
        decoder_ffn_embed_dim=ffn,
        decoder_layers=decoder_layers,
        encoder_normalize_before=False,
        decoder_normalize_before=False,
        normalize_output=False,
        deepnorm=deepnorm,
        share_all_embeddings=False,
        share_decoder_input_output_embed=False,
        **{**_COMMON, "activation_fn": activation},
    )
    model = TSEncoderDecoder(args)
    _check_built(list(model.encoder.layers) + list(model.decoder.layers), deepnorm)
    return model


def _check_built(layers, deepnorm: bool) -> None:
    """torchscale's flags override each other silently: confirm Post-LN and the alpha we asked for."""
    for layer in layers:
        assert layer.normalize_before is False, "torchscale built a Pre-LN layer"
        assert (layer.alpha != 1.0) == deepnorm, f"torchscale built alpha={layer.alpha}"


# ---------------------------------------------------------------- weight copying


@torch.no_grad()
def _copy_linear(dst: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor) -> None:
    dst.weight.copy_(weight)
    dst.bias.copy_(bias)


@torch.no_grad()
def _copy_norm(dst: torch.nn.LayerNorm, src: torch.nn.LayerNorm) -> None:
    dst.weight.copy_(src.weight)
    dst.bias.copy_(src.bias)


@torch.no_grad()
def _copy_attention(dst, src: Attention) -> None:
    """Split our fused ``qkv`` (self) or ``q`` + ``kv`` (cross) into torchscale's q/k/v projections."""
    d = src.width
    if src.cross:
        q_w, q_b = src.q.weight, src.q.bias
        k_w, v_w = src.kv.weight[:d], src.kv.weight[d:]
        k_b, v_b = src.kv.bias[:d], src.kv.bias[d:]
    else:
        q_w, k_w, v_w = src.qkv.weight[:d], src.qkv.weight[d : 2 * d], src.qkv.weight[2 * d :]
        q_b, k_b, v_b = src.qkv.bias[:d], src.qkv.bias[d : 2 * d], src.qkv.bias[2 * d :]
    _copy_linear(dst.q_proj, q_w, q_b)
    _copy_linear(dst.k_proj, k_w, k_b)
    _copy_linear(dst.v_proj, v_w, v_b)
    _copy_linear(dst.out_proj, src.out.weight, src.out.bias)


@torch.no_grad()
def copy_stack(ts_layers, stack: Stack) -> None:
    """Copy a kilolayer Post-LN/DeepNorm stack's weights into torchscale's layers, sublayer by sublayer."""
    assert len(ts_layers) == len(stack.layers)
    for ts, ours in zip(ts_layers, stack.layers):
        _copy_attention(ts.self_attn, ours.self_attn.branch)
        _copy_norm(ts.self_attn_layer_norm, ours.self_attn.post_norm)
        if ours.cross_attn is not None:
            _copy_attention(ts.encoder_attn, ours.cross_attn.branch)
            _copy_norm(ts.encoder_attn_layer_norm, ours.cross_attn.post_norm)
        ffn = ours.ffn.branch
        _copy_linear(ts.ffn.fc1, ffn.fc1.weight, ffn.fc1.bias)
        _copy_linear(ts.ffn.fc2, ffn.fc2.weight, ffn.fc2.bias)
        _copy_norm(ts.final_layer_norm, ours.ffn.post_norm)


# ---------------------------------------------------------------- running torchscale on hidden states


def run_encoder(enc, x: torch.Tensor, padding_mask=None) -> torch.Tensor:
    """torchscale's encoder on input hidden states ``x`` (no positions, no embedding scale)."""
    return enc(None, encoder_padding_mask=padding_mask, token_embeddings=x, features_only=True)["encoder_out"]


def run_decoder(dec, y: torch.Tensor, memory=None, memory_padding_mask=None, padding_mask=None):
    """torchscale's decoder on input hidden states ``y``, attending to ``memory`` if given."""
    # forward() reads the length from the token tensor even when token_embeddings are given
    dummy_tokens = torch.zeros(y.shape[:2], dtype=torch.long)
    encoder_out = None
    if memory is not None:
        mem_mask = memory_padding_mask
        if mem_mask is None:
            mem_mask = torch.zeros(memory.shape[:2], dtype=torch.bool)
        encoder_out = {"encoder_out": memory, "encoder_padding_mask": mem_mask}
    out, _ = dec(
        dummy_tokens,
        self_attn_padding_mask=padding_mask,
        encoder_out=encoder_out,
        token_embeddings=y,
        features_only=True,
    )
    return out
