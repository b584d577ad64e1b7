"""The training loop of the emitted script: gradient accumulation, clipping, LR schedule, logging (run_log.py shows it).

One optimizer step = `num_micro_batches` forward/backward passes of `micro_batch` sequences on every
data-parallel rank; the loss of each micro-batch is divided by num_micro_batches, and DDP / FSDP2
average gradients over ranks, so the gradient is the mean over the global batch, as in one process.

Checkpoints (runtime/checkpoint/save.py) are taken between optimizer steps. A resumed run continues as the
interrupted one would have: model and optimizer states from the checkpoint, the LR from the schedule
at the checkpoint's step, the data iterator at that step (its load_state_dict when it has one, else the
micro-batches before are replayed and dropped), the RNG and the loss scaler as they were.

A loss that is NaN or infinite stops the run (NonFiniteLossError, exit status 2) before anything is saved, so the
last checkpoint stays the last good state; with allow_nonfinite_loss (--allow-nonfinite-loss) the run goes on, but
a checkpoint due after a step whose loss was not finite is not written.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from zplan.errors import ZplanError
from zplan.runtime.checkpoint.run_lock import lock_checkpoint_dir
from zplan.runtime.checkpoint.save import (
    LATEST,
    LATEST_VALID,
    CheckpointConfig,
    latest_checkpoint,
    latest_valid_checkpoint,
    load_checkpoint,
    pause_if_requested,
    restore_rng_state,
    save_checkpoint,
)
from zplan.runtime.launch.distributed import RunContext
from zplan.runtime.optim.grad_norm import total_norm_fp32
from zplan.runtime.parallel.context_parallel import ContextParallelBatch
from zplan.runtime.parallel.data_parallel import keeps_parameters_gathered
from zplan.runtime.parallel.grad_reduce import gradient_reducer
from zplan.runtime.parallel.pipeline import PipelineRun
from zplan.runtime.precision.loss_scale import LossScaler
from zplan.runtime.training.memory_tiers import describe as describe_tiers
from zplan.runtime.training.memory_tiers import resident_bytes, state_bytes_by_tier
from zplan.runtime.training.run_log import PlanFigures, mfu_of, open_log, print_summary, progress_bar
from zplan.schemas.spec import Precision

ALLOW_NONFINITE_LOSS_FLAG = "--allow-nonfinite-loss"  # train.py's


class NonFiniteLossError(ZplanError):
    """A step's loss was NaN or infinite: the run stopped before saving that state."""


@dataclass(frozen=True)
class WarmupCosine:
    """Learning rate at optimizer step `step` (0-based): linear warmup, cosine to min_lr_ratio * max_lr."""

    max_lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.max_lr * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        min_lr = self.min_lr_ratio * self.max_lr
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.max_lr - min_lr)


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


def _to_device(batch, device: torch.device):
    if isinstance(batch, (torch.Tensor, ContextParallelBatch)):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
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


def _flush(optimizer: torch.optim.Optimizer) -> None:
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


def _grad_sync(model: nn.Module, last_micro_batch: bool):
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


def _attention_scope(batch):
    """Context parallel: its attention over the whole sequence during the forward and backward (which recomputes
    under activation recompute) of this rank's part of it (runtime.parallel.context_parallel); otherwise nothing."""
    return batch.attention() if isinstance(batch, ContextParallelBatch) else contextlib.nullcontext()


def _chunks(model: nn.Module) -> list[nn.Module]:
    return model.chunks if isinstance(model, PipelineRun) else [model]


def clear_gradients(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After a step: DDP's gradients, and the tensor-parallel reducer's, are views of their buckets
    (runtime.parallel.data_parallel, runtime.parallel.grad_reduce), zeroed in place so that the next step's
    micro-batches accumulate into them; every other gradient is dropped (set_to_none)."""
    in_buckets = any(isinstance(c, DistributedDataParallel) or gradient_reducer(c) for c in _chunks(model))
    optimizer.zero_grad(set_to_none=not in_buckets)


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
        micro_batches = [_to_device(next(data_iter), device) for _ in range(num_micro_batches)]
        with _attention_scope(micro_batches[0]):  # context parallel: one rank's positions in every micro-batch
            loss_sum += model.step(micro_batches, loss_scale=scaler.factor if scaler else 1.0)
    for micro in range(0 if pipelined else num_micro_batches):
        batch = _to_device(next(data_iter), device)
        with _grad_sync(model, last_micro_batch=micro == num_micro_batches - 1), _attention_scope(batch):
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
                     else torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
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


def _checkpoint_to_resume(checkpoint: CheckpointConfig | None, ctx: RunContext) -> Path | None:
    """The checkpoint to load, decided on rank 0 so that every rank loads the same one."""
    if checkpoint is None or checkpoint.resume is None:
        return None
    choice: list[str | None] = [None]
    if ctx.is_main:
        if checkpoint.resume in (LATEST, LATEST_VALID):
            if checkpoint.resume == LATEST:
                newest, skipped = latest_checkpoint(checkpoint.directory), []
            else:  # every file of each candidate checked against its manifest, newest first
                newest, skipped = latest_valid_checkpoint(checkpoint.directory)
            for reason in skipped:
                print(f"zplan: --resume {LATEST_VALID}: passing over {reason}", flush=True)
            if newest is None:
                print(f"zplan: no {'valid' if skipped else 'complete'} checkpoint in {checkpoint.directory} yet: "
                      "starting from step 0", flush=True)
            choice = [str(newest) if newest else None]
        else:
            choice = [str(checkpoint.resume)]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


def _fast_forward(data_iter: Iterator, data_state, steps_done: int, num_micro_batches: int) -> None:
    """Put the data iterator where it stood after `steps_done` optimizer steps."""
    if data_state is not None and hasattr(data_iter, "load_state_dict"):
        data_iter.load_state_dict(data_state)
        return
    for _ in range(steps_done * num_micro_batches):
        next(data_iter)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of train(): the batch shape and precision (runtime.plan.apply.train_config reads them from the
    plan), the run's length, clipping, schedule, log and checkpoints."""

    steps: int  # optimizer steps in all (a resumed run goes on to this)
    micro_batch: int  # sequences per micro-batch per data-parallel rank
    num_micro_batches: int  # micro-batches per optimizer step (gradient accumulation)
    seq_len: int
    data_parallel_size: int
    grad_clip: float  # max gradient norm; <= 0: no clipping
    lr_schedule: Callable[[int], float]  # optimizer step (0-based) -> learning rate
    precision: Precision = "fp32"
    log_json: str | Path | None = None  # one JSON line per step (rank 0)
    checkpoint: CheckpointConfig | None = None
    figures: PlanFigures = PlanFigures()
    allow_nonfinite_loss: bool = False  # go on after a NaN or infinite loss (its state is never checkpointed)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data_iter: Iterator, loss_fn: Callable,
          config: TrainConfig, ctx: RunContext) -> list[float]:
    """Run optimizer steps up to `config.steps` in all; return the loss of each step run (mean over the global
    batch, every rank). With `config.checkpoint.resume`, start after the checkpoint's step; with
    `config.checkpoint.directory`, save there after every `checkpoint.every` steps and after the last.

    Rank 0 shows a progress bar, writes one JSON line per step to `config.log_json` (step, loss, lr,
    grad_norm, tokens_per_s, step_time_s, mfu, predicted_mfu, predicted_step_time_s, model_state_bytes,
    predicted_model_state_bytes) and prints measured against predicted at the end.
    MFU = model_flops_per_step / (step_time_s * world_size * peak_flops)  (PaLM, Appendix B).
    """
    steps, num_micro_batches, micro_batch = config.steps, config.num_micro_batches, config.micro_batch
    data_parallel_size, checkpoint, figures = config.data_parallel_size, config.checkpoint, config.figures
    tokens_per_step = micro_batch * num_micro_batches * data_parallel_size * config.seq_len
    scaler = loss_scaler(model, optimizer, config.precision, ctx.device)
    # What a rank file's data-iterator and RNG state depend on: restored only under the same layout.
    layout = {"data_parallel_size": data_parallel_size, "num_micro_batches": num_micro_batches,
              "micro_batch": micro_batch}
    # one run at a time in a checkpoint folder, held from before a resume reads it to the end
    # (runtime/checkpoint/run_lock.py)
    run_lock = lock_checkpoint_dir(checkpoint.directory if checkpoint is not None else None, ctx)
    start_step = 0
    last_checkpoint, unverified_origin = None, None  # the checkpoint a NaN loss leaves as the last; why not verified
    try:
        resume_from = _checkpoint_to_resume(checkpoint, ctx)
        if resume_from is not None:
            loaded = load_checkpoint(resume_from, model, optimizer, ctx, layout=layout,
                                     verify=checkpoint.resume != LATEST_VALID,  # latest-valid: verified when chosen
                                     allow_unverified=checkpoint.allow_unverified, total_steps=steps)
            start_step = loaded.step
            last_checkpoint, unverified_origin = loaded.path, loaded.unverified_origin
            if scaler is not None and loaded.rank_state.get("scaler") is not None:
                scaler.load_state_dict(loaded.rank_state["scaler"])
            _fast_forward(data_iter, loaded.rank_state.get("data"), start_step, num_micro_batches)
            restore_rng_state(loaded.rank_state, ctx.device)  # after the fast-forward, which may draw
            if ctx.is_main:
                print(f"zplan: resumed from {loaded.path} (step {start_step} of {steps})", flush=True)
    except BaseException:  # a refused resume: the lock goes now, not only with the process (an in-process caller)
        run_lock.release()
        raise
    log_file = open_log(config.log_json, ctx, start_step)
    losses: list[float] = []
    step_times_s: list[float] = []
    state_bytes: dict[str, int] = {}
    tiers: dict[str, int] = {}
    model.train()
    try:
        with progress_bar(ctx) as progress:
            task = progress.add_task("train", total=steps, completed=start_step, status="")
            for step in range(start_step, steps):
                start = time.perf_counter()
                lr = config.lr_schedule(step)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                phases: dict = {}
                loss_sum, grad_norm = optimizer_step(model, optimizer, data_iter, loss_fn, num_micro_batches,
                                                     config.grad_clip, scaler, ctx.device, phases)
                if step == start_step:
                    state_bytes = model_state_bytes(model, optimizer)
                    tiers = state_bytes_by_tier(model, optimizer, ctx.device)
                clear_gradients(model, optimizer)
                # gloo has no AVG: sum, then divide; under context parallel each rank holds cp times its share of its
                # sequences' loss (runtime.parallel.context_parallel), so this is the global mean there too
                dist.all_reduce(loss_sum)
                loss_value = loss_sum.item() / ctx.world_size
                step_time_s = time.perf_counter() - start
                losses.append(loss_value)
                step_times_s.append(step_time_s)
                mfu = mfu_of(figures.model_flops_per_step, step_time_s, ctx.world_size, figures.peak_flops)
                record = {
                    "step": step + 1,
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": tokens_per_step / step_time_s,
                    "step_time_s": step_time_s,
                    "phases_s": phases,  # optimizer_step's forward + backward and optimizer, this rank
                    "mfu": mfu,
                    "predicted_mfu": figures.mfu,
                    "predicted_step_time_s": figures.step_time_s,
                    "model_state_bytes": sum(state_bytes.values()),
                    "predicted_model_state_bytes": figures.model_state_bytes,
                    "state_bytes_by_tier": tiers,
                    "predicted_state_bytes_by_tier": figures.state_bytes_by_tier,
                }
                if log_file:
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                progress.update(
                    task, advance=1,
                    status=f"loss {loss_value:.4f}  {record['tokens_per_s']:,.0f} tok/s  mfu {mfu:.1%}",
                )
                finite = math.isfinite(loss_value)  # all-reduced: the same on every rank
                if not finite:
                    _nonfinite_loss(loss_value, step + 1, last_checkpoint, checkpoint, config.allow_nonfinite_loss,
                                    ctx, progress.console)
                if checkpoint is not None and checkpoint.should_save(step + 1, steps) and finite:
                    _flush(optimizer)  # a delayed update in flight belongs to this checkpoint
                    save_start = time.perf_counter()
                    saved = save_checkpoint(
                        checkpoint.directory, step + 1, model, optimizer, ctx, keep=checkpoint.keep,
                        layout=layout, rank_state={"scaler": scaler.state_dict() if scaler else None},
                        data_state=data_iter.state_dict() if hasattr(data_iter, "state_dict") else None,
                        loss=loss_value, unverified_origin=unverified_origin,
                    )
                    last_checkpoint = saved
                    if ctx.is_main:
                        progress.console.print(f"checkpoint {saved} ({time.perf_counter() - save_start:.2f} s)",
                                               soft_wrap=True, highlight=False)
                pause_if_requested("after-step", step + 1)
        _flush(optimizer)  # the last step's delayed update lands before the weights are read
    finally:
        if log_file:
            log_file.close()
        run_lock.release()
    if ctx.is_main:
        print_summary(losses, step_times_s, state_bytes, figures, ctx)
        if losses and (tiers["host"] or tiers["nvme"] or figures.state_bytes_by_tier):
            print(describe_tiers(tiers, figures.state_bytes_by_tier, ctx.device), flush=True)
    return losses


def _nonfinite_loss(loss: float, step: int, last_checkpoint: Path | None, checkpoint: CheckpointConfig | None,
                    allowed: bool, ctx: RunContext, console) -> None:
    """A NaN or infinite loss at `step`: NonFiniteLossError (every rank), or with `allowed` a warning that the
    checkpoint due, if any, is not written."""
    if last_checkpoint is None and checkpoint is not None and checkpoint.directory is not None:
        last_checkpoint = latest_checkpoint(checkpoint.directory)
    last = (f"the last checkpoint, {last_checkpoint}, was not overwritten" if last_checkpoint is not None
            else "no checkpoint was written")
    if allowed:
        if ctx.is_main:
            console.print(f"zplan: warning: the loss of step {step} is {loss} ({ALLOW_NONFINITE_LOSS_FLAG}: going on); "
                          "no checkpoint is written of a step whose loss is not finite", soft_wrap=True,
                          highlight=False)
        return
    raise NonFiniteLossError(
        f"the loss of step {step} is {loss} (mean over the global batch): training stopped before saving that state; "
        f"{last}. Check the data and the model file, lower --lr, and resume from the last checkpoint; or give "
        f"{ALLOW_NONFINITE_LOSS_FLAG} to go on regardless (no checkpoint is written of a step whose loss is not "
        "finite)")
