"""The optimizer a plan runs: AdamW, sharded and placed as its ZeRO stage, offload tier and compression say."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from zplan.runtime.compression.grad_compression import OneBitGradients
from zplan.runtime.optim.device_states import DeviceStates
from zplan.runtime.optim.host_states import HostStates
from zplan.runtime.optim.layouts import ExpertRowShards, RowShards, WholeShards
from zplan.runtime.optim.nvme_states import NvmeStates
from zplan.runtime.optim.sharded_adamw import ShardedAdamW
from zplan.schemas import legality
from zplan.schemas.model_states import parameters_in_compute_dtype
from zplan.schemas.spec import GradCompression, Precision, Tier


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (dim >= 2), none on biases and norms (nanoGPT's configure_optimizers); each
    group split by where its parameters live (plain, or DTensors of one mesh: expert parallel's beside tensor
    parallel's), as torch's fused step takes one kind at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = []
    for decayed, decay in ((True, weight_decay), (False, 0.0)):
        kinds: dict[object, list[nn.Parameter]] = {}
        for p in params:
            if (p.dim() >= 2) == decayed:
                kinds.setdefault((id(p.device_mesh), p.placements) if isinstance(p, DTensor) else None, []).append(p)
        groups += [{"params": members, "weight_decay": decay} for members in kinds.values()]
    return groups


def build_optimizer(
    model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, lr: float, weight_decay: float, offload: Tier,
    precision: Precision = "fp32", nvme_path: str | None = None, swap_parameters: bool = False,
    delayed_update: bool = False, grad_compression: GradCompression = "none", onebit_warmup_steps: int = 100,
    parameters_on_host: bool | None = None, expert_dp_mesh: DeviceMesh | None = None,
) -> torch.optim.Optimizer:
    """AdamW (fused kernel: ~7x foreach on CPU, docs/design.md facts) as runtime.optim.sharded_adamw.ShardedAdamW, its
    parts chosen from the plan:

    layout: ZeRO 1 shards the states over dp (RowShards: dim-0 slices of every parameter, of its tp-local tensor
    under tensor parallel, updated rows all-gathered over dp); ZeRO 0 with 16-bit parameters (mixed precision:
    runtime.precision.mixed.cast_parameters) the same unsharded, for its fp32 masters (shard_states=False);
    ZeRO 2/3: FSDP2's parameters are already shards, so the states are (WholeShards).
    states: on the device (DeviceStates, torch's fused kernel); offload='cpu' (ZeRO-Offload) on the host with
    zplan's CPU Adam (HostStates), under ZeRO 1, or under ZeRO 2/3 with the parameters on the device
    (`parameters_on_host` False, as apply_data_parallel was given; with FSDP2's CPUOffloadPolicy the parameters are
    on the host and torch's fused AdamW steps them there); delayed_update (ZeRO 1): the one-step delayed parameter
    update (the CPU step overlaps the next forward/backward). offload='nvme' (ZeRO-Infinity): the moments in files
    under `nvme_path`, swapped per sub-group during the step (NvmeStates); swap_parameters (ZeRO 3): the parameter
    shards in files too (runtime.offload.param_swap).
    gradients: grad_compression '1bit' (DDP, ZeRO 0 or 1): exact AdamW for `onebit_warmup_steps` steps, then Adam's
    variance frozen and the momentum all-reduced as signs (1-bit Adam: OneBitGradients); int8 is DDP's hook
    (runtime.parallel.data_parallel) and changes nothing here.
    ZeRO 2/3 on the device with nothing else: torch.optim.AdamW as it is. fp16 with ZeRO 2/3 uses the foreach
    kernel: the fused step rejects the shape-[1] inf flag that FSDP's ShardedGradScaler hands it (torch 2.13).
    """
    broken = legality.problems(legality.config(zero=zero_stage, offload=offload, delayed_update=delayed_update,
                                               grad=grad_compression, parameters="nvme" if swap_parameters else None))
    if broken:  # the legality table (schemas/legality.py): the plan check refuses these before any collective
        raise NotImplementedError("; ".join(broken))
    groups = adamw_param_groups(model, weight_decay)
    fused = not (precision == "fp16" and zero_stage in (2, 3))
    gradients = None
    if grad_compression == "1bit":
        if not isinstance(model, DistributedDataParallel):
            raise NotImplementedError("1-bit compression runs on a DDP model (no tensor or pipeline parallel)")
        gradients = OneBitGradients(model, dp_mesh.get_group(), warmup_steps=onebit_warmup_steps)
    # each rank keeps AdamW states (and 16-bit parameters' fp32 masters) for an even dim-0 slice of every parameter
    # (runtime/optim/layouts.py); ZeRO 0: for all of it, where it keeps masters
    rows = zero_stage == 1 or (zero_stage == 0 and gradients is None
                               and parameters_in_compute_dtype(0, precision, grad_compression))
    if rows and zero_stage == 1 and expert_dp_mesh is not None:  # expert parallel: the experts' rows over edp
        layout = ExpertRowShards(dp_mesh, expert_dp_mesh)
    elif rows:
        layout = RowShards(dp_mesh, shard_states=zero_stage == 1)
    else:  # FSDP2's shards (ZeRO 2/3); or 1-bit Adam under ZeRO 0: every rank updates whole parameters alike
        layout = WholeShards()
    if offload == "nvme":
        states = NvmeStates(nvme_path, swap_parameters_of=model if swap_parameters else None)
    elif offload == "cpu" and (rows or (zero_stage in (2, 3) and parameters_on_host is False)):
        states = HostStates(delayed_update=delayed_update)  # ZeRO-Offload: master and moments on the host, CPU Adam
    elif rows or gradients is not None:
        states = DeviceStates(fused=fused)
    else:  # ZeRO 0 in fp32, ZeRO 2/3 on the device, or FSDP2 holding the shards on the host: torch's own
        return torch.optim.AdamW(groups, lr=lr, fused=fused)
    return ShardedAdamW(groups, layout, states, gradients, lr=lr)
