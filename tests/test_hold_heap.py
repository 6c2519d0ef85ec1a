"""``train.hold_heap`` (kilolayer.train.host.heap.hold_heap): what it asks of glibc, when the trainer asks it,
and that it stops a training step from faulting in the pages of the last one (in fresh interpreters: a
process's allocator settings last for its life)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import cli

from kilolayer.config import load_config
from kilolayer.train.host import heap as H

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"arch": "encoder", "layers": 2, "width": 16, "heads": 2, "ffn": 32, "vocab_size": 16, "max_len": 8}


class FakeLibc:
    def __init__(self, ok: int = 1):
        self.calls: list[tuple[int, int]] = []
        self.ok = ok

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.ok


@pytest.fixture
def libc(monkeypatch):
    fake = FakeLibc()
    monkeypatch.setattr(H, "_glibc", lambda: fake)
    for name in (H.HOLD_ENV, *H._GLIBC_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    return fake


def test_hold_heap_sets_both_thresholds(libc):
    assert H.hold_heap() is True
    # M_MMAP_THRESHOLD (-3) at 32 MiB, M_TRIM_THRESHOLD (-1) at the largest int mallopt takes
    assert libc.calls == [(-3, 32 * 1024 * 1024), (-1, 2**31 - 1)]


def test_hold_heap_reports_a_refusal_once(libc, capsys, monkeypatch):
    monkeypatch.setattr(H, "_WARNED", [False])
    libc.ok = 0  # mallopt returns 0 when it refuses a value
    assert H.hold_heap() is False
    assert capsys.readouterr().err == (
        "kilolayer: warning: train.hold_heap: glibc's mallopt refused the mmap threshold; the heap is not held\n"
    )
    assert H.hold_heap() is False and capsys.readouterr().err == ""  # once a process
    libc.ok = 1
    assert H.hold_heap() is True and capsys.readouterr().err == ""


def test_hold_heap_names_the_threshold_refused(libc, capsys, monkeypatch):
    monkeypatch.setattr(H, "_WARNED", [False])
    monkeypatch.setattr(libc, "mallopt", lambda param, value: int(param == H._M_MMAP_THRESHOLD))
    assert H.hold_heap() is False
    assert "refused the trim threshold (the mmap threshold is set); the heap is not held" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "off", " False ", "no"])
def test_hold_heap_off_by_environment(libc, monkeypatch, value):
    monkeypatch.setenv(H.HOLD_ENV, value)
    assert H.hold_heap() is False
    assert libc.calls == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MALLOC_MMAP_THRESHOLD_", "65536"),
        ("MALLOC_TRIM_THRESHOLD_", "65536"),
        ("MALLOC_TOP_PAD_", "0"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=65536"),
        ("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F:glibc.malloc.mmap_threshold=65536"),
    ],
)
def test_glibcs_own_settings_win(libc, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert H.hold_heap() is False
    assert libc.calls == []


def test_settings_glibc_ignores_do_not_stop_it(libc, monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "")  # empty: glibc ignores it
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F")  # no malloc tunable
    assert H.hold_heap() is True


def test_not_on_other_c_libraries(monkeypatch):
    monkeypatch.setattr(H, "_glibc", lambda: None)
    for name in (H.HOLD_ENV, *H._GLIBC_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert H.hold_heap() is False


def _task(cfg):
    from kilolayer.nn.transformer import build_model

    return SimpleNamespace(backbone=build_model(cfg.model), objective=SimpleNamespace(modules=lambda: iter(())))


@pytest.mark.parametrize(
    ("model", "train", "device", "held"),
    [
        ({}, {}, "cpu", True),  # the default
        ({}, {"hold_heap": False}, "cpu", False),
        ({"checkpoint_activations": True}, {}, "cpu", False),  # the heap trim applies instead
        ({}, {}, "cuda", False),  # a CUDA step's activations are not on the heap
    ],
)
def test_the_trainer_holds_the_heap_on_the_cpu_without_checkpointing(monkeypatch, model, train, device, held):
    calls = []
    monkeypatch.setattr(H, "hold_heap", lambda: calls.append(1) or True)
    cfg = load_config(
        {"model": {**SMALL, **model}, "objective": {"name": "mlm"}, "data": {"name": "synthetic"}, "train": train}
    )
    H.apply(_task(cfg), cfg, torch.device(device))  # as the trainer's engine does
    assert calls == ([1] if held else [])


def test_hold_heap_is_a_boolean():
    assert load_config({"model": SMALL, "objective": {"name": "mlm"}, "data": {"name": "synthetic"}}).train.hold_heap
    with pytest.raises(ValueError, match="hold_heap"):
        load_config(
            {"model": SMALL, "objective": {"name": "mlm"}, "data": {"name": "synthetic"}, "train": {"hold_heap": "x"}}
        )


FAULTS = r"""
import json, os, resource, torch
from kilolayer.train.host import heap as H
from benchmarks.common import EAGER, TrainStep, fixed_batch
from benchmarks.peers import Spec, build
torch.set_num_threads(1)
spec = Spec(arch="decoder", scheme="pre_ln", width=128, layers=6, heads=2, ffn=512, seq_len=128, vocab=256)
torch.manual_seed(0)
step = TrainStep(build("kilolayer", spec), EAGER)
inputs, targets = fixed_batch(spec, 16)

def faults_per_step(hold):  # in a forked child: this process's allocator stays as glibc started it
    if hold:  # after building, as the trainer's engine does
        assert H.hold_heap()
    for _ in range(3):
        step(inputs, targets)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step(inputs, targets)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4

faults = {"hold": [], "default": []}
for mode in ("hold", "default", "hold", "default"):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, json.dumps(faults_per_step(mode == "hold")).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        faults[mode].append(json.loads(pipe.read()))
    assert os.waitpid(pid, 0)[1] == 0
print(json.dumps(faults))
"""


def _faults_per_step() -> dict[str, list[float]]:
    """Minor faults a step in steady state, two forked processes each with the heap held and with glibc's
    default, forked from one interpreter that built the model and never changed its allocator."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != H.HOLD_ENV}
    env.pop("GLIBC_TUNABLES", None)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", FAULTS]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.skipif(H._glibc() is None, reason="needs Linux with glibc")
def test_a_held_heap_reuses_the_last_steps_pages():
    # a step of 6 layers, width 128, batch 16 x 128 tokens frees tens of MB of activations; with glibc's
    # dynamic thresholds the next step faults much of it in again (thousands of faults a step in steady state);
    # held, next to none. Two pairs of processes, summed, so one odd process does not decide.
    faults = _faults_per_step()
    held, default = sum(faults["hold"]), sum(faults["default"])
    if default <= 2000:  # the premise is glibc's, not kilolayer's: here its default kept the pages itself
        pytest.skip(f"glibc's default handed no pages back between steps here (faults a step: {faults})")
    assert held < default / 4, faults


def test_the_held_heap_is_recorded_and_stays_held(libc):
    before = H._HELD[0]
    try:
        H._HELD[0] = False
        libc.ok = 0
        assert H.hold_heap() is False and H.heap_held() is False
        libc.ok = 1
        assert H.hold_heap() is True and H.heap_held() is True
        libc.ok = 0  # a later refusal does not undo what glibc already holds
        assert H.hold_heap() is False and H.heap_held() is True
    finally:
        H._HELD[0] = before


@pytest.mark.integration
def test_a_completed_run_says_whether_its_heap_was_held(tmp_path):
    from objective_helpers import tiny_lm

    from kilolayer import rundir
    from kilolayer.train.run import train

    train(tiny_lm(steps=2, batch_size=2, log_every=1), tmp_path / "run", quiet=True)
    st = rundir.read_status(tmp_path / "run")
    assert st["status"] == "completed" and st["heap_held"] is H.heap_held()
    if H._glibc() is not None and not H._glibc_malloc_settings() and not os.environ.get(H.HOLD_ENV):
        assert st["heap_held"] is True  # the default, on the CPU with nothing checkpointed
    # a fresh process told not to hold it says so (this one's heap may be held for good by now)
    config = tmp_path / "off.yaml"
    config.write_text(json.dumps(tiny_lm(steps=2, batch_size=2, log_every=1, hold_heap=False)))
    env = {k: v for k, v in os.environ.items() if k != H.HOLD_ENV}
    cli("train", config, "--out", tmp_path / "off", "--quiet", check=True, env=env)
    st = rundir.read_status(tmp_path / "off")
    assert st["status"] == "completed" and st["heap_held"] is False
