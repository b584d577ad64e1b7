"""Measure this machine into a ClusterSpec where every CPU process plays the part of one GPU.

    python -m zplan.probe [SECONDS]      # prints the ClusterSpec as JSON

One "device" = one training process pinned to one core (torchrun sets OMP_NUM_THREADS=1 when it
starts several processes), so compute and device-memory numbers are measured with one thread, and
the node holds as many devices as the machine has cores. Times are the fastest of repeated runs: the
machine's own cost, with as little as possible of other processes' load; what one thread computes is
timed in CPU time (time.process_time), which does not count the time another process held the core.
What each number is:

- peak_fp32_flops, efficiency.gemm_half_flops: the asymptote R and half point x_half of the rate
  r(x) = R * x / (x + x_half) fitted (least squares of 1/r against 1/x, a straight line) to the
  forward + backward GEMMs of a transformer's MLP up-projection, Linear(h, 4h) on t tokens, timed as
  the three matmuls autograd runs (Y = X W^T, dX = dY W, dW = dY^T X; 3 x 2 t h 4h FLOPs) at the
  shapes of MLP_GEMM_SHAPES, with x = 2 t h 4h: the GEMM and the x at which planner/cost/compute.py
  evaluates the curve. Skinny GEMMs (h = 32..64) run far below square ones of the same FLOPs on a CPU.
  These are achieved rates, not data-sheet peaks, so efficiency.gemm_max = 1.
- peak_{bf16,fp16}_flops: one square GEMM (n = 256), raised to the asymptote along the fp32 curve:
  torch runs them on a CPU through a slow path where the CPU lacks AVX512-BF16/AMX/FP16 (a measured
  rate far below fp32 is then the truth, and the planner should see it).
- hbm_bandwidth_Bps: one process's copy bandwidth (bytes read + written per second of a tensor far
  larger than the caches), capped at the node's bandwidth divided by the processes sharing it.
- efficiency.memory_bound: the fraction of one core's copy bandwidth an elementwise op (c = a + b)
  achieves (the streaming of the optimizer step).
- efficiency.activation_ops: bytes read + written per second by the activation ops of a transformer
  block (LayerNorm, tanh-GELU, softmax, residual add; one call each on ELEMENTWISE_BYTES), over
  hbm_bandwidth_Bps. On a CPU they are compute-bound (GELU's tanh, the normalisations), far below a copy.
- cpu_memory_bandwidth_Bps: copy bandwidth of the node with every core (torch's default threads).
- host_overheads.op_s: host seconds per aten op of a training step, from one forward + backward of a
  stack of pre-LayerNorm GPT blocks (examples/gpt.py's structure) at negligible sizes (width 8, 4 tokens),
  divided by the aten ops it dispatched (counted with a TorchDispatchMode): dispatcher, autograd and
  Python module calls, with no arithmetic to speak of. Timed in CPU time (time.process_time), the
  process's own work, which other processes on the cores inflate far less than wall time.
- host_overheads.{selective,full}_recompute_s: what zplan's activation recompute (torch's selective
  checkpoint, a Python dispatch mode over every op of the block; torch.utils.checkpoint) adds per block
  to the same forward + backward, in CPU time: the machinery and the re-run ops, with no arithmetic.
- collectives (gloo between two spawned processes, each of all-reduce, all-gather, reduce-scatter):
  the time of an 8-byte and a COLLECTIVE_LARGE_BYTES message gives the fixed cost and the bandwidth of
  that type, read through the ring formulas of planner/cost/comm.py for two ranks:
  all-reduce S / B + 2 latency; all-gather, reduce-scatter S / (2 B) + latency.
  intra_node_bandwidth_Bps and intra_node_latency_s are the all-reduce's (link fraction 1). There is
  no second node: inter-node numbers repeat them.
- host_overheads.sharded_unit_s: the host CPU time one FSDP2 unit (fully_shard, reshard_after_forward=True,
  the ZeRO-3 of zplan's runtime) adds per forward + backward: the slope over the number of units
  (FSDP_UNITS) of a stack of FSDP2-wrapped reference blocks, less the slope of the same stack without
  FSDP2, both in CPU time (hooks, copy-in/out, DTensor bookkeeping; the waits inside its collectives are
  not CPU time, and the cost model prices them with the collective costs above).
- overlaps_comm_with_compute: False, gloo runs its collectives on the cores that compute.
- host_to_device_bandwidth_Bps: the "device" is host memory, so a copy: the per-process bandwidth. On a
  machine with a GPU (torch.cuda.is_available()), the pinned-memory copy rate from the host to GPU 0, and
  device_to_host_bandwidth_Bps the rate back: what offloaded states cross in a run there.
- cpu_adam_params_per_s: parameters per second of zplan.cuda.cpu_adam.adamw_step_ (its C++ kernel, or the
  pure-torch reference where that does not build; the profile's source says which) on fp32 weights,
  gradients and moments of CPU_ADAM_PARAMS each (4 x 64 MiB, far beyond the caches), with every core
  (torch's default threads): the node's ZeRO-Offload CPU step, which planner/cost/offload.py shares
  among the node's devices.
- hbm_bytes: 70 % of host RAM divided by the processes, whole GiB; cpu_memory_bytes: host RAM.
- nvme_bytes, nvme_bandwidth_Bps: free space and fsync'ed write rate of the temporary directory.
- framework_reserve_bytes: resident memory of a process that imported torch and joined gloo.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from zplan.probe_collectives import (
    COLLECTIVE_LARGE_BYTES,
    COLLECTIVE_SMALL_BYTES,
    collective_costs,
    gloo_two_processes,
)
from zplan.probe_overheads import (
    count_aten_ops,
    host_seconds_per_op,
    host_seconds_per_recompute,
    reference_input,
    reference_stack,
)
from zplan.probe_rates import (
    copy_bandwidth_Bps,
    cpu_adam_params_per_s,
    disk_bandwidths_Bps,
    elementwise_bandwidth_Bps,
    fit_saturating_curve,
    host_device_bandwidths_Bps,
    host_memory_bytes,
    matmul_flops_per_s,
    mlp_gemm_flops_per_s,
    transformer_elementwise_Bps,
)
from zplan.schemas.cluster import (
    CPU_PROCESS_GPU,
    ClusterSpec,
    EfficiencySpec,
    GpuSpec,
    HostOverheads,
)

__all__ = ["COLLECTIVE_LARGE_BYTES", "COLLECTIVE_SMALL_BYTES", "collective_costs", "count_aten_ops",
           "disk_bandwidths_Bps", "fit_saturating_curve", "probe_this_machine", "reference_input", "reference_stack"]

GiB = 1024**3
HOST_SHARE_FOR_DEVICES = 0.7  # fraction of host RAM handed to the device processes
# (tokens, h) of the Linear(h, 4h) forward + backward GEMMs the fp32 curve is fitted to: x = 2 t h 4h
MLP_GEMM_SHAPES = ((64, 32), (256, 32), (64, 64), (256, 64), (1024, 64), (256, 128), (1024, 128), (1024, 256),
                   (2048, 512))
HALF_PRECISION_SIZE = 256  # n of the bf16/fp16 GEMM (slow paths on CPUs without native support)
ELEMENTWISE_BYTES = 16 * 2**20  # tensor size for the memory-bound ops (beyond the L2 cache)
CPU_ADAM_PARAMS = 16 * 2**20  # fp32 parameters of the CPU Adam measurement: 4 states of 64 MiB each
HOST_DEVICE_BYTES = 256 * 2**20  # size of the pinned host <-> GPU copies


# ---- the profile ----------------------------------------------------------------------------------------


def _one_core_numbers(unit: float, node_copy_Bps: float, processes: int) -> dict:
    """Everything measured on one thread (one device = one process on one core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sizes, rates = zip(*(mlp_gemm_flops_per_s(t, h, unit / 2) for t, h in MLP_GEMM_SHAPES), strict=True)
        fp32_rate, half_flops = fit_saturating_curve(list(sizes), list(rates))
        # bf16/fp16: one square size, raised to the asymptote along the fp32 curve.
        half_size_flops = 2.0 * HALF_PRECISION_SIZE**3
        along_curve = half_size_flops / (half_size_flops + half_flops)
        one_core_copy_Bps = copy_bandwidth_Bps(256 * 2**20, unit, clock=time.process_time)
        # Processes stream at the same time: each gets at most its share of the node's bandwidth.
        process_copy_Bps = min(one_core_copy_Bps, node_copy_Bps / processes)
        return {
            "fp32": fp32_rate, "half_flops": half_flops,
            "bf16": matmul_flops_per_s(HALF_PRECISION_SIZE, torch.bfloat16, unit) / along_curve,
            "fp16": matmul_flops_per_s(HALF_PRECISION_SIZE, torch.float16, unit) / along_curve,
            "process_copy_Bps": process_copy_Bps,
            "memory_bound": min(1.0, elementwise_bandwidth_Bps(256 * 2**20, unit) / one_core_copy_Bps),
            # over hbm_bandwidth_Bps, so that the cost model's hbm_bandwidth_Bps * activation_ops is the rate measured
            "activation_ops": min(1.0, transformer_elementwise_Bps(ELEMENTWISE_BYTES, unit) / process_copy_Bps),
            "op_s": host_seconds_per_op(unit),
            "selective_recompute_s": host_seconds_per_recompute("selective", unit),
            "full_recompute_s": host_seconds_per_recompute("full", unit),
        }
    finally:
        torch.set_num_threads(threads)


def probe_this_machine(seconds_budget: float = 10, nvme_path: str | None = None) -> ClusterSpec:
    """Measure this machine (about 2-3 x `seconds_budget` seconds) into a ClusterSpec named 'cpu-local'.
    `nvme_path`: the folder offloaded states would be swapped to (default: the temporary directory);
    its free space and the slower of its sequential write and read rates are the profile's NVMe."""
    processes = os.cpu_count() or 1
    unit = seconds_budget / 30  # per measurement: ~18 of them plus process start-up fill the budget
    node_copy_Bps = copy_bandwidth_Bps(512 * 2**20, unit)
    adam_params_per_s, adam_backend = cpu_adam_params_per_s(CPU_ADAM_PARAMS, 2 * unit)
    link = host_device_bandwidths_Bps(HOST_DEVICE_BYTES, unit)
    one = _one_core_numbers(unit, node_copy_Bps, processes)
    costs, sharded_unit_s, resident_bytes = gloo_two_processes(12 * unit)
    host_bytes = host_memory_bytes()
    disk = nvme_path or tempfile.gettempdir()
    disk_write, disk_read = disk_bandwidths_Bps(disk)
    device_bytes = int(HOST_SHARE_FOR_DEVICES * host_bytes / processes) // GiB * GiB
    all_reduce = costs.all_reduce
    return ClusterSpec(
        name="cpu-local",
        description=f"this machine: {processes} CPU processes (one core each) as devices, gloo",
        source=f"measured by zplan.probe.probe_this_machine (CPU Adam: {adam_backend}"
               + ("; host-device: pinned copies to GPU 0)" if link else ")"),
        gpu=GpuSpec(
            name=CPU_PROCESS_GPU,
            hbm_bytes=max(device_bytes, GiB),
            hbm_bandwidth_Bps=one["process_copy_Bps"],
            peak_bf16_flops=one["bf16"],
            peak_fp16_flops=one["fp16"],
            peak_fp32_flops=one["fp32"],
        ),
        gpus_per_node=processes,
        intra_node_bandwidth_Bps=all_reduce.bandwidth_Bps,
        inter_node_bandwidth_Bps=all_reduce.bandwidth_Bps,
        host_to_device_bandwidth_Bps=link[0] if link else one["process_copy_Bps"],
        device_to_host_bandwidth_Bps=link[1] if link else None,
        intra_node_latency_s=all_reduce.latency_s,
        inter_node_latency_s=all_reduce.latency_s,
        cpu_memory_bytes=host_bytes,
        cpu_memory_bandwidth_Bps=node_copy_Bps,
        cpu_adam_params_per_s=adam_params_per_s,
        nvme_bytes=os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize,
        nvme_bandwidth_Bps=min(disk_write, disk_read),  # swapping both reads and writes
        framework_reserve_bytes=resident_bytes,
        efficiency=EfficiencySpec(
            gemm_max=1.0,
            gemm_half_flops=one["half_flops"],
            memory_bound=one["memory_bound"],
            activation_ops=one["activation_ops"],
            intra_node_link=1.0,
            inter_node_link=1.0,
            host_link=1.0,
        ),
        overlaps_comm_with_compute=False,
        collectives=costs,
        host_overheads=HostOverheads(op_s=one["op_s"], sharded_unit_s=sharded_unit_s,
                                     selective_recompute_s=one["selective_recompute_s"],
                                     full_recompute_s=one["full_recompute_s"]),
    )


if __name__ == "__main__":
    print(probe_this_machine(float(sys.argv[1]) if len(sys.argv) > 1 else 10).model_dump_json(indent=2))
