"""Start and stop torch.distributed for one process of a run.

Under torchrun the rank, local rank and world size come from its environment variables (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A plain `python train.py` without them is a world
of one process; it still gets a process group (from an in-memory store, no port) so that DeviceMesh,
DDP and FSDP2 work unchanged.

A process torchrun started dies with it (die_with_launcher): torchrun starts its workers in sessions of their own, so a
SIGKILL of the launcher's process group would leave them training, and checkpointing beside the next run.

Every program and benchmark runs its work as `run_distributed(work)`: the process group is started, `work(ctx)`
runs, and once it has returned (so that the model, optimizer and engine it built are garbage) the process group
is closed in the one order that lets the interpreter exit cleanly (close_distributed).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from zplan.runtime.launch.torchrun import LAUNCHER_ENV

T = TypeVar("T")


@dataclass(frozen=True)
class RunContext:
    """Where this process sits in the run."""

    rank: int  # global rank, 0 .. world_size - 1
    local_rank: int  # rank on this node; selects the GPU
    world_size: int  # processes in the run
    device: torch.device  # cuda:<local_rank> when CUDA is available, else cpu
    backend: str  # "nccl" or "gloo"

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints and writes logs."""
        return self.rank == 0


def _launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def die_with_launcher(signum: int = signal.SIGKILL) -> bool:
    """Ask Linux to send this process `signum` when its parent, the launcher, dies (prctl PR_SET_PDEATHSIG); and
    when the launcher died already (this process has another parent than the launcher that set ZPLAN_LAUNCHER),
    take it now. SIGKILL: a worker blocked in a collective with peers gone would not act on a gentler one, and the
    locks it holds (runtime/checkpoint/run_lock.py) go with it. True when set; False off Linux."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        return False
    launcher = os.environ.get(LAUNCHER_ENV, "")  # zplan's launcher's pid (runtime/launch/torchrun.py): our parent
    if launcher.isdigit() and os.getppid() != int(launcher):
        os.kill(os.getpid(), signum)
    return True


def init_distributed() -> RunContext:
    """Join the process group (NCCL with CUDA, else gloo) and pick this process's device. A process torchrun
    started dies with it from here on (die_with_launcher)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers
        die_with_launcher()
    if _launched_by_torchrun():
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    else:
        rank, world_size, local_rank = 0, 1, 0
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        if _launched_by_torchrun():
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return RunContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend)


def run_distributed(work: Callable[[RunContext], T]) -> T:
    """init_distributed, `work(ctx)`, then close_distributed. `work` returns None or 0 when this rank finished in
    step with the others (the close then starts with a barrier), another exit status when it did not; when it
    raises, the close has no barrier either (the other ranks may never reach it). Returns what `work` returned."""
    ctx = init_distributed()
    try:
        result = work(ctx)
    except BaseException:
        close_distributed(clean=False)
        raise
    close_distributed(clean=result in (None, 0))
    return result


def close_distributed(*, clean: bool) -> int:
    """Leave the process group; safe to call when none was started. Returns how many of its process groups are
    still alive afterwards (0: every gloo worker thread has been joined; more: a caller still holds a model,
    optimizer or mesh that uses them).

    Call it after everything that runs collectives in the background has stopped (the server's batch worker,
    a delayed optimizer update) and after the objects holding process groups are garbage (run_distributed
    calls it once `work` has returned). In order:
    1. clean: a barrier, so that every rank leaves its last collective together and no rank tears down
       connections a peer still reads from;
    2. destroy_process_group();
    3. clean: drop the references torch's DTensor caches keep to device meshes (and so to process groups),
       then gc.collect(): each ProcessGroupGloo is destroyed here, on the main thread, and its destructor joins
       its worker threads with the GIL released (torch binds ProcessGroup with a destructor that releases it).

    Why step 3: a gloo worker thread that drops a finished collective's work can hold the last reference to a
    tensor whose Python object the main thread has already released; freeing it takes the GIL. When the main
    thread is past this point and into interpreter exit, Python ends any other thread that asks for the GIL
    with pthread_exit, whose unwinding through gloo's worker loop calls std::terminate: "terminate called
    without an active exception", SIGABRT, after all the run's work was done (native backtrace: runLoop ->
    ~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> take_gil -> PyThread_exit_thread). Joined workers
    cannot ask. Without `clean` (an error on this rank) nothing is joined: a worker may still wait on a peer.
    """
    if not dist.is_initialized():
        return 0
    groups = [weakref.ref(group) for group in dist.distributed_c10d._world.pg_map]
    if clean and dist.get_world_size() > 1:
        try:
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()
        except RuntimeError as error:  # a peer already left: nothing to wait for
            print(f"zplan: rank {dist.get_rank()}: another rank left before the final barrier ({error})",
                  file=sys.stderr, flush=True)
            clean = False
    dist.destroy_process_group()
    if clean:
        _drop_cached_meshes()
        gc.collect()
    return sum(group() is not None for group in groups)


def _drop_cached_meshes() -> None:
    """Empty the caches of torch 2.13's DTensor that hold DeviceMesh objects (and through them process groups)
    after every tensor using the mesh is gone: sharding propagation (Python and C++), redistribution planning,
    mesh topology. They refill on the next DTensor operation."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor was made: nothing cached
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
