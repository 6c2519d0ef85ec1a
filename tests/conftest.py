"""Shared test set-up."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The tests use tiny tensors: a second OpenMP thread only adds synchronisation, and on a busy
    machine it costs up to ~100x. Subprocesses (CLI, torchrun) keep their own defaults."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """In ``make test``'s pytest-xdist workers (``--dist loadgroup``): the tests of a module that share a
    module-scoped fixture (a Ray cluster, a benchmark's smoke run, a set of trained runs) go to one worker, so the
    fixture is built once; and the slow tests come first, so that none of them starts last and leaves one worker
    running alone at the end. A plain ``pytest`` run keeps the files' order."""
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d and d[-1].scope == "module" for d in defs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
