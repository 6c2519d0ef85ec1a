"""Over-smoothing metrics on hidden states, layer by layer (docs/bamboo.md#over-smoothing-metrics).

Every per-sample metric takes hidden states ``(B, T, D)`` and an optional padding mask
``(B, T)`` (bool, True = padding) and returns one value per sample ``(B,)``;
a sample the metric is undefined for (e.g. fewer than two tokens) gets NaN and
is left out of averages. Padding tokens never change a result. Two metrics read the
evaluated set as a whole: ``cosine_centred`` subtracts the set's mean token, and
``cosine_same_minus_different`` compares tokens of one sample with tokens of others.

:class:`SmoothnessObserver` is passed to a backbone as ``observe``: it reduces
each layer's hidden states to these numbers at once, so analysing a
1,000-layer model holds one layer's activations (and one mean vector per layer), not 1,000.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from kilolayer.errors import InputError

# name -> what the number is; the order is the order of plot panels.
METRICS = {
    "cosine": "token cosine similarity",
    "cosine_centred": "token cosine, the set's mean token subtracted",
    "cosine_same_minus_different": "same-sample minus different-sample token cosine",
    "rank_residual": "rank-collapse residual (Dong et al.)",
    "effective_rank": "effective rank",
    "hc_ratio": "high-frequency share ||HC|| / ||X||",
    "high_freq": "relative log amplitude at the highest frequency",
}

FOURIER_EPS = 1e-6


# ---------------------------------------------------------------- helpers


def _as_float(hidden: torch.Tensor) -> torch.Tensor:
    """Half precision is too coarse for sums over thousands of pairs; keep float64 if given."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise InputError(f"hidden states: expected a tensor of shape (batch, tokens, width), got {got}")
    hidden = hidden.detach()
    return hidden if hidden.dtype == torch.float64 else hidden.float()


def keep_mask(
    hidden: torch.Tensor, padding_mask: torch.Tensor | None = None, exclude: Sequence[int] = ()
) -> torch.Tensor:
    """(B, T) bool, True = a token the metrics use: not padding and not at an excluded position."""
    B, T = hidden.shape[:2]
    if padding_mask is None:
        keep = torch.ones(B, T, dtype=torch.bool, device=hidden.device)
    else:
        if tuple(padding_mask.shape) != (B, T):
            raise InputError(
                f"padding mask: expected shape {(B, T)} to match the hidden states, got {tuple(padding_mask.shape)}"
            )
        keep = ~padding_mask.to(device=hidden.device, dtype=torch.bool)
    if exclude:
        keep = keep.clone()
        keep[:, list(exclude)] = False
    return keep


def _masked(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Hidden states with unused tokens set to zero rows (zero rows leave every metric below unchanged)."""
    return hidden * keep[..., None].to(hidden.dtype)


def _token_mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, 1, D) mean over each sample's kept tokens."""
    n = keep.sum(1).clamp_min(1).to(x.dtype)
    return (_masked(x, keep).sum(1) / n[:, None])[:, None, :]


# ---------------------------------------------------------------- metrics


def token_cosine(
    hidden: torch.Tensor, padding_mask: torch.Tensor | None = None, exclude: Sequence[int] = ()
) -> torch.Tensor:
    """Per sample: mean of cos(h_i, h_j) over ordered pairs i != j of its kept tokens (NaN if fewer than 2)."""
    x = _as_float(hidden)
    keep = keep_mask(x, padding_mask, exclude)
    unit = _masked(x / x.norm(dim=-1, keepdim=True).clamp_min(1e-30), keep)
    gram = unit @ unit.transpose(1, 2)
    n = keep.sum(1).to(x.dtype)
    off_diagonal = gram.sum((1, 2)) - gram.diagonal(dim1=1, dim2=2).sum(1)
    pairs = n * (n - 1)
    return torch.where(pairs > 0, off_diagonal / pairs.clamp_min(1), torch.full_like(n, math.nan))


def centred_token_cosine(
    hidden: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    exclude: Sequence[int] = (),
    mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per sample: :func:`token_cosine` of its kept tokens minus ``mean`` (D,), the mean kept token of the
    evaluated set: by default this batch's (all samples' kept tokens).

    Removes the direction every token shares (e.g. a large common bias), which plain
    cosine counts as similarity. A token at the mean (within 1e-6 of its own norm) has no direction, and
    rounding would give it an arbitrary one: it is left out, so a set of identical tokens gives NaN."""
    x = _as_float(hidden)
    keep = keep_mask(x, padding_mask, exclude)
    if mean is None:
        mean = _masked(x, keep).double().sum((0, 1)) / keep.sum().clamp_min(1)
    centred = x - mean.to(device=x.device, dtype=x.dtype)
    at_mean = centred.norm(dim=-1) <= 1e-6 * x.norm(dim=-1)
    return token_cosine(centred, ~keep | at_mean)


def mean_unit_tokens(
    hidden: torch.Tensor, padding_mask: torch.Tensor | None = None, exclude: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, D) each sample's mean kept token scaled to unit length, u_b = mean_i h_i / ||h_i||; (B,) bool, True
    for the samples :func:`token_cosine` counts, those with two kept tokens or more).

    The mean cosine between a token of sample a and a token of sample b is u_a . u_b."""
    x = _as_float(hidden)
    keep = keep_mask(x, padding_mask, exclude)
    unit = _masked(x / x.norm(dim=-1, keepdim=True).clamp_min(1e-30), keep)
    n = keep.sum(1)
    return unit.sum(1) / n.clamp_min(1)[:, None].to(x.dtype), n >= 2


def different_sample_cosine(unit_sum: torch.Tensor, unit_square_sum: float, samples: int) -> float:
    """Mean over ordered pairs of distinct samples (a, b) of the mean cosine between a token of a and a token of
    b, from S = ``samples`` vectors u_b (:func:`mean_unit_tokens`) given as their sum and their summed squared
    norms: (||sum_b u_b||^2 - sum_b ||u_b||^2) / (S (S - 1)). NaN below two samples."""
    if samples < 2:
        return math.nan
    return (float(unit_sum.double().square().sum()) - unit_square_sum) / (samples * (samples - 1))


def same_minus_different_cosine(
    hidden: torch.Tensor, padding_mask: torch.Tensor | None = None, exclude: Sequence[int] = ()
) -> float:
    """Over the samples of one batch (the evaluated set): the mean of :func:`token_cosine` (tokens of the same
    sample) minus :func:`different_sample_cosine` (tokens of different samples), both over the samples with two
    kept tokens or more. Near 0 when a sample's tokens are no more alike than any two tokens of the set (all
    tokens alike, or all independent); large when each sample's tokens share something of their own."""
    same = token_cosine(hidden, padding_mask, exclude)
    unit, counted = mean_unit_tokens(hidden, padding_mask, exclude)
    unit = unit[counted].double()
    samples = int(counted.sum())
    if samples < 2:
        return math.nan
    return float(same[counted].double().mean()) - different_sample_cosine(
        unit.sum(0), float(unit.square().sum()), samples
    )


def _composite_norm(a: torch.Tensor) -> torch.Tensor:
    """sqrt(||A||_1 ||A||_inf) per sample of (B, T, D): max column abs-sum times max row abs-sum."""
    one = a.abs().sum(1).amax(-1)
    inf = a.abs().sum(2).amax(-1)
    return (one * inf).sqrt()


def rank_collapse_residual(
    hidden: torch.Tensor, padding_mask: torch.Tensor | None = None, exclude: Sequence[int] = ()
) -> torch.Tensor:
    """Per sample: ||X - 1 mean(X)|| / ||X|| with Dong et al.'s norm sqrt(||.||_1 ||.||_inf); 0 = rank one."""
    x = _as_float(hidden)
    keep = keep_mask(x, padding_mask, exclude)
    residual = _masked(x - _token_mean(x, keep), keep)
    norm = _composite_norm(_masked(x, keep))
    return torch.where(norm > 0, _composite_norm(residual) / norm.clamp_min(1e-30), torch.full_like(norm, math.nan))


def effective_rank(
    hidden: torch.Tensor, padding_mask: torch.Tensor | None = None, exclude: Sequence[int] = ()
) -> torch.Tensor:
    """Per sample: exp(entropy of p_k = s_k / sum s), s the singular values of the kept tokens (T x D)."""
    x = _as_float(hidden)
    keep = keep_mask(x, padding_mask, exclude)
    s = torch.linalg.svdvals(_masked(x, keep))
    total = s.sum(-1, keepdim=True)
    p = s / total.clamp_min(1e-30)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # 0 log 0 = 0
    return torch.where(total[:, 0] > 0, entropy.exp(), torch.full_like(entropy, math.nan))


def hc_ratio(
    hidden: torch.Tensor, padding_mask: torch.Tensor | None = None, exclude: Sequence[int] = ()
) -> torch.Tensor:
    """Per sample: ||HC|| / ||X|| (Frobenius), HC = X - DC and DC = the mean token; 0 = all tokens equal."""
    x = _as_float(hidden)
    keep = keep_mask(x, padding_mask, exclude)
    hc = _masked(x - _token_mean(x, keep), keep).norm(dim=(1, 2))
    norm = _masked(x, keep).norm(dim=(1, 2))
    return torch.where(norm > 0, hc / norm.clamp_min(1e-30), torch.full_like(norm, math.nan))


def relative_log_amplitude(hidden: torch.Tensor, grid: int) -> torch.Tensor:
    """Park & Kim's Fourier curve per sample, ``(B, grid // 2 + 1)``: frequency 0 ... highest.

    The last ``grid * grid`` tokens are the patch grid (row-major); leading tokens
    (CLS, distillation or register tokens) are dropped. For each channel take
    log(|FFT2| + 1e-6), centre it (fftshift), average over channels, read the
    diagonal from the centre outwards and subtract the value at frequency 0.
    The diagonal runs towards the (-pi, -pi) corner, which for an even grid ends
    exactly at frequency pi (a real input's spectrum is symmetric, so this equals
    the +pi direction).
    """
    x = _as_float(hidden)
    B, T, D = x.shape
    prefix = T - grid * grid
    if grid < 2 or prefix < 0:
        raise InputError(f"grid {grid}x{grid}: needs at least {grid * grid} patch tokens, the hidden states have {T}")
    patches = x[:, prefix:].reshape(B, grid, grid, D).permute(0, 3, 1, 2)
    amplitude = torch.log(torch.fft.fft2(patches).abs() + FOURIER_EPS)
    centred = torch.fft.fftshift(amplitude, dim=(-2, -1)).mean(1)
    c = grid // 2
    steps = torch.arange(c + 1, device=x.device)
    diagonal = centred[:, c - steps, c - steps]
    return diagonal - diagonal[:, :1]


def high_frequency(hidden: torch.Tensor, grid: int) -> torch.Tensor:
    """Per sample: the last point of :func:`relative_log_amplitude` (higher = more high-frequency content)."""
    return relative_log_amplitude(hidden, grid)[:, -1]


def left_out_mask(padding_mask: torch.Tensor | None, skip: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) bool, True = a token the token metrics leave out: padding, or a real token ``skip`` marks."""
    return padding_mask if skip is None else (skip if padding_mask is None else padding_mask | skip)


def layer_metrics(
    hidden: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    exclude: Sequence[int] = (),
    grid: int | None = None,
    skip: torch.Tensor | None = None,
    centre: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Every per-sample metric that applies, each ``(B,)``. ``high_freq`` only with a grid (images: no padding).
    ``skip`` (B, T): tokens the token metrics leave out, as padding, but that are real tokens of the grid (the
    Fourier metric, which needs the whole grid, keeps them). ``centre`` (D,): the evaluated set's mean token, which
    ``cosine_centred`` subtracts (default: this batch's)."""
    left_out = left_out_mask(padding_mask, skip)
    out = {
        "cosine": token_cosine(hidden, left_out, exclude),
        "cosine_centred": centred_token_cosine(hidden, left_out, exclude, centre),
        "rank_residual": rank_collapse_residual(hidden, left_out, exclude),
        "effective_rank": effective_rank(hidden, left_out, exclude),
        "hc_ratio": hc_ratio(hidden, left_out, exclude),
    }
    if grid is not None:
        if padding_mask is not None and bool(padding_mask.any()):
            raise InputError("the Fourier metric needs a full patch grid, but the batch has padding")
        out["high_freq"] = high_frequency(hidden, grid)
    return out


# ---------------------------------------------------------------- accumulation


class _BatchObserver:
    """What every observer shares: the tokens left out (:meth:`begin_batch`), token 0 when ``exclude_first``,
    and where a kilolayer stack observes its last layer (``before_final_norm``, which the stacks read)."""

    def __init__(self, exclude_first: bool = False, before_final_norm: bool = False):
        self.exclude = (0,) if exclude_first else ()
        self.before_final_norm = before_final_norm
        self.padding_mask: torch.Tensor | None = None
        self.skip: torch.Tensor | None = None

    def begin_batch(self, padding_mask: torch.Tensor | None = None, skip: torch.Tensor | None = None):
        """The next batch's padding mask and the real tokens the token metrics skip (:func:`layer_metrics`)."""
        self.padding_mask = padding_mask
        self.skip = skip
        return self


def _grow(values: list, layer: int, zero) -> list:
    while len(values) <= layer:
        values.append(zero() if callable(zero) else zero)
    return values


class TokenMeans(_BatchObserver):
    """An ``observe(layer_index, hidden)`` callback that sums each layer's kept tokens: :meth:`means` is the mean
    token per layer over everything observed (the centre of ``cosine_centred``)."""

    def __init__(self, exclude_first: bool = False, before_final_norm: bool = False):
        super().__init__(exclude_first, before_final_norm)
        self._sums: list[torch.Tensor] = []
        self._counts: list[int] = []

    def __call__(self, layer: int, hidden: torch.Tensor) -> None:
        x = _as_float(hidden)
        keep = keep_mask(x, left_out_mask(self.padding_mask, self.skip), self.exclude)
        total = _masked(x, keep).double().sum((0, 1))
        _grow(self._counts, layer, 0)[layer] += int(keep.sum())
        sums = _grow(self._sums, layer, lambda: torch.zeros_like(total))
        sums[layer] = sums[layer] + total

    def means(self) -> list[torch.Tensor]:
        """The mean kept token (D,) of each observed layer (zeros where none was kept)."""
        return [s / max(n, 1) for s, n in zip(self._sums, self._counts)]


class SmoothnessObserver(_BatchObserver):
    """An ``observe(layer_index, hidden)`` callback that keeps only running sums of the metrics.

    Call :meth:`begin_batch` with the batch's padding mask before each forward
    pass. Averages are over samples (each sample counts once, whatever its
    length), across all batches. ``centre``: the evaluated set's mean token per layer
    (:class:`TokenMeans` over the same batches, which :func:`smoothness` runs first), subtracted by
    ``cosine_centred``; without it each batch is centred on its own mean token. The different-sample
    cosine pairs samples across all batches (a sum of one vector per layer), so
    ``cosine_same_minus_different`` is the set's whatever the batch size.
    """

    def __init__(
        self,
        grid: int | None = None,
        exclude_first: bool = False,
        before_final_norm: bool = False,
        centre: list[torch.Tensor] | None = None,
    ):
        super().__init__(exclude_first, before_final_norm)
        self.grid = grid
        self.centre = centre
        self.samples = 0
        self._sums: dict[str, list[float]] = {}
        self._counts: dict[str, list[int]] = {}
        # per layer, over the samples the cosine counts: sum of u_b, sum of ||u_b||^2 (mean_unit_tokens)
        self._unit_sums: list[torch.Tensor] = []
        self._unit_squares: list[float] = []

    def __call__(self, layer: int, hidden: torch.Tensor) -> None:
        if layer == 0:
            self.samples += hidden.shape[0]
        centre = self.centre[layer] if self.centre is not None else None
        with torch.no_grad():
            values = layer_metrics(hidden, self.padding_mask, self.exclude, self.grid, self.skip, centre)
            unit, counted = mean_unit_tokens(hidden, left_out_mask(self.padding_mask, self.skip), self.exclude)
        for name, v in values.items():
            sums = _grow(self._sums.setdefault(name, []), layer, 0.0)
            counts = _grow(self._counts.setdefault(name, []), layer, 0)
            finite = torch.isfinite(v)
            sums[layer] += float(v[finite].double().sum())
            counts[layer] += int(finite.sum())
        unit = unit[counted].double()
        unit_sums = _grow(self._unit_sums, layer, lambda: torch.zeros(unit.shape[-1], dtype=torch.float64))
        unit_sums[layer] = unit_sums[layer] + unit.sum(0).cpu()
        _grow(self._unit_squares, layer, 0.0)[layer] += float(unit.square().sum())

    def result(self) -> dict:
        """``{"layers": [0..L], "samples": n, metric: [mean per layer], ...}`` (NaN where no sample counted)."""
        if not self._sums:
            raise InputError("no hidden states were observed (empty input?)")
        depth = len(self._sums["cosine"])
        out: dict = {"layers": list(range(depth)), "samples": self.samples}
        for name in METRICS:
            if name in self._sums:
                out[name] = [s / c if c else math.nan for s, c in zip(self._sums[name], self._counts[name])]
        counted = self._counts["cosine"]
        out["cosine_same_minus_different"] = [
            same - different_sample_cosine(u, sq, n)
            for same, u, sq, n in zip(out["cosine"], self._unit_sums, self._unit_squares, counted)
        ]
        return {k: out[k] for k in ("layers", "samples", *METRICS) if k in out}


# ---------------------------------------------------------------- models


def hidden_states_of(output) -> list[torch.Tensor]:
    """A Hugging Face output's per-layer hidden states, the last replaced by ``last_hidden_state``
    when shapes agree: as in kilolayer backbones, the last entry is after the final norm."""
    states = getattr(output, "hidden_states", None)
    if states is None:
        raise InputError("the model returned no hidden_states (does it support output_hidden_states=True?)")
    states = list(states)
    last = getattr(output, "last_hidden_state", None)
    if isinstance(last, torch.Tensor) and last.shape == states[-1].shape:
        states[-1] = last
    return states


def _split_batch(batch, kilolayer_model: bool) -> tuple[dict, torch.Tensor | None, torch.Tensor | None]:
    if isinstance(batch, tuple):
        return (*batch, None) if len(batch) == 2 else batch
    if kilolayer_model:
        return batch, batch.get("padding_mask"), None
    mask = batch.get("attention_mask")
    return batch, (mask == 0 if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None), None


def smoothness(
    model: torch.nn.Module,
    batches: Iterable,
    *,
    grid: int | None = None,
    exclude_first: bool = False,
    before_final_norm: bool = False,
) -> dict:
    """Over-smoothing metrics per layer of ``model`` over ``batches``.

    ``model`` is a kilolayer backbone (run with ``observe=``; memory stays at one
    layer's activations) or a Hugging Face model (run with
    ``output_hidden_states=True``). Each batch is a dict of keyword arguments for
    the model, or a ``(kwargs, padding_mask)`` pair, or a ``(kwargs, padding_mask, skip)`` triple whose
    ``skip`` marks real tokens the token metrics leave out (:func:`layer_metrics`). Without a pair the padding
    mask is ``kwargs["padding_mask"]`` (kilolayer) or ``attention_mask == 0``
    (Hugging Face). ``grid`` (patches per side) adds the Fourier metric;
    ``exclude_first`` leaves token 0 (CLS) out of the token metrics.

    Returns ``{"layers": [0..L], "samples": n, "cosine": [...], ...}``: index 0 is
    the embedding output, index L the last layer's output after any final norm, or,
    with ``before_final_norm`` (kilolayer backbones), the last block's output before it.
    The model runs twice over ``batches`` (held in memory: inputs only): first for each layer's mean token
    over the whole set, which ``cosine_centred`` subtracts, then for the metrics.
    """
    batches = list(batches)  # two passes: the set's mean token per layer, then the metrics
    means = TokenMeans(exclude_first, before_final_norm)
    _observe(model, batches, means)
    observer = SmoothnessObserver(grid, exclude_first, before_final_norm, centre=means.means())
    _observe(model, batches, observer)
    return observer.result()


def _observe(model: torch.nn.Module, batches: list, observer: _BatchObserver) -> None:
    """Run ``model`` in evaluation mode on every batch with ``observer`` seeing each layer's hidden states."""
    from kilolayer.nn.transformer import Backbone

    ours = isinstance(model, Backbone)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                kwargs, mask, skip = _split_batch(batch, ours)
                observer.begin_batch(mask, skip)
                if ours:
                    # encoder-decoder objectives hand over the encoder's inputs (src, ...): run encode()
                    run = model.encode if hasattr(model, "encode") and "tgt" not in kwargs else model
                    run(**kwargs, observe=observer)
                else:
                    for i, h in enumerate(hidden_states_of(model(**kwargs, output_hidden_states=True))):
                        observer(i, h)
    finally:
        model.train(was_training)


def special_token_ids(config, source) -> list[int]:
    """Ids of special tokens (padding, BOS/EOS, MASK, CLS, SEP) in ``config``'s token inputs: the source's
    ``special_ids`` if it has them, else its tokenizer's; none for image patches."""
    if config.model.input != "tokens":
        return []
    ids = getattr(source, "special_ids", None)
    if ids is None:
        from kilolayer.data.text import tokenizer_for

        try:
            ids = tokenizer_for(config).special_ids
        except Exception:  # a source without a tokenizer has no special ids to drop
            ids = ()
    return sorted({int(i) for i in ids})


def blank_patches(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, N) bool: True where an image's ``patch`` x ``patch`` patch (row-major, as the patch embedding cuts
    them) has every pixel of every channel equal, such as MNIST's black border."""
    b, c, h, w = images.shape
    p = images.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    p = p.reshape(b, (h // patch) * (w // patch), -1)
    return p.amax(-1) == p.amin(-1)


def blank_token_mask(images: torch.Tensor, patch: int, cls_token: bool) -> torch.Tensor | None:
    """(B, T) bool, True = a token to leave out of the metrics because its patch is blank; None where no
    patch is blank. An image with fewer than two content patches keeps all its tokens (a cosine between
    tokens needs two)."""
    blank = blank_patches(images, patch)
    content = (~blank).sum(1)
    blank[content < 2] = False
    if not bool(blank.any()):
        return None
    if cls_token:
        blank = torch.cat([torch.zeros_like(blank[:, :1]), blank], dim=1)
    return blank


#: version of the measurement choices below; the study runner re-measures saved results of another version
#: (3: cosine_centred subtracts the evaluated set's mean token, not each batch's; cosine_same_minus_different)
SMOOTHNESS_METHOD = 3


def smoothness_of_run(
    run_dir: str | Path,
    *,
    data: str | dict | None = None,
    samples: int = 128,
    batch_size: int = 32,
    exclude_first: bool = False,
    exclude_special: bool = True,
    exclude_blank: bool = True,
    after_final_norm: bool = False,
    device: str = "cpu",
) -> dict:
    """:func:`smoothness` of a kilolayer run's chosen checkpoint on its evaluation data, or on ``data``: a source
    name (with the run's data options) or a whole data section.

    Measurement choices (Bamboo's over-smoothing is about the content tokens of the last block):
    ``exclude_special`` (default) leaves the CLS token of a patch model and special-token ids of token inputs
    out of every metric (``exclude_first`` drops token 0 whatever it is); ``exclude_blank`` (default) leaves
    out the tokens of blank patches (every pixel equal: MNIST's black border, most of its 4x4 patches), which
    differ only by their position embedding and would raise every model's cosine alike; the last entry is the
    last block's output before the stack's final LayerNorm, whose shared bias raises raw cosine, unless
    ``after_final_norm``.

    Adds metadata: ``source``, ``path``, ``name``, ``input``, ``split`` (of its data), ``depth``, ``grid``,
    ``exclude_special``, ``exclude_blank`` (with the share of patch tokens left out as blank, ``blank_share``),
    ``after_final_norm`` and ``method`` (:data:`SMOOTHNESS_METHOD`)."""
    from kilolayer.data import load_source
    from kilolayer.train.checkpoint import load_run

    run_dir = Path(run_dir)
    config, task = load_run(run_dir, device=device)
    if isinstance(data, str):  # another source of the run's options
        config = config.model_copy(update={"data": config.data.model_copy(update={"name": data})})
    elif data is not None:  # a whole data section
        config = config.model_copy(update={"data": type(config.data).model_validate(data)})
    source = load_source(config)
    m = config.model
    grid = m.image_size // m.patch_size if m.input == "patches" else None

    special = torch.tensor(
        special_token_ids(config, source) if exclude_special else [], dtype=torch.long, device=device
    )
    exclude_first = exclude_first or (exclude_special and m.input == "patches" and m.cls_token)
    blank_counts = [0, 0]  # blank patch tokens, all patch tokens

    def batches():
        for batch in source.eval_batches(batch_size, limit=samples):
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            kwargs, mask = task.objective.analysis_inputs(batch)
            ids = next((kwargs[k] for k in ("tokens", "inputs", "src") if k in kwargs), None)
            if len(special) and ids is not None and not ids.is_floating_point():
                # only the metrics skip them; the model still attends to them
                is_special = torch.isin(ids, special)
                mask = is_special if mask is None else (mask | is_special)
            blank = None
            if exclude_blank and m.input == "patches" and ids is not None and ids.dim() == 4:
                blank = blank_token_mask(ids, m.patch_size, m.cls_token)
                blank_counts[1] += ids.shape[0] * grid * grid
                blank_counts[0] += int(blank.sum()) if blank is not None else 0
            yield kwargs, mask, blank

    result = smoothness(
        task.backbone, batches(), grid=grid, exclude_first=exclude_first, before_final_norm=not after_final_norm
    )
    result.update(
        source="run",
        path=str(run_dir.resolve()),
        name=run_dir.resolve().name,
        input=f"data:{config.data.name}",
        split=source.eval_split,
        depth=len(result["layers"]) - 1,
        grid=grid,
        model=f"{m.arch} {m.scheme} {config.objective.name}",
        exclude_special=exclude_special,
        exclude_blank=bool(exclude_blank and m.input == "patches"),
        after_final_norm=after_final_norm,
        method=SMOOTHNESS_METHOD,
    )
    if m.input == "patches" and exclude_blank:
        result["blank_share"] = blank_counts[0] / max(1, blank_counts[1])
    return result


def write_smoothness(result: dict, out: str | Path) -> Path:
    """Write OUT/smoothness.json: ``result`` with NaN as null."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "smoothness.json"
    path.write_text(json.dumps(json_safe(result), indent=1) + "\n")
    return path


def json_safe(value):
    """``value`` with NaN/inf floats (not JSON) replaced by null, through lists and dicts."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return value
