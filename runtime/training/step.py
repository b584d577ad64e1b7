"""One optimizer step of the training loop: the micro-batches' forward and backward with gradient accumulation
(DDP's no_sync, FSDP2's reshard settings), fp16 loss scaling, clipping, the optimizer step and the gradients cleared
after it; and what the model states take per tier. runtime.training.loop runs it step after step; the dry run
(runtime.dryrun.dry_run) runs it on fake tensors."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from zplan.runtime.optim.grad_norm import clip_gradients_, total_norm_fp32
from zplan.runtime.parallel.context_parallel import ContextParallelBatch
from zplan.runtime.parallel.data_parallel import keeps_parameters_gathered
from zplan.runtime.parallel.grad_reduce import gradient_reducer
from zplan.runtime.parallel.pipeline import PipelineRun
from zplan.runtime.parallel.vocab_parallel import loss_parallel_scope
from zplan.runtime.precision.loss_scale import LossScaler
from zplan.runtime.training.memory_tiers import resident_bytes
from zplan.schemas.spec import Precision


def forward_batch(model: nn.Module, batch):
    """model(batch) for a tensor, model(*batch) for a tuple/list, model(**batch) for a dict (and for a context-parallel
    batch its inputs: runtime.parallel.context_parallel)."""
    if isinstance(batch, ContextParallelBatch):
        return model(**batch.inputs)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def to_device(batch, device: torch.device):
    if isinstance(batch, (torch.Tensor, ContextParallelBatch)):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in memory of parameters, gradients and optimizer states (its shards only; a
    state swapped to a file counts 0 here: runtime.training.memory_tiers)."""
    params = list({id(p): p for p in model.parameters()}.values())
    # sharded states (ZeRO 1: runtime.optim.layouts, ZeRO 2/3: FSDP2) are DTensors: their local shard counts; the fp32
    # masters of 16-bit parameters too where they are not states (the NVMe optimizer keeps them apart)
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    counted = {id(v) for v in states}
    states += [m for m in getattr(optimizer, "master_weights", dict)().values() if id(m) not in counted]
    return {
        "parameters": sum(resident_bytes(p) for p in params),
        "gradients": sum(resident_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(resident_bytes(v) for v in states),
    }


def flush_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Publish a delayed parameter update still running (runtime.optim.host_states); every rank."""
    flush = getattr(optimizer, "flush", None)
    if flush is not None:
        flush()


def loss_scaler(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, device: torch.device):
    """fp16 needs loss scaling (Micikevicius et al. 2018); bf16 and fp32 do not."""
    if precision != "fp16":
        return None
    # backward inside a pipeline's schedule, each rank with its stages' grads; or 16-bit gradients, unscaled by the
    # optimizer's step (runtime.precision.loss_scale)
    if isinstance(model, PipelineRun) or _unscaled_in_step(optimizer):
        return LossScaler(device)
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):  # sharded gradients: the inf check is all-reduced over ranks
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type)


def grad_sync(model: nn.Module, last_micro_batch: bool):
    """DDP all-reduces only after the last micro-batch (the others accumulate into its buckets: one copy; the
    tensor-parallel reducer counts the micro-batches itself: runtime.parallel.grad_reduce); FSDP2's fully_shard
    reduce-scatters each one (ZeRO keeps gradients sharded, so accumulating them unsharded would defeat it). ZeRO-2
    keeps its parameters gathered until the last micro-batch's backward
    (runtime.parallel.data_parallel.keeps_parameters_gathered)."""
    if isinstance(model, DistributedDataParallel) and not last_micro_batch:
        return model.no_sync()
    if keeps_parameters_gathered(model):
        model.set_reshard_after_backward(last_micro_batch)  # shards again before the optimizer step
    return contextlib.nullcontext()


def attention_scope(batch):
    """Context parallel: its attention over the whole sequence during the forward and backward (which recomputes
    under activation recompute) of this rank's part of it (runtime.parallel.context_parallel); otherwise nothing."""
    return batch.attention() if isinstance(batch, ContextParallelBatch) else contextlib.nullcontext()


def _chunks(model: nn.Module) -> list[nn.Module]:
    return model.chunks if isinstance(model, PipelineRun) else [model]


def clear_gradients(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After a step: DDP's gradients, and the tensor-parallel reducer's, are views of their buckets
    (runtime.parallel.data_parallel, runtime.parallel.grad_reduce), zeroed in place so that the next step's
    micro-batches accumulate into them; every other gradient is dropped (set_to_none)."""
    chunks = list(_chunks(model))
    reducers = [gradient_reducer(c) for c in chunks if gradient_reducer(c) is not None]
    for reducer in reducers:  # its buckets at once (their views may live on several meshes: expert parallel)
        reducer.zero_gradients()
    if not reducers:
        optimizer.zero_grad(set_to_none=not any(isinstance(c, DistributedDataParallel) for c in chunks))


def _unscaled_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """16-bit gradients of 16-bit parameters: the optimizer's step upcasts, unscales and clips them
    (runtime.optim.sharded_adamw.ShardedAdamW.grad_divisor)."""
    return getattr(optimizer, "unscales_gradients", False)


def _clip_in_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler, max_norm: float) -> torch.Tensor:
    """The gradients stay as the backward left them (16-bit, times the loss scale under fp16); their norm is taken
    in fp32, and the step divides them by the loss scale times torch's clipping factor, 1 / min(1, max_norm /
    (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_). Returns the unscaled norm, nothing read back to the host but
    an fp16 overflow check."""
    scale = scaler.factor if scaler else 1.0
    if isinstance(model, PipelineRun):  # the norm over all stages; max_norm inf: nothing scaled in place
        norm = model.clip_grad_norm_(math.inf)
    else:
        norm = total_norm_fp32(p.grad for p in model.parameters() if p.grad is not None)
    norm = norm / scale
    if scaler:
        scaler.note_overflow(norm)
    optimizer.grad_divisor = scale * torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    return norm


def _phase_end(device: torch.device) -> float:
    """Now, once the device has finished what was queued (a GPU runs ahead of the host): a phase boundary."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, data_iter: Iterator, loss_fn: Callable,
                   num_micro_batches: int, grad_clip: float, scaler, device: torch.device,
                   phases: dict | None = None):
    """One optimizer step as train() runs it (and the dry run, zplan.dryrun, on fake tensors): forward and backward
    of `num_micro_batches` micro-batches from `data_iter`, unscale, clip, step. Returns (loss_sum, grad_norm) as
    tensors, nothing read back to the host: loss_sum is this rank's sum of micro-batch losses / num_micro_batches.
    `phases`, when given, receives the seconds of the forward and backward with their gradient reduction
    ("forward_backward_s") and of the clipping and optimizer step ("optimizer_s"), the device synchronised at the
    boundary (zplan calibrate fits the profile to them)."""
    start = time.perf_counter() if phases is not None else 0.0
    pipelined = isinstance(model, PipelineRun)
    loss_sum = torch.zeros((), device=device)
    if pipelined:  # the schedule runs every micro-batch; the mean loss comes back on every rank
        micro_batches = [to_device(next(data_iter), device) for _ in range(num_micro_batches)]
        with attention_scope(micro_batches[0]):  # context parallel: one rank's positions in every micro-batch
            loss_sum += model.step(micro_batches, loss_scale=scaler.factor if scaler else 1.0)
    for micro in range(0 if pipelined else num_micro_batches):
        batch = to_device(next(data_iter), device)
        with grad_sync(model, last_micro_batch=micro == num_micro_batches - 1), attention_scope(batch), \
                loss_parallel_scope(model):  # a split vocabulary's loss: forward and backward
            loss = loss_fn(forward_batch(model, batch), batch) / num_micro_batches
            (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += loss.detach().float()
    reducer = gradient_reducer(model)  # tensor parallel's data-parallel all-reduces (a pipeline waits in its step)
    if reducer is not None:
        reducer.wait()
    backward_done = _phase_end(device) if phases is not None else 0.0
    max_norm = grad_clip if grad_clip > 0 else math.inf
    if _unscaled_in_step(optimizer):
        grad_norm = _clip_in_step(model, optimizer, scaler, max_norm)
    else:
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = (model.clip_grad_norm_(max_norm) if pipelined  # the norm over all stages
                     else clip_gradients_(model.parameters(), max_norm))
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if phases is not None:
        phases.update(forward_backward_s=backward_done - start, optimizer_s=_phase_end(device) - backward_done)
    return loss_sum, grad_norm
