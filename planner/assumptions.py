"""Every number a prediction rests on, as (name, value, source) rows for the report."""

from __future__ import annotations

from zplan.planner.cost.compute import (
    BACKWARD_OVER_FORWARD,
    BLOCK_OPS,
    FP8_CAST_BYTES_PER_ELEMENT,
    NVFP4_CAST_BYTES_PER_ELEMENT,
    STREAMED_PER_SAVED_BYTE,
)
from zplan.planner.cost.memory import (
    ADAM_BYTES,
    DDP_BUCKET_BYTES,
    GRAD_BYTES,
    HOST_USABLE_FRACTION,
    LOSS_BYTES_PER_LOGIT,
    MASTER_BYTES,
    NVFP4_CAST_TEMPORARY_BYTES_PER_ELEMENT,
    PARAM_BYTES,
)
from zplan.planner.cost.memory_activations import LOSS_PARALLEL_BYTES_PER_LOGIT
from zplan.planner.cost.step import ADAM_BYTES_PER_PARAM, CLIP_NORM_PASSES, CLIP_PASSES
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.model import ModelSummary
from zplan.schemas.plan import Assumption
from zplan.schemas.spec import TrainSpec, compute_dtype

GB = 1e9


def assumptions(cluster: ClusterSpec, summary: ModelSummary, train: TrainSpec) -> list[Assumption]:
    gpu, eff, host = cluster.gpu, cluster.efficiency, cluster.host_overheads
    src = cluster.source
    dtype = compute_dtype(train.precision)  # of everything but fp8's / nvfp4's GEMMs
    rows = [
        ("GPU", f"{gpu.name}, {cluster.gpus_per_node} per node" + (
            f", {cluster.link_domain()} per NVLink domain" if cluster.link_domain() != cluster.gpus_per_node else ""),
         src),
        (f"peak {dtype} FLOP/s", f"{cluster.peak_flops(train.precision) / 1e12:.1f} TFLOP/s", src),
        *([("fp8 training", f"the blocks' Linear GEMMs at the fp8 peak, {gpu.peak_fp8_flops / 1e12:.0f} TFLOP/s, on "
                            "the GEMM curve; each operand cast twice with dynamic scaling, "
                            f"{FP8_CAST_BYTES_PER_ELEMENT:.0f} B an element of X, W and G streamed; attention, "
                            "head, parameters, gradients and activations as bf16; MFU against the bf16 peak",
            f"{src}; torchao float8 (runtime/precision/float8.py)")] if train.precision == "fp8" else []),
        *([("nvfp4 training", f"the blocks' Linear GEMMs (forward, input and weight gradients) at the fp4 peak, "
                              f"{gpu.peak_fp4_flops / 1e12:.0f} TFLOP/s, on the GEMM curve; X, W and G each quantised "
                              "twice (along each GEMM's reduction dim: e2m1 values, an e4m3 scale per 16, fp32 per "
                              f"tensor), {NVFP4_CAST_BYTES_PER_ELEMENT:.3f} B an element streamed, "
                              f"{NVFP4_CAST_TEMPORARY_BYTES_PER_ELEMENT:.0f} B per (b, s, ffn) element of temporaries "
                              "in a Linear's backward; no Hadamard transform or stochastic rounding; attention, head, "
                              "parameters, gradients and activations as bf16; MFU against the bf16 peak",
            f"{src}; NVIDIA, Pretraining LLMs with NVFP4 (2025); torchao NVFP4Tensor (runtime/precision/nvfp4.py)")]
          if train.precision == "nvfp4" else []),
        *([("routing", f"{summary.experts.describe()}; tokens spread over the experts "
                       + ("evenly (balanced, dropless: as the published benchmarks force it; --moe-imbalance F "
                          "prices a busiest expert-parallel rank at F times the mean)"
                          if summary.experts.imbalance == 1.0 else
                          f"unevenly: the busiest expert-parallel rank gets {summary.experts.imbalance:g}x the mean "
                          "routed tokens (--moe-imbalance), its compute, all-to-alls and activations priced so"),
            "planner/expert_trace.py")] if summary.experts else []),
        ("HBM capacity", f"{gpu.hbm_bytes / GB:.0f} GB", src),
        ("HBM bandwidth", f"{gpu.hbm_bandwidth_Bps / GB:.0f} GB/s", src),
        ("intra-node link", f"{cluster.intra_node_bandwidth_Bps / GB:.1f} GB/s per GPU per direction", src),
        ("inter-node link", f"{cluster.inter_node_bandwidth_Bps / GB:.2f} GB/s per GPU per direction", src),
        ("host-device link", f"{cluster.host_to_device_bandwidth_Bps / GB:.0f} GB/s per GPU", src),
        ("collective latency", f"{cluster.intra_node_latency_s * 1e6:.0f} us intra, "
                               f"{cluster.inter_node_latency_s * 1e6:.0f} us inter-node per step", src),
        *([("collectives by type", ", ".join(
            f"{kind.replace('_', '-')} {getattr(cluster.collectives, kind).latency_s * 1e6:.0f} us + "
            f"{getattr(cluster.collectives, kind).bandwidth_Bps / GB:.2f} GB/s"
            for kind in ("all_reduce", "all_gather", "reduce_scatter")), src)]
          if cluster.collectives is not None else []),
        ("host memory", f"{cluster.cpu_memory_bytes / GB:.0f} GB, {cluster.cpu_memory_bandwidth_Bps / GB:.0f} GB/s "
                        "per node", src),
        ("NVMe", f"{cluster.nvme_bytes / GB:.0f} GB, {cluster.nvme_bandwidth_Bps / GB:.0f} GB/s per node", src),
        ("framework reserve", f"{cluster.framework_reserve_bytes / 2**30:.1f} GiB per GPU", src),
        ("GEMM efficiency curve", f"{eff.gemm_max:.2f} * x / (x + {eff.gemm_half_flops:.2g} FLOPs), "
                                  "x = per-GPU MLP GEMM; the half point is a GEMM's fixed time at the 16-bit peak, "
                                  "so an fp8 or fp4 GEMM's is as much larger as its peak",
         "cluster profile (assumption; planner/clusters.py GEMM_HALF_TIME_S)"),
        ("attention efficiency", (f"{eff.attention:.2f} of peak on the attention core (QK^T, AV) through the flash "
                                  "kernel; no (s, s) bytes streamed" if eff.attention is not None
                                  else "the GEMM curve on the attention core"), (
            "FlashAttention-2 forward + backward (Dao 2023, Figs. 4-7), counted as the cost model counts FLOPs; "
            "torch 2.11's causal SDPA ran at 1.18x the dgx-h200 figure at 4k tokens, 1.65x at 16k-64k on one H200 "
            "(benchmarks/gpu_measured_vs_predicted.py)"
            if eff.attention is not None else "cluster profile (no flash figure)")),
        ("memory-bound efficiency", f"{eff.memory_bound:.2f} of HBM bandwidth" + (
            f"; activation ops {eff.activation_ops:.2f}" if eff.activation_ops is not None else ""),
         "cluster profile (assumption)"),
        ("link efficiency", f"NVLink {eff.intra_node_link:.2f}, network {eff.inter_node_link:.2f}, "
                            f"PCIe {eff.host_link:.2f}", "cluster profile (assumption)"),
        ("communication overlap", "none: collectives share the cores that compute (gloo on CPU), so each adds to "
                                  "the step" if not cluster.overlaps_comm_with_compute else
         f"data-parallel / ZeRO collectives hide behind {eff.comm_overlap:.0%} of their phase's compute (forward, "
         "backward); tensor-parallel and pipeline sends do not overlap", src),
        *([("host overhead", f"{host.op_s * 1e6:.1f} us per aten op ({BLOCK_OPS} per block per micro-batch): a "
                             "floor under each block's, the embedding's, the head's and the optimizer step's device "
                             "time, as the host runs ahead of the GPU; it binds where a block's device work is "
                             "shorter. Not priced: the optimizer step's host time beyond its op count (examples/tiny.py"
                             " on one H200: 5 ms measured, 0.7 ms priced), FSDP2's per-unit hooks",
            "examples/tiny.py's forward + backward on one H200, 16 ms over 306 counted ops (benchmarks/gpu_check.sh),"
            " unless calibrated; op counts of examples/gpt.py (planner/cost/compute.py)")]
          if host.runs_ahead else
          [("host overhead", f"{host.op_s * 1e6:.1f} us per aten op ({BLOCK_OPS} per block per micro-batch), "
                             f"{host.sharded_unit_s * 1e3:.2f} ms per FSDP2 unit per micro-batch",
            f"{src}; op counts of examples/gpt.py (planner/cost/compute.py)")]
          if host.op_s or host.sharded_unit_s else
          [("host overhead", "not priced (0)", src)]),
        ("backward / forward FLOPs", f"{BACKWARD_OVER_FORWARD:.0f}x", "Narayanan et al. SC'21 Sec. 5.1"),
        ("streamed / saved activation bytes", f"{STREAMED_PER_SAVED_BYTE} (memory-bound ops), the backward twice the "
                                              "forward; the runtime runs the model's code unfused: measured 0.52x "
                                              "this for examples/gpt.py's block, 1.42x for transformers' Llama "
                                              "(eager RMSNorm, RoPE, SwiGLU)",
         "count of a Megatron GPT block's elementwise traffic (planner/cost/compute.py); benchmarks/streamed_bytes.py"),
        ("activation memory", "per-block saved bytes split replicated (10sbh) / tp-sharded",
         "Korthikanti et al. MLSys'23 Table 2"),
        ("logits and loss", "the runtime's default loss: the logits' own bytes (twice on a vocabulary split over tp) "
                            "and a 64 MiB fp32 chunk or two; a model file's own loss "
                            f"{LOSS_BYTES_PER_LOGIT[dtype]:.0f} B per logit, {LOSS_PARALLEL_BYTES_PER_LOGIT:.0f} B per "
                            "local logit under a split vocabulary (b, s, V / tp)",
         "measured: benchmarks/loss_memory.py; model/cross_entropy.py, runtime/parallel/vocab_parallel.py"),
        ("model states", (f"ZeRO 0/1: 2 B {dtype} weight + 2 B {dtype} gradient + "
                          f"{MASTER_BYTES + ADAM_BYTES:.0f} B fp32 master and Adam moments per parameter; ZeRO 2/3: "
                          if train.precision != "fp32" else "") +
         f"{PARAM_BYTES:.0f} B fp32 weight + {GRAD_BYTES:.0f} B fp32 gradient + {ADAM_BYTES:.0f} B Adam moments"
         f"{'' if train.precision == 'fp32' else ' (FSDP2 casts transient 16-bit copies for compute)'}; sharded by "
         "ZeRO stage", "zplan's runtime (schemas/model_states.py); partitioning: Rajbhandari et al. SC'20"),
        ("gradient accumulation and reduction", (
            f"ZeRO 0/1 in {dtype} (DDP buckets of {DDP_BUCKET_BYTES // 2**20} MiB, reduced once a step), "
            "ZeRO 2/3 in fp32 (reduce-scattered every micro-batch)" if train.precision != "fp32" else
            f"in fp32, DDP buckets of {DDP_BUCKET_BYTES // 2**20} MiB") + (
            ", overlapped with the backward" if cluster.overlaps_comm_with_compute
            else ", after the backward (no overlap)"), "torch DDP / FSDP2 defaults"),
        ("GPU optimizer phase", f"gradient clipping streams {CLIP_PASSES:.0f}x the gradients' bytes on the GPU "
                                f"({CLIP_NORM_PASSES:.0f}x with 16-bit parameters, whose step unscales), AdamW "
                                f"{ADAM_BYTES_PER_PARAM:.0f} bytes per parameter of its shard; the runtime's optimizer "
                                "phase took 2.4x the AdamW bytes alone for 0.95B parameters under FSDP2 on one H200 "
                                "(measured before the clipping was priced: it adds up to 12 bytes a parameter, 1.4x)",
         "clip_grad_norm_ and fused AdamW traffic; benchmarks/gpu_measured_vs_predicted.py"),
        ("eager step on a GPU", "not priced: a 0.95B transformers Llama trained by its train.py on one H200 (FSDP2, "
                                "bf16) spent about 1.5x the price of everything but the attention kernel (GEMMs, "
                                "eager elementwise ops, FSDP2's casts and copies) at 4k and 16k tokens; published "
                                "PyTorch FSDP runs took 1.15-1.21x this model's price on A100s (FSDP1, 104 runs), "
                                "1.34x on H100s (FSDP1, 53) and 1.20x (FSDP2, 1): the validation matches them with a "
                                "constant, which zplan's own plans do not carry",
         "benchmarks/gpu_measured_vs_predicted.py; benchmarks/validate_cost_model.py (raw_error by stack); "
         "docs/cost-model.md"),
        ("offload", "host transfers are not overlapped with compute (conservative); the CPU Adam step neither, "
                    "unless the plan turns on the delayed parameter update (see its row)",
         "Ren et al. ATC'21; the delayed update: planner/placement_choice.py"),
        ("host / NVMe usable", f"{HOST_USABLE_FRACTION:.0%} of capacity", "zplan default"),
        ("model numbers", f"{summary.tracer} ({summary.source}); attention FLOPs halved by the causal mask",
         "planner/trace.py or planner/family.py"),
    ]
    return [Assumption(name=n, value=v, source=s) for n, v, s in rows]
