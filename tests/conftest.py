"""Shared test set-up: the test layers, one torch thread per test, one thread per child process."""

import json
import os
from pathlib import Path

# child processes (CLI, torchrun, Ray) inherit one thread: under `-n 2` they would each take every core
# (and one thread keeps their losses bit-identical to in-process runs); a test may still pass its own env
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import pytest
import torch

# a test with neither marker is a unit test: in-process, seconds at most (`make test-fast` runs only these)
LAYERS = ("integration", "slow")


@pytest.fixture(autouse=True)
def one_thread():
    """The tests use tiny tensors: a second OpenMP thread only adds synchronisation, and on a busy
    machine it costs up to ~100x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def cpu_without_bf16(request, monkeypatch):
    """``train.precision: auto`` decides as on a CPU without bf16 instructions (fp32, nothing timed), so that no
    test's runs, output or time depend on how fast this CPU computes in bf16; tests marked ``bf16_as_is`` see the
    CPU as it is, and tests/test_precision.py constructs the CPUs it needs."""
    if request.node.get_closest_marker("bf16_as_is") is None:
        from kilolayer.train.host import precision

        monkeypatch.setattr(precision, "cpu_bf16", lambda: (False, "avx2"))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """``trained_run(config)``: the run directory of the raw ``config`` trained in-process, once per session and
    distinct config. It is shared: a test that changes it (resume, damage, rewrite) copies it first with
    ``shutil.copytree``. Call it inside a test, where the ``one_thread`` fixture holds."""
    from kilolayer.train.run import train

    runs: dict[str, Path] = {}

    def get(config: dict) -> Path:
        key = json.dumps(config, sort_keys=True)
        if key not in runs:
            run = tmp_path_factory.mktemp("trained") / "run"
            train(config, run, quiet=True)
            runs[key] = run
        return runs[key]

    return get


@pytest.fixture
def forked_points(monkeypatch):
    """Study points trained in-process by ``run_study`` start as forks of the fork server, as under ``kilolayer
    study`` (:mod:`kilolayer.study.executors.forked`), instead of each in a fresh interpreter that imports torch and
    kilolayer again (about 4 CPU-seconds a point): the runner forks only under kilolayer's own command, and pytest
    is this driver. pytest's main module is safe for multiprocessing to import again in each point."""
    from kilolayer.study.executors import forked

    monkeypatch.setattr(forked, "available", lambda: True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test marked neither integration nor slow gets the unit marker (before ``-m`` deselects: tryfirst).

    In ``make test``'s pytest-xdist workers (``--dist loadgroup``): the tests of a module that share a
    module-scoped fixture (a Ray cluster, a benchmark's smoke run, a set of trained runs) go to one worker, so the
    fixture is built once; and the slow tests come first, so that none of them starts last and leaves one worker
    running alone at the end. A plain ``pytest`` run keeps the files' order."""
    for item in items:
        if not any(item.get_closest_marker(name) for name in LAYERS):
            item.add_marker(pytest.mark.unit)
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d and d[-1].scope == "module" for d in defs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
            _name_group(config, item, item.module.__name__)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _name_group(config, item, group: str) -> None:
    """The scheduler of ``--dist loadgroup`` reads a test's group from an ``@group`` suffix of the node id it is
    sent. pytest-xdist 3.8 appends it to ``item._nodeid``, which pytest 9 no longer reads (the node id is
    ``str(item._id)``), so that without this every test would be scheduled alone and each worker would build
    the module fixtures again."""
    if not getattr(config.option, "loadgroup", False) or "@" in item.nodeid or not hasattr(item, "_id"):
        return
    from _pytest.nodeid import NodeId

    item._id = NodeId.parse(f"{item.nodeid}@{group}")
