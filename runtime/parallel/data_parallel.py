"""ZeRO / data parallel of a model (plan.parallel.zero_stage): DDP for ZeRO 0/1, FSDP2's fully_shard for ZeRO 2/3,
with mixed precision, offload and compression as the plan sets them."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from zplan.model.modules import transformer_blocks
from zplan.runtime.compression import grad_compression as compression
from zplan.runtime.compression.weight_allgather import quantize_weight_all_gathers
from zplan.runtime.parallel import tensor_parallel
from zplan.runtime.parallel.experts import expert_modules, expert_parameters
from zplan.runtime.parallel.grad_reduce import GradientReducer
from zplan.runtime.parallel.pipeline import PipelineRun
from zplan.runtime.precision.mixed import cast_parameters, compute_torch_dtype, forward_under_autocast
from zplan.schemas import legality
from zplan.schemas.model_states import parameters_in_compute_dtype
from zplan.schemas.spec import GradCompression, Precision, Tier, WeightCompression


def fsdp_param_groups(module: nn.Module) -> list:
    """FSDP2's FSDPParamGroups of a fully_shard module: FSDPState._fsdp_param_groups (a list, torch >= 2.12), else
    its one _fsdp_param_group (torch 2.6-2.11); [] when the module holds no parameters of its own."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def apply_data_parallel(
    model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, precision: Precision, offload: Tier, block_prefix: str,
    grad_compression: GradCompression = "none", weight_compression: WeightCompression = "none",
    parameters_on_host: bool | None = None, num_micro_batches: int = 1, expert_dp_mesh: DeviceMesh | None = None,
    parameters_in_files: bool = False,
) -> nn.Module:
    """Replicate or shard the model over `dp_mesh` by ZeRO stage.

    0: DDP, gradients all-reduced (with tensor parallel, whose DTensors DDP cannot hold, the same done by
    runtime.parallel.grad_reduce.GradientReducer on their local tensors, every `num_micro_batches` backward passes;
    likewise under expert parallel, the experts' gradients over `expert_dp_mesh`, the edp ranks holding this rank's
    experts).
    1: the same here, optimizer states sharded
    by build_optimizer (runtime.optim.layouts.RowShards, over the tp-local tensors under tensor parallel).
    2: FSDP2 fully_shard per block and at the root, parameters kept gathered between forward and
    backward (reshard_after_forward=False), so gradients and optimizer states are sharded.
    3: the same with reshard_after_forward=True, parameters sharded too.
    Under expert parallel (ZeRO 2/3) each experts module is its own FSDP2 unit over `expert_dp_mesh` (its Shard(0)
    DTensors over the ep ranks become 2-D), its gradients divided by all dp ranks as the others' (torchtitan's
    apply_fsdp does the same); the rest of each block is sharded over dp.
    Mixed precision keeps fp32 master weights: under ZeRO 2/3 FSDP2's MixedPrecisionPolicy (fp32 shards, compute
    in bf16/fp16, gradients reduced in fp32); under ZeRO 0/1 the parameters themselves are cast to the compute dtype
    (cast_parameters: 16-bit gradients, reduced in 16 bits, accumulated over micro-batches in 16 bits) and the
    optimizer keeps the fp32 masters (runtime.optim.layouts; schemas.model_states.parameters_in_compute_dtype), except
    with 1-bit Adam, which steps fp32 parameters, with torch.autocast around the forward. fp8 is bf16 here: its
    fp8 GEMMs are the blocks' torchao Float8Linears, converted before tensor parallel (runtime.precision.float8).
    offload='cpu' or 'nvme' (ZeRO 2/3), as the plan's placement puts the parameters (`parameters_on_host`; None:
    on the host whenever offload is not 'none'): parameters on the host (and so their gradients: placement cpu or
    nvme), FSDP2's CPUOffloadPolicy keeps the sharded parameters, gradients and the optimizer step there
    (pin_memory only when there is a GPU: pinning needs one, and not when `parameters_in_files`: ZeRO-Infinity's
    parameter swap, runtime.offload.param_swap, frees and re-reads the shards' host storage, and pinned storage cannot
    be resized; their host-to-GPU copies are then from pageable memory); parameters on the device, FSDP2 shards them
    there as without offload, and build_optimizer's optimizer alone is offloaded (ZeRO-Offload's optimizer offload,
    runtime.optim.host_states; with 'nvme' the moments in files). ZeRO 1: the model is replicated as
    without offload; build_optimizer steps the owned rows on the host.
    """
    if isinstance(model, PipelineRun):  # each pipeline stage of this rank is data-parallel like a model
        for index, chunk in enumerate(model.chunks):
            model.chunks[index] = apply_data_parallel(chunk, dp_mesh, zero_stage, precision, offload, block_prefix,
                                                      grad_compression, weight_compression, parameters_on_host,
                                                      num_micro_batches, expert_dp_mesh, parameters_in_files)
        return model
    if grad_compression not in ("none", "int8", "1bit"):
        raise ValueError(f"gradient compression must be none, int8 or 1bit, got {grad_compression!r}")
    if weight_compression not in ("none", "int8"):
        raise NotImplementedError(f"weight compression is none or int8, got {weight_compression!r}")
    _refuse(zero=zero_stage, offload=offload, grad=grad_compression, weights=weight_compression,
            parameters=None if parameters_on_host is None else "cpu" if parameters_on_host else "gpu")
    if precision not in ("bf16", "fp16", "fp32", "fp8", "nvfp4"):
        raise ValueError(f"precision must be bf16, fp16, fp32, fp8 or nvfp4, got {precision!r}")
    # fp8 / nvfp4: bf16 (runtime.precision.float8 / runtime.precision.nvfp4 converted the blocks' Linears)
    compute_dtype = compute_torch_dtype(precision)
    device = next(model.parameters()).device
    if zero_stage in (0, 1):
        sixteen_bit = parameters_in_compute_dtype(zero_stage, precision, grad_compression)
        if sixteen_bit:
            cast_parameters(model, compute_dtype)
        if expert_dp_mesh is not None:  # expert parallel: the experts' gradients over their own group
            GradientReducer(model, dp_mesh.get_group(), num_micro_batches, expert_params=expert_parameters(model),
                            expert_group=expert_dp_mesh.get_group())
            return model
        if tensor_parallel.has_tensor_parallel_parameters(model):  # tp > 1: DDP cannot hold DTensors
            _refuse(tp=2, grad=grad_compression)

            GradientReducer(model, dp_mesh.get_group(), num_micro_batches)
            return model
        from torch.nn.parallel import DistributedDataParallel

        if compute_dtype is not None and not sixteen_bit:  # 1-bit Adam: fp32 parameters under autocast
            forward_under_autocast(model, device.type, compute_dtype)
        device_ids = [device] if device.type == "cuda" else None
        # gradient_as_bucket_view: the gradients are views into DDP's buckets, not a second copy of them (torch's
        # DistributedDataParallel docs). Its reducer makes a gradient that exists at construction such a view; one
        # that does not exists beside the buckets until synchronised, which under no_sync (the micro-batches before
        # the last) is the whole backward. So every gradient exists first, as a broadcast zero that holds no memory,
        # and train_loop.clear_gradients zeroes the views in place instead of dropping them.
        zero = {}
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = zero.setdefault((p.dtype, p.device), torch.zeros((), dtype=p.dtype, device=p.device)) \
                    .expand(p.shape)
        ddp = DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids,
                                      gradient_as_bucket_view=True)
        if grad_compression == "int8":  # 1bit: build_optimizer's OneBitGradients registers its own hook

            ddp.register_comm_hook(compression.HookState(dp_mesh.get_group()), compression.int8_hook)
        return ddp
    if zero_stage not in (2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")

    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp_policy = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype is not None
        else MixedPrecisionPolicy()
    )
    if parameters_on_host is None:
        parameters_on_host = offload != "none"
    pin = torch.cuda.is_available() and not parameters_in_files
    offload_policy = CPUOffloadPolicy(pin_memory=pin) if parameters_on_host else OffloadPolicy()
    options = dict(mesh=dp_mesh, reshard_after_forward=zero_stage == 3, mp_policy=mp_policy,
                   offload_policy=offload_policy, shard_placement_fn=_evenly_sharded_dim(dp_mesh.size()))
    if expert_dp_mesh is not None:  # each experts module its own unit over edp, before its block takes the rest
        for experts in expert_modules(model):
            fully_shard(experts, **{**options, "mesh": expert_dp_mesh,
                                    "shard_placement_fn": _evenly_sharded_dim(expert_dp_mesh.size())})
            experts.set_gradient_divide_factor(float(dp_mesh.size()))
            # divide, then sum: gloo has no PREMUL_SUM. Not on one edp rank, where torch 2.13's foreach_reduce,
            # forced so, divides twice (and unforced, once, without a collective)
            experts.set_force_sum_reduction_for_comms(expert_dp_mesh.size() > 1)
    for block in transformer_blocks(model, block_prefix):
        fully_shard(block, **options)
    fully_shard(model, **options)  # the root: embedding, final norm, head
    if zero_stage == 2:  # runtime.training.loop keeps the gathered parameters between micro-batches
        setattr(model, _GATHERED_UNTIL_LAST_BACKWARD, True)
    if weight_compression == "int8":  # ZeRO++'s quantized weight all-gather (runtime.compression.weight_allgather)

        quantize_weight_all_gathers(model)
    return model


_GATHERED_UNTIL_LAST_BACKWARD = "_zplan_gathered_until_last_backward"


def _evenly_sharded_dim(ranks: int):
    """FSDP2's shard_placement_fn: a parameter whose dim 0 is shorter than the ranks (stacked experts: E = 8 rows
    over 64 ranks would leave 56 of them nothing and rank 0 a whole expert; under expert parallel the E / ep rows of
    this rank, FSDP2 shards a DTensor's local tensor) is sharded on its longest other dim, so that each rank holds
    1 / ranks of it, as the planner prices it; the others on dim 0 (FSDP2's default)."""
    def placement(param: nn.Parameter) -> Shard | None:
        shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
        if len(shape) < 2 or shape[0] >= ranks:
            return None
        longest = max(range(1, len(shape)), key=lambda d: shape[d])
        return Shard(longest) if shape[longest] > shape[0] else None
    return placement


def _refuse(**values) -> None:
    """NotImplementedError naming the rules of schemas.legality these values break (a plan the runtime cannot run:
    runtime.plan.check refuses it first)."""
    broken = legality.problems(legality.config(**values))
    if broken:
        raise NotImplementedError("; ".join(broken))


def keeps_parameters_gathered(model: nn.Module) -> bool:
    """True for ZeRO-2 under FSDP2 (apply_data_parallel): its gathered parameters may stay gathered from
    the first micro-batch's forward to the last one's backward (FSDPModule.set_reshard_after_backward
    (False) on the others), so a step all-gathers the parameters once, not once per micro-batch. The
    gradients are still reduce-scattered after every micro-batch: they stay sharded, as ZeRO-2 has them.
    No memory beyond what ZeRO-2 holds anyway (every unit gathered from its forward to its backward)."""
    return getattr(model, _GATHERED_UNTIL_LAST_BACKWARD, False)
