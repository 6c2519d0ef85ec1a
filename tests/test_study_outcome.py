"""What ``kilolayer study`` says and returns about a study beyond its verdicts: the claims of a named set that the
spec left out (and why), and analyses that failed (exit 1, a last line naming them). The study runs in process
with its executor replaced by one that writes finished run directories, so nothing trains."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import CHANCE, ROOT

from kilolayer import rundir
from kilolayer.study.analyses import analysis_stamp, failed_analyses
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


@pytest.mark.parametrize("failing", [0, 2])
def test_failed_analyses_make_the_study_exit_1_with_a_last_line_naming_them(tmp_path, monkeypatch, capsys, failing):
    from kilolayer.cli import main
    from kilolayer.study import runner
    from kilolayer.study import spec as spec_module

    path, out = _spec_file(tmp_path), tmp_path / "out"
    spec = load_spec(path)
    broken = [p.key for p in expand(spec)][:failing]

    analyse = runner.run_analyses

    def run_study(spec, out, *args, **kwargs):
        """The executor: every point finished; the `broken` ones have no checkpoint to measure, so their
        smoothness analysis, run as the study runs it, fails."""
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
    assert rc == 1
    assert [line.split(": ")[0] for line in lines if line.startswith("[study] smoothness")] == [
        f"[study] smoothness of {key} failed" for key in broken
    ]
    assert lines[-1] == (
        f"2 analyses of completed points failed (smoothness of {broken[0]}, smoothness of {broken[1]}); why each "
        "failed is printed above ('[study] NAME of POINT failed: ...'); re-running the study runs them again"
    )


def test_an_analysis_measured_on_another_checkpoint_counts_as_not_done(tmp_path):
    """A result whose stamp is not the current measurement's (another version, data or checkpoint) is one the
    study would run again: if it is still there after the study, its new measurement failed."""
    spec = load_spec(_spec_file(tmp_path))
    results = _finished(spec, tmp_path, lambda p: True)
    assert failed_analyses(results, tmp_path) == []
    stale = results[0].point.run_dir(tmp_path)
    stamp = json.loads((rundir.analysis_dir(stale, "smoothness") / rundir.STAMP).read_text())
    (rundir.analysis_dir(stale, "smoothness") / rundir.STAMP).write_text(json.dumps({**stamp, "version": -1}))
    assert failed_analyses(results, tmp_path) == [f"smoothness of {results[0].point.key}"]
    results[0].status = "diverged"  # only completed points are analysed
    assert failed_analyses(results, tmp_path) == []
