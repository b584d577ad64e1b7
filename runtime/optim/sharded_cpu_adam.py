"""ZeRO-Offload under ZeRO 2/3 (Ren et al., ZeRO-Offload, USENIX ATC'21, Sec. 4): the optimizer alone on the host,
over FSDP2's parameter shards, which stay on the device with their gradient shards.

FSDP2 without CPUOffloadPolicy (runtime.parallel.data_parallel.apply_data_parallel) keeps each parameter as this rank's
dim-0 shard on the device (a DTensor, fp32: the runtime's master weights in every precision) and reduce-scatters the
gradients into fp32 shards beside it. For every shard this optimizer keeps in host memory (pinned when CUDA is
available, so that the copies are asynchronous DMA; plain otherwise):
  - an fp32 master copy of the shard                         4 bytes a parameter of the shard,
  - Adam's moments exp_avg, exp_avg_sq (fp32)                8 bytes,
  - with a GPU, the buffer the gradient shard is copied into  4 bytes.
One step (once per optimizer step, not per micro-batch): the gradient shards device -> host, zplan's one-pass
CPU AdamW kernel (zplan.cuda.cpu_adam.adamw_step_, torch.optim.AdamW semantics; the kernel helpers of
runtime.optim.cpu_adam_optimizer) on the masters and moments, and the updated masters host -> device into the
parameter shards. Nothing crosses the data-parallel group: FSDP2 all-gathers the updated shards at the next
forward, as after any optimizer. On a machine without a GPU the device is the host and the same path runs (the
gradient shards are read where they are, the masters are still copied into the parameters), so tests on CPU
exercise it.

State dict: torch.optim.AdamW's over FSDP2's parameters, state[param] = {"step": fp32 host scalar, "exp_avg",
"exp_avg_sq": DTensor on the parameter's mesh with its placements, the host moment as its local tensor}, so
torch.distributed.checkpoint reshards it into and out of every other plan (runtime.optim.zero1's docstring). The
master is not a state: it equals the parameter's shard, and is re-read from it at the next step whenever the
shard was written by anything but this optimizer (made after the optimizer, loaded from a checkpoint: tracked by
the shard's address and version counter).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from zplan.runtime.optim.cpu_adam_optimizer import (
    _MOMENTS,
    _host_empty,
    _pin,
    host_dtensor_on,
    kernel_calls,
    run_kernel_calls,
    states_to_host,
    step_count,
)
from zplan.runtime.optim.zero1 import _local


def _stamp(local: torch.Tensor) -> tuple[int, int]:
    """What changes when a tensor is written or replaced: (address, version counter); on a fake tensor (the dry run),
    which has no address, its storage's identity."""
    return (id(local.untyped_storage()) if is_fake(local) else local.data_ptr()), local._version


class CpuOffloadShardedAdamW(torch.optim.Optimizer):
    """AdamW over FSDP2's device shards (ZeRO 2/3) stepped on the host (module docstring). Hyper-parameters as
    torch.optim.AdamW; `threads`: OpenMP threads of the kernel (0: torch.get_num_threads()).

    Measured, for benchmarks: last_cpu_step_s, seconds of the kernel calls of the last step; last_backend, what
    adamw_step_ ran last ('cpp-avx2', 'reference', ...)."""

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, threads: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._threads = threads
        self._master: dict[torch.Tensor, torch.Tensor] = {}  # host fp32 copy of each parameter's local shard
        self._synced: dict[torch.Tensor, tuple[int, int] | None] = {}  # _stamp of the shard the master equals
        self._grad_host: dict[torch.Tensor, torch.Tensor] = {}  # host copy of each device gradient shard
        self.last_cpu_step_s = 0.0
        self.last_backend: str | None = None
        for group in self.param_groups:
            for p in group["params"]:
                local = _local(p.detach())
                if p.dtype != torch.float32 or not local.is_contiguous():
                    raise ValueError(f"CpuOffloadShardedAdamW steps contiguous fp32 parameters (FSDP2's shards), got "
                                     f"{p.dtype} {tuple(local.shape)}")
                self._master[p] = _host_empty(local.shape, torch.float32)
                self._synced[p] = None  # read from the shard at the first step (the weights may come later)
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                 **{key: self._as_state(p, _host_empty(local.shape, torch.float32))
                                    for key in _MOMENTS}}

    @staticmethod
    def _as_state(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """A host moment laid out as p's shard (FSDP2's DTensor layout), or itself for a plain parameter."""
        return host_dtensor_on(local, p.device_mesh, p.placements, p) if isinstance(p, DTensor) else local

    def host_buffers(self) -> list[torch.Tensor]:
        """Host memory besides the moments: the masters and the gradient buffers (runtime.training.memory_tiers
        counts it)."""
        return [*self._master.values(), *self._grad_host.values()]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        calls, write_back, on_device = [], [], False
        for group in self.param_groups:
            by_step: dict[int, tuple[list, list, list, list, list]] = {}
            for p in group["params"]:
                if p.grad is None:  # as torch's AdamW: no gradient, no step
                    continue
                state = self.state[p]
                state["step"] += 1
                local, master = _local(p.detach()), self._master[p]
                if local.numel() == 0:  # this rank holds no element of p
                    continue
                if self._synced[p] != _stamp(local):
                    master.copy_(local)  # the shard was written by someone else (a load) or never read
                grad = _local(p.grad)
                if grad.device.type != "cpu":  # device -> host, asynchronous into the pinned buffer
                    host = self._grad_host.get(p)
                    if host is None:
                        host = self._grad_host[p] = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=_pin())
                    host.copy_(grad, non_blocking=True)
                    grad = host
                elif not grad.is_contiguous():
                    grad = grad.contiguous()
                on_device = on_device or local.device.type != "cpu"
                lists = by_step.setdefault(step_count(state["step"]), ([], [], [], [], []))
                for target, value in zip(lists, (master, grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                                                 None), strict=True):
                    target.append(value)
                write_back.append((p, local, master))
            calls += kernel_calls(by_step, group, self._threads)
        if on_device:
            torch.cuda.synchronize()  # the gradient copies have landed, the last step's copies out of the masters too
        self.last_cpu_step_s, backend = run_kernel_calls(calls)
        self.last_backend = backend or self.last_backend
        for p, local, master in write_back:  # host -> device, asynchronous from the pinned master
            local.copy_(master, non_blocking=local.device.type != "cpu")
            self._synced[p] = _stamp(local)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, then the states back into host memory (torch's loader casts them to the parameter's
        device), and every master re-read from its parameter's shard at the next step."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            states_to_host(state, lambda local, p=p: self._as_state(p, local))
        self._synced = dict.fromkeys(self._synced)
