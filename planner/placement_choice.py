"""The chosen plan's model states placed by planner.placement (CP-SAT), its prediction updated, and the
decision on ZeRO-Offload's one-step delayed parameter update (DPU).

The search scores an offloading candidate with its optimizer off the GPU and, under ZeRO 2/3, its parameter
and gradient shards off it too unless they fit there (planner.cost.memory); the solver then keeps on the GPU
whatever fits there, which only removes transfers. An --offload pin is a requirement, not an allowance: the
optimizer states go to the pinned tier (``none``: the GPU), and the parameters and gradients stay on the GPU
where they fit (planner.placement): under ZeRO 2/3 the optimizer alone is then offloaded (the runtime's
runtime.optim.host_states), and FSDP2's CPUOffloadPolicy takes the parameter and gradient shards to the
host only when the GPU cannot hold them.

Delayed parameter update (Ren et al., ZeRO-Offload, USENIX ATC'21, Sec. 5.2): the CPU optimizer step of
iteration i runs beside the forward and backward of iteration i+1, which use the weights from before that
step. The step then costs max(forward + backward, CPU step) + the rest instead of their sum: the saving is
    saved = min(cpu_step, window),  window = compute + tensor-parallel + pipeline bubble + p2p of one step;
the host-device copies stay serial (conservative: the gradients must be on the host before the CPU step,
the weights go up after it). zplan's runtime runs it for ZeRO-1 with the optimizer on the CPU only. Where the
profile's devices are the host's own cores (overlaps_comm_with_compute False: zplan probe's CPU profile,
one process per core), no core is idle to run the CPU step beside compute, so it saves nothing. In auto it
is turned on when it saves at least DELAYED_UPDATE_MIN_SAVING of the step: below that, the weights' one-step
lag is not worth its gain. The search itself ranks candidates without it (it can only make the chosen
offloading plan faster than ranked).
"""

from __future__ import annotations

from dataclasses import dataclass

from zplan.errors import SpecError
from zplan.planner.cost.inputs import OFFLOAD_TIERS, Candidates, gradient_group
from zplan.planner.cost.memory import (
    HOST_GRAD_BUFFER_BYTES,
    HOST_OPTIMIZER_BYTES,
    HOST_USABLE_FRACTION,
    MASTER_BYTES,
    element_bytes,
    optimizer_shard_params,
    sixteen_bit_states,
    state_bytes,
)
from zplan.planner.cost.step import StepEstimate, gpu_adam_step_s, gradient_clip_s, optimizer_phase_s
from zplan.planner.placement import PlacementResult, place_model_states
from zplan.schemas import legality
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.plan import DelayedUpdate, Placement
from zplan.schemas.spec import TrainSpec

# Fraction of the predicted step (without the delay) the overlap must save before auto turns it on; the help of
# `zplan compile --delayed-update` (zplan/cli.py) quotes it.
DELAYED_UPDATE_MIN_SAVING = 0.10
STATE_TO_OFFLOAD = dict(zip(legality.STATE_TIERS, legality.OFFLOAD_TIERS, strict=True))  # gpu -> none ...


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


def place(cand: Candidates, est: StepEstimate, cluster: ClusterSpec, train: TrainSpec,
          pinned: bool = False) -> PlacedStates:
    """Place candidate 0's model states; `pinned`: its offload tier is the user's --offload pin (the optimizer
    states go there) rather than the search's allowance (module docstring)."""
    mem, z, dp = est.memory, int(cand.zero[0]), int(gradient_group(cand)[0])  # ZeRO shards over dp * cp
    params_gpu = float(mem.peak_stage_params[0])  # the states beside the activations memory_per_gpu priced
    elem = element_bytes(train.precision)
    # As the runtime holds them (cost.memory: fp32 weights and gradients, Adam's m and v; or 16-bit weights and
    # gradients, the fp32 masters with m and v), on any tier.
    sixteen_bit = bool(sixteen_bit_states(z, train.precision, cand.grad_compress[0]))
    experts, ep = float(mem.peak_stage_expert_params[0]), int(cand.ep[0])  # routed experts: over dp / ep ranks
    weights, grads, optim = (float(b) for b in state_bytes(z, dp, ep, params_gpu, experts, False, None, sixteen_bit))
    optim_params = float(optimizer_shard_params(z, dp, ep, params_gpu, experts))
    gpu_free = cluster.gpu.hbm_bytes - float(mem.activations[0] + mem.comm_buffers[0] + mem.reserve[0])
    per_gpu = HOST_USABLE_FRACTION / cluster.gpus_per_node
    eff = cluster.efficiency
    result: PlacementResult = place_model_states(
        param_bytes=weights, grad_bytes=grads, optimizer_bytes=optim, gpu_free_bytes=max(gpu_free, 0.0),
        cpu_free_bytes=cluster.cpu_memory_bytes * per_gpu, nvme_free_bytes=cluster.nvme_bytes * per_gpu,
        host_device_bytes_per_s=cluster.host_to_device_bandwidth_Bps * eff.host_link,
        nvme_bytes_per_s=max(cluster.nvme_bandwidth_Bps, 1.0) / cluster.gpus_per_node,
        cpu_memory_bytes_per_s=cluster.cpu_memory_bandwidth_Bps * eff.memory_bound / cluster.gpus_per_node,
        device_to_host_bytes_per_s=cluster.device_to_host_Bps() * eff.host_link,
        optimizer_params=optim_params, cpu_adam_params_per_s=None if cluster.cpu_adam_params_per_s is None
        else cluster.cpu_adam_params_per_s / cluster.gpus_per_node,  # this GPU's share of the node's CPU
        zero_stage=z, offload=OFFLOAD_TIERS[int(cand.offload[0])], offload_pinned=pinned,
        micro_batches_per_step=max(1, int(round(est.num_micro_batches[0]))),
        # parameter all-gathers per step from the host: ZeRO-3 every forward and backward, ZeRO-2 once (the
        # runtime keeps them gathered through the step: runtime.parallel.data_parallel.keeps_parameters_gathered)
        param_fetches_per_step=1 if z == 2 else None,
        # this rank's shard, once a step with the optimizer alone off the GPU: ZeRO-1 its owned rows (priced as
        # ZeRO-Offload's 16-bit copies), ZeRO 2/3 FSDP2's fp32 gradient shard down and fp32 parameter shard up
        # (runtime.optim.host_states), i.e. the `grads` and `weights` bytes themselves
        **({} if z >= 2 else dict(param_update_bytes=elem * optim_params, grad_update_bytes=elem * optim_params)),
        # zplan's CPU Adam beside parameters on the GPU: the fp32 master of the shard (unless the optimizer's states
        # hold it already: 16-bit parameters) and the gradient buffers
        optimizer_host_extra_bytes=(HOST_OPTIMIZER_BYTES + HOST_GRAD_BUFFER_BYTES) * optim_params - optim,
        # on NVMe, a 16-bit parameter's master stays in host memory (runtime.optim.nvme_states)
        optimizer_nvme_host_bytes=MASTER_BYTES * optim_params if sixteen_bit else 0.0,
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
        optimizer_s=float(optimizer_phase_s(
            (float(gpu_adam_step_s(optim_params, cluster)) if on_gpu["optimizer"] else 0.0)
            + (float(gradient_clip_s(grads, sixteen_bit, cluster)) if on_gpu["grads"] else 0.0), cluster)),
        feasible=result.feasible,
    )


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def decide_delayed_update(requested: str, zero_stage: int, placed: PlacedStates, est: StepEstimate,
                          cluster: ClusterSpec) -> tuple[bool, DelayedUpdate]:
    """(on?, the decision with its numbers and reason) for the chosen plan (candidate 0 of `est`), as the
    module docstring says. `requested`: 'auto', 'on' or 'off'. Raises SpecError when 'on' cannot apply."""
    cpu_step = placed.placement.cpu_optimizer_s
    window = float(est.compute_s[0] + est.tensor_parallel_s[0] + est.context_parallel_s[0]
                   + est.expert_parallel_s[0] + est.pipeline_bubble_s[0] + est.pipeline_p2p_s[0])
    step = float(est.step_time_s[0] - est.offload_s[0] - est.optimizer_s[0]) + placed.offload_s + placed.optimizer_s
    optimizer_tier = placed.placement.optimizer
    # the run's offload is the optimizer's tier here: ZeRO 1 keeps the parameters and gradients on the GPU
    delayed = legality.config(delayed_update=1, zero=zero_stage, offload=STATE_TO_OFFLOAD[optimizer_tier])
    if legality.violations(delayed, [legality.BY_NAME["delayed_update_needs_zero1_cpu"]]):
        if optimizer_tier == "gpu":
            why, fix = ("the optimizer states stay on the GPU (they fit there, where they cost no transfers), so "
                        "there is no CPU step to delay", "drop --delayed-update on")
        else:
            why, fix = (f"zplan's runtime delays the update only for ZeRO-1 with the optimizer on the CPU, and this "
                        f"plan is ZeRO-{zero_stage} with the optimizer on {optimizer_tier.upper()}",
                        "pin --zero 1 --offload cpu, or pass --delayed-update auto")
        if requested == "on":
            raise SpecError(f"--delayed-update on needs a ZeRO-1 plan whose optimizer is offloaded to the CPU, but "
                            f"{why}: {fix}.")
        return False, DelayedUpdate(requested=requested, cpu_step_s=cpu_step, window_s=window, reason=f"off: {why}.")
    numbers = dict(requested=requested, cpu_step_s=cpu_step, window_s=window)
    if not cluster.overlaps_comm_with_compute:
        why = ("this profile's devices are the host's own cores (collectives share them too), so no core is idle "
               "to run the CPU step beside the forward and backward: it saves nothing")
        on = requested == "on"
        return on, DelayedUpdate(**numbers, reason=f"{'on (--delayed-update on)' if on else 'off'}: {why}.")
    saved = min(cpu_step, window)
    share = saved / step if step else 0.0
    overlap = (f"the {_seconds(cpu_step)} CPU optimizer step {{runs}} beside the next step's {_seconds(window)} "
               f"forward and backward, saving {_seconds(saved)} per step ({share:.1%} of the "
               f"{_seconds(step)} step without it)")
    on_reason = {"on": "on (--delayed-update on): ", "auto": "on: "}
    if requested == "on" or (requested == "auto" and share >= DELAYED_UPDATE_MIN_SAVING):
        return True, DelayedUpdate(**numbers, saved_s=saved, reason=on_reason[requested]
                                   + overlap.format(runs="runs") + ".")
    would = "delayed, " + overlap.format(runs="would run")
    if requested == "off":
        return False, DelayedUpdate(**numbers, saved_s=saved, reason=f"off (--delayed-update off); {would}.")
    return False, DelayedUpdate(**numbers, saved_s=saved, reason=f"off: {would}, under the "
                                f"{DELAYED_UPDATE_MIN_SAVING:.0%} of the step worth the one-step lag of the weights.")
