"""Hardware description the cost model reads: one GPU type, its node, and the links between nodes.

All bandwidths are per GPU and per direction unless the field says otherwise (bytes/s).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuSpec(_Frozen):
    name: str = Field(description="Accelerator model, e.g. 'A100-SXM4-80GB'.")
    hbm_bytes: int = Field(gt=0, description="Device memory capacity in bytes.")
    hbm_bandwidth_Bps: float = Field(gt=0, description="Device memory bandwidth, bytes/s.")
    peak_bf16_flops: float = Field(ge=0, description="Dense bf16 tensor-core peak, FLOP/s (0: unsupported).")
    peak_fp16_flops: float = Field(gt=0, description="Dense fp16 tensor-core peak, FLOP/s.")
    peak_fp32_flops: float = Field(gt=0, description="Dense fp32 peak (no TF32), FLOP/s.")


class EfficiencySpec(_Frozen):
    """Achieved fraction of peak, an assumption the report prints.

    Compute efficiency follows a saturating curve in the size of the dominant GEMM of a layer
    (per GPU, FLOPs): eff(x) = gemm_max * x / (x + gemm_half_flops).
    """

    gemm_max: float = Field(gt=0, le=1, description="Asymptotic fraction of peak FLOP/s for large GEMMs.")
    gemm_half_flops: float = Field(
        gt=0, description="GEMM size (FLOPs per GPU) at which efficiency reaches half of gemm_max."
    )
    memory_bound: float = Field(gt=0, le=1, description="Fraction of HBM bandwidth achieved by streaming ops.")
    intra_node_link: float = Field(gt=0, le=1, description="Fraction of NVLink bandwidth collectives achieve.")
    inter_node_link: float = Field(gt=0, le=1, description="Fraction of network bandwidth collectives achieve.")
    host_link: float = Field(gt=0, le=1, description="Fraction of PCIe bandwidth host<->device copies achieve.")


class ClusterSpec(_Frozen):
    name: str = Field(description="Profile name, e.g. 'dgx-a100-80g'.")
    description: str = Field(description="One line for humans.")
    source: str = Field(description="Where the numbers come from (data sheet, measurement).")
    gpu: GpuSpec = Field(description="The accelerator in every slot.")
    gpus_per_node: int = Field(gt=0, description="Accelerators per node.")
    intra_node_bandwidth_Bps: float = Field(
        gt=0, description="Per-GPU, per-direction bandwidth inside a node (NVLink/NVSwitch), bytes/s."
    )
    inter_node_bandwidth_Bps: float = Field(
        gt=0, description="Per-GPU, per-direction network bandwidth between nodes (InfiniBand), bytes/s."
    )
    host_to_device_bandwidth_Bps: float = Field(gt=0, description="Per-GPU PCIe bandwidth, bytes/s.")
    intra_node_latency_s: float = Field(ge=0, description="Latency of one collective step inside a node, s.")
    inter_node_latency_s: float = Field(ge=0, description="Latency of one collective step across nodes, s.")
    cpu_memory_bytes: int = Field(gt=0, description="Host memory per node, bytes.")
    cpu_memory_bandwidth_Bps: float = Field(gt=0, description="Host memory bandwidth per node, bytes/s.")
    nvme_bytes: int = Field(ge=0, description="Local NVMe capacity per node, bytes (0: none).")
    nvme_bandwidth_Bps: float = Field(ge=0, description="Local NVMe read+write bandwidth per node, bytes/s.")
    framework_reserve_bytes: int = Field(
        ge=0, description="Per-GPU memory the framework takes (context, allocator slack), bytes."
    )
    efficiency: EfficiencySpec = Field(description="Achieved fractions of the peak numbers.")

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s for a training precision ('bf16', 'fp16', 'fp32')."""
        return {
            "bf16": self.gpu.peak_bf16_flops,
            "fp16": self.gpu.peak_fp16_flops,
            "fp32": self.gpu.peak_fp32_flops,
        }[precision]
