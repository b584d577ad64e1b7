"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018, Sec. 3.2) where torch's GradScaler does not fit.

torch's GradScaler scales a loss that the training loop backpropagates itself and unscales fp32 gradients in
place. Two cases need more:
  - pipeline parallelism: the schedule runs backward inside PipelineRun.step, and each rank holds the gradients
    of its own stages only, so an overflow on one stage must skip the step on every rank. This scaler gives the
    schedule a factor to multiply each micro-batch loss by, unscales the gradients after it (unscale_), and
    agrees on overflow over all ranks (one all-reduce of a flag);
  - 16-bit gradients of 16-bit parameters (ZeRO 0/1 with mixed precision, runtime.optim.layouts): unscaling them in fp16
    would flush the small ones to zero, so they stay scaled, the optimizer's step divides its fp32 upcast by the
    scale (grad_divisor), and the overflow is read from the gradients' total norm, which every rank computes
    alike (note_overflow).
Its policy and defaults are GradScaler's: start at 2^16, halve on overflow and skip the step, double after 2000
steps without one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class LossScaler:
    def __init__(self, device: torch.device, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.factor = init_scale  # what the current step's losses are multiplied by
        self.growth_interval = growth_interval
        self.steps_since_overflow = 0
        self.device = device
        self.found_overflow = False  # in the last unscale_

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current factor (torch's GradScaler.scale)."""
        return loss * self.factor

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of this rank's parameters by the scale; note whether any rank has a
        non-finite one."""
        finite = torch.ones((), device=self.device)
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                local.mul_(1.0 / self.factor)
                finite = finite * torch.isfinite(local).all()
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank: 0 when any rank overflowed
        self.found_overflow = finite.item() == 0

    def note_overflow(self, total_norm: torch.Tensor) -> None:
        """Instead of unscale_, for gradients left scaled: an overflow when their total norm (the same on every
        rank) is not finite."""
        self.found_overflow = not bool(torch.isfinite(total_norm))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step, skipped after an overflow."""
        if not self.found_overflow:
            optimizer.step()

    def update(self) -> None:
        """The scale for the next step."""
        if self.found_overflow:
            self.factor /= 2.0
            self.steps_since_overflow = 0
            return
        self.steps_since_overflow += 1
        if self.steps_since_overflow == self.growth_interval:
            self.factor *= 2.0
            self.steps_since_overflow = 0

    def state_dict(self) -> dict:
        return {"scale": self.factor, "steps_since_overflow": self.steps_since_overflow}

    def load_state_dict(self, state: dict) -> None:
        self.factor, self.steps_since_overflow = state["scale"], state["steps_since_overflow"]
