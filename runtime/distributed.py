"""Start and stop torch.distributed for one training process.

Under torchrun the rank, local rank and world size come from its environment variables (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A plain `python train.py` without them is a world
of one process; it still gets a process group (from an in-memory store, no port) so that DeviceMesh,
DDP and FSDP2 work unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def init_distributed() -> RunContext:
    """Join the process group (NCCL with CUDA, else gloo) and pick this process's device."""
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


def close_distributed() -> None:
    """Leave the process group (safe to call when none was started)."""
    if dist.is_initialized():
        dist.destroy_process_group()
