"""Stacks, embeddings and the three backbones (encoder, decoder, encoder-decoder).

A backbone maps inputs to final hidden states ``(B, T, width)``; heads belong
to objectives. Every stack takes an optional ``observe(layer_index, hidden)``
callback: index 0 is the embedding output, index i the output of layer i (the
last one after the stack's final norm, if the scheme has one). Analysis uses
it so that a 1,000-layer model never holds more than one layer's activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from kilolayer.config import ModelConfig, model_config
from kilolayer.errors import InputError
from kilolayer.nn.layers import Layer
from kilolayer.nn.residual import SCHEME_OPTIONS, Depth, Scheme, make_scheme, xavier_

Observer = Callable[[int, torch.Tensor], None]


# ---------------------------------------------------------------- embeddings


def sinusoidal_positions(length: int, width: int) -> torch.Tensor:
    """The fixed sin/cos table of "Attention is all you need" (sin on even, cos on odd channels)."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)[:, : width // 2]
    return table


class TokenEmbedding(nn.Module):
    """Token embedding (times sqrt(width) if ``embed_scale``) plus learned, sinusoidal or no positions."""

    def __init__(self, cfg: ModelConfig, std: float, name: str = "tokens"):
        super().__init__()
        self.vocab_size, self.max_len = cfg.vocab_size, cfg.max_len
        self.name = name  # how input errors refer to this input (src/tgt in an encoder-decoder)
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        self.scale = math.sqrt(cfg.width) if cfg.embed_scale else 1.0
        self.positions = None
        if cfg.positions == "learned":
            self.positions = nn.Parameter(torch.empty(cfg.max_len, cfg.width))
        elif cfg.positions == "sinusoidal":
            self.register_buffer("sinusoid", sinusoidal_positions(cfg.max_len, cfg.width), persistent=False)
        self.kind = cfg.positions
        with torch.no_grad():
            self.tokens.weight.normal_(0.0, std)
            if self.positions is not None:
                self.positions.normal_(0.0, cfg.width**-0.5)

    def check(self, tokens: torch.Tensor, name: str = "tokens") -> None:
        if not isinstance(tokens, torch.Tensor):
            raise InputError(f"{name}: expected a torch.Tensor of token ids, got {type(tokens).__name__}")
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise InputError(
                f"{name}: expected integer token ids of shape (batch, length), got {tuple(tokens.shape)} {tokens.dtype}"
            )
        if tokens.shape[1] > self.max_len:
            raise InputError(f"{name}: length {tokens.shape[1]} exceeds model.max_len={self.max_len}")
        # The id range is read on the CPU only (elsewhere it would wait for the device), and only in eager mode:
        # reading a value out of a tensor would split a compiled graph (train.compile: model), and the
        # trainer's data sources are checked against model.vocab_size when a run is built.
        if tokens.device.type == "cpu" and tokens.numel() and not torch.compiler.is_compiling():
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.vocab_size:
                raise InputError(f"{name}: ids must lie in [0, {self.vocab_size}), got [{lo}, {hi}]")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.check(tokens, self.name)
        x = self.tokens(tokens)
        if self.scale != 1.0:
            x = x * self.scale
        T = tokens.shape[1]
        if self.positions is not None:
            x = x + self.positions[:T]
        elif self.kind == "sinusoidal":
            x = x + self.sinusoid[:T].to(x.dtype)
        return x


class PatchEmbedding(nn.Module):
    """Image -> non-overlapping patches -> linear projection, plus an optional CLS token and learned positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.image_size, self.patch_size, self.channels = cfg.image_size, cfg.patch_size, cfg.channels
        self.grid = cfg.image_size // cfg.patch_size
        self.proj = nn.Linear(cfg.channels * cfg.patch_size**2, cfg.width)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.width)) if cfg.cls_token else None
        self.positions = nn.Parameter(torch.empty(self.grid**2 + int(cfg.cls_token), cfg.width))
        with torch.no_grad():
            xavier_(self.proj.weight, 1.0, "uniform")
            self.proj.bias.zero_()
            self.positions.normal_(0.0, 0.02)
            if self.cls is not None:
                self.cls.normal_(0.0, 0.02)

    def check(self, images: torch.Tensor) -> None:
        want = (self.channels, self.image_size, self.image_size)
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or tuple(images.shape[1:]) != want:
            got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise InputError(f"images: expected shape (batch, {', '.join(map(str, want))}), got {got}")
        if not images.is_floating_point():
            raise InputError(f"images: expected a floating-point tensor, got {images.dtype}")

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, grid*grid, C*p*p), row-major over the grid."""
        B, C, _, _ = images.shape
        p, g = self.patch_size, self.grid
        x = images.reshape(B, C, g, p, g, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(B, g * g, p * p * C)

    def forward(self, images: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep`` (B, K) patch indices to embed (MAE's visible patches); all patches if None."""
        self.check(images)
        patches = self.patchify(images)
        positions = self.positions[1 if self.cls is not None else 0 :]
        if keep is not None:  # select first: only the kept patches are projected
            patches = torch.gather(patches, 1, keep[..., None].expand(-1, -1, patches.shape[-1]))
            positions = positions[keep]
        x = self.proj(patches) + positions
        if self.cls is not None:
            cls = (self.cls + self.positions[:1]).expand(x.shape[0], -1, -1)
            x = torch.cat([cls, x], dim=1)
        return x


# ---------------------------------------------------------------- masks


def check_padding_mask(mask: torch.Tensor | None, shape: tuple, name: str) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(shape):
        got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InputError(f"{name}: expected a bool tensor of shape {tuple(shape)} (True = padding), got {got}")


def attention_mask(padding: torch.Tensor | None, causal: bool, length: int, device) -> torch.Tensor | None:
    """Bool (B or 1, 1, T, S) mask, True = may attend; None when SDPA needs none (or does causal itself)."""
    if padding is None:
        return None
    keep = ~padding[:, None, None, :]
    if causal:
        keep = keep & torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return keep


# ---------------------------------------------------------------- stacks


class Stack(nn.Module):
    """N layers of one side; what each layer reads (the scheme's layer history) and what follows the last
    layer (the scheme's final part, ``final_norm``: a LayerNorm for pre-norm schemes) come from the scheme."""

    def __init__(self, cfg: ModelConfig, scheme: Scheme, side: str, n: int, cross: bool = False):
        super().__init__()
        self.side = side
        self.causal = side == "decoder"
        self.scheme = scheme  # told the training step (set_training_step)
        self.layers = nn.ModuleList(Layer(cfg, scheme, side, i, cross=cross) for i in range(n))
        self.history = scheme.history(n, cfg.width, cfg.norm_eps)
        self.final_norm = scheme.final_part(side, cfg.width, cfg.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_padding_mask: torch.Tensor | None = None,
        observe: Observer | None = None,
    ) -> torch.Tensor:
        mask = attention_mask(padding_mask, self.causal, x.shape[1], x.device)
        memory_mask = None if memory_padding_mask is None else ~memory_padding_mask[:, None, None, :]
        if observe is not None:
            observe(0, x)
        outputs: list[torch.Tensor] = []  # the history's record of this pass
        x = self.history.push(outputs, x)
        last = len(self.layers)
        for i, layer in enumerate(self.layers, 1):
            y = layer(x, mask, memory, memory_mask)
            x = self.history.push(outputs, y)
            if i == last and self.final_norm is not None:
                if observe is not None and getattr(observe, "before_final_norm", False):
                    observe(i, y)  # the last block's own output, before the norm's shared bias and scale
                    observe = None
                x = self.final_norm(x)
            if observe is not None:
                observe(i, x if i == last else y)
        return x


# ---------------------------------------------------------------- backbones


def scheme_for(cfg: ModelConfig) -> Scheme:
    """The scheme a backbone of ``cfg`` is built with (``kilolayer describe`` shows the same one)."""
    options = {key: getattr(cfg, key) for key in SCHEME_OPTIONS}
    return make_scheme(cfg.scheme, Depth(cfg.arch, cfg.encoder_depth, cfg.decoder_depth), **options)


class Backbone(nn.Module):
    """Common parts of the three backbones."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.scheme = scheme_for(cfg)
        self.depth = self.scheme.depth
        self.scheme.attach(self)

    @property
    def width(self) -> int:
        return self.config.width

    def stacks(self) -> list[Stack]:
        return [m for m in self.children() if isinstance(m, Stack)]


class EncoderModel(Backbone):
    """Encoder-only backbone over tokens (BERT-like) or image patches (ViT-like)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if cfg.input == "patches":
            self.embed = PatchEmbedding(cfg)
        else:
            self.embed = TokenEmbedding(cfg, self.scheme.embedding_std("encoder", cfg.width))
        self.encoder = Stack(cfg, self.scheme, "encoder", cfg.layers)

    def forward(
        self, inputs: torch.Tensor, padding_mask: torch.Tensor | None = None, observe: Observer | None = None
    ) -> torch.Tensor:
        x = self.embed(inputs)
        check_padding_mask(padding_mask, x.shape[:2], "padding_mask")
        return self.encoder(x, padding_mask, observe=observe)


class DecoderModel(Backbone):
    """Decoder-only (causal) backbone over tokens (GPT-like)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed = TokenEmbedding(cfg, self.scheme.embedding_std("decoder", cfg.width))
        self.decoder = Stack(cfg, self.scheme, "decoder", cfg.layers)

    def forward(
        self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None, observe: Observer | None = None
    ) -> torch.Tensor:
        x = self.embed(tokens)
        check_padding_mask(padding_mask, tokens.shape, "padding_mask")
        return self.decoder(x, padding_mask, observe=observe)


class EncoderDecoderModel(Backbone):
    """Encoder-decoder backbone (source tokens -> target tokens) with cross-attention in every decoder layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.src_embed = TokenEmbedding(cfg, self.scheme.embedding_std("encoder", cfg.width), name="src")
        self.tgt_embed = TokenEmbedding(cfg, self.scheme.embedding_std("decoder", cfg.width), name="tgt")
        self.encoder = Stack(cfg, self.scheme, "encoder", cfg.layers)
        self.decoder = Stack(cfg, self.scheme, "decoder", cfg.decoder_layers, cross=True)

    def encode(
        self, src: torch.Tensor, src_padding_mask: torch.Tensor | None = None, observe: Observer | None = None
    ) -> torch.Tensor:
        x = self.src_embed(src)
        check_padding_mask(src_padding_mask, src.shape, "src_padding_mask")
        return self.encoder(x, src_padding_mask, observe=observe)

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        tgt_padding_mask: torch.Tensor | None = None,
        src_padding_mask: torch.Tensor | None = None,
        observe: Observer | None = None,
    ) -> torch.Tensor:
        y = self.tgt_embed(tgt)
        check_padding_mask(tgt_padding_mask, tgt.shape, "tgt_padding_mask")
        return self.decoder(y, tgt_padding_mask, memory, src_padding_mask, observe=observe)

    def forward(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        src_padding_mask: torch.Tensor | None = None,
        tgt_padding_mask: torch.Tensor | None = None,
        observe: Observer | None = None,
        observe_decoder: Observer | None = None,
    ) -> torch.Tensor:
        memory = self.encode(src, src_padding_mask, observe)
        return self.decode(tgt, memory, tgt_padding_mask, src_padding_mask, observe_decoder)


BACKBONES = {"encoder": EncoderModel, "decoder": DecoderModel, "encoder_decoder": EncoderDecoderModel}


def build_model(cfg: ModelConfig | dict) -> Backbone:
    """Build the backbone that the ``model`` config section describes (a dict or a ModelConfig)."""
    cfg = model_config(cfg)
    return BACKBONES[cfg.arch](cfg)


def data_dependent_init(model: nn.Module, run: Callable[[], object]) -> dict | None:
    """Finish the initialisation that a scheme takes from data, for a freshly built ``model``.

    ``model`` is a backbone or a module holding backbones (a task); ``run`` runs one forward pass of it on a
    representative batch. Schemes without a data-dependent init (all but Admin with ``model.admin_omega:
    profile``) leave the model alone and ``run`` uncalled, so callers call this unconditionally after building
    and before training. Returns what the scheme measured (Admin: the final ratio per side), for a module
    holding backbones ``{backbone name: that}``; None if nothing was measured.
    """
    if isinstance(model, Backbone):
        return model.scheme.data_dependent_init(model, run)
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, Backbone) and (out := m.scheme.data_dependent_init(m, run)) is not None:
            found[name] = out
    return found or None


def set_training_step(model: nn.Module, step: int) -> None:
    """Tell every stack of ``model`` (a backbone, or a module holding backbones and stacks, such as a task with an
    MAE decoder) that ``step`` updates have been applied. The trainer calls it after each update; schemes whose
    forward follows training progress (BranchNorm) keep the step in the model, so checkpoints carry it, and the
    others ignore it."""
    for stack in _stacks(model):
        stack.scheme.on_step(stack, step)


def _stacks(module: nn.Module) -> list[Stack]:
    """The stacks in ``module``, found without walking through their layers (this runs on every step)."""
    if isinstance(module, Stack):
        return [module]
    return [s for child in module.children() for s in _stacks(child)]
