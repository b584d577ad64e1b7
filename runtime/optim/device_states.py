"""AdamW states on the parameters' device, stepped by torch's fused AdamW kernel: the states part of
runtime.optim.sharded_adamw.ShardedAdamW that keeps nothing on the host.

For every parameter, of the elements this rank updates (the layout part's `owned`: ZeRO-1's rows, FSDP2's shard):
exp_avg and exp_avg_sq (the parameter's dtype, fp32 for a 16-bit one) and the step (an fp32 scalar on the
parameter's device, as torch's fused AdamW keeps it). A 16-bit parameter (ZeRO 0/1 with mixed precision,
runtime.optim.layouts's docstring) has an fp32 master of its elements as a third state, "master": its gradient is
upcast (and divided by the optimizer's grad_divisor, the loss scale times the clipping factor), the master stepped,
and the parameter's elements rounded from it. The arithmetic is torch.optim.adam.adam's (fused=True, or foreach:
`fused=False`), so the result equals torch.optim.AdamW's in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.optim.adam import adam

from zplan.runtime.optim.layouts import _local, is_16bit

# fp32 gradient rows upcast at a time in a 16-bit step (one fused AdamW call each): the step's temporary bytes.
STEP_CHUNK_BYTES = 64 * 1024**2


class DeviceStates:
    """States on the device, torch's fused (or foreach) AdamW kernel (module docstring)."""

    def __init__(self, *, fused: bool = True):
        self.fused = fused

    def fresh(self, opt, p: torch.Tensor) -> dict:
        owned = opt.layout.owned(p)  # (rows owned, *local.shape[1:])
        state_dtype = torch.float32 if is_16bit(p) else p.dtype  # as torch's AdamW: the (master) parameter's

        def owned_state(init: torch.Tensor | None = None) -> torch.Tensor:  # laid out as the layout says
            local = torch.zeros(owned.shape, dtype=state_dtype, device=p.device)
            if init is not None:
                local.copy_(init)
            return opt.layout.as_state(local, p)

        # the step is a float32 scalar on the parameter's device, as torch's fused AdamW keeps it
        state = {"step": torch.zeros((), dtype=torch.float32, device=p.device), "exp_avg": owned_state(),
                 "exp_avg_sq": owned_state()}
        if is_16bit(p):
            state["master"] = owned_state(init=owned)
        return state

    def bind(self, opt) -> None:
        pass

    def master(self, opt, p: torch.Tensor):
        return opt.state[p].get("master")

    def host_buffers(self) -> list[torch.Tensor]:
        return []

    def flush(self, opt) -> None:
        pass

    def before_state_dict(self, opt) -> None:
        pass

    def loaded(self, opt) -> None:
        pass

    def close(self) -> None:
        pass

    def update(self, opt) -> None:
        for group in opt.param_groups:
            self._adamw_on_owned(opt, group)
        opt.layout.publish()

    def _adamw_on_owned(self, opt, group: dict) -> None:
        """AdamW on this rank's elements of the group's parameters: in place on an fp32 parameter's; on a 16-bit
        parameter's master, with its gradient upcast (and divided by grad_divisor), the parameter's elements then
        rounded from it. At most STEP_CHUNK_BYTES of upcast gradients exist at a time."""
        layout, batch = opt.layout, _AdamBatch()
        for p in group["params"]:
            if p.grad is None:  # as torch's AdamW: no gradient, no step (DDP makes this the same on every rank)
                continue
            state = opt.state[p]
            if layout.is_empty(p):  # this rank owns no element of p: only the step count advances
                state["step"] += 1
                continue
            # views of the (tp-local) tensors: the update lands in the parameter, or in its master
            param_rows, grad_rows = layout.owned(p), layout.grad(p)
            if "master" in state:
                grad_rows = grad_rows.to(torch.float32)  # (rows, ...) fp32: a new tensor
                if opt.grad_divisor is not None:
                    grad_rows.div_(opt.grad_divisor)
                batch.add(_local(state["master"]), grad_rows, state, copy_to=param_rows)
            else:
                batch.add(param_rows, grad_rows, state)
            if batch.upcast_bytes >= STEP_CHUNK_BYTES:
                self._adamw(batch, group)
                batch = _AdamBatch()
        self._adamw(batch, group)

    def _adamw(self, batch: _AdamBatch, group: dict) -> None:
        if not batch.params:
            return
        beta1, beta2 = group["betas"]
        adam(batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, [], batch.steps,
             foreach=None if self.fused else True, fused=self.fused or None, decoupled_weight_decay=True,
             amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=False)
        for param_rows, master_rows in batch.copies:
            param_rows.copy_(master_rows)  # rounded to the parameter's 16-bit dtype



@dataclass
class _AdamBatch:
    """The tensors of one fused AdamW call (torch.optim.adam.adam's lists), and the 16-bit rows to write after."""

    params: list = field(default_factory=list)  # fp32: parameter rows, or a 16-bit parameter's master rows
    grads: list = field(default_factory=list)
    exp_avgs: list = field(default_factory=list)
    exp_avg_sqs: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    copies: list = field(default_factory=list)  # (16-bit parameter rows, master rows)
    upcast_bytes: int = 0  # fp32 gradient rows made for this call

    def add(self, param: torch.Tensor, grad: torch.Tensor, state: dict, copy_to: torch.Tensor | None = None):
        for target, value in ((self.params, param), (self.grads, grad), (self.exp_avgs, _local(state["exp_avg"])),
                              (self.exp_avg_sqs, _local(state["exp_avg_sq"])), (self.steps, state["step"])):
            target.append(value)
        if copy_to is not None:
            self.copies.append((copy_to, param))
            self.upcast_bytes += grad.numel() * grad.element_size()
