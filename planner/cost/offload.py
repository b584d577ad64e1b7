"""Per-step host and NVMe traffic of offloaded model states, vectorised over candidates.

The same traffic rules as planner.placement (whose docstring cites ZeRO-Offload, Ren et al. ATC'21,
and ZeRO-Infinity, Rajbhandari et al. SC'21), applied to the placement the search assumes for an
offloading candidate: the optimizer on the offload tier; under ZeRO 2/3 the parameter and gradient shards stay
on the GPU where they fit there (planner.cost.memory decides, `parameters_offloaded`), else they go to host
memory too (FSDP2's CPUOffloadPolicy), ZeRO-3 parameters possibly on NVMe. Per GPU, with shard = parameters
this rank updates:
  gradients down: the reduced shard once a step (ZeRO-1, elem bytes; ZeRO 2/3 with the parameters on the GPU,
                  the fp32 shard), or every micro-batch's shard (ZeRO 2/3 under CPUOffloadPolicy),
                  at the device-to-host bandwidth
  weights up:     the updated shard once a step (ZeRO 1, elem bytes; ZeRO 2/3 with the parameters on the GPU, the
                  fp32 shard), or, under CPUOffloadPolicy, one fetch per step (ZeRO-2, kept gathered through the
                  step) or 2 fetches per micro-batch (ZeRO-3), at host-to-device
  CPU Adam:       shard / (cpu_adam_params_per_s / gpus_per_node) where the profile has a measured
                  throughput (zplan probe), else reads and writes the fp32 states, reads gradients, writes
                  weights, at this GPU's share of the host memory bandwidth
  NVMe:           reads and writes the moments in files (a 16-bit parameter's master stays in host memory);
                  ZeRO-3 weights read per fetch, written once
Counted as not overlapped with compute (the delayed parameter update, planner.placement_choice, is decided
for the chosen plan only).
"""

from __future__ import annotations

import numpy as np

from zplan.planner.cost.inputs import Candidates, gradient_group
from zplan.planner.cost.memory import (
    ADAM_BYTES,
    GRAD_BYTES,
    HOST_OPTIMIZER_BYTES,
    PARAM_BYTES,
    element_bytes,
    optimizer_bytes_per_param,
)
from zplan.schemas.cluster import ClusterSpec


def cpu_adam_s(shard_params: np.ndarray | float, shard_bytes_moved: np.ndarray | float,
               cluster: ClusterSpec) -> np.ndarray | float:
    """Seconds of one GPU's CPU Adam step over `shard_params` parameters: at its share of the node's measured
    throughput (cpu_adam_params_per_s / gpus_per_node) when the profile has one, else `shard_bytes_moved` at
    its share of the host memory bandwidth (cpu_memory_bandwidth_Bps x efficiency.memory_bound / gpus_per_node)."""
    if cluster.cpu_adam_params_per_s is not None:
        return shard_params / (cluster.cpu_adam_params_per_s / cluster.gpus_per_node)
    cpu_bw = cluster.cpu_memory_bandwidth_Bps * cluster.efficiency.memory_bound / cluster.gpus_per_node
    return shard_bytes_moved / cpu_bw


def offload_time_s(cand: Candidates, params_gpu: np.ndarray, num_micro_batches: np.ndarray,
                   cluster: ClusterSpec, precision: str, parameters_offloaded: np.ndarray | None = None) -> np.ndarray:
    """Seconds per step of each candidate's offload (module docstring); `parameters_offloaded`: the ZeRO 2/3
    candidates whose parameter shards are on the host (planner.cost.memory's; default: every ZeRO 2/3 one)."""
    elem = element_bytes(precision)
    z, dp, m = cand.zero, gradient_group(cand).astype(float), num_micro_batches  # ZeRO shards over dp * cp
    params_off = z >= 2 if parameters_offloaded is None else np.asarray(parameters_offloaded, dtype=bool)
    beside_device = (z >= 2) & ~params_off  # ZeRO 2/3, the optimizer alone on the host (runtime.optim.host_states)
    shard = params_gpu / np.where(z >= 1, dp, 1.0)
    grads = elem * shard
    optim = optimizer_bytes_per_param(precision) * shard
    grads_down = np.select([beside_device, z >= 2], [GRAD_BYTES * shard, m * grads], grads)
    weights_up = np.select([beside_device, z == 3], [PARAM_BYTES * shard, 2.0 * m * elem * shard], elem * shard)
    host_link = cluster.efficiency.host_link
    host_s = (grads_down / (cluster.device_to_host_Bps() * host_link)
              + weights_up / (cluster.host_to_device_bandwidth_Bps * host_link))
    # CPU Adam's bytes: read and write the fp32 states, read the gradients, write the weights (beside device
    # parameters: the fp32 master, m and v, and the fp32 gradients; the master is what goes up)
    adam_bytes = np.where(beside_device, 2.0 * HOST_OPTIMIZER_BYTES * shard + GRAD_BYTES * shard,
                          2.0 * optim + grads + elem * shard)
    adam_s = cpu_adam_s(shard, adam_bytes, cluster)
    nvme_bw = max(cluster.nvme_bandwidth_Bps, 1.0) / cluster.gpus_per_node
    nvme_bytes = 2.0 * ADAM_BYTES * shard + np.where((z == 3) & params_off, (2.0 * m + 1.0) * elem * shard, 0.0)
    total = host_s + adam_s + np.where(cand.offload == 2, nvme_bytes / nvme_bw, 0.0)
    return np.where(cand.offload > 0, total, 0.0)
