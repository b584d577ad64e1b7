"""Offload of model states off the GPU: the NVMe swapping engine (ZeRO-Infinity) lives in nvme.py."""

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
