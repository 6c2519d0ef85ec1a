"""kilolayer study: verdict rule, end-to-end tiny study, skip/retry, divergence as a result, bad specs."""

from __future__ import annotations

import shutil
import tempfile
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kilolayer.errors import ConfigError
from kilolayer.study.findings import HELD, INCONCLUSIVE, NOT_HELD, verdict
from kilolayer.study.report import write_report
from kilolayer.study.runner import run_study
from kilolayer.study.spec import expand, load_spec

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the verdict rule


def test_verdict_held_not_held_inconclusive():
    assert verdict([0.5, 0.6, 0.55], margin=0.1).verdict == HELD
    assert verdict([-0.5, -0.6, -0.55], margin=0.1).verdict == NOT_HELD
    # a mean above the margin but with a seed spread that swamps it
    v = verdict([1.0, -0.8, 0.9], margin=0.1)
    assert v.verdict == INCONCLUSIVE and "within noise" in v.reason
    # below the margin
    assert verdict([0.05, 0.04], margin=0.1).verdict == INCONCLUSIVE
    # one seed: decided by the margin alone, and the reason says so
    v = verdict([0.3], margin=0.1)
    assert v.verdict == HELD and "one seed" in v.reason
    assert verdict([], margin=0.1).verdict == INCONCLUSIVE
    assert verdict([float("nan")], margin=0.1).verdict == INCONCLUSIVE


def test_verdict_threshold_is_max_of_margin_and_two_standard_errors():
    v = verdict([1.0, 3.0], margin=0.1)  # mean 2, sd sqrt(2), se 1 -> threshold 2
    assert v.threshold == pytest.approx(2.0) and v.verdict == INCONCLUSIVE
    v = verdict([1.9, 2.1], margin=0.5)  # se 0.1 -> threshold is the margin
    assert v.threshold == pytest.approx(0.5) and v.verdict == HELD


@given(st.lists(st.floats(-10, 10), min_size=1, max_size=6), st.floats(0.01, 1))
def test_verdict_is_antisymmetric(diffs, margin):
    a, b = verdict(diffs, margin), verdict([-d for d in diffs], margin)
    flip = {HELD: NOT_HELD, NOT_HELD: HELD, INCONCLUSIVE: INCONCLUSIVE}
    assert b.verdict == flip[a.verdict]


# ---------------------------------------------------------------- a tiny study end to end

BASE = {
    "model": {"arch": "encoder_decoder", "scheme": "deepnorm", "layers": 1, "decoder_layers": 1, "width": 32,
              "heads": 2, "ffn": 64, "vocab_size": 13, "max_len": 12},
    "objective": {"name": "seq2seq", "options": {"decode_samples": 8}},
    "data": {"name": "synthetic", "task": "reverse", "options": {"min_len": 3, "max_len": 6, "eval_size": 16}},
    "train": {"steps": 4, "batch_size": 8, "lr": 1e-3, "warmup": 2, "eval_every": 2, "log_every": 1,
              "diagnostics_every": 1},
}


def tiny_spec(tmp_path: Path, grid=None, **extra) -> Path:
    spec = {
        "name": "tiny", "description": "two points",
        "groups": [{"name": "deepnet", "base": BASE,
                    "grid": grid or {"model.scheme": ["post_ln", "deepnorm"]}}],
        "findings": ["deepnet_postln", "deepnet_update"], **extra,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_tiny_study_end_to_end_and_rerun(tmp_path):
    spec = load_spec(tiny_spec(tmp_path))
    out = tmp_path / "study"
    results = run_study(spec, out, log=lambda *_: None)
    assert [r.status for r in results] == ["completed", "completed"]
    assert all(r.ran for r in results)
    md, html, findings = write_report(spec, results, out, 1.0)
    text = md.read_text()
    for section in ("# kilolayer study: tiny", "## Verdicts", "## DeepNorm trains where Post-LN fails at depth",
                    "**Claim.**", "**Rule.**", "**Verdict:", "## Runs", "kilolayer train"):
        assert section in text, section
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page
    assert {f.name for f in findings} == {"deepnet_postln", "deepnet_update"}
    assert all(f.verdict.verdict in (HELD, NOT_HELD, INCONCLUSIVE) for f in findings)
    # re-running trains nothing
    again = run_study(spec, out, log=lambda *_: None)
    assert not any(r.ran for r in again)
    assert [r.eval for r in again] == [r.eval for r in results]
    # deleting one run re-runs only that one
    shutil.rmtree(results[0].point.run_dir(out))
    third = run_study(spec, out, log=lambda *_: None)
    assert [r.ran for r in third] == [True, False]
    assert third[0].eval == results[0].eval  # same seed, same data: the same result


def test_diverged_point_is_a_result(tmp_path):
    path = tiny_spec(tmp_path, grid={"train.lr": [1e-3, 1e5]})
    data = yaml.safe_load(path.read_text())
    data["groups"][0]["base"]["train"].update(warmup=0, clip=0.0, steps=30, eval_every=0)
    data["groups"][0]["base"]["model"]["scheme"] = "post_ln"
    data["findings"] = []
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    out = tmp_path / "study"
    results = run_study(spec, out, log=lambda *_: None)
    assert [r.status for r in results] == ["completed", "diverged"]
    md, _, _ = write_report(spec, results, out, 1.0)
    assert "diverged at step" in md.read_text()
    # a diverged point is finished: a re-run does not train it again
    assert not any(r.ran for r in run_study(spec, out, log=lambda *_: None))


def test_builtin_studies_expand_and_validate():
    for name in ("quick", "deepnet", "bamboo"):
        spec = load_spec(name)
        points = expand(spec)
        assert points and len({p.key for p in points}) == len(points)
    quick = expand(load_spec("quick"))
    ft = [p for p in quick if p.group == "finetune"]
    assert ft and all(p.init_from_point.startswith("mae/") for p in ft)
    # init_from pairs each fine-tuning point with the MAE point of the same shape and seed
    for p in ft:
        src = next(q for q in quick if q.key == p.init_from_point)
        assert src.config.model == p.config.model and src.values["train.seed"] == p.values["train.seed"]


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"name": "x", "groups": [{"name": "g", "base": BASE, "bogus": 1}]}, "unknown key"),
        ({"name": "x", "groups": [{"name": "g", "base": BASE, "grid": {"model.layers": []}}]}, "empty list"),
        ({"name": "x", "groups": []}, "groups"),
        ({"name": "x", "groups": [{"name": "g", "base": BASE}], "findings": ["nope"]}, "unknown finding"),
        ({"name": "x", "groups": [{"name": "g", "base": BASE, "grid": {"model.scheme": ["nope"]}}]},
         "model.scheme='nope'"),
    ],
)
def test_bad_spec_is_one_line(tmp_path, spec, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=needle) as err:
        expand(load_spec(path))
    assert "\n" not in str(err.value)


def test_unknown_study_name_cli_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kilolayer", "study", "nosuchstudy", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "nosuchstudy" in lines[0] and "quick" in lines[0]


def test_study_list():
    p = subprocess.run([sys.executable, "-m", "kilolayer", "study", "--list"], capture_output=True, text=True,
                       cwd=ROOT)
    assert p.returncode == 0
    assert all(name in p.stdout for name in ("quick", "deepnet", "bamboo"))


# ---------------------------------------------------------------- Bamboo findings on constructed results


def _fake_results(cosine: dict, accuracy: dict, loss: dict):
    """Every point of the built-in bamboo study, with made-up outcomes: ``cosine[group]``, ``accuracy[group]``
    and ``loss[group]`` are functions of (layers, seed)."""
    from kilolayer.study.runner import Result

    results = []
    for p in expand(load_spec("bamboo")):
        layers, seed = p.config.model.layers, p.values["train.seed"]
        ev = {}
        if p.group in accuracy:
            ev["accuracy"] = accuracy[p.group](layers, seed)
        if p.group in loss:
            ev["loss"] = loss[p.group](layers, seed)
        smooth = None
        if p.group in cosine:
            c = cosine[p.group](layers, seed)
            smooth = {"cosine": [0.1, c], "cosine_centred": [0.0, c / 2], "hc_ratio": [1.0, 1 - c]}
        results.append(Result(point=p, status="completed", eval=ev, smoothness=smooth))
    return results


SEQ = ("supervised", "contrastive", "text_classify")
TOK = ("mae", "mlm", "next_token")


@pytest.mark.parametrize("gap, expected", [(0.3, HELD), (-0.3, NOT_HELD), (0.0, INCONCLUSIVE)])
def test_bamboo_smoothing_verdict_on_constructed_results(tmp_path, gap, expected):
    from kilolayer.study.findings import bamboo_smoothing

    noise = {0: 0.01, 1: -0.01, 2: 0.0}
    cosine = {g: (lambda layers, seed: 0.5 + gap + noise[seed]) for g in SEQ}
    cosine.update({g: (lambda layers, seed: 0.5) for g in TOK + ("untrained", "text_untrained")})
    f = bamboo_smoothing(_fake_results(cosine, {}, {}), tmp_path)
    assert f.verdict.verdict == expected
    # every pair present: 4 shapes x 3 seeds x (supervised|contrastive vs mae, text_classify vs mlm|next_token)
    assert f.verdict.n == 4 * 3 * 4 and len(f.rows) == 48
    assert f.verdict.mean == pytest.approx(gap, abs=1e-9)
    assert f.plots and Path(f.plots[0][0]).is_file()


def test_bamboo_depth_findings_on_constructed_results(tmp_path):
    from kilolayer.study.findings import bamboo_depth, bamboo_depth_tokens

    # from scratch, accuracy falls with depth; after token-level pre-training it rises
    acc = {"supervised": lambda l, s: 0.9 - 0.001 * l, "text_classify": lambda l, s: 0.6 - 0.001 * l,
           "finetune": lambda l, s: 0.85 + 0.001 * l + 0.001 * s, "mlm_finetune": lambda l, s: 0.55 + 0.001 * l,
           "contrastive": lambda l, s: 0.5, "mlm": lambda l, s: 0.4}
    # token-level losses fall with depth for next_token, and stay flat for mlm
    loss = {"next_token": lambda l, s: 2.0 - 0.01 * l, "mlm": lambda l, s: 1.5, "mae": lambda l, s: 0.3}
    results = _fake_results({}, acc, loss)
    depth = bamboo_depth(results, tmp_path)
    assert depth.verdict.verdict == HELD
    # (0.048 - 0.006) - (-0.042) = 0.084 for MAE and for MLM (48 vs 6 layers), with the seed term cancelling
    assert depth.verdict.mean == pytest.approx(2 * 0.042, abs=1e-9) and depth.verdict.n == 6
    assert depth.plots and Path(depth.plots[0][0]).is_file()
    tokens = bamboo_depth_tokens(results, tmp_path)
    # next_token: 0.42 nats better at 48 layers; mlm: 0 -> mean 0.21 over 6 comparisons
    assert tokens.verdict.n == 6 and tokens.verdict.mean == pytest.approx(0.21)
    assert tokens.verdict.verdict == HELD
    # a failed deep run is left out, not counted as a loss
    for r in results:
        if r.point.group == "next_token" and r.point.config.model.layers == 48:
            r.status = "failed"
    assert bamboo_depth_tokens(results, tmp_path).verdict.n == 3


def test_bamboo_findings_absent_without_their_groups(tmp_path):
    from kilolayer.study.findings import bamboo_depth_tokens, bamboo_smoothing

    assert bamboo_smoothing([], tmp_path) is None and bamboo_depth_tokens([], tmp_path) is None


def test_bamboo_shapes_match_parameters_and_pair_up():
    from kilolayer.nn.budget import count_parameters

    points = expand(load_spec("bamboo"))
    for group in ("supervised", "next_token", "mlm"):
        counts = [count_parameters(p.config.model) for p in points if p.group == group and p.values["train.seed"] == 0]
        assert len(counts) == 4 and max(counts) / min(counts) < 1.025, (group, counts)  # embeddings differ
    for p in points:
        if p.group == "mlm_finetune":
            src = next(q for q in points if q.key == p.init_from_point)
            assert src.group == "mlm" and src.config.model.layers == p.config.model.layers
            assert src.values["train.seed"] == p.values["train.seed"]


# ---------------------------------------------------------------- run-time estimates


def test_estimate_counts_match_a_real_run(tmp_path):
    """The estimator's counts of evaluations and diagnostics are those the trainer performs."""
    from kilolayer.study.estimate import _count, diagnostic_steps
    from kilolayer.train.logging import read_metrics

    spec = load_spec(tiny_spec(tmp_path))
    out = tmp_path / "study"
    results = run_study(spec, out, log=lambda *_: None)
    for r in results:
        recs = read_metrics(r.point.run_dir(out))
        cfg = r.point.config
        assert sum(x["split"] == "eval" for x in recs) == _count(cfg.train.steps, cfg.train.eval_every)
        assert sum(x["split"] == "diagnostics" for x in recs) == diagnostic_steps(cfg)


@pytest.mark.parametrize("steps, every, until, expected", [(200, 5, 50, 11), (200, 5, 0, 41), (4, 1, 0, 4), (0, 5, 0, 0),
                                                           (10, 0, 0, 0)])
def test_diagnostic_steps(steps, every, until, expected):
    from kilolayer.study.estimate import diagnostic_steps

    cfg = BASE
    cfg = {**cfg, "train": {**cfg["train"], "steps": steps, "diagnostics_every": every, "diagnostics_until": until}}
    from kilolayer.config import load_config

    assert diagnostic_steps(load_config(cfg)) == expected


def test_schedule_replays_the_runner():
    from kilolayer.study.estimate import schedule

    assert schedule([[3.0, 1.0, 1.0, 1.0]], 1) == 6.0
    assert schedule([[3.0, 1.0, 1.0, 1.0]], 2) == 3.0  # 3 | 1+1+1
    assert schedule([[1.0, 1.0], [4.0]], 2) == 5.0  # groups run one after the other
    assert schedule([[]], 3) == 0.0


def test_estimate_tiny_study(tmp_path, monkeypatch):
    from kilolayer.study.estimate import estimate

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where probing builds its runs
    spec = load_spec(tiny_spec(tmp_path, grid={"model.scheme": ["post_ln", "deepnorm"]}))
    est = estimate(spec, jobs=1, probe_steps=2, log=lambda *_: None)
    assert set(est["points"]) == {p.key for p in expand(spec)}
    for p in est["points"].values():
        assert p["step"] > 0 and p["seconds"] > est["startup_seconds"]
        # 4 steps, 2 evaluations, 1 checkpoint, 4 diagnostics
        parts = est["startup_seconds"] + p["setup"] + 4 * p["step"] + 2 * p["evaluation"] + p["checkpoint"] \
            + 4 * p["diagnostics"] + p["analyses"]
        assert p["seconds"] == pytest.approx(parts)
    assert est["wall_seconds"] == pytest.approx(est["compute_seconds"])  # one job: one after the other
    assert not list(tmp_path.glob("study*"))  # probing leaves nothing behind in the project
    assert not list(scratch.glob("kilolayer-estimate-*"))  # nor in the temporary directory it probed in


def test_still_improving_flags_unconverged_runs():
    from kilolayer.study.findings import still_improving
    from kilolayer.study.runner import Result

    p = expand(load_spec(tiny_spec(Path(tempfile.mkdtemp()))))[0]

    def run(values, key="accuracy"):
        return Result(point=p, status="completed", evals=[{"step": 100 * (i + 1), key: v} for i, v in enumerate(values)])

    assert still_improving(run([0.5, 0.7, 0.8, 0.9]), "accuracy", 0.01)  # +0.1 over the last quarter
    assert not still_improving(run([0.5, 0.7, 0.9, 0.905]), "accuracy", 0.01)  # plateaued
    assert not still_improving(run([0.5, 0.7, 0.9, 0.8]), "accuracy", 0.01)  # got worse: not improving
    assert still_improving(run([3.0, 2.0, 1.5, 1.4], "loss"), "loss", 0.02, lower_is_better=True, relative=True)
    assert not still_improving(run([3.0, 2.0, 1.5, 1.49], "loss"), "loss", 0.02, lower_is_better=True, relative=True)
    assert not still_improving(run([0.9]), "accuracy", 0.01)  # one evaluation: nothing to compare


@pytest.mark.slow
def test_bamboo_study_runs_end_to_end_at_toy_size(tmp_path):
    """Every group of the built-in bamboo study (all five objectives, MLM -> fine-tuning across data sources,
    smoothness of encoders and of a causal decoder) trains and reaches the report, at toy size."""
    from kilolayer.study.builtin import bamboo

    data = bamboo()
    for g in data["groups"]:
        g["grid"] = {"model.layers,model.width,model.heads,model.ffn": [[1, 32, 2, 64], [2, 32, 2, 64]]}
        g["seeds"] = [0]
        train = g["base"]["train"]
        if train["steps"]:
            train.update(steps=3, eval_every=3, checkpoint_every=3, warmup=1, eval_batches=1)
        if g["base"]["data"]["name"] == "stdlib_packages":
            g["base"]["data"]["options"]["max_per_class"] = 20
    path = tmp_path / "bamboo_toy.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    out = tmp_path / "study"
    results = run_study(spec, out, jobs=2, log=lambda *_: None)
    bad = [(r.point.key, r.status, r.reason) for r in results if not r.ok]
    assert not bad, bad
    assert all(r.smoothness and len(r.smoothness["cosine"]) == r.point.config.model.layers + 1 for r in results)
    md, _, findings = write_report(spec, results, out, 1.0)
    assert [f.name for f in findings] == ["bamboo_smoothing", "bamboo_depth", "bamboo_depth_tokens"]
    smoothing = findings[0]
    assert smoothing.verdict.n == 2 * 4  # two shapes x four sequence-vs-token pairs, one seed
    assert "text_classify vs next_token" in md.read_text()


def test_study_list_says_how_times_were_obtained():
    p = subprocess.run([sys.executable, "-m", "kilolayer", "study", "--list"], capture_output=True, text=True,
                       cwd=ROOT)
    lines = {line.split()[0]: line for line in p.stdout.splitlines() if line and not line.startswith(" ")}
    assert "measured" in lines["quick"]
    assert "estimated" in lines["deepnet"] and "estimated" in lines["bamboo"]


def test_estimate_cli_bad_input_is_one_line(tmp_path):
    for args, needle in ((["quick", "--estimate", "--probe-steps", "0"], "--probe-steps=0"),
                         (["--estimate"], "NAME|SPEC.yaml"),
                         (["quick", "--out", str(tmp_path), "--jobs", "0"], "--jobs=0")):
        p = subprocess.run([sys.executable, "-m", "kilolayer", "study", *args], capture_output=True, text=True,
                           cwd=ROOT)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], lines


def test_shipped_study_specs_load():
    specs = sorted((ROOT / "configs").glob("study_*.yaml"))
    assert specs
    for path in specs:
        points = expand(load_spec(path))
        assert points, path


def test_readme_study_example_is_the_shipped_spec():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("`configs/study_depth_sweep.yaml`:\n\n```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == yaml.safe_load((ROOT / "configs" / "study_depth_sweep.yaml").read_text())
