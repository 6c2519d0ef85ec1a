"""kilolayer.train.distributed.teardown: a run's process group, and gloo's worker threads with it, end before the
interpreter finalises, also when the run ends with an exception whose traceback holds the model."""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback

import pytest
import torch.distributed as dist

from kilolayer.train import distributed as D

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a process's threads are read from /proc")


def gloo_workers() -> int:
    """How many of this process's threads are gloo's collective workers."""
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return names.count("pt_gloo_runloop")


class Sharded:
    """What a sharded model is to its process group: it holds the group, inside reference cycles."""

    def __init__(self):
        self.group = dist.distributed_c10d._get_default_group()
        self.itself = self


@pytest.fixture
def group():
    """A one-process gloo group, as each rank's under torchrun, once its worker threads have named themselves."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deadline = time.monotonic() + 30
    while gloo_workers() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def train_and_fail() -> None:
    model = Sharded()  # noqa: F841 - held by this frame, as a run's frames hold its engine
    raise RuntimeError("diverged")


def test_teardown_after_a_failure_ends_the_group_the_traceback_held(group):
    assert gloo_workers() == 2
    try:
        train_and_fail()
    except RuntimeError as err:
        D.teardown(err)
        assert gloo_workers() == 0
        assert not dist.is_initialized()
        # the traceback still says where it was raised
        assert "train_and_fail" in "".join(traceback.format_exception(err))


def test_without_the_exception_the_traceback_keeps_the_group_and_its_threads(group):
    """Why teardown takes the exception: ``destroy_process_group`` and a collection leave the group to whatever
    holds it, here the failed frame's model (a gloo worker would then outlive Python's finalisation)."""
    try:
        train_and_fail()
    except RuntimeError as err:
        D.teardown()
        assert not dist.is_initialized() and gloo_workers() == 2
        traceback.clear_frames(err.__traceback__)
    gc.collect()
    assert gloo_workers() == 0


def test_teardown_releases_the_frames_of_chained_exceptions(group):
    """A failure turned into another error (an OSError into one line) chains the first, whose frames held the
    model."""
    try:
        try:
            train_and_fail()
        except RuntimeError as first:
            raise ValueError("one line") from first
    except ValueError as err:
        D.teardown(err)
        assert gloo_workers() == 0


def test_at_exit_ends_the_group_an_uncaught_exception_held(group, monkeypatch):
    """The hook that runs before the interpreter finalises: Python keeps an uncaught exception as
    ``sys.last_value``, whose traceback holds the failed run's model."""
    try:
        train_and_fail()
    except RuntimeError as err:
        monkeypatch.setattr(sys, "last_value", err, raising=False)
    D._at_exit()
    assert gloo_workers() == 0 and not dist.is_initialized()
