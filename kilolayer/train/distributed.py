"""Multi-process training on PyTorch's own engine, applied from outside the model.

Under ``torchrun`` (WORLD_SIZE > 1) the process group is gloo on CPU and nccl
on GPU; ``train.parallel`` picks DDP or FSDP2, applied by
:func:`kilolayer.train.parallelize.parallelize`. Full state dicts are gathered
for checkpoints, so a checkpoint is the same safetensors file whatever the
parallelism.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import itertools
import os
import signal
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def die_with_launcher() -> bool:
    """Under torchrun on Linux: have this process get SIGTERM when its launcher dies, however it died (``kill
    -9`` included), so that it saves a checkpoint, records ``interrupted`` and exits instead of training on as an
    orphan that holds the run's lock (torchrun forwards the signals it can catch itself). Returns whether it
    was set (a launcher that dies between reading the parent's PID and setting the signal is caught by reading
    it again)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    launcher = os.getppid()
    try:
        ok = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if ok and os.getppid() != launcher:  # it died between the two reads: the signal will never come
        os.kill(os.getpid(), signal.SIGTERM)
    return ok


_PR_SET_PDEATHSIG = 1

#: the process groups this process has started, one a run
_runs = itertools.count()


def setup(device_choice: str = "auto") -> Dist:
    """Read torchrun's environment, pick the device, start the process group if there is more than one process
    (each then stops with its launcher: :func:`die_with_launcher`). A process may train again once
    :func:`teardown` has destroyed the group, as long as every rank does: the n-th group of each rank meets the
    n-th of the others."""
    die_with_launcher()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        store, _, _ = next(dist.rendezvous("env://"))
        # each run's groups under a key prefix of their own in torchrun's store: destroying the world restarts
        # PyTorch's group numbering, so a second run's groups (FSDP2's mesh) would otherwise read the first's
        # addresses there and connect to ports that closed with it
        store = dist.PrefixStore(f"kilolayer/run{next(_runs)}", store)
        dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world)
        atexit.unregister(_at_exit)  # one entry, however many runs this process makes
        atexit.register(_at_exit)
    return Dist(rank, world, local, device)


#: the device meshes this process made (FSDP2's), whose process groups :func:`teardown` lets go of
_meshes: list = []


def device_mesh(env: Dist):
    """A one-dimensional device mesh over every process, for FSDP2; :func:`teardown` lets go of its group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(env.device.type, (env.world,))
    _meshes.append(mesh)
    return mesh


def teardown(error: BaseException | None = None) -> None:
    """Destroy the process group, and with it the collective library's threads, while Python is whole; call it
    once nothing that trained (an engine, its model) is referenced any more. ``error``: the exception the run
    ends with, if any.

    ``destroy_process_group`` only forgets the group: DDP's reducer, FSDP2's sharded modules and its device mesh
    hold it too, and DTensor's caches hold the mesh for the rest of the process. A group that outlives this call
    keeps gloo's worker threads into the interpreter's finalisation; one that then finishes a collective takes
    the GIL (a future's callback, a tensor's Python object to release), Python ends such a thread with
    ``pthread_exit``, whose unwinding meets a ``noexcept`` destructor, and the process aborts ("terminate called
    without an active exception", exit -6). So the meshes' groups are let go of and the model's reference
    cycles collected here, which destroys the group and joins its threads. An exception's traceback holds the
    frames that trained, and they hold the engine: their variables are let go of (the traceback still prints
    where it was raised, without them), for the exception and those it chains."""
    active = dist.is_initialized() or bool(_meshes)
    if error is not None and active:
        _release_frames(error)
    if dist.is_initialized():
        dist.destroy_process_group()
    for mesh in _meshes:
        getattr(mesh, "_pg_registry", {}).clear()  # the mesh's own references to its groups (torch 2.13)
    _meshes.clear()
    if active:
        gc.collect()  # a module tree is a web of reference cycles: only the collector frees it


def _release_frames(error: BaseException) -> None:
    """Clear the variables of the finished frames in ``error``'s traceback and in those of the exceptions it
    chains (``__cause__``, ``__context__``); frames still running keep theirs."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        todo += [err.__cause__, err.__context__]


def _at_exit() -> None:
    """The last chance before the interpreter finalises (a ``Run`` made directly, an exception nobody caught,
    which Python keeps as ``sys.last_value``): the same teardown."""
    teardown(getattr(sys, "last_value", None))


def unwrap(module: nn.Module) -> nn.Module:
    return (
        module.module
        if hasattr(module, "module") and isinstance(module, nn.parallel.DistributedDataParallel)
        else module
    )


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on CPU. Every rank must call it under FSDP."""
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(unwrap(module), options=_options())
    return {k: v.detach().cpu() for k, v in unwrap(module).state_dict().items()}


def load_model_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(unwrap(module), state, options=StateDictOptions(full_state_dict=True))
    else:
        unwrap(module).load_state_dict(state)


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(unwrap(module), optimizer, options=_options())
    return optimizer.state_dict()


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(unwrap(module), optimizer, state, options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)


def all_sum(t: torch.Tensor, env: Dist) -> torch.Tensor:
    """Sum of a tensor over processes, returned on the CPU."""
    t = t.to(env.device if env.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.cpu()


def all_max(value: int, env: Dist) -> int:
    """Maximum of an integer over processes (itself with one process)."""
    if not env.active:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=env.device if env.device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def from_main(value, env: Dist):
    """Rank 0's ``value`` (any picklable object) on every process: one decision for the whole group."""
    if not env.active:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=env.device if env.device.type == "cuda" else None)
    return box[0]


def barrier(env: Dist) -> None:
    if env.active:
        dist.barrier()
