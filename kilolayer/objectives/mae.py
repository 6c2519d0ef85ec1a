"""Masked autoencoding of image patches (MAE, He et al. 2021): a token-level objective.

Per sample, a random permutation of the L patches keeps the first
K = max(1, int(L * (1 - mask_ratio))) visible; the backbone's encoder sees only
those K patches (plus its CLS token), embedded by ``PatchEmbedding(images,
keep=...)`` with their own positions. A lighter decoder (a kilolayer encoder
stack of its own depth, width and heads) takes the encoded tokens projected to
its width, a shared learned mask token at every hidden patch, and its own
learned positions, and predicts every patch's pixels. The target is each
patch's pixels, normalised by that patch's mean and variance when
``norm_pix_loss`` (default, as MAE); the loss is the mean squared error over
the masked patches only.

Training masks are keyed by ``train.seed`` and each sample's index in the
run's sample stream (:func:`~kilolayer.objectives.common.keyed_bits`), so a
sample is masked the same way at any number of processes or micro-batches.

Batch: ``{"inputs": float (B, C, H, W)}`` (labels, if any, are ignored).
Evaluation: the reconstruction loss with fixed masks, the same at every evaluation. :meth:`MAE.save_samples`
writes a PNG grid: original | masked | reconstruction, one row per sample.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch
from pydantic import ConfigDict, Field
from torch import nn

from kilolayer.config import ModelConfig, NumbersNotBools
from kilolayer.data.base import Source
from kilolayer.data.options import parse_options
from kilolayer.errors import ConfigError
from kilolayer.nn.residual import SCHEMES
from kilolayer.nn.transformer import Stack, scheme_for
from kilolayer.objectives.base import Objective, batch_size, register_objective
from kilolayer.objectives.common import batch_inputs, eval_generator, keyed_bits, sample_keys


class MAEOptions(NumbersNotBools):
    model_config = ConfigDict(extra="forbid")

    mask_ratio: float = Field(0.75, gt=0.0, lt=1.0)
    norm_pix_loss: bool = True
    decoder_layers: int = Field(2, ge=1)
    decoder_width: int | None = Field(None, ge=1, description="default: half the encoder width, at least 32")
    decoder_heads: int = Field(4, ge=1)
    decoder_ffn: int | None = Field(None, ge=1, description="default: 4 x decoder_width")
    decoder_scheme: str = Field(
        "pre_ln", description="with the model's scheme options (e.g. model.branchnorm_steps), Admin's omega default"
    )
    max_constant_patches: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="with norm_pix_loss, refuse data whose first training batch has a larger share of constant "
        "patches (their normalised target is 0: nothing to learn)",
    )


def unpatchify(patches: torch.Tensor, channels: int, patch: int) -> torch.Tensor:
    """(B, g*g, p*p*C) -> (B, C, g*p, g*p); the inverse of ``PatchEmbedding.patchify``."""
    B, L, _ = patches.shape
    g = math.isqrt(L)
    x = patches.reshape(B, g, g, patch, patch, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(B, channels, g * patch, g * patch)


def constant_patch_fraction(images: torch.Tensor, patch: int) -> float:
    """The share of ``patch`` x ``patch`` patches of ``images`` (B, C, H, W) whose pixels are all equal (to
    1e-6 of the batch's pixel range): with ``norm_pix_loss`` their target is exactly 0."""
    B, C, H, W = images.shape
    x = images.float().unfold(2, patch, patch).unfold(3, patch, patch)  # (B, C, H/p, W/p, p, p)
    x = x.permute(0, 2, 3, 1, 4, 5).reshape(B, (H // patch) * (W // patch), -1)
    spread = x.amax(-1) - x.amin(-1)
    tol = 1e-6 * max(float(images.amax() - images.amin()), 1e-30)
    return float((spread <= tol).float().mean())


DRAWN = "mae_drawn"  # the batch key under which :meth:`MAE.prepare` leaves the step's masking


def masking_of(noise: torch.Tensor, keep: int, device) -> tuple:
    """(keep_idx (B, K), restore (B, L), mask (B, L) with 1 = hidden): each sample keeps the ``keep`` patches of
    smallest ``noise`` (B, L), a per-sample random permutation's first ``keep``."""
    B, L = noise.shape
    shuffle = noise.to(device).argsort(dim=1, stable=True)
    restore = shuffle.argsort(dim=1)
    mask = torch.ones(B, L, device=device)
    mask[:, :keep] = 0
    return shuffle[:, :keep], restore, torch.gather(mask, 1, restore)


def random_masking(batch: int, length: int, keep: int, generator: torch.Generator, device) -> tuple:
    """:func:`masking_of` a batch of ``batch`` samples of ``length`` patches, noise from ``generator``."""
    return masking_of(torch.rand(batch, length, generator=generator), keep, device)


def keyed_masking(seed: int, samples: torch.Tensor, length: int, keep: int, device) -> tuple:
    """:func:`masking_of` with each sample's noise keyed by ``seed`` and its key in ``samples`` (B,)
    (:func:`~kilolayer.objectives.common.keyed_bits`): the same masking in any batch."""
    return masking_of(keyed_bits(seed, samples, 3, length), keep, device)


@register_objective
class MAE(Objective):
    name = "mae"
    metrics = ("loss",)
    archs = ("encoder",)

    def __init__(self, config, backbone: nn.Module, source: Source | None):
        super().__init__(config, backbone, source)
        opts = parse_options(MAEOptions, config.objective.options, "objective.options")
        m = backbone.config
        if m.input != "patches":
            raise ConfigError(f"model.input={m.input!r}: mae reconstructs image patches; set model.input: patches")
        self.mask_ratio, self.norm_pix_loss = opts.mask_ratio, opts.norm_pix_loss
        self.seed = config.train.seed
        self.max_constant_patches = opts.max_constant_patches
        self.num_patches, self.cls = m.num_patches, int(m.cls_token)
        self.keep = max(1, int(self.num_patches * (1 - opts.mask_ratio)))
        self.channels, self.patch_size = m.channels, m.patch_size
        width = opts.decoder_width or max(32, m.width // 2)
        if width % opts.decoder_heads:
            raise ConfigError(
                f"objective.options.decoder_width={width}: must be divisible by "
                f"objective.options.decoder_heads={opts.decoder_heads}"
            )
        if opts.decoder_scheme not in SCHEMES:
            raise ConfigError(SCHEMES.unknown(opts.decoder_scheme, field="objective.options.decoder_scheme"))
        dec = ModelConfig(
            arch="encoder",
            scheme=opts.decoder_scheme,
            layers=opts.decoder_layers,
            width=width,
            heads=opts.decoder_heads,
            ffn=opts.decoder_ffn or 4 * width,
            activation=m.activation,
            norm_eps=m.norm_eps,
            # the model's scheme options, but Admin's omega at its default: data-dependent init reaches backbones
            layerscale_init=m.layerscale_init,
            ds_init_variant=m.ds_init_variant,
            branchnorm_steps=m.branchnorm_steps,
        )
        self.decoder_config = dec
        scheme = scheme_for(dec)
        self.decoder_embed = nn.Linear(m.width, width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        self.decoder_positions = nn.Parameter(torch.zeros(1, self.num_patches + self.cls, width))
        self.decoder = Stack(dec, scheme, "encoder", dec.layers)
        self.predict = nn.Linear(width, m.channels * m.patch_size**2)
        with torch.no_grad():
            self.mask_token.normal_(0.0, 0.02)
            self.decoder_positions.normal_(0.0, 0.02)
            for lin in (self.decoder_embed, self.predict):
                nn.init.xavier_uniform_(lin.weight)
                lin.bias.zero_()
        if source is not None:
            self._check_data(source)

    def _check_data(self, source: Source) -> None:
        """Refuse, before training, data on which the normalised-pixel target is mostly 0: e.g. images
        upscaled by pixel repetition and cut into patches no larger than the repetition."""
        if not self.norm_pix_loss:
            return
        with torch.device("cpu"):  # the data, wherever the heads are built (the memory estimate: on meta)
            batch = source.train_batch(0, min(64, self.config.train.batch_size))
            share = constant_patch_fraction(batch_inputs(batch, "inputs", "images"), self.patch_size)
        if share > self.max_constant_patches:
            raise ConfigError(
                f"objective.options.norm_pix_loss: {share:.0%} of the {self.patch_size}x{self.patch_size} patches "
                f"in the first training batch are constant, so their normalised target is 0 and MAE has "
                f"nothing to learn there (limit objective.options.max_constant_patches="
                f"{self.max_constant_patches:g}); use a larger model.patch_size, data without pixel-repetition "
                f"upscaling (data.options.upscale), or norm_pix_loss: false"
            )

    # -- pieces (public so that tests and analyses can call them one by one)
    def targets(self, backbone: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """Per-patch pixel targets (B, L, p*p*C), normalised per patch when ``norm_pix_loss``."""
        target = backbone.embed.patchify(images)
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1e-6).sqrt()
        return target

    def masking(
        self, images: torch.Tensor, generator: torch.Generator | None = None, samples: torch.Tensor | None = None
    ) -> tuple:
        """One random masking of ``images``: (keep_idx, restore, mask) as :func:`masking_of`, drawn from
        ``generator`` or keyed by ``train.seed`` and each sample's key in ``samples`` (B,)."""
        if samples is not None:
            return keyed_masking(self.seed, samples, self.num_patches, self.keep, images.device)
        return random_masking(images.shape[0], self.num_patches, self.keep, generator, images.device)

    def reconstruct(
        self,
        backbone: nn.Module,
        images: torch.Tensor,
        generator: torch.Generator | None = None,
        observe=None,
        masking: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted patches (B, L, p*p*C), mask (B, L), 1 = hidden) for one random masking: ``masking`` (a
        :meth:`masking`) if given, else one drawn from ``generator``."""
        B = images.shape[0]
        keep, restore, mask = masking if masking is not None else self.masking(images, generator)
        x = backbone.embed(images, keep=keep)  # (B, cls + K, width): only the visible patches
        latent = backbone.encoder(x, observe=observe)
        y = self.decoder_embed(latent)
        visible = y[:, self.cls :]
        filler = self.mask_token.to(y.dtype).expand(B, self.num_patches - self.keep, -1)
        full = torch.cat([visible, filler], dim=1)
        full = torch.gather(full, 1, restore[..., None].expand(-1, -1, full.shape[-1]))  # back to patch order
        full = torch.cat([y[:, : self.cls], full], dim=1) + self.decoder_positions.to(y.dtype)
        out = self.predict(self.decoder(full))
        return out[:, self.cls :], mask

    @staticmethod
    def masked_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error per patch, averaged over the hidden patches only."""
        per_patch = ((pred.float() - target.float()) ** 2).mean(dim=-1)
        return (per_patch * mask).sum() / mask.sum()

    # -- the Objective interface
    def _loss(self, backbone, batch, masking: tuple) -> torch.Tensor:
        images = batch_inputs(batch, "inputs", "images")
        pred, mask = self.reconstruct(backbone, images, masking=masking)
        return self.masked_loss(pred, self.targets(backbone, images), mask)

    def prepare(self, batch: dict) -> dict:
        """The batch with its masking under ``mae_drawn``, keyed by its samples' indices in the run's sample
        stream (:func:`~kilolayer.objectives.common.sample_keys`)."""
        if DRAWN in batch:
            return batch
        images = batch_inputs(batch, "inputs", "images")
        return {**batch, DRAWN: self.masking(images, samples=sample_keys(batch, images.shape[0]))}

    def forward(self, backbone: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
        batch = self.prepare(batch)
        return self._loss(backbone, batch, batch[DRAWN]), {}

    @torch.no_grad()
    def evaluate(self, backbone: nn.Module, batches: Iterable[dict]) -> dict:
        total = count = 0.0
        for i, batch in enumerate(batches):
            images = batch_inputs(batch, "inputs", "images")
            n = images.shape[0]
            total += float(self._loss(backbone, batch, self.masking(images, eval_generator(i)))) * n
            count += n
        return {"loss": total / max(count, 1)}

    @torch.no_grad()
    def chance(self, backbone: nn.Module, batches: Iterable[dict]) -> dict:
        """The loss of the best input-independent predictor under squared error. The decoder knows each hidden
        patch's position, so that predictor is the mean target patch *at each position*; its loss is the
        per-position target variance, averaged over the hidden patches of ``evaluate``'s fixed masks."""
        total = total_sq = count = None
        for i, batch in enumerate(batches):
            images = batch_inputs(batch, "inputs", "images")
            _, _, mask = random_masking(images.shape[0], self.num_patches, self.keep, eval_generator(i), images.device)
            m = mask.double()[..., None]  # (B, L, 1): 1 = hidden, scored
            t = self.targets(backbone, images).double() * m
            s, sq, n = t.sum(0), (t * t).sum(0), m.sum(0)  # per position: (L, D), (L, D), (L, 1)
            total, total_sq, count = (s, sq, n) if total is None else (total + s, total_sq + sq, count + n)
        if count is None or not float(count.sum()):
            return {"loss": float("nan")}
        residual = (total_sq - total * total / count.clamp_min(1)).clamp_min(0)  # sum of squared deviations
        return {"loss": float(residual.sum() / (count.sum() * total.shape[-1]))}

    def represent(self, backbone: nn.Module, batch: dict) -> torch.Tensor:
        return backbone(batch_inputs(batch, "inputs", "images"))

    def analysis_inputs(self, batch: dict):
        # over-smoothing is measured on the encoder over whole images, as for a supervised ViT
        return {"inputs": batch_inputs(batch, "inputs", "images"), "padding_mask": None}, None

    def train_flops(self, batch: dict) -> float:
        """The encoder on the visible patches (and CLS), the decoder and its prediction on every position, the
        decoder's input projection on the encoder's outputs."""
        B = batch_size(batch)
        seen, full = self.keep + self.cls, self.num_patches + self.cls
        encoder = self.backbone_flops(B, seen)
        decoder = self.backbone_flops(B, full, model=self.decoder_config)
        projections = 6.0 * B * (self.decoder_embed.weight.numel() * seen + self.predict.weight.numel() * full)
        return encoder + decoder + projections

    def tokens(self, batch: dict) -> int:
        return batch_inputs(batch, "inputs", "images").shape[0] * (self.keep + self.cls)

    def loss_weight(self, batch: dict) -> int:
        """The hidden patches: the loss is the mean over them of each patch's mean squared error."""
        return batch_inputs(batch, "inputs", "images").shape[0] * (self.num_patches - self.keep)

    def backbone_length(self, length: int) -> int:
        return self.keep + self.cls  # the encoder sees only the visible patches (and CLS)

    @torch.no_grad()
    def save_samples(self, backbone: nn.Module, batch: dict, path: str | Path, count: int = 8) -> Path:
        """Write a PNG grid, one row per sample: original | masked (hidden patches grey) | reconstruction
        (visible patches from the original, hidden ones predicted, de-normalised with the patch's statistics)."""
        from PIL import Image

        images = batch_inputs(batch, "inputs", "images")[:count]
        pred, mask = self.reconstruct(backbone, images, eval_generator(0))
        patches = backbone.embed.patchify(images).float()
        pred = pred.float()
        if self.norm_pix_loss:
            mean = patches.mean(dim=-1, keepdim=True)
            std = (patches.var(dim=-1, keepdim=True) + 1e-6).sqrt()
            pred = pred * std + mean
        hidden = mask.bool()[..., None]
        lo = images.flatten(1).amin(1)[:, None, None]
        hi = images.flatten(1).amax(1)[:, None, None]

        def show(p):  # patches -> [0, 1] image by each sample's original range
            return ((p - lo) / (hi - lo).clamp_min(1e-6)).clamp(0, 1)

        panels = [
            show(patches),
            torch.where(hidden, torch.full_like(patches, 0.5), show(patches)),
            show(torch.where(hidden, pred, patches)),
        ]
        rows = [
            torch.cat([unpatchify(p, self.channels, self.patch_size)[i] for p in panels], dim=2)
            for i in range(len(images))
        ]
        grid = torch.cat(rows, dim=1)  # (C, rows*H, 3*W)
        scale = max(1, math.ceil(64 / images.shape[-1]))
        grid = grid.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
        arr = (grid * 255).round().byte().permute(1, 2, 0).cpu().numpy()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr if self.channels == 3 else arr[..., 0]).save(out)
        return out
