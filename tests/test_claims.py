"""Claims written as data: the example spec loads, a bad claim is refused with one line naming its field before
anything trains, and each contrast, requirement and split gives, on constructed evidence, the verdict its stated
rule gives."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml
from helpers import CHANCE, ROOT, cli

from kilolayer.errors import ConfigError
from kilolayer.study.runner import Result
from kilolayer.study.spec import expand, load_spec
from kilolayer.verdicts import HELD, INCONCLUSIVE, NOT_HELD, judge

EXAMPLE = ROOT / "examples" / "my_depth.yaml"
NOISE = {0: 0.01, 1: -0.01, 2: 0.0, 3: 0.005, 4: -0.005}


def _spec_file(tmp_path: Path, change=None, seeds=(0, 1, 2)) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["groups"][0]["base"] = str(ROOT / "configs" / "stdlib_gpt.yaml")
    data["groups"][0]["seeds"] = list(seeds)
    if change:
        change(data)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _results(spec, loss, status=None, evals=None) -> list[Result]:
    """A Result per point: ``loss(layers, seed)`` its final evaluation loss, ``status(layers, seed)`` its status."""
    out = []
    for p in expand(spec):
        layers, seed = p.config.model.layers, p.config.train.seed
        st = status(layers, seed) if status else "completed"
        final = {"step": 60, "split": "eval", "loss": loss(layers, seed)} if st == "completed" else {}
        r = Result(point=p, status=st, step=60 if st == "completed" else 20, eval=final)
        r.evals = evals(layers, seed) if evals else ([final] if final else [])
        r.chance = dict(CHANCE)
        out.append(r)
    return out


def _judge(spec, results, tmp_path, index=0):
    claim = spec.claims[index]
    group = next(g for g in spec.groups if g.name == claim.runs)
    return judge(claim, results, group, tmp_path)


# ---------------------------------------------------------------- the example and its spec features


def test_the_example_spec_loads_its_base_from_a_path_relative_to_the_spec_and_applies_set():
    spec = load_spec(EXAMPLE)
    points = expand(spec)
    assert len(points) == 6 and spec.claims[0].name == "deeper_is_better"
    assert {(p.config.model.layers, p.config.model.width) for p in points} == {(2, 96), (8, 48)}
    assert {p.config.train.steps for p in points} == {60}  # the group's set
    assert points[0].config.data.name == "stdlib_bytes"  # from ../configs/stdlib_gpt.yaml
    # --set applies to every group, after its own set
    assert {p.config.train.steps for p in expand(load_spec(EXAMPLE, ["train.steps=40"]))} == {40}


def test_the_rule_text_is_generated_from_the_claims_fields(tmp_path):
    spec = load_spec(EXAMPLE)
    f = _judge(spec, _results(spec, lambda l, s: 2.0 - 0.01 * l + NOISE[s]), tmp_path)
    assert f.rule.startswith(
        "d = evaluation loss at the standing checkpoint of model.layers=2 minus that of model.layers=8"
    )
    assert "Margin 0.02 nats: twice the seed-to-seed spread" in f.rule and "same split" not in f.rule
    assert "read on validation, the split that also chose each run's checkpoint" in f.rule
    assert "(model.layers moves together with model.width and model.heads in the grid)" in f.rule
    assert f.claim == spec.claims[0].claim and f.reference == "my own hypothesis"


# ---------------------------------------------------------------- bad claims: one line, before anything trains


@pytest.mark.parametrize(
    "change, field, allowed",
    [
        (lambda c: c.update(measure="los"), "claims[0] (deeper_is_better).measure='los'", "eval_loss"),
        (lambda c: c.update(runs="shape"), "claims[0] (deeper_is_better).runs='shape'", "groups: shapes"),
        (lambda c: c["compare"].update(key="model.ffn"), "compare.key=model.ffn", "it varies model.layers"),
        (lambda c: c["compare"].update(claimed_better=16), "compare.claimed_better=16", "allowed: 2, 8"),
        (lambda c: c["compare"].update(against=8), "compare.against", "the same value"),
        (lambda c: c.update(margin=-0.02), "margin=-0.02", "expected a number >= 0"),
        (lambda c: c.update(margin=0.05, paper_effect=0.04), "margin=0.05", "not below the paper's own effect"),
        (lambda c: c.update(requires=["converges"]), "requires", "allowed: winner_learns, loser_fails"),
        (lambda c: c.update(where={"model.layers": 8}), "where.model.layers", "the contrast varies this key"),
        (lambda c: c.update(ratio=c.pop("compare")) or c.update(margin=0.5), "margin=0.5", "a factor of at least 1"),
        (lambda c: c.pop("compare"), "claims[0]", "give exactly one contrast, one of compare, ratio"),
        (lambda c: c.update(compar=c.pop("compare")), "claims[0]", "did you mean compare for compar?"),
        (lambda c: c.update(marginn=1), "claims[0].marginn: unknown key", "a contrast is one of compare"),
        (
            lambda c: c.update(measure="accuracy", margin=0.5 * 100 / 100 + 1),
            "margin=1.5",
            "accuracy is a fraction",
        ),
        (
            lambda c: (
                c.update(slope=c.pop("compare") and {"key": "model.layers", "claimed": "decreases"})
                or c.update(requires=["loser_fails"])
            ),
            "requires",
            "needs a contrast that compares two runs",
        ),
    ],
)
def test_a_bad_claim_is_one_line_naming_its_field(tmp_path, change, field, allowed):
    path = _spec_file(tmp_path, lambda d: change(d["claims"][0]))
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    message = str(err.value)
    assert "\n" not in message and field in message and allowed in message, message


def test_a_test_split_measure_needs_the_test_scores_analysis(tmp_path):
    path = _spec_file(tmp_path, lambda d: d["claims"][0].update(measure="test_accuracy", margin=0.01))
    with pytest.raises(ConfigError, match="add test_scores to the analyses of group 'shapes'"):
        load_spec(path)


@pytest.mark.parametrize("relative_to", [False, True])
def test_a_measure_that_reads_an_analysis_needs_its_groups_to_run_it(tmp_path, capsys, relative_to):
    """last_layer_cosine reads the smoothness analysis: a claim on a group that does not run it (or measured
    relative to a baseline group that does not) is one line naming the field and what to add, exit 2 from the
    command, before anything trains and with nothing written."""
    from kilolayer.cli import main
    from kilolayer.verdicts import MEASURES

    assert MEASURES["last_layer_cosine"].analysis == "smoothness"
    assert MEASURES["test_accuracy"].analysis == "test_scores"

    def cosine(d):
        d["claims"][0].update(measure="last_layer_cosine", margin=0.01)
        d["groups"][0]["analyses"] = ["smoothness"]
        if relative_to:
            base = copy.deepcopy(d["groups"][0])
            base.update(name="untrained", analyses=[])
            d["groups"].append(base)
            d["claims"][0]["relative_to"] = "untrained"

    path = _spec_file(tmp_path, cosine)
    lacking = "'untrained'" if relative_to else "'shapes'"
    if not relative_to:
        assert load_spec(path).claims[0].measure == "last_layer_cosine"  # the group runs it: accepted
        data = yaml.safe_load(path.read_text())
        data["groups"][0]["analyses"] = []
        path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    expected = "claims[0] (deeper_is_better).measure=last_layer_cosine: reads the smoothness analysis; add smoothness "
    assert str(err.value) == expected + f"to the analyses of group {lacking}"
    out = tmp_path / "out"
    assert main(["study", str(path), "--out", str(out)]) == 2 and not out.exists()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith(f"add smoothness to the analyses of group {lacking}")


def test_the_cli_refuses_a_bad_claim_with_exit_2_and_writes_nothing(tmp_path, capsys):
    from kilolayer.cli import main

    path = _spec_file(tmp_path, lambda d: d["claims"][0]["compare"].update(claimed_better=16))
    out = tmp_path / "out"
    rc = main(["study", str(path), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists(), err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "compare.claimed_better=16" in lines[0], err


# ---------------------------------------------------------------- judging constructed evidence


def test_compare_holds_and_fails_by_the_bounds(tmp_path):
    spec = load_spec(EXAMPLE)
    deeper_better = _results(spec, lambda l, s: 2.0 - (0.1 if l == 8 else 0) + NOISE[s] * (l == 8))
    f = _judge(spec, deeper_better, tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(0.1) and f.verdict.n == 3
    assert [r[:4] for r in f.rows][:1] == [[2, 96, 4, 0]]  # the tied width and heads shown beside the layers
    shallower_better = _results(spec, lambda l, s: 2.0 + (0.1 if l == 8 else 0) + NOISE[s] * (l == 8))
    assert _judge(spec, shallower_better, tmp_path).verdict.verdict == NOT_HELD
    within = _results(spec, lambda l, s: 2.0 - (0.01 if l == 8 else 0) + NOISE[s] * (l == 8))
    assert _judge(spec, within, tmp_path).verdict.verdict == INCONCLUSIVE


def test_a_failed_run_is_named_and_a_diverged_one_scores_chance(tmp_path):
    spec = load_spec(EXAMPLE)
    results = _results(
        spec,
        lambda l, s: 2.0 - 0.1 * (l == 8) + NOISE[s],
        status=lambda l, s: "failed" * (l == 2 and s == 1) or "completed",
    )
    f = _judge(spec, results, tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "shapes/layers=2_width=96_heads=4_seed=1 (failed" in f.verdict.reason
    # the shallow model diverged in every seed: it scores the chance loss, 2.4 - (1.9 + noise) per seed
    results = _results(spec, lambda l, s: 1.9 + NOISE[s], status=lambda l, s: "diverged" if l == 2 else "completed")
    f = _judge(spec, results, tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(0.5)


def test_loser_fails_needs_the_loser_to_fail_in_every_seed(tmp_path):
    path = _spec_file(tmp_path, lambda d: d["claims"][0].update(requires=["winner_learns", "loser_fails"]))
    spec = load_spec(path)
    # the shallow model at 0.79 x chance learned: no "trains where it fails"
    learned = _results(spec, lambda l, s: 1.0 + NOISE[s] if l == 8 else 1.9)
    f = _judge(spec, learned, tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "needs model.layers=2 to fail in every seed" in f.verdict.reason
    assert "(0.79 x chance)" in f.verdict.reason
    failed = _results(spec, lambda l, s: 1.0 + NOISE[s] if l == 8 else 2.3)  # 0.96 x chance
    assert _judge(spec, failed, tmp_path).verdict.verdict == HELD
    # the deep model learning nothing contradicts the claim that it trains
    neither = _results(spec, lambda l, s: 2.3 + NOISE[s] if l == 8 else 2.35)
    f = _judge(spec, neither, tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "learned nothing" in f.verdict.reason


def test_still_improving_is_reported_and_decides_only_a_claim_about_converged_models(tmp_path):
    def moving(layers, seed):  # 10% gained in the last quarter of the steps
        return [{"step": 20, "loss": 2.5}, {"step": 40, "loss": 2.0}, {"step": 60, "loss": 1.8}]

    spec = load_spec(EXAMPLE)
    results = _results(spec, lambda l, s: 1.8 - 0.1 * (l == 8) + NOISE[s] * (l == 8), evals=moving)
    for r in results:
        r.evals[-1] = dict(r.eval)
    f = _judge(spec, results, tmp_path)
    assert f.verdict.verdict == HELD and f.improving.startswith(
        "budget 60 steps: 6 of 6 runs still improving loss by more than 2%"
    )
    spec = load_spec(_spec_file(tmp_path, lambda d: d["claims"][0].update(requires=["converged"])))
    results = _results(spec, lambda l, s: 1.8 - 0.1 * (l == 8) + NOISE[s] * (l == 8), evals=moving)
    for r in results:
        r.evals[-1] = dict(r.eval)
    f = _judge(spec, results, tmp_path)
    assert f.verdict.verdict == INCONCLUSIVE and "the claim is about converged models" in f.verdict.reason


def test_a_score_is_read_on_test_only_when_every_compared_run_was_scored_there(tmp_path, monkeypatch):
    from kilolayer.registry import OBJECTIVES

    # the example's causal LM logs no accuracy: here it does, as an objective of the user's could
    monkeypatch.setattr(OBJECTIVES.get("causal_lm"), "metrics", ("loss", "accuracy"))
    spec = load_spec(_spec_file(tmp_path, lambda d: d["claims"][0].update(measure="accuracy", margin=0.005)))
    results = _results(spec, lambda l, s: 1.0)
    for r in results:
        deep = r.point.config.model.layers == 8
        r.eval["accuracy"] = 0.50  # validation chose the checkpoints: no difference there
        r.test = {"metrics": {"accuracy": 0.60 + 0.02 * deep + NOISE[r.point.config.train.seed] / 5 * deep}}
    f = _judge(spec, results, tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(0.02)
    assert "read on the whole test split, each run's checkpoint chosen on validation" in f.rule
    results[0].test = None  # one run not scored on test: all are read on validation, and the rule says so
    f = _judge(spec, results, tmp_path)
    assert f.verdict.mean == pytest.approx(0.0) and "the split that also chose each run's checkpoint" in f.rule


def test_review_cases_rounding_grid_values_and_diverged_winners(tmp_path):
    # differences equal up to float rounding are zero variance: the sign test, not a t-bound of zero width
    from kilolayer.verdicts import decide

    assert decide({0: 2.05 - 2.0, 1: 1.55 - 1.5}, 0.02).test == "sign"

    # a grid value the config coerces (0 -> 0.0) still matches the claim's value
    def clip(d):
        d["groups"][0]["grid"] = {"train.clip": [0, 1]}
        d["claims"][0]["compare"] = {"key": "train.clip", "claimed_better": 1, "against": 0}

    spec = load_spec(_spec_file(tmp_path, clip))
    results = _results(spec, lambda l, s: 2.0)
    for r in results:
        r.eval["loss"] = 2.0 - 0.1 * (r.point.values["train.clip"] == 1) + NOISE[r.point.config.train.seed]
    f = _judge(spec, results, tmp_path)
    assert "missing" not in f.verdict.reason and f.verdict.mean == pytest.approx(0.1)
    # a claimed-better side that diverged never wins against one that completed, even above chance
    spec = load_spec(EXAMPLE)
    results = _results(spec, lambda l, s: 2.5 + NOISE[s], status=lambda l, s: "diverged" if l == 8 else "completed")
    assert _judge(spec, results, tmp_path).verdict.verdict != HELD


def test_slope_and_ratio(tmp_path):
    def slope_spec(d):
        d["groups"][0]["grid"] = {"model.layers": [2, 4, 8]}
        d["claims"][0].pop("compare")
        d["claims"][0]["slope"] = {"key": "model.layers", "claimed": "decreases"}

    spec = load_spec(_spec_file(tmp_path, slope_spec))
    results = _results(spec, lambda l, s: 2.0 - (0.05 + NOISE[s]) * math.log2(l))
    f = _judge(spec, results, tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(0.05) and "per doubling" in f.verdict.reason

    def ratio_spec(d):
        d["claims"][0].pop("compare")
        d["claims"][0].update(ratio={"key": "model.layers", "claimed_better": 8, "against": 2}, margin=1.5)

    spec = load_spec(_spec_file(tmp_path, ratio_spec))
    results = _results(spec, lambda l, s: 1.0 if l == 8 else 2.0 + NOISE[s])
    f = _judge(spec, results, tmp_path)
    assert f.verdict.verdict == HELD and f.verdict.mean == pytest.approx(math.log(2.0), abs=0.01)
    assert f.verdict.margin == pytest.approx(math.log(1.5))


def test_survived_is_count_data_decided_by_the_sign_test(tmp_path):
    def survived_spec(d, seeds):
        d["groups"][0]["grid"] = {"model.scheme": ["post_ln", "pre_ln"], "train.lr": [0.001, 0.01, 0.1]}
        d["groups"][0]["seeds"] = list(seeds)
        d["claims"][0].pop("compare")
        d["claims"][0].update(
            survived={"key": "model.scheme", "claimed_better": "pre_ln", "against": "post_ln", "over": "train.lr"},
            margin=0,
        )

    def outcome(spec):
        results = _results(spec, lambda l, s: 1.0)
        for r in results:  # post_ln diverges at the largest learning rate
            if r.point.config.model.scheme == "post_ln" and r.point.config.train.lr == 0.1:
                r.status, r.eval = "diverged", {}
        return _judge(spec, results, tmp_path)

    two_spec = load_spec(_spec_file(tmp_path, lambda d: survived_spec(d, (0, 1))))
    assert two_spec.claims_undecidable == [
        f"{two_spec.claims[0].name}: its runs share 2 seed(s) and count data are decided by a one-sided sign test "
        "at 5%, which needs 5 agreeing seeds, so it can only read inconclusive"
    ]
    two = outcome(two_spec)
    assert two.verdict.verdict == INCONCLUSIVE and two.verdict.p == pytest.approx(0.25)
    assert two.verdict.per_seed == {0: 1.0, 1: 1.0} and "sign test" in two.rule
    five_spec = load_spec(_spec_file(tmp_path, lambda d: survived_spec(d, range(5))))
    assert five_spec.claims_undecidable == []
    five = outcome(five_spec)
    assert five.verdict.verdict == HELD and five.verdict.p == pytest.approx(1 / 32)


def test_one_seed_is_named_as_undecidable_before_anything_trains_and_8_0_is_the_grid_value_8(tmp_path, capsys):
    from kilolayer.study.cli import say_claim_notes

    def one_seed(d):
        d["groups"][0]["seeds"] = [0]
        d["claims"][0]["compare"]["claimed_better"] = 8.0

    path = _spec_file(tmp_path, one_seed)
    spec = load_spec(path)
    assert len(spec.claims_undecidable) == 1 and "share 1 seed(s)" in spec.claims_undecidable[0]
    assert "one seed cannot tell a difference from seed noise" in spec.claims_undecidable[0]
    say_claim_notes(spec)
    assert capsys.readouterr().out == f"cannot decide: {spec.claims_undecidable[0]}\n"
    assert spec.claims[0].contrast.claimed_better == 8.0 and len(spec.claims_left_out) == 0


def test_a_claim_reads_only_its_own_group(tmp_path):
    def two_groups(d):
        other = copy.deepcopy(d["groups"][0])
        other["name"] = "other"
        d["groups"].append(other)

    spec = load_spec(_spec_file(tmp_path, two_groups))
    results = _results(spec, lambda l, s: 2.0 - 0.1 * (l == 8) + NOISE[s] * (l == 8))
    for r in results:
        if r.point.group == "other":
            r.eval["loss"] = 9.0
    f = _judge(spec, results, tmp_path)
    assert f.verdict.verdict == HELD and len(f.rows) == 6


@pytest.mark.integration
def test_the_example_runs_from_the_cli_and_its_report_has_the_claims_row(tmp_path):
    out = tmp_path / "my_depth"
    sets = ["train.steps=8", "train.eval_every=4", "train.checkpoint_every=8", "train.log_every=4"]
    # a slice of the corpus and small batches: the example's six runs and its claim, at a cost of seconds
    sets += ["train.batch_size=4", "train.eval_batches=2", "data.options.max_bytes=200000"]
    sets += ["data.options.eval_windows=8"]
    proc = cli("study", EXAMPLE, "--out", out, "--jobs", "2", *[a for s in sets for a in ("--set", s)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (out / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| deeper_is_better |"))
    assert any(v in row for v in ("**held**", "**did not hold**", "**inconclusive**")), row
    assert "d = evaluation loss at the standing checkpoint of model.layers=2 minus that of model.layers=8" in report
    assert "Margin 0.02 nats: twice the seed-to-seed spread" in report


@pytest.mark.parametrize("kind", ["compare", "ratio", "slope"])
def test_two_seeds_equal_up_to_float_rounding_never_hold_by_a_degenerate_bound(tmp_path, kind):
    """The deep model's loss is 0.3 nats lower in both seeds, the seeds' differences 1e-7 apart (float32 rounding
    of a 2.3-nat loss is about 1e-7): each contrast carries the rounding of the values it read to its *d*, and
    the two seeds are a sign test (p = 0.25), not t-bounds of width 1e-7. Seeds 0.01 apart are seed noise."""

    def use(d):
        if kind != "compare":
            d["claims"][0].pop("compare")
        if kind == "ratio":
            d["claims"][0].update(ratio={"key": "model.layers", "claimed_better": 8, "against": 2}, margin=1.05)
        if kind == "slope":
            d["claims"][0]["slope"] = {"key": "model.layers", "claimed": "decreases"}

    spec = load_spec(_spec_file(tmp_path, use, seeds=(0, 1)))
    near = _judge(spec, _results(spec, lambda l, s: 2.0 if l == 8 else 2.3 + 1e-7 * s), tmp_path)
    assert near.verdict.n == 2 and near.verdict.mean > near.verdict.margin
    assert near.verdict.verdict == INCONCLUSIVE and near.verdict.test == "sign", near.verdict.reason
    assert near.verdict.p == pytest.approx(0.25) and "within float rounding" in near.verdict.reason
    noisy = _judge(spec, _results(spec, lambda l, s: 2.0 if l == 8 else 2.3 + 0.01 * s), tmp_path)
    assert noisy.verdict.verdict == HELD and noisy.verdict.test == "t"


def test_a_claims_plots_show_only_the_runs_its_where_selects(tmp_path, monkeypatch):
    """A claim at the deepest setting (``where: {model.layers: max}``) plots the runs of that setting only, the
    cells its verdict compares; a plot drawn from the whole study still gets every run."""
    from kilolayer.study import plots
    from kilolayer.study.claim_plots import claim_plots

    def at_depth(d):
        d["groups"][0]["grid"] = {"model.scheme": ["pre_ln", "deepnorm"], "model.layers": [2, 4]}
        d["claims"][0].update(
            compare={"key": "model.scheme", "claimed_better": "deepnorm", "against": "pre_ln"},
            where={"model.layers": "max"},
            plots=["loss_curves", "depth"],
        )

    spec = load_spec(_spec_file(tmp_path, at_depth, seeds=(0, 1)))
    results = _results(spec, lambda l, s: 2.0)
    drawn = {}

    def fake(name):
        def draw(runs, path, **kw):
            drawn[name] = sorted(r.point.key for r in runs)
            return True

        return draw

    monkeypatch.setattr(plots, "loss_curves", fake("loss_curves"))
    monkeypatch.setattr(plots, "depth_curves", fake("depth"))
    found = claim_plots(spec.claims[0], results, tmp_path)
    assert [Path(path).name for path, _ in found] == ["deeper_is_better_loss.png", "deeper_is_better_depth.png"]
    assert drawn["loss_curves"] == sorted(r.point.key for r in results if r.point.config.model.layers == 4)
    assert len(drawn["loss_curves"]) == 4 and len(drawn["depth"]) == 8  # the depth plot is of the whole study
