"""plan.json applied to a model: the one place where a run learns what to do from its plan (docs/design.md decision 5).

    plan = load_plan(HERE / "plan.json"); check_plan(plan, model_path, ctx.world_size)   # before any collective
    mesh = plan_mesh(plan, ctx.device.type)
    model, weights = build_meta_model(model_file.build_model, seed=seed, device=ctx.device)
    model, materialized = parallelize(model, weights, mesh, plan, model_file, ctx.device)
    optimizer = plan_optimizer(model, mesh, plan, lr=lr, weight_decay=weight_decay, steps=steps)
    data = plan_data_iter(plan, mesh, make_data_iter(...), model)   # context parallel: this rank's part of each
    train(model, optimizer, data, plan_loss_fn(plan, model_file), train_config(plan, steps=steps, ...), ctx)

parallelize is the fixed order (torchtitan's parallelize_llama is the model: a short ordered function, the sharding
plans as data): zplan's executor of routed experts (runtime.parallel.experts) -> fp8 or NVFP4 GEMMs in the blocks'
Linears (precision fp8, runtime.precision.float8; nvfp4, runtime.precision.nvfp4) -> tensor parallel -> activation
recompute -> pipeline split -> no generation cache -> data parallel (ZeRO stage, mixed precision, offload, compression;
over mesh["dp_cp"] under context parallel: runtime.parallel.mesh), with the weights made before data parallelism under
ZeRO 0/1 (DDP needs real tensors) and after it under ZeRO 2/3 (only FSDP2's shards are made). Every setting comes from
the plan that check_plan validated, so an edit to plan.json is either checked and run, or refused. Offload follows the
placement: under ZeRO 2/3 the parameter (and gradient) shards go to the host only where plan.placement.parameters says
so; otherwise they stay on the device and only the optimizer is offloaded.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from zplan.errors import PlanMismatchError
from zplan.model.fused_layout import FusedLayout
from zplan.model.modules import disable_generation_cache
from zplan.runtime.checkpoint.save import CheckpointConfig
from zplan.runtime.launch.distributed import RunContext
from zplan.runtime.optim.build import build_optimizer
from zplan.runtime.parallel.context_parallel import (
    accepts_position_ids,
    context_parallel_loss,
    shard_batches,
    takes_attention_mask,
    token_ids_name,
)
from zplan.runtime.parallel.data_parallel import apply_data_parallel
from zplan.runtime.parallel.experts import apply_experts
from zplan.runtime.parallel.mesh import build_mesh, data_parallel_mesh
from zplan.runtime.parallel.pipeline import PipelineRun, apply_pipeline
from zplan.runtime.parallel.tensor_parallel import apply_tensor_parallel
from zplan.runtime.parallel.vocab_parallel import vocab_parallel_loss
from zplan.runtime.plan.check import device_mismatch
from zplan.runtime.precision.float8 import convert_blocks_to_float8, on_fake_tensors
from zplan.runtime.precision.nvfp4 import convert_blocks_to_nvfp4
from zplan.runtime.training.loop import PlanFigures, TrainConfig
from zplan.runtime.training.materialize import MaterializeReport, materialize_weights
from zplan.runtime.training.recompute import apply_recompute
from zplan.schemas.plan import Plan
from zplan.schemas.spec import ONE_BIT_WARMUP_STEPS


def warn_if_other_devices(plan: Plan, ctx: RunContext) -> str | None:
    """Rank 0: one warning line on stderr when this run's devices are not those the plan was made for
    (plan_check.device_mismatch: a GPU plan on CPU processes, a CPU plan on a GPU, another GPU). Returns the warning
    (every rank), or None."""
    name, memory = "", 0
    if ctx.device.type == "cuda":
        properties = torch.cuda.get_device_properties(ctx.device)
        name, memory = properties.name, properties.total_memory
    warning = device_mismatch(plan.cluster, ctx.device.type, name, memory)
    if warning and ctx.is_main:
        print(f"zplan: warning: {warning}", file=sys.stderr, flush=True)
    return warning


def plan_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The (pp, dp, cp, tp) device mesh of the plan, tp innermost (and its flattened "dp_cp" dim when cp > 1)."""
    p = plan.parallel
    return build_mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, device_type=device_type, ep=p.ep)


def parallelize(model: nn.Module, weights, mesh: DeviceMesh, plan: Plan, model_file, device: torch.device
                ) -> tuple[nn.Module, MaterializeReport]:
    """Apply `plan` to `model` (built on meta by build_meta_model, `weights` its recorded initialisation) in the
    fixed order (module docstring); returns the model to train and what making its weights took on this rank."""
    p, prefix, precision = plan.parallel, plan.model.block_prefix, plan.train.precision
    rules = plan.model.tp_rules
    fused = {rule.module: FusedLayout(parts=rule.parts, groups=rule.groups) for rule in rules if rule.parts}
    # The structural steps work on the meta model, outside any fake mode (the dry run's, runtime.dryrun.fake_world: a
    # fake mode that saw the meta parameters keeps weakrefs to them, and the weights' swap_tensors refuses such
    # tensors).
    fake = on_fake_tensors()  # the dry run (runtime.dryrun.fake_world)
    with unset_fake_temporarily():
        # routed experts run zplan's executor (runtime.parallel.experts), E / ep of them a rank under expert parallel
        apply_experts(model, mesh["ep"] if p.ep > 1 else None)
        tp_plan = {rule.module: rule.style for rule in rules}
        if precision == "fp8":  # the blocks' Linears to fp8 GEMMs first: torchao converts before TP and FSDP2
            # said once by rank 0 of a real run; the dry run's output is its own (zplan dryrun --json)
            convert_blocks_to_float8(model, prefix, device, say=(lambda message: None) if fake else _say_once,
                                     tp=p.tp, tp_plan=tp_plan)
        if precision == "nvfp4":  # likewise, NVFP4 GEMMs (tp 1: runtime.plan.check refuses more); the dry run
            # measures the GPU's code path (torch._scaled_mm's meta kernel), not the CPU's emulation
            convert_blocks_to_nvfp4(model, prefix, device, say=(lambda message: None) if fake else _say_once,
                                    tensor_cores=True if fake else None)
        model = apply_tensor_parallel(model, mesh["tp"], tp_plan, prefix, p.sequence_parallel, fused,
                                      stage_starts(plan), vocab=plan.model.vocab if p.vocab_parallel else 0)
        model = apply_recompute(model, p.recompute, prefix)
        model = apply_pipeline(model, mesh["pp"], [stage.layer_names for stage in plan.stages], p.schedule,
                               units=plan.model.layers, num_micro_batches=p.num_micro_batches,
                               loss_fn=plan_loss_fn(plan, model_file),
                               example_micro_batch=model_file.example_inputs(p.micro_batch, plan.train.seq_len),
                               activation_compression=p.compression.activations)
        # after the pipeline split, whose check on the meta device runs the forward as the model file builds it:
        # without its cache a Hugging Face forward reads the positions' values (a packed-sequence test), which meta
        # tensors do not have
        model = disable_generation_cache(model)
    replicated = p.zero_stage in (0, 1)
    if replicated:
        materialized = materialize_weights(model, weights, device)
    if p.cp > 1:  # the model file's forward gets each token's global position (runtime/parallel/context_parallel.py)
        _check_context_parallel_forward(model, p.cp)
    model = apply_data_parallel(model, data_parallel_mesh(mesh, p.cp), p.zero_stage, precision, p.offload, prefix,
                                grad_compression=p.compression.grad, weight_compression=p.compression.weights,
                                parameters_on_host=plan.placement.parameters != "gpu",
                                parameters_in_files=plan.placement.parameters == "nvme",
                                num_micro_batches=p.num_micro_batches,
                                expert_dp_mesh=mesh["edp"] if p.ep > 1 else None)
    if not replicated:
        materialized = materialize_weights(model, weights, device)
    return model, materialized


def model_forward(model: nn.Module):
    """The forward a batch is given to: the model's, a DDP-wrapped model's, or the one every pipeline stage runs."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, PipelineRun):
        return model.model_forward
    return (model.module if isinstance(model, DistributedDataParallel) else model).forward


def _check_context_parallel_forward(model: nn.Module, cp: int) -> None:
    forward = model_forward(model)
    if not accepts_position_ids(forward):
        raise PlanMismatchError(f"context parallel (cp={cp}) passes each rank's tokens with their positions, "
                                f"model(input_ids=..., position_ids=...), and {forward.__qualname__} takes no "
                                "position_ids: add that argument (positions of the tokens in the sequence) or "
                                "recompile with --cp 1")


def plan_data_iter(plan: Plan, mesh: DeviceMesh, batches, model: nn.Module):
    """The micro-batches this rank runs: `batches` (its data-parallel rank's, whole sequences: make_data_iter) as
    they are, or under context parallel each split for this cp rank (runtime.parallel.context_parallel.shard_batches),
    with an all-ones attention_mask when `model` (parallelize's) names one."""
    if plan.parallel.cp == 1:
        return batches
    cp_mesh = mesh["cp"]
    forward = model_forward(model)
    return shard_batches(batches, cp_mesh.get_local_rank(), cp_mesh.size(), cp_mesh.get_group(),
                         attention_mask=takes_attention_mask(forward), ids_name=token_ids_name(forward))


def plan_loss_fn(plan: Plan, model_file):
    """The model file's loss_fn, or under context parallel each rank's share of the next-token loss (check_plan
    refused a model file with its own loss_fn); where the plan splits the vocabulary over tp, that loss on the split
    logits (runtime/parallel/vocab_parallel.py vocab_parallel_loss)."""
    loss_fn = model_file.loss_fn if plan.parallel.cp == 1 else context_parallel_loss
    return vocab_parallel_loss(loss_fn) if plan.parallel.vocab_parallel else loss_fn


def _say_once(message: str) -> None:
    """Print on rank 0 only (every rank says the same)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def stage_starts(plan: Plan) -> tuple[int, ...]:
    """Indices of the blocks that begin a pipeline stage after the first (each stage's first block)."""
    prefix = plan.model.block_prefix + "."
    starts = []
    for stage in plan.stages[1:]:
        blocks = [int(name[len(prefix):]) for name in stage.layer_names if name.startswith(prefix)]
        if blocks:
            starts.append(min(blocks))
    return tuple(starts)


def plan_optimizer(model: nn.Module, mesh: DeviceMesh, plan: Plan, *, lr: float, weight_decay: float, steps: int,
                   nvme_path: str | None = None, onebit_warmup_steps: int | None = None) -> torch.optim.Optimizer:
    """The optimizer the plan places (runtime.optim.build.build_optimizer): ZeRO stage, offload tier (under ZeRO 2/3 on
    the host with the parameters, or alone where the placement keeps the parameters on the GPU), delayed update,
    1-bit Adam. `nvme_path`: the swap folder, required when the plan offloads to NVMe. `onebit_warmup_steps`:
    exact AdamW steps before 1-bit Adam compresses (default: the planner's, or 30 % of `steps` when fewer)."""
    p = plan.parallel
    if p.offload == "nvme" and not nvme_path:
        raise PlanMismatchError("the plan offloads the optimizer states to NVMe (parallel.offload = nvme): pass "
                                "--nvme-path DIR, a folder on a local NVMe drive")
    return build_optimizer(
        model, data_parallel_mesh(mesh, p.cp), p.zero_stage, lr=lr, weight_decay=weight_decay, offload=p.offload,
        precision=plan.train.precision, nvme_path=nvme_path, swap_parameters=plan.placement.parameters == "nvme",
        delayed_update=p.delayed_update, grad_compression=p.compression.grad,
        onebit_warmup_steps=onebit_warmup_steps or min(ONE_BIT_WARMUP_STEPS, max(1, int(0.3 * steps))),
        parameters_on_host=plan.placement.parameters != "gpu", expert_dp_mesh=mesh["edp"] if p.ep > 1 else None)


def plan_figures(plan: Plan) -> PlanFigures:
    """What the plan predicts per rank, printed beside what the run measures, and the FLOP numbers of its MFU."""
    prediction, memory, cluster = plan.prediction, plan.prediction.memory, plan.cluster
    model_states = memory.parameters + memory.gradients + memory.optimizer
    return PlanFigures(
        step_time_s=prediction.step_time_s, mfu=prediction.mfu, model_flops_per_step=prediction.model_flops_per_step,
        peak_flops=cluster.peak_flops(plan.train.precision), model_state_bytes=model_states,
        state_bytes_by_tier={"gpu": int(model_states),  # per GPU: the placement's bytes on each tier
                             "cpu": int(memory.cpu_bytes_per_node / cluster.gpus_per_node),
                             "nvme": int(memory.nvme_bytes_per_node / cluster.gpus_per_node)})


def train_config(plan: Plan, *, steps: int, lr_schedule, grad_clip: float, log_json: Any = None,
                 checkpoint: CheckpointConfig | None = None) -> TrainConfig:
    """runtime.training.loop.train's settings: the batch shape and precision from the plan, the rest as given."""
    p = plan.parallel
    return TrainConfig(steps=steps, micro_batch=p.micro_batch, num_micro_batches=p.num_micro_batches,
                       seq_len=plan.train.seq_len, data_parallel_size=p.dp, precision=plan.train.precision,
                       grad_clip=grad_clip, lr_schedule=lr_schedule, log_json=log_json, checkpoint=checkpoint,
                       figures=plan_figures(plan))
