"""zplan's CPU AdamW kernel (zplan.cuda.cpu_adam.adamw_step_) as the host-state optimizers call it: host buffers
(pinned with a GPU), the kernel calls of one param group, running them, and loaded states brought back to the host.
"""

from __future__ import annotations

import time

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from zplan.cuda import cpu_adam

MOMENTS = ("exp_avg", "exp_avg_sq")

# One kernel call: (masters, grads, exp_avgs, exp_avg_sqs) host tensor lists, then adamw_step_'s keyword arguments.
_Call = tuple[tuple[list[torch.Tensor], ...], dict]


def pin() -> bool:
    return torch.cuda.is_available()  # pinning needs a CUDA context


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin())


def states_to_host(state: dict, as_state) -> None:
    """One parameter's states after torch's load_state_dict (which casts them to the parameter's device) back
    into host memory: each moment (and 16-bit master) fp32 on the host (pinned with a GPU), rewrapped by
    `as_state(local)` when it is not already a DTensor of that local tensor; the step a host fp32 scalar."""
    for key in (*MOMENTS, "master"):
        if key not in state:
            continue
        value = state[key]
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.device.type != "cpu" or local.dtype != torch.float32 or (pin() and not local.is_pinned()):
            host = host_empty(local.shape, torch.float32)
            host.copy_(local)
            local = host
        if not isinstance(value, DTensor) or value.to_local() is not local:
            state[key] = as_state(local)
    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu().reshape(())


def kernel_calls(by_step: dict[int, tuple[list, list, list, list, list]], group: dict, threads: int,
                 grad_divisor=None) -> list[_Call]:
    """adamw_step_ calls for one param group: `by_step` maps a step count to the (masters, grads, exp_avgs,
    exp_avg_sqs, outs) host tensor lists of the parameters at that count (outs: a 16-bit tensor the kernel writes
    the updated parameter into in the same pass, or None); one call per step count and kind of parameter. 16-bit
    gradients are read divided by `grad_divisor` (the optimizer's: loss scale times clipping factor), if any."""
    beta1, beta2 = group["betas"]
    hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                 weight_decay=group["weight_decay"], threads=threads or torch.get_num_threads())
    # a fake divisor (the dry run) has no value, and its kernel does not run (run_kernel_calls)
    grad_scale = 1.0 if grad_divisor is None or is_fake(grad_divisor) else 1.0 / float(grad_divisor)
    calls: list[_Call] = []
    for step, (masters, grads, exp_avgs, exp_avg_sqs, outs) in by_step.items():
        has_out = [o for o in outs if o is not None]
        if has_out and len(has_out) != len(outs):  # mixed dtypes in one group: one call per kind
            kinds = [(m, g, a, s, o) for m, g, a, s, o in zip(masters, grads, exp_avgs, exp_avg_sqs, outs,
                                                              strict=True)]
            parts = [[k for k in kinds if k[4] is None], [k for k in kinds if k[4] is not None]]
        else:
            parts = [list(zip(masters, grads, exp_avgs, exp_avg_sqs, outs, strict=True))]
        for part in parts:
            m, g, a, s, o = (list(x) for x in zip(*part, strict=True))
            sixteen_bit = o[0] is not None
            calls.append(((m, g, a, s), dict(hyper, step=step, param_copy_out=o if sixteen_bit else None,
                                             grad_scale=grad_scale if sixteen_bit else 1.0)))
    return calls


def step_count(step: torch.Tensor) -> int:
    """A parameter's AdamW step count, which the kernel's bias correction reads; on fake tensors (the dry run:
    zplan dryrun) there are no values, and no kernel to read one (run_kernel_calls), so 1."""
    return 1 if is_fake(step) else int(step.item())


def run_kernel_calls(calls: list[_Call]) -> tuple[float, str | None]:
    """Run the adamw_step_ calls on the calling thread: (their seconds, the backend of the last one). On fake tensors
    (the dry run) nothing runs: the step updates its tensors in place and allocates nothing."""
    if calls and is_fake(calls[0][0][0][0]):
        return 0.0, "fake"
    backend = None
    start = time.perf_counter()
    for tensors, kwargs in calls:
        backend = cpu_adam.adamw_step_(*tensors, **kwargs)
    return time.perf_counter() - start, backend
