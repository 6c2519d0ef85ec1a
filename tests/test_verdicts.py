"""The verdict rule as a measuring instrument: constructed evidence in, exactly the verdict the stated rule says out.

Every case builds Results for the built-in studies' grid points with made-up outcomes; chance levels are set
on the results, so no data is loaded and nothing trains.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import pytest
import yaml
from helpers import CHANCE, builtin_claim
from hypothesis import given, settings
from hypothesis import strategies as st

from kilolayer.analysis.chance import LEARNED_NOTHING
from kilolayer.study.runner import Result
from kilolayer.study.spec import expand, load_spec
from kilolayer.verdicts.rule import HELD, INCONCLUSIVE, NOT_HELD, decide, t_quantile


@pytest.fixture(autouse=True)
def no_data(monkeypatch):
    """A verdict is a rule applied to evidence: the evidence here is made up, so no test may load a data source
    (a corpus that a fresh machine has not fetched would fail it there, and only there)."""
    from kilolayer.data import SOURCES

    class Unloadable:
        """A source as a config reads it (its options and fields), refusing to be built: building loads its data."""

        def __init__(self, name):
            self.name, self.source = name, real_get(name)

        def __getattr__(self, attr):
            return getattr(self.source, attr)

        def __call__(self, *args, **kwargs):
            raise AssertionError(f"a verdict test loaded the data source {self.name!r}")

    real_get = SOURCES.get
    monkeypatch.setattr(SOURCES, "get", Unloadable)


def test_no_verdict_test_can_load_a_data_source():
    from kilolayer.config import load_config
    from kilolayer.data import load_source

    config = load_config("configs/digits_mae.yaml")  # a config still reads its source's options
    with pytest.raises(AssertionError, match="a verdict test loaded the data source 'digits'"):
        load_source(config)


def _builtin(name: str):
    return builtin_claim(name, "quick")


deepnet_postln, deepnet_preln, deepnet_update = map(_builtin, ("deepnet_postln", "deepnet_preln", "deepnet_update"))
deepnet_postln_bleu, deepnet_preln_bleu = map(_builtin, ("deepnet_postln_bleu", "deepnet_preln_bleu"))
bamboo_smoothing, bamboo_depth, bamboo_depth_tokens = (
    builtin_claim(name, "bamboo") for name in ("bamboo_smoothing", "bamboo_depth", "bamboo_depth_tokens")
)

# ---------------------------------------------------------------- the rule itself


def test_t_quantiles_match_the_table():
    # one-sided 95% Student-t quantiles (docs/bamboo.md#verdict-rule):
    # t(1) = 6.314, t(2) = 2.920, t(3) = 2.353, t(9) = 1.833
    for df, t in [(1, 6.314), (2, 2.920), (3, 2.353), (4, 2.132), (5, 2.015), (9, 1.833)]:
        assert t_quantile(df) == pytest.approx(t, abs=1e-3)


def test_decide_bounds_are_student_t():
    d = [0.30, 0.50, 0.40]
    v = decide(d, margin=0.1)
    half = 2.920 * statistics.stdev(d) / math.sqrt(3)
    assert v.mean == pytest.approx(0.4) and v.lower == pytest.approx(0.4 - half, abs=1e-3)
    assert v.upper == pytest.approx(0.4 + half, abs=1e-3) and v.n == 3
    assert v.verdict == HELD  # lower bound 0.232 > 0.1
    # the same mean with more spread: the lower bound falls below the margin
    assert decide([0.0, 0.8, 0.4], margin=0.1).verdict == INCONCLUSIVE
    assert decide([-0.3, -0.5, -0.4], margin=0.1).verdict == NOT_HELD


def test_one_seed_is_never_decided_but_shows_direction_and_size():
    v = decide([0.9], margin=0.01)
    assert v.verdict == INCONCLUSIVE and "one seed" in v.reason and "+0.9" in v.reason
    assert "in the claim's direction" in v.reason
    v = decide([-0.9], margin=0.01)
    assert v.verdict == INCONCLUSIVE and "against the claim" in v.reason


def test_two_seeds_with_opposite_signs_are_inconclusive():
    v = decide([1.0, -0.8], margin=0.05)
    assert v.verdict == INCONCLUSIVE and v.lower < 0 < v.upper


def test_two_agreeing_seeds_can_decide():
    # t(1) = 6.314 is harsh, but identical seeds have no spread
    assert decide([0.5, 0.52], margin=0.05).verdict == HELD


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=0, max_size=8), st.floats(0, 1))
def test_decide_is_antisymmetric(diffs, margin):
    a, b = decide(diffs, margin), decide([-d for d in diffs], margin)
    flip = {HELD: NOT_HELD, NOT_HELD: HELD, INCONCLUSIVE: INCONCLUSIVE}
    assert b.verdict == flip[a.verdict]
    if len(diffs) < 2:
        assert a.verdict == INCONCLUSIVE


def test_excluded_runs_make_any_verdict_inconclusive_and_are_named():
    v = decide([0.5, 0.5, 0.5], margin=0.1, not_evidence=("deepnet/post_ln_18 (failed: out of memory)",))
    assert v.verdict == INCONCLUSIVE and "post_ln_18 (failed: out of memory)" in v.reason


def _slope(depths, values) -> float:
    """The least-squares slope of ``values`` against log2(depth), computed apart from the claims' code."""
    return statistics.linear_regression([math.log2(d) for d in depths], values).slope


def test_a_slope_claim_reads_the_least_squares_slope_per_doubling_of_depth(tmp_path):
    """d of a slope claim is, per seed, the least-squares slope of the measure against log2(depth): a loss falling
    by 0.1 nats per doubling gives d = +0.1 (the claim: it decreases), a curve that rises then falls its own fit."""
    depths = (6, 11, 24, 43)
    bent = dict(zip(depths, (1.5, 1.4, 1.4, 1.5)))
    loss = {"next_token": lambda l, s: 1.5 - 0.1 * math.log2(l) + NOISE[s], "mlm": lambda l, s: bent[l]}
    found = bamboo_depth_tokens(_bamboo(loss=loss), tmp_path)
    nt, mlm = _by_name(found, "bamboo_depth_tokens_next_token"), _by_name(found, "bamboo_depth_tokens_mlm")
    assert nt.verdict.per_seed == pytest.approx({0: 0.1, 1: 0.1, 2: 0.1})
    expected = -_slope(depths, [bent[d] for d in depths])
    assert mlm.verdict.per_seed == pytest.approx(dict.fromkeys((0, 1, 2), expected))
    assert "per doubling" in nt.rule and "log2(model.layers)" in nt.rule


# ---------------------------------------------------------------- DeepNet findings


def _deepnet(loss: dict, status: dict | None = None, update: dict | None = None, seeds=(0, 1)):
    """The quick study's deepnet points (schemes x 2/6/18 layers per side), restricted to ``seeds``.
    ``loss[scheme]`` / ``status[scheme]`` / ``update[scheme]`` are functions of (layers, seed)."""
    status = status or {}
    update = update or {}
    results = []
    for p in expand(load_spec("quick")):
        if p.group != "deepnet" or p.values["train.seed"] not in seeds:
            continue
        scheme, layers, seed = p.values["model.scheme"], p.config.model.layers, p.values["train.seed"]
        st_ = status.get(scheme, lambda *_: "completed")(layers, seed)
        ev = {"loss": loss[scheme](layers, seed)} if st_ == "completed" else {}
        diag = [{"step": 1, "update": update.get(scheme, lambda *_: 1.0)(layers, seed)}]
        r = Result(
            point=p,
            status=st_,
            eval=ev,
            diagnostics=diag,
            step=30 if st_ == "diverged" else 200,
            reason="" if st_ == "completed" else "boom",
        )
        r.chance = dict(CHANCE)
        results.append(r)
    return results


GOOD = {"post_ln": lambda l, s: 2.25 + 0.02 * s, "pre_ln": lambda l, s: 1.4, "deepnorm": lambda l, s: 0.05 + 0.01 * s}


def test_deepnet_held_with_two_seeds(tmp_path):
    f = deepnet_postln(_deepnet(GOOD), tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.n == 2 and f.verdict.mean == pytest.approx(2.205)
    assert any("Chance level" in n and "2.400" in n for n in f.notes)


def test_deepnet_one_seed_is_inconclusive(tmp_path):
    f = deepnet_postln(_deepnet(GOOD, seeds=(0,)), tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "one seed" in f.verdict.reason and "+2.2" in f.verdict.reason


@pytest.mark.parametrize("side", ["post_ln", "deepnorm"])
def test_deepnet_failed_run_on_either_side_is_not_evidence(tmp_path, side):
    status = {side: lambda l, s: "failed" if (l == 18 and s == 1) else "completed"}
    f = deepnet_postln(_deepnet(GOOD, status), tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE
    assert f"scheme={side}_layers=18_decoder_layers=18_seed=1 (failed: boom)" in f.verdict.reason
    assert f.verdict.reason.startswith("not evidence")


def test_deepnet_missing_run_is_not_evidence(tmp_path):
    results = [
        r
        for r in _deepnet(GOOD)
        if not (
            r.point.values["model.scheme"] == "post_ln"
            and r.point.config.model.layers == 18
            and r.point.values["train.seed"] == 1
        )
    ]
    f = deepnet_postln(results, tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "post_ln seed 1 (missing)" in f.verdict.reason


def test_deepnet_diverged_post_ln_counts_as_chance(tmp_path):
    status = {"post_ln": lambda l, s: "diverged" if l == 18 else "completed"}
    f = deepnet_postln(_deepnet(GOOD, status), tmp_path)
    # d = chance 2.4 - DeepNorm's loss, per seed
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(2.4 - 0.055)


def test_deepnet_diverged_deepnorm_is_evidence_against(tmp_path):
    status = {"deepnorm": lambda l, s: "diverged" if l == 18 else "completed"}
    f = deepnet_postln(_deepnet(GOOD, status), tmp_path)
    # d = Post-LN's loss - chance: -0.15 and -0.13
    assert f.verdict.verdict == NOT_HELD and f.verdict.mean == pytest.approx(2.26 - 2.4)


def test_deepnet_winner_that_learned_nothing_cannot_hold(tmp_path):
    # Post-LN diverged (chance 2.4); DeepNorm completed at 2.3, above 0.9 x chance: it learned nothing
    status = {"post_ln": lambda l, s: "diverged" if l == 18 else "completed"}
    loss = {**GOOD, "deepnorm": lambda l, s: 2.3}
    assert 2.3 > LEARNED_NOTHING * CHANCE["loss"]
    f = deepnet_postln(_deepnet(loss, status), tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "learned nothing" in f.verdict.reason
    assert f.verdict.mean == pytest.approx(0.1)  # the difference alone would have been held


def test_deepnet_preln_not_held_when_pre_ln_wins(tmp_path):
    loss = {**GOOD, "pre_ln": lambda l, s: 0.01, "deepnorm": lambda l, s: 0.5 + 0.01 * s}
    assert deepnet_preln(_deepnet(loss), tmp_path).verdict.verdict == NOT_HELD


def _with_bleu(results, bleu: dict):
    """Set each completed run's BLEU from ``bleu[scheme](layers, seed)`` (None: the run logged no BLEU)."""
    for r in results:
        value = bleu[r.point.values["model.scheme"]](r.point.config.model.layers, r.point.values["train.seed"])
        if r.status == "completed" and value is not None:
            r.eval["bleu"] = value
    return results


BLEU = {"post_ln": lambda l, s: 3.0 + s, "pre_ln": lambda l, s: 30.0, "deepnorm": lambda l, s: 38.0 + 0.5 * s}


def test_bleu_verdicts_quote_the_baselines_and_which_runs_translate(tmp_path):
    import json

    results = _with_bleu(_deepnet(GOOD), BLEU)
    base = {"copy": {"bleu": 6.3, "chrf": 22.5}, "nearest": {"bleu": 31.0, "chrf": 40.0}}
    deepest = max(r.point.config.model.layers for r in results)
    for r in results:
        r.eval["chrf"] = 45.0
        if r.point.config.model.layers == deepest:
            r.point.run_dir(tmp_path).mkdir(parents=True)
            (r.point.run_dir(tmp_path) / "baselines.json").write_text(json.dumps({"baselines": base}))
    f = deepnet_postln_bleu(results, tmp_path)
    # the runs compared, at the deepest setting, two seeds each: DeepNorm's BLEU 38/38.5 above 31, Post-LN's 3/4 not
    assert f.notes[-1] == (
        "Baselines on the same validation pairs: copy BLEU 6.30, chrF 22.50; nearest BLEU 31.00, chrF 40.00. 2 of "
        "4 completed runs translate (BLEU and chrF above the better of copying and the nearest training pair's "
        "target)."
    )
    assert not any("Baselines" in n for n in deepnet_postln(results, tmp_path).notes)  # the loss verdict


def test_deepnet_bleu_is_higher_is_better(tmp_path):
    f = deepnet_postln_bleu(_with_bleu(_deepnet(GOOD), BLEU), tmp_path)
    # d = DeepNorm's BLEU - Post-LN's: 35 and 34.5
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(34.75) and "BLEU" in f.rule
    # the table shows what the verdict compares, and the loss against chance beside it
    rows = {(r[0], r[1]): r for r in f.rows}
    assert rows[("deepnorm", 0)][2:4] == ["38", "0.02"] and rows[("post_ln", 1)][2:4] == ["4", "0.95"]
    assert f.headers[2] == "bleu" and deepnet_postln(_deepnet(GOOD), tmp_path).headers[2] == "eval_loss"


def test_runs_the_grid_does_not_tell_apart_are_not_compared_blindly(tmp_path):
    """Two learning rates that the group's grid does not name give each scheme, depth and seed two runs: no pair
    is picked blindly, every DeepNet verdict is inconclusive and names the seed and side, and no number of the
    runs is stated as the difference."""
    import copy

    results = []
    for lr, scale in ((1e-3, 1.0), (3e-3, 2.0)):
        for r in _deepnet(GOOD, update={"post_ln": lambda l, s: 40.0, "deepnorm": lambda l, s: 1.0}):
            r = copy.deepcopy(r)
            r.point.values["train.lr"] = lr
            r.eval["loss"] *= scale
            results.append(r)
    for finding in (deepnet_postln, deepnet_preln, deepnet_update):
        f = finding(results, tmp_path)
        assert f.verdict.verdict == INCONCLUSIVE, (f.name, f.verdict)
        assert "that the grid does not tell apart" in f.verdict.reason, f.verdict.reason
        assert math.isnan(f.verdict.mean) and not f.verdict.per_seed  # no numbers from blindly picked runs
    # with BLEU and one seed too
    one = [r for r in results if r.point.values["train.seed"] == 0]
    f = deepnet_postln_bleu(_with_bleu(one, BLEU), tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "does not tell apart" in f.verdict.reason


def test_a_value_tied_to_the_depth_is_not_a_second_run_but_an_untied_decoder_depth_is(tmp_path):
    """A learning rate set per depth leaves one run per scheme, depth and seed, and the verdict is decided;
    decoder depths varied apart from ``model.layers`` give two runs to a side, which are not compared blindly."""
    import copy

    tied = _deepnet(GOOD)
    for r in tied:
        r.point.values["train.lr"] = {2: 1e-3, 6: 7e-4, 18: 5e-4}[r.point.config.model.layers]
    f = deepnet_postln(tied, tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(2.205)
    untied = []
    for dec in (6, 18):
        for r in _deepnet(GOOD):
            r = copy.deepcopy(r)
            r.point.values["model.decoder_layers"] = dec
            untied.append(r)
    f = deepnet_postln(untied, tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "does not tell apart" in f.verdict.reason, f.verdict


def test_the_table_lists_the_runs_compared_and_a_missing_run_is_named(tmp_path):
    """The table under a claim lists each run it compares (the deepest setting here), one row per run in seed
    order; a seed with no run of a side is named as missing and leaves the verdict inconclusive; one seed is
    never decided."""
    results = [
        r
        for r in _deepnet(GOOD)
        if not (r.point.values["model.scheme"] == "post_ln" and r.point.values["train.seed"] == 1)
    ]
    f = deepnet_postln(results, tmp_path)
    assert f.headers == ["model.scheme", "seed", "eval_loss", "loss / chance", "status"]
    assert [r[:3] for r in f.rows] == [["deepnorm", 0, "0.05"], ["deepnorm", 1, "0.06"], ["post_ln", 0, "2.25"]]
    assert f.verdict.verdict == INCONCLUSIVE and "model.scheme=post_ln seed 1 (missing)" in f.verdict.reason
    one = deepnet_postln_bleu(_with_bleu(_deepnet(GOOD, seeds=(0,)), BLEU), tmp_path)
    assert one.verdict.verdict == INCONCLUSIVE and "one seed" in one.verdict.reason
    f = deepnet_preln_bleu(_with_bleu(_deepnet(GOOD), {**BLEU, "pre_ln": lambda l, s: 45.0}), tmp_path)
    assert f.verdict.verdict == NOT_HELD and f.verdict.mean == pytest.approx(38.25 - 45.0)


def test_deepnet_bleu_diverged_scores_zero_and_missing_bleu_is_named(tmp_path):
    status = {"post_ln": lambda l, s: "diverged" if l == 18 else "completed"}
    f = deepnet_postln_bleu(_with_bleu(_deepnet(GOOD, status), BLEU), tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(38.25)  # DeepNorm's BLEU - 0
    row = next(r for r in f.rows if r[0] == "post_ln")
    assert row[2:] == ["0", "-", "diverged at step 30"], row  # what the verdict scores it
    nan = {**BLEU, "pre_ln": lambda l, s: float("nan")}
    f = deepnet_preln_bleu(_with_bleu(_deepnet(GOOD), nan), tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "seed=0 (no finite bleu)" in f.verdict.reason
    no_bleu = {**BLEU, "deepnorm": lambda l, s: None if s == 1 else 38.0}
    f = deepnet_postln_bleu(_with_bleu(_deepnet(GOOD), no_bleu), tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "seed=1 (no finite bleu)" in f.verdict.reason


def test_deepnet_update_uses_step_one_and_keeps_diverged_runs(tmp_path):
    status = {"post_ln": lambda l, s: "diverged" if l == 18 else "completed"}
    update = {"post_ln": lambda l, s: 3.0 * (1 + 0.01 * s), "deepnorm": lambda l, s: 0.1}
    f = deepnet_update(_deepnet(GOOD, status, update), tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.n == 2
    assert f.verdict.mean == pytest.approx(statistics.fmean([math.log(30), math.log(30.3)]))


# ---------------------------------------------------------------- Bamboo findings


PRETRAINED_AT = {"started": "2026-01-01T00:00:00+00:00", "finished": "2026-01-01T01:00:00+00:00"}
FINETUNED_AT = {"started": "2026-01-01T02:00:00+00:00", "finished": "2026-01-01T03:00:00+00:00"}


def _bamboo(cosine=None, accuracy=None, loss=None, status=None, out=None):
    """Every point of the built-in bamboo study; ``cosine[group]``, ``accuracy[group]``, ``loss[group]`` and
    ``status[group]`` are functions of (layers, seed). Losses default to 0.5 (learned: chance 2.4). With ``out``,
    each run's status.json is written there, fine-tuning starting after its pre-training finished."""
    from kilolayer.rundir import write_status

    cosine, accuracy, loss, status = cosine or {}, accuracy or {}, loss or {}, status or {}
    results = []
    for p in expand(load_spec("bamboo")):
        layers, seed = p.config.model.layers, p.values["train.seed"]
        st_ = status.get(p.group, lambda *_: "completed")(layers, seed)
        if out is not None:
            p.run_dir(out).mkdir(parents=True, exist_ok=True)
            write_status(p.run_dir(out), st_, 10, **(FINETUNED_AT if p.init_from_point else PRETRAINED_AT))
        ev = {}
        if st_ == "completed":
            ev["loss"] = loss.get(p.group, lambda *_: 0.5)(layers, seed)
            if p.group in accuracy:
                ev["accuracy"] = accuracy[p.group](layers, seed)
        smooth = None
        if p.group in cosine and st_ == "completed":
            c = cosine[p.group](layers, seed)
            smooth = {
                "cosine": [0.1, c],
                "cosine_centred": [0.0, c / 2],
                "hc_ratio": [1.0, 1 - c],
                "exclude_special": True,
                "after_final_norm": False,
            }
        r = Result(point=p, status=st_, eval=ev, smoothness=smooth, reason="" if st_ == "completed" else "boom")
        if "test_scores" in p.analyses and st_ == "completed":  # its test split scored as its validation
            r.test = {"metrics": dict(ev)}
        r.chance = dict(CHANCE)
        results.append(r)
    return results


def _by_name(findings, name):
    found = [f for f in findings if f.name == name]
    assert len(found) == 1, [f.name for f in findings]
    return found[0]


SEQ = ("supervised", "contrastive", "text_classify")
TOK = ("mae", "mlm", "next_token")
NOISE = {0: 0.01, 1: -0.01, 2: 0.0}
SMOOTHING = [
    "bamboo_smoothing_supervised",
    "bamboo_smoothing_contrastive",
    "bamboo_smoothing_text",
    "bamboo_smoothing_trend_supervised",
    "bamboo_smoothing_trend_contrastive",
    "bamboo_smoothing_trend_text",
]


def test_smoothing_gives_one_verdict_per_modality_and_pair(tmp_path):
    cos = {g: (lambda l, s: 0.8 + NOISE[s]) for g in SEQ}
    cos.update({g: (lambda l, s: 0.4) for g in TOK + ("untrained", "text_untrained")})
    found = bamboo_smoothing(_bamboo(cos), tmp_path)
    # a level verdict for each of the 3 pairs (encoders only) and a trend verdict for each sequence-level group
    assert [f.name for f in found] == SMOOTHING
    level = _by_name(found, "bamboo_smoothing_supervised")
    assert "(images: supervised vs MAE)" in level.title
    assert level.verdict.verdict == HELD and level.verdict.n == 3 and level.verdict.mean == pytest.approx(0.4)
    # the runs of both sides: shapes x seeds each, told apart by their group
    assert len(level.rows) == 2 * 4 * 3 and level.headers[0] == "group"
    assert {row[0] for row in level.rows} == {"supervised", "mae"}
    trend = _by_name(found, "bamboo_smoothing_trend_supervised")
    assert trend.verdict.verdict == INCONCLUSIVE and trend.verdict.mean == pytest.approx(0.0, abs=1e-12)
    assert any("CLS and special tokens excluded" in n and "before the final LayerNorm" in n for n in level.notes)


def test_smoothing_images_and_text_disagreeing_are_reported_separately(tmp_path):
    from kilolayer.study.builtin import builtin_claim_sets, builtin_claims

    cos = {
        "supervised": lambda l, s: 0.8 + NOISE[s],
        "contrastive": lambda l, s: 0.8 + NOISE[s],
        "text_classify": lambda l, s: 0.2 + NOISE[s],
    }
    cos.update({g: (lambda l, s: 0.5) for g in TOK + ("untrained", "text_untrained")})
    found = bamboo_smoothing(_bamboo(cos), tmp_path)
    assert _by_name(found, "bamboo_smoothing_supervised").verdict.verdict == HELD
    assert _by_name(found, "bamboo_smoothing_contrastive").verdict.verdict == HELD
    text = _by_name(found, "bamboo_smoothing_text")
    assert text.verdict.verdict == NOT_HELD and text.verdict.mean == pytest.approx(-0.3)
    # a causal decoder is no pair for an encoder: next_token is judged by its loss only
    claims = builtin_claims()
    assert not [n for n in builtin_claim_sets()["bamboo_smoothing"] if "next_token" in claims[n]["runs"]]


def test_smoothing_trend_over_every_shape(tmp_path):
    # supervised's last-layer cosine grows by 0.05 per doubling of depth, measured from the untrained model's level
    cos = {
        "supervised": lambda l, s: 0.5 + (0.05 + NOISE[s] / 10) * math.log2(l),
        "mae": lambda l, s: 0.3,
        "untrained": lambda l, s: 0.6,
    }
    trend = _by_name(bamboo_smoothing(_bamboo(cos), tmp_path), "bamboo_smoothing_trend_supervised")
    assert trend.verdict.verdict == HELD and trend.verdict.mean == pytest.approx(0.05, abs=1e-9)
    assert "less that of the group untrained run at its settings" in trend.rule
    assert "last_layer_cosine of untrained" in trend.headers
    # the baseline is part of the measurement: an untrained model that smooths just as much cancels the trend
    cos["untrained"] = lambda l, s: 0.5 + 0.05 * math.log2(l)
    trend = _by_name(bamboo_smoothing(_bamboo(cos), tmp_path), "bamboo_smoothing_trend_supervised")
    assert trend.verdict.verdict == INCONCLUSIVE and abs(trend.verdict.mean) < 0.01
    # and without it the trend cannot be measured: the missing baseline is named
    results = [r for r in _bamboo(cos) if r.point.group != "untrained"]
    trend = _by_name(bamboo_smoothing(results, tmp_path), "bamboo_smoothing_trend_supervised")
    assert trend.verdict.verdict == INCONCLUSIVE and math.isnan(trend.verdict.mean)
    assert re.search(r"the untrained baseline of supervised/layers=6_\S+ \(missing\)", trend.verdict.reason)


def test_smoothing_diverged_or_unlearned_models_cannot_hold(tmp_path):
    cos = {"supervised": lambda l, s: 0.8 + NOISE[s], "mae": lambda l, s: 0.3}
    status = {"mae": lambda l, s: "diverged" if l == 43 else "completed"}
    level = _by_name(bamboo_smoothing(_bamboo(cos, status=status), tmp_path), "bamboo_smoothing_supervised")
    # a diverged model has no representation to measure: not evidence, named
    assert level.verdict.verdict == INCONCLUSIVE and "diverged, and has no representation" in level.verdict.reason
    # the supervised models stayed at chance loss: their token similarity says nothing about training
    unlearned = {"supervised": lambda l, s: 2.39}
    level = _by_name(bamboo_smoothing(_bamboo(cos, loss=unlearned), tmp_path), "bamboo_smoothing_supervised")
    assert level.verdict.verdict == INCONCLUSIVE and level.verdict.mean == pytest.approx(0.5)
    assert "learned nothing" in level.verdict.reason and "the claim needs it to" in level.verdict.reason
    # all_learn, as its rule states, makes a did-not-hold inconclusive too, naming the runs
    cos = {"supervised": lambda l, s: 0.2 + NOISE[s], "mae": lambda l, s: 0.5}
    level = _by_name(bamboo_smoothing(_bamboo(cos, loss=unlearned), tmp_path), "bamboo_smoothing_supervised")
    assert level.verdict.mean == pytest.approx(-0.3) and level.verdict.verdict == INCONCLUSIVE
    assert "learned nothing" in level.verdict.reason


def test_judging_by_the_selection_measure_keeps_failed_runs_one_seed_and_modalities_apart(tmp_path):
    """The smoothing claims with accuracy-stopped classifiers (the built-in bamboo's) whose losses rise with
    noise after their minimum, as an overfitting classifier's do: the images pair holds (a loss dip after the
    standing checkpoint is not reported as improving: a classifier is read on the accuracy that chose it), the
    text pair, whose numbers contradict the images', does not hold; a failed supervised run is named and leaves
    the images verdict inconclusive, a diverged classifier the text one; one seed decides nothing."""
    cos = {"supervised": lambda l, s: 0.8 + NOISE[s], "mae": lambda l, s: 0.4}
    cos |= {"text_classify": lambda l, s: 0.2 + NOISE[s], "mlm": lambda l, s: 0.6}
    results = _bamboo(cos)
    for r in results:
        if r.point.group in ("supervised", "text_classify"):
            assert r.point.config.train.early_stop_metric == "accuracy"
            rows = [(0.40, 0.85), (0.35, 0.90), (0.45, 0.95), (0.43, 0.95), (0.50, 0.95), (0.52, 0.95)]
            r.evals = [{"step": 100 * (i + 1), "loss": x, "accuracy": a} for i, (x, a) in enumerate(rows)]
            r.eval = dict(r.evals[2])  # the accuracy-best; step 400's loss is 4% below it
    found = bamboo_smoothing(results, tmp_path)
    images = _by_name(found, "bamboo_smoothing_supervised")
    text = _by_name(found, "bamboo_smoothing_text")
    assert images.verdict.verdict == HELD and images.verdict.mean == pytest.approx(0.4)
    assert text.verdict.verdict == NOT_HELD and text.verdict.mean == pytest.approx(-0.4)
    assert "0 of 12 runs still improving accuracy by more than 0.01" in images.improving
    assert "0 of 12 runs still improving loss" in images.improving  # the MAE runs, stopped on their loss
    failed = next(r for r in results if r.point.group == "supervised" and r.point.values["train.seed"] == 1)
    failed.status, failed.reason = "failed", "boom"
    images = _by_name(bamboo_smoothing(results, tmp_path), "bamboo_smoothing_supervised")
    assert images.verdict.verdict == INCONCLUSIVE and f"{failed.point.key} (failed: boom)" in images.verdict.reason
    # a diverged classifier has no representation to measure: it decides nothing against the claim
    diverged = next(r for r in results if r.point.group == "text_classify" and r.point.values["train.seed"] == 2)
    diverged.status, diverged.reason = "diverged", "loss above 10 x its running minimum"
    text = _by_name(bamboo_smoothing(results, tmp_path), "bamboo_smoothing_text")
    assert text.verdict.verdict == INCONCLUSIVE and f"{diverged.point.key} (diverged" in text.verdict.reason
    diverged.status, diverged.reason = "completed", ""
    one_seed = [r for r in results if r.point.values.get("train.seed", 0) == 0]
    text = _by_name(bamboo_smoothing(one_seed, tmp_path), "bamboo_smoothing_text")
    assert text.verdict.verdict == INCONCLUSIVE and text.verdict.mean == pytest.approx(-0.39)
    assert "one seed" in text.verdict.reason


def test_non_finite_or_missing_metrics_are_named_not_dropped(tmp_path):
    loss = {"next_token": lambda l, s: float("nan") if (l == 6 and s == 2) else 1.5 - 0.05 * math.log2(l)}
    nt = _by_name(bamboo_depth_tokens(_bamboo(loss=loss), tmp_path), "bamboo_depth_tokens_next_token")
    assert nt.verdict.verdict == INCONCLUSIVE and "seed=2 (evaluation loss nan)" in nt.verdict.reason
    acc = _acc(lambda l, s: 0.8, lambda l, s: float("nan") if (l == 24 and s == 0) else 0.8 + 0.05 * math.log2(l))
    absolute = _by_name(bamboo_depth(_bamboo(accuracy=acc, out=tmp_path), tmp_path), "bamboo_depth_mae")
    assert absolute.verdict.verdict == INCONCLUSIVE
    assert "seed=0 (no finite accuracy on its test split)" in absolute.verdict.reason
    update = {"post_ln": lambda l, s: float("nan") if s == 1 else 3.0, "deepnorm": lambda l, s: 0.1}
    f = deepnet_update(_deepnet(GOOD, update=update), tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "seed=1 (no finite first_update)" in f.verdict.reason


def test_a_study_without_a_scheme_cannot_name_its_claim(tmp_path):
    from kilolayer.errors import ConfigError
    from kilolayer.study.builtin import BUILTIN

    data = BUILTIN["quick"]()
    group = next(g for g in data["groups"] if g["name"] == "deepnet")
    group["grid"]["model.scheme"] = ["post_ln", "deepnorm"]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"compare.against=\"pre_ln\": not a value of model.scheme"):
        load_spec(tmp_path / "s.yaml")


def test_deepnorm_that_learned_nothing_contradicts_deepnorm_trains(tmp_path):
    loss = {**GOOD, "deepnorm": lambda l, s: 2.3, "pre_ln": lambda l, s: 1.4 + 0.01 * s}
    f = deepnet_preln(_deepnet(loss), tmp_path)
    assert f.verdict.verdict == NOT_HELD and "learned nothing" in f.verdict.reason


def _acc(scratch, tuned):
    return {"supervised": scratch, "text_classify": scratch, "finetune": tuned, "mlm_finetune": tuned}


def test_depth_absolute_and_relative_are_separate_verdicts(tmp_path):
    # depth hurts both models, but hurts the fine-tuned one less: relative held, absolute did not hold
    acc = _acc(
        lambda l, s: 0.9 - 0.05 * math.log2(l) + NOISE[s] / 10, lambda l, s: 0.9 - (0.02 + NOISE[s] / 10) * math.log2(l)
    )
    found = bamboo_depth(_bamboo(accuracy=acc, out=tmp_path), tmp_path)
    # (images, text) x (absolute, relative)
    assert [f.name for f in found] == [
        "bamboo_depth_mae",
        "bamboo_depth_relative_mae",
        "bamboo_depth_mlm",
        "bamboo_depth_relative_mlm",
    ]
    absolute, relative = _by_name(found, "bamboo_depth_mae"), _by_name(found, "bamboo_depth_relative_mae")
    assert absolute.verdict.verdict == NOT_HELD and absolute.verdict.mean == pytest.approx(-0.02)
    assert relative.verdict.verdict == HELD and relative.verdict.mean == pytest.approx(0.03, abs=1e-9)
    assert "minus the same slope of group supervised's runs" in relative.rule
    # the text pair is its own verdict, read on its own groups
    text = _by_name(found, "bamboo_depth_relative_mlm")
    column = text.headers.index("group")
    assert text.verdict.verdict == HELD and {r[column] for r in text.rows} == {"mlm_finetune", "text_classify"}


def test_depth_reads_test_accuracy_where_the_groups_score_it_and_names_a_run_without_it(tmp_path):
    """Validation accuracy says depth pays off (+0.05 per doubling, the checkpoints chosen on it); the test split,
    scored whole, is flat (within the margin). The bamboo groups score test (the test_scores analysis), so the
    verdict reads test; a classifier whose test score is missing is not evidence, named (never a fall-back to the
    validation split that chose the checkpoints); a claim that does not compare that run still reads test."""
    acc = _acc(lambda l, s: 0.8, lambda l, s: 0.8 + (0.05 + NOISE[s] / 10) * math.log2(l))
    results = _bamboo(accuracy=acc, out=tmp_path)
    classifiers = [r for r in results if r.point.group in _acc(0, 0)]
    for r in classifiers:
        r.test = {"split": "test", "metrics": {"loss": 0.5, "accuracy": 0.8 + NOISE[r.point.values["train.seed"]] / 10}}
    on_test = _by_name(bamboo_depth(results, tmp_path), "bamboo_depth_mae")
    assert on_test.verdict.verdict == INCONCLUSIVE and on_test.verdict.mean == pytest.approx(0.0, abs=1e-9)
    assert "read on the whole test split" in on_test.rule and on_test.headers[-3] == "accuracy (test)"
    unscored = next(r for r in classifiers if r.point.group == "finetune")
    unscored.test = None
    found = bamboo_depth(results, tmp_path)
    missing = _by_name(found, "bamboo_depth_mae")
    assert missing.verdict.verdict == INCONCLUSIVE and "read on the whole test split" in missing.rule
    assert f"{unscored.point.key} (no finite accuracy on its test split)" in missing.verdict.reason
    assert unscored.point.key in _by_name(found, "bamboo_depth_relative_mae").verdict.reason
    assert "read on the whole test split" in _by_name(found, "bamboo_depth_mlm").rule  # its runs all have test


def test_depth_is_decided_at_the_budget_and_reports_runs_still_improving(tmp_path):
    """A fine-tuned trend is decided at the budget the study gave it; that the fine-tuned runs it reads were still
    raising their accuracy by more than 0.01 over their last quarter is reported beside the verdict, and the MLM
    side, whose fine-tuning plateaued, reports none."""
    acc = _acc(lambda l, s: 0.8, lambda l, s: 0.8 + (0.05 + NOISE[s] / 10) * math.log2(l))
    results = _bamboo(accuracy=acc, out=tmp_path)
    for r in results:
        if r.point.group in ("finetune", "mlm_finetune"):
            a, gain = r.eval["accuracy"], 0.05 if r.point.group == "finetune" else 0.0
            r.evals = [{"step": 100 * (i + 1), "accuracy": a - gain * (3 - i) / 3} for i in range(4)]
    found = bamboo_depth(results, tmp_path)
    images, text = _by_name(found, "bamboo_depth_mae"), _by_name(found, "bamboo_depth_mlm")
    assert images.verdict.verdict == HELD
    assert "12 of 12 runs still improving accuracy by more than 0.01 at their budget" in images.improving
    assert text.verdict.verdict == HELD and text.improving.startswith(
        "budget 4,000 steps: 0 of 12 runs still improving accuracy by more than 0.01; "
    )
    assert "still improving" not in images.verdict.reason  # reported beside the verdict, not a gate
    # the pre-training runs behind the fine-tuned ones are reported too, on the loss that chose their checkpoints
    assert images.improving.endswith(
        "their pre-training runs (mae), budget 10,000 steps: 0 of 12 runs still improving loss by more than 2%"
    )
    assert text.improving.endswith(
        "their pre-training runs (mlm), budget 10,000 steps: 0 of 12 runs still improving loss by more than 2%"
    )


def test_depth_trend_in_the_middle_shapes_only(tmp_path):
    # the fine-tuned accuracy steps up between the middle shapes (11 -> 24 layers) and is flat at either end
    step = {6: 0.80, 11: 0.80, 24: 0.90, 43: 0.90}
    acc = _acc(lambda l, s: 0.8, lambda l, s: step[l] * (1 + NOISE[s]))
    absolute = _by_name(bamboo_depth(_bamboo(accuracy=acc, out=tmp_path), tmp_path), "bamboo_depth_mae")
    expected = _slope([6, 11, 24, 43], [0.8, 0.8, 0.9, 0.9])
    assert absolute.verdict.mean == pytest.approx(expected, abs=1e-9)
    assert absolute.verdict.verdict == HELD  # a rise over the shapes is a rise, wherever it happens


def test_depth_diverged_deep_shapes_count_against_depth(tmp_path):
    # two seeds of three diverge at the deepest shape (scored the chance accuracy); the third is slightly better
    tuned = lambda l, s: 0.90 + (0.01 if l == 43 else 0.0)
    status = {"finetune": lambda l, s: "diverged" if (l == 43 and s < 2) else "completed"}
    found = bamboo_depth(_bamboo(accuracy=_acc(lambda l, s: 0.9, tuned), status=status, out=tmp_path), tmp_path)
    absolute = _by_name(found, "bamboo_depth_mae")
    assert absolute.verdict.verdict != HELD and absolute.verdict.mean < 0
    assert absolute.verdict.per_seed[0] < 0 < absolute.verdict.per_seed[2]
    # dropping diverged runs and keeping the survivor would have held +0.01


def test_depth_failed_run_is_inconclusive_and_named(tmp_path):
    status = {"finetune": lambda l, s: "failed" if (l == 24 and s == 1) else "completed"}
    acc = _acc(lambda l, s: 0.8, lambda l, s: 0.8 + 0.05 * math.log2(l))
    absolute = _by_name(bamboo_depth(_bamboo(accuracy=acc, status=status, out=tmp_path), tmp_path), "bamboo_depth_mae")
    assert absolute.verdict.verdict == INCONCLUSIVE and "seed=1 (failed: boom)" in absolute.verdict.reason


def test_depth_needs_finished_pretraining_before_fine_tuning(tmp_path):
    acc = _acc(lambda l, s: 0.8, lambda l, s: 0.8 + (0.05 + NOISE[s] / 10) * math.log2(l))
    held = _by_name(bamboo_depth(_bamboo(accuracy=acc, out=tmp_path), tmp_path), "bamboo_depth_mae")
    assert held.verdict.verdict == HELD
    # an MAE run that was interrupted: its fine-tuned run is no evidence, and the reason names both
    status = {"mae": lambda l, s: "interrupted" if (l == 11 and s == 2) else "completed"}
    found = bamboo_depth(_bamboo(accuracy=acc, status=status, out=tmp_path / "b"), tmp_path / "b")
    absolute = _by_name(found, "bamboo_depth_mae")
    assert absolute.verdict.verdict == INCONCLUSIVE
    assert re.search(
        r"finetune/layers=11_width=96_heads=6_ffn=384_seed=2 \(its pre-training run mae/\S+ is interrupted\)",
        absolute.verdict.reason,
    )
    assert _by_name(found, "bamboo_depth_mlm").verdict.verdict == HELD  # the MLM side is untouched
    # a fine-tuned run that started before its pre-training finished (no init_from record: the old rule)
    results = _bamboo(accuracy=acc, out=tmp_path / "c")
    from kilolayer.rundir import read_status, write_status

    late = next(r for r in results if r.point.group == "finetune")
    st = read_status(late.point.run_dir(tmp_path / "c"))
    write_status(late.point.run_dir(tmp_path / "c"), "completed", 10, started="2026-01-01T00:30:00+00:00")
    absolute = _by_name(bamboo_depth(results, tmp_path / "c"), "bamboo_depth_mae")
    assert st["started"] > "2026-01-01T00:30" and absolute.verdict.verdict == INCONCLUSIVE
    assert f"{late.point.key} (started before its pre-training run" in absolute.verdict.reason


def test_depth_fine_tuning_from_a_stale_pretraining_checkpoint_is_no_evidence(tmp_path, monkeypatch):
    from kilolayer import rundir

    acc = _acc(lambda l, s: 0.8, lambda l, s: 0.8 + (0.05 + NOISE[s] / 10) * math.log2(l))
    results = _bamboo(accuracy=acc, out=tmp_path)
    for r in results:
        if r.point.init_from_point:
            rundir.write_status(r.point.run_dir(tmp_path), "completed", 10, init_from={"path": "x", "step": 500})
    # the pre-training runs' chosen checkpoints are at step 500, except one that trained on to 800 since
    stale = next(r for r in results if r.point.group == "finetune" and r.point.values["train.seed"] == 1)
    newer = stale.point.init_from_point
    monkeypatch.setattr(rundir, "chosen_checkpoint", lambda d, patience=0, on_damaged=None: Path(d) / "ckpt")
    monkeypatch.setattr(rundir, "checkpoint_step", lambda p: 800 if str(p.parent).endswith(newer) else 500)
    found = bamboo_depth(results, tmp_path)
    absolute = _by_name(found, "bamboo_depth_mae")
    assert absolute.verdict.verdict == INCONCLUSIVE
    assert f"{stale.point.key} (fine-tuned from step 500 of {newer}, whose chosen checkpoint is 800)" in (
        absolute.verdict.reason
    )
    # the relative claim reads the same fine-tuned runs, and says so too
    assert stale.point.key in _by_name(found, "bamboo_depth_relative_mae").verdict.reason
    assert _by_name(found, "bamboo_depth_mlm").verdict.verdict == HELD  # the MLM side is untouched


def _evals(final: float, earlier: float, key: str = "loss") -> list[dict]:
    return [{"step": 100, key: earlier + 0.2}, {"step": 300, key: earlier}, {"step": 400, key: final}]


def test_runs_still_improving_are_reported_and_compared_at_their_budget(tmp_path):
    cos = {g: (lambda l, s: 0.8 + NOISE[s]) for g in SEQ}
    cos.update({g: (lambda l, s: 0.4) for g in TOK + ("untrained", "text_untrained")})
    results = _bamboo(cos)
    for r in results:  # every run ends flat at its budget (within 2% over its last quarter): converged
        r.evals = _evals(0.50, 0.505)
    level = _by_name(bamboo_smoothing(results, tmp_path), "bamboo_smoothing_supervised")
    assert level.verdict.verdict == HELD and "0 of 12 runs still improving loss" in level.improving
    moving = [r for r in results if r.point.group == "mae" and r.point.config.model.layers == 43]
    for r in moving:  # the deepest MAE runs still gaining 10% in their last quarter
        r.evals = _evals(0.45, 0.50)
    level = _by_name(bamboo_smoothing(results, tmp_path), "bamboo_smoothing_supervised")
    assert level.verdict.verdict == HELD  # the papers compare at matched budgets; the count is reported
    # the 12 MAE runs judged on their loss (the supervised runs stand by the accuracy that chose them)
    assert f"{len(moving)} of 12 runs still improving loss by more than 2% at their budget" in level.improving
    assert "0 of 12 runs still improving accuracy" in level.improving
    assert "still improving" not in level.verdict.reason
    # accuracy for the depth claims: +0.02 in the last quarter is reported too
    acc = _acc(lambda l, s: 0.8, lambda l, s: 0.8 + (0.05 + NOISE[s] / 10) * math.log2(l))
    results = _bamboo(accuracy=acc, out=tmp_path / "d")
    for r in results:
        if r.point.group == "finetune":
            a = r.eval["accuracy"]
            r.evals = [{"step": 300, "accuracy": a - 0.02}, {"step": 400, "accuracy": a}]
    absolute = _by_name(bamboo_depth(results, tmp_path / "d"), "bamboo_depth_mae")
    assert "12 of 12 runs still improving accuracy by more than 0.01" in absolute.improving


def test_depth_tokens_per_objective(tmp_path):
    loss = {"next_token": lambda l, s: 1.5 - (0.05 + NOISE[s] / 10) * math.log2(l), "mlm": lambda l, s: 1.5}
    found = bamboo_depth_tokens(_bamboo(loss=loss), tmp_path)
    nt = _by_name(found, "bamboo_depth_tokens_next_token")
    mlm = _by_name(found, "bamboo_depth_tokens_mlm")
    assert nt.verdict.verdict == HELD and nt.verdict.mean == pytest.approx(0.05, abs=1e-9)
    assert mlm.verdict.verdict == INCONCLUSIVE and mlm.verdict.mean == pytest.approx(0.0, abs=1e-12)


def test_bamboo_claims_without_their_runs_are_inconclusive_and_a_spec_without_their_groups_names_none(tmp_path):
    """Judged on no runs, every Bamboo claim is inconclusive and says no run matched; a study names of a set only
    the claims its groups can decide (quick: the images ones), and a set none of whose groups it has is refused."""
    for finding in (bamboo_smoothing, bamboo_depth, bamboo_depth_tokens):
        for f in finding([], tmp_path):
            assert f.verdict.verdict == INCONCLUSIVE and f.verdict.n == 0, f.name
            assert "no seed with every run the comparison needs" in f.verdict.reason
            assert any(n.startswith("No run of") for n in f.notes)
    quick = load_spec("quick")
    bamboo = [c.name for c in quick.claims if c.name.startswith("bamboo")]
    assert bamboo == [
        "bamboo_smoothing_supervised",
        "bamboo_smoothing_trend_supervised",
        "bamboo_depth_mae",
        "bamboo_depth_relative_mae",
    ]
    from kilolayer.errors import ConfigError
    from kilolayer.study.builtin import BUILTIN

    data = BUILTIN["quick"]()
    data["claims"] = ["bamboo_depth_tokens"]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"'bamboo_depth_tokens' reads groups this spec does not have \(mlm, "):
        load_spec(tmp_path / "s.yaml")


def test_report_md_and_html_give_the_same_decided_verdicts(tmp_path):
    """Held, did not hold and inconclusive all survive rendering: report.md and report.html agree."""
    from types import SimpleNamespace

    from kilolayer.study.report import render_html, render_markdown

    # DeepNorm beats Post-LN (held) and loses to Pre-LN (did not hold)
    loss = {**GOOD, "pre_ln": lambda l, s: 0.01, "deepnorm": lambda l, s: 0.5 + 0.01 * s}
    results = _deepnet(loss)
    cos = {"supervised": lambda l, s: 0.8 + NOISE[s], "mae": lambda l, s: 0.3}
    results += [r for r in _bamboo(cos) if r.point.group in ("supervised", "mae", "untrained")]
    findings = [deepnet_postln(results, tmp_path), deepnet_preln(results, tmp_path)]
    findings += bamboo_smoothing(results, tmp_path)
    words = [f.verdict.verdict for f in findings]
    assert {HELD, NOT_HELD, INCONCLUSIVE} <= set(words)
    spec = SimpleNamespace(name="constructed", description="constructed evidence", findings=[])
    md = render_markdown(spec, results, findings, tmp_path, 1.0)
    page = render_html(md, tmp_path)
    assert re.findall(r"\*\*Verdict: ([a-z ]+)\.\*\*", md) == words
    assert re.findall(r"<strong[^>]*>Verdict: ([a-z ]+)\.</strong>", page) == words
    summary_md = md.split("## Verdicts", 1)[1].split("\n## ", 1)[0]
    summary_html = page.split("Verdicts</h2>", 1)[1].split("<h2", 1)[0]
    assert re.findall(r"\| \*\*([a-z ]+)\*\* \|", summary_md) == words
    assert re.findall(r"<td><strong[^>]*>([a-z ]+)</strong></td>", summary_html) == words


def test_an_objective_without_a_chance_level_makes_a_diverged_run_not_evidence(tmp_path, monkeypatch):
    import kilolayer.verdicts.evidence as evidence

    def no_chance(*_a, **_k):
        raise NotImplementedError("no categorical evaluation targets")

    monkeypatch.setattr(evidence, "chance_of_run", no_chance)
    status = {"post_ln": lambda l, s: "diverged" if l == 18 else "completed"}
    results = _deepnet(GOOD, status)
    for r in results:
        r.chance = None  # computed on demand, through the patched function
    f = deepnet_postln(results, tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "no finite value here" in f.verdict.reason


def test_trains_where_post_ln_fails_needs_post_ln_to_have_failed_in_every_seed(tmp_path):
    """Post-LN at 0.79-0.80 x chance learned: "DeepNorm trains where Post-LN fails" is inconclusive and names
    it, although the loss difference alone is far beyond the margin; one seed that failed is not enough."""
    learned = {**GOOD, "post_ln": lambda l, s: 1.9 + 0.01 * s}
    f = deepnet_postln(_deepnet(learned), tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and f.verdict.mean == pytest.approx(1.85)
    assert "needs model.scheme=post_ln to fail in every seed" in f.verdict.reason and "seed=1" in f.verdict.reason
    half = {**GOOD, "post_ln": lambda l, s: 2.25 if s == 0 else 1.9}
    assert deepnet_postln(_deepnet(half), tmp_path).verdict.verdict == INCONCLUSIVE
    # "matches or beats Pre-LN" is no "fails" claim: a Pre-LN that learned does not stop it
    assert deepnet_preln(_deepnet({**GOOD, "pre_ln": lambda l, s: 1.4 + 0.02 * s}), tmp_path).verdict.verdict == HELD


def test_count_data_and_zero_variance_are_decided_by_the_sign_test():
    # two seeds that each survived one more setting: p = 0.25, never held
    v = decide({0: 1, 1: 1}, 0.5, count=True)
    assert v.verdict == INCONCLUSIVE and v.test == "sign" and v.p == pytest.approx(0.25)
    assert math.isnan(v.lower) and math.isnan(v.upper)  # no zero-width bounds
    # five agreeing seeds: p = 1/32 < 5%
    v = decide(dict.fromkeys(range(5), 1.0), 0.5, count=True)
    assert v.verdict == HELD and v.p == pytest.approx(1 / 32)
    assert decide(dict.fromkeys(range(5), -2.0), 0.5, count=True).verdict == NOT_HELD
    # four of five: p = 6/32, inconclusive; a tie counts for nobody
    assert decide({0: 1, 1: 1, 2: 1, 3: 1, 4: 0}, 0.5, count=True).verdict == INCONCLUSIVE
    # a continuous difference that does not vary over seeds is no t-bound either
    v = decide({0: 0.3, 1: 0.3, 2: 0.3}, 0.1)
    assert v.verdict == INCONCLUSIVE and v.test == "sign" and "zero-variance" in v.reason
    v = decide({0: 0.3, 1: 0.31, 2: 0.29}, 0.1)
    assert v.verdict == HELD and v.test == "t"


def test_one_learned_rule_for_doctor_and_verdicts_including_an_unknown_chance():
    from kilolayer.analysis.chance import learned_something

    assert learned_something(2.0, 2.4) is True and learned_something(2.2, 2.4) is False
    assert learned_something(float("nan"), 2.4) is False  # a non-finite loss learned nothing
    assert learned_something(1.0, float("nan")) is None and learned_something(1.0, None) is None
    assert learned_something(1.0, 0.0) is None


def test_near_zero_variance_within_float_rounding_is_decided_by_the_sign_test():
    """Two seeds whose differences agree to 1e-7 would give t-bounds [0.29999, 0.30001] and a held: a bound that
    narrow measures float rounding, not seed noise. Within the rounding the judge gives, it is a sign test (two
    agreeing seeds: p = 0.25, inconclusive); a spread beyond it is seed noise, and the t-bounds decide."""
    near = {0: 0.3, 1: 0.3 + 1e-7}
    v = decide(near, 0.1, rounding=4e-6)
    assert v.verdict == INCONCLUSIVE and v.test == "sign" and v.p == pytest.approx(0.25)
    assert math.isnan(v.lower) and "zero-variance" in v.reason and "within float rounding" in v.reason
    assert decide(near, 0.1).verdict == HELD and decide(near, 0.1).test == "t"  # what the rounding floor prevents
    # five seeds agreeing up to rounding: the sign test holds it, p = 1/32
    v = decide({s: 0.3 + 1e-7 * s for s in range(5)}, 0.1, rounding=4e-6)
    assert v.verdict == HELD and v.test == "sign" and v.p == pytest.approx(1 / 32)
    # a spread well beyond rounding is seed noise: t-bounds
    v = decide({0: 0.30, 1: 0.31}, 0.1, rounding=4e-6)
    assert v.verdict == HELD and v.test == "t" and v.lower == pytest.approx(0.305 - t_quantile(1) * 0.005)


# ---------------------------------------------------------------- many-to-many translation scores


def _directions_record(model_bleu: dict[str, float], pooled: float) -> dict:
    """A test record as the test_scores analysis writes it for a many-to-many run: the pooled scores (``pooled``
    BLEU) and every direction's, with their means. en-ja has chrF alone (no BLEU tokenizer)."""
    from kilolayer.objectives.directions import averages

    rows = {}
    for d in ("en-de", "de-en", "en-ja"):
        s, t = d.split("-")
        model = {"chrf": 50.0, **({"bleu": model_bleu[d]} if d in model_bleu else {})}
        copy = {"chrf": 20.0, **({"bleu": 2.0} if t != "ja" else {})}
        nearest = {"chrf": 30.0, **({"bleu": 10.0} if t != "ja" else {})}
        rows[d] = {"source": s, "target": t, "pairs": 8, "model": model, "copy": copy, "nearest": nearest}
    table = {"directions": rows, "averages": averages(rows, ("model", "copy", "nearest"))}
    return {"split": "test", "metrics": {"loss": 0.5, "bleu": pooled, "chrf": 50.0}, "directions": table}


def test_multilingual_bleu_is_the_mean_over_directions_on_test(tmp_path):
    """DeepNet reports a many-to-many model's BLEU averaged over its directions: a claim reads that mean on test,
    not the BLEU of every direction's pairs pooled. Here the deeper model's mean is 2.0 / 2.1 points above the wide
    one's (32.0 + 0.1 x seed against 30.0), while its pooled BLEU is 5 points below: held by the mean, where the
    pooled score would say the opposite."""
    from helpers import study_results

    from kilolayer.verdicts.measures import MEASURES, TEST

    claim = builtin_claim("deepnet_multilingual_wide", "deepnet_multilingual")
    results = [
        r
        for r in study_results("deepnet_multilingual", lambda p: ("completed", {"loss": 0.5, "bleu": 1.0}, []))
        if r.point.group in ("deeper", "wide")
    ]
    for r in results:
        seed = r.point.values["train.seed"]
        if r.point.group == "deeper":  # en-de and de-en 30 and 34 (+ 0.1 x seed): mean 32 (+ 0.1 x seed)
            r.test = _directions_record({"en-de": 30.0 + 0.1 * seed, "de-en": 34.0 + 0.1 * seed}, pooled=20.0)
        else:
            r.test = _directions_record({"en-de": 29.0, "de-en": 31.0}, pooled=25.0)
    f = claim(results, tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(2.05)
    assert "mean over its directions" in f.rule
    assert f.notes[-1].startswith(
        "Baselines on the same test pairs, means over each run's directions: copy BLEU 2.00, chrF 20.00; nearest "
        "BLEU 10.00, chrF 30.00. 4 of 4 completed runs translate (BLEU and chrF above the better of copying and the "
        "nearest training pair's target, the means' point estimates)."
    )
    # runs read over different pairs are not compared: one side pooled, or means over other directions
    pooled = [r for r in results if r.point.group == "wide"]
    for r in pooled:
        r.test = {"split": "test", "metrics": {"loss": 0.5, "bleu": 25.0, "chrf": 50.0}}
    f = claim(results, tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE
    assert "the runs' bleu covers different pairs, so their values are not comparable: the mean over 2 directions " in (
        f.verdict.reason
    )
    assert "(de-en, en-de) for deeper/" in f.verdict.reason and "the pooled pairs for wide/" in f.verdict.reason
    for r in pooled:  # scored where Japanese had a BLEU tokenizer: en-ja enters its mean
        r.test = _directions_record({"en-de": 29.0, "de-en": 31.0, "en-ja": 30.0}, pooled=25.0)
    f = claim(results, tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "the mean over 3 directions (de-en, en-de, en-ja)" in f.verdict.reason
    # a diverged wide run scores BLEU 0 whatever it would have covered: no basis of its own, so the others agree
    # and the verdict stands on them (d = 32.0 - 30.0 and 32.1 - 0)
    for r in pooled:
        r.test = _directions_record({"en-de": 29.0, "de-en": 31.0}, pooled=25.0)
    pooled[1].status, pooled[1].test = "diverged", None
    f = claim(results, tmp_path)
    assert "covers different pairs" not in f.verdict.reason and f.verdict.per_seed == pytest.approx({0: 2.0, 1: 32.1})
    # one seed: fewer than 2 seeds is inconclusive by the rule, and mixed bases are named beside it
    one = [r for r in results if r.point.values["train.seed"] == 0]
    one[-1].test = {"split": "test", "metrics": {"loss": 0.5, "bleu": 25.0, "chrf": 50.0}}
    f = claim(one, tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "covers different pairs" in f.verdict.reason
    # a failed run is not read, so it has no basis either
    one[-1].status, one[-1].eval = "failed", {}
    assert "covers different pairs" not in claim(one, tmp_path).verdict.reason
    # on validation, and for a run of one direction, the evaluation's own (pooled) score
    bleu = MEASURES["bleu"]
    deeper = next(r for r in results if r.point.group == "deeper")
    assert bleu.read(deeper, tmp_path, "validation") == 1.0 and bleu.read(deeper, tmp_path, TEST) == 32.0
    deeper.test = {"split": "test", "metrics": {"bleu": 20.0}}
    assert bleu.read(deeper, tmp_path, TEST) == 20.0
    # a many-to-many run none of whose directions has a BLEU score has no BLEU (not its pooled one)
    deeper.test = _directions_record({}, pooled=20.0)
    assert bleu.read(deeper, tmp_path, TEST) is None and MEASURES["chrf"].read(deeper, tmp_path, TEST) == 50.0
