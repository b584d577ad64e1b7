"""Validation loss (--val-data, --eval-every, --eval-batches): the model in eval mode, no gradients, over the same
fixed batches every time (the first --eval-batches global batches of the validation data, in file order), each
data-parallel rank its slice of them as in training.

val_loss is the mean of the micro-batch losses over the global batch, all-reduced as the training loss is
(runtime/training/loop.py: a sum over all ranks / world size, right under tensor and context parallel too);
val_ppl = exp(val_loss). Under pipeline parallel the stages run forward only, outside the training schedule
(runtime.parallel.pipeline.PipelineRun.evaluate: one global batch's micro-batches at a time, their mean loss on every
pipeline rank, as its step() returns the training loss), then the same all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zplan.runtime.data.source import TokenData, token_batches
from zplan.runtime.launch.distributed import RunContext
from zplan.runtime.parallel.pipeline import PipelineRun
from zplan.runtime.parallel.vocab_parallel import loss_parallel_scope
from zplan.runtime.training.step import attention_scope, forward_batch, to_device


@dataclass(frozen=True)
class Validation:
    """When and on what to evaluate: `batches()` makes this rank's micro-batches afresh (the same ones each time),
    `micro_batches` of them per evaluation; every `every` steps (0: after the last step only) and after the last."""

    batches: Callable[[], Iterator]
    micro_batches: int
    every: int = 0

    def due(self, steps_done: int, total_steps: int) -> bool:
        return steps_done == total_steps or (self.every > 0 and steps_done % self.every == 0)

    def run(self, model: nn.Module, loss_fn: Callable, ctx: RunContext) -> dict[str, float]:
        """evaluate(model, loss_fn, self, ctx): what the train loop calls (it does not import this module)."""
        return evaluate(model, loss_fn, self, ctx)


def evaluate(model: nn.Module, loss_fn: Callable, validation: Validation, ctx: RunContext) -> dict[str, float]:
    """{"val_loss": ..., "val_ppl": ...} over validation's batches (collective: every rank calls it)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=ctx.device)  # fp32: the sum of the micro-batch losses
    batches = validation.batches()
    try:
        with torch.no_grad():
            if isinstance(model, PipelineRun):  # the model's loss_fn, which the run holds (as for step())
                per_step = model.num_micro_batches  # one global batch at a time: this rank's slice of it
                for _ in range(0, validation.micro_batches, per_step):
                    micro_batches = [to_device(next(batches), ctx.device) for _ in range(per_step)]
                    with attention_scope(micro_batches[0]):  # context parallel: as around step()
                        total += model.evaluate(micro_batches) * per_step
            else:
                for _ in range(validation.micro_batches):
                    batch = to_device(next(batches), ctx.device)
                    with attention_scope(batch), loss_parallel_scope(model):  # a split vocabulary's loss
                        total += loss_fn(forward_batch(model, batch), batch).detach().float()
    finally:
        model.train(was_training)
    total /= validation.micro_batches
    dist.all_reduce(total)  # gloo has no AVG: sum, then divide
    loss = total.item() / ctx.world_size
    return {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else math.inf}


def make_validation(val: TokenData, *, seq_len: int, micro_batch: int, num_micro_batches: int, dp_rank: int,
                    dp_size: int, eval_batches: int, every: int,
                    wrap: Callable[[Iterator], Iterator] = lambda batches: batches) -> Validation:
    """The Validation of --val-data `val`: its first `eval_batches` global batches in file order, this rank's slice,
    each iterator passed through `wrap` (the plan's context-parallel split: runtime.plan.apply.plan_data_iter)."""

    def batches() -> Iterator:
        return wrap(token_batches(val, seq_len=seq_len, micro_batch=micro_batch, num_micro_batches=num_micro_batches,
                                  dp_rank=dp_rank, dp_size=dp_size, seed=0, shuffle=False,
                                  batches_needed=eval_batches, option="--val-data"))

    return Validation(batches, eval_batches * num_micro_batches, every)
