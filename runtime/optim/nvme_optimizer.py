"""ZeRO-Infinity's optimizer offload (Rajbhandari et al. SC'21): AdamW whose moments live in files on NVMe
(runtime.optim.swapped_moments), swapped in per sub-group during the step and stepped there by zplan's
CPU AdamW kernel (zplan.cuda.cpu_adam).

Two optimizers, one per way the runtime shards a parameter:
  - NvmeZeroOneAdamW (ZeRO-1): runtime.optim.zero1.ZeroOneAdamW, this rank's rows of every parameter (of its
    tp-local tensor under tensor parallel); the updated rows are all-gathered as there.
  - NvmeShardedAdamW (ZeRO-2/3): FSDP2's parameters are this rank's shards already (DTensor, local tensor on
    the host under CPUOffloadPolicy, on the device when the placement keeps the parameters there); each local
    tensor is stepped whole.
The master weights: an fp32 parameter is its own (FSDP2's shards, fp32 ZeRO-1), updated in place, staged through host
memory sub-group by sub-group when it is on a GPU; a 16-bit parameter (ZeRO-1 with mixed precision: runtime.optim.zero1)
has an fp32 master of its rows in host memory (pinned with a GPU), stepped there and rounded into the parameter's
rows. What is in files: exp_avg and exp_avg_sq, 8 bytes per updated parameter. The step count is a host scalar per
parameter.

State dict: the same layout as torch.optim.AdamW over these parameters (ZeRO-1: runtime.optim.zero1's DTensor
rows), so checkpoints reshard into and out of every other plan. state_dict() reads the moments back from
the files into new host tensors (this rank's whole optimizer state, in host memory while a checkpoint is
written); load_state_dict() writes them out again. Between steps only the step counts are in self.state.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zplan.errors import SwapError
from zplan.runtime.offload.nvme import SwapEngine
from zplan.runtime.optim.cpu_adam_optimizer import _host_dtensor, host_dtensor_on
from zplan.runtime.optim.swapped_moments import SwappedMoments
from zplan.runtime.optim.zero1 import ZeroOneAdamW, _local, is_16bit

_MOMENTS = ("exp_avg", "exp_avg_sq")
DEFAULT_SUB_GROUP_BYTES = 64 * 2**20  # moments per sub-group (both): 8M parameters, one 64 MiB read and write


def _rank_folder(nvme_path: str | os.PathLike) -> Path:
    rank = os.environ.get("RANK", "0")
    return Path(nvme_path) / f"rank{rank}"


def _between_steps(step: torch.Tensor) -> dict:
    """A parameter's state between steps: its step count, and the moments' keys with empty tensors (the moments
    are in files; torch.distributed.checkpoint's loader takes the state names from optimizer.state[param])."""
    return {"step": step, "exp_avg": torch.empty(0), "exp_avg_sq": torch.empty(0)}


class _SwappedAdamW:
    """What both optimizers share: the segments (this rank's flat fp32 views), the swapped moments, the step
    over sub-groups, and the state dict. The class using it provides _segment(p) and _state_tensor(p, local)."""

    def _setup_swap(self, nvme_path: str | os.PathLike | None, sub_group_bytes: int, threads: int,
                    swap_parameters_of: nn.Module | None = None) -> None:
        if not nvme_path:
            raise SwapError("NVMe offload needs a folder for the swap files: pass --nvme-path DIR (a local NVMe "
                            "drive; it must hold this rank's optimizer states, 8 bytes per parameter it updates)")
        self._threads = threads
        self._params = [p for group in self.param_groups for p in group["params"]]
        self.swap = SwapEngine(_rank_folder(nvme_path))
        self.param_swapper, segment_groups = None, None
        if swap_parameters_of is not None:  # ZeRO-3 parameters in files too: one sub-group per FSDP unit
            from torch.distributed.fsdp import FSDPModule

            from zplan.runtime.offload.param_swap import ParameterSwapper

            units = [m for m in swap_parameters_of.modules() if isinstance(m, FSDPModule)]  # root first, as run
            self.param_swapper = ParameterSwapper(self.swap, swap_parameters_of, units)
            unit_of = self.param_swapper.unit_of
            self._params.sort(key=lambda p: unit_of[id(p)].index)
            segment_groups = [[i for i, p in enumerate(self._params) if unit_of[id(p)] is unit]
                              for unit in self.param_swapper.units]
        numels = [self._segment(p).numel() for p in self._params]
        self.moments = SwappedMoments(self.swap, numels, max(1, sub_group_bytes // 8), segment_groups=segment_groups)
        needed = self.moments.state_bytes + (self.param_swapper.file_bytes if self.param_swapper else 0)
        self.swap.check_space(needed)  # before training starts, not when the disk fills up
        for p in self._params:
            self.state[p] = _between_steps(torch.zeros((), dtype=torch.float32))
        self.last_backend: str | None = None

    def _segment(self, p: torch.Tensor) -> torch.Tensor:  # this rank's elements of p's master: a flat fp32 view
        raise NotImplementedError

    def _rounded_segment(self, p: torch.Tensor) -> torch.Tensor | None:  # a 16-bit p's elements (flat), else None
        return None

    def _state_tensor(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:  # a moment in the dict layout
        raise NotImplementedError

    def _owned_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        raise NotImplementedError

    # ---- the step ----------------------------------------------------------------------------------

    def _swapped_adamw_step(self) -> None:
        from zplan.cuda.cpu_adam import adamw_step_

        group_of = {p: group for group in self.param_groups for p in group["params"]}  # load_state_dict renews them
        stepped = [p for p in self._params if p.grad is not None]  # as torch's AdamW: no gradient, no step
        for p in stepped:
            self.state[p]["step"] += 1
        stepped = set(stepped)

        swapper = self.param_swapper

        def update(pieces, exp_avg, exp_avg_sq) -> bool:
            if swapper is not None:  # this sub-group is one unit: its parameters in memory, the next one's read
                unit = swapper.unit_of[id(self._params[pieces[0].segment])]
                swapper.for_update(unit)
                ahead = swapper.neighbour(unit, forward=True)
                if ahead is not None:
                    swapper.prefetch(ahead)
            calls: dict[tuple[int, int], tuple[list, list, list, list, list]] = {}
            for piece in pieces:
                p = self._params[piece.segment]
                if p not in stepped:
                    continue
                n = piece.stop - piece.start
                master = self._segment(p)[piece.start:piece.stop]
                grad = self._segment_grad(p)[piece.start:piece.stop].to("cpu", torch.float32)
                rounded = self._rounded_segment(p)  # a 16-bit parameter's rows, written from its master
                if rounded is not None and self.grad_divisor is not None:
                    grad.div_(float(self.grad_divisor))  # loss scale x clipping (runtime.optim.zero1)
                host = master if master.device.type == "cpu" else master.to("cpu")  # staged from the GPU
                copies = [(master, host)] + ([] if rounded is None else [(rounded[piece.start:piece.stop], host)])
                key = (id(group_of[p]), int(self.state[p]["step"].item()))
                lists = calls.setdefault(key, ([], [], [], [], []))
                for target, value in zip(lists, (host, grad, exp_avg[piece.offset:piece.offset + n],
                                                 exp_avg_sq[piece.offset:piece.offset + n], copies), strict=True):
                    target.append(value)
            groups = {id(g): g for g in self.param_groups}
            for (group_id, step), (masters, grads, exp_avgs, exp_avg_sqs, write_back) in calls.items():
                group = groups[group_id]
                beta1, beta2 = group["betas"]
                self.last_backend = adamw_step_(
                    masters, grads, exp_avgs, exp_avg_sqs, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"], step=step, threads=self._threads)
                for target, host in (pair for copies in write_back for pair in copies):
                    if target is not host:
                        target.copy_(host)
            if swapper is not None:
                swapper.written_back(unit)  # written and freed behind the next units' steps
            return bool(calls)

        self.moments.sweep(update)
        if swapper is not None:
            swapper.reap()

    def _segment_grad(self, p: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ---- state dict --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's layout, with the moments read back from the files (module docstring)."""
        values = self.moments.read_all()
        steps = {p: self.state[p]["step"] for p in self._params}
        for p, (exp_avg, exp_avg_sq) in zip(self._params, values, strict=True):
            shape = self._owned_shape(p)
            self.state[p] = {"step": steps[p], "exp_avg": self._state_tensor(p, exp_avg.view(shape)),
                             "exp_avg_sq": self._state_tensor(p, exp_avg_sq.view(shape))}
        try:
            return super().state_dict()
        finally:  # new dicts: the returned state dict keeps the moments, this optimizer drops them
            for p in self._params:
                self.state[p] = _between_steps(steps[p])

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, then the moments written to the files and dropped from memory."""
        super().load_state_dict(state_dict)
        values = []
        for p in self._params:
            state = self.state[p]
            local = [state[k].to_local() if isinstance(state[k], DTensor) else state[k] for k in _MOMENTS]
            values.append(tuple(t.detach().to("cpu", torch.float32).reshape(-1) for t in local))
            step = torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu().reshape(())
            self.state[p] = _between_steps(step)
        self.moments.write_all(values)

    def host_buffers(self) -> list[torch.Tensor]:
        """The host memory the swapped moments take (runtime.training.memory_tiers counts it)."""
        return list(self.moments._slots)

    def close(self) -> None:
        """Remove the swap files (also done at exit and on SIGTERM), and this rank's folder when nothing else is
        in it."""
        self.swap.close()
        try:
            self.swap.folder.rmdir()
        except OSError:  # not empty (another run's files, a parameter swap still open) or already gone
            pass


class NvmeZeroOneAdamW(_SwappedAdamW, ZeroOneAdamW):
    """ZeRO-1 AdamW (runtime.optim.zero1) whose owned rows' moments live in files under `nvme_path` (module docstring),
    a 16-bit parameter's fp32 master rows in host memory. `sub_group_bytes`: moment bytes swapped per sub-group;
    `threads`: the CPU kernel's OpenMP threads (0: all)."""

    def __init__(self, params, dp_mesh, *, nvme_path: str | os.PathLike | None, sub_group_bytes: int =
                 DEFAULT_SUB_GROUP_BYTES, threads: int = 0, **kwargs):
        kwargs.pop("fused", None)  # the host kernel steps whatever the device kernel choice
        self._masters: dict[torch.Tensor, DTensor] = {}  # 16-bit parameter -> host fp32 master rows (DTensor)
        super().__init__(params, dp_mesh, fused=True, **kwargs)
        self._setup_swap(nvme_path, sub_group_bytes, threads)

    def _fresh_state(self, p: torch.Tensor) -> dict:  # ZeroOneAdamW's init: no moments in memory
        if is_16bit(p):
            rows = self._rows[p]
            host = torch.empty(self._owned_shape(p), dtype=torch.float32, pin_memory=torch.cuda.is_available())
            host.copy_(_local(p.detach())[rows.start:rows.stop])
            self._masters[p] = _host_dtensor(host, p, self.dp_mesh)
        return _between_steps(torch.zeros((), dtype=torch.float32))

    def master(self, p: torch.Tensor) -> DTensor | None:
        return self._masters.get(p)

    def host_buffers(self) -> list[torch.Tensor]:
        """The swapped moments' host slots and the 16-bit parameters' fp32 masters (runtime.training.memory_tiers)."""
        return super().host_buffers() + [master.to_local() for master in self._masters.values()]

    def _rounded_segment(self, p: torch.Tensor) -> torch.Tensor | None:
        if p not in self._masters:
            return None
        rows = self._rows[p]
        return _local(p.detach())[rows.start:rows.stop].view(-1)

    def _owned_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        rows = self._rows[p]
        return (rows.stop - rows.start, *_local(p).shape[1:])

    def _segment(self, p: torch.Tensor) -> torch.Tensor:
        if p in self._masters:
            return self._masters[p].to_local().view(-1)
        rows = self._rows[p]
        return _local(p.detach())[rows.start:rows.stop].view(-1)

    def _segment_grad(self, p: torch.Tensor) -> torch.Tensor:
        rows = self._rows[p]
        return _local(p.grad)[rows.start:rows.stop].reshape(-1)

    def _state_tensor(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        return _host_dtensor(local, p, self.dp_mesh)

    def _adamw_on_owned_rows(self, group: dict) -> None:  # ZeroOneAdamW.step calls it once per group
        if group is self.param_groups[0]:
            self._swapped_adamw_step()  # every group at once, sub-group by sub-group


class NvmeShardedAdamW(_SwappedAdamW, torch.optim.Optimizer):
    """AdamW over FSDP2's sharded parameters (ZeRO-2/3), moments in files under `nvme_path` (module docstring).
    Hyper-parameters as torch.optim.AdamW. `swap_parameters_of`: the ZeRO-3 model whose parameter shards go
    to files too (runtime.offload.param_swap); the sub-groups are then its FSDP units."""

    def __init__(self, params, *, nvme_path: str | os.PathLike | None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 sub_group_bytes: int = DEFAULT_SUB_GROUP_BYTES, threads: int = 0,
                 swap_parameters_of: nn.Module | None = None, **_ignored):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for p in (p for g in self.param_groups for p in g["params"]):
            if p.dtype != torch.float32 or not _local(p).is_contiguous():
                raise ValueError(f"NvmeShardedAdamW steps contiguous fp32 parameters, got {p.dtype} "
                                 f"{tuple(_local(p).shape)}")
        self._setup_swap(nvme_path, sub_group_bytes, threads, swap_parameters_of)

    def _owned_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        return tuple(_local(p).shape)

    def _segment(self, p: torch.Tensor) -> torch.Tensor:
        return _local(p.detach()).view(-1)

    def _segment_grad(self, p: torch.Tensor) -> torch.Tensor:
        return _local(p.grad).reshape(-1)

    def _state_tensor(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        # as FSDP2's shards: p's mesh and placements, the local tensor on the host
        return host_dtensor_on(local, p.device_mesh, p.placements, p) if isinstance(p, DTensor) else local

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._swapped_adamw_step()
        return loss
