"""The DeepSpeed config equivalent to a plan, for users who train with DeepSpeed instead of zplan's runtime.

Field names follow DeepSpeed's config reference (https://www.deepspeed.ai/docs/config-json/). The batch
fields satisfy DeepSpeed's check train_batch_size == micro * accumulation * data-parallel size, where the
data-parallel size counts the GPUs that hold different sequences: context parallel's cp GPUs share each sequence,
so a cp > 1 plan sets "sequence_parallel_size" (DeepSpeed-Ulysses), by which DeepSpeedConfig divides the world
size without an mpu (deepspeed/runtime/config.py, DeepSpeedConfig.__init__, DeepSpeed 0.19).
Expert parallel is DeepSpeed's AutoEP ("expert_parallel": autoep_size).
What DeepSpeed cannot express from a config (the tensor-parallel layer plan, the pipeline stage
boundaries, selective recompute) is listed by `deepspeed_config_notes` and printed in the report.
Compression: 1-bit gradients map to DeepSpeed's 1-bit Adam optimizer ("OneBitAdam", freeze_step = the warm-up;
Tang et al. 2021), int8 weights and int8 gradients under ZeRO 3 to ZeRO++'s zero_quantized_weights and
zero_quantized_gradients (Wang et al. 2023); DeepSpeed has no int8 gradient all-reduce for ZeRO 0/1 and no
activation compression between pipeline stages (notes).
"""

from __future__ import annotations

from typing import Any

from zplan.schemas.plan import Plan
from zplan.schemas.spec import ADAMW_DEFAULTS, GRAD_CLIP, ONE_BIT_WARMUP_STEPS, compute_dtype

# The emitted training script's optimizer and clipping (schemas.spec), in DeepSpeed's spelling.
ADAMW_PARAMS: dict[str, Any] = {**ADAMW_DEFAULTS, "betas": list(ADAMW_DEFAULTS["betas"])}
GRADIENT_CLIPPING = GRAD_CLIP
# Where NVMe offload swaps to; DeepSpeed needs a path, the plan only a tier. Edit to the node's mount.
DEFAULT_NVME_PATH = "/local_nvme"
# ZeRO bucket sizes in elements: DeepSpeed's defaults (5e8), written out so the config is explicit.
BUCKET_ELEMENTS = 500_000_000


def _offload_block(device: str) -> dict[str, Any]:
    block: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = DEFAULT_NVME_PATH
    return block


def _zero_block(plan: Plan) -> dict[str, Any]:
    parallel, placement = plan.parallel, plan.placement
    zero: dict[str, Any] = {
        "stage": parallel.zero_stage,
        "overlap_comm": parallel.zero_stage > 0,
        "contiguous_gradients": True,
        "reduce_bucket_size": BUCKET_ELEMENTS,
        "allgather_bucket_size": BUCKET_ELEMENTS,
    }
    if parallel.zero_stage == 0:
        return zero
    if placement.optimizer != "gpu":
        zero["offload_optimizer"] = _offload_block(placement.optimizer)
    if parallel.zero_stage == 3 and placement.parameters != "gpu":
        zero["offload_param"] = _offload_block(placement.parameters)
    compression = parallel.compression
    if parallel.zero_stage == 3 and compression.weights == "int8":
        zero["zero_quantized_weights"] = True  # ZeRO++ qwZ: int8 parameter all-gathers
    if parallel.zero_stage == 3 and compression.grad == "int8":
        zero["zero_quantized_gradients"] = True  # ZeRO++ qgZ: int8 all-to-all gradient reduce-scatter
    return zero


def _optimizer_block(plan: Plan) -> dict[str, Any]:
    """AdamW, or DeepSpeed's 1-bit Adam for 1-bit gradients: exact Adam for freeze_step steps, then the momentum
    all-reduced as signs over NCCL (comm_backend_name)."""
    if plan.parallel.compression.grad == "1bit":
        params = {**ADAMW_PARAMS, "freeze_step": ONE_BIT_WARMUP_STEPS, "cuda_aware": False, "comm_backend_name": "nccl"}
        return {"type": "OneBitAdam", "params": params}
    return {"type": "AdamW", "params": dict(ADAMW_PARAMS)}


def _precision_blocks(plan: Plan) -> dict[str, Any]:
    precision = plan.train.precision
    fp16: dict[str, Any] = {"enabled": precision == "fp16"}
    if precision == "fp16":  # dynamic loss scaling, DeepSpeed's recommended settings
        fp16.update({"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                     "min_loss_scale": 1})
    # fp8 plans: bf16 here; DeepSpeed's config has no fp8 GEMMs
    return {"bf16": {"enabled": compute_dtype(precision) == "bf16"}, "fp16": fp16}


def deepspeed_config(plan: Plan) -> dict[str, Any]:
    """A dict DeepSpeed's parser (deepspeed.runtime.config.DeepSpeedConfig) accepts at the plan's dp."""
    parallel = plan.parallel
    config: dict[str, Any] = {
        "train_batch_size": plan.train.global_batch,
        "train_micro_batch_size_per_gpu": parallel.micro_batch,
        "gradient_accumulation_steps": parallel.num_micro_batches,
        "gradient_clipping": GRADIENT_CLIPPING,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "optimizer": _optimizer_block(plan),
        "zero_optimization": _zero_block(plan),
        **_precision_blocks(plan),
    }
    if parallel.recompute != "none":
        config["activation_checkpointing"] = {
            "partition_activations": parallel.tp > 1,  # shard saved inputs across the tensor-parallel group
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    if parallel.cp > 1:  # the cp GPUs of a sequence: one data-parallel rank to the batch arithmetic
        config["sequence_parallel_size"] = parallel.cp
    if parallel.tp > 1:
        config["tensor_parallel"] = {"autotp_size": parallel.tp}
    if parallel.ep > 1:  # DeepSpeed's AutoEP (deepspeed/module_inject/auto_ep_config.py, DeepSpeed 0.19)
        config["expert_parallel"] = {"enabled": True, "autoep_size": parallel.ep}
    if parallel.pp > 1:
        config["pipeline"] = {
            "stages": parallel.pp,
            "partition": "parameters",
            "activation_checkpoint_interval": 1 if parallel.recompute == "full" else 0,
        }
    return config


def deepspeed_config_notes(plan: Plan) -> list[str]:
    """What the DeepSpeed config does not carry over from the plan, one sentence each."""
    parallel = plan.parallel
    notes = [f"Optimizer hyper-parameters (AdamW lr={ADAMW_PARAMS['lr']:g}, weight decay "
             f"{ADAMW_PARAMS['weight_decay']:g}) and gradient clipping {GRADIENT_CLIPPING:g} are defaults, "
             "not part of the plan."]
    if parallel.tp > 1:
        notes.append(f"Tensor parallelism (tp={parallel.tp}) is set as DeepSpeed AutoTP; Megatron-style "
                     "models pass their own mpu instead. The column/row split of each Linear is in train.py.")
    if parallel.ep > 1:
        notes.append(f"Expert parallelism (ep={parallel.ep}) is DeepSpeed's AutoEP (expert_parallel.autoep_size), "
                     "which finds the MoE layers of the model families it has presets for (Mixtral, Qwen3-MoE, "
                     "DeepSeek-V2/V3); under tensor parallelism it folds the experts over the tensor-parallel "
                     "ranks, where zplan keeps them whole on each tp rank, and it runs that folding with pp 1 only.")
    if parallel.pp > 1:
        notes.append(f"Pipeline parallelism needs deepspeed.pipe.PipelineModule(num_stages={parallel.pp}); "
                     "the plan's stage boundaries are listed in the Stages table.")
        if parallel.interleave > 1:
            notes.append("DeepSpeed's pipeline engine has no interleaved schedule; the plan's "
                         f"{parallel.interleave} chunks per stage run as plain 1F1B there.")
        if parallel.zero_stage >= 2:
            notes.append("DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only.")
    if parallel.cp > 1:
        notes.append(f"Context parallelism (cp={parallel.cp}) is DeepSpeed's sequence_parallel_size (the batch "
                     f"fields count the {parallel.cp} GPUs of a sequence once); DeepSpeed-Ulysses splits attention by "
                     "heads with all-to-alls (deepspeed.runtime.sequence_parallel.ulysses_sp), where zplan gathers K "
                     "and V: the model needs DeepSpeed's Ulysses attention (UlyssesSPAttentionHF) and a head count "
                     f"divisible by {parallel.cp}.")
    if parallel.recompute == "selective":
        notes.append("Selective recompute (attention only) has no DeepSpeed config switch; the model's "
                     "checkpointing calls decide what is recomputed.")
    if parallel.sequence_parallel:
        notes.append("Megatron sequence parallelism has no DeepSpeed config switch.")
    if parallel.delayed_update:
        notes.append("DeepSpeed has no one-step delayed parameter update (its authors' code was never merged: "
                     "DeepSpeed issue #1260); there the CPU optimizer step runs after the backward, not beside "
                     "the next step's.")
    notes += _compression_notes(plan)
    if "nvme" in plan.placement.model_dump().values():
        notes.append(f"NVMe offload swaps to {DEFAULT_NVME_PATH}; change nvme_path to the node's NVMe mount.")
    return notes


def _compression_notes(plan: Plan) -> list[str]:
    """What of --compress the DeepSpeed config carries, and how."""
    parallel, notes = plan.parallel, []
    compression = parallel.compression
    if compression.grad == "1bit":
        notes.append(f"1-bit gradients are DeepSpeed's 1-bit Adam (\"OneBitAdam\", freeze_step {ONE_BIT_WARMUP_STEPS} "
                     "exact steps before compressing, as zplan's warm-up); its update has no bias correction, "
                     "zplan's 1-bit Adam corrects as AdamW does. DeepSpeed removed its 1-bit optimizers in "
                     "deepspeedai/DeepSpeed#8490 (tracking issue #8489): this block needs a release that still has "
                     "OneBitAdam.")
    if compression.grad == "int8":
        notes.append("int8 gradients: DeepSpeed quantizes gradients only under ZeRO 3 (ZeRO++'s "
                     "zero_quantized_gradients)" + (", which this config turns on." if parallel.zero_stage == 3 else
                     f"; for ZeRO {parallel.zero_stage} it has no int8 gradient all-reduce, so its gradients "
                     "travel uncompressed."))
    if compression.weights == "int8":
        notes.append("int8 weights are ZeRO++'s zero_quantized_weights" + (
            "." if parallel.zero_stage == 3 else f", which needs ZeRO 3 (this plan is ZeRO {parallel.zero_stage}): "
            "left out."))
    if compression.activations == "int8":
        notes.append("int8 activations between pipeline stages have no DeepSpeed config block: DeepSpeed's pipeline "
                     "sends them uncompressed.")
    return notes
