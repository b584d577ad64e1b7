"""cpu-local: a profile for the 2-core CPU machines zplan is developed on, where each training
process (gloo, one core) plays the part of one GPU.

Measured, not taken from a data sheet, with
    .venv/bin/python -m zplan.probe 30
on an AMD EPYC (Zen 1, AVX2, KVM guest, 2 cores, 23.5 GiB RAM; torch 2.13.0 CPU, MKL), rounded to 3
significant digits; see zplan/probe.py for what each number measures and how. The machine was
shared with other work (1-minute load average 1.3-2.8 on its 2 cores), which is why the probe keeps the
fastest of repeated runs and times one thread's work in CPU time. Four runs of the probe within
30 minutes agreed within: op_s 9.2-10.2 us, sharded_unit_s 6.3-7.9 ms, collective latencies 20 %,
peak_fp32_flops 15 %, gemm_half_flops a factor 2, activation_ops and the bandwidths about 30 % (copy
bandwidth is what other processes disturb most).

What to know when reading a plan made with it:
- peak_*_flops are achieved single-core GEMM rates (the asymptote of a fitted efficiency curve), so
  gemm_max = 1. bf16 and fp16 are real measurements, not the fp32 number: torch multiplies them on
  this CPU through a slow path (no AVX512-BF16/AMX/FP16 on Zen 1), 15x (bf16) and 27x (fp16) slower
  than fp32. Plans for this profile should use --precision fp32.
- the fp32 curve is fitted to the MLP up-projection's forward + backward GEMMs (tokens x h x 4h,
  h = 32..512), the GEMM at which the cost model evaluates it.
- hbm_* is host memory: 8 GiB per process (70 % of RAM over 2 processes) at one process's share of
  the copy bandwidth; "host to device" is a copy within host memory.
- a transformer block's activation ops (LayerNorm, tanh-GELU, softmax, adds) are compute-bound on one
  core: they reach 0.43 of the copy bandwidth (activation_ops), while the optimizer's streaming reaches it.
- host_overheads: ~10 us of host time per aten op (dispatcher, autograd, Python module calls), which a
  tiny model's ~300 ops per micro-batch make a large part of its step; an FSDP2 unit (ZeRO-2/3) adds
  ~8 ms of host time per micro-batch, far more than its collectives; selective recompute (torch's
  selective checkpoint runs every op of the block through a Python dispatch mode) ~7.5 ms per block per
  micro-batch, full recompute ~2.3 ms.
- collectives: gloo between two local processes (TCP loopback), each type measured at 8 B and 8 MiB:
  all-gather and reduce-scatter cost 2-2.6x an all-reduce's per-step latency and run at 1/2-1/3 of its
  bandwidth, so they are not the halves of an all-reduce that the ring formula makes them. intra_node_*
  repeat the all-reduce's numbers; there is no network: inter_node_* repeat them too.
- overlaps_comm_with_compute = False: gloo runs on the cores that compute, so no collective hides
  behind the backward pass.
- nvme_*: free space and fsync'ed write rate of /tmp.
"""

from __future__ import annotations

from zplan.schemas.cluster import (
    CPU_PROCESS_GPU,
    ClusterSpec,
    CollectiveCost,
    CollectiveCosts,
    EfficiencySpec,
    GpuSpec,
    HostOverheads,
)

GiB = 1024**3

CPU_LOCAL = ClusterSpec(
    name="cpu-local",
    description="this kind of machine: 2 CPU processes (one core each) as devices, gloo",
    source="measured with zplan.probe.probe_this_machine on a 2-core AMD EPYC VM (see cpu_local.py)",
    gpu=GpuSpec(
        name=CPU_PROCESS_GPU,
        hbm_bytes=8 * GiB,  # 70 % of 23.5 GiB host RAM over 2 processes, whole GiB
        hbm_bandwidth_Bps=5.36e9,  # one process's copy bandwidth (read + write), <= node / 2
        peak_bf16_flops=1.85e9,  # n = 256 bf16 GEMM on one core, slow path (no AVX512-BF16)
        peak_fp16_flops=1.07e9,  # n = 256 fp16 GEMM on one core, slow path
        peak_fp32_flops=2.85e10,  # asymptote of the fp32 curve fitted to Linear(h, 4h) fwd + bwd GEMMs, one core
    ),
    gpus_per_node=2,  # processes = cores
    intra_node_bandwidth_Bps=8.15e8,  # gloo all-reduce, 2 processes: 8 MiB against 8 B (= collectives.all_reduce)
    inter_node_bandwidth_Bps=8.15e8,  # no second node: same as intra-node
    host_to_device_bandwidth_Bps=5.36e9,  # the "device" is host memory: a copy
    intra_node_latency_s=1.20e-4,  # per ring step: half of an 8-byte gloo all-reduce (240 us)
    inter_node_latency_s=1.20e-4,
    cpu_memory_bytes=25_276_063_744,  # physical RAM
    cpu_memory_bandwidth_Bps=1.07e10,  # copy bandwidth with both cores
    nvme_bytes=81_092_976_640,  # free space in /tmp at measurement time
    nvme_bandwidth_Bps=3.81e8,  # fsync'ed sequential write of 128 MiB
    framework_reserve_bytes=380_235_776,  # resident memory of a process with torch and gloo
    efficiency=EfficiencySpec(
        gemm_max=1.0,  # the peaks above are measured asymptotes
        gemm_half_flops=1.35e5,  # fitted: r(x) = R x / (x + x_half), x = 2 t h 4h, (t, h) = (64, 32) .. (2048, 512)
        memory_bound=1.0,  # c = a + b streams as fast as a copy on one core
        activation_ops=0.429,  # LayerNorm + tanh-GELU + softmax + add on 16 MiB: 2.30 GB/s, over hbm_bandwidth_Bps
        intra_node_link=1.0,  # bandwidths above are what the collectives achieved
        inter_node_link=1.0,
        host_link=1.0,
    ),
    overlaps_comm_with_compute=False,  # gloo's collectives run on the 2 cores that compute
    collectives=CollectiveCosts(  # gloo, 2 processes, fastest of repeated 8 B and 8 MiB calls
        all_reduce=CollectiveCost(latency_s=1.20e-4, bandwidth_Bps=8.15e8),  # t = S / B + 2 latency
        all_gather=CollectiveCost(latency_s=2.39e-4, bandwidth_Bps=4.24e8),  # t = S / (2 B) + latency
        reduce_scatter=CollectiveCost(latency_s=3.15e-4, bandwidth_Bps=3.16e8),  # t = S / (2 B) + latency
    ),
    host_overheads=HostOverheads(
        op_s=1.02e-5,  # CPU time of fwd + bwd of 4 reference GPT blocks (width 8, 4 tokens) / its 530 aten ops
        sharded_unit_s=7.91e-3,  # CPU-time slope per FSDP2 unit (1 -> 5 reference blocks) less the plain stack's
        selective_recompute_s=7.53e-3,  # CPU time per reference block: runtime's selective recompute less none
        full_recompute_s=2.33e-3,  # CPU time per reference block: runtime's full recompute less none
    ),
)
