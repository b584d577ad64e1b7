"""Model-state bytes per GPU for planner.cost.memory: weights, gradients and optimizer states per parameter, and the
16-bit copies made for compute.

Model states as zplan's runtime holds them (Rajbhandari et al., ZeRO, SC'20, Sec. 3 and 5, for the
partitioning; schemas.model_states says which layout runs where):
  - ZeRO 0/1 with mixed precision: the paper's layout. 16-bit parameters and gradients on every rank, the fp32
    master weights and Adam's m and v in the optimizer (runtime.optim.layouts): 2 + 2 + 12 bytes per parameter, the 12
    sharded over dp by ZeRO-1: 4 + 12/dp (the paper's K = 12). The gradients accumulate over micro-batches in the
    16-bit dtype (DDP's buckets) and are reduced in it once a step.
  - fp32, ZeRO 2/3 and 1-bit Adam: fp32 parameters (the masters: FSDP2's MixedPrecisionPolicy under ZeRO 2/3, or
    autocast under 1-bit Adam, make 16-bit copies for compute), fp32 gradients (FSDP2's reduce dtype: ZeRO 2/3
    accumulate over micro-batches in fp32), fp32 m and v: 4 + 4 + 8. ZeRO 2 shards the gradients and (FSDP2 holds
    only shards at rest) the weights too, so 16/dp at rest, 2 + 16/dp at the peak with the gathered 16-bit
    parameters (the paper's 2 + 14/dp, its gradient shard 16-bit); ZeRO 3 16/dp.
The 16-bit copies for compute are transient, a term of the peak (compute_copy_bytes, in comm_buffers): under
ZeRO 2 every unit's gathered parameters (FSDP2 with reshard_after_forward=False), held from its forward until its
backward; ZeRO-3's two in-flight units; with 1-bit Adam autocast's cached copies of the weights.
"""

from __future__ import annotations

import numpy as np

from zplan.schemas.spec import compute_dtype

PARAM_BYTES = 4.0  # fp32 parameters: the master weights (fp32 runs, ZeRO 2/3's FSDP2 shards, 1-bit Adam)
GRAD_BYTES = 4.0  # fp32 gradients (fp32 runs; FSDP2's reduce_dtype=fp32; 1-bit Adam's autocast)
ADAM_BYTES = 8.0  # fp32 m and v
MASTER_BYTES = 4.0  # the optimizer's fp32 master of a 16-bit parameter (ZeRO 0/1 with mixed precision)
# zplan's CPU Adam beside parameters kept on the device (ZeRO-1's runtime.optim.host_states, ZeRO 2/3's
# runtime.optim.host_states), per parameter of this rank's shard, in host memory: an fp32 master copy, m and
# v (12), and the buffers the gradient shard is copied down into before the step (4, with a GPU: fp32, or a 16-bit
# parameter's 16-bit gradient and the 16-bit rows the kernel writes for the copy back up).
HOST_OPTIMIZER_BYTES = 12.0
HOST_GRAD_BUFFER_BYTES = 4.0


def element_bytes(precision: str) -> int:
    """Bytes of one value in the compute dtype."""
    return 4 if precision == "fp32" else 2



def sixteen_bit_states(zero, precision: str, grad_compress) -> np.ndarray:
    """Per candidate: parameters and gradients in the 16-bit compute dtype, the fp32 masters in the optimizer
    (schemas.model_states.parameters_in_compute_dtype, vectorised; grad_compress 2 is 1-bit Adam)."""
    return (np.asarray(zero) <= 1) & (compute_dtype(precision) in ("bf16", "fp16")) & (np.asarray(grad_compress) != 2)


def optimizer_bytes_per_param(precision: str) -> int:
    """Adam with ZeRO-Offload's CPU step (planner.cost.offload, planner.placement): fp32 master + m + v
    (mixed precision, K=12) or m + v (fp32, the weight is the master)."""
    return 8 if precision == "fp32" else 12


def state_bytes_per_param(zero, dp, offloaded, parameters_offloaded=None, sixteen_bit=False) -> tuple:
    """(weights, gradients, optimizer) bytes per parameter on the GPU, arrays or scalars alike: the
    runtime's 4 + 4 + 8, or with `sixteen_bit` (sixteen_bit_states) 2 + 2 + 12, sharded by ZeRO stage; offloaded
    states leave the GPU: the optimizer always (ZeRO-1:
    runtime.optim.host_states; ZeRO 2/3 with the parameters on the GPU: runtime.optim.host_states),
    and under ZeRO 2/3 where `parameters_offloaded` the weight and gradient shards with it (FSDP2's
    CPUOffloadPolicy; planner.placement places them so). Default: every offloaded ZeRO 2/3 candidate offloads
    its parameters too (the conservative end, the least GPU memory)."""
    zero, dp, offloaded = np.asarray(zero), np.asarray(dp, dtype=float), np.asarray(offloaded, dtype=bool)
    params_off = offloaded & (zero >= 2) if parameters_offloaded is None else np.asarray(parameters_offloaded, bool)
    sixteen = np.asarray(sixteen_bit, dtype=bool)
    sharded = np.where(zero >= 2, dp, 1.0)
    weights = np.where(params_off, 0.0, np.where(sixteen, 2.0, PARAM_BYTES) / sharded)
    grads = np.where(params_off, 0.0, np.where(sixteen, 2.0, GRAD_BYTES) / sharded)
    optim = np.where(offloaded, 0.0, (ADAM_BYTES + np.where(sixteen, MASTER_BYTES, 0.0)) / np.where(zero >= 1, dp, 1.0))
    return weights, grads, optim



def state_bytes(zero, dp, ep, params, expert_params, offloaded, parameters_offloaded=None, sixteen_bit=False) -> tuple:
    """(weights, gradients, optimizer) bytes on a GPU holding `params` parameters, `expert_params` of them routed
    experts (its E / ep of them): state_bytes_per_param's bytes, the experts' sharded over the dp / ep ranks that hold
    the same experts (runtime.parallel.data_parallel, runtime.optim.layouts.ExpertRowShards), the others over dp."""
    ep = np.asarray(ep, dtype=float)
    dense = state_bytes_per_param(zero, dp, offloaded, parameters_offloaded, sixteen_bit)
    routed = state_bytes_per_param(zero, np.asarray(dp, dtype=float) / ep, offloaded, parameters_offloaded,
                                   sixteen_bit)
    return tuple(d * (params - expert_params) + r * expert_params for d, r in zip(dense, routed, strict=True))


def optimizer_shard_params(zero, dp, ep, params, expert_params) -> np.ndarray:
    """Parameters one rank's optimizer steps (ZeRO 1-3: its shard; 0: all it holds), as state_bytes shards them."""
    ep, dp = np.asarray(ep, dtype=float), np.asarray(dp, dtype=float)
    shard = (params - expert_params) / dp + expert_params * ep / dp
    return np.where(np.asarray(zero) >= 1, shard, params)


def compute_copy_bytes(params_gpu: np.ndarray, zero: np.ndarray, precision: str,
                       uncast_params: np.ndarray | float = 0.0, grad_compress: np.ndarray | int = 0) -> np.ndarray:
    """Parameters held in the compute dtype besides the fp32 ones, from forward until backward: ZeRO-2
    (FSDP2, reshard_after_forward=False) the stage's whole parameters, gathered unit by unit; ZeRO 0/1 with
    mixed precision and 1-bit Adam (grad_compress 2: fp32 parameters under autocast) autocast's cached 16-bit
    copies of the weights it casts, which are all but `uncast_params` (an embedding lookup is not an autocast op:
    its table is read in fp32); 0 otherwise (ZeRO 0/1 compute on their 16-bit parameters themselves; ZeRO-3 frees
    each unit after its forward: its two in-flight blocks are counted in comm_buffers)."""
    autocast = (zero <= 1) & (precision != "fp32") & (np.asarray(grad_compress) == 2)
    cast = np.where(autocast, params_gpu - uncast_params, params_gpu)
    return np.where((zero == 2) | autocast, element_bytes(precision) * cast, 0.0)
