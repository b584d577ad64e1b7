"""The total norm of gradients accumulated in fp32, whatever their dtype."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by where they live: plain tensors, and DTensors by mesh and placements (tensor parallel's,
    the experts' over the expert-parallel ranks): torch's norms and foreach ops take one kind at a time."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        key = (id(t.device_mesh), t.placements) if isinstance(t, DTensor) else None
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def _norm_fp32(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The total norm of tensors of one kind (_by_mesh), as below."""
    wide = [t for t in tensors if t.dtype == torch.float32]
    norms = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in tensors if t.dtype != torch.float32]
    if wide:
        norms.append(torch.nn.utils.get_total_norm(wide, norm_type))
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return total.full_tensor() if isinstance(total, DTensor) else total


def total_norm_fp32(tensors: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.get_total_norm with each 16-bit tensor's norm accumulated and returned in fp32: 16-bit gradients
    still multiplied by an fp16 loss scale overflow their own dtype's range (65504) in a norm. fp32 tensors of one
    kind: torch's own result, bit for bit. DTensors: the norm over their meshes (full_tensor), each mesh apart. A
    plain fp32 scalar; 0 for none."""
    groups = _by_mesh(list(tensors))
    if not groups:
        return torch.zeros(())
    norms = [_norm_fp32(group, norm_type) for group in groups]
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_gradients_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over gradients on several meshes (total_norm_fp32): scaled in place by
    min(1, max_norm / (norm + 1e-6)) on the device, nothing read back; max_norm <= 0 or inf: only the norm."""
    params = [p for p in parameters if p.grad is not None]
    total = total_norm_fp32([p.grad for p in params], norm_type)
    if max_norm > 0 and not math.isinf(max_norm):
        scale_gradients_(params, max_norm, total)
    return total


def scale_gradients_(params: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Each gradient times min(1, max_norm / (total + 1e-6)) (torch.nn.utils.clip_grads_with_norm_), on the local
    tensors of DTensors (a plain scalar cannot multiply a DTensor)."""
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    for group in _by_device_and_dtype(grads):
        torch._foreach_mul_(group, coefficient.to(group[0].device, group[0].dtype))


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())
