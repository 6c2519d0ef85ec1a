"""The claim features Bamboo's and DeepNet's built-in claims are written with, each on constructed evidence from a
small spec of its own: several groups compared by the key ``group``, a baseline group subtracted (``relative_to``),
a slope against another group's (``slope.than``), the worst cell deciding (``combine: worst``) and every run compared
having to learn (``all_learn``). Nothing trains and no data is loaded: chance levels are set on the results."""

from __future__ import annotations

import math

import pytest
import yaml
from helpers import CHANCE

from kilolayer.study.runner import Result
from kilolayer.study.spec import expand, load_spec
from kilolayer.verdicts.claims import check_claim, judge, parse_claim
from kilolayer.verdicts.rule import HELD, INCONCLUSIVE, NOT_HELD

BASE = {
    "model": {
        "arch": "encoder_decoder",
        "layers": 1,
        "decoder_layers": 1,
        "width": 32,
        "heads": 2,
        "ffn": 64,
        "vocab_size": 13,
    },
    "objective": {"name": "seq2seq"},
    "data": {"name": "synthetic", "task": "reverse", "options": {"min_len": 3, "max_len": 6, "eval_size": 16}},
    "train": {"steps": 400, "batch_size": 8, "lr": 1e-3, "warmup": 2, "eval_every": 100},
}
DEPTHS = [1, 2, 4]
SEEDS = [0, 1, 2]
NOISE = {0: 0.01, 1: -0.01, 2: 0.0}


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict:
    """Groups ``a``, ``b`` and ``base`` over three depths, and ``sweep`` (two schemes x three learning rates)."""
    by_depth = {"grid": {"model.layers,model.decoder_layers": [[d, d] for d in DEPTHS]}, "seeds": SEEDS}
    spec = {
        "name": "features",
        "description": "constructed evidence for the claim features",
        "groups": [
            *({"name": g, "base": BASE, **by_depth} for g in ("a", "b", "base")),
            *(
                {
                    "name": g,
                    "base": BASE,
                    "grid": {"model.layers,model.decoder_layers": [[d, d] for d in DEPTHS], "train.lr": [1e-3, 1e-2]},
                    "seeds": SEEDS,
                }
                for g in ("p", "q")
            ),
            {
                "name": "sweep",
                "base": BASE,
                "grid": {"model.scheme": ["post_ln", "deepnorm"], "train.lr": [1e-3, 3e-3, 1e-2]},
                "seeds": SEEDS,
            },
        ],
    }
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_spec(path)
    return {"spec": loaded, "points": expand(loaded), "by_name": {g.name: g for g in loaded.groups}}


def _results(groups, loss, status=lambda p: "completed") -> list:
    """A result per point whose ``loss(p)`` (group, depth, seed and values on ``p``) is not None."""
    out = []
    for p in groups["points"]:
        value = loss(p)
        if value is None:
            continue
        st = status(p)
        r = Result(
            point=p,
            status=st,
            step=400 if st == "completed" else 30,
            eval={"loss": value} if st == "completed" else {},
            evals=[{"step": 400, "loss": value}] if st == "completed" else [],
            reason="" if st in ("completed", "diverged") else "boom",
        )
        r.chance = dict(CHANCE)
        out.append(r)
    return out


def _claim(groups, **fields):
    data = {"name": "c", "claim": "constructed", "source": "a test", "measure": "eval_loss", "margin": 0.02, **fields}
    claim = parse_claim(data, "claims[0]")
    check_claim(claim, groups["by_name"], "claims[0]")
    return claim


def _judge(groups, claim, results, out):
    return judge(claim, results, groups["by_name"], out)


def _depth(p) -> int:
    return p.config.model.layers


def _seed(p) -> int:
    return p.values["train.seed"]


# ---------------------------------------------------------------- two groups compared by `group`


def test_two_groups_are_compared_by_the_key_group_matched_on_their_settings(groups, tmp_path):
    claim = _claim(groups, runs=["a", "b"], compare={"key": "group", "claimed_better": "a", "against": "b"})
    # a's loss 0.2 below b's at every depth and seed, but for noise: d = 0.2 per seed
    lower = _results(groups, lambda p: {"a": 1.0 + NOISE[_seed(p)], "b": 1.2}.get(p.group))
    f = _judge(groups, claim, lower, tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.n == 3
    assert f.verdict.per_seed == pytest.approx({s: 0.2 - NOISE[s] for s in SEEDS})
    assert f.headers[0] == "group" and {r[0] for r in f.rows} == {"a", "b"} and len(f.rows) == 2 * 3 * 3
    assert "d = evaluation loss at the standing checkpoint of group=b minus that of group=a" in f.rule
    assert "runs matched on model.layers, model.decoder_layers and averaged over them" in f.rule
    higher = _results(groups, lambda p: {"a": 1.4 + NOISE[_seed(p)], "b": 1.2}.get(p.group))
    assert _judge(groups, claim, higher, tmp_path).verdict.verdict == NOT_HELD
    # the cells are matched by depth: a run of one group missing at one depth is named where it is
    gap = [r for r in lower if not (r.point.group == "b" and _depth(r.point) == 2 and _seed(r.point) == 1)]
    v = _judge(groups, claim, gap, tmp_path).verdict
    assert (
        v.verdict == INCONCLUSIVE and "group=b seed 1 at model.layers=2, model.decoder_layers=2 (missing)" in v.reason
    )
    assert set(v.per_seed) == {0, 2}


def test_group_values_are_the_claims_groups(groups):
    with pytest.raises(ValueError, match=r"compare.against=\"base\": not a value of group in the group \(allowed: "):
        _claim(groups, runs=["a", "b"], compare={"key": "group", "claimed_better": "a", "against": "base"})
    with pytest.raises(ValueError, match=r"compare.key=group: group 'a' does not vary it"):
        _claim(groups, runs="a", compare={"key": "group", "claimed_better": "a", "against": "b"})
    with pytest.raises(ValueError, match=r"runs=\[.a., .a.\]: .*2 or more different groups"):
        _claim(groups, runs=["a", "a"], compare={"key": "group", "claimed_better": "a", "against": "b"})


# ---------------------------------------------------------------- relative_to: a baseline group subtracted


def test_relative_to_subtracts_the_baseline_at_the_same_settings_and_seed(groups, tmp_path):
    """a's loss is flat in depth; the baseline's rises by 0.1 + 0.02 x seed per doubling: relative to it, a's falls
    by that much, each seed by its own baseline's slope."""
    claim = _claim(
        groups, runs="a", relative_to="base", slope={"key": "model.layers", "claimed": "decreases"}, margin=0.02
    )

    def loss(p):
        if p.group == "base":
            return 1.0 + (0.1 + 0.02 * _seed(p)) * math.log2(_depth(p))
        return 1.0 if p.group == "a" else None

    f = _judge(groups, claim, _results(groups, loss), tmp_path)
    assert f.verdict.per_seed == pytest.approx({0: 0.1, 1: 0.12, 2: 0.14})
    assert f.verdict.verdict == HELD
    assert "each run's eval_loss less that of the group base run at its settings and seed" in f.rule
    assert f.headers[-3] == "eval_loss of base"
    # without the baseline subtracted, the same runs are flat
    flat = _claim(groups, runs="a", slope={"key": "model.layers", "claimed": "decreases"})
    assert _judge(groups, flat, _results(groups, loss), tmp_path).verdict.per_seed == pytest.approx(
        dict.fromkeys(SEEDS, 0.0)
    )
    # a seed whose baseline run is missing is not evidence, named: another seed's initialisation is no baseline
    no_seed_2 = [r for r in _results(groups, loss) if not (r.point.group == "base" and _seed(r.point) == 2)]
    v = _judge(groups, claim, no_seed_2, tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and "the base baseline of a/" in v.reason and "(missing)" in v.reason
    assert 2 not in v.per_seed


def test_a_diverged_runs_score_is_measured_from_the_same_baseline(groups, tmp_path):
    """b diverged (it scores the chance loss, 2.4), a ended at 2.6, the baseline at 3.0: relative to it, a's -0.4
    and b's -0.6. A diverged side never wins on a quality measure, so d = 0 (b's raw chance score less a's
    baseline-relative one would be +2.8)."""
    claim = _claim(
        groups, runs=["a", "b"], relative_to="base", compare={"key": "group", "claimed_better": "a", "against": "b"}
    )

    def loss(p):
        return {"a": 2.6, "b": 2.0, "base": 3.0}[p.group] if p.group in ("a", "b", "base") else None

    diverged = _results(groups, loss, status=lambda p: "diverged" if p.group == "b" else "completed")
    v = _judge(groups, claim, diverged, tmp_path).verdict
    assert v.per_seed == pytest.approx(dict.fromkeys(SEEDS, 0.0)) and v.verdict == INCONCLUSIVE


def test_a_missing_or_failed_baseline_is_named_and_leaves_the_claim_inconclusive(groups, tmp_path):
    claim = _claim(groups, runs="a", relative_to="base", slope={"key": "model.layers", "claimed": "decreases"})

    def loss(p):
        if p.group == "base":
            return None if _depth(p) == 2 else 1.0 + 0.1 * math.log2(_depth(p)) + NOISE[_seed(p)]
        return 1.0 if p.group == "a" else None

    v = _judge(groups, claim, _results(groups, loss), tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and not v.per_seed
    assert "the base baseline of a/layers=2_decoder_layers=2_seed=0 (missing)" in v.reason
    failed = _results(
        groups,
        lambda p: 1.0 if p.group in ("a", "base") else None,
        status=lambda p: "failed" if p.group == "base" and _depth(p) == 4 else "completed",
    )
    v = _judge(groups, claim, failed, tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and "the base baseline of a/layers=4_decoder_layers=4_seed=0 (failed)" in v.reason


def test_relative_to_names_a_group_of_the_spec_other_than_the_claims(groups):
    slope = {"key": "model.layers", "claimed": "decreases"}
    with pytest.raises(ValueError, match=r"relative_to='nope': no group of that name in the spec"):
        _claim(groups, runs="a", relative_to="nope", slope=slope)
    with pytest.raises(ValueError, match=r"relative_to='a': a baseline group other than the claim's runs"):
        _claim(groups, runs="a", relative_to="a", slope=slope)


# ---------------------------------------------------------------- slope.than: one group's slope against another's


def test_slope_than_subtracts_the_other_groups_slope(groups, tmp_path):
    claim = _claim(
        groups, runs=["a", "b"], slope={"key": "model.layers", "claimed": "decreases", "than": "b"}, margin=0.02
    )

    def loss(a_per_doubling, b_per_doubling):
        def of(p):
            rate = {"a": a_per_doubling, "b": b_per_doubling + NOISE[_seed(p)]}.get(p.group)
            return None if rate is None else 2.0 - rate * math.log2(_depth(p))

        return of

    # a's loss falls 0.1 per doubling, b's 0.02 (and noise): a's falls 0.08 more
    f = _judge(groups, claim, _results(groups, loss(0.1, 0.02)), tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.per_seed == pytest.approx({s: 0.08 - NOISE[s] for s in SEEDS})
    assert "minus the same slope of group b's runs" in f.rule and "more than group b's" in f.rule
    # both falling alike: no difference, whatever each does alone
    same = _judge(groups, claim, _results(groups, loss(0.1, 0.1)), tmp_path).verdict
    assert same.verdict == INCONCLUSIVE and same.mean == pytest.approx(0.0, abs=1e-9)
    # b falling faster: did not hold, although a's own loss falls with depth
    assert _judge(groups, claim, _results(groups, loss(0.02, 0.1)), tmp_path).verdict.verdict == NOT_HELD
    # a seed with no runs of b is named, not judged on a's slope alone
    runs = [r for r in _results(groups, loss(0.1, 0.02)) if not (r.point.group == "b" and _seed(r.point) == 2)]
    v = _judge(groups, claim, runs, tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and "group b, seed 2 (missing)" in v.reason and set(v.per_seed) == {0, 1}
    # and a run missing from one of a seed's depths is named too
    runs = [
        r for r in _results(groups, loss(0.1, 0.02)) if not (r.point.group == "a" and r.point.key.endswith("4_seed=1"))
    ]
    v = _judge(groups, claim, runs, tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and "model.layers=4 seed 1 at group=a (missing)" in v.reason


def test_slope_than_with_combine_worst_pairs_the_groups_cell_by_cell(groups, tmp_path):
    """p's loss falls 0.3 per doubling at lr 1e-3 and 0.1 at 1e-2, q's 0 and 0.15: p falls faster at 1e-3 only.
    The worst matched cell (lr 1e-2: 0.1 - 0.15) decides "must hold at each"; the mean of the cells holds."""
    rates = {("p", 1e-3): 0.3, ("p", 1e-2): 0.1, ("q", 1e-3): 0.0, ("q", 1e-2): 0.15}

    def loss(p):
        rate = rates.get((p.group, p.values.get("train.lr")))
        return None if rate is None else 2.0 - (rate + NOISE[_seed(p)] * (p.group == "p")) * math.log2(_depth(p))

    slope = {"key": "model.layers", "claimed": "decreases", "than": "q"}
    worst = _judge(
        groups, _claim(groups, runs=["p", "q"], slope=slope, combine="worst"), _results(groups, loss), tmp_path
    )
    assert worst.verdict.per_seed == pytest.approx({s: -0.05 + NOISE[s] for s in SEEDS})
    assert worst.verdict.verdict == NOT_HELD
    mean = _judge(groups, _claim(groups, runs=["p", "q"], slope=slope), _results(groups, loss), tmp_path)
    assert mean.verdict.per_seed == pytest.approx({s: 0.125 + NOISE[s] for s in SEEDS}) and mean.verdict.verdict == HELD


def test_slope_than_names_one_of_the_claims_groups(groups):
    with pytest.raises(ValueError, match=r"slope.than='base': not one of the claim's groups \(its groups: a, b\)"):
        _claim(groups, runs=["a", "b"], slope={"key": "model.layers", "claimed": "decreases", "than": "base"})
    with pytest.raises(ValueError, match=r"slope.than='b': not one of the claim's groups; give runs as a list"):
        _claim(groups, runs="a", slope={"key": "model.layers", "claimed": "decreases", "than": "b"})


# ---------------------------------------------------------------- combine: worst


def _sweep(gap_at: dict):
    """DeepNorm's loss below Post-LN's by ``gap_at[lr]`` (+ a seed's noise) at each learning rate of ``sweep``."""

    def loss(p):
        if p.group != "sweep":
            return None
        gap = gap_at[p.values["train.lr"]] + NOISE[_seed(p)]
        return 1.0 if p.values["model.scheme"] == "deepnorm" else 1.0 + gap

    return loss


def test_combine_worst_lets_one_bad_cell_decide(groups, tmp_path):
    compare = {"key": "model.scheme", "claimed_better": "deepnorm", "against": "post_ln"}
    worst = _claim(groups, runs="sweep", compare=compare, combine="worst", margin=0.05)
    mean = _claim(groups, runs="sweep", compare=compare, margin=0.05)
    # DeepNorm far ahead at two learning rates, behind at the third: the mean holds, the worst does not
    results = _results(groups, _sweep({1e-3: 1.0, 3e-3: 1.0, 1e-2: -0.2}))
    by_mean = _judge(groups, mean, results, tmp_path).verdict
    assert by_mean.verdict == HELD and by_mean.per_seed == pytest.approx({s: 0.6 + NOISE[s] for s in SEEDS})
    f = _judge(groups, worst, results, tmp_path)
    assert f.verdict.verdict == NOT_HELD and f.verdict.per_seed == pytest.approx({s: -0.2 + NOISE[s] for s in SEEDS})
    assert "the worst of them taken (the claim must hold at each)" in f.rule
    # ahead at every one: the worst is the smallest lead
    f = _judge(groups, worst, _results(groups, _sweep({1e-3: 1.0, 3e-3: 0.3, 1e-2: 0.5})), tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(0.3)


def test_combine_worst_of_a_decreasing_slope_is_its_least_decreasing_cell(groups, tmp_path):
    """The worst cell of a claim that the loss decreases is the one whose loss decreases least."""
    slope = {"key": "train.lr", "claimed": "decreases"}
    worst = _claim(groups, runs="sweep", slope=slope, combine="worst")
    rate = {"post_ln": 0.02, "deepnorm": 0.1}

    def loss(p):
        if p.group != "sweep":
            return None
        return 2.0 - (rate[p.values["model.scheme"]] + NOISE[_seed(p)]) * math.log2(p.values["train.lr"] * 1000)

    v = _judge(groups, worst, _results(groups, loss), tmp_path).verdict
    assert v.per_seed == pytest.approx({s: 0.02 + NOISE[s] for s in SEEDS})


# ---------------------------------------------------------------- all_learn


def test_all_learn_needs_every_run_compared_to_have_learned(groups, tmp_path):
    claim = _claim(
        groups,
        runs=["a", "b"],
        compare={"key": "group", "claimed_better": "a", "against": "b"},
        requires=["all_learn"],
    )
    assert "every run compared must have learned" in _judge(groups, claim, [], tmp_path).rule
    learned = _results(groups, lambda p: {"a": 1.0 + NOISE[_seed(p)], "b": 1.5}.get(p.group))
    assert _judge(groups, claim, learned, tmp_path).verdict.verdict == HELD
    # the against side stayed at chance (2.3 > 0.9 x 2.4) at one depth: the held is inconclusive, and names it
    stalled = _results(groups, lambda p: {"a": 1.0 + NOISE[_seed(p)], "b": 2.3 if _depth(p) == 4 else 1.5}.get(p.group))
    v = _judge(groups, claim, stalled, tmp_path).verdict
    assert v.verdict == INCONCLUSIVE and v.lower > v.margin  # the difference alone would be held
    assert "b/layers=4_decoder_layers=4_seed=0" in v.reason and "learned nothing" in v.reason
    # the requirement is on every run compared, not only the claimed-better side's
    winner_only = _claim(
        groups,
        runs=["a", "b"],
        compare={"key": "group", "claimed_better": "a", "against": "b"},
        requires=["winner_learns"],
    )
    assert _judge(groups, winner_only, stalled, tmp_path).verdict.verdict == HELD
    # a run that is no run of the comparison (the baseline group's) need not have learned
    base = _claim(
        groups,
        runs="a",
        relative_to="base",
        slope={"key": "model.layers", "claimed": "decreases"},
        requires=["all_learn"],
    )
    results = _results(
        groups,
        lambda p: {"a": 1.0 - (0.1 + NOISE[_seed(p)]) * math.log2(_depth(p)), "base": 2.35}.get(p.group),
    )
    v = _judge(groups, base, results, tmp_path).verdict
    assert v.verdict == HELD and "learned nothing" not in v.reason


# ---------------------------------------------------------------- fine-tuned runs: their pre-training's budget


def test_a_claim_on_fine_tuned_runs_reports_its_pre_training_runs_still_improving(tmp_path):
    """Bamboo's depth claims read fine-tuned runs; whether the pre-training behind them had converged at its budget
    is reported beside the verdict too: here the deepest pre-training runs were still lowering their loss by 10%
    over their last quarter (how many, which group, and the largest gain), while every fine-tuned run was flat."""
    from kilolayer.rundir import write_status

    by_depth = {"grid": {"model.layers,model.decoder_layers": [[d, d] for d in DEPTHS]}, "seeds": SEEDS}
    spec = {
        "name": "finetuned",
        "groups": [
            {"name": "pre", "base": BASE, **by_depth},
            {"name": "tuned", "base": BASE, "after": "pre", "init_from": "pre", **by_depth},
        ],
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_spec(path)
    built = {"points": expand(loaded), "by_name": {g.name: g for g in loaded.groups}}
    out = tmp_path / "out"

    def loss(p):
        return 1.0 - (0.05 + NOISE[_seed(p)]) * math.log2(_depth(p)) if p.group == "tuned" else 0.5

    results = _results(built, loss)
    for r in results:
        final = r.eval["loss"]
        moving = r.point.group == "pre" and _depth(r.point) == 4
        earlier = final / 0.9 if moving else final  # 10% lower in the last quarter, or flat
        r.evals = [{"step": 100, "loss": earlier + 0.2}, {"step": 300, "loss": earlier}, {"step": 400, "loss": final}]
        r.point.run_dir(out).mkdir(parents=True)
        when = ("02", "03") if r.point.init_from_point else ("00", "01")
        write_status(
            r.point.run_dir(out),
            "completed",
            400,
            started=f"2026-01-01T{when[0]}:00:00+00:00",
            finished=f"2026-01-01T{when[1]}:00:00+00:00",
        )  # fine-tuning started after pre-training ended
    claim = _claim(built, runs="tuned", slope={"key": "model.layers", "claimed": "decreases"})
    f = _judge(built, claim, results, out)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(0.05)
    fine_tuned, pretraining = f.improving.split("; their pre-training runs (pre), ")
    assert fine_tuned == "budget 400 steps: 0 of 9 runs still improving loss by more than 2%"
    assert pretraining.startswith("budget 400 steps: 3 of 9 runs still improving loss by more than 2% at their budget")
    assert "(most: pre/layers=4_decoder_layers=4_seed=" in pretraining and "10.0% in its last quarter" in pretraining
    # a claim on runs trained from scratch names no pre-training
    scratch = _judge(
        built, _claim(built, runs="pre", slope={"key": "model.layers", "claimed": "decreases"}), results, out
    )
    assert "pre-training" not in scratch.improving and scratch.improving.startswith("budget 400 steps: 3 of 9 runs")
