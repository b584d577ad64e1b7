"""Offload of model states off the GPU: ZeRO-Infinity's swapping engine (nvme.py) and swapped ZeRO-3 parameters
(param_swap.py). The optimizers that keep their states on the host or on NVMe are in runtime/optim/."""

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
