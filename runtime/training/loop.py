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

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
from zplan.runtime.data.position import data_record, resume_data
from zplan.runtime.launch.distributed import RunContext
from zplan.runtime.training.memory_tiers import describe as describe_tiers
from zplan.runtime.training.memory_tiers import state_bytes_by_tier
from zplan.runtime.training.run_log import PlanFigures, mfu_of, open_log, print_summary, progress_bar
from zplan.runtime.training.step import clear_gradients, flush_optimizer, loss_scaler, model_state_bytes, optimizer_step
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
    tensorboard: str | Path | None = None  # a folder of TensorBoard event files, the same scalars (rank 0)
    checkpoint: CheckpointConfig | None = None
    figures: PlanFigures = PlanFigures()
    allow_nonfinite_loss: bool = False  # go on after a NaN or infinite loss (its state is never checkpointed)
    # --data (runtime/data): its TokenBatches, whose position checkpoints record and a resume goes on from; its path;
    # --allow-other-data; --val-data's Validation (runtime/training/validation.py: due, run)
    data: Any = None
    data_path: str | Path | None = None
    allow_other_data: bool = False
    validation: Any = None


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data_iter: Iterator, loss_fn: Callable,
          config: TrainConfig, ctx: RunContext) -> list[float]:
    """Run optimizer steps up to `config.steps` in all; return the loss of each step run (mean over the global
    batch, every rank). With `config.checkpoint.resume`, start after the checkpoint's step; with
    `config.checkpoint.directory`, save there after every `checkpoint.every` steps and after the last.

    Rank 0 shows its progress, writes one JSON line per step to `config.log_json` (step, loss, lr,
    grad_norm, tokens_per_s, step_time_s, mfu, predicted_mfu, predicted_step_time_s, model_state_bytes,
    predicted_model_state_bytes) and their scalars to `config.tensorboard`, and prints measured against predicted
    at the end.
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
            # --data goes on at its recorded position (any layout); synthetic data or a hook is replayed
            data_note = resume_data(config.data, config.data_path, loaded.train_state.get("data"), start_step,
                                    loaded.path, allow_other=config.allow_other_data)
            if config.data is None:
                _fast_forward(data_iter, loaded.rank_state.get("data"), start_step, num_micro_batches)
            if data_note and ctx.is_main:
                print(f"zplan: note: {data_note}", flush=True)
            restore_rng_state(loaded.rank_state, ctx.device)  # after the fast-forward, which may draw
            if ctx.is_main:
                print(f"zplan: resumed from {loaded.path} (step {start_step} of {steps})", flush=True)
    except BaseException:  # a refused resume: the lock goes now, not only with the process (an in-process caller)
        run_lock.release()
        raise
    log_file = open_log(config.log_json, ctx, start_step, config.tensorboard)  # JSON lines and TensorBoard
    losses: list[float] = []
    step_times_s: list[float] = []
    state_bytes: dict[str, int] = {}
    tiers: dict[str, int] = {}
    model.train()
    try:
        with progress_bar(ctx, steps, start_step) as progress:  # a bar on a terminal, else a line per step
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
                if config.validation is not None and config.validation.due(step + 1, steps):
                    record.update(config.validation.run(model, loss_fn, ctx))  # val_loss, val_ppl (collective)
                    if ctx.is_main:
                        progress.console.print(f"step {step + 1}: val_loss {record['val_loss']:.4f}  val_ppl "
                                               f"{record['val_ppl']:.2f}", soft_wrap=True, highlight=False)
                if log_file:
                    log_file.write(record)
                progress.show(record)
                finite = math.isfinite(loss_value)  # all-reduced: the same on every rank
                if not finite:
                    _nonfinite_loss(loss_value, step + 1, last_checkpoint, checkpoint, config.allow_nonfinite_loss,
                                    ctx, progress.console)
                if checkpoint is not None and checkpoint.should_save(step + 1, steps) and finite:
                    flush_optimizer(optimizer)  # a delayed update in flight belongs to this checkpoint
                    save_start = time.perf_counter()
                    saved = save_checkpoint(
                        checkpoint.directory, step + 1, model, optimizer, ctx, keep=checkpoint.keep,
                        layout=layout, rank_state={"scaler": scaler.state_dict() if scaler else None},
                        data_state=data_iter.state_dict() if hasattr(data_iter, "state_dict") else None,
                        loss=loss_value, unverified_origin=unverified_origin, model_ref=checkpoint.model_ref,
                        data_position=(data_record(config.data, config.data_path, step + 1)
                                       if config.data is not None else None),
                    )
                    last_checkpoint = saved
                    if ctx.is_main:
                        progress.console.print(f"checkpoint {saved} ({time.perf_counter() - save_start:.2f} s)",
                                               soft_wrap=True, highlight=False)
                pause_if_requested("after-step", step + 1)
        flush_optimizer(optimizer)  # the last step's delayed update lands before the weights are read
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
