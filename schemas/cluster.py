"""Hardware description the cost model reads: one GPU type, its node, and the links between nodes.

All bandwidths are per GPU and per direction unless the field says otherwise (bytes/s).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# Plausible range of a number by its unit (the end of its field name), zero aside where a field allows it: a
# value outside is a typo or a unit error, and a tiny or huge one overflows the cost model (an infinite step time,
# a plan.json that fails its own schema). Infinity and NaN are refused by every field (allow_inf_nan=False).
RANGE_BY_UNIT = {
    "_Bps": (1e3, 1e15, "1 kB/s to 1 PB/s"),
    "_per_s": (1.0, 1e15, "1 to 1e15 per second"),
    "_flops": (1.0, 1e19, "1 to 1e19 FLOP/s"),
    "_bytes": (2**20, 2**60, "1 MiB to 1 EiB"),
    "_s": (0.0, 3600.0, "0 to 3600 s"),
}
RANGE_BY_NAME = {"gemm_half_flops": (0.0, 1e19, "0 to 1e19 FLOPs")}  # tiny: every GEMM at gemm_max
GPUS_PER_NODE_MAX = 4096
CPU_PROCESS_GPU = "cpu-process"  # GpuSpec.name of a profile whose devices are CPU processes (cpu-local, zplan probe)
FRACTION_MIN = 1e-3  # an efficiency below 0.1 % is a typo


def _range_problem(name: str, value: float) -> str | None:
    """Why `value` of the field `name` is implausible, or None."""
    if name == "gpus_per_node" and value > GPUS_PER_NODE_MAX:
        return f"more than {GPUS_PER_NODE_MAX} accelerators per node"
    if isinstance(value, float) and 0 < value < FRACTION_MIN and not any(name.endswith(u) for u in RANGE_BY_UNIT):
        return f"an efficiency below {FRACTION_MIN:g}"
    units = sorted((unit for unit in RANGE_BY_UNIT if name.endswith(unit)), key=len)  # _per_s before _s
    bounds = RANGE_BY_NAME.get(name) or (RANGE_BY_UNIT[units[-1]] if units else None)
    if bounds and value != 0 and not bounds[0] <= value <= bounds[1]:
        return f"outside {bounds[2]}"
    return None


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _plausible(cls, value, info: ValidationInfo):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            problem = "not finite" if not math.isfinite(value) else _range_problem(info.field_name, value)
            if problem:
                raise ValueError(f"implausible: {problem}")
        return value


class GpuSpec(_Frozen):
    name: str = Field(description="Accelerator model, e.g. 'A100-SXM4-80GB'.")
    hbm_bytes: int = Field(gt=0, description="Device memory capacity in bytes.")
    hbm_bandwidth_Bps: float = Field(gt=0, description="Device memory bandwidth, bytes/s.")
    peak_bf16_flops: float = Field(ge=0, description="Dense bf16 tensor-core peak, FLOP/s (0: unsupported).")
    peak_fp16_flops: float = Field(gt=0, description="Dense fp16 tensor-core peak, FLOP/s.")
    peak_fp32_flops: float = Field(gt=0, description="Dense fp32 peak (no TF32), FLOP/s.")
    peak_fp8_flops: float = Field(default=0.0, ge=0, description="Dense fp8 (e4m3/e5m2) tensor-core peak, FLOP/s "
                                                                 "(0: no fp8 tensor cores).")
    peak_fp4_flops: float = Field(default=0.0, ge=0, description="Dense fp4 (NVFP4: e2m1 with e4m3 block scales) "
                                                                 "tensor-core peak, FLOP/s (0: no fp4 tensor cores).")


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
    activation_ops: float | None = Field(
        default=None, gt=0, le=1,
        description="Fraction of HBM bandwidth achieved by a block's activation ops (LayerNorm, GELU, softmax, "
                    "residual adds), where they are not memory-bound (a CPU core: tanh, reductions); None: "
                    "memory_bound.")
    attention: float | None = Field(
        default=None, gt=0, le=1,
        description="Fraction of peak FLOP/s the fused (flash) attention kernel reaches on the attention core "
                    "(QK^T, AV), forward and backward together, counted as the cost model counts them (causal "
                    "halves, backward twice the forward); None: the GEMM curve.")
    intra_node_link: float = Field(gt=0, le=1, description="Fraction of NVLink bandwidth collectives achieve.")
    inter_node_link: float = Field(gt=0, le=1, description="Fraction of network bandwidth collectives achieve.")
    host_link: float = Field(gt=0, le=1, description="Fraction of PCIe bandwidth host<->device copies achieve.")
    comm_overlap: float = Field(
        default=1.0, gt=0, le=1,
        description="Fraction of a phase's compute (the forward, the backward) that data-parallel / ZeRO collectives "
                    "can hide behind where they overlap compute: 1 hides them whenever they are shorter; less where "
                    "they slow the compute they run beside or start late (fitted by zplan calibrate).")


class CollectiveCost(_Frozen):
    """One collective as measured on one node, for the ring formulas of planner/cost/comm.py:
    all-reduce 2 (n-1)/n S / B + 2 (n-1) latency; all-gather, reduce-scatter (n-1)/n S / B + (n-1) latency
    (S: bytes of the full tensor)."""

    latency_s: float = Field(ge=0, description="Fixed time per ring step of this collective, s (tiny messages).")
    bandwidth_Bps: float = Field(gt=0, description="Per-device, per-direction bandwidth this collective achieves, "
                                                   "bytes/s (the link fraction included).")


class CollectiveCosts(_Frozen):
    """Measured per-collective costs inside a node, where one library's collectives differ by type (gloo's
    all-gather and reduce-scatter are not the halves of its all-reduce that the ring formula makes them)."""

    all_reduce: CollectiveCost = Field(description="All-reduce (DDP gradients, tensor-parallel activations).")
    all_gather: CollectiveCost = Field(description="All-gather (ZeRO-2/3 parameter gathers, ZeRO-1 weight sync).")
    reduce_scatter: CollectiveCost = Field(description="Reduce-scatter (ZeRO-2/3 gradient reduction).")


class HostOverheads(_Frozen):
    """Fixed host (CPU) time per operation. Where the host is the device (a CPU profile) it adds to the FLOPs and
    bytes; where the host dispatches ahead of its device (runs_ahead: a GPU) it is a floor under the device's time,
    which it hides behind while the device's work per op outlasts it (planner.cost.compute.with_host_s)."""

    op_s: float = Field(default=0.0, ge=0, description="Host time per dispatched aten op of a training step "
                                                       "(dispatcher, autograd, Python module call), s.")
    sharded_unit_s: float = Field(
        default=0.0, ge=0, description="Host time a ZeRO-2/3 (FSDP2) unit adds per micro-batch apart from its "
                                       "collectives: pre/post hooks, copy-in/out, resharding, s.")
    selective_recompute_s: float | None = Field(
        default=None, ge=0, description="Host time selective activation recompute adds per block per micro-batch "
                                        "(torch's selective checkpoint: a Python dispatch mode over every op, the "
                                        "re-run ops), s; None: the re-run ops at op_s.")
    full_recompute_s: float | None = Field(
        default=None, ge=0, description="Host time full activation recompute adds per block per micro-batch "
                                        "(torch.utils.checkpoint and the re-run forward's ops), s; None: the "
                                        "re-run ops at op_s.")
    runs_ahead: bool = Field(
        default=False, description="The host launches work on a separate device and runs ahead of it (a GPU): "
                                   "a block, the embedding, the head and the optimizer step each take the longer "
                                   "of their device time and their host time. False: the two add (a CPU).")


class ClusterSpec(_Frozen):
    name: str = Field(description="Profile name, e.g. 'dgx-a100-80g'.")
    description: str = Field(description="One line for humans.")
    source: str = Field(description="Where the numbers come from (data sheet, measurement).")
    gpu: GpuSpec = Field(description="The accelerator in every slot.")
    gpus_per_node: int = Field(gt=0, description="Accelerators per node (one host: its CPUs, memory, NVMe).")
    link_domain_gpus: int | None = Field(
        default=None, gt=0, description="Accelerators that reach each other at intra_node_bandwidth_Bps, a multiple "
                                        "of gpus_per_node: an NVL72 rack's NVLink domain joins 18 nodes of 4. None: "
                                        "gpus_per_node.")
    intra_node_bandwidth_Bps: float = Field(
        gt=0, description="Per-GPU, per-direction bandwidth inside a node (NVLink/NVSwitch), bytes/s."
    )
    inter_node_bandwidth_Bps: float = Field(
        gt=0, description="Per-GPU, per-direction network bandwidth between nodes (InfiniBand), bytes/s."
    )
    host_to_device_bandwidth_Bps: float = Field(gt=0, description="Per-GPU PCIe bandwidth, bytes/s.")
    device_to_host_bandwidth_Bps: float | None = Field(
        default=None, gt=0,
        description="Per-GPU device-to-host bandwidth, bytes/s, where it differs from host-to-device: zplan probe "
                    "measures both with pinned host memory on a machine with a GPU. None: "
                    "host_to_device_bandwidth_Bps (data sheets give one PCIe figure).")
    intra_node_latency_s: float = Field(ge=0, description="Latency of one collective step inside a node, s.")
    inter_node_latency_s: float = Field(ge=0, description="Latency of one collective step across nodes, s.")
    cpu_memory_bytes: int = Field(gt=0, description="Host memory per node, bytes.")
    cpu_memory_bandwidth_Bps: float = Field(gt=0, description="Host memory bandwidth per node, bytes/s.")
    cpu_adam_params_per_s: float | None = Field(
        default=None, gt=0,
        description="Parameters per second the node's CPU updates with AdamW on fp32 states, all cores together: "
                    "measured by zplan probe (zplan.cuda.cpu_adam.adamw_step_, the kernel ZeRO-Offload runs, on "
                    "fp32 states far larger than the caches). None: the CPU step is priced at "
                    "cpu_memory_bandwidth_Bps x efficiency.memory_bound.")
    nvme_bytes: int = Field(ge=0, description="Local NVMe capacity per node, bytes (0: none).")
    nvme_bandwidth_Bps: float = Field(ge=0, description="Local NVMe read+write bandwidth per node, bytes/s.")
    framework_reserve_bytes: int = Field(
        ge=0, description="Per-GPU memory the framework takes (context, allocator slack), bytes."
    )
    efficiency: EfficiencySpec = Field(description="Achieved fractions of the peak numbers.")
    overlaps_comm_with_compute: bool = Field(
        default=True, description="Data-parallel collectives run beside compute (GPUs: NCCL on its own streams). "
                                  "False where they share the cores that compute (gloo on a CPU).")
    collectives: CollectiveCosts | None = Field(
        default=None, description="Measured per-collective costs inside a node; None: every collective uses "
                                  "intra_node_bandwidth_Bps, efficiency.intra_node_link and intra_node_latency_s.")
    host_overheads: HostOverheads = Field(
        default_factory=HostOverheads, description="Fixed host time per op and per sharded unit; 0: not priced.")
    calibration_errors: list[float] | None = Field(
        default=None, description="log(measured / predicted) step seconds of measured runs under this profile, written "
                                  "by zplan calibrate: its --check runs' (left out of the fit) where it had any, else "
                                  "the fitted runs'. From 9 of them on, the plans' 80 % intervals on this profile are "
                                  "theirs (planner/uncertainty.py); None: the published runs' by regime.")
    calibration_errors_held_out: bool = Field(
        default=False, description="Whether calibration_errors are of runs left out of the fit.")

    def without_host(self) -> ClusterSpec:
        """This profile with its host time unpriced: for runs whose host dispatches otherwise than zplan's runtime
        (a published stack's fused kernels and CUDA graphs), or to check the device's terms alone."""
        return self.model_copy(update={"host_overheads": HostOverheads()})

    def link_domain(self) -> int:
        """GPUs a collective reaches over the intra-node link before it needs the network."""
        return self.link_domain_gpus or self.gpus_per_node

    def device_to_host_Bps(self) -> float:
        """Per-GPU device-to-host bandwidth, bytes/s: host_to_device_bandwidth_Bps where none is given."""
        return self.device_to_host_bandwidth_Bps or self.host_to_device_bandwidth_Bps

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s for a training precision ('bf16', 'fp16', 'fp32'; 'fp8' and 'nvfp4': bf16's, the peak of all
        but the block GEMMs and the MFU denominator, as torchao and NeMo report fp8 and fp4 MFU)."""
        return {
            "bf16": self.gpu.peak_bf16_flops,
            "fp16": self.gpu.peak_fp16_flops,
            "fp32": self.gpu.peak_fp32_flops,
            "fp8": self.gpu.peak_bf16_flops,
            "nvfp4": self.gpu.peak_bf16_flops,
        }[precision]

    def gemm_peak_flops(self, precision: str) -> float:
        """Peak FLOP/s of the blocks' Linear GEMMs: fp8's under fp8 training, fp4's under nvfp4 training, else
        peak_flops(precision)."""
        if precision == "nvfp4":
            return self.gpu.peak_fp4_flops
        return self.gpu.peak_fp8_flops if precision == "fp8" else self.peak_flops(precision)
