"""Measure this machine into a ClusterSpec where every CPU process plays the part of one GPU.

    python -m zplan.planner.probe [SECONDS]      # prints the ClusterSpec as JSON

One "device" = one training process pinned to one core (torchrun sets OMP_NUM_THREADS=1 when it
starts several processes), so compute and device-memory numbers are measured with one thread, and
the node holds as many devices as the machine has cores. What each number is:

- peak_{fp32,bf16,fp16}_flops: the asymptote R of the matmul rate r(x) = R * x / (x + x_half) fitted
  over square GEMMs of x = 2 n^3 FLOPs (least squares of 1/r against 1/x, a straight line). These
  are achieved rates, not data-sheet peaks, so efficiency.gemm_max = 1 and gemm_half_flops = the
  fitted x_half of fp32 (the curve the cost model applies to every precision). bf16 and fp16 are
  timed at one size (n = 256) and raised to the asymptote along the fp32 curve: torch does run them
  on a CPU, through a slow path where the CPU lacks AVX512-BF16/AMX/FP16 (a measured rate far below
  fp32 is then the truth, and the planner should see it).
- hbm_bandwidth_Bps: one process's copy bandwidth (bytes read + written per second of a tensor far
  larger than the caches), capped at the node's bandwidth divided by the processes sharing it.
  memory_bound: the fraction of one core's copy bandwidth an elementwise op (c = a + b) achieves.
- cpu_memory_bandwidth_Bps: copy bandwidth of the node with every core (torch's default threads).
- intra_node_bandwidth_Bps, intra_node_latency_s: gloo all-reduce between two spawned processes fitted
  to the ring formula the cost model uses, t(S) = S / B + 2 * latency for two ranks; the link fraction
  is then 1. There is no second node: inter-node numbers repeat the intra-node ones.
- host_to_device_bandwidth_Bps: the "device" is host memory, so a copy: the per-process bandwidth.
- hbm_bytes: 70 % of host RAM divided by the processes, whole GiB; cpu_memory_bytes: host RAM.
- nvme_bytes, nvme_bandwidth_Bps: free space and fsync'ed write rate of the temporary directory.
- framework_reserve_bytes: resident memory of a process that imported torch and joined gloo.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from zplan.schemas.cluster import ClusterSpec, EfficiencySpec, GpuSpec

GiB = 1024**3
HOST_SHARE_FOR_DEVICES = 0.7  # fraction of host RAM handed to the device processes
MATMUL_SIZES = (32, 64, 128, 256, 512, 1024)  # n of the n x n x n GEMMs timed for fp32
HALF_PRECISION_SIZE = 256  # n of the bf16/fp16 GEMM (slow paths on CPUs without native support)


def _best_time_s(fn: Callable[[], object], seconds: float, min_repeats: int = 3) -> float:
    """Fastest of repeated calls of `fn` (after one warm-up call) within about `seconds`."""
    fn()
    best, deadline, repeats = float("inf"), time.perf_counter() + seconds, 0
    while repeats < min_repeats or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        repeats += 1
    return best


def matmul_flops_per_s(n: int, dtype: torch.dtype, seconds: float) -> float:
    """FLOP/s of an n x n by n x n matmul (2 n^3 FLOPs) on the current torch threads."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2.0 * n**3 / _best_time_s(lambda: torch.mm(a, b), seconds)


def fit_saturating_curve(sizes_flops: list[float], rates: list[float]) -> tuple[float, float]:
    """(R, x_half) of r(x) = R * x / (x + x_half), by least squares of 1/r = 1/R + (x_half/R) / x."""
    xs = [1.0 / x for x in sizes_flops]
    ys = [1.0 / r for r in rates]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    intercept = mean_y - slope * mean_x
    if intercept <= 0:  # no saturation seen: take the fastest measured rate as the asymptote
        return max(rates), min(sizes_flops)
    return 1.0 / intercept, max(slope / intercept, 1.0)


def copy_bandwidth_Bps(num_bytes: int, seconds: float) -> float:
    """Bytes read + written per second by dst.copy_(src) of `num_bytes`."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2.0 * num_bytes / _best_time_s(lambda: dst.copy_(src), seconds)


def elementwise_bandwidth_Bps(num_bytes: int, seconds: float) -> float:
    """Bytes read + written per second by torch.add(a, b, out=c) on tensors of `num_bytes`."""
    a, b = torch.ones(num_bytes // 4), torch.ones(num_bytes // 4)
    c = torch.empty_like(a)
    return 3.0 * num_bytes / _best_time_s(lambda: torch.add(a, b, out=c), seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_worker(rank: int, port: int, seconds: float, large_bytes: int, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    small, large = torch.ones(1), torch.ones(large_bytes // 4)
    small_s = _best_time_s(lambda: dist.all_reduce(small), seconds / 2, min_repeats=20)
    large_s = _best_time_s(lambda: dist.all_reduce(large), seconds / 2)
    if rank == 0:
        results.put((small_s, large_s, _resident_bytes()))
    dist.barrier()
    dist.destroy_process_group()


def gloo_allreduce_two_processes(seconds: float, large_bytes: int = 32 * 2**20) -> tuple[float, float, int]:
    """(bandwidth B/s, latency s per ring step, resident bytes of one worker) of a 2-process gloo
    all-reduce, from t(S) = S / B + 2 * latency (ring all-reduce over two ranks)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(_allreduce_worker, args=(_free_port(), seconds, large_bytes, results), nprocs=2, join=True)
    small_s, large_s, resident = results.get()
    latency_s = small_s / 2.0
    return large_bytes / max(large_s - small_s, 1e-9), latency_s, resident


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def disk_write_Bps(directory: str, num_bytes: int = 128 * 2**20) -> float:
    """fsync'ed sequential write rate of `num_bytes` into `directory`."""
    block = os.urandom(2**20)
    with tempfile.NamedTemporaryFile(dir=directory) as f:
        start = time.perf_counter()
        for _ in range(num_bytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        return num_bytes / (time.perf_counter() - start)


def probe_this_machine(seconds_budget: float = 10) -> ClusterSpec:
    """Measure this machine (about `seconds_budget` seconds) into a ClusterSpec named 'cpu-local'."""
    processes = os.cpu_count() or 1
    unit = seconds_budget / 30  # per measurement: ~15 of them plus process start-up fill the budget
    threads = torch.get_num_threads()
    node_copy_Bps = copy_bandwidth_Bps(512 * 2**20, unit)
    torch.set_num_threads(1)  # one device = one process on one core
    try:
        sizes = [2.0 * n**3 for n in MATMUL_SIZES]
        fp32_rate, half_flops = fit_saturating_curve(
            sizes, [matmul_flops_per_s(n, torch.float32, unit) for n in MATMUL_SIZES]
        )
        # bf16/fp16: one size, raised to the asymptote along the fp32 curve.
        half_size_flops = 2.0 * HALF_PRECISION_SIZE**3
        along_curve = half_size_flops / (half_size_flops + half_flops)
        bf16_rate = matmul_flops_per_s(HALF_PRECISION_SIZE, torch.bfloat16, unit) / along_curve
        fp16_rate = matmul_flops_per_s(HALF_PRECISION_SIZE, torch.float16, unit) / along_curve
        one_core_copy_Bps = copy_bandwidth_Bps(256 * 2**20, unit)
        # Processes stream at the same time: each gets at most its share of the node's bandwidth.
        process_copy_Bps = min(one_core_copy_Bps, node_copy_Bps / processes)
        elementwise_fraction = min(1.0, elementwise_bandwidth_Bps(256 * 2**20, unit) / one_core_copy_Bps)
    finally:
        torch.set_num_threads(threads)
    link_Bps, latency_s, resident_bytes = gloo_allreduce_two_processes(4 * unit)
    host_bytes = host_memory_bytes()
    tmp = tempfile.gettempdir()
    device_bytes = int(HOST_SHARE_FOR_DEVICES * host_bytes / processes) // GiB * GiB
    return ClusterSpec(
        name="cpu-local",
        description=f"this machine: {processes} CPU processes (one core each) as devices, gloo",
        source="measured by zplan.planner.probe.probe_this_machine",
        gpu=GpuSpec(
            name="cpu-process",
            hbm_bytes=max(device_bytes, GiB),
            hbm_bandwidth_Bps=process_copy_Bps,
            peak_bf16_flops=bf16_rate,
            peak_fp16_flops=fp16_rate,
            peak_fp32_flops=fp32_rate,
        ),
        gpus_per_node=processes,
        intra_node_bandwidth_Bps=link_Bps,
        inter_node_bandwidth_Bps=link_Bps,
        host_to_device_bandwidth_Bps=process_copy_Bps,
        intra_node_latency_s=latency_s,
        inter_node_latency_s=latency_s,
        cpu_memory_bytes=host_bytes,
        cpu_memory_bandwidth_Bps=node_copy_Bps,
        nvme_bytes=os.statvfs(tmp).f_bavail * os.statvfs(tmp).f_frsize,
        nvme_bandwidth_Bps=disk_write_Bps(tmp),
        framework_reserve_bytes=resident_bytes,
        efficiency=EfficiencySpec(
            gemm_max=1.0,
            gemm_half_flops=half_flops,
            memory_bound=elementwise_fraction,
            intra_node_link=1.0,
            inter_node_link=1.0,
            host_link=1.0,
        ),
    )


if __name__ == "__main__":
    print(probe_this_machine(float(sys.argv[1]) if len(sys.argv) > 1 else 10).model_dump_json(indent=2))
