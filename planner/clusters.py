"""Built-in cluster profiles (vendor data sheets; cpu-local measured, see cpu_local.py) and loading
of user cluster files (YAML/JSON).

Bandwidths are per GPU, per direction. Where a data sheet gives a node total or a bidirectional
figure, the division is written out next to the number.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import ValidationError

from zplan.errors import ClusterError, validation_message
from zplan.planner.cpu_local import CPU_LOCAL
from zplan.safe_files import UnsafeFileError, read_capped
from zplan.schemas.cluster import ClusterSpec, EfficiencySpec, GpuSpec, HostOverheads

GiB = 1024**3
GB = 1e9
TB = 1e12

# Achieved fractions of peak for NVIDIA data-centre GPUs. Assumptions, printed in every report:
# large bf16 GEMMs reach ~80% of tensor-core peak in cuBLAS; NCCL bus bandwidth reaches ~80% of
# NVLink and ~90% of InfiniBand line rate (nccl-tests); PCIe copies ~80%. The flash attention kernel's fraction
# (efficiency.attention) is set per GPU below.
_NVIDIA_EFFICIENCY = EfficiencySpec(
    gemm_max=0.80,
    gemm_half_flops=2.0e9,  # the A100's; each profile scales it by its peak (GEMM_HALF_TIME_S, nvidia_efficiency)
    memory_bound=0.80,
    intra_node_link=0.80,
    inter_node_link=0.90,
    host_link=0.80,
)

# A GEMM spends a fixed time beyond its FLOPs (launch, prologue and epilogue, the last partial wave): x_half /
# (gemm_max * peak) in the efficiency curve (planner/cost/compute.py gemm_efficiency), so its half point in FLOPs grows
# with the peak. The profiles' half point was 2 GFLOP on every GPU, an assumption without a source; it is kept for the
# A100, the first profile (2 GFLOP at 312 TFLOP/s: 6.4 us of peak work, 8.0 us at gemm_max), and scaled by each GPU's
# 16-bit peak: an H100 needs 6.3 GFLOP to reach half its efficiency, a B200 14.4 (and its fp8 GEMMs twice that).
GEMM_HALF_TIME_S = _NVIDIA_EFFICIENCY.gemm_half_flops / (312 * TB)  # s: the A100's half point at its 16-bit peak


def nvidia_efficiency(peak_16bit_flops: float, **update) -> EfficiencySpec:
    """_NVIDIA_EFFICIENCY with the GEMM half point of a GPU of this 16-bit peak (GEMM_HALF_TIME_S), and `update`."""
    return _NVIDIA_EFFICIENCY.model_copy(update={"gemm_half_flops": GEMM_HALF_TIME_S * peak_16bit_flops, **update})


# FlashAttention-2 forward + backward, causal, head dim 64-128, sequences 2k-16k (Dao 2023, arXiv:2307.08691,
# Figs. 4-7): ~175-200 TFLOP/s on an A100 (of 312), ~330 on an H100 SXM5 (of 989; FlashAttention-3, Shah et al. 2024,
# Fig. 5, measures FA2's forward at 350-370). Those figures count the backward as 2.5 forwards, the cost model as 2
# (planner/cost/compute.py): x 3 / 3.5.
FLASH_ATTENTION_A100 = 190e12 * 3.0 / 3.5 / 312e12  # 0.52
FLASH_ATTENTION_H100 = 330e12 * 3.0 / 3.5 / 989e12  # 0.29
# Blackwell (B200, and the same chip in GB200 / GB300): FlashAttention-4 (Zadouri, ..., Dao 2026; Together AI's
# release, March 2026) reaches up to 1605 TFLOP/s forward in BF16 on a B200, 1.3x cuDNN 9.13, the kernel torch's SDPA
# and Transformer Engine call there: 1605 / 1.3 TFLOP/s forward, x 3 / 3.5 as above. A fraction of each profile's
# own BF16 peak (FLOP/s, not a fraction: the same chip at 2250 or 2500 TFLOP/s).
FLASH_ATTENTION_BLACKWELL_FLOPS = 1605e12 / 1.3 * 3.0 / 3.5  # 1.06 PFLOP/s

# Host time of zplan's runtime on a GPU machine, measured once: examples/tiny.py (2 blocks of width 64, 8 x 64 tokens)
# trained on one H200 (2026-12-04, benchmarks/gpu_check.sh, step tiny; docs/results.md, On a GPU) spent 16 ms in
# forward + backward, all host time: 2 x BLOCK_OPS + EMBEDDING_OPS + HEAD_OPS = 306 counted aten ops
# (planner/cost/compute.py), 52 us a counted op, what the bf16 program dispatches beside them included. The host runs
# ahead of the GPU, so this is a floor under each block's device time, not an addition (HostOverheads.runs_ahead).
# Not measured apart: other hosts (taken as this one), the optimizer step (5 ms there against 14 ops' 0.7 ms) and
# FSDP2's per-unit hooks (sharded_unit_s 0).
GPU_HOST = HostOverheads(op_s=16e-3 / 306, runs_ahead=True)

DGX_A100_80G = ClusterSpec(
    name="dgx-a100-80g",
    description="NVIDIA DGX A100 80GB: 8x A100-SXM4-80GB, NVSwitch, 8x HDR 200 Gb/s InfiniBand",
    source="NVIDIA DGX A100 data sheet (2020); A100 80GB data sheet",
    gpu=GpuSpec(
        name="A100-SXM4-80GB",
        hbm_bytes=80 * GB,
        hbm_bandwidth_Bps=2039 * GB,
        peak_bf16_flops=312 * TB,
        peak_fp16_flops=312 * TB,
        peak_fp32_flops=19.5 * TB,
    ),
    gpus_per_node=8,
    intra_node_bandwidth_Bps=600 * GB / 2,  # NVLink 3: 600 GB/s bidirectional per GPU
    inter_node_bandwidth_Bps=200e9 / 8,  # one 200 Gb/s HDR port per GPU = 25 GB/s
    host_to_device_bandwidth_Bps=32 * GB,  # PCIe Gen4 x16 per direction
    intra_node_latency_s=8e-6,
    inter_node_latency_s=15e-6,
    cpu_memory_bytes=2 * 1024 * GiB,  # 2 TB DDR4
    cpu_memory_bandwidth_Bps=2 * 204.8 * GB,  # 2x AMD EPYC 7742, 8 channels DDR4-3200 each
    nvme_bytes=int(30 * TB),  # 8x 3.84 TB U.2 NVMe
    nvme_bandwidth_Bps=25 * GB,  # 8 PCIe Gen4 drives in RAID-0 (assumed, not in the data sheet)
    framework_reserve_bytes=2 * GiB,
    host_overheads=GPU_HOST,
    efficiency=nvidia_efficiency(312 * TB, attention=FLASH_ATTENTION_A100),
)

# A100 40GB nodes as MosaicML benchmarked them: 8 GPUs, NVSwitch, 1600 Gb/s RoCE per node (llm-foundry's
# benchmarking README); host side as the DGX A100.
DGX_A100_40G = DGX_A100_80G.model_copy(
    update={
        "name": "dgx-a100-40g",
        "description": "8x A100-SXM4-40GB, NVSwitch, 1600 Gb/s RoCE per node",
        "source": "A100 40GB data sheet (2020); node network from MosaicML llm-foundry's benchmarking README",
        "gpu": DGX_A100_80G.gpu.model_copy(
            update={"name": "A100-SXM4-40GB", "hbm_bytes": int(40 * GB), "hbm_bandwidth_Bps": 1555 * GB}
        ),
        "inter_node_bandwidth_Bps": 1600e9 / 8 / 8,  # 1600 Gb/s a node over 8 GPUs = 25 GB/s
        "cpu_memory_bytes": 1024 * GiB,  # 1 TB (DGX A100 40GB configuration)
    }
)

DGX_H100 = ClusterSpec(
    name="dgx-h100",
    description="NVIDIA DGX H100: 8x H100-SXM5-80GB, NVSwitch, 8x NDR 400 Gb/s InfiniBand",
    source="NVIDIA DGX H100 data sheet (2023); H100 data sheet (dense, no sparsity)",
    gpu=GpuSpec(
        name="H100-SXM5-80GB",
        hbm_bytes=80 * GB,
        hbm_bandwidth_Bps=3350 * GB,
        peak_bf16_flops=989 * TB,
        peak_fp16_flops=989 * TB,
        peak_fp32_flops=67 * TB,
        peak_fp8_flops=1979 * TB,
    ),
    gpus_per_node=8,
    intra_node_bandwidth_Bps=900 * GB / 2,  # NVLink 4: 900 GB/s bidirectional per GPU
    inter_node_bandwidth_Bps=400e9 / 8,  # one 400 Gb/s NDR port per GPU = 50 GB/s
    host_to_device_bandwidth_Bps=64 * GB,  # PCIe Gen5 x16 per direction
    intra_node_latency_s=6e-6,
    inter_node_latency_s=12e-6,
    cpu_memory_bytes=2 * 1024 * GiB,
    cpu_memory_bandwidth_Bps=2 * 307.2 * GB,  # 2x Xeon 8480C, 8 channels DDR5-4800 each
    nvme_bytes=int(30 * TB),
    nvme_bandwidth_Bps=50 * GB,  # 8 PCIe Gen4/5 drives in RAID-0 (assumed)
    framework_reserve_bytes=2 * GiB,
    host_overheads=GPU_HOST,
    efficiency=nvidia_efficiency(989 * TB, attention=FLASH_ATTENTION_H100),
)

DGX_H200 = DGX_H100.model_copy(
    update={
        "name": "dgx-h200",
        "description": "NVIDIA DGX H200: 8x H200-SXM-141GB, NVSwitch, 8x NDR 400 Gb/s InfiniBand",
        "source": "NVIDIA DGX H200 data sheet (2024); H200 data sheet (dense, no sparsity)",
        "gpu": DGX_H100.gpu.model_copy(
            update={"name": "H200-SXM-141GB", "hbm_bytes": int(141 * GB), "hbm_bandwidth_Bps": 4800 * GB}
        ),
    }
)

DGX_B200 = ClusterSpec(
    name="dgx-b200",
    description="NVIDIA DGX B200: 8x B200-180GB, NVLink 5 / NVSwitch, 8x NDR 400 Gb/s InfiniBand",
    source="NVIDIA DGX B200 data sheet (2024): 1440 GB HBM3e and 64 TB/s a node, 72 PFLOP/s FP8 training and "
           "144 PFLOP/s FP4 a node (with sparsity; dense is half); B200 bf16 dense 2.25 PFLOP/s",
    gpu=GpuSpec(
        name="B200-180GB",
        hbm_bytes=180 * GB,  # 1440 GB / 8
        hbm_bandwidth_Bps=8000 * GB,  # 64 TB/s / 8
        peak_bf16_flops=2250 * TB,
        peak_fp16_flops=2250 * TB,
        peak_fp32_flops=75 * TB,  # FP32 (non-tensor) per GPU, 600 TFLOP/s a node / 8
        peak_fp8_flops=4500 * TB,  # 72 PFLOP/s sparse a node / 8 / 2
        peak_fp4_flops=9000 * TB,  # FP4 Tensor Core 144 PFLOP/s sparse a node / 8 / 2
    ),
    gpus_per_node=8,
    intra_node_bandwidth_Bps=1800 * GB / 2,  # NVLink 5: 1.8 TB/s bidirectional per GPU
    inter_node_bandwidth_Bps=400e9 / 8,  # one 400 Gb/s NDR port per GPU = 50 GB/s
    host_to_device_bandwidth_Bps=64 * GB,  # PCIe Gen5 x16 per direction
    intra_node_latency_s=6e-6,
    inter_node_latency_s=12e-6,
    cpu_memory_bytes=2 * 1024 * GiB,  # 2 TB (up to 4 TB)
    cpu_memory_bandwidth_Bps=2 * 358.4 * GB,  # 2x Xeon Platinum 8570, 8 channels DDR5-5600 each
    nvme_bytes=int(30 * TB),  # 8x 3.84 TB U.2 NVMe
    nvme_bandwidth_Bps=50 * GB,  # 8 PCIe Gen5 drives in RAID-0 (assumed)
    framework_reserve_bytes=2 * GiB,
    host_overheads=GPU_HOST,
    efficiency=nvidia_efficiency(2250 * TB, attention=FLASH_ATTENTION_BLACKWELL_FLOPS / (2250 * TB)),
)

# GB200 NVL72: one NVLink domain of 72 Blackwell GPUs in 18 compute trays (nodes) of 4 GPUs and 2 Grace CPUs; every
# GPU of the rack reaches every other at NVLink bandwidth (link_domain_gpus). Each Grace is joined to its 2 GPUs by
# NVLink-C2C (900 GB/s bidirectional a superchip).
# Rack figures from the data sheet (with sparsity where marked; dense is half): FP4 1,440 PFLOP/s sparse, FP8
# 720 PFLOP/s sparse, FP16/BF16 360 PFLOP/s sparse, HBM3e 13.4 TB at 576 TB/s, LPDDR5X 17 TB at 18.4 TB/s,
# NVLink 130 TB/s.
GB200_NVL72 = ClusterSpec(
    name="gb200-nvl72",
    description="NVIDIA GB200 NVL72: 72x B200 (GB200 superchips), one NVLink 5 domain, 400 Gb/s InfiniBand a GPU",
    source="NVIDIA GB200 NVL72 data sheet (2024), per GPU = rack / 72, dense = sparse / 2; ConnectX-7 400 Gb/s per GPU",
    gpu=GpuSpec(
        name="B200-186GB (GB200)",
        hbm_bytes=186 * GB,  # 13.4 TB / 72
        hbm_bandwidth_Bps=8000 * GB,  # 576 TB/s / 72
        peak_bf16_flops=2500 * TB,  # 360 PFLOP/s sparse / 72 / 2
        peak_fp16_flops=2500 * TB,
        peak_fp32_flops=80 * TB,  # FP32 5760 TFLOP/s a rack / 72
        peak_fp8_flops=5000 * TB,  # 720 PFLOP/s sparse / 72 / 2
        peak_fp4_flops=10000 * TB,  # FP4 Tensor Core 1,440 PFLOP/s sparse / 72 / 2
    ),
    gpus_per_node=4,  # a compute tray: 2 GB200 superchips (2 Grace + 4 GPUs)
    link_domain_gpus=72,  # the NVLink domain: 18 trays
    intra_node_bandwidth_Bps=1800 * GB / 2,  # NVLink 5: 1.8 TB/s bidirectional per GPU (130 TB/s / 72)
    inter_node_bandwidth_Bps=400e9 / 8,  # one 400 Gb/s ConnectX-7 port per GPU = 50 GB/s
    host_to_device_bandwidth_Bps=900 * GB / 2 / 2,  # NVLink-C2C 900 GB/s bidirectional, shared by 2 GPUs
    intra_node_latency_s=6e-6,
    inter_node_latency_s=12e-6,
    cpu_memory_bytes=2 * 480 * GB,  # 2 Grace a tray x 480 GB LPDDR5X (17 TB a rack / 18)
    cpu_memory_bandwidth_Bps=18.4 * TB / 18,  # 18.4 TB/s a rack / 18 trays (2 x 512 GB/s)
    nvme_bytes=int(4 * 3.84 * TB),  # 4 E1.S 3.84 TB a tray (assumed, not in the data sheet)
    nvme_bandwidth_Bps=4 * 6 * GB,  # PCIe Gen5 E1.S at ~6 GB/s each (assumed)
    framework_reserve_bytes=2 * GiB,
    host_overheads=GPU_HOST,
    efficiency=nvidia_efficiency(2500 * TB, attention=FLASH_ATTENTION_BLACKWELL_FLOPS / (2500 * TB)),
)

# GB300 NVL72 (Blackwell Ultra): the GB200 rack with 288 GB of HBM3e a GPU and 800 Gb/s ConnectX-8 a GPU. FP8 and
# BF16 per GPU as GB200 (720 / 360 PFLOP/s sparse a rack). FP4 is where Blackwell Ultra gains: the data sheet gives
# it as "1,440 | 1,080 PFLOP/s" (with | without sparsity), so its dense FP4 is 1,080 / 72 = 15 PFLOP/s a GPU, not
# sparse / 2 (sparsity adds a third, not a doubling, on Blackwell Ultra's FP4).
GB300_NVL72 = GB200_NVL72.model_copy(
    update={
        "name": "gb300-nvl72",
        "description": "NVIDIA GB300 NVL72: 72x Blackwell Ultra (GB300 superchips), one NVLink 5 domain, "
                       "800 Gb/s ConnectX-8 a GPU",
        "source": "NVIDIA GB300 NVL72 data sheet (2025): HBM3e 20.7 TB at 576 TB/s, LPDDR5X 17 TB at 14 TB/s, "
                  "FP8 720 PFLOP/s and BF16 360 PFLOP/s sparse a rack, FP4 1,080 PFLOP/s dense; per GPU = rack / 72, "
                  "dense = sparse / 2 where only sparse is given",
        "gpu": GB200_NVL72.gpu.model_copy(update={"name": "B300-288GB (GB300)", "hbm_bytes": int(288 * GB),
                                                  "peak_fp4_flops": 15000 * TB}),  # 1,080 PFLOP/s dense / 72
        "inter_node_bandwidth_Bps": 800e9 / 8,  # one 800 Gb/s ConnectX-8 port per GPU = 100 GB/s
        "cpu_memory_bandwidth_Bps": 14 * TB / 18,  # 14 TB/s a rack / 18 trays
    }
)

# L40S (Ada, PCIe, no NVLink): the serving rows' 4- and 8-GPU servers; GPUs talk over PCIe Gen4 x16.
L40S_SERVER = ClusterSpec(
    name="l40s-8",
    description="8x NVIDIA L40S 48GB (PCIe Gen4, no NVLink), 2x 400 Gb/s a server",
    source="NVIDIA L40S data sheet (2023), dense = sparse / 2: FP8 1466 / 2, BF16 733 / 2 TFLOP/s; GDDR6 864 GB/s",
    gpu=GpuSpec(
        name="L40S-48GB",
        hbm_bytes=48 * GB,
        hbm_bandwidth_Bps=864 * GB,
        peak_bf16_flops=366 * TB,
        peak_fp16_flops=366 * TB,
        peak_fp32_flops=91.6 * TB,
        peak_fp8_flops=733 * TB,
    ),
    gpus_per_node=8,
    intra_node_bandwidth_Bps=32 * GB,  # PCIe Gen4 x16 per direction, through the host's switches
    inter_node_bandwidth_Bps=2 * 400e9 / 8 / 8,  # 2x 400 Gb/s a server over 8 GPUs (assumed)
    host_to_device_bandwidth_Bps=32 * GB,
    intra_node_latency_s=10e-6,
    inter_node_latency_s=15e-6,
    cpu_memory_bytes=1024 * GiB,
    cpu_memory_bandwidth_Bps=2 * 307.2 * GB,  # 2 sockets, 8 channels DDR5-4800 each (assumed)
    nvme_bytes=int(15 * TB),
    nvme_bandwidth_Bps=25 * GB,  # assumed
    framework_reserve_bytes=2 * GiB,
    host_overheads=GPU_HOST,
    efficiency=nvidia_efficiency(366 * TB),
)

DGX2_V100 = ClusterSpec(
    name="dgx2-v100",
    description="NVIDIA DGX-2: 16x V100-SXM3-32GB, NVSwitch, 8x EDR 100 Gb/s InfiniBand",
    source="NVIDIA DGX-2 data sheet (2018); V100 data sheet. No bf16 on V100.",
    gpu=GpuSpec(
        name="V100-SXM3-32GB",
        hbm_bytes=32 * GB,
        hbm_bandwidth_Bps=900 * GB,
        peak_bf16_flops=0.0,
        peak_fp16_flops=125 * TB,
        peak_fp32_flops=15.7 * TB,
    ),
    gpus_per_node=16,
    intra_node_bandwidth_Bps=300 * GB / 2,  # NVLink 2 via NVSwitch: 300 GB/s bidirectional per GPU
    inter_node_bandwidth_Bps=8 * 100e9 / 8 / 16,  # 8x 100 Gb/s EDR per node shared by 16 GPUs
    host_to_device_bandwidth_Bps=16 * GB,  # PCIe Gen3 x16
    intra_node_latency_s=10e-6,
    inter_node_latency_s=20e-6,
    cpu_memory_bytes=int(1.5 * 1024 * GiB),
    cpu_memory_bandwidth_Bps=2 * 128 * GB,  # 2x Xeon 8168, 6 channels DDR4-2666 each
    nvme_bytes=int(30 * TB),
    nvme_bandwidth_Bps=12 * GB,  # 8 PCIe Gen3 drives in RAID-0 (assumed)
    framework_reserve_bytes=int(1.5 * GiB),
    host_overheads=GPU_HOST,
    efficiency=nvidia_efficiency(125 * TB),  # fp16
)

MAX_CLUSTER_FILE_BYTES = 1 << 20  # a profile is a few kB; more is not one

BUILTIN_CLUSTERS: dict[str, ClusterSpec] = {
    c.name: c for c in (DGX_A100_80G, DGX_A100_40G, DGX_H100, DGX_H200, DGX_B200, GB200_NVL72, GB300_NVL72, L40S_SERVER,
                        DGX2_V100, CPU_LOCAL)
}


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A built-in profile by name, or a ClusterSpec from a .yaml/.yml/.json file."""
    if name_or_path in BUILTIN_CLUSTERS:
        return BUILTIN_CLUSTERS[name_or_path]
    path = Path(name_or_path)
    if not path.exists():  # a folder or a special file is refused by kind below
        known = ", ".join(sorted(BUILTIN_CLUSTERS))
        raise ClusterError(
            f"unknown cluster '{name_or_path}': not a built-in profile ({known}) and not a file. "
            "Pass one of those names or a YAML/JSON file with a ClusterSpec (see `zplan clusters --json`)."
        )
    try:
        text = read_capped(path, MAX_CLUSTER_FILE_BYTES, "cluster file").decode()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except UnsafeFileError as exc:
        raise ClusterError(f"{exc}: not a cluster profile (see `zplan clusters --json` for one)") from None
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as exc:
        raise ClusterError(f"cluster file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                           f"{_first_line(exc)}") from None
    if not isinstance(data, dict):
        raise ClusterError(f"cluster file {path} is not a valid ClusterSpec: it holds a {type(data).__name__}, not a "
                           "mapping of fields (see `zplan clusters --json`)")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        raise ClusterError(f"cluster file {path} is not a valid ClusterSpec: {validation_message(exc)}") from None


def _first_line(error: Exception) -> str:
    """The parser's message on one line, at most 200 characters."""
    return " ".join(str(error).split())[:200] or type(error).__name__
