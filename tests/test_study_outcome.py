"""What ``kilolayer study`` says and returns about a study beyond its verdicts: the claims of a named set that the
spec left out (and why), and analyses that failed (exit 1, a last line naming them). The study runs in process
with its executor replaced by one that writes finished run directories, so nothing trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import CHANCE, ROOT

from kilolayer import rundir
from kilolayer.study.analyses import ANALYSES, analysis_stamp, failed_analyses
from kilolayer.study.runner import Result
from kilolayer.study.spec import expand, load_spec

EXAMPLE = ROOT / "examples" / "my_depth.yaml"


def _spec_file(tmp_path):
    """The example spec with its group named ``next_token``, the smoothness analysis, and Bamboo's set of
    token-level depth claims, whose MLM member reads a group ``mlm`` the spec does not have."""
    data = yaml.safe_load(EXAMPLE.read_text())
    group = data["groups"][0]
    group.update(name="next_token", base=str(ROOT / "configs" / "stdlib_gpt.yaml"), analyses=["smoothness"])
    data["claims"] = ["bamboo_depth_tokens"]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_claim_set_names_the_members_it_left_out_and_why(tmp_path):
    spec = load_spec(_spec_file(tmp_path))
    assert [c.name for c in spec.claims] == ["bamboo_depth_tokens_next_token"]
    assert spec.claims_left_out == ["bamboo_depth_tokens_mlm (of bamboo_depth_tokens): this spec has no group mlm"]
    quick = load_spec("quick").claims_left_out
    assert "bamboo_depth_mlm (of bamboo_depth): this spec has no group mlm_finetune" in quick
    assert "bamboo_smoothing_text (of bamboo_smoothing): this spec has no groups text_classify, mlm" in quick
    assert load_spec("bamboo").claims_left_out == []  # every member's groups are there


def _finished(spec, out, analysed) -> list[Result]:
    """Every point completed (loss falling with depth); ``analysed(point)`` says whether its smoothness result is
    on disk with the stamp of a current measurement."""
    results = []
    for p in expand(spec):
        run = p.run_dir(out)
        run.mkdir(parents=True)
        rundir.write_status(run, "completed", 60)
        if analysed(p):
            rundir.analysis_dir(run, "smoothness").mkdir(parents=True)
            rundir.analysis_file(run, "smoothness").write_text(json.dumps({"layers": [0], "cosine": [0.5]}))
            stamp = analysis_stamp("smoothness", None, run)
            (rundir.analysis_dir(run, "smoothness") / rundir.STAMP).write_text(json.dumps(stamp))
        loss = 2.0 - 0.05 * p.config.model.layers + 0.001 * p.config.train.seed
        r = Result(point=p, status="completed", step=60, eval={"step": 60, "loss": loss})
        r.chance = dict(CHANCE)
        results.append(r)
    return results


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_failed_analyses_make_the_study_exit_1_with_a_last_line_naming_them_and_where_why_is(
    tmp_path, monkeypatch, capsys, failing
):
    from kilolayer.cli import main
    from kilolayer.study import runner
    from kilolayer.study import spec as spec_module

    path, out = _spec_file(tmp_path), tmp_path / "out"
    spec = load_spec(path)
    broken = [p.key for p in expand(spec)][:failing]
    smoothness = ANALYSES.get("smoothness")

    def flawed(run_dir, target, data=None):
        """A bug on the first broken point (a plain exception); any other point measured as the study measures
        it (the broken ones have no checkpoint: a kilolayer error)."""
        if Path(run_dir).relative_to(out / "runs").as_posix() == broken[0]:
            raise RuntimeError("probe blew up")
        return smoothness(run_dir, target, data=data)

    flawed.version = smoothness.version
    monkeypatch.setitem(ANALYSES._items, "smoothness", flawed)
    analyse = runner.run_analyses

    def run_study(spec, out, *args, **kwargs):
        """The executor: every point finished; the analyses run as the study runs them."""
        results = _finished(spec, out, lambda p: p.key not in broken)
        for r in results:
            analyse(r.point, out)
        return results

    monkeypatch.setattr(runner, "run_study", run_study)
    monkeypatch.setattr(spec_module, "check_data", lambda points: None)
    rc = main(["study", str(path), "--out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert "left out: bamboo_depth_tokens_mlm (of bamboo_depth_tokens): this spec has no group mlm" in lines
    assert "- bamboo_depth_tokens_mlm (of bamboo_depth_tokens): this spec has no group mlm" in (
        (out / "report.md").read_text().splitlines()
    )
    if not failing:
        assert rc == 0 and lines[-1].strip().endswith("report.md")
        return
    assert rc == 1 and (out / "report.md").is_file()
    said = {line.split(" failed: ")[0]: line.split(" failed: ")[1] for line in lines if line.startswith("[study] ")}
    assert list(said) == [f"[study] smoothness of {key}" for key in broken]
    why = [rundir.analysis_error_file(out / "runs" / key, "smoothness") for key in broken]
    bug = why[0].read_text()
    assert said[f"[study] smoothness of {broken[0]}"] == bug.splitlines()[0] == "RuntimeError: probe blew up"
    assert "Traceback (most recent call last)" in bug and "in flawed" in bug  # where the bug is
    if failing == 1:
        assert lines[-1] == (
            f"1 analysis of a completed point failed (smoothness of {broken[0]}); why: {why[0]}; re-running the "
            "study runs it again"
        )
        return
    refused = why[1].read_text()
    assert refused.splitlines() == [said[f"[study] smoothness of {broken[1]}"]]  # a kilolayer error: its line
    assert lines[-1] == (
        f"2 analyses of completed points failed (smoothness of {broken[0]}, smoothness of {broken[1]}); why each "
        f"failed: RUN/analysis/NAME/error.txt of its point's run (the first: {why[0]}); re-running the study runs "
        "them again"
    )


def test_an_analysis_that_raises_fails_for_its_point_and_its_reason_goes_when_it_next_succeeds(tmp_path):
    """The point's other analyses still run; the failure is on disk until the analysis succeeds."""
    from kilolayer.study.runner import run_analyses

    spec = load_spec(_spec_file(tmp_path))
    results = _finished(spec, tmp_path, lambda p: True)
    point, run = results[0].point, results[0].point.run_dir(tmp_path)
    point.analyses = ["probe_test", "smoothness"]
    divisor = [0]

    def probe(run_dir, target, data=None):
        target.mkdir(parents=True, exist_ok=True)
        (target / "probe_test.json").write_text(json.dumps({"ratio": 1 / divisor[0]}))

    said = []
    with ANALYSES.added("probe_test", probe):
        run_analyses(point, tmp_path, log=said.append)
        why = rundir.analysis_error_file(run, "probe_test")
        assert said == [f"[study] probe_test of {point.key} failed: ZeroDivisionError: division by zero"]
        assert why.read_text().startswith("ZeroDivisionError: division by zero\n\nTraceback")
        assert [(f.name, f.point, f.why) for f in failed_analyses(results[:1], tmp_path)] == [
            ("probe_test", point.key, why)
        ]
        divisor[0] = 4
        run_analyses(point, tmp_path, log=said.append)
        assert said[-1] == f"[study] probe_test of {point.key}"
        assert not why.exists() and failed_analyses(results[:1], tmp_path) == []
        assert json.loads(rundir.analysis_file(run, "probe_test").read_text()) == {"ratio": 0.25}


def test_a_lost_ray_analysis_task_writes_why_for_each_analysis_it_left_undone(tmp_path):
    from types import SimpleNamespace

    from kilolayer.study.executors.cluster import Lost
    from kilolayer.study.ray_executor import _Driver
    from kilolayer.study.spec import Queue

    spec = load_spec(_spec_file(tmp_path))
    first = expand(spec)[0].key
    results = _finished(spec, tmp_path, lambda p: p.key != first)
    done, undone = results[1].point, results[0].point
    said = []
    driver = SimpleNamespace(
        by_key={p.key: p for p in (done, undone)},
        root=tmp_path,
        progress=SimpleNamespace(say=said.append),
        queue=Queue(spec, expand(spec)),
    )
    for p in (done, undone):
        _Driver.analysed(driver, p.key, Lost("worker died"))
    assert said == [f"[study] smoothness of {undone.key} failed: Ray task: worker died"]
    assert rundir.analysis_error_file(undone.run_dir(tmp_path), "smoothness").read_text() == "Ray task: worker died\n"
    assert not rundir.analysis_error_file(done.run_dir(tmp_path), "smoothness").exists()
    assert driver.queue.ended == {done.key, undone.key}


def test_an_analysis_measured_on_another_checkpoint_counts_as_not_done(tmp_path):
    """A result whose stamp is not the current measurement's (another version, data or checkpoint) is one the
    study would run again: if it is still there after the study, its new measurement failed."""
    spec = load_spec(_spec_file(tmp_path))
    results = _finished(spec, tmp_path, lambda p: True)
    assert failed_analyses(results, tmp_path) == []
    stale = results[0].point.run_dir(tmp_path)
    stamp = json.loads((rundir.analysis_dir(stale, "smoothness") / rundir.STAMP).read_text())
    (rundir.analysis_dir(stale, "smoothness") / rundir.STAMP).write_text(json.dumps({**stamp, "version": -1}))
    assert list(map(str, failed_analyses(results, tmp_path))) == [f"smoothness of {results[0].point.key}"]
    results[0].status = "diverged"  # only completed points are analysed
    assert failed_analyses(results, tmp_path) == []
