"""kilolayer study: end-to-end tiny study, skip/retry, divergence as a result, bad specs."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import statistics
import tempfile
from pathlib import Path

import pytest
import yaml
from helpers import cli

from kilolayer import rundir
from kilolayer.errors import ConfigError
from kilolayer.study.report import write_report
from kilolayer.study.runner import run_study
from kilolayer.study.spec import expand, load_spec
from kilolayer.verdicts.rule import HELD, INCONCLUSIVE, NOT_HELD

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- a tiny study end to end

BASE = {
    "model": {
        "arch": "encoder_decoder",
        "scheme": "deepnorm",
        "layers": 1,
        "decoder_layers": 1,
        "width": 32,
        "heads": 2,
        "ffn": 64,
        "vocab_size": 13,
        "max_len": 12,
    },
    "objective": {"name": "seq2seq"},
    "data": {"name": "synthetic", "task": "reverse", "options": {"min_len": 3, "max_len": 6, "eval_size": 16}},
    "train": {
        "steps": 4,
        "batch_size": 8,
        "lr": 1e-3,
        "warmup": 2,
        "eval_every": 2,
        "log_every": 1,
        "diagnostics_every": 1,
    },
}


def tiny_spec(tmp_path: Path, grid=None, **extra) -> Path:
    spec = {
        "name": "tiny",
        "description": "two points",
        "groups": [{"name": "deepnet", "base": BASE, "grid": grid or {"model.scheme": ["post_ln", "deepnorm"]}}],
        "findings": ["deepnet_postln", "deepnet_update"],
        **extra,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow
@pytest.mark.integration
def test_tiny_study_end_to_end_and_rerun(tmp_path, forked_points):
    from kilolayer.study.estimate import _count, diagnostic_steps
    from kilolayer.train.logging import read_metrics

    spec = load_spec(tiny_spec(tmp_path))
    out = tmp_path / "study"
    results = run_study(spec, out, log=lambda *_: None)
    assert [r.status for r in results] == ["completed", "completed"]
    assert all(r.ran for r in results)
    # the estimator's counts of evaluations and diagnostics are those the trainer performed
    for r in results:
        recs = read_metrics(r.point.run_dir(out))
        cfg = r.point.config
        assert sum(x["split"] == "eval" for x in recs) == _count(cfg.train.steps, cfg.train.eval_every) == 2
        assert sum(x["split"] == "diagnostics" for x in recs) == diagnostic_steps(cfg) == 4
    md, html, findings = write_report(spec, results, out, 1.0)
    text = md.read_text()
    for section in (
        "# kilolayer study: tiny",
        "## Verdicts",
        "## DeepNorm trains where Post-LN fails at depth",
        "**Claim.**",
        "**Rule.**",
        "**Verdict:",
        "## Runs",
        "kilolayer train",
    ):
        assert section in text, section
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page
    assert {f.name for f in findings} == {"deepnet_postln", "deepnet_update"}
    assert all(f.verdict.verdict in (HELD, NOT_HELD, INCONCLUSIVE) for f in findings)
    # report.md and report.html say the same verdicts, in the summary and after each finding
    import re

    words = [f.verdict.verdict for f in findings]
    assert re.findall(r"\*\*Verdict: ([a-z ]+)\.\*\*", text) == words
    assert re.findall(r"<strong[^>]*>Verdict: ([a-z ]+)\.</strong>", page) == words
    summary_md = text.split("## Verdicts", 1)[1].split("\n## ", 1)[0]
    summary_html = page.split("Verdicts</h2>", 1)[1].split("<h2", 1)[0]
    assert re.findall(r"\| \*\*([a-z ]+)\*\* \|", summary_md) == words
    assert re.findall(r"<td><strong[^>]*>([a-z ]+)</strong></td>", summary_html) == words
    assert "Student-t" in summary_md and "Student-t" in summary_html and "Chance level" in text
    # re-running trains nothing
    again = run_study(spec, out, log=lambda *_: None)
    assert not any(r.ran for r in again)
    assert [r.eval for r in again] == [r.eval for r in results]
    # deleting one run re-runs only that one
    shutil.rmtree(results[0].point.run_dir(out))
    third = run_study(spec, out, log=lambda *_: None)
    assert [r.ran for r in third] == [True, False]
    assert third[0].eval == results[0].eval  # same seed, same data: the same result
    # a changed spec re-run into the same folder trains its points again, each old run kept beside it
    data = yaml.safe_load(tiny_spec(tmp_path).read_text())
    data["groups"][0]["base"]["train"]["steps"] = 6
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(data))
    lines = []
    fourth = run_study(load_spec(changed), out, log=lines.append)
    assert [(r.ran, r.step) for r in fourth] == [(True, 6), (True, 6)]
    assert sum("its config changed since it ran (train.steps: 4 -> 6)" in line for line in lines) == 2
    for r in fourth:
        old = r.point.run_dir(out).with_name(r.point.run_dir(out).name + ".stale-1")
        assert json.loads((old / "status.json").read_text())["step"] == 4


@pytest.mark.slow
@pytest.mark.integration
def test_diverged_point_is_a_result(tmp_path, forked_points):
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
        (
            {"name": "x", "groups": [{"name": "g", "base": BASE, "grid": {"model.scheme": ["nope"]}}]},
            "model.scheme='nope'",
        ),
    ],
)
def test_bad_spec_is_one_line(tmp_path, spec, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=needle) as err:
        expand(load_spec(path))
    assert "\n" not in str(err.value)


def study_cli(capsys, *args) -> tuple[int, list[str]]:
    """``kilolayer study ARGS`` in this process: its exit code (argparse's refusals exit) and its stderr lines."""
    from kilolayer.cli import main

    try:
        rc = main(["study", *map(str, args)])
    except SystemExit as stop:
        rc = stop.code
    return rc, capsys.readouterr().err.strip().splitlines()


def test_unknown_study_name_cli_one_line(tmp_path, capsys):
    rc, lines = study_cli(capsys, "nosuchstudy", "--out", tmp_path)
    assert rc == 2
    assert len(lines) == 1 and "nosuchstudy" in lines[0] and "quick" in lines[0]


@pytest.mark.integration
def test_study_list():
    p = cli("study", "--list")
    assert p.returncode == 0
    listed = {line.split()[0] for line in p.stdout.splitlines() if line and not line.startswith(" ")}
    studies = "quick deepnet deepnet_1000 deepnet_analysis deepnet_robust bamboo bamboo_cpu deepnet_mt deepnet_mt_slice"
    studies += " deepnet_mt_depth deepnet_multilingual deepnet_multilingual_cpu"
    assert listed == set(studies.split())
    # each line says how its time was obtained
    lines = {line.split()[0]: line for line in p.stdout.splitlines() if line and not line.startswith(" ")}
    assert "measured" in lines["quick"]
    assert "estimated" in lines["deepnet"] and "estimated" in lines["bamboo"]
    assert "estimated" in lines["deepnet_multilingual"] and "measured" in lines["deepnet_multilingual_cpu"]


def test_bamboo_shapes_match_parameters_and_pair_up():
    from kilolayer.nn.budget import count_parameters

    points = expand(load_spec("bamboo"))
    for group in ("supervised", "next_token", "mlm"):
        counts = [count_parameters(p.config.model) for p in points if p.group == group and p.values["train.seed"] == 0]
        assert len(counts) == 4 and max(counts) / min(counts) < 1.04, (group, counts)  # embeddings differ
        heads = {p.config.model.width // p.config.model.heads for p in points if p.group == group}
        assert heads == {16}, heads  # one head size: depth is the only thing that changes with width
    for p in points:
        if p.group == "mlm_finetune":
            src = next(q for q in points if q.key == p.init_from_point)
            assert src.group == "mlm" and src.config.model.layers == p.config.model.layers
            assert src.values["train.seed"] == p.values["train.seed"]


# ---------------------------------------------------------------- run-time estimates


@pytest.mark.parametrize(
    "steps, every, until, expected", [(200, 5, 50, 11), (200, 5, 0, 41), (4, 1, 0, 4), (0, 5, 0, 0), (10, 0, 0, 0)]
)
def test_diagnostic_steps(steps, every, until, expected):
    from kilolayer.study.estimate import diagnostic_steps

    cfg = BASE
    cfg = {**cfg, "train": {**cfg["train"], "steps": steps, "diagnostics_every": every, "diagnostics_until": until}}
    from kilolayer.config import load_config

    assert diagnostic_steps(load_config(cfg)) == expected


def _waits_spec():
    from kilolayer.study.spec import StudySpec

    base = {"model": {"layers": 1, "width": 16, "heads": 2}, "train": {"steps": 2}}
    return StudySpec(
        name="s",
        groups=[
            {"name": "a", "base": base, "seeds": [0, 1, 2]},
            {"name": "b", "base": base, "seeds": [0, 1]},
            {"name": "c", "base": base, "after": "a"},
            {"name": "d", "base": base, "init_from": "b", "seeds": [0, 1]},
            {"name": "e", "base": base},
        ],
    )


def test_a_point_waits_only_for_its_source_point_or_its_after_group():
    from kilolayer.study.spec import Queue, expand

    spec = _waits_spec()
    queue = Queue(spec, expand(spec))
    keys = lambda points: [p.key for p in points]
    # every point that waits for nothing, in the spec's order; a limit takes the first of them
    assert keys(queue.take(2)) == ["a/seed=0", "a/seed=1"]
    assert keys(queue.take()) == ["a/seed=2", "b/seed=0", "b/seed=1", "e/seed=0"]
    assert queue.take() == [] and len(queue) == 3
    queue.end("b/seed=1")  # d's seed-1 point needs only its own source point, not all of b
    assert keys(queue.take()) == ["d/seed=1"]
    for key in ("a/seed=0", "a/seed=1"):
        queue.end(key)
    assert queue.take() == []  # c waits for all of a
    queue.end("a/seed=2")
    assert keys(queue.take()) == ["c/seed=0"] and len(queue) == 1


def test_schedule_replays_the_runner():
    from kilolayer.study.estimate import schedule
    from kilolayer.study.spec import Queue, StudySpec, expand

    spec = _waits_spec()
    points = expand(spec)

    def wall(jobs: int, **slow: float) -> float:
        """Every point takes 1 s but those named (``b_1`` for ``b/seed=1``)."""
        return schedule(Queue(spec, points), {p.key: slow.get(p.key.replace("/seed=", "_"), 1.0) for p in points}, jobs)

    assert wall(1) == 9.0 and wall(1, b_1=5.0) == 13.0  # one after the other
    assert wall(3) == 3.0  # a a a | b b c | d d e: each point starts as soon as what it waits for has ended
    # a a | a b | b(5 s) c | d e | ... d waits for b/seed=1 alone: 8 s, where cutting the study into stages at
    # c and d (every point of the stages before ended) would take 10
    assert wall(2, b_1=5.0) == 8.0
    assert wall(2, a_2=10.0) == 12.0  # c waits for all of a; the rest of the study fills the other slot
    # points that end together free their slots together (estimates give a group's seeds the same cost): x's two
    # points take both slots once both of a's have ended, so w starts after them
    base = {"model": {"layers": 1, "width": 16, "heads": 2}, "train": {"steps": 2}}
    groups = [{"name": "a", "seeds": [0, 1]}, {"name": "x", "after": "a", "seeds": [0, 1]}, {"name": "w"}]
    tied = StudySpec(name="t", groups=[{**g, "base": base} for g in groups])
    cost = {p.key: 10.0 if p.group == "w" else 1.0 for p in expand(tied)}
    assert schedule(Queue(tied, expand(tied)), cost, 2) == 12.0


@pytest.mark.integration
def test_estimate_tiny_study(tmp_path, monkeypatch):
    from kilolayer.study.estimate import estimate

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where probing builds its runs
    spec = load_spec(tiny_spec(tmp_path, grid={"model.scheme": ["post_ln", "deepnorm"]}))
    said: list[str] = []
    est = estimate(spec, jobs=1, probe_steps=2, log=said.append)
    assert set(est["points"]) == {p.key for p in expand(spec)}
    # it says what it probes before each probe (set-up can take minutes), then what it measured
    keys = [p.key for p in expand(spec)]
    assert said[0].startswith("[estimate] 2 distinct point(s) to probe (seeds of a point cost the same)")
    assert "timed over 2 steps after 2 warm-up steps" in said[0]
    probing = [line for line in said if " probing " in line]
    assert len(probing) == 2 and probing[0].startswith(f"[estimate] probing {keys[0]} (1/2)")
    assert said.index(probing[1]) > said.index(probing[0]) + 1  # the first point's result comes in between
    for p in est["points"].values():
        assert p["step"] > 0 and p["seconds"] > est["startup_seconds"]
        # 4 steps, 2 evaluations, 1 checkpoint, 4 diagnostics
        parts = (
            est["startup_seconds"]
            + p["setup"]
            + 4 * p["step"]
            + 2 * p["evaluation"]
            + p["checkpoint"]
            + 4 * p["diagnostics"]
            + p["analyses"]
        )
        assert p["seconds"] == pytest.approx(parts)
    assert est["wall_seconds"] == pytest.approx(est["compute_seconds"])  # one job: one after the other
    from kilolayer.study.executors import forked

    assert (est["startup_seconds"] == 0.0) == forked.available()  # forked points pay no interpreter start-up
    assert not list(tmp_path.glob("study*"))  # probing leaves nothing behind in the project
    assert not list(scratch.glob("kilolayer-estimate-*"))  # nor in the temporary directory it probed in


@pytest.mark.integration
def test_estimate_probes_points_that_differ_only_in_their_analyses_apart(tmp_path, monkeypatch):
    """Analyses run after training and cost time of their own (on their own data, where a group names it): two
    points alike up to their analyses are two probes, each running its point's analyses on its data; seeds stay
    one probe."""
    from kilolayer.study import estimate as E

    spec = load_spec(tiny_spec(tmp_path, grid={"model.scheme": ["post_ln"]}, findings=[]))
    (base,) = expand(spec)
    variants = [
        base,
        dataclasses.replace(base, name="seed1", config=base.config.model_copy(deep=True)),
        dataclasses.replace(base, name="smooth", analyses=["smoothness"]),
        dataclasses.replace(base, name="smooth_ptb", analyses=["smoothness"], analysis_data={"name": "ptb"}),
    ]
    variants[1].config.train.seed = 1
    probed, real_probe = [], E.probe

    def fake_probe(point, steps):
        probed.append((point.name, point.analyses, point.analysis_data))
        return E.PointCost(1.0, 0.1, 0.0, 0.0, 0.0, 5.0 * len(point.analyses))

    monkeypatch.setattr(E, "expand", lambda _spec: variants)
    monkeypatch.setattr(E, "probe", fake_probe)
    monkeypatch.setattr(E, "startup_seconds", lambda: 0.0)
    est = E.estimate(spec, jobs=1, probe_steps=1, log=lambda _line: None)
    assert probed == [
        (base.name, [], None),
        ("smooth", ["smoothness"], None),
        ("smooth_ptb", ["smoothness"], {"name": "ptb"}),
    ]
    seconds = {k.split("/")[1]: v["analyses"] for k, v in est["points"].items()}
    assert seconds == {base.name: 0.0, "seed1": 0.0, "smooth": 5.0, "smooth_ptb": 5.0}

    # a real probe runs the point's analyses on the data they read, as the study will
    ran = []
    monkeypatch.setattr(E, "run_analysis", lambda name, run_dir, data=None: ran.append((name, data)))
    real_probe(variants[3], 1)
    assert ran == [("smoothness", {"name": "ptb"})]


def test_a_finished_run_launched_with_another_config_is_named_and_its_location_is_not_a_change(tmp_path):
    """changed_config: the launch config (OUT/configs/GROUP/NAME.yaml) against the point's config now; a run not
    finished, or without a recorded launch config, is never called changed; train.init_from (where a source run
    lies) is left out."""
    from kilolayer.config import dump_yaml
    from kilolayer.rundir import write_status
    from kilolayer.study.runner import changed_config

    out = tmp_path / "study"
    p = expand(load_spec(tiny_spec(tmp_path)))[0]
    launch = out / "configs" / p.group / f"{p.name}.yaml"
    launch.parent.mkdir(parents=True)
    p.run_dir(out).mkdir(parents=True)
    write_status(p.run_dir(out), "completed", 4)
    assert changed_config(p, out) is None  # no launch config recorded: nothing to compare
    launch.write_text(dump_yaml(p.config))
    assert changed_config(p, out) is None
    moved = p.config.model_copy(update={"train": p.config.train.model_copy(update={"init_from": "/elsewhere"})})
    launch.write_text(dump_yaml(moved))
    assert changed_config(p, out) is None
    other = p.config.model_copy(update={"train": p.config.train.model_copy(update={"lr": 5e-4})})
    launch.write_text(dump_yaml(other))
    assert changed_config(p, out) == "its config changed since it ran (train.lr: 0.0005 -> 0.001)"
    write_status(p.run_dir(out), "interrupted", 2)
    assert changed_config(p, out) is None  # an unfinished run is resumed, not judged


def test_still_improving_flags_unconverged_runs():
    from kilolayer.study.runner import Result
    from kilolayer.verdicts.evidence import still_improving

    p = expand(load_spec(tiny_spec(Path(tempfile.mkdtemp()))))[0]

    def run(values, key="accuracy"):
        return Result(
            point=p, status="completed", evals=[{"step": 100 * (i + 1), key: v} for i, v in enumerate(values)]
        )

    assert still_improving(run([0.5, 0.7, 0.8, 0.9]), "accuracy", 0.01)  # +0.1 over the last quarter
    assert not still_improving(run([0.5, 0.7, 0.9, 0.905]), "accuracy", 0.01)  # plateaued
    assert not still_improving(run([0.5, 0.7, 0.9, 0.8]), "accuracy", 0.01)  # got worse: not improving
    assert still_improving(run([3.0, 2.0, 1.5, 1.4], "loss"), "loss", 0.02, lower_is_better=True, relative=True)
    assert not still_improving(run([3.0, 2.0, 1.5, 1.49], "loss"), "loss", 0.02, lower_is_better=True, relative=True)
    assert not still_improving(run([0.9]), "accuracy", 0.01)  # one evaluation: nothing to compare
    # a non-finite evaluation is no evaluation: a NaN at the window's edge does not hide a falling loss
    nan_edge = [1.5, 1.4, 1.3, 1.2, math.nan, 1.0, 0.8, 0.7]
    assert still_improving(run(nan_edge, "loss"), "loss", 0.02, lower_is_better=True, relative=True)
    loss = {"lower_is_better": True, "relative": True}
    # early-stopped: best 1.00 at step 200, one noisy spike at step 600 (the quarter's start), flat after; the
    # last evaluation is 3.8% below the spike but above the best, so nothing improved in the last quarter
    stopped = run([1.2, 1.0, 1.03, 1.02, 1.04, 1.08, 1.03, 1.039], "loss")
    assert not still_improving(stopped, "loss", 0.02, **loss)
    # a new best inside the last quarter (0.90 at step 700 against 1.00 before), hidden by a last evaluation
    # that spiked back up: still improving
    assert still_improving(run([1.2, 1.0, 1.01, 1.0, 1.0, 1.0, 0.90, 1.0], "loss"), "loss", 0.02, **loss)
    # a new best within the tolerance is not flagged; beyond it it is
    assert not still_improving(run([1.0, 1.0, 1.0, 0.985], "loss"), "loss", 0.02, **loss)
    assert still_improving(run([1.0, 1.0, 1.0, 0.975], "loss"), "loss", 0.02, **loss)
    assert still_improving(run([0.80, 0.85, 0.84, 0.90, 0.86], "accuracy"), "accuracy", 0.01)  # best 0.90 > 0.85
    # recovering after an early best: 0.84 in the last quarter against 1.00 in as many evaluations before it,
    # though the run's best (0.80 at step 200) is older: still improving
    recovering = [1.0, 0.80, 0.82, 0.9, 1.0, 1.02, 1.05, 1.03, 1.0, 1.02, 1.02, 1.01, 0.95, 0.90, 0.86, 0.84]
    assert still_improving(run(recovering, "loss"), "loss", 0.02, **loss)
    # flat with noise: the quarter's best against as many evaluations' best before it (not all of them), so
    # the earlier side does not get more draws of the noise
    flat = [1.0, 0.99, 1.01, 1.0, 0.98, 1.02, 1.0, 1.01, 0.99, 1.0, 1.01, 1.0]
    assert not still_improving(run(flat, "loss"), "loss", 0.02, **loss)
    # stopped on its loss at step 300 while its accuracy rose on: 0.95 at step 500 against the standing 0.90
    evals = [
        {"step": 100 * (i + 1), "loss": x, "accuracy": a}
        for i, (x, a) in enumerate(
            [
                (0.5, 0.85),
                (0.4, 0.88),
                (0.35, 0.90),
                (0.37, 0.93),
                (0.38, 0.95),
                (0.40, 0.95),
                (0.42, 0.95),
                (0.43, 0.95),
            ]
        )
    ]
    rising = Result(point=p, status="completed", evals=evals, eval=evals[2])
    assert still_improving(rising, "accuracy", 0.01)  # the quarter itself is flat at 0.95
    assert not still_improving(rising, "loss", 0.02, **loss)
    assert not still_improving(Result(point=p, status="completed", evals=evals, eval=evals[4]), "accuracy", 0.01)


def test_a_claim_judges_each_run_still_improving_on_its_measure_else_on_the_one_that_chose_its_checkpoint(tmp_path):
    """convergence_of: a measure with its own convergence rule (accuracy: 0.01; a loss: 2%) reads every run by it; one
    without (token similarity) reads each run by the measure that chose its checkpoint. A classifier stopped on its
    accuracy stands past its loss minimum, where a noisy later loss below the standing one is no sign of a loss still
    falling: it is read on its accuracy, a run stopped on its loss (or not stopped early: the default) on its loss.
    What was still improving is reported beside the verdict, never a gate."""
    from kilolayer.study.runner import Result
    from kilolayer.verdicts.claims import judge, parse_claim
    from kilolayer.verdicts.measures import MEASURES, convergence_of

    spec = load_spec(tiny_spec(tmp_path))
    p = expand(spec)[0]

    def on(metric: str, scheme: str):
        cfg = p.config.model_copy(update={"train": p.config.train.model_copy(update={"early_stop_metric": metric})})
        return dataclasses.replace(p, config=cfg, name=scheme, values={**p.values, "model.scheme": scheme})

    # loss at its lowest at step 300, then rising with noise; accuracy flat at 0.95 from step 500 (standing)
    rows = [(0.5, 0.85), (0.4, 0.88), (0.35, 0.90), (0.37, 0.93), (0.40, 0.95), (0.43, 0.95), (0.38, 0.95)]
    rows += [(0.45, 0.95)] * 3
    evals = [{"step": 100 * (i + 1), "loss": x, "accuracy": a} for i, (x, a) in enumerate(rows)]

    def run(metric: str, scheme: str, cosine: float, history=evals) -> Result:
        r = Result(point=on(metric, scheme), status="completed", evals=history, eval=dict(evals[4]))
        r.smoothness, r.chance = {"cosine": [0.1, cosine]}, {"loss": 2.4, "accuracy": 0.1}
        return r

    by_acc, by_loss = run("accuracy", "post_ln", 0.2), run("loss", "deepnorm", 0.6)
    similarity, accuracy, loss = MEASURES["last_layer_cosine"], MEASURES["accuracy"], MEASURES["eval_loss"]
    assert convergence_of(similarity, by_acc) == ("accuracy", 0.01, False)
    assert convergence_of(similarity, by_loss) == ("loss", 0.02, True)
    assert convergence_of(accuracy, by_loss) == ("accuracy", 0.01, False)  # a measure's own rule reads every run
    assert convergence_of(loss, by_acc) == ("loss", 0.02, True)
    claim = parse_claim(
        {
            "name": "similar",
            "claim": "DeepNorm's last-layer tokens are more alike",
            "source": "a test",
            "runs": "deepnet",
            "measure": "last_layer_cosine",
            "compare": {"key": "model.scheme", "claimed_better": "deepnorm", "against": "post_ln"},
            "margin": 0.05,
        },
        "claims[0]",
    )
    f = judge(claim, [by_acc, by_loss], {g.name: g for g in spec.groups}, tmp_path)
    # 0.38 at step 700 is 5% below the standing 0.40: the loss-stopped run was still improving, the other not
    assert "0 of 1 runs still improving accuracy by more than 0.01" in f.improving
    assert "1 of 1 runs still improving loss by more than 2%" in f.improving
    assert f.verdict.verdict == INCONCLUSIVE and "one seed" in f.verdict.reason  # one seed, not the improving run
    # the accuracy rule still flags a classifier whose accuracy rose after its checkpoint
    rising = [*evals[:8], {**evals[8], "accuracy": 0.97}, evals[9]]
    f = judge(claim, [run("accuracy", "post_ln", 0.2, rising), by_loss], {g.name: g for g in spec.groups}, tmp_path)
    assert "1 of 1 runs still improving accuracy by more than 0.01" in f.improving


def test_a_wait_of_a_quarter_of_the_cap_lets_a_slow_run_stop_converged():
    """A slowly falling validation loss (an MAE's: about 0.6% per 100 steps near its end, flat from step 4,000),
    stopped by the trainer's own early stopping (its last gain of min_delta at step 3,900): waiting 8 evaluations
    ends it at step 4,700 with its last quarter (after step 3,525) holding a 3% gain, which the convergence rule
    counts against it; the wait bamboo_cpu gives its MAE group (a quarter of its 6,000-step cap: 15 evaluations) ends
    it at 5,400, flat over its last quarter, so the rule judges it converged."""
    from types import SimpleNamespace

    from kilolayer.study.builtin import BUILTIN
    from kilolayer.study.runner import Result
    from kilolayer.train.policies import EarlyStopping
    from kilolayer.verdicts.evidence import still_improving

    p = expand(load_spec(tiny_spec(Path(tempfile.mkdtemp()))))[0]
    # 0.374 at step 100 falling by 0.0019 every 100 steps (0.5-0.6%, under min_delta) to 0.300 at step 4,000,
    # then within 0.3% of it
    curve = [0.30 + 0.0019 * (4000 - s) / 100 for s in range(100, 4001, 100)]
    curve += [0.3 + 0.0009 * ((i * 7) % 3) for i in range(1, 30)]

    def stopped(patience: int) -> Result:
        tc = SimpleNamespace(patience=patience, early_stop_metric="loss", early_stop_mode="auto", min_delta=0.002)
        rule, evals = EarlyStopping(tc), []
        for i, x in enumerate(curve):
            evals.append({"step": 100 * (i + 1), "loss": x})
            rule.track(evals[-1]["step"], evals[-1])
            if rule.plateaued:
                break
        assert rule.plateaued
        standing = next(e for e in evals if e["step"] == rule.best_step)
        return Result(point=p, status="completed", evals=evals, eval=standing)

    train = {g["name"]: g["base"]["train"] for g in BUILTIN["bamboo_cpu"]()["groups"]}
    # a quarter of a cap, in evaluations, and at least 8: CLIP's 2,500-step cap gives the floor
    assert (train["mae"]["patience"], train["contrastive"]["patience"]) == (15, 8)
    short, long = stopped(8), stopped(train["mae"]["patience"])
    assert (short.evals[-1]["step"], long.evals[-1]["step"]) == (4700, 5400)
    loss = {"lower_is_better": True, "relative": True}
    assert still_improving(short, "loss", 0.02, **loss)
    assert not still_improving(long, "loss", 0.02, **loss)


def _standing_eval(run: Path) -> dict:
    """The evaluation that stands for a finished run, read by hand: the one at status.json's best step."""
    status = json.loads((run / "status.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["split"] == "eval" and r["step"] == status["best_step"])


def _last_cosine(run: Path) -> float:
    return json.loads((run / "analysis" / "smoothness" / "smoothness.json").read_text())["cosine"][-1]


def _bounds(ds: list[float]) -> tuple[float, float, float]:
    """Mean and one-sided 95% bounds of per-seed differences, by the t formula of the findings' rule."""
    from scipy.stats import t

    m = sum(ds) / len(ds)
    half = t.ppf(0.95, len(ds) - 1) * statistics.stdev(ds) / math.sqrt(len(ds))
    return m, m - half, m + half


@pytest.mark.integration
@pytest.mark.slow
def test_bamboo_cpu_recipes_plateau_and_its_verdicts_match_a_hand_count(tmp_path, monkeypatch, forked_points):
    """bamboo_cpu's groups, recipes unchanged but at toy size (1- and 2-layer width-32 models, 256 MNIST training
    images in batches of 64 (MAE's too), help pages made up in the package's format, about 128 samples an
    evaluation, a quarter of each step cap, so a quarter of each wait):
    every trained run but MAE's and MLM's stops on its plateau, before its step cap; every analysis and finding
    runs; and two verdicts' numbers recomputed by hand from the run directories (standing evaluations,
    smoothness files) equal the report's."""
    from helpers import build_fixture

    from kilolayer.data import lo_help
    from kilolayer.study.builtin import BUILTIN

    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    # the points' count must come from --jobs, not from the suite's own OMP_NUM_THREADS
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    lo_help.load_corpus.cache_clear()
    pages = tmp_path / "pages"
    build_fixture(pages)
    help_data = {"name": "lo_help", "options": {"root": str(pages), "modules": ["swriter", "scalc", "simpress"]}}
    data = BUILTIN["bamboo_cpu"]()
    caps = {}
    for g in data["groups"]:
        g["grid"] = {"model.layers,model.width,model.heads,model.ffn": [[1, 32, 2, 128], [2, 32, 2, 128]]}
        # two seeds for the text groups whose verdicts are counted by hand below and those paired with them, one
        # for the rest (the plateau is checked everywhere); the groups a claim pairs run the same seeds
        g["seeds"] = [0, 1] if g["name"] in ("text_classify", "mlm", "mlm_finetune", "text_untrained") else [0]
        base = g["base"]
        if base["data"]["name"] == "lo_help":
            base["data"] = copy.deepcopy(help_data)
            g["analysis_data"] = copy.deepcopy(help_data)
        else:
            base["data"]["options"]["train_size"] = 256
            base["train"]["batch_size"] = 64
        base["train"]["eval_batches"] = -(-64 // base["train"]["batch_size"])  # about 64 samples an evaluation
        if base["train"]["steps"]:
            # MAE and MLM reach their caps at full size too (docs/results.md, "Bamboo on real data": MAE flat by
            # the convergence rule, MLM still improving): they are cut short here (to 40 steps: their fine-tuning
            # starts from a pre-trained encoder) and only the other recipes are held to stopping on a plateau
            steps = {"mae": 40, "mlm": 40}.get(g["name"], base["train"]["steps"] // 4)
            base["train"].update(steps=steps, eval_every=10, checkpoint_every=steps, warmup=5)
            caps[g["name"]] = steps
    path = tmp_path / "bamboo_toy.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    out = tmp_path / "study"
    results = run_study(spec, out, jobs=2, log=lambda *_: None)
    bad = [(r.point.key, r.status, r.reason) for r in results if not r.ok]
    assert not bad, bad
    # --jobs 2 shares the usable CPUs out: each point trained at its share, fixed, from OMP_NUM_THREADS
    from kilolayer.study.runner import threads_per_job
    from kilolayer.train import host

    share = threads_per_job(2)
    assert share == max(1, host.usable_cpus() // 2)  # the usable CPUs shared out by the two jobs
    trained = [rundir.read_status(r.point.run_dir(out)) for r in results if r.point.config.train.steps > 0]
    assert {(st.get("threads"), st.get("threads_reason")) for st in trained} == {(share, "OMP_NUM_THREADS")}
    assert all(r.smoothness and len(r.smoothness["cosine"]) == r.point.config.model.layers + 1 for r in results)
    for r in results:
        if r.point.group in caps and r.point.group not in ("mae", "mlm"):
            status = json.loads((r.point.run_dir(out) / "status.json").read_text())
            assert status["stopped_early"] and status["step"] < caps[r.point.group], (r.point.key, status)
    md, _, findings = write_report(spec, results, out, 1.0)
    # smoothing level x 3 encoder pairs, smoothing trend x 3 sequence-level groups, depth (absolute, relative) x 2,
    # depth_tokens x 2 objectives: the claims of the three sets bamboo_cpu names
    assert [f.name for f in findings] == [
        *(f"bamboo_smoothing_{pair}" for pair in ("supervised", "contrastive", "text")),
        *(f"bamboo_smoothing_trend_{group}" for group in ("supervised", "contrastive", "text")),
        *(f"bamboo_depth{kind}_{pre}" for pre in ("mae", "mlm") for kind in ("", "_relative")),
        "bamboo_depth_tokens_next_token",
        "bamboo_depth_tokens_mlm",
    ]
    by_name = {f.name: f.verdict for f in findings}

    def run(group: str, layers: int, seed: int) -> Path:
        r = next(
            r
            for r in results
            if r.point.group == group and r.point.config.model.layers == layers and r.point.values["train.seed"] == seed
        )
        return r.point.run_dir(out)

    # masked-byte loss per doubling of depth: d = -(loss at 2 layers - loss at 1 layer), per seed
    d = [_standing_eval(run("mlm", 1, s))["loss"] - _standing_eval(run("mlm", 2, s))["loss"] for s in (0, 1)]
    v = by_name["bamboo_depth_tokens_mlm"]
    assert (v.mean, v.lower, v.upper) == pytest.approx(_bounds(d), rel=1e-9)
    # over-smoothing, text classification vs MLM: last-layer cosine difference averaged over the two shapes, per seed
    d = [
        sum(_last_cosine(run("text_classify", n, s)) - _last_cosine(run("mlm", n, s)) for n in (1, 2)) / 2
        for s in (0, 1)
    ]
    v = by_name["bamboo_smoothing_text"]
    assert (v.mean, v.lower, v.upper) == pytest.approx(_bounds(d), rel=1e-9)
    text = md.read_text()
    assert "(text: classification vs MLM)" in text and "vs next_token" not in text
    # every text model was measured on the same inputs (the help paragraphs), stamped beside its result
    texts = [r for r in results if r.point.config.model.input == "tokens"]
    assert {r.smoothness["input"] for r in texts} == {"data:lo_help"}
    assert "Measured on the validation split of data:lo_help" in text


def test_report_runs_table_says_whether_a_run_ended_on_a_plateau_or_its_step_budget(tmp_path):
    """The *ended* column of the report's runs table, from constructed results and the status.json fields the
    trainer writes on completion (``stopped_early``, ``best_step``): a plateau names its best step, a run that
    used its budget says so, and a run that did not complete has no ending to report."""
    from types import SimpleNamespace

    from kilolayer.rundir import write_status
    from kilolayer.study.report import render_markdown
    from kilolayer.study.runner import Result

    spec = load_spec(tiny_spec(tmp_path, grid={"model.scheme": ["post_ln", "deepnorm", "pre_ln"]}))
    out = tmp_path / "study"
    plateau, budget, interrupted = expand(spec)
    ends = [
        (plateau, "completed", 140, "validation loss plateaued", {"stopped_early": True, "best_step": 90}),
        (budget, "completed", 200, "step budget", {"stopped_early": False, "best_step": 200}),
        (interrupted, "interrupted", 60, "stopped by signal", {}),
    ]
    results = []
    for point, status, step, reason, fields in ends:
        point.run_dir(out).mkdir(parents=True)
        write_status(point.run_dir(out), status, step, reason, **fields)
        ev = {"step": step, "split": "eval", "loss": 1.5} if status == "completed" else {}
        results.append(Result(point=point, status=status, reason=reason, step=step, eval=ev, seconds=3.0))
    md = render_markdown(SimpleNamespace(name="ended", description="constructed", findings=[]), results, [], out, 1)
    runs = md.split("## Runs", 1)[1]
    header = next(line for line in runs.splitlines() if line.startswith("| point |"))
    assert header == "| point | status | ended | last evaluation | MFU | precision | seconds |"
    rows = {r.split(" | ")[0][2:]: r.split(" | ")[1:3] for r in runs.splitlines() if r.startswith("| deepnet/")}
    assert rows == {
        plateau.key: ["completed", "plateau (best step 90)"],
        budget.key: ["completed", "step budget"],
        interrupted.key: ["interrupted at step 60: stopped by signal", "-"],
    }


def test_estimate_cli_bad_input_is_one_line(tmp_path, capsys):
    for args, needle in (
        (["quick", "--estimate", "--probe-steps", "0"], "--probe-steps=0"),
        (["--estimate"], "NAME|SPEC.yaml"),
        (["quick", "--out", str(tmp_path), "--jobs", "0"], "--jobs=0"),
    ):
        rc, lines = study_cli(capsys, *args)
        assert rc == 2, lines
        assert len(lines) == 1 and needle in lines[0], lines
    assert not any(tmp_path.iterdir())  # refused before --out was written


def test_shipped_study_specs_load():
    specs = sorted((ROOT / "configs").glob("study_*.yaml"))
    assert specs
    for path in specs:
        points = expand(load_spec(path))
        assert points, path


def test_the_documented_study_example_is_the_shipped_spec():
    page = (ROOT / "docs" / "studies.md").read_text()
    block = page.split("`configs/study_depth_sweep.yaml`:\n\n```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == yaml.safe_load((ROOT / "configs" / "study_depth_sweep.yaml").read_text())


def test_an_analysis_is_redone_when_its_version_or_data_change(tmp_path, monkeypatch):
    """A saved analysis result is kept only while its stamp (the analysis's version and data section) is the
    point's; a result from another version of the measurement, or on other inputs, is measured again."""
    from kilolayer.config import load_config
    from kilolayer.rundir import write_status
    from kilolayer.study.analyses import ANALYSES, STAMP
    from kilolayer.study.runner import run_analyses
    from kilolayer.study.spec import Point

    calls = []

    def probe(run_dir, target, data=None):
        calls.append(data)
        target.mkdir(parents=True, exist_ok=True)
        (target / "probe_test.json").write_text("{}")

    probe.version = 1
    run = tmp_path / "runs" / "g" / "p"
    run.mkdir(parents=True)
    write_status(run, "completed", 1)
    point = Point("g", "p", {}, load_config(BASE), analyses=["probe_test"])
    with ANALYSES.added("probe_test", probe):
        run_analyses(point, tmp_path, log=lambda *_: None)
        run_analyses(point, tmp_path, log=lambda *_: None)
        assert calls == [None]  # measured once, then kept
        probe.version = 2
        run_analyses(point, tmp_path, log=lambda *_: None)
        assert calls == [None, None]  # a new version of the measurement
        point.analysis_data = {"name": "ptb"}
        run_analyses(point, tmp_path, log=lambda *_: None)
        run_analyses(point, tmp_path, log=lambda *_: None)
        assert calls == [None, None, {"name": "ptb"}]  # other inputs, then kept
        (run / "analysis" / "probe_test" / STAMP).unlink()  # a result saved before stamps existed
        run_analyses(point, tmp_path, log=lambda *_: None)
        assert len(calls) == 4
        # the run resumed to more steps: the checkpoint that stands for it is another one, measured again
        import kilolayer.rundir as rd

        monkeypatch.setattr(rd, "chosen_checkpoint", lambda d, patience=0, on_damaged=None: Path(d) / "step_9")
        monkeypatch.setattr(rd, "checkpoint_step", lambda p: 9)
        run_analyses(point, tmp_path, log=lambda *_: None)
        run_analyses(point, tmp_path, log=lambda *_: None)
        assert len(calls) == 5


def test_one_study_per_directory(tmp_path):
    from kilolayer.study.cli import study_lock

    with study_lock(tmp_path):
        with pytest.raises(ConfigError, match="another kilolayer study"):
            with study_lock(tmp_path):
                pass
    with study_lock(tmp_path):  # released with the first
        pass


def test_a_damaged_metrics_file_is_one_unreadable_point_not_a_failed_report(tmp_path):
    from kilolayer.study.runner import collect
    from kilolayer.study.spec import expand, load_spec

    point = next(p for p in expand(load_spec("quick")) if p.group == "deepnet")
    run = point.run_dir(tmp_path)
    run.mkdir(parents=True)
    rundir.write_status(run, "completed", 200, "")
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "split": "train", "loss": 2.0}\nnot json\n{"step": 2, "split": "eval", "loss": 1.0}\n'
    )
    r = collect(point, tmp_path)
    assert r.status == "unreadable" and "metrics.jsonl:2" in r.reason and r.eval == {}
    json.dumps(r.reason)  # one plain line for the report


def test_a_grid_over_the_seed_is_refused_in_one_line(tmp_path):
    """Points are named by their grid values and seed: a grid over train.seed would name every point alike and
    send them all to one run directory."""
    from kilolayer.study.spec import load_spec

    base = {"model": {"arch": "decoder", "layers": 1, "width": 32, "heads": 2}, "objective": {"name": "causal_lm"}}
    path = tmp_path / "spec.yaml"
    path.write_text(
        yaml.safe_dump({"name": "s", "groups": [{"name": "g", "base": base, "grid": {"train.seed": [0, 1]}}]})
    )
    with pytest.raises(
        ConfigError, match=r"^study.groups.0.grid.train.seed: seeds are the group's `seeds` list"
    ) as err:
        load_spec(path)
    assert "\n" not in str(err.value)


def test_a_bad_spec_is_one_line_and_leaves_no_out_directory(tmp_path, capsys):
    """Every point's config is checked (early stopping's needs too) before --out is made or locked."""
    from kilolayer.cli import main

    base = {"model": {"arch": "decoder", "layers": 1, "width": 32, "heads": 2}, "objective": {"name": "causal_lm"}}
    for train in ({"steps": -5}, {"patience": 2}):
        path = tmp_path / "spec.yaml"
        path.write_text(yaml.safe_dump({"name": "s", "groups": [{"name": "g", "base": {**base, "train": train}}]}))
        out = tmp_path / "out"
        assert main(["study", str(path), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "groups.g point seed=0: train." in err, err
        assert not out.exists()


def test_missing_data_is_one_line_before_any_run(tmp_path, capsys, monkeypatch):
    """A data set a point needs is loaded before --out is made: a help package that is not extracted is one
    line naming the point and the fetch command, not a failed run per point an hour into the study."""
    from kilolayer.cli import main
    from kilolayer.data import lo_help

    monkeypatch.setenv("KILOLAYER_CACHE", str(tmp_path / "cache"))
    lo_help.load_corpus.cache_clear()
    model = {"arch": "encoder", "input": "tokens", "layers": 1, "width": 32, "heads": 2, "vocab_size": 262}
    base = {
        "model": {**model, "max_len": 32},
        "objective": {"name": "classification"},
        "data": {"name": "lo_help", "options": {"root": str(tmp_path / "empty")}},
        "train": {"steps": 2},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "groups": [{"name": "text", "base": base}]}))
    out = tmp_path / "out"
    assert main(["study", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith(
        "python -m kilolayer.data.debian fetch lo_help --root "
        + str(tmp_path / "empty")
        + " (apt-get download libreoffice-help-en-us, then dpkg -x the .deb into that folder)"
    ), err
    assert "groups.text point seed=0: data.name='lo_help'" in err
    assert not out.exists()


@pytest.mark.parametrize("statuses, code", [(("completed", "diverged"), 0), (("completed", "failed"), 1)])
def test_a_study_with_unfinished_points_exits_1_and_its_last_line_says_where_their_logs_are(
    tmp_path, monkeypatch, capsys, statuses, code
):
    import argparse

    from kilolayer.study import cli as study_cli
    from kilolayer.study.runner import Result

    path = tiny_spec(tmp_path)
    points = expand(load_spec(path))

    def fake_run(spec, args):
        return [Result(point=p, status=s, reason="boom" * (s == "failed")) for p, s in zip(points, statuses)]

    monkeypatch.setattr(study_cli, "_run", fake_run)
    out = tmp_path / "out"
    args = argparse.Namespace(
        spec=str(path),
        out=str(out),
        jobs=1,
        executor="local",
        estimate=False,
        list=False,
        set=[],
        address=None,
        cpus_per_run=None,
        gpus_per_run=None,
        nproc_per_run=None,
    )
    assert study_cli.cmd_study(args) == code
    last = capsys.readouterr().out.strip().splitlines()[-1]
    (entry,) = json.loads((out / "invocations.json").read_text())["invocations"]
    assert (entry["trained"], entry["executor"]) == (0, "local --jobs 1")  # the fake run trained nothing here
    if code:
        assert last.startswith("1 of 2 points did not finish (deepnet/scheme=deepnorm_seed=0)")
        assert f"their logs: {out / 'logs'}/GROUP/POINT.log" in last
    else:
        assert last.startswith("        ") and last.endswith("report.md")


def test_a_baseline_is_the_point_that_says_train_untrained(tmp_path):
    """The estimate prices an untrained point as built, saved once and analysed; a group that trains no step
    without saying it is a baseline is refused before anything runs, as kilolayer train refuses it."""
    from kilolayer.study import estimate as E

    spec = load_spec(tiny_spec(tmp_path, grid={"train.untrained": [True, False]}, findings=[]))
    baseline, trained = expand(spec)
    assert (baseline.config.train.untrained, baseline.config.train.steps) == (True, 0)
    cost = E.PointCost(setup=1.0, step=0.5, evaluation=2.0, checkpoint=3.0, diagnostics=0.0, analyses=4.0)
    assert E.extrapolate(baseline.config, cost, startup=10.0) == 10.0 + 1.0 + 3.0 + 4.0
    tc = trained.config.train
    evaluations = tc.steps // tc.eval_every + (tc.steps % tc.eval_every != 0) if tc.eval_every else 1
    checkpoints = tc.steps // tc.checkpoint_every + (tc.steps % tc.checkpoint_every != 0) if tc.checkpoint_every else 1
    expected = 10.0 + 1.0 + tc.steps * 0.5 + evaluations * 2.0 + checkpoints * 3.0 + 4.0
    assert E.extrapolate(trained.config, cost, startup=10.0) == pytest.approx(expected)

    with pytest.raises(ConfigError) as info:
        expand(load_spec(tiny_spec(tmp_path, grid={"train.steps": [0]}, findings=[])))
    assert str(info.value).startswith("groups.deepnet point ")
    assert str(info.value).endswith(
        ": train.steps=0: expected at least 1; for an untrained baseline (the "
        "initialised model saved as a run) set train.untrained=true as well"
    )


def test_the_smoothness_plot_dots_the_untrained_groups_lines(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from kilolayer.config import load_config
    from kilolayer.study import plots

    def result(group, **train):
        config = load_config({"model": {"layers": 2}, "train": train})
        point = SimpleNamespace(group=group, config=config, values={"train.seed": 0})
        return SimpleNamespace(point=point, smoothness={"cosine": [0.1, 0.5, 0.9]})

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or True)
    assert plots.smoothness_curves([result("baseline", untrained=True), result("trained", steps=5)], tmp_path / "s.png")
    (ax,) = figures[0].axes
    drawn = [line for line in ax.get_lines() if len(line.get_xdata())]
    assert sorted((line.get_linestyle(), len(line.get_xdata())) for line in drawn) == [("-", 3), (":", 3)]


def test_a_report_rendered_again_says_what_the_invocations_that_trained_took(tmp_path):
    import datetime

    from kilolayer.study import clock

    began = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    assert clock.wall_line(tmp_path, 6.0) == "this invocation took 0.1 min wall-clock"  # nothing recorded
    clock.record(tmp_path, began, 3000.0, 5, "local --jobs 2")
    clock.record(tmp_path, began, 1800.0, 3, "local --jobs 1")  # resumed after an interrupt
    clock.record(tmp_path, began, 3.0, 0, "local --jobs 2")  # rendered again: trained nothing
    assert clock.wall_line(tmp_path, 3.0) == (
        "this invocation took 0.1 min wall-clock; the 2 invocations that trained points took 80.0 min "
        "(local --jobs 1, local --jobs 2)"
    )
    (tmp_path / clock.FILE).write_text("{not json")
    assert clock.invocations(tmp_path) == []  # unreadable: passed over, and the next record starts afresh
    clock.record(tmp_path, began, 60.0, 1, "ray")
    assert clock.wall_line(tmp_path, 60.0).endswith("the invocation that trained points took 1.0 min (ray)")


def test_a_study_or_search_given_threads_auto_says_once_that_its_runs_are_not_bit_reproducible(capsys):
    from kilolayer.study.cli import say_adaptive_threads
    from kilolayer.study.executors import Executor

    say_adaptive_threads(Executor(threads="auto"), "point")
    say_adaptive_threads(Executor(threads=2), "trial")
    say_adaptive_threads(Executor(), "trial")
    assert capsys.readouterr().out == (
        "--threads auto: each point's run follows the machine's load, so its losses are not bit-reproducible\n"
    )
