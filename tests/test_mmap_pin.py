"""``train.pin_mmap``: activation checkpointing pins glibc's mmap threshold
(kilolayer.train.host.heap.pin_mmap_threshold); off by default, since it slows each step (docs in config).

glibc has no getter for the threshold, so each check reproduces what the pin prevents: a 16 MiB block is
mapped and freed, which makes glibc's dynamic threshold rise to 16 MiB; a 4 MiB block then comes from the heap
(``mallinfo2().hblks``, the blocks served by their own mapping, stays put) unless the threshold is pinned, when
it is mapped (hblks goes up by one). Each case runs in a process of its own, since the setting is process-wide:
forked from an interpreter that has imported torch and never set it, and a fresh interpreter for each value of
glibc's environment variable, which glibc reads at start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import ctypes, ctypes.util, json, os, sys
import torch
from kilolayer.config import ModelConfig
from kilolayer.nn.transformer import build_model
from kilolayer.train.host.heap import prepare_checkpointing
from kilolayer.train.parallelize import checkpoint_layers

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def after_a_big_free():
    libc.free(libc.malloc(16 << 20))
    before = libc.mallinfo2().hblks
    p = libc.malloc(4 << 20)
    mapped = libc.mallinfo2().hblks - before
    libc.free(p)
    return mapped

def probe(mode):
    model = build_model(ModelConfig(arch="encoder", layers=2, width=16, heads=2, ffn=32))
    if mode == "checkpoint":
        checkpoint_layers(model, prepare_checkpointing())
    elif mode == "checkpoint_pinned":
        checkpoint_layers(model, prepare_checkpointing(pin_mmap=True))
    elif mode == "config_pinned":
        from types import SimpleNamespace
        from kilolayer.config import load_config
        from kilolayer.train.host.heap import apply
        from kilolayer.train.parallelize import apply_checkpointing
        cfg = load_config({"model": {"arch": "encoder", "layers": 2, "width": 16, "heads": 2, "ffn": 32,
                                     "checkpoint_activations": True, "vocab_size": 16, "max_len": 8},
                           "objective": {"name": "mlm"}, "data": {"name": "synthetic"},
                           "train": {"pin_mmap": True}})
        task = SimpleNamespace(backbone=model, objective=SimpleNamespace(modules=lambda: iter(())))
        apply_checkpointing(task, cfg, apply(task, cfg, "cpu"))
    return after_a_big_free()

mapped = []
for mode, env in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.environ.update(env)  # KILOLAYER_PIN_MMAP, read when the pin is asked for
        os.write(write, json.dumps(probe(mode)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        mapped.append(json.loads(pipe.read()))
    assert os.waitpid(pid, 0)[1] == 0
print(json.dumps(mapped))
"""


def _glibc() -> bool:
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2  # noqa: B018 - glibc >= 2.33
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


pytestmark = pytest.mark.skipif(not _glibc(), reason="needs Linux with glibc >= 2.33")


def _probe(*cases: tuple[str, dict], malloc_env: dict | None = None) -> list[int]:
    """Blocks mapped after a big free, for each (mode, KILOLAYER_PIN_MMAP setting) of ``cases``: each in a process
    forked from one interpreter started with glibc's environment ``malloc_env``."""
    full = {k: v for k, v in os.environ.items() if k not in ("KILOLAYER_PIN_MMAP", "MALLOC_MMAP_THRESHOLD_")}
    full.update(malloc_env or {}, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", PROBE, json.dumps(cases)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=full, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


PIN = {"KILOLAYER_PIN_MMAP": "1"}
NO_PIN = {"KILOLAYER_PIN_MMAP": "0"}


@pytest.mark.integration
def test_checkpointing_pins_the_threshold_only_when_asked():
    cases = [("plain", {}), ("checkpoint", {}), ("checkpoint_pinned", {}), ("config_pinned", {})]
    cases.append(("checkpoint", PIN))
    # the default (checkpoint): glibc's dynamic threshold, faster steps; config_pinned: train.pin_mmap, as the
    # trainer's engine applies it
    assert _probe(*cases) == [0, 0, 1, 1, 1]


@pytest.mark.integration
def test_the_pin_can_be_turned_off_and_glibc_setting_wins():
    assert _probe(("checkpoint_pinned", NO_PIN)) == [0]
    # the user's own glibc setting is left as it is (here one that maps nothing below 8 MiB)
    assert _probe(("checkpoint_pinned", {}), malloc_env={"MALLOC_MMAP_THRESHOLD_": str(8 << 20)}) == [0]
    assert _probe(("plain", {}), malloc_env={"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}) == [1]


def test_pin_reports_whether_it_took_effect(monkeypatch):
    from kilolayer.train.host import heap as H

    monkeypatch.setenv("KILOLAYER_PIN_MMAP", "0")
    assert H.pin_mmap_threshold() is False
    monkeypatch.delenv("KILOLAYER_PIN_MMAP")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert H.pin_mmap_threshold() is False
