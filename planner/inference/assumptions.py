"""Every number an inference prediction rests on, as (name, value, source) rows for the report."""

from __future__ import annotations

from zplan.planner.cost.memory import HOST_USABLE_FRACTION
from zplan.planner.inference.cost import (
    BLOCK_FORWARD_OPS,
    PREFETCH_LAYERS,
    QUANT_GROUP_SIZE,
    InferenceModel,
    Workload,
    pass_host_s,
)
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.model import ModelSummary
from zplan.schemas.plan import Assumption

GB = 1e9


def inference_assumptions(cluster: ClusterSpec, summary: ModelSummary, model: InferenceModel,
                          work: Workload, fp8: bool = False) -> list[Assumption]:
    """Every number the prediction assumed; fp8: the search scored fp8 weights (pinned), so their row too."""
    gpu, eff, src = cluster.gpu, cluster.efficiency, cluster.source
    dtype = work.compute_dtype
    rows = [
        ("GPU", f"{gpu.name}, {cluster.gpus_per_node} per node", src),
        (f"peak {dtype} FLOP/s", f"{cluster.peak_flops(dtype) / 1e12:.1f} TFLOP/s", src),
        ("HBM capacity", f"{gpu.hbm_bytes / GB:.0f} GB", src),
        ("HBM bandwidth", f"{gpu.hbm_bandwidth_Bps / GB:.0f} GB/s at {eff.memory_bound:.2f} achieved "
                          "(decode reads weights and KV cache at this rate)", f"{src}; cluster profile (assumption)"),
        ("GEMM efficiency curve", f"{eff.gemm_max:.2f} * x / (x + {eff.gemm_half_flops:.2g} FLOPs), x = per-GPU MLP "
                                  "GEMM of the pass (B*P tokens in prefill, B in decode); fp8 weights' GEMMs: the half "
                                  "point as much larger as the fp8 peak",
         "cluster profile (assumption), as planner/cost/compute.py"),
        ("tensor-parallel all-reduce", f"2 per block per pass, ring over tp GPUs at "
                                       f"{cluster.intra_node_bandwidth_Bps / GB:.0f} GB/s x {eff.intra_node_link:.2f}"
                                       f" + {cluster.intra_node_latency_s * 1e6:.0f} us per step",
         "Shoeybi et al. 2019 (Megatron-LM) Sec. 3; planner/cost/comm.py"),
        ("host-device link", f"{cluster.host_to_device_bandwidth_Bps / GB:.0f} GB/s per GPU x {eff.host_link:.2f} "
                             "achieved (streamed weights)", f"{src}; cluster profile (assumption)"),
        ("NVMe", f"{cluster.nvme_bytes / GB:.0f} GB, {cluster.nvme_bandwidth_Bps / GB:.1f} GB/s per node shared by "
                 "the node's GPUs in use", src),
        ("host memory", f"{cluster.cpu_memory_bytes / GB:.0f} GB per node; {HOST_USABLE_FRACTION:.0%} of host memory "
                        "and NVMe usable; every GPU process keeps its own copy of its streamed shard",
         "zplan default (planner/cost/memory.py)"),
        ("framework reserve", f"{cluster.framework_reserve_bytes / 2**30:.1f} GiB per GPU", src),
        ("weights", f"block Linears split over tp at the weight precision; embeddings, norms, biases and the head "
                    f"({model.replicated_params:,.0f} parameters) replicated at {dtype}, the head's "
                    "vocabulary x hidden matrix at the weight precision when int8/int4 (at the compute dtype for fp8)",
         "zplan's inference engine (runtime.inference)"),
        ("quantization", f"weight-only, group-wise symmetric: int8 1 byte, int4 0.5 byte per weight, plus one "
                         f"fp32 scale per group of at most {QUANT_GROUP_SIZE} inputs (the largest power of two "
                         "dividing every quantized input width on one GPU)",
         "Frantar et al. 2023 (GPTQ) / Dettmers et al. 2022 (LLM.int8()) group-wise format"),
        *([("fp8", "W8A8 (e4m3): 1 byte per block Linear weight plus one fp32 scale per output channel, activations "
                   "cast per token; the block GEMMs at the fp8 peak "
                   f"({cluster.gpu.peak_fp8_flops / 1e12:,.0f} TFLOP/s), attention and the head at the compute "
                   "dtype's", "Micikevicius et al. 2022 (FP8 formats for deep learning); runtime/inference/fp8.py")]
          if fp8 else []),
        ("KV cache", f"2 * layers * max_batch * max_seq_len * ceil(kv_heads / tp) * head_dim * bytes, preallocated "
                     f"for max_seq_len = {work.max_seq_len}", "Kwon et al. 2023 (PagedAttention) Sec. 2"),
        ("decode context", f"prompt + gen / 2 = {work.mean_decode_context:g} tokens (the mean over the decode steps)",
         "zplan (mean of the KV-cache reads)"),
        ("prefill", "compute bound: 2 FLOPs per Linear weight per token + causal attention 2*P^2*h per block, "
                    "logits for the last position only; at least one read of the weights",
         "Pope et al. 2022 Sec. 2-3; Kaplan et al. 2020 (C = 2N)"),
        ("decode step", "memory bound: resident weights + KV cache read once; compute bound instead where the "
                        "FLOPs take longer; plus the host's dispatch time on CPU profiles",
         "Pope et al. 2022 Sec. 3.1"),
        ("attention memory", "flash / memory-efficient attention: no P x P scores kept", "Dao et al. 2022"),
        ("activations", "largest prefill transient of one block: residual, q/k/v/output and MLP inner values, plus "
                        "the last position's fp32 logits", "zplan estimate"),
        ("streaming", f"block weights move every pass (prefill and each decode step), {PREFETCH_LAYERS} layer "
                      "prefetched: a layer takes max(transfer, compute)" if cluster.overlaps_comm_with_compute else
                      "block weights move every pass (prefill and each decode step); this device does not overlap "
                      "copies with compute, so a layer takes transfer + compute",
         "Aminabadi et al. 2022 (DeepSpeed-Inference, ZeRO-Inference) Sec. 6"),
        *([("host overhead", f"{cluster.host_overheads.op_s * 1e6:.1f} us per aten op, {BLOCK_FORWARD_OPS} per block "
                             "per forward pass", f"{src}; op counts of planner/cost/compute.py")]
          if pass_host_s(1, cluster) else
          [("host overhead", "not priced: the engine's dispatch on a GPU is unmeasured (a small model's decode step "
                             "can take longer than its weights' reads)", "zplan (assumption)")]
          if cluster.host_overheads.runs_ahead else []),
        ("model numbers", f"{summary.tracer} ({summary.source}); Linear weights per block "
                          f"{model.block_linear_params / 1e6:,.2f} M from the block FLOPs",
         "planner/trace.py or planner/family.py"),
        ("positions", f"learned table of {model.position_rows} rows: prompt + gen may not exceed it"
         if model.position_rows else "no learned position table (rotary or none): lengths are not capped",
         "embedding parameters beyond vocab x hidden"),
    ]
    return [Assumption(name=n, value=v, source=s) for n, v, s in rows]
