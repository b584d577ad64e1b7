"""AdamW states on NVMe: ZeRO-Infinity's optimizer offload (Rajbhandari et al. SC'21), the states part of
runtime.optim.sharded_adamw.ShardedAdamW for offload='nvme'. The moments live in files (runtime.optim.swapped_moments),
swapped in per sub-group during the step and stepped there by zplan's CPU AdamW kernel (zplan.cuda.cpu_adam).

The elements a rank updates are the layout's (runtime.optim.layouts): ZeRO-1's rows of every parameter (of its
tp-local tensor under tensor parallel), published to the other ranks after the step; or FSDP2's shards under ZeRO 2/3
(DTensor, local tensor on the host under CPUOffloadPolicy, on the device when the placement keeps the parameters
there), each local tensor stepped whole.
The master weights: an fp32 parameter is its own (FSDP2's shards, fp32 ZeRO-1), updated in place, staged through host
memory sub-group by sub-group when it is on a GPU; a 16-bit parameter (ZeRO-1 with mixed precision) has an fp32 master
of its rows in host memory (pinned with a GPU), stepped there and rounded into the parameter's rows. What is in
files: exp_avg and exp_avg_sq, 8 bytes per updated parameter. The step count is a host scalar per parameter.
swap_parameters_of (ZeRO 3): the parameter shards in files too (runtime.offload.param_swap), one sub-group per FSDP
unit.

State dict: the layout's, so checkpoints reshard into and out of every other plan. Before a state dict is made the
moments are read back from the files into new host tensors (this rank's whole optimizer state, in host memory while
a checkpoint is written), and dropped after; a loaded state dict's moments are written out again. Between steps only
the step counts are in the optimizer's state.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from zplan.cuda import cpu_adam
from zplan.errors import SwapError
from zplan.runtime.offload.nvme import SwapEngine
from zplan.runtime.offload.param_swap import ParameterSwapper
from zplan.runtime.optim.cpu_adam_kernel import MOMENTS
from zplan.runtime.optim.layouts import _local, is_16bit
from zplan.runtime.optim.swapped_moments import SwappedMoments

DEFAULT_SUB_GROUP_BYTES = 64 * 2**20  # moments per sub-group (both): 8M parameters, one 64 MiB read and write


def _rank_folder(nvme_path: str | os.PathLike) -> Path:
    rank = os.environ.get("RANK", "0")
    return Path(nvme_path) / f"rank{rank}"


def _between_steps(step: torch.Tensor) -> dict:
    """A parameter's state between steps: its step count, and the moments' keys with empty tensors (the moments
    are in files; torch.distributed.checkpoint's loader takes the state names from optimizer.state[param])."""
    return {"step": step, "exp_avg": torch.empty(0), "exp_avg_sq": torch.empty(0)}


class NvmeStates:
    """Moments in files under `nvme_path` (module docstring), a 16-bit parameter's fp32 master rows in host memory.
    `sub_group_bytes`: moment bytes swapped per sub-group; `threads`: the CPU kernel's OpenMP threads (0: all);
    `swap_parameters_of`: the ZeRO-3 model whose parameter shards go to files too (the sub-groups are then its
    FSDP units)."""

    def __init__(self, nvme_path: str | os.PathLike | None, *, sub_group_bytes: int = DEFAULT_SUB_GROUP_BYTES,
                 threads: int = 0, swap_parameters_of: nn.Module | None = None):
        if not nvme_path:
            raise SwapError("NVMe offload needs a folder for the swap files: pass --nvme-path DIR (a local NVMe "
                            "drive; it must hold this rank's optimizer states, 8 bytes per parameter it updates)")
        self._nvme_path, self._sub_group_bytes, self._threads = nvme_path, sub_group_bytes, threads
        self._swap_parameters_of = swap_parameters_of
        self._masters: dict[torch.Tensor, torch.Tensor] = {}  # 16-bit parameter -> host fp32 master rows (DTensor)
        self.last_backend: str | None = None

    def fresh(self, opt, p: torch.Tensor) -> dict:  # no moments in memory
        if is_16bit(p):
            if not opt.layout.keeps_rows_of_replicas:
                raise ValueError(f"NVMe states step fp32 shards (FSDP2's), got {p.dtype} {tuple(_local(p).shape)}")
            host = torch.empty(opt.layout.owned(p).shape, dtype=torch.float32, pin_memory=torch.cuda.is_available())
            host.copy_(opt.layout.owned(p))
            self._masters[p] = opt.layout.as_state(host, p)
        return _between_steps(torch.zeros((), dtype=torch.float32))

    def bind(self, opt) -> None:
        """The swap engine, the sub-groups and the files' space, once the optimizer holds its parameters."""
        self._params = [p for group in opt.param_groups for p in group["params"]]
        self._layout = opt.layout
        self.swap = SwapEngine(_rank_folder(self._nvme_path))
        self.param_swapper, segment_groups = None, None
        if self._swap_parameters_of is not None:  # ZeRO-3 parameters in files too: one sub-group per FSDP unit
            model = self._swap_parameters_of
            units = [m for m in model.modules() if isinstance(m, FSDPModule)]  # root first, as run
            self.param_swapper = ParameterSwapper(self.swap, model, units)
            unit_of = self.param_swapper.unit_of
            self._params.sort(key=lambda p: unit_of[id(p)].index)
            segment_groups = [[i for i, p in enumerate(self._params) if unit_of[id(p)] is unit]
                              for unit in self.param_swapper.units]
        numels = [self._segment(opt, p).numel() for p in self._params]
        self.moments = SwappedMoments(self.swap, numels, max(1, self._sub_group_bytes // 8),
                                      segment_groups=segment_groups)
        needed = self.moments.state_bytes + (self.param_swapper.file_bytes if self.param_swapper else 0)
        self.swap.check_space(needed)  # before training starts, not when the disk fills up

    def master(self, opt, p: torch.Tensor):
        return self._masters.get(p)

    def _segment(self, opt, p: torch.Tensor) -> torch.Tensor:  # this rank's elements of p's master: flat fp32
        if p in self._masters:
            return _local(self._masters[p]).view(-1)
        return opt.layout.owned(p).view(-1)

    def _rounded_segment(self, opt, p: torch.Tensor) -> torch.Tensor | None:  # a 16-bit p's elements, else None
        return opt.layout.owned(p).view(-1) if p in self._masters else None

    def flush(self, opt) -> None:
        pass

    # ---- the step ----------------------------------------------------------------------------------

    def update(self, opt) -> None:
        """Every param group at once, sub-group by sub-group; then the layout's publish."""
        group_of = {p: group for group in opt.param_groups for p in group["params"]}  # load_state_dict renews them
        stepped = [p for p in self._params if p.grad is not None]  # as torch's AdamW: no gradient, no step
        for p in stepped:
            opt.state[p]["step"] += 1
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
                master = self._segment(opt, p)[piece.start:piece.stop]
                grad = opt.layout.grad(p).reshape(-1)[piece.start:piece.stop].to("cpu", torch.float32)
                rounded = self._rounded_segment(opt, p)  # a 16-bit parameter's rows, written from its master
                if rounded is not None and opt.grad_divisor is not None:
                    grad.div_(float(opt.grad_divisor))  # loss scale x clipping (runtime.optim.device_states)
                host = master if master.device.type == "cpu" else master.to("cpu")  # staged from the GPU
                copies = [(master, host)] + ([] if rounded is None else [(rounded[piece.start:piece.stop], host)])
                key = (id(group_of[p]), int(opt.state[p]["step"].item()))
                lists = calls.setdefault(key, ([], [], [], [], []))
                for target, value in zip(lists, (host, grad, exp_avg[piece.offset:piece.offset + n],
                                                 exp_avg_sq[piece.offset:piece.offset + n], copies), strict=True):
                    target.append(value)
            groups = {id(g): g for g in opt.param_groups}
            for (group_id, step), (masters, grads, exp_avgs, exp_avg_sqs, write_back) in calls.items():
                group = groups[group_id]
                beta1, beta2 = group["betas"]
                self.last_backend = cpu_adam.adamw_step_(
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
        opt.layout.publish()


    # ---- state dict --------------------------------------------------------------------------------

    def before_state_dict(self, opt) -> None:
        """The moments read back from the files into the optimizer's state (module docstring)."""
        values = self.moments.read_all()
        for p, (exp_avg, exp_avg_sq) in zip(self._params, values, strict=True):
            shape = opt.layout.owned(p).shape
            opt.state[p] = {"step": opt.state[p]["step"], "exp_avg": opt.layout.as_state(exp_avg.view(shape), p),
                            "exp_avg_sq": opt.layout.as_state(exp_avg_sq.view(shape), p)}

    def after_state_dict(self, opt) -> None:
        """New dicts: the returned state dict keeps the moments, the optimizer drops them."""
        for p in self._params:
            opt.state[p] = _between_steps(opt.state[p]["step"])

    def loaded(self, opt) -> None:
        """After a load: the moments written to the files and dropped from memory."""
        values = []
        for p in self._params:
            state = opt.state[p]
            local = [state[k].to_local() if isinstance(state[k], DTensor) else state[k] for k in MOMENTS]
            values.append(tuple(t.detach().to("cpu", torch.float32).reshape(-1) for t in local))
            step = torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu().reshape(())
            opt.state[p] = _between_steps(step)
        self.moments.write_all(values)

    def host_buffers(self) -> list[torch.Tensor]:
        """The swapped moments' host slots and the 16-bit parameters' fp32 masters (runtime.training.memory_tiers)."""
        return list(self.moments._slots) + [_local(master) for master in self._masters.values()]

    def close(self) -> None:
        """Remove the swap files (also done at exit and on SIGTERM), and this rank's folder when nothing else is
        in it."""
        self.swap.close()
        try:
            self.swap.folder.rmdir()
        except OSError:  # not empty (another run's files, a parameter swap still open) or already gone
            pass
