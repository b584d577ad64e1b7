"""Where this rank's model states are, measured: the compute device, host memory, NVMe files. Printed next to
the plan's placement (plan.prediction.memory: GPU bytes per state, CPU and NVMe bytes per node / GPUs per node).

A tensor counts where its storage is, and only while its storage holds memory (a ZeRO-3 parameter shard
swapped out to a file has a 0-byte storage: runtime.offload.param_swap). The NVMe tier is the bytes in the
swap files (runtime.optim.nvme_states: Adam's moments, and ZeRO-3 parameter shards). On a run without a
GPU the compute device is the host: the device and host tiers are then one memory, reported as "device".
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of `t` (a DTensor's local shard) in memory now: 0 when its storage was freed."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.untyped_storage().nbytes() == 0:
        return 0
    return local.numel() * local.element_size()


def _states(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = list({id(p): p for p in model.parameters()}.values())
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors += [t for t in getattr(optimizer, "host_buffers", lambda: [])()]  # e.g. swapped moments' slots
    return tensors


def nvme_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of model states in this rank's swap files (0 without NVMe offload)."""
    moments, swapper = getattr(optimizer, "moments", None), getattr(optimizer, "param_swapper", None)
    return (moments.file_bytes() if moments is not None else 0) + (swapper.file_bytes if swapper else 0)


def state_bytes_by_tier(model: nn.Module, optimizer: torch.optim.Optimizer,
                        device: torch.device) -> dict[str, int]:
    """{'device', 'host', 'nvme'}: this rank's model-state bytes on each tier now."""
    tiers = {"device": 0, "host": 0, "nvme": nvme_bytes(optimizer)}
    for t in _states(model, optimizer):
        local = t.to_local() if isinstance(t, DTensor) else t
        on_host = local.device.type == "cpu" and device.type != "cpu"
        tiers["host" if on_host else "device"] += resident_bytes(t)
    return tiers


def describe(measured: dict[str, int], predicted: dict[str, float] | None, device: torch.device) -> str:
    """One line: measured bytes per tier, each with the plan's prediction when given."""
    mib = 2**20
    names = {"device": "gpu", "host": "cpu", "nvme": "nvme"}  # the plan's names of the tiers

    def one(tier: str) -> str:
        plan = f" (plan {predicted[names[tier]] / mib:.1f})" if predicted else ""
        return f"{tier} {measured[tier] / mib:.1f} MiB{plan}"

    note = " [no GPU: device and host are one memory]" if device.type == "cpu" else ""
    return "model states per tier: " + ", ".join(one(t) for t in ("device", "host", "nvme")) + note
