"""The run directory keeps its promises: one writer at a time, a status on every exit path,
resume semantics as documented, checksummed checkpoints with fallback, and user folders left alone."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import cli
from objective_helpers import tiny_lm

from kilolayer import rundir
from kilolayer.cli import main
from kilolayer.config import dump_yaml, load_config
from kilolayer.errors import KilolayerError
from kilolayer.train import checkpoint as ckpt
from kilolayer.train.checkpoint import load_run
from kilolayer.train.optim import lr_factor
from kilolayer.train.run import Run, train

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "train_harness.py"

LM = tiny_lm(steps=12, batch_size=4, lr=1e-3, warmup=2, log_every=1, checkpoint_every=4)


def cfg_with(**train) -> dict:
    return {**LM, "train": {**LM["train"], **train}}


def write_config(tmp_path: Path, cfg: dict, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(dump_yaml(load_config(cfg)))
    return path


def losses(run: Path, split: str = "train") -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in rundir.read_metrics(run) if r["split"] == split]


def lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in rundir.read_metrics(run) if r["split"] == "train"}


def one_line_error(err: str, *needles: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kilolayer: error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def start_paused(gate: Path, at: int, *args: str) -> subprocess.Popen:
    """`kilolayer train ARGS` paused before step AT + 1 (see tests/train_harness.py); returns once it waits."""
    gate.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(HARNESS), str(gate), str(at), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while not (gate / "waiting").exists():
        if proc.poll() is not None:
            raise AssertionError(f"the harness exited early: {proc.communicate()}")
        assert time.time() < deadline, "the harness never reached its pause"
        time.sleep(0.02)
    return proc


@pytest.fixture(scope="module")
def reference(trained_run) -> dict[int, list]:
    """Uninterrupted in-process runs of LM (12 and 16 steps): their train losses."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {steps: losses(trained_run(cfg_with(steps=steps))) for steps in (12, 16)}
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- one writer at a time


@pytest.mark.slow
@pytest.mark.integration
def test_a_second_writer_is_refused_and_the_first_run_stays_intact(tmp_path, reference, capsys):
    run, gate = tmp_path / "run", tmp_path / "gate"
    cfg = write_config(tmp_path, LM)
    wide = write_config(tmp_path, {**LM, "model": {**LM["model"], "width": 64}}, "wide.yaml")
    first = start_paused(gate, 5, "train", str(cfg), "--out", str(run), "--quiet")
    try:
        st = rundir.read_status(run)
        assert st["status"] == "running" and st["pid"] == first.pid
        # the real command, with another model: refused before it touches anything
        p = cli("train", str(wide), "--out", str(run), "--quiet")
        assert p.returncode == 2
        one_line_error(p.stderr, f"PID {first.pid}", "another kilolayer train")
        # and a resume, in-process (the lock is the other process's, so this is the same check)
        assert main(["train", "--resume", "--out", str(run), "--set", "train.steps=20", "--quiet"]) == 2
        one_line_error(capsys.readouterr().err, f"PID {first.pid}")
        assert rundir.read_status(run)["pid"] == first.pid
    finally:
        (gate / "go").touch()
    assert first.wait(timeout=240) == 0, first.communicate()
    assert losses(run) == reference[12]  # every step once, as if alone
    assert load_config(run / "config.yaml").model.width == 32
    st = rundir.read_status(run)
    assert st["status"] == "completed" and st["pid"] == first.pid
    assert not rundir.is_locked(run)
    train(None, run, resume=True, quiet=True, sets=["train.steps=16"])
    assert losses(run) == reference[16]


# ---------------------------------------------------------------- signals


@pytest.mark.integration
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_at_a_step_boundary_and_resume_is_bit_identical(tmp_path, reference, sig, code):
    run, gate = tmp_path / "run", tmp_path / "gate"
    proc = start_paused(gate, 5, "train", str(write_config(tmp_path, LM)), "--out", str(run), "--quiet")
    proc.send_signal(sig)  # arrives during step 6, which is not a checkpoint step (every 4)
    (gate / "go").touch()
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == code, err
    one_line_error(err, f"interrupted by {sig.name} at step 6", "checkpoint step 6 saved", "--resume")
    st = rundir.read_status(run)
    assert (st["status"], st["step"], st["last_checkpoint"]) == ("interrupted", 6, 6)
    assert sig.name in st["reason"] and st["pid"] == proc.pid
    assert rundir.verify_checkpoint(rundir.checkpoint_dir(run, 6)) is None
    assert train(None, run, resume=True, quiet=True) == {"status": "completed", "step": 12}
    assert losses(run) == reference[12]
    assert [(h["step"], h["changed"]) for h in rundir.read_resume_history(run)] == [(6, {})]


@pytest.mark.integration
def test_a_signal_during_set_up_stops_at_once_and_leaves_nothing(tmp_path):
    run, gate = tmp_path / "run", tmp_path / "gate"
    proc = start_paused(gate, -1, "train", str(write_config(tmp_path, LM)), "--out", str(run), "--quiet")
    assert (run / "train.lock").exists()  # it holds the lock while it sets up
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)  # no need to open the gate: it stops while waiting
    assert proc.returncode == 143, err
    one_line_error(err, "interrupted by SIGTERM before training started")
    assert not run.exists()


# ---------------------------------------------------------------- resume semantics


def test_resume_honours_new_train_values_and_records_them(tmp_path):
    run = tmp_path / "run"
    cfg = cfg_with(steps=6, schedule="constant", warmup=0)
    train(cfg, run, quiet=True)
    assert set(lrs(run).values()) == {1e-3}
    train(None, run, resume=True, quiet=True, sets=["train.lr=0.01", "train.steps=9"])
    assert [lrs(run)[s] for s in (6, 7, 8, 9)] == [1e-3, 0.01, 0.01, 0.01]
    saved = load_config(run / "config.yaml")
    assert (saved.train.lr, saved.train.steps) == (0.01, 9)
    (entry,) = rundir.read_resume_history(run)
    assert entry["step"] == 6 and entry["changed"] == {"train.lr": [1e-3, 0.01], "train.steps": [6, 9]}
    # the higher rate is really used: the same resume at the old rate ends elsewhere
    other = tmp_path / "other"
    train(cfg, other, quiet=True)
    train(None, other, resume=True, quiet=True, sets=["train.steps=9"])
    assert losses(run)[:7] == losses(other)[:7] and losses(run)[7:] != losses(other)[7:]
    # a later plain --resume keeps the values of the last one (config.yaml), and is recorded too
    train(None, run, resume=True, quiet=True, sets=["train.steps=12"])
    assert lrs(run)[12] == 0.01 and rundir.read_status(run)["step"] == 12
    hist = rundir.read_resume_history(run)
    assert [(h["step"], h["changed"]) for h in hist[1:]] == [(9, {"train.steps": [9, 12]})]


def test_resume_cannot_go_back_before_its_step(tmp_path):
    run = tmp_path / "run"
    train(cfg_with(steps=6), run, quiet=True)
    before = (run / "status.json").read_text()
    with pytest.raises(KilolayerError, match=r"train.steps=4: the run is already at step 6"):
        train(None, run, resume=True, quiet=True, sets=["train.steps=4"])
    assert (run / "status.json").read_text() == before  # refused during set-up: nothing changed


@pytest.mark.parametrize("schedule", ["constant", "inverse_sqrt"])
def test_longer_resume_equals_one_run_when_the_schedule_does_not_depend_on_steps(tmp_path, schedule):
    """docs/training.md: `--resume --set train.steps=N2` after an N1-step run = one N2-step run, bit for bit, when
    the learning rate up to N1 does not depend on train.steps (constant, inverse_sqrt)."""
    cfg = cfg_with(schedule=schedule)
    train(cfg, tmp_path / "one", quiet=True)
    train(cfg, tmp_path / "two", quiet=True, sets=["train.steps=5"])
    train(None, tmp_path / "two", resume=True, quiet=True, sets=["train.steps=12"])
    assert losses(tmp_path / "two") == losses(tmp_path / "one")
    assert lrs(tmp_path / "two") == lrs(tmp_path / "one")


def test_longer_cosine_resume_is_replanned_and_differs_from_one_run(tmp_path):
    """docs/training.md: with cosine the lr depends on train.steps, so the resumed run is NOT one long run; from the
    resume step on it follows the cosine planned for the new train.steps."""
    cfg = cfg_with(schedule="cosine")
    train(cfg, tmp_path / "one", quiet=True)
    two = tmp_path / "two"
    train(cfg, two, quiet=True, sets=["train.steps=5"])
    train(None, two, resume=True, quiet=True, sets=["train.steps=12"])
    one_l, two_l = losses(tmp_path / "one"), losses(two)
    # warm-up (2 steps) is the same plan; the update of step 3 already decays differently
    assert two_l[:3] == one_l[:3] and two_l[3] != one_l[3]
    long_tc = load_config(cfg).train
    short_tc = load_config(cfg_with(schedule="cosine", steps=5)).train
    logged = lrs(two)
    assert logged[5] == pytest.approx(1e-3 * lr_factor(5, short_tc))  # the old plan's end (min_lr_ratio 0)
    for s in range(6, 13):
        assert logged[s] == pytest.approx(1e-3 * lr_factor(s, long_tc), rel=1e-12, abs=1e-15), s


# ---------------------------------------------------------------- operating-system errors


@pytest.mark.filterwarnings("error")  # in-process: a warning a real run would print must fail the one-line check
def test_out_that_is_a_file_is_one_line(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert main(["train", str(write_config(tmp_path, LM)), "--out", str(a_file), "--quiet"]) == 2
    one_line_error(capsys.readouterr().err, str(a_file), "is a file")
    assert a_file.read_text() == "mine"


def test_out_under_a_file_is_one_line(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert main(["train", str(write_config(tmp_path, LM)), "--out", str(a_file / "run"), "--quiet"]) == 2
    one_line_error(capsys.readouterr().err, "lies under the file", str(a_file))


def test_read_only_directory_is_one_line(tmp_path, capsys, monkeypatch):
    """Root ignores permission bits, so the refusal of the operating system is simulated at the first
    write into the directory (its lock file)."""
    out = tmp_path / "ro"
    out.mkdir()
    real_open = os.open

    def no_write(path, flags, *rest):
        if str(path).startswith(str(out)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *rest)

    monkeypatch.setattr(os, "open", no_write)
    assert main(["train", str(write_config(tmp_path, LM)), "--out", str(out), "--quiet"]) == 2
    one_line_error(capsys.readouterr().err, str(out / "train.lock"), "Permission denied")
    assert list(out.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits; see the simulated test above")
def test_read_only_directory_for_real(tmp_path, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert main(["train", str(write_config(tmp_path, LM)), "--out", str(out), "--quiet"]) == 2
        one_line_error(capsys.readouterr().err, "Permission denied")
    finally:
        out.chmod(0o755)


def _disk_full_at(monkeypatch, step: int) -> None:
    """safetensors' own error for a full disk, raised when checkpoint ``step`` is written."""
    from safetensors import SafetensorError

    real = ckpt.save_file

    def save_file(tensors, path, *a, **kw):
        if f"step_{step:08d}" in str(path):
            Path(path).write_bytes(b"\0" * 100)  # a partial file, as a full disk leaves
            raise SafetensorError(
                "Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                '"No space left on device" })'
            )
        return real(tensors, path, *a, **kw)

    monkeypatch.setattr(ckpt, "save_file", save_file)


def test_full_disk_during_a_checkpoint_is_failed_and_resumable(tmp_path, capsys, monkeypatch, reference):
    run = tmp_path / "run"
    _disk_full_at(monkeypatch, 8)
    assert main(["train", str(write_config(tmp_path, LM)), "--out", str(run), "--quiet"]) == 2
    line = one_line_error(capsys.readouterr().err, "No space left on device", "step_00000008")
    st = rundir.read_status(run)
    assert (st["status"], st["step"], st["last_checkpoint"]) == ("failed", 8, 4)
    assert "No space left on device" in st["reason"] and st["reason"] in line
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000004"]  # the partial one is gone
    monkeypatch.undo()  # space freed
    assert train(None, run, resume=True, quiet=True)["status"] == "completed"
    assert losses(run) == reference[12]


def test_full_disk_before_any_checkpoint_records_no_checkpoint(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    real = rundir.MetricsFile.append

    def append(self, record):
        if record["step"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        real(self, record)

    monkeypatch.setattr(rundir.MetricsFile, "append", append)
    assert main(["train", str(write_config(tmp_path, LM)), "--out", str(run), "--quiet"]) == 2
    one_line_error(capsys.readouterr().err, "metrics.jsonl", "No space left on device")
    st = rundir.read_status(run)
    assert (st["status"], st["step"]) == ("failed", 3) and "last_checkpoint" not in st


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.integration
def test_a_really_full_small_tmpfs(tmp_path, capsys):
    """A 320 KiB tmpfs holds the config, status and logs but not a checkpoint (about 470 KB)."""
    small = tmp_path / "small"
    if not _tmpfs(small, "320k"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount); the simulated full disk above stands in")
    try:
        run = small / "run"
        assert main(["train", str(write_config(tmp_path, LM)), "--out", str(run), "--quiet"]) == 2
        one_line_error(capsys.readouterr().err, "No space left on device")
        st = rundir.read_status(run)
        assert (st["status"], st["step"]) == ("failed", 4) and "No space left on device" in st["reason"]
        assert rundir.complete_checkpoints(run) == [] and not list((run / "checkpoints").iterdir())
    finally:
        unmounted = subprocess.run(["umount", str(small)], capture_output=True, text=True)
    assert unmounted.returncode == 0, unmounted.stderr  # busy would mean a file left open


# ---------------------------------------------------------------- checksums


def _flip_tensor_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + (len(data) - 8 - header) // 2] ^= 0x10  # inside the tensor data, not the header
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_the_newest_checkpoint_is_detected_with_fallback(tmp_path, capsys, reference, trained_run):
    run = shutil.copytree(
        trained_run(LM), tmp_path / "run"
    )  # checkpoints 8 and 12 kept (train.keep_checkpoints defaults to 2)
    assert [p.name for p in rundir.complete_checkpoints(run)] == ["step_00000008", "step_00000012"]
    assert load_config(LM).train.keep_checkpoints >= 2
    bad = rundir.checkpoint_dir(run, 12) / "model.safetensors"
    _flip_tensor_byte(bad)
    ckpt.read_weights(bad)  # still a well-formed file: only the checksum can tell
    _, task = load_run(run)
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and str(bad) in warning[0] and "step_00000008" in warning[0], warning
    good = ckpt.read_weights(rundir.checkpoint_dir(run, 8) / "model.safetensors")
    assert all(torch.equal(task.state_dict()[k], v) for k, v in good.items())
    assert main(["train", "--resume", "--out", str(run), "--set", "train.steps=16", "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kilolayer: warning: ") and str(bad) in err[0], err
    assert losses(run) == reference[16]  # resumed from step 8, not from the damaged weights
    assert rundir.verify_checkpoint(rundir.checkpoint_dir(run, 12)) is None  # rewritten by the resumed run


def test_every_checkpoint_damaged_is_one_line(tmp_path, capsys, trained_run):
    run = shutil.copytree(trained_run(cfg_with(steps=8)), tmp_path / "run")
    for c in rundir.complete_checkpoints(run):
        _flip_tensor_byte(c / "model.safetensors")
    before = (run / "status.json").read_text()
    assert main(["train", "--resume", "--out", str(run), "--set", "train.steps=12", "--quiet"]) == 2
    one_line_error(capsys.readouterr().err, "step_00000008/model.safetensors", "no intact checkpoint")
    assert (run / "status.json").read_text() == before


def test_checkpoints_without_a_manifest_still_resume(tmp_path, reference, trained_run):
    run = shutil.copytree(trained_run(cfg_with(steps=8)), tmp_path / "run")
    for c in rundir.complete_checkpoints(run):
        (c / "manifest.json").unlink()  # as written before checksums existed
    train(None, run, resume=True, quiet=True, sets=["train.steps=12"])
    assert losses(run) == reference[12]


# ---------------------------------------------------------------- directories that are not runs


def test_a_non_run_directory_is_refused_and_left_alone(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    files = {"metrics.jsonl": "my measurements\n", "status.json": '{"mood": "fine"}\n', "notes.txt": "x"}
    for name, text in files.items():
        (folder / name).write_text(text)
    cfg = str(write_config(tmp_path, LM))
    for extra in ([], ["--overwrite"], ["--resume"]):
        assert main(["train", cfg, "--out", str(folder), "--quiet", *extra]) == 2
        one_line_error(capsys.readouterr().err, str(folder), "not a kilolayer run directory")
    assert {p.name: p.read_text() for p in folder.iterdir()} == files


def test_a_run_without_a_checkpoint_is_replaced_only_with_overwrite(tmp_path, capsys):
    run = tmp_path / "run"
    Run(load_config(LM), run, quiet=True).close()  # set up, then "killed" before its first step
    assert rundir.read_status(run)["status"] == "running" and rundir.complete_checkpoints(run) == []
    (run / "notes.txt").write_text("mine")
    wide = str(write_config(tmp_path, {**LM, "model": {**LM["model"], "width": 64}}))
    assert main(["train", wide, "--out", str(run), "--quiet"]) == 2
    one_line_error(capsys.readouterr().err, "already holds a run (running at step 0)", "--overwrite")
    assert load_config(run / "config.yaml").model.width == 32
    assert main(["train", wide, "--out", str(run), "--quiet", "--resume", "--overwrite"]) == 2
    one_line_error(capsys.readouterr().err, "--resume and --overwrite")
    # --overwrite replaces the run only once the new one has set up: a refused one leaves it as it was
    assert (
        main(
            [
                "train",
                wide,
                "--out",
                str(run),
                "--quiet",
                "--overwrite",
                "--set",
                "data.name=text_bytes",
                "--set",
                f"data.path={tmp_path / 'nope.txt'}",
            ]
        )
        == 2
    )
    one_line_error(capsys.readouterr().err, "nope.txt")
    assert load_config(run / "config.yaml").model.width == 32
    assert main(["train", wide, "--out", str(run), "--quiet", "--overwrite", "--set", "train.steps=2"]) == 0
    assert load_config(run / "config.yaml").model.width == 64
    assert rundir.read_status(run)["status"] == "completed" and (run / "notes.txt").read_text() == "mine"


def test_a_refused_fresh_run_leaves_no_directory(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(KilolayerError, match="nope.txt"):
        train(LM, out, quiet=True, sets=["data.name=text_bytes", f"data.path={tmp_path / 'nope.txt'}"])
    assert not out.exists()


# ---------------------------------------------------------------- the study runner


@pytest.mark.slow
@pytest.mark.integration
def test_study_runner_resumes_failed_and_interrupted_points(tmp_path, forked_points):
    from kilolayer.study.runner import run_point
    from kilolayer.study.spec import expand, load_spec

    spec_file = tmp_path / "spec.yaml"
    base = cfg_with(steps=8, checkpoint_every=2, keep_checkpoints=4)
    spec_file.write_text(
        json.dumps({"name": "tiny", "groups": [{"name": "g", "base": base, "grid": {"model.scheme": ["pre_ln"]}}]})
    )
    (point,) = expand(load_spec(spec_file))
    out = tmp_path / "study"
    run = point.run_dir(out)
    train(point.config, run, quiet=True)
    done = losses(run)

    def crash_at(step: int, status: str, **extra) -> None:
        for c in rundir.complete_checkpoints(run):
            if rundir.checkpoint_step(c) > step:
                shutil.rmtree(c)
        rundir.truncate_metrics(run, step)
        rundir.write_status(run, status, step, "test", **extra)

    crash_at(4, "interrupted", seconds=100.0)  # an earlier attempt that trained for 100 s
    status, took, ran = run_point(point, out, log=lambda *_: None)
    assert (status, ran) == ("completed", True) and losses(run) == done
    assert rundir.read_resume_history(run)[-1]["step"] == 4
    assert rundir.read_status(run)["seconds"] == pytest.approx(100.0 + took)  # the run's time over both attempts
    crash_at(2, "failed")
    assert run_point(point, out, log=lambda *_: None)[:3:2] == ("completed", True) and losses(run) == done
    # a child refused because another process holds the run adds no time to it and writes nothing
    crash_at(2, "interrupted", seconds=100.0)
    with rundir.RunLock(run):
        assert run_point(point, out, log=lambda *_: None)[0] == "interrupted"
    assert rundir.read_status(run)["seconds"] == 100.0
    # a point another process is training: the child is refused, and the runner does not write over it
    crash_at(2, "running", pid=12345)
    with rundir.RunLock(run):
        status, _, ran = run_point(point, out, log=lambda *_: None)
    assert (status, ran) == ("running", True) and rundir.read_status(run)["pid"] == 12345
    log = (out / "logs" / point.group / f"{point.name}.log").read_text()
    assert f"PID {os.getpid()}" in log.strip().splitlines()[-1]


def test_a_run_records_its_own_training_time_over_its_attempts(tmp_path):
    """status.json's ``seconds`` is written by the training process itself, over all the run's attempts: a run
    trained by hand has one, and a study driver killed mid-attempt (its SIGTERM reaches the child, which saves
    and stops) cannot lose that attempt's time, since the child recorded it."""
    run = tmp_path / "run"
    t0 = time.perf_counter()
    train(cfg_with(steps=4, checkpoint_every=2), run, quiet=True)
    first = rundir.read_status(run)["seconds"]
    assert 0 < first < time.perf_counter() - t0
    rundir.write_status(run, "interrupted", 4, "test", seconds=100.0)  # what earlier attempts took
    t1 = time.perf_counter()
    assert train(None, run, resume=True, quiet=True, sets=["train.steps=6"])["status"] == "completed"
    assert 100.0 < rundir.read_status(run)["seconds"] < 100.0 + time.perf_counter() - t1


@pytest.mark.slow
@pytest.mark.integration
def test_ctrl_c_on_a_study_keeps_the_run_time_of_every_attempt(tmp_path):
    """Ctrl-C on a study twice: each time its training process saves and records ``interrupted``, and the
    run's ``seconds`` grows by that attempt's time (the child's own status writes keep the field)."""
    spec_file = tmp_path / "spec.yaml"
    base = cfg_with(steps=4000, checkpoint_every=50, log_every=1, eval_every=0)
    spec_file.write_text(json.dumps({"name": "c", "groups": [{"name": "g", "base": base}]}))
    out = tmp_path / "study"
    run = out / "runs" / "g" / "seed=0"
    cmd = [sys.executable, "-m", "kilolayer", "study", str(spec_file), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    total, step = 0.0, 0
    for _ in range(2):
        # its own session, like a terminal's foreground job: Ctrl-C signals the driver and its training process
        driver = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True
        )
        try:
            deadline = time.time() + 180
            while time.time() < deadline and not any(s >= step + 3 for s, _ in _safe_losses(run)):
                time.sleep(0.5)
            os.killpg(driver.pid, signal.SIGINT)
            driver.wait(timeout=90)
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
        st = rundir.read_status(run)
        assert st["status"] == "interrupted" and st["step"] > step, st
        assert st["seconds"] > total, st  # this attempt's time added to the earlier ones'
        total, step = st["seconds"], st["step"]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_study_driver_stops_its_training_processes(tmp_path, sig):
    """The study driver killed (SIGTERM, or kill -9, which it cannot catch): its training process is not left
    training as an orphan that holds the run's lock; it saves a checkpoint, records ``interrupted``, and the
    next run of the study resumes it to the uninterrupted losses."""
    spec_file = tmp_path / "spec.yaml"
    base = cfg_with(steps=4000, checkpoint_every=50, log_every=1, eval_every=0)
    spec_file.write_text(json.dumps({"name": "k", "groups": [{"name": "g", "base": base}]}))
    out = tmp_path / "study"
    run = out / "runs" / "g" / "seed=0"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --jobs 2: a driver with several threads, each of whose exits Linux answers with the parent-death signal
    cmd = [sys.executable, "-m", "kilolayer", "study", str(spec_file), "--out", str(out), "--jobs", "2"]
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not any(s >= 3 for s, _ in _safe_losses(run)):
            time.sleep(0.5)
        child = rundir.read_status(run).get("pid")
        assert child and child != driver.pid
        driver.send_signal(sig)
        driver.wait(timeout=60)
        deadline = time.time() + 120
        while time.time() < deadline and rundir.read_status(run).get("status") == "running":
            time.sleep(0.5)
        st = rundir.read_status(run)
        assert st["status"] == "interrupted" and st["pid"] == child, st
        # one request to stop, however many times the signal came: the step in hand is finished and saved
        assert st["reason"].startswith("interrupted by SIGTERM at step") and st["last_checkpoint"] == st["step"], st
        with rundir.RunLock(run):  # nobody holds the run any more
            pass
    finally:
        if driver.poll() is None:
            driver.kill()


@pytest.mark.integration
def test_a_killed_fork_server_leaves_each_of_its_points_interrupted_and_resumable(tmp_path):
    """Two points forked from one fork server: kill -9 the server and each point saves its step, records
    ``interrupted`` under its own PID and lets go of its run (no orphan holds it), with an intact checkpoint of
    that step to resume from; the driver carries on to its report."""
    spec_file = tmp_path / "spec.yaml"
    base = cfg_with(steps=4000, checkpoint_every=50, log_every=1, eval_every=0)
    spec_file.write_text(json.dumps({"name": "k", "groups": [{"name": "g", "base": base, "seeds": [0, 1]}]}))
    out = tmp_path / "study"
    runs = [out / "runs" / "g" / f"seed={seed}" for seed in (0, 1)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kilolayer", "study", str(spec_file), "--out", str(out), "--jobs", "2"]
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not all(any(s >= 3 for s, _ in _safe_losses(r)) for r in runs):
            time.sleep(0.5)
        children = [rundir.read_status(r).get("pid") for r in runs]
        servers = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in children}
        (server,) = servers  # both points are forks of one process ...
        assert server != driver.pid  # ... which is not the driver
        os.kill(server, signal.SIGKILL)
        driver.wait(timeout=120)
        assert (out / "report.md").is_file()
        for r, child in zip(runs, children):
            st = rundir.read_status(r)
            assert st["status"] == "interrupted" and st["pid"] == child, st
            assert st["last_checkpoint"] == st["step"] >= 3, st
            assert rundir.checkpoint_step(rundir.intact_checkpoint(r)) == st["step"]
            with rundir.RunLock(r):  # nobody holds the run any more
                pass
    finally:
        if driver.poll() is None:
            driver.kill()


def test_a_repeated_sigterm_is_one_request_but_a_later_one_stops_at_once(monkeypatch):
    from kilolayer.train import signals as loop

    clock = [100.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])
    stop = loop.StopSignals()
    stop.armed = True
    stop._handle(signal.SIGTERM, None)
    stop._handle(signal.SIGTERM, None)  # the same request again (a dying driver's threads)
    assert stop.signum == signal.SIGTERM
    clock[0] += loop.StopSignals.ECHO_S + 0.1
    with pytest.raises(loop.Interrupted, match="second SIGTERM"):
        stop._handle(signal.SIGTERM, None)
    # later, but the parent has died meanwhile (the process was reparented): its death signal, not a request
    parent = [1000]
    monkeypatch.setattr(loop.os, "getppid", lambda: parent[0])
    orphan = loop.StopSignals()
    orphan.armed = True
    orphan._handle(signal.SIGTERM, None)
    clock[0] += 10 * loop.StopSignals.ECHO_S
    parent[0] = 1
    orphan._handle(signal.SIGTERM, None)
    assert orphan.signum == signal.SIGTERM
    ctrl_c = loop.StopSignals()
    ctrl_c.armed = True
    ctrl_c._handle(signal.SIGINT, None)
    with pytest.raises(loop.Interrupted, match="second SIGINT"):  # Ctrl-C twice is always "now"
        ctrl_c._handle(signal.SIGINT, None)


def _safe_losses(run: Path) -> list:
    try:
        return losses(run)
    except (KilolayerError, OSError):
        return []


# ---------------------------------------------------------------- fault injection


@pytest.mark.integration
@pytest.mark.slow
def test_random_kill9_and_resume_reproduce_the_uninterrupted_losses(tmp_path):
    """kill -9 at random moments (during start-up, training, evaluation or a checkpoint save), resume
    each time; the final loss sequence is bit for bit the uninterrupted one, and no lock is left behind. The
    last resume also finds the worst moment's leftover beside the kills' own: a half-written next checkpoint,
    which it removes."""
    cfg = cfg_with(steps=150, checkpoint_every=1, keep_checkpoints=3, eval_every=10)
    train(cfg, tmp_path / "ref", quiet=True)
    ref_train, ref_eval = losses(tmp_path / "ref"), losses(tmp_path / "ref", "eval")
    cfg_file, run = write_config(tmp_path, cfg), tmp_path / "run"
    rng = random.Random(int(os.environ.get("KILOLAYER_FAULT_SEED", "12")))
    kills = 0
    for attempt in range(4):
        args = ["train", str(cfg_file), "--out", str(run), "--quiet"] + (["--resume"] if attempt else [])
        proc = subprocess.Popen(
            [sys.executable, "-m", "kilolayer", *args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if attempt == 2:
            time.sleep(rng.uniform(0.0, 3.0))  # anywhere, start-up included
        else:
            deadline = time.time() + 120  # during training: once this process has set up
            while proc.poll() is None and time.time() < deadline and rundir.read_status(run).get("pid") != proc.pid:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.6))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (0, -signal.SIGKILL), err
        assert not rundir.is_locked(run)  # the kernel dropped the lock with the process
        assert rundir.read_status(run).get("status") in (None, "running", "completed")
    assert kills >= 3
    step = int(rundir.complete_checkpoints(run)[-1].name.split("_")[1])
    assert step < 150, "the last attempt finished: nothing left to resume"
    partial = run / "checkpoints" / f".step_{step + 1:08d}.tmp-999"
    partial.mkdir(exist_ok=True)
    (partial / "model.safetensors").write_bytes(b"\x00" * 10)
    # the last resume runs in this process: what it reads was left by the killed processes
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0
    assert losses(run) == ref_train
    assert losses(run, "eval") == ref_eval
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]
