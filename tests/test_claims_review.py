"""Claims under review: what a referee of the papers and a user writing their own claims try, each judged as the
stated rule says: a claim fixed after its runs were seen is labelled post hoc, a measure the group's objective
does not log is refused before anything trains, and constructed evidence at the edges of the rule (4 or 5
agreeing seeds, a chance level of NaN, a loser that learned in one seed) gives the verdict the rule gives."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from helpers import CHANCE, ROOT

from kilolayer.study.registered import FILE, post_hoc, record_claims
from kilolayer.study.report import write_report
from kilolayer.study.runner import Result
from kilolayer.study.spec import expand, load_spec

EXAMPLE = ROOT / "examples" / "my_depth.yaml"
NOISE = {0: 0.01, 1: -0.01, 2: 0.0, 3: 0.005, 4: -0.005}


def _spec(tmp_path: Path, change=None, sets=None):
    data = yaml.safe_load(EXAMPLE.read_text())
    data["groups"][0]["base"] = str(ROOT / "configs" / "stdlib_gpt.yaml")
    if change:
        change(data)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path, sets)


def _finish(points, out: Path, n: int) -> None:
    """The first ``n`` points' runs finished (completed) in ``out``."""
    for p in points[:n]:
        p.run_dir(out).mkdir(parents=True, exist_ok=True)
        (p.run_dir(out) / "status.json").write_text(json.dumps({"status": "completed", "step": 60}))


def _recorded(tmp_path: Path, finished: int):
    """The example's claims recorded in a fresh study folder, then its first ``finished`` runs finished."""
    out = tmp_path / "out"
    out.mkdir()
    spec = _spec(tmp_path)
    points = expand(spec)
    record_claims(spec, points, out)
    _finish(points, out, finished)
    return out, spec, points


def _results(spec) -> list[Result]:
    out = []
    for p in expand(spec):
        deep = p.config.model.layers == 8
        loss = 2.0 - (0.1 + NOISE[p.config.train.seed]) * deep
        final = {"step": 60, "split": "eval", "loss": loss}
        r = Result(point=p, status="completed", step=60, eval=final, evals=[final])
        r.chance = dict(CHANCE)
        out.append(r)
    return out


# ---------------------------------------------------------------- post hoc


def test_a_claim_changed_before_any_run_finished_is_not_post_hoc(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spec = _spec(tmp_path)
    record_claims(spec, expand(spec), out)
    revised = _spec(tmp_path, lambda d: d["claims"][0].update(margin=0.01))
    record_claims(revised, expand(revised), out)
    assert post_hoc(revised.claims[0], expand(revised), out) == ""
    entry = json.loads((out / FILE).read_text())["deeper_is_better"]
    assert entry["fields"]["margin"] == 0.01 and entry["changes"][0]["finished"] == 0


def test_a_margin_changed_after_runs_finished_is_post_hoc_in_the_report(tmp_path):
    out, spec, points = _recorded(tmp_path, 2)
    revised = _spec(tmp_path, lambda d: d["claims"][0].update(margin=0.01))
    record_claims(revised, expand(revised), out)
    why = post_hoc(revised.claims[0], expand(revised), out)
    assert why == "changed after 2 of its 6 runs had finished (margin 0.02 -> 0.01)"
    md, _, findings = write_report(revised, _results(revised), out, 1.0)
    report = md.read_text()
    assert findings[0].post_hoc == why
    assert "| deeper_is_better (post hoc) | **held** |" in report
    assert f"**Post hoc.** This claim was {why}." in report
    # the same claim on a fresh folder, recorded before its runs: no label
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    record_claims(revised, expand(revised), fresh)
    assert "(post hoc)" not in write_report(revised, _results(revised), fresh, 1.0)[0].read_text()


def test_a_claim_added_after_its_runs_finished_and_a_budget_changed_are_post_hoc(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spec = _spec(tmp_path)
    points = expand(spec)
    _finish(points, out, 6)
    record_claims(spec, points, out)
    assert post_hoc(spec.claims[0], points, out) == "first recorded after 6 of its 6 runs had finished"
    other = tmp_path / "other"
    other.mkdir()
    record_claims(spec, points, other)
    _finish(points, other, 3)
    shorter = _spec(tmp_path, sets=["train.steps=40"])
    record_claims(shorter, expand(shorter), other)
    assert post_hoc(shorter.claims[0], expand(shorter), other) == (
        'changed after 3 of its 6 runs had finished (budget {"shapes": [60]} -> {"shapes": [40]})'
    )
    # the text of a claim decides nothing: rewording it is no change
    reworded = _spec(tmp_path, lambda d: d["claims"][0].update(claim="Deeper is better", source="a referee"))
    record_claims(reworded, expand(reworded), out)
    assert json.loads((out / FILE).read_text())["deeper_is_better"]["changes"] == []


def test_more_seeds_another_grid_value_and_another_setting_after_runs_finished_are_post_hoc(tmp_path):
    """Optional stopping (seeds added once results are seen), a grid extended under ``where: max`` and a changed
    learning rate each change what the claim reads, as a margin does; a record written without these fields (an
    older kilolayer) is not a change."""
    out, spec, points = _recorded(tmp_path, 6)

    def changed(change=None, sets=None):
        later = _spec(tmp_path, change, sets)
        record_claims(later, expand(later), out)
        return post_hoc(later.claims[0], expand(later), out)

    assert changed(lambda d: d["groups"][0].update(seeds=[0, 1, 2, 3, 4])) == (
        'changed after 6 of its 10 runs had finished (seeds {"shapes": [0, 1, 2]} -> {"shapes": [0, 1, 2, 3, 4]})'
    )
    assert "shapes.train.lr 0.002 -> 0.003)" in changed(sets=["train.lr=0.003"])
    wider = changed(
        lambda d: d["groups"][0]["grid"].update(
            {"model.layers,model.width,model.heads": [[2, 96, 4], [8, 48, 4], [16, 32, 4]]}
        )
    )
    assert "changed after 6 of its 9 runs had finished (grid " in wider and "16" in wider
    older = tmp_path / "older"
    older.mkdir()
    record_claims(spec, points, older)
    record = json.loads((older / FILE).read_text())
    for key in ("seeds", "grid", "settings"):
        del record["deeper_is_better"]["fields"][key]
    (older / FILE).write_text(json.dumps(record))
    _finish(points, older, 6)
    assert post_hoc(spec.claims[0], points, older) == ""
    record_claims(spec, points, older)
    assert json.loads((older / FILE).read_text())["deeper_is_better"]["changes"] == []


# ---------------------------------------------------------------- a measure the runs never log


def test_a_measure_the_groups_objective_does_not_log_is_refused_before_anything_trains(tmp_path, capsys):
    """The example's group trains causal_lm, whose evaluation logs loss and bits per token: a claim on its accuracy
    or BLEU could only ever be inconclusive after every run trained, so the study refuses it with one line, exit 2,
    nothing written; the diagnostics measures need train.diagnostics_every."""
    from kilolayer.cli import main
    from kilolayer.errors import ConfigError

    def refused(change):
        spec = _spec(tmp_path, change)
        try:
            expand(spec)
        except ConfigError as err:
            return str(err)
        return None

    assert refused(lambda d: d["claims"][0].update(measure="accuracy", margin=0.01)) == (
        "claims[0] (deeper_is_better).measure=accuracy: group 'shapes' trains causal_lm, whose evaluation logs "
        "loss, bits_per_token (no accuracy); measures it can read: eval_loss, loss_vs_chance"
    )
    assert "(no bleu)" in refused(lambda d: d["claims"][0].update(measure="bleu", margin=0.5))
    assert refused(lambda d: d["claims"][0].update(measure="first_update", margin=0.01)).endswith(
        "reads the stability diagnostics, which group 'shapes' does not log; set train.diagnostics_every in its set"
    )

    def logged(d):
        d["claims"][0].update(measure="first_update", margin=0.01)
        d["groups"][0]["set"]["train.diagnostics_every"] = 10

    assert refused(logged) is None and refused(None) is None
    _spec(tmp_path, lambda d: d["claims"][0].update(measure="accuracy", margin=0.01))
    out = tmp_path / "out"
    assert main(["study", str(tmp_path / "spec.yaml"), "--out", str(out)]) == 2 and not out.exists()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "measure=accuracy" in lines[0], lines


def test_what_each_builtin_objective_says_it_logs_is_what_its_evaluation_returns():
    from kilolayer.registry import OBJECTIVES

    assert OBJECTIVES.get("causal_lm").logs({}) == ("loss", "bits_per_token")
    assert "accuracy" in OBJECTIVES.get("mlm").logs({}) and "accuracy" in OBJECTIVES.get("classification").logs({})
    assert "accuracy" not in OBJECTIVES.get("contrastive").logs({})
    assert "bleu" in OBJECTIVES.get("seq2seq").logs({}) and "chrf" in OBJECTIVES.get("seq2seq").logs({})
    assert OBJECTIVES.get("seq2seq").logs({"decode_samples": 0}) == ("loss", "token_accuracy")
    assert OBJECTIVES.get("mae").logs({}) == ("loss",)


# ---------------------------------------------------------------- an analysis the data cannot give


TINY = {
    "model": {"arch": "encoder_decoder", "layers": 1, "decoder_layers": 1, "width": 16, "heads": 2, "ffn": 32},
    "objective": {"name": "seq2seq"},
    "data": {"name": "synthetic", "task": "reverse", "options": {"min_len": 3, "max_len": 6, "eval_size": 8}},
    "train": {"steps": 2, "batch_size": 4, "warmup": 1, "eval_every": 2, "log_every": 1},
}


def test_test_scores_on_data_without_a_test_split_is_refused_and_its_estimate_names_the_analysis(tmp_path, capsys):
    """The reverse task evaluates on its validation split only: a group that lists test_scores would train every
    point and then fail each one's analysis. The study refuses it in one line before anything trains (exit 2,
    nothing written), and --estimate, which probes the analysis, names the point and the analysis that fails."""
    from kilolayer.cli import main

    spec = {"name": "t", "groups": [{"name": "g", "base": TINY, "analyses": ["test_scores"]}]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    assert main(["study", str(path), "--out", str(out)]) == 2 and not out.exists()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith(
        "groups.g.analyses: test_scores scores the test split, which data.name='synthetic' does not have (it "
        "evaluates on its validation split only)"
    ), lines
    assert main(["study", str(path), "--estimate", "--probe-steps", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "g/seed=0: analysis test_scores fails on this point's probe (--split test:" in err[0]
    assert err[0].endswith("the study would train the point and then fail the analysis"), err


# ---------------------------------------------------------------- constructed evidence at the rule's edges


def _judged(tmp_path, loss, status=None, chance=CHANCE, change=None, seeds=(0, 1, 2)):
    from kilolayer.verdicts import judge

    spec = _spec(tmp_path, lambda d: (d["groups"][0].update(seeds=list(seeds)), change and change(d)))
    results = []
    for p in expand(spec):
        layers, seed = p.config.model.layers, p.config.train.seed
        st = status(layers, seed) if status else "completed"
        final = {"step": 60, "split": "eval", "loss": loss(layers, seed)} if st == "completed" else {}
        r = Result(point=p, status=st, step=60 if st == "completed" else 20, eval=final, evals=[final] if final else [])
        r.chance = dict(chance)
        results.append(r)
    return judge(spec.claims[0], results, {g.name: g for g in spec.groups}, tmp_path)


def test_four_agreeing_seeds_of_equal_difference_do_not_hold_and_five_do(tmp_path):
    """The deep model is exactly 0.1 nats lower in every seed: zero variance, so the sign test decides, and 4
    agreeing seeds give p = 1/16 > 5% where 5 give 1/32."""
    four = _judged(tmp_path, lambda l, s: 2.0 - 0.1 * (l == 8), seeds=range(4))
    assert four.verdict.verdict == "inconclusive" and four.verdict.test == "sign"
    assert four.verdict.p == 1 / 16 and "needs 5 agreeing seeds of 5" in four.verdict.reason
    five = _judged(tmp_path, lambda l, s: 2.0 - 0.1 * (l == 8), seeds=range(5))
    assert five.verdict.verdict == "held" and five.verdict.p == 1 / 32


def test_a_loser_that_learned_in_one_seed_and_a_loser_with_no_chance_level_leave_trains_where_it_fails_open(tmp_path):
    def needs(d):
        d["claims"][0]["requires"] = ["winner_learns", "loser_fails"]

    # the shallow model fails (0.96 x chance) in seeds 0 and 2, and learns (0.79 x chance) in seed 1
    one = _judged(tmp_path, lambda l, s: 1.0 + NOISE[s] if l == 8 else (1.9 if s == 1 else 2.3), change=needs)
    assert one.verdict.verdict == "inconclusive"
    assert one.verdict.reason.endswith(
        "the claim needs model.layers=2 to fail in every seed, but shapes/layers=2_width=96_heads=4_seed=1 "
        "(0.79 x chance) learned"
    )
    # with no chance level, whether the shallow model failed is unknown: said so, not "learned"
    nan = _judged(tmp_path, lambda l, s: 1.0 + NOISE[s] if l == 8 else 2.3, chance={"loss": float("nan")}, change=needs)
    assert nan.verdict.verdict == "inconclusive" and " learned" not in nan.verdict.reason.split("fail in every")[1]
    assert "completed on data with no chance level, so nobody can say whether it failed" in nan.verdict.reason


def test_a_seed_without_a_finite_difference_is_named_not_dropped():
    from kilolayer.verdicts import decide

    v = decide({0: 0.1, 1: float("inf"), 2: 0.12, 3: float("nan")}, 0.02)
    assert v.verdict == "inconclusive" and v.n == 2
    assert v.reason.startswith("not evidence: seed 1 (d inf), seed 3 (d nan); the other runs give mean d +0.11")


# ---------------------------------------------------------------- claims whose runs cannot be paired


def _second_group(d, **changes):
    other = {**copy.deepcopy(d["groups"][0]), "name": "other", **changes}
    d["groups"].append(other)


def _refusal(tmp_path, change) -> str:
    from kilolayer.errors import ConfigError

    try:
        expand(_spec(tmp_path, change))
    except ConfigError as err:
        return str(err)
    return ""


def _claim(**fields):
    def change(d):
        d["claims"][0].update(fields)
        for kind in ("compare", "slope", "ratio", "survived"):
            if kind in fields and kind != "compare":
                d["claims"][0].pop("compare", None)

    return change


@pytest.mark.parametrize(
    "change, needle",
    [
        (
            lambda d: (
                _second_group(d),
                _claim(runs=["shapes", "other"], slope={"key": "model.layers", "claimed": "decreases"})(d),
            ),
            "a slope reads one group, or two with than: GROUP",
        ),
        (_claim(where={"model.scheme": "max"}), "where.model.scheme=max: max and min need numbers"),
        (_claim(where={"foo.bar": "max"}), "where.foo.bar: not a config key of group 'shapes'"),
        (
            lambda d: (
                _second_group(d, seeds=[1, 2, 3]),
                _claim(
                    runs=["shapes", "other"], compare={"key": "group", "claimed_better": "other", "against": "shapes"}
                )(d),
            ),
            "runs: its groups run different seeds (shapes: 0, 1, 2; other: 1, 2, 3); runs are paired by seed",
        ),
        (
            lambda d: (
                _second_group(d, grid={"model.layers,model.width,model.heads": [[2, 96, 4], [4, 64, 4]]}),
                _claim(
                    runs=["shapes", "other"], compare={"key": "group", "claimed_better": "other", "against": "shapes"}
                )(d),
            ),
            "groups 'shapes' and 'other' vary different settings",
        ),
        (
            lambda d: (_second_group(d, seeds=[0, 1]), _claim(relative_to="other")(d)),
            "relative_to=other: it runs no seed 2; each run is measured from the baseline run of its own seed",
        ),
        (
            lambda d: (
                _second_group(d, grid={"model.layers,model.width,model.heads": [[2, 96, 4]]}),
                _claim(relative_to="other")(d),
            ),
            "relative_to=other: no model.layers=8; each run is measured from the baseline run at its own settings",
        ),
        (_claim(better="higher"), "better=higher: eval_loss is a score (lower is better"),
        (
            _claim(ratio={"key": "model.layers", "claimed_better": 8, "against": 2}, measure="accuracy", margin=1.5),
            "a ratio needs a measure above 0, and accuracy can be 0",
        ),
        (_claim(paper_effect=float("inf")), "paper_effect=inf: expected a finite number above 0"),
        (_claim(paper_effect=-1), "paper_effect=-1: expected a finite number above 0"),
        (_claim(requires=["all_learn", "all_learn"]), "a requirement named twice"),
    ],
)
def test_a_claim_whose_runs_cannot_be_paired_or_read_is_refused_in_one_line(tmp_path, change, needle):
    message = _refusal(tmp_path, change)
    assert needle in message and "\n" not in message, message


def test_survived_with_all_learn_is_refused(tmp_path):
    def survived(d):
        d["groups"][0]["grid"] = {"model.scheme": ["post_ln", "pre_ln"], "train.lr": [0.001, 0.01]}
        d["claims"][0].pop("compare")
        d["claims"][0].update(
            survived={"key": "model.scheme", "claimed_better": "pre_ln", "against": "post_ln", "over": "train.lr"},
            margin=0,
            requires=["all_learn"],
        )

    assert "requires: all_learn with survived" in _refusal(tmp_path, survived)
