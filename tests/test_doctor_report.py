"""The study report shows the doctor's one-paragraph diagnosis next to each failed or diverged point."""

import json

import pytest
import yaml

from kilolayer import rundir
from kilolayer.config import dump_yaml
from kilolayer.files import write_atomic
from kilolayer.study.report import diagnoses, write_report
from kilolayer.study.runner import collect_all
from kilolayer.study.spec import expand, load_spec

BASE = {
    "model": {
        "arch": "encoder_decoder",
        "scheme": "post_ln",
        "layers": 2,
        "decoder_layers": 2,
        "width": 16,
        "heads": 2,
        "ffn": 32,
        "vocab_size": 13,
        "max_len": 16,
    },
    "objective": {"name": "seq2seq", "options": {"decode_samples": 0}},
    "data": {
        "name": "synthetic",
        "task": "reverse",
        "options": {"vocab": 10, "min_len": 4, "max_len": 8, "eval_size": 32},
    },
    "train": {
        "steps": 4,
        "batch_size": 8,
        "lr": 1e-3,
        "warmup": 1,
        "clip": 0.0,
        "eval_every": 2,
        "eval_batches": 1,
        "diagnostics_every": 1,
        "log_every": 1,
    },
}
CRASH = "exit code -9: Killed"


def _snapshot(root):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A study directory with three points: one trained to completion, one diverged by its learning rate
    (trained for real: lr 100 diverges at step 2) and one whose training process was killed (its status
    as the runner records it, through kilolayer.rundir)."""
    from kilolayer.errors import DivergedError
    from kilolayer.train.run import train

    tmp = tmp_path_factory.mktemp("diag")
    spec_file = tmp / "spec.yaml"
    spec_file.write_text(
        yaml.safe_dump(
            {
                "name": "diag",
                "groups": [
                    {"name": "lr", "base": BASE, "grid": {"train.lr": [1e-3, 100.0]}},
                    {"name": "crash", "base": BASE},
                ],
            }
        )
    )
    spec = load_spec(spec_file)
    points = expand(spec)
    out = tmp / "study"
    by = {}
    for p in points:
        run = p.run_dir(out)
        if p.group == "crash":
            run.mkdir(parents=True)
            write_atomic(run / rundir.CONFIG, dump_yaml(p.config))
            rundir.write_status(run, "failed", 0, CRASH)
            by["failed"] = p
            continue
        try:
            train(p.config, run, quiet=True)
            by["completed"] = p
        except DivergedError:
            by["diverged"] = p
    assert set(by) == {"completed", "diverged", "failed"}
    return spec, points, out, by


def test_report_diagnoses_failed_and_diverged_points(study):
    spec, points, out, by = study
    results = collect_all(points, out, set())
    assert {r.point.key: r.status for r in results} == {
        by["completed"].key: "completed",
        by["diverged"].key: "diverged",
        by["failed"].key: "failed",
    }
    runs = _snapshot(out / "runs")
    md_path, html_path, _ = write_report(spec, results, out, 1.0)
    assert _snapshot(out / "runs") == runs  # diagnosing wrote nothing into the run directories
    md = md_path.read_text()
    section = md.split("## Why points failed or diverged", 1)[1].split("\n## ", 1)[0]
    items = [ln for ln in section.splitlines() if ln.startswith("- **")]
    assert len(items) == 2  # the completed point has none

    diverged = next(ln for ln in items if ln.startswith(f"- **{by['diverged'].key}** (diverged at step "))
    status = json.loads((by["diverged"].run_dir(out) / "status.json").read_text())
    assert f"(diverged at step {status['step']}): Diverged at step {status['step']} (lr " in diverged
    assert status["reason"] in diverged and "fix: lower train.lr (peak 100)" in diverged
    # the replayed first step against DeepNorm's at the same shape and lr: the doctor's evidence for the fix
    assert "its first update was " in diverged and "x DeepNorm's" in diverged

    failed = next(ln for ln in items if ln.startswith(f"- **{by['failed'].key}** (failed at step 0): "))
    assert f"Failed at step 0: {CRASH}; fix: not a training outcome" in failed

    # the same paragraphs in report.html, and in what diagnose() itself returns
    html = html_path.read_text()
    assert "Why points failed or diverged" in html and CRASH in html and status["reason"] in html
    from kilolayer.doctor import diagnose

    para = diagnose(by["failed"].run_dir(out), smoothness_samples=0).paragraph
    assert failed.endswith(para)


def test_report_diagnosis_never_stops_the_report(study, tmp_path):
    """A point the doctor cannot read (damaged metrics.jsonl) is one sentence in the report; a study with no
    failed or diverged point has no such section."""
    spec, points, out, by = study
    from kilolayer.study.runner import Result

    copy = tmp_path / "run"
    import shutil

    shutil.copytree(by["diverged"].run_dir(out), copy)
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    assert len(lines) > 2  # a damaged line before the last is an error (a cut-off last line is not)
    lines[1] = "{damaged"
    (copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    point = by["diverged"]

    class Moved:
        def __init__(self, p):
            self.key, self.config = p.key, p.config

        def run_dir(self, _out):
            return copy

    text = diagnoses([Result(point=Moved(point), status="diverged")], out)[point.key]
    assert text.startswith("The doctor cannot diagnose this run: ") and "metrics.jsonl:2: not a JSON object" in text
    assert "\n" not in text

    ok = [r for r in collect_all(points, out, set()) if r.status == "completed"]
    assert diagnoses(ok, out) == {}
