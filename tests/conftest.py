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
