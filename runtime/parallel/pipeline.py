"""Pipeline parallelism: the model cut into stages at the plan's boundaries, run by a
torch.distributed.pipelining schedule (GPipe, 1F1B or interleaved 1F1B; docs/design.md decision 4).

    run = build_pipeline(model, mesh["pp"], stage_modules, "1f1b", num_micro_batches, loss_fn, example)
    loss = run.step(micro_batches)          # forward + backward of one optimizer step, on every pp rank
    grad_norm = run.clip_grad_norm_(1.0)    # the norm over all stages, as one process would compute it
    optimizer.step()                        # over run.parameters(): this rank's stages only

Layout (Megatron's, Narayanan et al. 2021, section 2.2): with pp pipeline ranks and v model chunks per
rank, stage s = c * pp + r is chunk c of pipeline rank r (torch's PipelineStage maps stage s to group
rank s % pp). GPipe and 1F1B run one stage per rank (v = 1); interleaved 1F1B runs v >= 2.

Parameters registered under several names (a tied output head: lm_head.weight is wte.weight) that end
up on several pipeline ranks have their gradients summed over those ranks after each step (Megatron's
embedding all-reduce); the norm for clipping counts them once. The losses of the micro-batches (the
model file's loss_fn(outputs, batch), a mean per micro-batch) are averaged, and so are the gradients
(each scaled by 1 / num_micro_batches), as one process accumulating the same micro-batches would.

The stage split (what a stage computes, the contract a model's forward must satisfy, check_split) is in
runtime/parallel/pipeline_split.py, the units and what stands in for them in runtime/parallel/pipeline_units.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from zplan.model.fused_layout import stored_layouts, to_original_state
from zplan.runtime.optim.grad_norm import scale_gradients_, total_norm_fp32
from zplan.runtime.optim.layouts import with_master_weights
from zplan.runtime.parallel.context_parallel import ContextParallelBatch
from zplan.runtime.parallel.grad_reduce import gradient_reducer
from zplan.runtime.parallel.pipeline_split import (
    MICRO_BATCH_INDEX,
    MicroBatches,
    PipelineChunk,
    _attach,
    batch_leaves,
    check_split,
    split_model,
)
from zplan.runtime.parallel.pipeline_split import run_stages as run_stages
from zplan.runtime.parallel.pipeline_units import PipelineSplitError, UnitRoles, _local, unit_roles
from zplan.runtime.parallel.vocab_parallel import loss_parallel_scope
from zplan.schemas.plan import Schedule
from zplan.schemas.spec import ActivationCompression

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}  # in
# torch.distributed.pipelining, imported when a schedule is built: it pulls in torch._dynamo (~1 s per process)


# ---- tied parameters across pipeline ranks -------------------------------------------------------


def _stage_of(name: str, stage_modules: Sequence[Sequence[str]]) -> int:
    return next(i for i, paths in enumerate(stage_modules) if any(name.startswith(p + ".") for p in paths))


def tied_parameters(model: nn.Module, stage_modules: Sequence[Sequence[str]], pp: int) -> list[tuple[str, ...]]:
    """Names of each parameter registered under several names whose names fall on more than one pipeline
    rank (e.g. ('wte.weight', 'lm_head.weight')), in a fixed order."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    tied = [tuple(names) for names in names_of.values()
            if len({_stage_of(name, stage_modules) % pp for name in names}) > 1]
    return sorted(tied)


# ---- the run -------------------------------------------------------------------------------------


class PipelineRun(nn.Module):
    """This pipeline rank's part of the model, and the schedule that trains it.

    As an nn.Module it holds this rank's stage modules under their original names (what the optimizer,
    checkpoints and state dicts see: 'blocks.2.ln1.weight', not 'chunks.0....'); forward is not used:
    call step(). `chunks` are the stage modules the schedule runs; data parallelism wraps them (DDP or
    fully_shard, each chunk like a model) before the first step(), which builds the PipelineStages.
    """

    def __init__(self, chunks: list[PipelineChunk], model: nn.Module, roles: UnitRoles, group: dist.ProcessGroup,
                 schedule: Schedule, num_micro_batches: int, loss_fn: Callable,
                 tied: list[tuple[str, ...]], stage_modules: Sequence[Sequence[str]]):
        super().__init__()
        _attach(self, model, [p for chunk in chunks for p in chunk._paths], roles.block_containers)
        self._chunks: list[nn.Module] = list(chunks)
        self._built_chunks = tuple(chunks)  # as built, before data parallelism wraps them (not registered)
        self._stage_indices = [chunk.stage_index for chunk in chunks]
        # stage 0's chunk as built (the wrappers of data parallelism replace it in `chunks`); in a tuple, so
        # that it is not registered as a submodule (its modules are already, under their own names)
        self._first_chunk = tuple(chunk for chunk in chunks if chunk.stage_index == 0)
        self._num_stages = len(stage_modules)
        self._group = group
        self._pp_rank, self._pp = dist.get_rank(group), dist.get_world_size(group)
        self._schedule_name = schedule
        self._num_micro_batches = num_micro_batches
        self._loss_fn = loss_fn
        self._loss_scale = 1.0  # step() sets it: the factor of fp16 loss scaling
        self._loss_batches = MicroBatches()  # step() sets them: the micro-batches the loss receives
        self._schedule = None
        self._micro_batches = chunks[0]._micro_batches  # shared by the chunks: what later stages read
        self._last_chunk = tuple(chunk for chunk in chunks if chunk.stage_index == self._num_stages - 1)
        # Tied parameters on several ranks: this rank's name of each, the pipeline ranks holding it, and
        # whether this rank counts it in the gradient norm (the first holder does).
        self._tied: list[tuple[str, list[int]]] = []
        self._tied_names: dict[str, str] = {}
        self._not_in_norm: set[str] = set()
        for names in tied:
            holders = sorted({_stage_of(n, stage_modules) % self._pp for n in names})
            if self._pp_rank not in holders:
                continue
            mine = next(n for n in names if _stage_of(n, stage_modules) % self._pp == self._pp_rank)
            self._tied.append((mine, holders))
            self._tied_names[mine] = names[0]
            if self._pp_rank != holders[0]:
                self._not_in_norm.add(mine)

    @property
    def chunks(self) -> list[nn.Module]:
        """This rank's stage modules (wrap them in place for data parallelism before the first step)."""
        return self._chunks

    @property
    def model_forward(self) -> Callable:
        """The model class's forward (unbound), which every stage runs: what it takes is what a batch holds."""
        return self._built_chunks[0]._skeleton_of[1]

    @property
    def num_micro_batches(self) -> int:  # per step(): this rank's slice of one global batch
        return self._num_micro_batches

    @property
    def stage_indices(self) -> list[int]:
        return list(self._stage_indices)

    @property
    def _device(self) -> torch.device:
        """Where this rank's stages compute: read when needed, as a model built on meta gets its weights
        after the split (runtime.training.materialize)."""
        return next(self.parameters()).device

    def weight_roots(self) -> list[nn.Module]:
        """The modules under which each tensor of this rank's stages appears with its model-file name:
        the stage modules and the model copies the first and last stage run (runtime.training.materialize)."""
        return [*self._built_chunks, *(chunk.skeleton for chunk in self._built_chunks)]

    @property
    def tied_names(self) -> dict[str, str]:
        """{this rank's name of a tied parameter: its first name in the whole model}, e.g. {'lm_head.weight':
        'wte.weight'} on the last rank. A checkpoint of the whole model keys a tied parameter's optimizer
        state by the first name only, so loading one on this rank must read that name's entries."""
        return dict(self._tied_names)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through PipelineRun.step(micro_batches), not forward()")

    def train(self, mode: bool = True) -> PipelineRun:
        super().train(mode)
        for chunk in self._chunks:
            chunk.train(mode)
        return self

    def _activation_examples(self, first_micro_batch: Any) -> dict[int, tuple[tuple, tuple]] | None:
        """(inputs, outputs) of each local stage for one micro-batch, as meta tensors: one forward of every
        stage, in stage order, under no_grad and through the chunks as wrapped for data parallelism (so
        mixed precision shows in the dtypes); each rank sends the shapes and dtypes of its outputs to the
        next stage's rank. None if an activation is a DTensor (sequence parallel): torch infers those.

        torch's own inference (PipelineStage without example tensors) also runs a backward, which breaks
        DDP's reducer with 2 chunks per rank (torch 2.13); the forward alone under no_grad does not."""

        def meta(t: torch.Tensor, grad: bool) -> torch.Tensor:
            t = torch.empty(t.shape, dtype=t.dtype, device="meta")
            return t.requires_grad_(True) if grad and t.is_floating_point() else t

        examples: dict[int, tuple[tuple, tuple]] = {}
        has_dtensor = False
        local = dict(zip(self._stage_indices, self._chunks, strict=True))
        self._micro_batches.batches = [first_micro_batch]
        outputs: tuple = ()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for stage in range(self._num_stages):
                if stage not in local:
                    continue
                if stage == 0:
                    inputs = tuple(batch_leaves(first_micro_batch)[0])
                elif stage - 1 in local:
                    inputs = outputs
                else:
                    received: list[Any] = [None]
                    dist.recv_object_list(received, group=self._group, group_src=(stage - 1) % self._pp)
                    inputs = tuple(torch.zeros(shape, dtype=dtype, device=self._device)
                                   for shape, dtype in received[0])
                result = local[stage](*inputs, **{MICRO_BATCH_INDEX: torch.zeros(1, dtype=torch.long)})
                outputs = result if isinstance(result, tuple) else (result,)
                has_dtensor |= any(isinstance(t, DTensor) for t in (*inputs, *outputs))
                examples[stage] = (tuple(meta(t, grad=stage > 0) for t in inputs),
                                   tuple(meta(t, grad=True) for t in outputs))
                if stage + 1 < self._num_stages and stage + 1 not in local:
                    shapes = [(tuple(t.shape), t.dtype) for t in outputs]
                    dist.send_object_list([shapes], group=self._group, group_dst=(stage + 1) % self._pp)
        return None if has_dtensor else examples

    def _build_schedule(self, first_micro_batch: Any):
        from torch.distributed import pipelining

        from zplan.runtime.parallel.pipeline_buffers import InFlightStage  # imports pipelining too

        examples = self._activation_examples(first_micro_batch)
        stages = []
        for chunk, index in zip(self._chunks, self._stage_indices, strict=True):
            inputs, outputs = examples[index] if examples else (None, None)
            # receive buffers for the micro-batches in flight only (runtime/parallel/pipeline_buffers.py)
            stages.append(InFlightStage(_as_stage_module(chunk), index, self._num_stages, self._device,
                                        input_args=inputs, output_args=outputs, group=self._group))
        schedule_class = getattr(pipelining, SCHEDULES[self._schedule_name])
        # scale_grads=False: step() divides the gradients by num_micro_batches itself, once per parameter
        # (torch scales per stage, twice for a parameter shared by two chunks of one rank).
        if schedule_class is pipelining.ScheduleInterleaved1F1B:
            return schedule_class(stages, self._num_micro_batches, loss_fn=self._micro_batch_loss,
                                  scale_grads=False)
        return schedule_class(stages[0], self._num_micro_batches, loss_fn=self._micro_batch_loss,
                              scale_grads=False)

    def _micro_batch_loss(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # The schedule hands the loss a slice of `target`; step() passes the micro-batch indices as target,
        # so that loss_fn receives the whole micro-batch (any structure), as in the non-pipelined loop.
        loss = self._loss_fn(self._last_chunk[0].outputs_for_loss(output), self._loss_batches.get(index))
        return loss * self._loss_scale

    def step(self, micro_batches: Sequence[Any], loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one optimizer step over `micro_batches` (num_micro_batches batches as the
        data iterator yields them, on the device; every pipeline rank passes the same ones). Gradients are
        the mean over the micro-batches of the gradients of loss * `loss_scale` (fp16 loss scaling:
        runtime.precision.loss_scale unscales them), tied gradients summed over ranks. Returns the mean loss
        (unscaled), on every pipeline rank."""
        if len(micro_batches) != self._num_micro_batches:
            raise ValueError(f"expected {self._num_micro_batches} micro-batches, got {len(micro_batches)}")
        # the loss gets each micro-batch as given; the stages its forward inputs (a context-parallel batch's inputs:
        # runtime.parallel.context_parallel, whose attention scope the caller holds around step)
        self._loss_batches.batches = list(micro_batches)
        micro_batches = [batch.inputs if isinstance(batch, ContextParallelBatch) else batch for batch in micro_batches]
        holds_first, holds_last = 0 in self._stage_indices, self._num_stages - 1 in self._stage_indices
        args: tuple = ()
        if holds_first:
            per_micro = [batch_leaves(batch) for batch in micro_batches]
            self._first_chunk[0]._batch_spec = per_micro[0][1]  # stage 0 rebuilds a micro-batch from its tensors
            # the schedule splits each tensor along dim 0 into num_micro_batches equal parts: these ones
            args = tuple(torch.cat(parts) for parts in zip(*(leaves for leaves, _ in per_micro), strict=True))
        with loss_parallel_scope(self):  # a split vocabulary's loss (and a forward computing it): the stages' passes
            if self._schedule is None:
                self._schedule = self._build_schedule(micro_batches[0])
            self._micro_batches.batches = list(micro_batches)
            self._loss_scale = loss_scale
            target = torch.arange(self._num_micro_batches) if holds_last else None
            losses: list[torch.Tensor] = []
            self._schedule.step(*args, target=target, losses=losses if holds_last else None, return_outputs=False,
                                **{MICRO_BATCH_INDEX: torch.arange(self._num_micro_batches)})  # an index a stage call
        self._micro_batches.batches, self._loss_batches.batches = [], []
        for chunk in self.chunks:  # tensor parallel's data-parallel reductions done (DDP waits in its backward)
            reducer = gradient_reducer(chunk)
            if reducer is not None:
                reducer.wait()
        for param in self.parameters():  # unique parameters of this rank
            if param.grad is not None:
                param.grad.div_(self._num_micro_batches)
        for name, holders in self._tied:
            grad = self.get_parameter(name).grad
            self._sum_over_ranks(grad.to_local() if isinstance(grad, DTensor) else grad, holders)
        loss = (torch.stack([x.detach().float() for x in losses]).mean() / loss_scale if holds_last
                else torch.zeros((), device=self._device))
        dist.broadcast(loss, group=self._group, group_src=(self._num_stages - 1) % self._pp)
        return loss

    def evaluate(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        from zplan.runtime.parallel.pipeline_eval import evaluate_pipeline  # the validation loss, forward only
        return evaluate_pipeline(self, micro_batches)

    def _sum_over_ranks(self, local: torch.Tensor, holders: list[int]) -> None:
        """local <- the sum of `local` over the pipeline ranks `holders`, added in rank order on each (so the
        copies stay bit-identical). Point-to-point over the pp group: no process group per tied parameter. Two
        holders (a tied embedding and head) add in place: a + b is b + a to the bit, so one received copy is the
        only temporary."""
        others = [r for r in holders if r != self._pp_rank]
        received = {r: torch.empty_like(local) for r in others}
        ops = [dist.P2POp(dist.isend, local, group=self._group, group_peer=r) for r in others]
        ops += [dist.P2POp(dist.irecv, received[r], group=self._group, group_peer=r) for r in others]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if len(holders) == 2:
            local.add_(received[others[0]])
            return
        parts = {**received, self._pp_rank: local.clone()}
        total = parts[holders[0]]
        for r in holders[1:]:
            total = total + parts[r]
        local.copy_(total)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole pipeline: the norm of all stages' gradients (tied
        ones counted once, accumulated in fp32), the same on every rank; grads scaled by min(1, max_norm / (norm +
        1e-6)).
        max_norm <= 0 or inf: only the norm."""
        named = [(name, p) for name, p in self.named_parameters() if p.grad is not None]
        counted = [p.grad for name, p in named if name not in self._not_in_norm]
        # in fp32: 16-bit gradients may still carry an fp16 loss scale (runtime.training.loop)
        local = total_norm_fp32(counted, norm_type).to(self._device)
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._group)
            total = local
        else:
            power = local**norm_type
            dist.all_reduce(power, group=self._group)
            total = power ** (1.0 / norm_type)
        if max_norm > 0 and not math.isinf(max_norm):  # on the device, no value read back (nor a sync)
            scale_gradients_([p for _, p in named], max_norm, total)
        return total


class _ShardedStage(nn.Module):
    """An FSDP2 chunk (ZeRO 2/3) as torch.distributed.pipelining sees it: a plain module. Given an FSDPModule, the
    pipeline stage keeps every unit's parameters gathered and its gradients unsharded from the first micro-batch's
    backward to the step's end, reducing once (set_reshard_after_backward / set_requires_gradient_sync False):
    measured by the dry run, 6 bytes a parameter of the stage more than ZeRO-3 holds (70B, tp 4 x pp 2, 61.5 GiB for
    11.7 planned). Seen as a plain module, the chunk runs as ZeRO 2/3 run outside a pipeline and as the planner
    prices them: each unit's gradients reduce-scattered every micro-batch, ZeRO-3's parameters gathered for each
    forward and backward and freed after."""

    def __init__(self, chunk: nn.Module):
        super().__init__()
        self.chunk = chunk

    def forward(self, *args, **kwargs):
        return self.chunk(*args, **kwargs)


def _as_stage_module(chunk: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FSDPModule

    return _ShardedStage(chunk) if isinstance(chunk, FSDPModule) else chunk


def _process_group(pp: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    return pp.get_group() if isinstance(pp, DeviceMesh) else pp


def build_pipeline(
    model: nn.Module,
    pp: DeviceMesh | dist.ProcessGroup,
    stage_modules: Sequence[Sequence[str]],
    schedule: Schedule,
    num_micro_batches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_micro_batch: Any,
    activation_compression: ActivationCompression = "none",
) -> PipelineRun:
    """This rank's stages of `model` and `schedule` over them (module docstring).

    stage_modules[s]: the module paths of stage s (plan units expanded with stage_module_paths); with
    interleaved 1F1B, len(stage_modules) = v * pp and stage s is chunk s // pp of pipeline rank s % pp.
    loss_fn(outputs, micro_batch) -> scalar mean over the micro-batch (the model file's loss_fn).
    activation_compression: 'none', or 'int8': hidden states and their gradients travel between stages as int8
    (runtime.compression.activations).
    example_micro_batch: a batch the model takes, e.g. the model file's example_inputs(micro_batch,
    seq_len); used to check the split (check_split). The stages learn their activations' shapes and
    dtypes at the first step(), from its first micro-batch through the chunks as data parallelism wrapped
    them (PipelineRun._activation_examples). Every rank passes the whole model, on the meta device (as
    runtime.training.materialize.build_meta_model makes it: materialize_weights then fills only this rank's stages)
    or real; drop the reference to `model` afterwards so that only this rank's stages stay in memory.
    """
    if schedule not in SCHEDULES:
        raise PipelineSplitError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    group = _process_group(pp)
    pp_size, pp_rank = dist.get_world_size(group), dist.get_rank(group)
    num_stages = len(stage_modules)
    if num_stages % pp_size:
        raise PipelineSplitError(f"{num_stages} stages cannot be spread evenly over {pp_size} pipeline ranks")
    chunks_per_rank = num_stages // pp_size
    if schedule != "interleaved-1f1b" and chunks_per_rank != 1:
        raise PipelineSplitError(f"{schedule} runs one stage per pipeline rank: got {num_stages} stages for "
                                 f"{pp_size} ranks (use interleaved-1f1b for {chunks_per_rank} chunks per rank)")
    if schedule == "1f1b" and num_micro_batches < num_stages:
        raise PipelineSplitError(f"1F1B needs at least as many micro-batches as stages: {num_micro_batches} "
                                 f"< {num_stages}")
    if schedule == "interleaved-1f1b" and num_micro_batches % max(1, num_micro_batches // pp_size):
        raise PipelineSplitError(f"interleaved 1F1B needs num_micro_batches ({num_micro_batches}) to be a "
                                 f"multiple of num_micro_batches // pp ({num_micro_batches // pp_size})")
    roles = unit_roles(model, stage_modules)
    chunks = split_model(model, stage_modules, roles, activation_compression)
    device = _local(next(model.parameters())).device  # meta for a model built on meta
    example_micro_batch = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                                          example_micro_batch)
    # the split is checked exactly, without the (lossy) int8 activations
    check_split(model, split_model(model, stage_modules, roles) if activation_compression != "none" else chunks,
                example_micro_batch)
    mine = [chunks[s] for s in range(pp_rank, num_stages, pp_size)]
    tied = tied_parameters(model, stage_modules, pp_size)
    return PipelineRun(mine, model, roles, group, schedule, num_micro_batches, loss_fn, tied, stage_modules)


# ---- helpers for the emitted script --------------------------------------------------------------


def stage_module_paths(stage_layer_names: Sequence[Sequence[str]], layers: Sequence[Any]) -> list[list[str]]:
    """The plan's stages (unit names, Stage.layer_names) as module paths: each unit's LayerCost.modules
    (e.g. 'embedding' -> ['wte', 'wpe']), or the unit name itself when it lists none (a hand-made plan
    whose units are module paths)."""
    modules_of = {layer.name: list(layer.modules) for layer in layers}
    return [[path for name in names for path in (modules_of.get(name) or [name])] for names in stage_layer_names]


def gather_full_state_dict(run: PipelineRun, optimizer: torch.optim.Optimizer | None = None
                           ) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict (full CPU tensors, original names and order; a 16-bit parameter's fp32 master
    where `optimizer` keeps one: runtime.optim.layouts) on pipeline rank 0, None on the others. Collective over the
    pipeline group, and over data/tensor parallel meshes for DTensors."""
    local = {}
    for name, tensor in with_master_weights(run.state_dict(), optimizer)[0].items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        local[name] = full.detach().cpu()
    layouts = {name: layout for root in run.weight_roots() for name, layout in stored_layouts(root).items()}
    local = to_original_state(local, layouts)  # fused projections in the model file's order
    gathered: list[dict | None] = [None] * run._pp if run._pp_rank == 0 else None
    dist.gather_object(local, gathered, group=run._group, group_dst=0)
    if run._pp_rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return merged


def apply_pipeline(
    model: nn.Module, pp_mesh: DeviceMesh, stage_layer_names: list[list[str]], schedule: Schedule, *,
    units=(), num_micro_batches: int = 1, loss_fn=None, example_micro_batch=None, activation_compression="none",
) -> nn.Module:
    """Keep this rank's pipeline stages (units `stage_layer_names[stage]`; stage s is chunk s // pp of
    pipeline rank s % pp) and run `schedule` over them: a runtime.parallel.pipeline.PipelineRun, trained through
    its step() (runtime.training.loop does). `units`: the plan's LayerCost list (unit name -> module paths).
    activation_compression 'int8': hidden states and their gradients cross stages as int8."""
    if pp_mesh.size() == 1:
        return model
    stages = stage_module_paths(stage_layer_names, units)
    return build_pipeline(model, pp_mesh, stages, schedule, num_micro_batches, loss_fn, example_micro_batch,
                          activation_compression)
