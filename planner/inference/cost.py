"""Serving cost model: memory, time to first token and time per output token of inference candidates.

Pure numpy over whole candidate arrays (docs/design.md decision 2); every formula names its source. Notation:
L blocks, h hidden, a heads, a_kv key/value heads, d = h / a head dim, f MLP width, V vocabulary, W Linear
weights per block, t tensor-parallel degree, B sequences per replica, P prompt tokens, G generated tokens.

  memory  block Linear weights are split over t and stored at the weight precision (int8: 1 byte, int4: 1/2,
          plus one fp32 scale per group of quant_group_size inputs); embeddings, norms, biases and the head
          are replicated at the compute dtype, except that int8/int4 quantize the head's V x h matrix too (one
          table when tied to the token embedding), as the engine does. fp8 (W8A8, e4m3): 1 byte a weight plus one
          fp32 scale per output channel of each block Linear; the head stays at the compute dtype. KV cache
          2 * L * B * S * ceil(a_kv / t) * d * bytes (Kwon et al. 2023, "Efficient Memory Management for LLM
          Serving with PagedAttention", Sec. 2; preallocated for S = P + G, no paging).
  prefill compute bound (Pope et al. 2022, "Efficiently Scaling Transformer Inference", Sec. 2-3):
          2 * W * L * B * P FLOPs + causal attention 2 * L * B * P^2 * h (QK^T and AV, 2 P^2 h each in full,
          halved by the mask) over t, plus the logits of the last position 2 * h * V * B (replicated head),
          at the cluster's GEMM efficiency curve (planner/cost/compute.py); at least one read of the weights
          (a short prompt is memory bound, Pope et al. Sec. 3.1). Two all-reduces of B * P * h per block
          (Megatron tensor parallelism, Shoeybi et al. 2019, Sec. 3). fp8 runs the block Linears' 2 W FLOPs per
          token at the GPU's fp8 peak (peak_fp8_flops), attention and the logits at the compute dtype's; the
          per-token cast of each Linear's input to fp8 (elementwise, O(tokens * width) against the GEMM's
          O(tokens * width^2)) is not priced.
  decode  one step reads every resident weight byte once and the KV cache at the mean context
          c = P + G / 2 (Pope et al. Sec. 3.1: small-batch decode is memory-bandwidth bound), at
          hbm_bandwidth * efficiency.memory_bound; where B makes the FLOPs (2 W L B + 4 L B c h) / t + 2 h V B
          take longer, the step is compute bound and the FLOPs time counts instead of the bytes. Two
          all-reduces of B * h per block (latency bound). CPU profiles add the host's dispatch time per op
          (host_overheads.op_s) to prefill and decode: there it runs on the computing core.
  streamed tiers (ZeRO-Inference, Aminabadi et al. 2022, "DeepSpeed-Inference", Sec. 6): each forward pass
          moves the block weights from host memory over PCIe (host_to_device_bandwidth * efficiency.host_link),
          and for nvme from the node's disks (nvme_bandwidth shared by the node's GPUs in use) through host
          memory, pipelined, so the slower link sets the pace. Prefetching the next layer while one computes
          makes a pass take max(transfer, compute) per layer; the part not hidden is the stream time. A device
          that cannot overlap copies with compute (overlaps_comm_with_compute false) hides none of it.
  tokens/s = replicas * B * G / (ttft + (G - 1) * tpot).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from zplan.planner.cost.comm import all_reduce_s
from zplan.planner.cost.compute import gemm_efficiency
from zplan.planner.cost.memory import HOST_USABLE_FRACTION
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.model import ModelSummary

WEIGHT_PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4", "fp8")
WEIGHT_TIERS = ("gpu", "cpu", "nvme")
FLOAT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
QUANT_BYTES = {"int8": 1.0, "int4": 0.5}  # bytes per weight, before the scales
QUANT_GROUP_SIZE = 128  # input features per scale, at most (quant_group_size: smaller where widths need it)
SCALE_BYTES = 4.0  # zplan.cuda.weight_quant keeps one fp32 scale per group; fp8 one per output channel
FP8_BYTES = 1.0  # float8_e4m3fn weights (W8A8: runtime/inference/fp8.py), before the per-channel scales
PREFETCH_LAYERS = 1  # streamed tiers: layers loaded ahead of the one computing
# Host dispatch per forward pass (pass_host_s): 39 aten ops per block forward, as counted for
# planner/cost/compute.py's BLOCK_OPS (39 forward + 93 backward), and the embedding lookups plus the final norm and
# logits.
BLOCK_FORWARD_OPS = 39
EDGE_FORWARD_OPS = 8
LOGITS_BYTES = 4.0  # the last position's logits are kept in fp32 for sampling


@dataclass(frozen=True)
class InferenceModel:
    """The few numbers of a ModelSummary the serving cost model reads."""

    layers: int  # L
    hidden: int  # h
    heads: int  # a
    kv_heads: int  # a_kv
    ffn: int  # f
    vocab: int  # V
    block_linear_params: float  # W: Linear weights of one block (the 2 FLOPs per token each)
    replicated_params: float  # embeddings, norms, biases, head: kept whole on every GPU
    decode_read_params: float  # of those, read by one decode step: norms, biases, the logits matrix V * h
    position_rows: int | None  # rows of a learned position table; None for rotary / no positions

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_summary(cls, summary: ModelSummary) -> InferenceModel:
        """W from a block's forward FLOPs at seq_len s: fwd = 2 s W + 2 s^2 h (planner/family.py counts the
        causal attention core that way, as the tracer does), so W = (fwd - 2 s^2 h) / (2 s)."""
        s, h, V = summary.seq_len, summary.hidden, summary.vocab
        blocks = [u for u in summary.layers if u.kind == "block"]
        block_params = sum(u.params for u in blocks)
        linear = [min(float(u.params), max(0.0, (u.fwd_flops - 2.0 * s * s * h) / (2.0 * s))) for u in blocks]
        per_block = sum(linear) / len(linear)
        embedding = sum(u.params for u in summary.layers if u.kind == "embedding")
        others = summary.params - embedding - block_params  # head, final norm, other units
        head_matrix = float(V * h)  # the logits GEMM reads V*h weights, tied to the token table or not
        tied = others < head_matrix
        extra = embedding - V * h  # a learned position table beside the token table
        position_rows = extra // h if extra >= h and extra % h == 0 else None
        return cls(layers=len(blocks), hidden=h, heads=summary.heads, kv_heads=summary.kv_heads,
                   ffn=summary.ffn_hidden, vocab=V, block_linear_params=per_block,
                   replicated_params=float(summary.params) - per_block * len(blocks),
                   decode_read_params=block_params - per_block * len(blocks) + others + (head_matrix if tied else 0),
                   position_rows=position_rows)


@dataclass(frozen=True)
class InferenceCandidates:
    """One configuration per index; int64 arrays of one length."""

    tp: np.ndarray
    precision: np.ndarray  # index into WEIGHT_PRECISIONS
    tier: np.ndarray  # index into WEIGHT_TIERS
    batch: np.ndarray  # sequences per replica (max_batch)

    def __len__(self) -> int:
        return len(self.tp)

    def take(self, index: np.ndarray) -> InferenceCandidates:
        return InferenceCandidates(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


@dataclass(frozen=True)
class Workload:
    """What every candidate serves: lengths, the compute dtype and the GPUs."""

    prompt_len: int  # P
    gen_len: int  # G
    compute_dtype: str  # 'fp32' | 'bf16' | 'fp16'
    gpus: int

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def mean_decode_context(self) -> float:
        """Mean tokens attended to over the G - 1 decode steps (contexts P + 1 .. P + G - 1): P + G / 2."""
        return self.prompt_len + self.gen_len / 2.0


@dataclass(frozen=True)
class InferenceEstimate:
    """Per-candidate arrays (bytes per GPU, seconds)."""

    weights: np.ndarray
    kv_cache: np.ndarray
    activations: np.ndarray
    reserve: np.ndarray
    total: np.ndarray
    cpu_bytes_per_node: np.ndarray
    nvme_bytes_per_node: np.ndarray
    fits: np.ndarray
    prefill_compute_s: np.ndarray
    prefill_tp_s: np.ndarray
    prefill_stream_s: np.ndarray
    decode_weights_s: np.ndarray
    decode_kv_s: np.ndarray
    decode_compute_s: np.ndarray
    decode_tp_s: np.ndarray
    decode_stream_s: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    request_latency_s: np.ndarray
    tokens_per_s: np.ndarray


def pass_host_s(layers: int, cluster: ClusterSpec) -> float:
    """Host seconds the engine dispatches one forward pass in, where they add to its work: a CPU profile's (the host
    is the device). 0 on a profile whose host runs ahead of its GPU: the engine's dispatch there is unmeasured, and
    the training figure (host_overheads.op_s, under autograd) would overstate an inference pass's."""
    host = cluster.host_overheads
    return 0.0 if host.runs_ahead else (BLOCK_FORWARD_OPS * layers + EDGE_FORWARD_OPS) * host.op_s


def quant_group_size(model: InferenceModel, tp: np.ndarray) -> np.ndarray:
    """Input features per int8/int4 scale: the largest power of two <= QUANT_GROUP_SIZE that divides every
    quantized Linear's input width on one GPU -- h (q/k/v, up/gate, head), a * d / t (o) and f / t (down)."""
    tp = np.asarray(tp)
    widths = [np.full(len(tp), model.hidden), model.heads * model.head_dim // tp, model.ffn // tp]
    group = np.full(len(tp), QUANT_GROUP_SIZE)
    for width in widths:
        while np.any(width % group):
            group = np.where(width % group, group // 2, group)
    return group


def weight_bytes_per_param(precision: np.ndarray, group: np.ndarray | int = QUANT_GROUP_SIZE,
                           fp8_scales: np.ndarray | float = 0.0) -> np.ndarray:
    """Stored bytes per Linear weight: 4 / 2 unquantized; int8 1 and int4 0.5 plus one fp32 scale per `group`
    inputs; fp8 1 plus one fp32 scale per output channel, `fp8_scales` channels per weight (fp8_scales_per_weight)."""
    quant = np.array([QUANT_BYTES.get(p, 0.0) for p in WEIGHT_PRECISIONS])[precision]
    floats = np.array([FLOAT_BYTES.get(p, 0.0) for p in WEIGHT_PRECISIONS])[precision]
    return np.where(is_fp8(precision), FP8_BYTES + SCALE_BYTES * np.asarray(fp8_scales, dtype=float),
                    np.where(quant > 0, quant + SCALE_BYTES / group, floats))


def is_quantized(precision: np.ndarray) -> np.ndarray:
    """int8/int4: group-wise weight-only, the head quantized too."""
    return np.isin(precision, [WEIGHT_PRECISIONS.index(p) for p in QUANT_BYTES])


def is_fp8(precision: np.ndarray) -> np.ndarray:
    """fp8: W8A8 block Linears (fp8 GEMMs), the head at the compute dtype."""
    return np.asarray(precision) == WEIGHT_PRECISIONS.index("fp8")


def fp8_scales_per_weight(model: InferenceModel, tp: np.ndarray) -> np.ndarray:
    """fp8 scales (one per output channel) per block Linear weight on one GPU. A block's Linears whose input is
    h (q/k/v, up and gate: column-parallel) have (W - a d h - f h) / h output rows, split over t; o (input a d)
    and down (input f) are row-parallel, h output rows on every GPU. So (W - a d h - f h) / (h t) + 2 h channels
    for W / t weights."""
    h, W, t = float(model.hidden), model.block_linear_params, np.asarray(tp, dtype=float)
    colwise_rows = (W - model.heads * model.head_dim * h - model.ffn * h) / h
    return (colwise_rows / t + 2.0 * h) / (W / t)


def block_weight_bytes(model: InferenceModel, cand: InferenceCandidates) -> np.ndarray:
    """Block Linear weight bytes per GPU, all L blocks: L * W / t * bytes per weight."""
    group = quant_group_size(model, cand.tp)
    per_weight = weight_bytes_per_param(cand.precision, group, fp8_scales_per_weight(model, cand.tp))
    return model.layers * model.block_linear_params / cand.tp * per_weight


def head_bytes(model: InferenceModel, cand: InferenceCandidates, compute_dtype: str) -> np.ndarray:
    """The head's V x h matrix (replicated): at the compute dtype (fp8 too), or quantized with the blocks
    (int8/int4)."""
    per_param = np.where(is_quantized(cand.precision),
                         weight_bytes_per_param(cand.precision, quant_group_size(model, cand.tp)),
                         FLOAT_BYTES[compute_dtype])
    return model.vocab * model.hidden * per_param


def kv_cache_bytes(model: InferenceModel, tp: np.ndarray, batch: np.ndarray, max_seq_len: int,
                   compute_dtype: str) -> np.ndarray:
    """2 (K and V) * L * B * S * ceil(a_kv / t) * d * bytes per GPU (Kwon et al. 2023, Sec. 2: the KV cache per
    token is 2 * L * a_kv * d elements; a GPU holds its ceil(a_kv / t) heads)."""
    kv_heads_per_gpu = np.ceil(model.kv_heads / tp)
    return 2.0 * model.layers * batch * max_seq_len * kv_heads_per_gpu * model.head_dim * FLOAT_BYTES[compute_dtype]


def activation_bytes(model: InferenceModel, tp: np.ndarray, batch: np.ndarray, prompt_len: int,
                     compute_dtype: str) -> np.ndarray:
    """Largest transient of a prefill over B * P tokens (one block at a time, nothing kept for backward):
    residual stream and its norm 2h, q/k/v and attention output (2h + 2 a_kv d) / t, MLP input to output 3f / t
    (SwiGLU's gate, up and product; GELU's input and output are fewer), at the compute dtype; attention scores are
    never materialised (flash / memory-efficient attention, Dao et al. 2022). Plus the last position's logits,
    B * V in fp32."""
    per_token = 2.0 * model.hidden + (2.0 * model.hidden + 2.0 * model.kv_heads * model.head_dim + 3.0 * model.ffn) / tp
    return batch * prompt_len * per_token * FLOAT_BYTES[compute_dtype] + batch * model.vocab * LOGITS_BYTES


def stream_link_Bps(tier: np.ndarray, cluster: ClusterSpec, gpus: int) -> np.ndarray:
    """Bytes/s one GPU receives streamed weights at: PCIe at its achieved fraction; for nvme also the node's disks
    shared by the GPUs in use on the node, the slower of the two (disk -> host -> GPU is pipelined)."""
    pcie = cluster.host_to_device_bandwidth_Bps * cluster.efficiency.host_link
    gpus_on_node = min(gpus, cluster.gpus_per_node)
    disk = cluster.nvme_bandwidth_Bps / gpus_on_node if cluster.nvme_bandwidth_Bps > 0 else 1e-9
    return np.where(tier == WEIGHT_TIERS.index("nvme"), min(pcie, disk), pcie)


def not_hidden_stream_s(layer_transfer_s: np.ndarray, pass_s: np.ndarray, layers: int) -> np.ndarray:
    """Stream time a pass waits for: with the next layer prefetched during this one's compute a layer takes
    max(transfer, compute) (ZeRO-Inference's prefetch, Aminabadi et al. 2022, Sec. 6.2), so
    L * max(0, transfer - compute per layer)."""
    return layers * np.maximum(0.0, layer_transfer_s - pass_s / layers)


def estimate(model: InferenceModel, cand: InferenceCandidates, cluster: ClusterSpec, work: Workload
             ) -> InferenceEstimate:
    """Memory and time of every candidate (bytes per GPU; seconds)."""
    dtype, P, G = work.compute_dtype, work.prompt_len, work.gen_len
    cbytes = FLOAT_BYTES[dtype]
    L, h, f, V = model.layers, model.hidden, model.ffn, model.vocab
    t, B = cand.tp.astype(float), cand.batch.astype(float)
    resident = cand.tier == WEIGHT_TIERS.index("gpu")
    replicas = work.gpus // cand.tp

    # Memory per GPU.
    blocks_b = block_weight_bytes(model, cand)
    head_b = head_bytes(model, cand, dtype)
    in_flight = np.where(resident, blocks_b, np.minimum(L, 1 + PREFETCH_LAYERS) * blocks_b / L)
    weights = in_flight + (model.replicated_params - V * h) * cbytes + head_b
    kv = kv_cache_bytes(model, t, B, work.max_seq_len, dtype)
    act = activation_bytes(model, t, B, P, dtype)
    reserve = np.full(len(cand), float(cluster.framework_reserve_bytes))
    total = weights + kv + act + reserve
    gpus_on_node = min(work.gpus, cluster.gpus_per_node)  # every GPU process holds its own shard's copy
    cpu_node = np.where(cand.tier == WEIGHT_TIERS.index("cpu"), blocks_b * gpus_on_node, 0.0)
    nvme_node = np.where(cand.tier == WEIGHT_TIERS.index("nvme"), blocks_b * gpus_on_node, 0.0)
    fits = ((total <= cluster.gpu.hbm_bytes) & (cpu_node <= HOST_USABLE_FRACTION * cluster.cpu_memory_bytes)
            & (nvme_node <= HOST_USABLE_FRACTION * cluster.nvme_bytes))

    peak = cluster.peak_flops(dtype)
    # the block Linears' GEMMs: at the fp8 peak for fp8 weights (W8A8), else at the compute dtype's
    fp8_peak = cluster.gpu.peak_fp8_flops if cluster.gpu.peak_fp8_flops > 0 else peak  # no fp8: refused upstream
    gemm_peak = np.where(is_fp8(cand.precision), fp8_peak, peak)
    hbm = cluster.gpu.hbm_bandwidth_Bps * cluster.efficiency.memory_bound
    host_s = pass_host_s(L, cluster)
    read_b = blocks_b + (model.decode_read_params - V * h) * cbytes + head_b  # weight bytes a pass reads

    # Prefill (Pope et al. 2022, Sec. 3): compute bound, and at least one read of the weights.
    prefill_gemm_flops = 2.0 * model.block_linear_params * L * B * P / t
    prefill_other_flops = 2.0 * L * B * P * P * h / t + 2.0 * h * V * B  # attention, logits: compute dtype
    prefill_eff = gemm_efficiency(2.0 * B * P * h * f / t, cluster, gemm_peak / peak)
    prefill_flops_s = (prefill_gemm_flops / gemm_peak + prefill_other_flops / peak) / prefill_eff
    prefill_compute = np.maximum(prefill_flops_s, read_b / hbm) + host_s
    ones = np.ones(len(cand), dtype=np.int64)
    prefill_tp = 2.0 * L * all_reduce_s(B * P * h * cbytes, cand.tp, ones, cluster)

    # Decode step at the mean context: bytes, unless the batch makes the FLOPs take longer.
    c = work.mean_decode_context
    weights_s = read_b / hbm
    kv_s = kv_cache_bytes(model, t, B, 1, dtype) * c / hbm
    decode_gemm_flops = 2.0 * model.block_linear_params * L * B / t
    decode_other_flops = 4.0 * L * B * c * h / t + 2.0 * h * V * B
    flops_s = ((decode_gemm_flops / gemm_peak + decode_other_flops / peak)
               / gemm_efficiency(2.0 * B * h * f / t, cluster, gemm_peak / peak))
    compute_bound = flops_s > weights_s + kv_s
    decode_weights = np.where(compute_bound, 0.0, weights_s)
    decode_kv = np.where(compute_bound, 0.0, kv_s)
    # the host dispatches the step's ops one after another, beside neither the reads nor the FLOPs on a CPU
    # profile (pass_host_s: 0 on GPU profiles)
    decode_compute = np.where(compute_bound, flops_s, 0.0) + host_s
    decode_tp = 2.0 * L * all_reduce_s(B * h * cbytes, cand.tp, ones, cluster)

    # Streamed tiers: every pass (the prefill and each decode step) moves all block weights.
    # A device that cannot overlap copies with compute (overlaps_comm_with_compute False: the CPU profiles, where
    # the copy is a memcpy on the computing core) hides nothing.
    layer_transfer = np.where(resident, 0.0, blocks_b / L / stream_link_Bps(cand.tier, cluster, work.gpus))
    decode_step = decode_weights + decode_kv + decode_compute + decode_tp
    if cluster.overlaps_comm_with_compute:
        prefill_stream = not_hidden_stream_s(layer_transfer, prefill_compute + prefill_tp, L)
        decode_stream = not_hidden_stream_s(layer_transfer, decode_step, L)
    else:
        prefill_stream = decode_stream = L * layer_transfer

    ttft = prefill_compute + prefill_tp + prefill_stream
    tpot = decode_step + decode_stream
    latency = ttft + (G - 1) * tpot
    return InferenceEstimate(
        weights=weights, kv_cache=kv, activations=act, reserve=reserve, total=total, cpu_bytes_per_node=cpu_node,
        nvme_bytes_per_node=nvme_node, fits=fits, prefill_compute_s=prefill_compute, prefill_tp_s=prefill_tp,
        prefill_stream_s=prefill_stream, decode_weights_s=decode_weights, decode_kv_s=decode_kv,
        decode_compute_s=decode_compute, decode_tp_s=decode_tp, decode_stream_s=decode_stream, ttft_s=ttft,
        tpot_s=tpot, request_latency_s=latency, tokens_per_s=replicas * B * G / latency)
