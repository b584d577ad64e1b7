"""cpu-local: a profile for the 2-core CPU machines zplan is developed on, where each training
process (gloo, one core) plays the part of one GPU.

Measured, not taken from a data sheet, with
    .venv/bin/python -m zplan.planner.probe 10
on an AMD EPYC (Zen 1, AVX2, KVM guest, 2 cores, 23.5 GiB RAM; torch 2.13.0 CPU, MKL), rounded to 3
significant digits; see zplan/planner/probe.py for what each number measures. Runs of the probe on
this VM vary by about 20 % (fp32 GEMM 35.8-39.0 GFLOP/s, one-core copy 8.4-13.8 GB/s).

What to know when reading a plan made with it:
- peak_*_flops are achieved single-core GEMM rates (the asymptote of a fitted efficiency curve), so
  gemm_max = 1. bf16 and fp16 are real measurements, not the fp32 number: torch multiplies them on
  this CPU through a slow path (no AVX512-BF16/AMX/FP16 on Zen 1), 17x (bf16) and 31x (fp16) slower
  than fp32. Plans for this profile should use --precision fp32.
- gemm_half_flops: a GEMM of 2 * 43^3 FLOPs already runs at half the asymptote (MKL on one core).
- hbm_* is host memory: 8 GiB per process (70 % of RAM over 2 processes) at one process's share of
  the copy bandwidth; "host to device" is a copy within host memory.
- intra_node_*: gloo all-reduce between two local processes (TCP loopback), fitted to the ring
  formula t(S) = S / B + 2 * latency. There is no network: inter_node_* repeat them.
- nvme_*: free space and fsync'ed write rate of /tmp.
"""

from __future__ import annotations

from zplan.schemas.cluster import ClusterSpec, EfficiencySpec, GpuSpec

GiB = 1024**3

CPU_LOCAL = ClusterSpec(
    name="cpu-local",
    description="this kind of machine: 2 CPU processes (one core each) as devices, gloo",
    source="measured with zplan.planner.probe.probe_this_machine on a 2-core AMD EPYC VM (see cpu_local.py)",
    gpu=GpuSpec(
        name="cpu-process",
        hbm_bytes=8 * GiB,  # 70 % of 23.5 GiB host RAM over 2 processes, whole GiB
        hbm_bandwidth_Bps=8.40e9,  # one process's copy bandwidth (read + write), <= node / 2
        peak_bf16_flops=2.05e9,  # n = 256 bf16 GEMM on one core, slow path (no AVX512-BF16)
        peak_fp16_flops=1.14e9,  # n = 256 fp16 GEMM on one core, slow path
        peak_fp32_flops=3.58e10,  # asymptote of the fitted fp32 GEMM curve, one core (AVX2 FMA, MKL)
    ),
    gpus_per_node=2,  # processes = cores
    intra_node_bandwidth_Bps=1.18e9,  # gloo all-reduce, 2 processes, 32 MiB message
    inter_node_bandwidth_Bps=1.18e9,  # no second node: same as intra-node
    host_to_device_bandwidth_Bps=8.40e9,  # the "device" is host memory: a copy
    intra_node_latency_s=7.66e-5,  # per ring step: half of a 4-byte gloo all-reduce (153 us)
    inter_node_latency_s=7.66e-5,
    cpu_memory_bytes=25_276_063_744,  # physical RAM
    cpu_memory_bandwidth_Bps=1.68e10,  # copy bandwidth with both cores
    nvme_bytes=83_688_927_232,  # free space in /tmp at measurement time
    nvme_bandwidth_Bps=4.32e8,  # fsync'ed sequential write of 128 MiB
    framework_reserve_bytes=281_509_888,  # resident memory of a process with torch and gloo
    efficiency=EfficiencySpec(
        gemm_max=1.0,  # the peaks above are measured asymptotes
        gemm_half_flops=1.58e5,  # fitted: r(x) = R x / (x + x_half) over n = 32 .. 1024
        memory_bound=1.0,  # c = a + b streams as fast as a copy on one core
        intra_node_link=1.0,  # bandwidth above is what all-reduce achieved
        inter_node_link=1.0,
        host_link=1.0,
    ),
)
