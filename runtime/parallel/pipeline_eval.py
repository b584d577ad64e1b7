"""The validation forward of a pipeline (PipelineRun.evaluate): its stages run forward only, outside the schedule.

The schedule is not used, so nothing of training's is touched (its stages' buffers and state, the loss scale, the
micro-batches of step()): one micro-batch after the other, each rank runs its stages in stage order through the
chunks as data parallelism wrapped them, and a hidden state crossing to another rank goes point to point over the
pipeline group, its shapes and dtypes first. The last stage computes loss_fn(outputs, micro-batch) of each; their mean
is broadcast from its rank, as PipelineRun.step's is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zplan.runtime.parallel.context_parallel import ContextParallelBatch
from zplan.runtime.parallel.pipeline_split import MICRO_BATCH_INDEX, batch_leaves
from zplan.runtime.parallel.pipeline_units import PipelineSplitError
from zplan.runtime.parallel.vocab_parallel import loss_parallel_scope

_DTENSOR_BETWEEN_STAGES = ("a pipeline stage's output is a DTensor: the validation forward (PipelineRun.evaluate) "
                           "passes plain tensors between stages, as the runtime's tensor and sequence parallel leave "
                           "them at each stage end (runtime/parallel/tensor_parallel.py)")


def evaluate_pipeline(run, micro_batches: Sequence[Any]) -> torch.Tensor:
    """The mean loss of `micro_batches` (any number, as the data iterator yields them, on the device; every
    pipeline rank passes the same ones), forward only under no_grad: the validation loss (runtime/training/
    validation.py, which puts the model in eval mode around it) of the PipelineRun `run`. Returns it (fp32 scalar)
    on every pipeline rank (module docstring)."""
    local = dict(zip(run._stage_indices, run._chunks, strict=True))
    last = run._num_stages - 1
    inputs = [batch.inputs if isinstance(batch, ContextParallelBatch) else batch for batch in micro_batches]
    saved_batches = run._micro_batches.batches
    saved_spec = run._first_chunk[0]._batch_spec if run._first_chunk else None
    total = torch.zeros((), device=run._device)  # fp32: the sum of the micro-batch losses (last stage's rank)
    run._micro_batches.batches = inputs  # what stages after the first read by index
    try:
        with torch.no_grad(), loss_parallel_scope(run):  # a split vocabulary's loss
            for index, batch in enumerate(inputs):
                kwargs = {MICRO_BATCH_INDEX: torch.tensor([index])}  # (1,): as the schedule hands it each stage
                hidden: tuple = ()
                for stage in sorted(local):
                    if stage == 0:
                        leaves, run._first_chunk[0]._batch_spec = batch_leaves(batch)
                        args = tuple(leaves)
                    elif stage - 1 in local:
                        args = hidden
                    else:
                        args = _receive_hidden(run, (stage - 1) % run._pp)
                    output = local[stage](*args, **kwargs)
                    hidden = output if isinstance(output, tuple) else (output,)
                    if stage == last:  # the model's output object where it returned one (outputs_for_loss)
                        loss = run._loss_fn(run._last_chunk[0].outputs_for_loss(output), micro_batches[index])
                        total += loss.detach().float()
                    elif stage + 1 not in local:
                        _send_hidden(run, hidden, (stage + 1) % run._pp)
    finally:
        run._micro_batches.batches = saved_batches
        if run._first_chunk:
            run._first_chunk[0]._batch_spec = saved_spec
    total /= max(1, len(micro_batches))
    dist.broadcast(total, group=run._group, group_src=last % run._pp)
    return total

def _send_hidden(run, tensors: tuple[torch.Tensor, ...], dst: int) -> None:
    """evaluate_pipeline(): a stage's outputs to the next stage's pipeline rank `dst`: [(shape, dtype), ...] first."""
    plain = not any(isinstance(t, DTensor) for t in tensors)
    meta = [(tuple(t.shape), t.dtype) for t in tensors] if plain else None
    dist.send_object_list([meta], group=run._group, group_dst=dst)
    if not plain:  # both ranks stop (the receiver reads None): neither waits on the other
        raise PipelineSplitError(_DTENSOR_BETWEEN_STAGES)
    for t in tensors:
        dist.send(t.contiguous(), group=run._group, group_dst=dst)

def _receive_hidden(run, src: int) -> tuple[torch.Tensor, ...]:
    """evaluate_pipeline(): the outputs of the stage before, from pipeline rank `src` (_send_hidden)."""
    meta: list[Any] = [None]
    dist.recv_object_list(meta, group=run._group, group_src=src)
    if meta[0] is None:
        raise PipelineSplitError(_DTENSOR_BETWEEN_STAGES)
    received = []
    for shape, dtype in meta[0]:
        t = torch.empty(shape, dtype=dtype, device=run._device)
        dist.recv(t, group=run._group, group_src=src)
        received.append(t)
    return tuple(received)
