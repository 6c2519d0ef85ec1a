"""Identical language models in kilolayer, torchscale and x-transformers, for side-by-side runs.

Every builder takes one :class:`Spec` and returns an :class:`LM`: the backbone
plus a bias-free LM head, mapping token ids to logits ``(B, T, vocab)``
(``model(src, tgt)`` for an encoder-decoder). Width, depth, heads, FFN size,
vocabulary, sequence length and the residual arrangement (Post-LN, DeepNorm's
up-weighted shortcut before the LN, or Pre-LN) are the same in all three.

Differences the peers do not let us remove (all tiny next to the matmuls):
- x-transformers' attention projections have no biases and its LayerNorm no
  beta; kilolayer and torchscale keep both (``Spec.bias`` can switch
  kilolayer's off).
- torchscale and x-transformers do not implement DeepNorm's init (torchscale
  divides default-init weights; x-transformers only has the shortcut
  constant), which does not change speed.
- x-transformers has no activation checkpointing; torchscale wraps each
  layer with fairscale's ``checkpoint_wrapper``.

torchscale 0.3.0 imports ``timm.models.layers.drop_path`` and timm cannot be
imported here (it needs torchvision), so :func:`install_timm_stub` puts a
small stand-in into ``sys.modules`` first (drop path is never active in these
benchmarks: ``drop_path_rate=0``).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

PEERS = ("kilolayer", "torchscale", "x-transformers")
SCHEMES = ("post_ln", "deepnorm", "pre_ln")


@dataclass(frozen=True)
class Spec:
    """One model, described once for all three libraries."""

    arch: str = "decoder"  # decoder | encoder_decoder
    scheme: str = "deepnorm"  # post_ln | deepnorm | pre_ln
    layers: int = 12  # decoder layers (decoder), encoder layers (encoder_decoder)
    decoder_layers: int = 0  # encoder_decoder only
    width: int = 256
    heads: int = 4
    ffn: int = 1024
    vocab: int = 256
    seq_len: int = 128
    bias: bool = True
    checkpoint: bool = False

    def label(self) -> str:
        depth = f"{self.layers}L-{self.decoder_layers}L" if self.arch == "encoder_decoder" else f"{self.layers}L"
        return f"d={self.width} x {depth}"

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> Spec:
        return replace(self, **changes)

    def tokens_per_sample(self) -> int:
        return 2 * self.seq_len if self.arch == "encoder_decoder" else self.seq_len


class NotSupported(Exception):
    """The peer cannot build this spec (the message says why, in one line)."""


# ---------------------------------------------------------------- timm stand-in


def _drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    """Stochastic depth per sample: zero whole samples with probability ``drop_prob``."""
    if not training or not drop_prob:
        return x
    keep = 1.0 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask / keep if scale_by_keep else x * mask


def install_timm_stub() -> None:
    """Make ``from timm.models.layers import drop_path`` work without importing the real timm."""
    have = sys.modules.get("timm.models.layers")
    if have is not None and hasattr(have, "drop_path"):
        return
    timm = types.ModuleType("timm")
    models = types.ModuleType("timm.models")
    layers = types.ModuleType("timm.models.layers")
    layers.drop_path = _drop_path
    timm.models, models.layers = models, layers
    timm.__path__, models.__path__ = [], []  # packages, so submodule imports resolve through sys.modules
    sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers})


# ---------------------------------------------------------------- versions


def versions() -> dict:
    """Installed versions of torch and the three libraries (``None`` where absent)."""
    from importlib import metadata

    out = {"torch": torch.__version__}
    for dist in ("kilolayer", "torchscale", "x-transformers", "fairscale"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    if out["kilolayer"] is None:
        import kilolayer

        out["kilolayer"] = kilolayer.__version__
    return out


# ---------------------------------------------------------------- the LM wrapper


class LM(nn.Module):
    """Backbone + head; ``forward(*inputs) -> logits``. ``layers`` lists the per-layer modules."""

    def __init__(self, backbone: nn.Module, head: nn.Module | None, call: Callable, layers: list[nn.Module]):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self._call = call
        self._layers = layers

    def layer_modules(self) -> list[nn.Module]:
        return list(self._layers)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        h = self._call(self.backbone, *inputs)
        return self.head(h) if self.head is not None else h


def _head(spec: Spec) -> nn.Linear:
    head = nn.Linear(spec.width, spec.vocab, bias=False)
    nn.init.normal_(head.weight, 0.0, spec.width**-0.5)
    return head


def _check(spec: Spec) -> None:
    if spec.scheme not in SCHEMES:
        raise NotSupported(f"scheme {spec.scheme!r}: benchmarks compare {', '.join(SCHEMES)}")
    if spec.arch not in ("decoder", "encoder_decoder"):
        raise NotSupported(f"arch {spec.arch!r}: benchmarks compare decoder and encoder_decoder")
    if spec.width % spec.heads:
        raise NotSupported(f"width {spec.width} not divisible by heads {spec.heads}")


# ---------------------------------------------------------------- kilolayer


def kilolayer_config(spec: Spec):
    from kilolayer import ModelConfig

    return ModelConfig(
        arch=spec.arch,
        scheme=spec.scheme,
        layers=spec.layers,
        decoder_layers=spec.decoder_layers,
        width=spec.width,
        heads=spec.heads,
        ffn=spec.ffn,
        vocab_size=spec.vocab,
        max_len=spec.seq_len,
        bias=spec.bias,
        checkpoint_activations=spec.checkpoint,
    )


def build_kilolayer(spec: Spec) -> LM:
    from kilolayer import build_model

    _check(spec)
    backbone = build_model(kilolayer_config(spec))
    if spec.checkpoint:
        from kilolayer.train.host import prepare_checkpointing
        from kilolayer.train.parallelize import checkpoint_layers

        # applied from outside the model with the default heap handling, as the trainer does
        checkpoint_layers(backbone, prepare_checkpointing())
    layers = [layer for stack in backbone.stacks() for layer in stack.layers]
    if spec.arch == "encoder_decoder":
        return LM(backbone, _head(spec), lambda m, src, tgt: m(src, tgt), layers)
    return LM(backbone, _head(spec), lambda m, tokens: m(tokens), layers)


# ---------------------------------------------------------------- torchscale


def build_torchscale(spec: Spec) -> LM:
    _check(spec)
    install_timm_stub()
    from torchscale.architecture.config import DecoderConfig, EncoderDecoderConfig
    from torchscale.architecture.decoder import Decoder
    from torchscale.architecture.encoder_decoder import EncoderDecoder
    from torchscale.component.embedding import PositionalEmbedding

    if not spec.bias:
        raise NotSupported("torchscale always uses biases")
    deepnorm, pre = spec.scheme == "deepnorm", spec.scheme == "pre_ln"
    # every flag explicit: torchscale's flags override each other (subln defaults to True)
    common = dict(
        activation_fn="gelu",
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        drop_path_rate=0.0,
        deepnorm=deepnorm,
        subln=False,
        no_scale_embedding=True,
        layernorm_embedding=False,
        vocab_size=spec.vocab,
        checkpoint_activations=spec.checkpoint,
        layernorm_eps=1e-5,
    )
    d = spec.width

    def positions():
        # fairseq-style positions start at 2
        return PositionalEmbedding(spec.seq_len + 2, d)

    if spec.arch == "decoder":
        args = DecoderConfig(
            decoder_embed_dim=d,
            decoder_attention_heads=spec.heads,
            decoder_ffn_embed_dim=spec.ffn,
            decoder_layers=spec.layers,
            decoder_normalize_before=pre,
            max_target_positions=spec.seq_len,
            **common,
        )
        backbone = Decoder(args, embed_tokens=nn.Embedding(spec.vocab, d), embed_positions=positions())
        layers = list(backbone.layers)
        call = lambda m, tokens: m(tokens)[0]  # output projection included
    else:
        args = EncoderDecoderConfig(
            encoder_embed_dim=d,
            encoder_attention_heads=spec.heads,
            encoder_ffn_embed_dim=spec.ffn,
            encoder_layers=spec.layers,
            encoder_normalize_before=pre,
            decoder_embed_dim=d,
            decoder_attention_heads=spec.heads,
            decoder_ffn_embed_dim=spec.ffn,
            decoder_layers=spec.decoder_layers,
            decoder_normalize_before=pre,
            max_source_positions=spec.seq_len,
            max_target_positions=spec.seq_len,
            **common,
        )
        backbone = EncoderDecoder(
            args,
            encoder_embed_tokens=nn.Embedding(spec.vocab, d),
            encoder_embed_positions=positions(),
            decoder_embed_tokens=nn.Embedding(spec.vocab, d),
            decoder_embed_positions=positions(),
        )
        layers = list(backbone.encoder.layers) + list(backbone.decoder.layers)
        call = lambda m, src, tgt: m(src, tgt)[0]
    # torchscale's flags can silently override each other: confirm what was built
    for layer in layers:
        if layer.normalize_before != pre:
            raise NotSupported(f"torchscale built normalize_before={layer.normalize_before} for {spec.scheme}")
        if (layer.alpha != 1.0) != deepnorm:
            raise NotSupported(f"torchscale built alpha={layer.alpha} for {spec.scheme}")
    return LM(backbone, None, call, layers)


# ---------------------------------------------------------------- x-transformers


def build_xtransformers(spec: Spec) -> LM:
    _check(spec)
    if spec.arch != "decoder":
        raise NotSupported("x-transformers: only the decoder-only spec is built here")
    if spec.checkpoint:
        raise NotSupported("x-transformers has no activation checkpointing")
    from x_transformers import Decoder, TransformerWrapper

    from kilolayer import deepnorm_constants

    if spec.ffn % spec.width:
        raise NotSupported(f"x-transformers sets the FFN as a multiple of width; {spec.ffn}/{spec.width}")
    extra = {}
    if spec.scheme == "deepnorm":
        # x <- LN(alpha x + F(x)): Post-LN with the shortcut scaled by a constant
        extra["scale_residual_constant"] = deepnorm_constants("decoder", decoder_layers=spec.layers)["decoder"][0]
    backbone = TransformerWrapper(
        num_tokens=spec.vocab,
        max_seq_len=spec.seq_len,
        attn_layers=Decoder(
            dim=spec.width,
            depth=spec.layers,
            heads=spec.heads,
            attn_dim_head=spec.width // spec.heads,
            ff_mult=spec.ffn // spec.width,
            pre_norm=spec.scheme == "pre_ln",
            norm_add_unit_offset=False,
            attn_flash=True,  # its SDPA path, the faster one on this CPU
            **extra,
        ),
    )
    layers = [block for block in backbone.attn_layers.layers]
    return LM(backbone, None, lambda m, tokens: m(tokens), layers)


BUILDERS: dict[str, Callable[[Spec], LM]] = {
    "kilolayer": build_kilolayer,
    "torchscale": build_torchscale,
    "x-transformers": build_xtransformers,
}


def build(peer: str, spec: Spec) -> LM:
    """Build ``peer``'s model for ``spec`` (raises :class:`NotSupported` with a one-line reason)."""
    return BUILDERS[peer](spec)


def batch(spec: Spec, batch_size: int, generator: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Random token inputs and next-token targets for ``spec``."""
    T = spec.seq_len
    if spec.arch == "encoder_decoder":
        src = torch.randint(0, spec.vocab, (batch_size, T), generator=generator)
        tgt = torch.randint(0, spec.vocab, (batch_size, T + 1), generator=generator)
        return (src, tgt[:, :-1]), tgt[:, 1:]
    tokens = torch.randint(0, spec.vocab, (batch_size, T + 1), generator=generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def matmul_parameters(spec: Spec) -> int:
    """Parameters of the LM head (the only matmul the backbone FLOP count leaves out)."""
    return spec.width * spec.vocab


def model_flops_per_token(spec: Spec) -> float:
    """Training FLOPs per token: kilolayer.training_flops per sample / tokens + 6 d V for the LM head."""
    from kilolayer import training_flops

    per_sample = training_flops(kilolayer_config(spec), spec.seq_len, spec.seq_len)
    head = 6 * matmul_parameters(spec) * spec.seq_len  # the head runs on target tokens only
    return (per_sample + head) / spec.tokens_per_sample()
