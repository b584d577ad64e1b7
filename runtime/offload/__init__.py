"""Offload of model states off the GPU: ZeRO-Offload's CPU AdamW (cpu_adam_optimizer.py for ZeRO-1's rows,
sharded_cpu_adam.py for FSDP2's ZeRO 2/3 shards kept on the device), and ZeRO-Infinity's swapping engine
(nvme.py), swapped Adam moments (swapped_moments.py, nvme_optimizer.py) and swapped ZeRO-3 parameters
(param_swap.py)."""

from zplan.errors import SwapError
from zplan.runtime.offload.nvme import (
    ALIGN_BYTES,
    SwapEngine,
    SwapRecord,
    aligned_empty,
    aligned_tensor,
    check_space,
    remove_stale_folders,
)

__all__ = ["ALIGN_BYTES", "SwapEngine", "SwapError", "SwapRecord", "aligned_empty", "aligned_tensor", "check_space",
           "remove_stale_folders"]
