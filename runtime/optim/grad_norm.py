"""The total norm of gradients accumulated in fp32, whatever their dtype."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def total_norm_fp32(tensors: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.get_total_norm with each 16-bit tensor's norm accumulated and returned in fp32: 16-bit gradients
    still multiplied by an fp16 loss scale overflow their own dtype's range (65504) in a norm. fp32 tensors: torch's
    own result, bit for bit. DTensors: the norm over their meshes (full_tensor). A plain fp32 scalar; 0 for none."""
    tensors = list(tensors)
    wide = [t for t in tensors if t.dtype == torch.float32]
    norms = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in tensors if t.dtype != torch.float32]
    if wide:
        norms.append(torch.nn.utils.get_total_norm(wide, norm_type))
    if not norms:
        return torch.zeros(())
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return total.full_tensor() if isinstance(total, DTensor) else total
