"""The chosen plan's model states placed by planner.placement (CP-SAT), and its prediction updated.

The search scores an offloading candidate as if every offloadable state left the GPU (the
conservative end); the solver then keeps on the GPU whatever fits there, which only removes transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

from zplan.planner.cost.inputs import OFFLOAD_TIERS, Candidates
from zplan.planner.cost.memory import (
    HOST_USABLE_FRACTION,
    element_bytes,
    state_bytes_per_param,
)
from zplan.planner.cost.step import StepEstimate, gpu_adam_step_s
from zplan.planner.placement import PlacementResult, place_model_states
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.plan import Placement
from zplan.schemas.spec import TrainSpec


@dataclass(frozen=True)
class PlacedStates:
    """Per-GPU model-state bytes on the GPU, host/NVMe bytes per node, and the step-time terms."""

    placement: Placement
    parameters: float
    gradients: float
    optimizer: float
    cpu_bytes_per_node: float
    nvme_bytes_per_node: float
    offload_s: float
    optimizer_s: float
    feasible: bool


def place(cand: Candidates, est: StepEstimate, cluster: ClusterSpec, train: TrainSpec) -> PlacedStates:
    mem, z, dp = est.memory, int(cand.zero[0]), int(cand.dp[0])
    params_gpu = float(mem.stage_params[0])
    elem = element_bytes(train.precision)
    # As the runtime holds them (cost.memory: fp32 weights and gradients, Adam's m and v), on any tier.
    weights, grads, optim = (float(b) * params_gpu for b in state_bytes_per_param(z, dp, False))
    optim_params = params_gpu / (dp if z >= 1 else 1)
    gpu_free = cluster.gpu.hbm_bytes - float(mem.activations[0] + mem.comm_buffers[0] + mem.reserve[0])
    per_gpu = HOST_USABLE_FRACTION / cluster.gpus_per_node
    eff = cluster.efficiency
    result: PlacementResult = place_model_states(
        param_bytes=weights, grad_bytes=grads, optimizer_bytes=optim, gpu_free_bytes=max(gpu_free, 0.0),
        cpu_free_bytes=cluster.cpu_memory_bytes * per_gpu, nvme_free_bytes=cluster.nvme_bytes * per_gpu,
        host_device_bytes_per_s=cluster.host_to_device_bandwidth_Bps * eff.host_link,
        nvme_bytes_per_s=max(cluster.nvme_bandwidth_Bps, 1.0) / cluster.gpus_per_node,
        cpu_memory_bytes_per_s=cluster.cpu_memory_bandwidth_Bps * eff.memory_bound / cluster.gpus_per_node,
        zero_stage=z, offload=OFFLOAD_TIERS[int(cand.offload[0])],
        micro_batches_per_step=max(1, int(round(est.num_micro_batches[0]))),
        param_update_bytes=elem * optim_params, grad_update_bytes=elem * optim_params,  # this rank's shard
    )
    on_gpu = {"params": result.param_tier == "gpu", "grads": result.grad_tier == "gpu",
              "optimizer": result.optimizer_tier == "gpu"}
    return PlacedStates(
        placement=Placement(parameters=result.param_tier, gradients=result.grad_tier,
                            optimizer=result.optimizer_tier,
                            host_device_bytes_per_step=result.transfer.host_device_bytes,
                            host_device_s=result.transfer.host_device_s,
                            nvme_bytes_per_step=result.transfer.nvme_bytes, nvme_s=result.transfer.nvme_s,
                            cpu_optimizer_s=result.transfer.cpu_optimizer_s),
        parameters=weights if on_gpu["params"] else 0.0,
        gradients=grads if on_gpu["grads"] else 0.0,
        optimizer=optim if on_gpu["optimizer"] else 0.0,
        cpu_bytes_per_node=result.cpu_bytes * cluster.gpus_per_node,
        nvme_bytes_per_node=result.nvme_bytes * cluster.gpus_per_node,
        offload_s=result.total_transfer_s,
        optimizer_s=float(gpu_adam_step_s(optim_params, cluster)) if on_gpu["optimizer"] else 0.0,
        feasible=result.feasible,
    )
