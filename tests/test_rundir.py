"""kilolayer.rundir: what a run directory is, its status file, metrics, checksums and lock."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT

from kilolayer import rundir
from kilolayer.cli import main
from kilolayer.errors import ConfigError, InputError
from kilolayer.rundir import RunDirError, RunLock, RunLocked


def test_status_round_trip_and_lifecycle(tmp_path):
    assert rundir.read_status(tmp_path) == {}
    (tmp_path / rundir.STATUS).write_text("{not json")
    assert rundir.read_status(tmp_path) == {}  # a torn or foreign file reads as no status
    life = rundir.Lifecycle(tmp_path)
    life.running(0)
    st = rundir.read_status(tmp_path)
    assert st["status"] == "running" and st["pid"] == os.getpid() and st["host"] and st["started"]
    assert life.finish("failed", 3, "disk\nfull")
    st = rundir.read_status(tmp_path)
    assert st["status"] == "failed" and st["step"] == 3 and st["reason"] == "disk full"
    assert "last_checkpoint" not in st  # there is none
    rundir.checkpoint_dir(tmp_path, 2).mkdir(parents=True)
    (rundir.checkpoint_dir(tmp_path, 2) / rundir.COMPLETE).write_text("2")
    life.finish("interrupted", 3, "SIGTERM")
    assert rundir.read_status(tmp_path)["last_checkpoint"] == 2
    assert rundir.update_status(tmp_path, seconds=1.5)["status"] == "interrupted"
    assert not list(tmp_path.glob(".status.*.tmp"))
    with pytest.raises(ValueError, match="expected one of"):
        rundir.write_status(tmp_path, "done", 1)


def test_what_counts_as_a_run_directory(tmp_path):
    assert not rundir.is_run_dir(tmp_path / "missing") and rundir.is_empty(tmp_path / "missing")
    user = tmp_path / "user"
    user.mkdir()
    (user / "status.json").write_text('{"mine": true}')
    (user / "metrics.jsonl").write_text("my data\n")
    assert not rundir.is_run_dir(user)
    with pytest.raises(RunDirError, match="not empty and not a kilolayer run directory"):
        rundir.check_out(user)
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.LOCK).write_text("1 host\n")
    assert rundir.is_empty(run)  # only a lock file left by a process that stopped before writing
    rundir.check_out(run)
    rundir.write_status(run, "running", 0)
    assert rundir.is_run_dir(run)
    old = tmp_path / "old"  # a run from before status.json was written at the start
    old.mkdir()
    (old / "config.yaml").write_text("model: {}\n")
    (old / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 2.0}\n')  # records of ours
    assert rundir.is_run_dir(old)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        rundir.check_out(a_file)
    with pytest.raises(RunDirError, match="lies under the file"):
        rundir.check_out(a_file / "run" / "deeper")


def test_clear_run_removes_only_what_a_run_writes(tmp_path):
    for name in ("config.yaml", "status.json", "metrics.jsonl", "resume.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    rundir.clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_metrics_reader_skips_a_cut_last_line_and_names_a_bad_one(tmp_path):
    assert rundir.read_metrics(tmp_path) == []
    m = rundir.MetricsFile(tmp_path)
    m.append({"step": 1, "split": "train", "loss": float("nan")})
    m.append({"step": 2, "split": "train", "loss": 2.0})
    m.close()
    with open(tmp_path / rundir.METRICS, "a") as f:
        f.write('{"step": 3, "spl')  # killed mid-write
    recs = rundir.read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2] and recs[0]["loss"] == "nan"
    rundir.truncate_metrics(tmp_path, 1)
    assert (tmp_path / rundir.METRICS).read_text() == '{"step": 1, "split": "train", "loss": "nan"}\n'
    (tmp_path / rundir.METRICS).write_text('{"step": 1}\ngarbage\n{"step": 2}\n')
    with pytest.raises(InputError, match=r"metrics.jsonl:2: not a JSON object"):
        rundir.read_metrics(tmp_path / rundir.METRICS)


def _checkpoint(run, step: int, payload: bytes):
    d = rundir.checkpoint_dir(run, step)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(payload)
    rundir.write_manifest(d)
    (d / rundir.COMPLETE).write_text(str(step))
    return d


def test_manifest_detects_a_flipped_byte_and_falls_back(tmp_path):
    first = _checkpoint(tmp_path, 4, b"a" * 1000)
    second = _checkpoint(tmp_path, 8, b"b" * 1000)
    manifest = json.loads((second / rundir.MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["bytes"] == 1000
    assert rundir.verify_checkpoint(second) is None
    data = bytearray((second / "model.safetensors").read_bytes())
    data[500] ^= 0x01
    (second / "model.safetensors").write_bytes(bytes(data))
    problem = rundir.verify_checkpoint(second)
    assert "step_00000008/model.safetensors" in problem and "SHA-256" in problem
    warnings = []
    assert rundir.intact_checkpoint(tmp_path, on_damaged=warnings.append) == first
    assert len(warnings) == 1 and "step_00000008/model.safetensors" in warnings[0] and "step_00000004" in warnings[0]
    (first / "model.safetensors").write_bytes(b"a" * 10)
    with pytest.raises(InputError, match=r"step_00000008/model.safetensors.*no intact checkpoint"):
        rundir.intact_checkpoint(tmp_path)
    assert "truncated" in rundir.verify_checkpoint(first)


def test_a_checkpoint_without_manifest_is_accepted(tmp_path):
    d = _checkpoint(tmp_path, 1, b"x")
    (d / rundir.MANIFEST).unlink()
    assert rundir.verify_checkpoint(d) is None and rundir.intact_checkpoint(tmp_path) == d


def test_lock_is_exclusive_and_names_its_holder(tmp_path):
    with RunLock(tmp_path):
        assert rundir.is_locked(tmp_path)
        with pytest.raises(RunLocked, match=rf"another kilolayer train \(PID {os.getpid()} on "):
            RunLock(tmp_path).acquire()
    assert not rundir.is_locked(tmp_path)
    RunLock(tmp_path).acquire().release()


@pytest.mark.integration
def test_lock_dies_with_a_killed_process(tmp_path):
    code = (
        "import sys, time; from kilolayer.rundir import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=f"PID {proc.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 10
    while rundir.is_locked(tmp_path) and time.time() < deadline:
        time.sleep(0.05)
    assert not rundir.is_locked(tmp_path)  # no stale lock, although the file is still there
    assert (tmp_path / rundir.LOCK).exists()


def test_resume_history(tmp_path):
    rundir.record_resume(tmp_path, 6, {"train.lr": [0.001, 0.01]})
    rundir.record_resume(tmp_path, 9, {})
    hist = rundir.read_resume_history(tmp_path)
    assert [h["step"] for h in hist] == [6, 9] and hist[0]["changed"] == {"train.lr": [0.001, 0.01]}
    assert hist[0]["time"]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0", "-1e-3"])
def test_lr_must_be_finite_and_positive(value):
    from kilolayer.config import load_config

    with pytest.raises(ConfigError, match=r"^train\.lr="):
        load_config({}, [f"train.lr={value}"])


def test_a_run_dir_answers_what_its_readers_ask(tmp_path):
    from kilolayer.config import dump_yaml, load_config

    run = rundir.RunDir(tmp_path / "run")
    assert (run.status, run.state, run.finished, run.step, run.seconds, run.status_time) == ({}, None, False, 0, 0.0, 0)
    assert run.checkpoint() is None and run.init_from is None and run.metrics() == []
    assert run.mark_failed("not started: its source is running")  # makes the directory
    assert (run.state, run.step, run.status["reason"]) == ("failed", 0, "not started: its source is running")
    (run.path / rundir.CONFIG).write_text(dump_yaml(load_config(None, ["train.patience=2"])))
    for step in (4, 8):  # early stopping: the newest checkpoint names step 4 as the best
        d = rundir.checkpoint_dir(run.path, step)
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(bytes([step]) * 100)
        (d / "state.json").write_text(json.dumps({"trainer": {"best_step": 4, "init_from": {"path": "p", "step": 3}}}))
        rundir.write_manifest(d)
        (d / rundir.COMPLETE).write_text(str(step))
    rundir.write_status(run.path, "completed", 8, seconds=12.5)
    (run.path / rundir.METRICS).write_text(
        "".join(json.dumps({"step": s, "split": "eval", "loss": s / 10}) + "\n" for s in (4, 8))
    )
    assert (run.state, run.finished, run.step, run.seconds) == ("completed", True, 8, 12.5)
    assert run.checkpoint() == rundir.checkpoint_dir(run.path, 4)  # the best, under the run's own patience
    assert run.final_eval(run.metrics()) == {"step": 4, "split": "eval", "loss": 0.4}
    assert run.init_from == {"path": "p", "step": 3}  # from the checkpoint's trainer state
    assert not run.mark_failed("crashed") and run.state == "completed"  # a finished run's result stands
    assert run.record_seconds(20.0) and run.seconds == 20.0 and run.state == "completed"
    assert run.status_time == pytest.approx(time.time(), abs=60)
    with RunLock(run.path):  # a training process holds it: its status is its own
        assert run.locked
        assert not run.mark_failed("Ray task: lost", keep=()) and not run.record_seconds(1.0)
    assert not run.locked and run.seconds == 20.0
    assert run.mark_failed("Ray task: lost", keep=()) and (run.state, run.step) == ("failed", 8)


def test_a_folder_with_someone_elses_config_and_metrics_is_not_a_run(tmp_path, capsys):
    folder = tmp_path / "mine"
    (folder / "analysis").mkdir(parents=True)
    (folder / "config.yaml").write_text("lr: 3\n")
    (folder / "metrics.jsonl").write_text("epoch,loss\n")
    (folder / "analysis" / "report.txt").write_text("important\n")
    assert not rundir.is_run_dir(folder)
    rc = main(
        ["train", str(ROOT / "configs/stdlib_gpt.yaml"), "--out", str(folder), "--overwrite", "--set", "train.steps=1"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "not a kilolayer run directory" in err and len(err.splitlines()) == 1
    assert (folder / "analysis" / "report.txt").read_text() == "important\n"
    assert (folder / "config.yaml").read_text() == "lr: 3\n" and (
        folder / "metrics.jsonl"
    ).read_text() == "epoch,loss\n"


def test_a_loadable_config_beside_foreign_metrics_is_not_a_run(tmp_path):
    folder = tmp_path / "half"
    folder.mkdir()
    (folder / "config.yaml").write_text((ROOT / "configs" / "stdlib_gpt.yaml").read_text())
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


def test_an_analysis_result_is_not_read_while_the_attempt_to_measure_it_again_stands_failed(tmp_path):
    """A study that re-measures an analysis (new version, data or checkpoint) and fails leaves the old result on
    disk beside ``error.txt``: the report must not read the out-of-date numbers as current."""
    result = rundir.analysis_file(tmp_path, "smoothness")
    result.parent.mkdir(parents=True)
    result.write_text(json.dumps({"cosine": [0.5, 0.9]}))
    assert rundir.read_analysis(tmp_path, "smoothness") == {"cosine": [0.5, 0.9]}
    rundir.analysis_error_file(tmp_path, "smoothness").write_text("RuntimeError: boom\n")
    assert rundir.read_analysis(tmp_path, "smoothness") is None
    rundir.analysis_error_file(tmp_path, "smoothness").unlink()
    assert rundir.read_analysis(tmp_path, "smoothness") == {"cosine": [0.5, 0.9]}
