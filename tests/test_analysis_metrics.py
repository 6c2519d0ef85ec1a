"""Over-smoothing metrics against hand-computed values and invariances (docs/bamboo.md#over-smoothing-metrics)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilolayer.analysis.smoothness import (
    SmoothnessObserver,
    TokenMeans,
    centred_token_cosine,
    different_sample_cosine,
    effective_rank,
    hc_ratio,
    high_frequency,
    layer_metrics,
    rank_collapse_residual,
    relative_log_amplitude,
    same_minus_different_cosine,
    smoothness,
    token_cosine,
)
from kilolayer.errors import InputError

TOKEN_METRICS = [token_cosine, centred_token_cosine, rank_collapse_residual, effective_rank, hc_ratio]


def _random(seed, B, T, D):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------- hand-computed values


def test_identical_tokens_are_fully_smoothed():
    v = torch.tensor([[0.3, -1.2, 2.0, 0.5], [1.0, 1.0, -4.0, 0.1]], dtype=torch.float64)
    x = v[:, None, :].expand(2, 5, 4)
    assert torch.allclose(token_cosine(x), torch.ones(2, dtype=torch.float64))
    assert torch.allclose(rank_collapse_residual(x), torch.zeros(2, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(hc_ratio(x), torch.zeros(2, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(effective_rank(x), torch.ones(2, dtype=torch.float64))


def test_orthogonal_tokens():
    T = 4
    x = 3.0 * torch.eye(T, 6, dtype=torch.float64)[None]  # 4 orthogonal tokens of equal norm
    assert token_cosine(x).item() == pytest.approx(0.0, abs=1e-12)
    assert effective_rank(x).item() == pytest.approx(T)
    # HC of identity rows: each row e_i - 1/T sum e_j has squared norm (T-1)/T, ||X||^2 = T  (scale cancels)
    assert hc_ratio(x).item() == pytest.approx(math.sqrt((T - 1) / T))
    # ||I - J/T||_1 = ||.||_inf = 2(T-1)/T and ||I||_1 = ||I||_inf = 1
    assert rank_collapse_residual(x).item() == pytest.approx(2 * (T - 1) / T)


def test_cosine_of_three_hand_tokens():
    # pairs: cos(e1, e2) = 0, cos(e1, e1+e2) = cos(e2, e1+e2) = 1/sqrt(2); 6 ordered pairs
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]], dtype=torch.float64)
    assert token_cosine(x).item() == pytest.approx(4 / math.sqrt(2) / 6)
    # excluding token 0 leaves e2 and e1+e2
    assert token_cosine(x, exclude=(0,)).item() == pytest.approx(1 / math.sqrt(2))


def test_cosine_is_nan_with_fewer_than_two_tokens():
    x = _random(0, 2, 3, 4)
    pad = torch.tensor([[False, True, True], [False, False, True]])
    out = token_cosine(x, pad)
    assert math.isnan(out[0]) and not math.isnan(out[1])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), T=st.integers(2, 9), D=st.integers(2, 9))
def test_rank_residual_and_effective_rank_match_numpy(seed, T, D):
    x = _random(seed, 1, T, D)
    a = x[0].numpy()
    res = a - a.mean(0, keepdims=True)
    # numpy's matrix norms: ord=1 is the max column abs-sum, ord=inf the max row abs-sum
    composite = lambda m: math.sqrt(np.linalg.norm(m, 1) * np.linalg.norm(m, np.inf))
    assert rank_collapse_residual(x).item() == pytest.approx(composite(res) / composite(a), rel=1e-9)
    s = np.linalg.svd(a, compute_uv=False)
    p = s / s.sum()
    assert effective_rank(x).item() == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(1, 6),
    extra_rows=st.integers(0, 5),
    extra_cols=st.integers(0, 5),
    sigma=st.floats(0.1, 50.0),
)
def test_effective_rank_of_rank_k_with_equal_singular_values_is_k(seed, k, extra_rows, extra_cols, sigma):
    g = torch.Generator().manual_seed(seed)
    T, D = k + extra_rows, k + extra_cols
    u, _ = torch.linalg.qr(torch.randn(T, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(D, k, generator=g, dtype=torch.float64))
    x = sigma * u @ v.T
    assert effective_rank(x[None]).item() == pytest.approx(k, rel=1e-6)


# ---------------------------------------------------------------- invariances


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 4),
    T=st.integers(2, 8),
    D=st.integers(2, 8),
    pad=st.integers(1, 5),
    garbage=st.floats(-1e3, 1e3),
)
def test_padding_never_changes_a_result(seed, B, T, D, pad, garbage):
    x = _random(seed, B, T, D)
    # ragged lengths: sample b keeps the first T - (b % 2) tokens (at least 2)
    lengths = [max(2, T - (b % 2)) for b in range(B)]
    base_mask = torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]
    padded = torch.cat([x, torch.full((B, pad, D), garbage, dtype=torch.float64) + _random(seed + 1, B, pad, D)], 1)
    x = torch.where(base_mask[..., None], garbage, x)  # garbage inside the mask too
    mask = torch.cat([base_mask, torch.ones(B, pad, dtype=torch.bool)], 1)
    for fn in TOKEN_METRICS:
        want = fn(x, base_mask)
        got = fn(padded, mask)
        assert torch.allclose(want, got, rtol=1e-9, atol=1e-12), fn.__name__
        # and the same as computing each sample alone on its real tokens
        for b in range(B):
            alone = x[b : b + 1, : lengths[b]]
            if fn is not centred_token_cosine:  # centring uses the whole batch's mean token
                assert fn(alone).item() == pytest.approx(want[b].item(), rel=1e-9, abs=1e-12), fn.__name__


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), shift=st.floats(-100, 100))
def test_centred_cosine_ignores_a_shared_offset(seed, shift):
    x = _random(seed, 3, 5, 4)
    offset = shift * torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    assert torch.allclose(centred_token_cosine(x + offset), centred_token_cosine(x), atol=1e-9)


def test_large_shared_offset_drives_plain_cosine_to_one():
    x = _random(3, 2, 6, 4)
    shifted = x + 1e4 * torch.ones(4, dtype=torch.float64)
    assert token_cosine(shifted).min().item() > 0.9999
    assert token_cosine(x).max().item() < 0.9


def test_exclude_first_equals_dropping_the_token():
    x = _random(7, 3, 6, 5)
    for fn in TOKEN_METRICS:
        assert torch.allclose(fn(x, exclude=(0,)), fn(x[:, 1:]), atol=1e-12), fn.__name__


# ---------------------------------------------------------------- Fourier (Park & Kim)


def _grid_tokens(pattern: torch.Tensor, channels: int, cls: bool) -> torch.Tensor:
    """(g, g) pattern -> (1, [1 +] g*g, channels) tokens, channel c scaled by c + 1."""
    g = pattern.shape[0]
    x = pattern.reshape(g * g, 1) * torch.arange(1, channels + 1, dtype=torch.float64)[None]
    if cls:
        x = torch.cat([torch.full((1, channels), 123.0, dtype=torch.float64), x])
    return x[None]


@pytest.mark.parametrize("g", [4, 6, 8])
@pytest.mark.parametrize("cls", [False, True])
def test_checkerboard_and_constant_high_frequency(g, cls):
    i = torch.arange(g, dtype=torch.float64)
    checker = (-1.0) ** (i[:, None] + i[None, :])
    C = 3
    eps = 1e-6
    # checkerboard: all energy at (pi, pi), |F| = (c+1) g^2 there and 0 at frequency 0
    want = np.mean([math.log((c + 1) * g * g + eps) for c in range(C)]) - math.log(eps)
    assert high_frequency(_grid_tokens(checker, C, cls), g).item() == pytest.approx(want, rel=1e-9)
    # constant: all energy at frequency 0
    const = torch.ones(g, g, dtype=torch.float64)
    assert high_frequency(_grid_tokens(const, C, cls), g).item() == pytest.approx(-want, rel=1e-9)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_diagonal_wave_peaks_at_its_frequency(k):
    g = 8
    i = torch.arange(g, dtype=torch.float64)
    wave = torch.cos(2 * math.pi * k * (i[:, None] + i[None, :]) / g)
    curve = relative_log_amplitude(_grid_tokens(wave, 2, cls=True), g)[0]
    assert curve.shape == (g // 2 + 1,)
    assert curve[0].item() == 0.0
    assert int(curve.argmax()) == k


def test_fourier_needs_a_full_grid():
    with pytest.raises(InputError, match="grid 4x4"):
        high_frequency(torch.zeros(1, 15, 3), 4)


# ---------------------------------------------------------------- accumulation


def test_observer_weights_samples_across_batches():
    a, b = _random(1, 3, 5, 4), _random(2, 1, 5, 4)
    mask_a = torch.zeros(3, 5, dtype=torch.bool)
    mask_a[0, 3:] = True
    obs = SmoothnessObserver()
    for x, m in ((a, mask_a), (b, None)):
        obs.begin_batch(m)
        obs(0, x)
        obs(1, 2 * x + 1)
    result = obs.result()
    assert result["layers"] == [0, 1] and result["samples"] == 4
    per_sample = torch.cat([token_cosine(a, mask_a), token_cosine(b)])
    assert result["cosine"][0] == pytest.approx(per_sample.mean().item(), rel=1e-12)
    per_sample = torch.cat([effective_rank(2 * a + 1, mask_a), effective_rank(2 * b + 1)])
    assert result["effective_rank"][1] == pytest.approx(per_sample.mean().item(), rel=1e-12)
    # only Python floats are kept, never tensors
    assert all(isinstance(v, float) for vs in obs._sums.values() for v in vs)


def test_layer_metrics_keys():
    x = torch.randn(2, 17, 8)
    assert set(layer_metrics(x)) == {"cosine", "cosine_centred", "rank_residual", "effective_rank", "hc_ratio"}
    assert "high_freq" in layer_metrics(x, grid=4)


# ---------------------------------------------------------------- the evaluated set: centring, samples against samples


def _pairwise_same_minus_different(x: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """The definition written out pair by pair: per sample the mean cosine over its ordered token pairs i != j;
    per ordered pair of distinct samples the mean cosine over all their token pairs; the two means' difference."""
    tokens = [x[b] if mask is None else x[b][~mask[b]] for b in range(len(x))]
    cos = lambda u, v: float(u @ v / (u.norm() * v.norm()))
    same = [np.mean([cos(t[i], t[j]) for i in range(len(t)) for j in range(len(t)) if i != j]) for t in tokens]
    different = [
        np.mean([cos(u, v) for u in tokens[a] for v in tokens[b]])
        for a in range(len(tokens))
        for b in range(len(tokens))
        if a != b
    ]
    return float(np.mean(same) - np.mean(different))


def test_same_minus_different_by_hand():
    # sample 0: e1, e2 (same-sample cosine 0); sample 1: e1, e1 (1); sample 2: e2, e1+e2 (1/sqrt 2)
    r = 1 / math.sqrt(2)
    x = torch.tensor([[[1.0, 0], [0, 1]], [[1, 0], [1, 0]], [[0, 1], [1, 1]]], dtype=torch.float64)
    same = (0 + 1 + r) / 3
    # mean unit tokens u0 = (1/2, 1/2), u1 = (1, 0), u2 = (r/2, (1 + r)/2): the six ordered pairs
    u = [(0.5, 0.5), (1.0, 0.0), (r / 2, (1 + r) / 2)]
    dots = [u[a][0] * u[b][0] + u[a][1] * u[b][1] for a in range(3) for b in range(3) if a != b]
    want = same - sum(dots) / 6
    assert want == pytest.approx(1 / 12, rel=1e-12)  # (1 + r) / 3 - (3/4 + r) / 3
    assert same_minus_different_cosine(x) == pytest.approx(want, rel=1e-12)
    assert same_minus_different_cosine(x) == pytest.approx(_pairwise_same_minus_different(x), rel=1e-12)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(2, 4), T=st.integers(2, 5), D=st.integers(2, 6))
def test_same_minus_different_matches_the_pairwise_definition_with_padding(seed, B, T, D):
    x = _random(seed, B, T + 1, D)
    mask = torch.zeros(B, T + 1, dtype=torch.bool)
    mask[0, -1] = True  # ragged: sample 0 has one token fewer
    mask[1:, :] = False
    want = _pairwise_same_minus_different(x, mask)
    assert same_minus_different_cosine(x, mask) == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_same_minus_different_of_identical_sample_constant_and_random_tokens():
    # every token the same vector: as alike within a sample as across samples
    v = torch.tensor([0.3, -1.2, 2.0, 0.5], dtype=torch.float64)
    assert same_minus_different_cosine(v.expand(4, 6, 4)) == pytest.approx(0.0, abs=1e-12)
    # each sample's tokens one constant of its own, the constants orthogonal: within 1, across 0
    constants = 2.5 * torch.eye(4, dtype=torch.float64)
    assert same_minus_different_cosine(constants[:, None, :].expand(4, 6, 4)) == pytest.approx(1.0, rel=1e-12)
    # isotropic random tokens: about 0 (within and across alike near 0)
    assert abs(same_minus_different_cosine(_random(0, 32, 16, 64))) < 0.01
    # a large shared offset lifts the plain cosine near 1 within and across samples: the difference stays small
    shifted = _random(1, 8, 10, 16) + 50.0
    assert token_cosine(shifted).min().item() > 0.99 and abs(same_minus_different_cosine(shifted)) < 1e-3


def test_different_sample_cosine_needs_two_samples():
    assert math.isnan(different_sample_cosine(torch.ones(3), 1.0, 1))
    assert math.isnan(same_minus_different_cosine(_random(0, 1, 4, 3)))


def test_centred_cosine_of_identical_tokens_is_undefined_and_of_sample_constants_is_one():
    v = torch.tensor([0.3, -1.2, 2.0, 0.5])  # float32: rounding must not give tokens at the mean a direction
    assert torch.isnan(centred_token_cosine(v.expand(3, 5, 4))).all()
    constants = torch.tensor([[1.0, 2.0, 0.0, 0.0], [-1.0, -2.0, 0.0, 0.0], [0.0, 0.0, 3.0, 1.0]])
    x = constants[:, None, :].expand(3, 5, 4)
    # the mean token is (0, 0, 1, 1/3): each sample's centred tokens are still one vector each
    assert torch.allclose(centred_token_cosine(x), torch.ones(3))
    obs = SmoothnessObserver(centre=[v])
    obs(0, v.expand(3, 5, 4))
    assert math.isnan(obs.result()["cosine_centred"][0])  # no sample counted: NaN, null in smoothness.json


def test_centred_cosine_subtracts_the_mean_of_the_whole_set_across_batches():
    a, b = _random(1, 3, 5, 4) + 2.0, _random(2, 2, 5, 4) - 1.0
    mask_a = torch.zeros(3, 5, dtype=torch.bool)
    mask_a[0, 3:] = True
    mask_all = torch.cat([mask_a, torch.zeros(2, 5, dtype=torch.bool)])
    whole = torch.cat([a, b])
    means = TokenMeans()
    for x, m in ((a, mask_a), (b, None)):
        means.begin_batch(m)(0, x)
    kept = whole[~mask_all]
    assert torch.allclose(means.means()[0], kept.mean(0), atol=1e-12)
    obs = SmoothnessObserver(centre=means.means())
    for x, m in ((a, mask_a), (b, None)):
        obs.begin_batch(m)(0, x)
    result = obs.result()
    # the same numbers as the whole set in one batch, which differ from centring each batch on its own mean
    assert result["cosine_centred"][0] == pytest.approx(centred_token_cosine(whole, mask_all).mean().item(), rel=1e-12)
    own = torch.cat([centred_token_cosine(a, mask_a), centred_token_cosine(b)]).mean().item()
    assert abs(result["cosine_centred"][0] - own) > 0.01
    # samples are paired across batches too
    want = _pairwise_same_minus_different(whole, mask_all)
    assert result["cosine_same_minus_different"][0] == pytest.approx(want, rel=1e-12)


def test_smoothness_reports_set_metrics_per_layer_of_a_model():
    from kilolayer import build_model

    torch.manual_seed(0)
    model = build_model(dict(arch="encoder", layers=3, width=16, heads=2, ffn=32, vocab_size=32, max_len=8)).eval()
    g = torch.Generator().manual_seed(0)
    batches = [{"inputs": torch.randint(0, 32, (3, 8), generator=g)} for _ in range(2)]
    result = smoothness(model, iter(batches))  # a one-shot iterator is read once, run twice
    hidden = [[], [], [], []]
    with torch.no_grad():
        for batch in batches:
            model(**batch, observe=lambda i, h: hidden[i].append(h.clone()))
    whole = [torch.cat(h) for h in hidden]
    for key in ("cosine", "cosine_centred", "cosine_same_minus_different"):
        assert len(result[key]) == len(result["layers"]) == 4
    assert result["cosine_centred"] == pytest.approx([centred_token_cosine(h).mean().item() for h in whole], rel=1e-5)
    assert result["cosine_same_minus_different"] == pytest.approx(
        [same_minus_different_cosine(h) for h in whole], rel=1e-5, abs=1e-7
    )
