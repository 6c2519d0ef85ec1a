"""DeepNet's section 3 analysis (``deepnet_analysis``) and robustness sweep (``deepnet_robust``): each built-in claim
fed constructed evidence says what its stated rule says, and the specs expand to the intended points.

The results are the built-in studies' own grid points with made-up outcomes and diagnostics records (layer names
as the trainer logs them); chance levels are set on them, so nothing trains and no data is loaded.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import yaml
from helpers import CHANCE, builtin_claim, study_results

from kilolayer.analysis.chance import LEARNED_NOTHING
from kilolayer.study.builtin import BUILTIN
from kilolayer.study.spec import expand, load_spec
from kilolayer.verdicts.rule import HELD, INCONCLUSIVE, NOT_HELD


def _builtin(name: str):
    return builtin_claim(name, "deepnet_analysis")


deepnet_init_loss, deepnet_init_update = _builtin("deepnet_init_loss"), _builtin("deepnet_init_update")
deepnet_init_gradient, deepnet_init_gradient_depth = map(
    _builtin, ("deepnet_init_gradient", "deepnet_init_gradient_depth")
)
deepnet_robust = builtin_claim("deepnet_robust", "deepnet_robust")

STEPS = [1, *range(5, 201, 5)]  # the analysis study's diagnostics steps: every 5 for the first 200


def _scheme(p) -> str:
    return p.values["model.scheme"]


def _seed(p) -> int:
    return p.values["train.seed"]


def _records(p, grad, update=0.1, steps=STEPS) -> list[dict]:
    """Diagnostics records of point ``p``: ``grad(stack, i, layers, step)`` per layer, bottom to top."""
    m = p.config.model
    names = [f"encoder.{i}" for i in range(m.layers)] + [f"decoder.{i}" for i in range(m.decoder_layers)]
    return [
        {
            "step": s,
            "split": "diagnostics",
            "layers": names,
            "grad_norm": [grad(n.split(".")[0], int(n.split(".")[1]), m.decoder_layers, s) for n in names],
            "update": update,
            "ln_names": ["decoder.final_norm"],
            "ln_input": [1.0 + 0.01 * s],
        }
        for s in steps
    ]


def _analysis(grad=None, loss=None, update=None, status=None, steps=None, seeds=(0, 1), drop=()):
    """The deepnet_analysis points, each scheme's outcome a function of (point): ``grad[scheme](stack, i, M,
    step, seed)``, ``loss[scheme](seed)``, ``update[scheme](seed)`` (the first update), ``status[scheme](point)``,
    ``steps[scheme](point)`` (its diagnostics steps); points whose key contains a string of ``drop`` are missing."""
    grad, loss, update = grad or {}, loss or {}, update or {}
    status, steps = status or {}, steps or {}

    def outcome(p):
        s, seed = _scheme(p), _seed(p)
        st = status.get(s, lambda p: "completed")(p)
        g = grad.get(s, lambda stack, i, M, step, seed: 1.0)
        records = _records(
            p,
            lambda stack, i, M, step: g(stack, i, M, step, seed),
            update.get(s, lambda seed: 0.1)(seed),
            steps.get(s, lambda p: STEPS)(p),
        )
        final = {"loss": loss.get(s, lambda seed: 0.05)(seed)} if st == "completed" else {}
        return st, final, records

    return [r for r in study_results("deepnet_analysis", outcome, seeds) if not any(d in r.point.key for d in drop)]


def _top_larger(factor, noise=0.02):
    """Post-LN-init's gradient ``factor`` x Post-LN's in the decoder's top third, seed 1 a little apart; the rest
    of the layers ten times smaller than Post-LN's (what the top-layer rule must not read)."""

    def grad(stack, i, M, step, seed):
        top = stack == "decoder" and i >= M - math.ceil(M / 3)
        return factor * (1 + noise * seed) if top else 0.1

    return {"post_ln_init": grad, "post_ln": lambda *a: 1.0}


# ---------------------------------------------------------------- (a) gradient in the top layers, 18L-18L


def _key(scheme: str, seed: int, layers: int = 18) -> str:
    return f"scheme={scheme}_layers={layers}_decoder_layers={layers}_seed={seed}"


def test_top_layer_gradient_held_when_post_ln_init_is_larger(tmp_path):
    f = deepnet_init_gradient(_analysis(grad=_top_larger(2.0)), tmp_path)
    v = f.verdict
    assert v.verdict == HELD and v.n == 2
    # ln of the ratio in the top 6 of 18 decoder layers, per seed: the lower layers' 0.1 do not count
    assert v.per_seed == pytest.approx({0: math.log(2.0), 1: math.log(2.04)})
    assert f.headers[:3] == ["model.scheme", "seed", "top_third_gradient"]
    rows = {(r[0], r[1]): r for r in f.rows}
    assert set(rows) == {(s, seed) for s in ("post_ln", "post_ln_init") for seed in (0, 1)}  # the sides compared
    assert rows[("post_ln_init", 0)][2] == "2" and rows[("post_ln", 1)][2] == "1"
    assert "top third of the top stack's layers" in f.rule and "read over the same steps" in f.rule
    assert "model.layers = 18 (the group's max)" in f.rule


def test_top_layer_gradient_did_not_hold_when_smaller(tmp_path):
    v = deepnet_init_gradient(_analysis(grad=_top_larger(0.5)), tmp_path).verdict
    assert v.verdict == NOT_HELD and v.mean == pytest.approx(math.log(0.5 * 1.01), abs=1e-3)


def test_top_layer_gradient_inconclusive_below_the_margin_with_one_seed_or_a_failed_run(tmp_path):
    # 1.1x in every seed is in the claim's direction but inside the ln 1.25 margin (and of zero variance: the
    # sign test decides, and finds no seed beyond the margin)
    v = deepnet_init_gradient(_analysis(grad=_top_larger(1.1, noise=0.0)), tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and v.test == "sign" and v.mean == pytest.approx(math.log(1.1))
    assert "0 of 2 seeds beyond +margin" in v.reason
    v = deepnet_init_gradient(_analysis(grad=_top_larger(2.0), seeds=(0,)), tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and "one seed" in v.reason
    failed = {"post_ln": lambda p: "failed" if _seed(p) == 1 else "completed"}
    v = deepnet_init_gradient(_analysis(grad=_top_larger(2.0), status=failed), tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and f"{_key('post_ln', 1)} (failed: boom)" in v.reason


def test_top_layer_gradient_reads_only_the_steps_both_runs_logged(tmp_path):
    # Post-LN diverged after step 10; Post-LN-init's later steps (where its gradient is 100x) must not count
    diverged = {"post_ln": lambda p: "diverged"}
    steps = {"post_ln": lambda p: [1, 5, 10]}
    g = {
        "post_ln_init": lambda stack, i, M, step, seed: 3.0 * (1 + 0.1 * seed) if step <= 10 else 300.0,
        "post_ln": lambda *a: 1.0,
    }
    f = deepnet_init_gradient(_analysis(grad=g, status=diverged, steps=steps), tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx((math.log(3.0) + math.log(3.3)) / 2)
    # the table shows what the verdict used: Post-LN-init over steps 1-10 (3 and 3.3), never its full window's
    rows = {(r[0], r[1]): r[2] for r in f.rows}
    assert rows == {("post_ln_init", 0): "3", ("post_ln_init", 1): "3.3", ("post_ln", 0): "1", ("post_ln", 1): "1"}
    assert any("over the diagnostics steps that both runs of its pair logged" in n for n in f.notes)
    # the steps window is the pair's: the same Post-LN-init runs beside a Post-LN that logged every step read 300x
    f = deepnet_init_gradient(_analysis(grad=g, status=diverged), tmp_path)
    assert f.verdict.mean > math.log(50)


def test_top_layer_gradient_that_vanished_is_named_not_averaged(tmp_path):
    g = _top_larger(2.0)
    g["post_ln"] = lambda stack, i, M, step, seed: 0.0 if (seed == 1 and step == 5) else 1.0
    v = deepnet_init_gradient(_analysis(grad=g), tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and f"{_key('post_ln', 1)} (no finite top_third_gradient)" in v.reason
    assert v.per_seed == pytest.approx({0: math.log(2.0)})


# ---------------------------------------------------------------- (b) the last layer's gradient across depths


def _last_larger(factor_at):
    """Post-LN-init's last decoder layer ``factor_at(M)`` x Post-LN's at depth M (every other layer equal)."""

    def grad(stack, i, M, step, seed):
        return factor_at(M) * (1 + 0.01 * seed) if (stack == "decoder" and i == M - 1) else 1.0

    return {"post_ln_init": grad, "post_ln": lambda *a: 1.0, "deepnorm": lambda *a: 0.5}


def test_last_layer_gradient_held_at_every_depth(tmp_path):
    f = deepnet_init_gradient_depth(_analysis(grad=_last_larger(lambda M: 2.0 + 0.1 * M)), tmp_path)
    v = f.verdict
    # d is the smallest ratio over 6, 12, 18 and 24 layers: the one at 6L-6L
    assert v.verdict == HELD and v.per_seed == pytest.approx({0: math.log(2.6), 1: math.log(2.6 * 1.01)})
    assert "the worst of them taken (the claim must hold at each)" in f.rule
    # one row per run of the two sides, at each depth and seed
    assert len(f.rows) == 2 * 4 * 2 and {r[0] for r in f.rows} == {"post_ln", "post_ln_init"}
    column = f.headers.index("top_layer_gradient")
    layers, seed = f.headers.index("model.layers"), f.headers.index("seed")
    deepest = next(r for r in f.rows if r[0] == "post_ln_init" and r[layers] == 24 and r[seed] == 0)
    assert deepest[column] == "4.4"


def test_last_layer_gradient_smaller_at_one_depth_did_not_hold(tmp_path):
    # larger at 6L-6L to 18L-18L, half Post-LN's at 24L-24L: "regardless of depth" is contradicted, however much
    # larger it is at the other depths (their mean would hold)
    v = deepnet_init_gradient_depth(_analysis(grad=_last_larger(lambda M: 0.5 if M == 24 else 30.0)), tmp_path).verdict
    assert v.verdict == NOT_HELD and v.mean == pytest.approx(math.log(0.5 * 1.005), abs=1e-3)


def test_last_layer_gradient_missing_depth_leaves_the_seed_out(tmp_path):
    results = _analysis(grad=_last_larger(lambda M: 3.0), drop=("post_ln_layers=12_decoder_layers=12_seed=1",))
    v = deepnet_init_gradient_depth(results, tmp_path).verdict
    assert v.verdict == INCONCLUSIVE
    assert "model.scheme=post_ln seed 1 at model.layers=12, model.decoder_layers=12 (missing)" in v.reason
    assert v.per_seed == pytest.approx({0: math.log(3.0)})


def test_the_gradient_plots_draw_from_the_runs_a_claim_reads(tmp_path):
    """The plots the gradient claims ask for: gradient per layer at the deepest setting (Figure 3(a)) and the last
    layer's gradient across depths (Figure 3(b)), drawn from constructed diagnostics; nothing without them."""
    from kilolayer.study.claim_plots import CLAIM_PLOTS

    runs = _analysis(grad=_last_larger(lambda M: 2.0), seeds=(0,))
    deep = [r for r in runs if r.point.group == "deepnet"]
    sweep = [r for r in runs if r.point.group == "depth_gradients"]
    [(path, caption)] = CLAIM_PLOTS.get("layer_gradients")(deep, tmp_path, "g")
    assert path.endswith("g_gradients.png") and "per layer" in caption
    [(path, caption)] = CLAIM_PLOTS.get("last_layer_gradients")(sweep, tmp_path, "d")
    assert path.endswith("d_gradients.png") and "vs depth" in caption
    assert (tmp_path / "report_files" / "g_gradients.png").is_file()
    for r in deep:
        r.diagnostics = []
    assert CLAIM_PLOTS.get("layer_gradients")(deep, tmp_path, "none") == []


# ---------------------------------------------------------------- (c) validation loss at 18L-18L


def test_loss_held_did_not_hold_and_unlearned(tmp_path):
    loss = {"post_ln": lambda s: 2.1, "post_ln_init": lambda s: 0.3 + 0.01 * s}
    f = deepnet_init_loss(_analysis(loss=loss), tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(1.795)
    assert [row[0] for row in f.rows] == ["post_ln", "post_ln", "post_ln_init", "post_ln_init"]  # the sides compared
    worse = {"post_ln": lambda s: 0.3, "post_ln_init": lambda s: 1.5 + 0.01 * s}
    assert deepnet_init_loss(_analysis(loss=worse), tmp_path).verdict.verdict == NOT_HELD
    # Post-LN diverged (chance 2.4) and Post-LN-init ended above 0.9 x chance: a positive d, but it learned nothing
    unlearned = {"post_ln_init": lambda s: 2.3}
    assert 2.3 > LEARNED_NOTHING * CHANCE["loss"]
    v = deepnet_init_loss(_analysis(loss=unlearned, status={"post_ln": lambda p: "diverged"}), tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and v.mean == pytest.approx(0.1) and "learned nothing" in v.reason


# ---------------------------------------------------------------- (d) the early model update


def test_update_held_did_not_hold_and_without_diagnostics(tmp_path):
    update = {"post_ln": lambda s: 3.0 * (1 + 0.01 * s), "post_ln_init": lambda s: 0.2}
    f = deepnet_init_update(_analysis(update=update), tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.per_seed == pytest.approx({0: math.log(15), 1: math.log(15.15)})
    row = next(r for r in f.rows if r[0] == "post_ln_init" and r[1] == 0)
    assert row[:3] == ["post_ln_init", 0, "0.2"]
    smaller = {"post_ln": lambda s: 0.2, "post_ln_init": lambda s: 3.0 + s}
    assert deepnet_init_update(_analysis(update=smaller), tmp_path).verdict.verdict == NOT_HELD
    results = _analysis(update=update)
    for r in results:
        if r.point.values["model.scheme"] == "post_ln_init" and _seed(r.point) == 1:
            r.diagnostics = []
    v = deepnet_init_update(results, tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and "post_ln_init_layers=18_decoder_layers=18_seed=1 (no finite first_update)" in (
        v.reason
    )


def test_the_gradient_claims_cannot_be_named_by_a_study_without_post_ln_init_or_a_depth_sweep(tmp_path):
    """quick's deepnet group has no Post-LN-init and quick has no depth_gradients group: a spec naming the
    section-3 gradient claims is refused before anything trains, one line naming the field."""
    from kilolayer.errors import ConfigError

    for name, message in (
        ("deepnet_init_gradient", r"claimed_better=\"post_ln_init\": not a value of model.scheme"),
        ("deepnet_init_gradient_depth", r"runs='depth_gradients': no group of that name in the spec"),
    ):
        data = BUILTIN["quick"]()
        data["claims"] = [name]
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError, match=message):
            load_spec(tmp_path / "s.yaml")


# ---------------------------------------------------------------- robustness: one setting raised at a time


def _robust(unstable=None, status=None, loss=None, seeds=(0, 1)):
    """The deepnet_robust points: ``unstable[(group, scheme)](value, seed)`` True makes the run end at 2.3 (above
    0.9 x chance: learned nothing), else at ``loss[(group, scheme)](value, seed)`` (0.1 + 0.01 x seed unless
    told); ``status[(group, scheme)](value, seed)`` its status."""
    unstable, status, loss = unstable or {}, status or {}, loss or {}
    key = {"robust_lr": "train.lr", "robust_batch": "train.batch_size", "robust_width": "model.width"}

    def outcome(p):
        x, seed, cell = p.setting(key[p.group]), _seed(p), (p.group, _scheme(p))
        st = status.get(cell, lambda x, seed: "completed")(x, seed)
        bad = unstable.get(cell, lambda x, seed: False)(x, seed)
        final = 2.3 if bad else loss.get(cell, lambda x, seed: 0.1 + 0.01 * seed)(x, seed)
        return st, ({"loss": final} if st == "completed" else {}), []

    return study_results("deepnet_robust", outcome, seeds)


def _by_axis(found) -> dict:
    return {f.name.removeprefix("deepnet_"): f for f in found}


def _stable(seed: int) -> float:
    return (0.1 + 0.01 * seed) / CHANCE["loss"]  # a stable run's loss against chance


UNLEARNED = 2.3 / CHANCE["loss"]


def test_robust_held_where_post_ln_fails_at_the_largest_setting_and_deepnorm_does_not(tmp_path):
    # Post-LN learns nothing at lr 1e-2 and diverges at width 256; DeepNorm is stable throughout
    found = _by_axis(
        deepnet_robust(
            _robust(
                unstable={("robust_lr", "post_ln"): lambda x, s: x == 1e-2},
                status={("robust_width", "post_ln"): lambda x, s: "diverged" if x == 256 else "completed"},
            ),
            tmp_path,
        )
    )
    assert set(found) == {"robust_lr", "robust_batch", "robust_width"}  # one verdict per axis, never pooled
    # d per seed: Post-LN's loss against chance minus DeepNorm's at the axis's largest setting; a diverged run
    # scores 1 (chance); the rule names the setting
    lr, width = found["robust_lr"].verdict, found["robust_width"].verdict
    assert lr.verdict == HELD and lr.test == "t"
    assert lr.per_seed == pytest.approx({s: UNLEARNED - _stable(s) for s in (0, 1)})
    assert width.verdict == HELD and width.per_seed == pytest.approx({s: 1.0 - _stable(s) for s in (0, 1)})
    assert "train.lr = 0.01 (the group's max)" in found["robust_lr"].rule
    table = found["robust_lr"]
    assert table.headers[:3] == ["model.scheme", "seed", "loss_vs_chance"] and len(table.rows) == 2 * 2
    post_ln = next(r for r in table.rows if r[:2] == ["post_ln", 0])
    assert post_ln[2] == f"{UNLEARNED:.4g}"
    diverged = next(r for r in found["robust_width"].rows if r[0] == "post_ln")
    assert diverged[-3:] == ["1", "-", "diverged at step 30"]
    # Post-LN learned at the largest batch: the claim that it fails there is not met, whatever the difference
    batch = found["robust_batch"].verdict
    assert batch.verdict == INCONCLUSIVE and "to fail in every seed" in batch.reason


def test_robust_compares_the_loss_continuously_not_counts_of_settings_survived(tmp_path):
    """Post-LN at chance at the largest learning rate in both seeds, DeepNorm learned: two seeds decide through the
    t-bounds on the loss against chance (a count of settings survived, 1 in each seed, would need 5 seeds)."""
    worse = {("robust_lr", "post_ln"): lambda x, s: 2.2 + 0.05 * s if x == 1e-2 else 0.1 + 0.01 * s}
    assert 2.2 > LEARNED_NOTHING * CHANCE["loss"]
    v = _by_axis(deepnet_robust(_robust(loss=worse), tmp_path))["robust_lr"].verdict
    expected = {s: (2.2 + 0.05 * s) / CHANCE["loss"] - _stable(s) for s in (0, 1)}
    assert v.verdict == HELD and v.test == "t" and v.per_seed == pytest.approx(expected)
    assert "loss as a multiple of the chance loss" in _by_axis(deepnet_robust(_robust(), tmp_path))["robust_lr"].rule


def test_robust_did_not_hold_when_deepnorm_fails_where_post_ln_does_not(tmp_path):
    # DeepNorm learned nothing at the largest learning rate, Post-LN learned: the claim is contradicted, and says why
    unstable = {("robust_lr", "deepnorm"): lambda x, s: x > 1e-3}
    v = _by_axis(deepnet_robust(_robust(unstable=unstable), tmp_path))["robust_lr"].verdict
    assert v.verdict == NOT_HELD and v.per_seed == pytest.approx({s: _stable(s) - UNLEARNED for s in (0, 1)})
    assert "learned nothing" in v.reason and "robust_lr/scheme=deepnorm_lr=0.01_seed=0" in v.reason


def test_robust_deepnorm_that_learned_nothing_makes_a_held_inconclusive(tmp_path):
    """Both at chance at the largest learning rate: d = 0, inconclusive, naming DeepNorm's run; Post-LN diverged there
    while DeepNorm learned nothing: the difference alone would be held, but the claim needs DeepNorm to learn."""
    both = lambda x, s: x == 1e-2
    unstable = {("robust_lr", "deepnorm"): both, ("robust_lr", "post_ln"): both}
    v = _by_axis(deepnet_robust(_robust(unstable=unstable), tmp_path))["robust_lr"].verdict
    assert v.verdict == INCONCLUSIVE and v.per_seed == {0: 0.0, 1: 0.0}
    assert "robust_lr/scheme=deepnorm_lr=0.01_seed=0" in v.reason and "learned nothing" in v.reason
    diverged = {("robust_lr", "post_ln"): lambda x, s: "diverged" if x > 1e-3 else "completed"}
    worse = {("robust_lr", "deepnorm"): lambda x, s: 2.0 + 0.02 * s if x == 1e-2 else 0.1}  # 0.83-0.84 x chance
    v = _by_axis(deepnet_robust(_robust(loss=worse, status=diverged), tmp_path))["robust_lr"].verdict
    assert v.verdict == HELD  # 0.83 x chance is below the 0.9 bar: DeepNorm learned (a little)
    unstable = {("robust_lr", "deepnorm"): both}
    v = _by_axis(deepnet_robust(_robust(unstable=unstable, status=diverged), tmp_path))["robust_lr"].verdict
    assert v.per_seed == pytest.approx({s: 1.0 - UNLEARNED for s in (0, 1)})
    assert v.verdict == INCONCLUSIVE and "learned nothing" in v.reason


def test_robust_post_ln_training_better_is_no_did_not_hold_for_a_deepnorm_that_learned(tmp_path):
    """At the largest learning rate both learned, Post-LN to a lower loss: the claim's premise (Post-LN fails) is
    unmet, so the verdict is inconclusive, not a did not hold of a DeepNorm that trained."""
    better = {("robust_lr", "post_ln"): lambda x, s: 0.7 + 0.01 * s, ("robust_lr", "deepnorm"): lambda x, s: 1.2}
    v = _by_axis(deepnet_robust(_robust(loss=better), tmp_path))["robust_lr"].verdict
    assert v.mean < -v.margin and v.verdict == INCONCLUSIVE and "to fail in every seed" in v.reason


def test_robust_seeds_that_disagree_a_failed_run_or_one_seed_are_inconclusive(tmp_path):
    unstable = {("robust_lr", "post_ln"): lambda x, s: x == 1e-2 and s == 0}
    v = _by_axis(deepnet_robust(_robust(unstable=unstable), tmp_path))["robust_lr"].verdict
    assert v.verdict == INCONCLUSIVE and v.per_seed == pytest.approx({0: UNLEARNED - _stable(0), 1: 0.0})
    assert "to fail in every seed" in v.reason
    failed = {("robust_batch", "deepnorm"): lambda x, s: "failed" if x == 128 and s == 1 else "completed"}
    v = _by_axis(deepnet_robust(_robust(status=failed), tmp_path))["robust_batch"].verdict
    assert v.verdict == INCONCLUSIVE and "robust_batch/scheme=deepnorm_batch_size=128_seed=1 (failed: boom)" in v.reason
    one = {("robust_lr", "post_ln"): lambda x, s: x == 1e-2}
    v = _by_axis(deepnet_robust(_robust(unstable=one, seeds=(0,)), tmp_path))["robust_lr"].verdict
    assert v.verdict == INCONCLUSIVE and "one seed" in v.reason


def test_the_robustness_loss_curves_have_a_panel_per_raised_setting(tmp_path):
    from kilolayer.study.claim_plots import CLAIM_PLOTS

    runs = [r for r in _robust(seeds=(0,)) if r.point.group == "robust_batch"]
    [(path, caption)] = CLAIM_PLOTS.get("loss_curves")(runs, tmp_path, "deepnet_robust_batch")
    assert caption == "validation loss vs step, one panel per train.batch_size" and path.endswith("_loss.png")
    assert (tmp_path / "report_files" / "deepnet_robust_batch_loss.png").is_file()


# ---------------------------------------------------------------- the specs


def test_deepnet_analysis_expands_to_its_panels():
    spec = load_spec("deepnet_analysis")
    points = expand(spec)
    assert len(points) == 30
    schemes = {"post_ln", "post_ln_init", "deepnorm"}
    deep = [p for p in points if p.group == "deepnet"]
    assert {(_scheme(p), p.config.model.layers, p.config.model.decoder_layers, _seed(p)) for p in deep} == {
        (s, 18, 18, seed) for s in schemes for seed in (0, 1)
    }
    sweep = [p for p in points if p.group == "depth_gradients"]
    assert {(_scheme(p), p.config.model.layers, _seed(p)) for p in sweep} == {
        (s, d, seed) for s in schemes for d in (6, 12, 18, 24) for seed in (0, 1)
    }
    for p in points:
        c = p.config
        assert (c.model.arch, c.model.width, c.data.task, c.train.lr, c.train.warmup) == (
            "encoder_decoder",
            64,
            "reverse",
            1e-3,
            100,
        )
        assert (c.train.diagnostics_every, c.train.diagnostics_until) == (5, 200)
        # the depth sweep trains only the diagnosed window; the 18L-18L models train on for the loss curves
        assert c.train.steps == (2000 if p.group == "deepnet" else 200)
    assert spec.findings == []  # every section-3 question is a claim of kilolayer/studies/claims/deepnet.yaml
    assert [c.name for c in spec.claims] == [
        "deepnet_init_gradient",
        "deepnet_init_gradient_depth",
        "deepnet_init_loss",
        "deepnet_init_update",
    ]
    assert spec.expected_minutes <= 90 and spec.expected_basis.startswith("measured with --jobs 2")


def test_deepnet_robust_raises_one_setting_at_a_time():
    spec = load_spec("deepnet_robust")
    points = expand(spec)
    assert len(points) == 72 and [g.name for g in spec.groups] == ["robust_lr", "robust_batch", "robust_width"]
    base = {"train.lr": 1e-3, "train.batch_size": 32, "model.width": 64}
    raised = {"robust_lr": "train.lr", "robust_batch": "train.batch_size", "robust_width": "model.width"}
    for p in points:
        assert _scheme(p) in ("post_ln", "pre_ln", "deepnorm", "branchnorm")
        c = p.config
        assert (c.model.layers, c.model.decoder_layers, c.model.heads, c.train.steps) == (6, 6, 4, 400)
        assert c.model.ffn == 4 * c.model.width
        for key, value in base.items():
            if key != raised[p.group]:
                assert p.setting(key) == value, (p.key, key)
    values = {g: sorted({p.setting(raised[g]) for p in points if p.group == g}) for g in raised}
    assert values == {"robust_lr": [1e-3, 3e-3, 1e-2], "robust_batch": [32, 64, 128], "robust_width": [64, 128, 256]}
    assert spec.expected_minutes <= 90 and spec.expected_basis.startswith("measured with --jobs 2")


def test_deepnet_compares_table_1_and_branchnorm():
    schemes = BUILTIN["deepnet"]()["groups"][0]["grid"]["model.scheme"]
    # DeepNet's Table 1, row by row, then BranchNorm
    assert schemes == [
        "post_ln",
        "ds_init",
        "admin",
        "rezero",
        "r_fixup",
        "t_fixup",
        "pre_ln",
        "dlcl",
        "normformer",
        "deepnorm",
        "branchnorm",
    ]
    spec = load_spec("deepnet")
    points = expand(spec)
    grid = [p for p in points if p.group == "deepnet"]
    assert {_scheme(p) for p in grid} == set(schemes)
    assert len(grid) == 11 * 4 * 2 and len(points) == len(grid) + 1
    assert "estimated" in spec.expected_basis and all(s in spec.description for s in schemes)


def test_study_list_shows_the_new_studies(capsys):
    from kilolayer.study.cli import cmd_study

    assert cmd_study(SimpleNamespace(list=True)) == 0
    lines = capsys.readouterr().out.splitlines()
    first = {line.split()[0]: line for line in lines if line and not line.startswith(" ")}
    assert " 30 runs, ~38 min on 2 CPU cores (measured with --jobs 2" in first["deepnet_analysis"]
    assert " 72 runs, ~59 min on 2 CPU cores (measured with --jobs 2" in first["deepnet_robust"]
    assert " 89 runs, ~9.0 h on 2 CPU cores (estimated" in first["deepnet"]
    described = lines[lines.index(first["deepnet_robust"]) + 1]
    assert described.strip().startswith("DeepNet's robustness sweep at CPU scale")
