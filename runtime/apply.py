"""Apply a plan to a model: one function per step, called in DESIGN.md decision 5's fixed order.

    apply_tensor_parallel -> apply_recompute -> apply_pipeline -> disable_generation_cache -> apply_data_parallel
    -> build_optimizer

Each step stands on torch.distributed's own API (DESIGN.md decision 4) and returns the model it was
given or its wrapped version. Steps that are not implemented yet for a degree > 1 say so; none of them
pretends.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from zplan.schemas.model_states import parameters_in_compute_dtype
from zplan.schemas.spec import compute_dtype as compute_dtype_name

# the dtype of parameters' compute copies and activations by plan precision; fp8 is bf16's (its fp8 GEMMs are the
# blocks' Float8Linears: runtime.float8)
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_torch_dtype(precision: str) -> torch.dtype | None:
    """torch dtype of the mixed-precision compute for `precision` (None: fp32, no mixed precision)."""
    return _COMPUTE_DTYPES.get(compute_dtype_name(precision))


def transformer_blocks(model: nn.Module, block_prefix: str) -> list[nn.Module]:
    """The repeated blocks in execution order, from the container at `block_prefix` (e.g. 'blocks')."""
    container = model.get_submodule(block_prefix)
    if isinstance(container, nn.ModuleDict):
        return list(container.values())
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        return list(container)
    kind = type(container).__name__
    raise ValueError(f"{block_prefix} is a {kind}, not a ModuleList, Sequential or ModuleDict of blocks")


def disable_generation_cache(model: nn.Module) -> nn.Module:
    """Training keeps no generation cache: a Hugging Face model's forward fills a KV cache (config.use_cache, on by
    default) that a recomputed block would fill again in backward, with keys twice as long (activation recompute
    then fails: torch's checkpoint finds other ops than the forward ran), and that holds every layer's keys and
    values besides what backward saves. HF's own gradient checkpointing turns it off the same way."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False
    return model


# ---- 1. tensor parallel --------------------------------------------------------------------------


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, str], block_prefix: str, sequence_parallel: bool,
    fused: dict | None = None, stage_starts: tuple[int, ...] = (),
) -> nn.Module:
    """Split each block's Linears column/row-wise over `tp_mesh` (tp_plan: path in block -> style),
    with sequence parallel when planned; everything else replicated over `tp_mesh`; fused projections (`fused`:
    path in block -> runtime.fused_layout.FusedLayout) stored grouped at every tp; `stage_starts`: the blocks
    that begin a pipeline stage after the first (runtime.tensor_parallel)."""
    from zplan.runtime import tensor_parallel

    return tensor_parallel.apply_tensor_parallel(model, tp_mesh, tp_plan, block_prefix, sequence_parallel, fused,
                                                 stage_starts)


# ---- 2. activation recompute ---------------------------------------------------------------------


def _save_only_matmuls(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy: keep the GEMM outputs (the Linear projections), recompute the rest.

    What is recomputed is the attention core (QK^T and attention x V as bmm, softmax, or the fused SDPA
    op) and the cheap elementwise ops; the FLOP overhead is the attention core's, as in Megatron's
    selective recompute (Korthikanti et al. 2022, section 4.2), and no (B, heads, T, T) tensor is kept.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    # _scaled_mm: an fp8 block's GEMM (runtime.float8 on fp8 tensor cores; emulated, torchao runs aten.mm)
    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten._scaled_mm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_only_matmuls)


def _checkpoint_forward(block: nn.Module, selective: bool) -> None:
    # Replace the block's forward on the instance rather than wrapping the block in another module,
    # so parameter names, the plan's layer names and state-dict keys stay what the model file defines.
    original_forward = block.forward
    extra = {"context_fn": _selective_context} if selective else {}

    def forward(*args, **kwargs):
        return checkpoint(original_forward, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = forward


def apply_recompute(model: nn.Module, mode: str, block_prefix: str) -> nn.Module:
    """Activation recompute per block: 'none'; 'full' keeps only each block's input and reruns the
    block's forward in backward (torch.utils.checkpoint); 'selective' keeps the GEMM outputs and
    recomputes the attention core and elementwise ops (torch's selective activation checkpoint API)."""
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute mode must be none, selective or full, got {mode!r}")
    for block in transformer_blocks(model, block_prefix):
        _checkpoint_forward(block, selective=mode == "selective")
    return model


# ---- 3. pipeline split ---------------------------------------------------------------------------


def apply_pipeline(
    model: nn.Module, pp_mesh: DeviceMesh, stage_layer_names: list[list[str]], schedule: str, *,
    units=(), num_micro_batches: int = 1, loss_fn=None, example_micro_batch=None, activation_compression="none",
) -> nn.Module:
    """Keep this rank's pipeline stages (units `stage_layer_names[stage]`; stage s is chunk s // pp of
    pipeline rank s % pp) and run `schedule` over them: a runtime.pipeline.PipelineRun, trained through
    its step() (runtime.train_loop does). `units`: the plan's LayerCost list (unit name -> module paths).
    activation_compression 'int8': hidden states and their gradients cross stages as int8."""
    if pp_mesh.size() == 1:
        return model
    from zplan.runtime.pipeline import build_pipeline, stage_module_paths

    stages = stage_module_paths(stage_layer_names, units)
    return build_pipeline(model, pp_mesh, stages, schedule, num_micro_batches, loss_fn, example_micro_batch,
                          activation_compression)


# ---- 4. ZeRO / data parallel (with mixed precision and offload) ----------------------------------


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The floating-point parameters (not the buffers: rotary tables stay as the model made them) in `dtype`, in
    place (the same Parameter objects, so tied ones stay tied; a DTensor's through torch.utils.swap_tensors, a plain
    one's data replaced, which a fake tensor's weak references allow: the dry run), as FSDP2's MixedPrecisionPolicy
    computes: every op in the parameters' dtype, no autocast."""
    for p in dict.fromkeys(model.parameters()):
        if p.is_floating_point() and p.dtype != dtype:
            if isinstance(p, DTensor):
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))
            else:
                p.data = p.detach().to(dtype)
    return model


def _forward_under_autocast(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    original_forward = model.forward

    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return original_forward(*args, **kwargs)

    model.forward = forward


def apply_data_parallel(
    model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, precision: str, offload: str, block_prefix: str,
    grad_compression: str = "none", weight_compression: str = "none", parameters_on_host: bool | None = None,
    num_micro_batches: int = 1,
) -> nn.Module:
    """Replicate or shard the model over `dp_mesh` by ZeRO stage.

    0: DDP, gradients all-reduced (with tensor parallel, whose DTensors DDP cannot hold, the same done by
    runtime.grad_reduce.GradientReducer on their local tensors, every `num_micro_batches` backward passes).
    1: the same here, optimizer states sharded
    by build_optimizer (runtime.zero1.ZeroOneAdamW, over the tp-local tensors under tensor parallel).
    2: FSDP2 fully_shard per block and at the root, parameters kept gathered between forward and
    backward (reshard_after_forward=False), so gradients and optimizer states are sharded.
    3: the same with reshard_after_forward=True, parameters sharded too.
    Mixed precision keeps fp32 master weights: under ZeRO 2/3 FSDP2's MixedPrecisionPolicy (fp32 shards, compute
    in bf16/fp16, gradients reduced in fp32); under ZeRO 0/1 the parameters themselves are cast to the compute dtype
    (cast_parameters: 16-bit gradients, reduced in 16 bits, accumulated over micro-batches in 16 bits) and the
    optimizer keeps the fp32 masters (runtime.zero1; schemas.model_states.parameters_in_compute_dtype), except
    with 1-bit Adam, which steps fp32 parameters, with torch.autocast around the forward. fp8 is bf16 here: its
    fp8 GEMMs are the blocks' torchao Float8Linears, converted before tensor parallel (runtime.float8).
    offload='cpu' or 'nvme' (ZeRO 2/3), as the plan's placement puts the parameters (`parameters_on_host`; None:
    on the host whenever offload is not 'none'): parameters on the host (and so their gradients: placement cpu or
    nvme), FSDP2's CPUOffloadPolicy keeps the sharded parameters, gradients and the optimizer step there
    (pin_memory only when there is a GPU: pinning needs one); parameters on the device, FSDP2 shards them there
    as without offload, and build_optimizer's optimizer alone is offloaded (ZeRO-Offload's optimizer offload,
    runtime.offload.sharded_cpu_adam; with 'nvme' the moments in files). ZeRO 1: the model is replicated as
    without offload; build_optimizer steps the owned rows on the host.
    """
    from zplan.runtime.pipeline import PipelineRun

    if isinstance(model, PipelineRun):  # each pipeline stage of this rank is data-parallel like a model
        for index, chunk in enumerate(model.chunks):
            model.chunks[index] = apply_data_parallel(chunk, dp_mesh, zero_stage, precision, offload, block_prefix,
                                                      grad_compression, weight_compression, parameters_on_host,
                                                      num_micro_batches)
        return model
    if grad_compression not in ("none", "int8", "1bit"):
        raise ValueError(f"gradient compression must be none, int8 or 1bit, got {grad_compression!r}")
    if weight_compression not in ("none", "int8") or (weight_compression == "int8" and zero_stage != 3):
        raise NotImplementedError(f"weight compression is none, or int8 with ZeRO 3 (its parameter all-gathers), got "
                                  f"{weight_compression!r} with ZeRO {zero_stage}")
    if grad_compression != "none" and zero_stage > 1:
        raise NotImplementedError(f"{grad_compression} gradient compression runs with ZeRO 0 and 1 (DDP's "
                                  f"reduction), not ZeRO {zero_stage}")
    if precision not in ("bf16", "fp16", "fp32", "fp8", "nvfp4"):
        raise ValueError(f"precision must be bf16, fp16, fp32, fp8 or nvfp4, got {precision!r}")
    # fp8 / nvfp4: bf16 (runtime.float8 / runtime.nvfp4 converted the blocks' Linears)
    compute_dtype = compute_torch_dtype(precision)
    device = next(model.parameters()).device
    if zero_stage in (0, 1):
        if offload != "none" and zero_stage == 0:  # nothing is sharded: every rank would step everything
            raise NotImplementedError(f"{offload} offload with ZeRO 0: pin ZeRO 1, 2 or 3 (ZeRO-Offload and "
                                      "ZeRO-Infinity step each rank's optimizer shard; ZeRO 0 has none)")
        from zplan.runtime import tensor_parallel

        sixteen_bit = parameters_in_compute_dtype(zero_stage, precision, grad_compression)
        if sixteen_bit:
            cast_parameters(model, compute_dtype)
        if tensor_parallel.has_tensor_parallel_parameters(model):  # tp > 1: DDP cannot hold DTensors
            if grad_compression != "none":
                raise NotImplementedError("gradient compression runs on DDP's reduction: tensor parallel = 1 only")
            from zplan.runtime.grad_reduce import GradientReducer

            GradientReducer(model, dp_mesh.get_group(), num_micro_batches)
            return model
        from torch.nn.parallel import DistributedDataParallel

        if compute_dtype is not None and not sixteen_bit:  # 1-bit Adam: fp32 parameters under autocast
            _forward_under_autocast(model, device.type, compute_dtype)
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
        if grad_compression == "int8":  # 1bit: build_optimizer's OneBitAdamW registers its own hook
            from zplan.runtime.compression import grad_compression as compression

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
    if parameters_on_host and offload == "none":
        raise ValueError("parameters on the host need offload 'cpu' or 'nvme' (FSDP2's CPUOffloadPolicy steps there)")
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if parameters_on_host else OffloadPolicy()
    options = dict(mesh=dp_mesh, reshard_after_forward=zero_stage == 3, mp_policy=mp_policy,
                   offload_policy=offload_policy)
    for block in transformer_blocks(model, block_prefix):
        fully_shard(block, **options)
    fully_shard(model, **options)  # the root: embedding, final norm, head
    if zero_stage == 2:  # runtime.train_loop keeps the gathered parameters between micro-batches
        setattr(model, _GATHERED_UNTIL_LAST_BACKWARD, True)
    if weight_compression == "int8":  # ZeRO++'s quantized weight all-gather (runtime.compression.weight_allgather)
        from zplan.runtime.compression.weight_allgather import quantize_weight_all_gathers

        quantize_weight_all_gathers(model)
    return model


_GATHERED_UNTIL_LAST_BACKWARD = "_zplan_gathered_until_last_backward"


def keeps_parameters_gathered(model: nn.Module) -> bool:
    """True for ZeRO-2 under FSDP2 (apply_data_parallel): its gathered parameters may stay gathered from
    the first micro-batch's forward to the last one's backward (FSDPModule.set_reshard_after_backward
    (False) on the others), so a step all-gathers the parameters once, not once per micro-batch. The
    gradients are still reduce-scattered after every micro-batch: they stay sharded, as ZeRO-2 has them.
    No memory beyond what ZeRO-2 holds anyway (every unit gathered from its forward to its backward)."""
    return getattr(model, _GATHERED_UNTIL_LAST_BACKWARD, False)


# ---- 5. optimizer ---------------------------------------------------------------------------------


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (dim >= 2), none on biases and norms (nanoGPT's configure_optimizers)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def build_optimizer(
    model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, lr: float, weight_decay: float, offload: str,
    precision: str = "fp32", nvme_path: str | None = None, swap_parameters: bool = False,
    delayed_update: bool = False, grad_compression: str = "none", onebit_warmup_steps: int = 100,
    parameters_on_host: bool | None = None,
) -> torch.optim.Optimizer:
    """AdamW (fused kernel: ~7x foreach on CPU, DESIGN.md facts); ZeRO-1 shards its states over dp
    (runtime.zero1.ZeroOneAdamW: dim-0 slices of every parameter, of its tp-local tensor under tensor
    parallel, updated rows all-gathered over dp); with offload='cpu' its host variant
    (runtime.offload.cpu_adam_optimizer.CpuOffloadZeroOneAdamW: ZeRO-Offload, CPU Adam on the owned rows),
    with delayed_update its one-step delayed parameter update (the CPU step overlaps the next forward/backward).

    ZeRO 0 with 16-bit parameters (mixed precision: runtime.apply.cast_parameters): the same optimizer unsharded, for
    its fp32 masters (shard_states=False).
    ZeRO 2/3 need nothing more: FSDP2's parameters are already shards, so the optimizer states are.
    offload='cpu' with ZeRO 2/3: parameters on the host (`parameters_on_host`, as apply_data_parallel was given:
    FSDP2's CPUOffloadPolicy), the fused AdamW steps the host shards; parameters on the device, the optimizer
    alone goes to the host (runtime.offload.sharded_cpu_adam.CpuOffloadShardedAdamW: fp32 master and moments of
    the shards there, CPU Adam, gradients down and parameters up once a step).
    offload='nvme' (ZeRO-Infinity): the moments in files under `nvme_path`, swapped per sub-group during
    the step (runtime.offload.nvme_optimizer: NvmeZeroOneAdamW for ZeRO 1, NvmeShardedAdamW for 2/3);
    swap_parameters (ZeRO 3): the parameter shards in files too (runtime.offload.param_swap).
    grad_compression '1bit' (DDP): exact AdamW for `onebit_warmup_steps` steps, then Adam's variance frozen and,
    ZeRO 0, the momentum all-reduced as signs (1-bit Adam: runtime.compression.grad_compression.OneBitAdamW), or,
    ZeRO 1, the gradients (OneBitZeroOneAdamW).
    fp16 with ZeRO 2/3 uses the foreach kernel: the fused step rejects the shape-[1] inf flag that
    FSDP's ShardedGradScaler hands it (torch 2.13).
    """
    if delayed_update and (zero_stage, offload) != (1, "cpu"):
        raise NotImplementedError("the delayed parameter update runs with ZeRO 1 and CPU offload only")
    groups = adamw_param_groups(model, weight_decay)
    if grad_compression == "1bit":
        from torch.nn.parallel import DistributedDataParallel

        from zplan.runtime.compression import grad_compression as compression

        if zero_stage not in (0, 1) or offload != "none" or not isinstance(model, DistributedDataParallel):
            raise NotImplementedError("1-bit compression runs with ZeRO 0 or 1, no offload, on a DDP model (no "
                                      "tensor or pipeline parallel)")
        if zero_stage == 1:
            return compression.OneBitZeroOneAdamW(groups, dp_mesh, model, lr=lr, warmup_steps=onebit_warmup_steps)
        return compression.OneBitAdamW(groups, model, dp_mesh.get_group(), lr=lr, warmup_steps=onebit_warmup_steps)
    fused = not (precision == "fp16" and zero_stage in (2, 3))
    if offload == "nvme":
        from zplan.runtime.offload import nvme_optimizer

        if zero_stage == 1:
            return nvme_optimizer.NvmeZeroOneAdamW(groups, dp_mesh, lr=lr, nvme_path=nvme_path)
        if zero_stage in (2, 3):
            if swap_parameters and zero_stage != 3:
                raise NotImplementedError("parameters swap to NVMe only with ZeRO 3 (the others keep them gathered)")
            return nvme_optimizer.NvmeShardedAdamW(groups, lr=lr, nvme_path=nvme_path,
                                                   swap_parameters_of=model if swap_parameters else None)
        raise NotImplementedError("NVMe offload with ZeRO 0: pin ZeRO 1, 2 or 3")
    if zero_stage in (0, 1) and (zero_stage == 1 or parameters_in_compute_dtype(0, precision, grad_compression)):
        if offload == "cpu":  # ZeRO-Offload: the owned rows' master and moments on the host, CPU Adam
            from zplan.runtime.offload.cpu_adam_optimizer import CpuOffloadZeroOneAdamW

            return CpuOffloadZeroOneAdamW(groups, dp_mesh, lr=lr, delayed_update=delayed_update)
        from zplan.runtime.zero1 import ZeroOneAdamW

        # each rank keeps AdamW states (and 16-bit parameters' fp32 masters) for an even dim-0 slice of every
        # parameter (runtime/zero1.py); ZeRO 0: for all of it
        return ZeroOneAdamW(groups, dp_mesh, lr=lr, fused=fused, shard_states=zero_stage == 1)
    if offload == "cpu" and zero_stage in (2, 3) and parameters_on_host is False:  # the optimizer alone on the host
        from zplan.runtime.offload.sharded_cpu_adam import CpuOffloadShardedAdamW

        return CpuOffloadShardedAdamW(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr, fused=fused)
