"""Cases an adversarial review of the run directory found after the reliability work, each now answered."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kilolayer import rundir
from kilolayer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_a_folder_with_someone_elses_config_and_metrics_is_not_a_run(tmp_path):
    folder = tmp_path / "mine"
    (folder / "analysis").mkdir(parents=True)
    (folder / "config.yaml").write_text("lr: 3\n")
    (folder / "metrics.jsonl").write_text("epoch,loss\n")
    (folder / "analysis" / "report.txt").write_text("important\n")
    assert not rundir.is_run_dir(folder)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kilolayer",
            "train",
            "configs/stdlib_gpt.yaml",
            "--out",
            str(folder),
            "--overwrite",
            "--set",
            "train.steps=1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 2 and "not a kilolayer run directory" in p.stderr and len(p.stderr.splitlines()) == 1
    assert (folder / "analysis" / "report.txt").read_text() == "important\n"
    assert (folder / "config.yaml").read_text() == "lr: 3\n" and (
        folder / "metrics.jsonl"
    ).read_text() == "epoch,loss\n"


def test_a_loadable_config_beside_foreign_metrics_is_not_a_run(tmp_path):
    folder = tmp_path / "half"
    folder.mkdir()
    (folder / "config.yaml").write_text((ROOT / "configs/stdlib_gpt.yaml").read_text())
    (folder / "metrics.jsonl").write_text('{"mine": 1}\n')
    assert not rundir.is_run_dir(folder)
    (folder / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 2.0}\n')
    assert rundir.is_run_dir(folder)  # a run written before status.json existed


def test_final_status_is_written_in_place_on_a_full_disk(tmp_path, monkeypatch):
    rundir.write_status(tmp_path, "running", 3, "", pid=1)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir, "write_atomic", full)
    rundir.write_status(tmp_path, "failed", 7, "metrics.jsonl: No space left on device")
    assert rundir.read_status(tmp_path) == {
        "status": "failed",
        "step": 7,
        "reason": "metrics.jsonl: No space left on device",
    }
    with pytest.raises(OSError):  # with no status file to reuse, the error is the caller's to report
        rundir.write_status(tmp_path / "none", "failed", 1, "x")


@pytest.mark.parametrize(
    "href",
    ["javascript&#58;alert(1)", "&#106;avascript:alert(1)", "java&#x09;script:alert(1)", "javascript&colon;alert(1)"],
)
def test_entity_encoded_javascript_links_are_not_links(tmp_path, href):
    from kilolayer.study.report import render_html

    page = render_html(f"# t\n\n[a]({href}) and [b](https://example.org)\n", tmp_path)
    assert "<a>a</a>" in page  # the link lost its href
    assert 'href="https://example.org"' in page and page.count("href=") == 1


@pytest.mark.parametrize(
    "value, needle",
    [
        ("train.betas=[1.5,0.9]", "train.betas.0=1.5"),
        ("train.weight_decay=inf", "train.weight_decay"),
        ("train.eps=nan", "train.eps"),
    ],
)
def test_optimizer_numbers_are_validated(value, needle):
    p = subprocess.run(
        [sys.executable, "-m", "kilolayer", "describe", "configs/stdlib_gpt.yaml", "--set", value],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1


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
