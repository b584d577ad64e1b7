"""ZeRO-Offload for ZeRO-1 (Ren et al., ZeRO-Offload, USENIX ATC'21): runtime.zero1.ZeroOneAdamW with this
rank's optimizer work on the host.

Each dp rank owns the same dim-0 rows of every parameter as under ZeroOneAdamW (of the tp-local tensor under
tensor parallel). For those rows it keeps, in host memory (pinned when CUDA is available, so that the copies
are asynchronous DMA; plain otherwise):
  - the fp32 master copy of the rows,
  - the Adam moments exp_avg, exp_avg_sq (fp32).
A step copies the owned rows of the (already dp-averaged) gradient to the host, runs zplan.cuda.cpu_adam's
adamw_step_ (C++ SIMD kernel, torch.optim.AdamW semantics) on them, and writes the updated rows back into the
parameter: a 16-bit parameter's rows come out of the same kernel pass (param_copy_out), an fp32 parameter's
rows are the updated master rows copied back. The rows then reach the other dp ranks exactly as in
ZeroOneAdamW (in-place broadcasts, padded all-gather buckets).

State dict: the same layout as ZeroOneAdamW, so checkpoints reshard between the two and into every other
layout (runtime.zero1's docstring): state[param] = {"step": fp32 scalar, "exp_avg", "exp_avg_sq": DTensor of
the parameter's global shape, this rank's rows as its local tensor}; here the local tensors are host tensors
(a DTensor on a CUDA mesh may hold a CPU local tensor, as FSDP2's CPUOffloadPolicy does) and the step
scalar lives on the host too. The fp32 master is not a state of an fp32 parameter: it equals the
parameter's rows, and is re-read from them whenever the parameter was written by anything else than this
optimizer (loading a checkpoint, a broadcast at start-up: tracked by the parameter's version counter). A
16-bit parameter's master is kept as a third state, "master" (same layout as the moments).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from zplan.runtime.zero1 import ZeroOneAdamW, _local, state_layout

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _pin() -> bool:
    return torch.cuda.is_available()  # pinning needs a CUDA context


def _host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=_pin())


def _host_dtensor(local: torch.Tensor, p: torch.Tensor, dp_mesh) -> DTensor:
    """A DTensor of p's global shape laid out as ZeroOneAdamW's moments, whose local tensor is `local`, a host
    tensor, even on a CUDA mesh (DTensor.from_local would move it to the mesh's device)."""
    mesh, placements = state_layout(p, dp_mesh)
    if mesh.device_type == "cpu":
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(p.shape, p.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


class CpuOffloadZeroOneAdamW(ZeroOneAdamW):
    """ZeroOneAdamW whose owned rows' fp32 master and moments live on the host and step with the CPU Adam
    kernel (module docstring). Hyper-parameters as torch.optim.AdamW; `threads`: OpenMP threads of the kernel
    (0: torch.get_num_threads())."""

    def __init__(self, params, dp_mesh, *, threads: int = 0, **kwargs):
        kwargs.pop("fused", None)  # the host kernel is used whatever the device kernel choice
        self._threads = threads
        self._master: dict[torch.Tensor, torch.Tensor] = {}  # fp32 parameters: host master rows
        self._synced_version: dict[torch.Tensor, int] = {}  # parameter version the master was read from
        self._grad_host: dict[torch.Tensor, torch.Tensor] = {}  # pinned staging of grad rows (CUDA only)
        self._out_host: dict[torch.Tensor, torch.Tensor] = {}  # pinned 16-bit updated rows (CUDA only)
        self.last_backend: str | None = None  # what adamw_step_ ran last: 'cpp-avx2', 'reference', ...
        super().__init__(params, dp_mesh, fused=True, **kwargs)

    # ---- states ------------------------------------------------------------------------------------

    def _owned_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        rows = self._rows[p]
        return (rows.stop - rows.start, *_local(p).shape[1:])

    def _fresh_state(self, p: torch.Tensor) -> dict:
        shape = self._owned_shape(p)
        state = {"step": torch.zeros((), dtype=torch.float32)}
        for key in _MOMENTS:
            state[key] = _host_dtensor(_host_empty(shape, torch.float32), p, self.dp_mesh)
        owned = _local(p.detach())[self._rows[p].start:self._rows[p].stop]
        if p.dtype == torch.float32:
            self._master[p] = _host_empty(shape, torch.float32)
            self._master[p].copy_(owned)
            self._synced_version[p] = _local(p.detach())._version
        else:  # 16-bit parameter: the master carries information the parameter does not, so it is a state
            master = _host_empty(shape, torch.float32)
            master.copy_(owned)
            state["master"] = _host_dtensor(master, p, self.dp_mesh)
        return state

    def master_rows(self, p: torch.Tensor) -> torch.Tensor:
        """The host fp32 master of this rank's rows of `p`."""
        return self._master[p] if p in self._master else self.state[p]["master"].to_local()

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, then the states back into host memory (torch's loader casts them to the parameter's
        device), and every fp32 master re-read from its parameter at the next step."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            for key in (*_MOMENTS, "master"):
                if key not in state:
                    continue
                value = state[key]
                local = value.to_local() if isinstance(value, DTensor) else value
                if local.device.type != "cpu" or local.dtype != torch.float32 or (_pin() and not local.is_pinned()):
                    host = _host_empty(local.shape, torch.float32)
                    host.copy_(local)
                    local = host
                if not isinstance(value, DTensor) or value.to_local() is not local:
                    state[key] = _host_dtensor(local, p, self.dp_mesh)
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu().reshape(())
        self._synced_version.clear()

    # ---- the step ------------------------------------------------------------------------------------

    def _adamw_on_owned_rows(self, group: dict) -> None:
        from zplan.cuda.cpu_adam import adamw_step_

        by_step: dict[int, tuple[list, list, list, list, list]] = {}
        write_back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device rows, host rows) to copy after
        staged = False
        for p in group["params"]:
            if p.grad is None:  # as torch's AdamW: no gradient, no step
                continue
            rows, state = self._rows[p], self.state[p]
            state["step"] += 1
            if rows.stop == rows.start:
                continue
            owned = _local(p.detach())[rows.start:rows.stop]
            if p in self._master and self._synced_version.get(p) != owned._version:
                self._master[p].copy_(owned)  # the parameter was written by someone else (e.g. a load)
            grad = _local(p.grad)[rows.start:rows.stop]
            if grad.device.type != "cpu":
                host = self._grad_host.get(p)
                if host is None:
                    host = self._grad_host[p] = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=_pin())
                host.copy_(grad, non_blocking=True)
                grad, staged = host, True
            elif not grad.is_contiguous():
                grad = grad.contiguous()
            out = None
            if p not in self._master:  # 16-bit parameter: the kernel writes its rows in the same pass
                if owned.device.type == "cpu":
                    out = owned
                else:
                    out = self._out_host.get(p)
                    if out is None:
                        out = self._out_host[p] = torch.empty(owned.shape, dtype=owned.dtype, pin_memory=_pin())
                    write_back.append((owned, out))
            else:
                write_back.append((owned, self._master[p]))
            lists = by_step.setdefault(int(state["step"].item()), ([], [], [], [], []))
            for target, value in zip(lists, (self.master_rows(p), grad, state["exp_avg"].to_local(),
                                             state["exp_avg_sq"].to_local(), out), strict=True):
                target.append(value)
        if staged:
            torch.cuda.synchronize()  # the gradient rows are on the host
        beta1, beta2 = group["betas"]
        for step, (masters, grads, exp_avgs, exp_avg_sqs, outs) in by_step.items():
            has_out = [o for o in outs if o is not None]
            if has_out and len(has_out) != len(outs):  # mixed dtypes in one group: one call per kind
                kinds = [(m, g, a, s, o) for m, g, a, s, o in zip(masters, grads, exp_avgs, exp_avg_sqs, outs,
                                                                  strict=True)]
                calls = [[k for k in kinds if k[4] is None], [k for k in kinds if k[4] is not None]]
            else:
                calls = [list(zip(masters, grads, exp_avgs, exp_avg_sqs, outs, strict=True))]
            for call in calls:
                m, g, a, s, o = (list(x) for x in zip(*call, strict=True))
                self.last_backend = adamw_step_(
                    m, g, a, s, lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], step=step,
                    param_copy_out=o if o[0] is not None else None, threads=self._threads)
        for device_rows, host_rows in write_back:
            device_rows.copy_(host_rows, non_blocking=device_rows.device.type != "cpu")

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for p in self._master:  # our own writes (and the rows the others sent) do not make the master stale
            self._synced_version[p] = _local(p.detach())._version
        return loss
