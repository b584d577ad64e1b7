"""Compute time of one micro-batch on one pipeline stage, vectorised over candidates.

Time = GEMM FLOPs / (peak * eff(x)) + attention-core FLOPs / (peak * attention) + streamed bytes / (HBM
bandwidth * memory_bound), where eff is the cluster's saturating efficiency curve in the size x of the layer's
largest GEMM per GPU (the MLP up-projection, 2*b*s*h*ffn/tp FLOPs):
    eff(x) = gemm_max * x / (x + gemm_half_flops)
`attention` is the fraction of peak the flash kernel reaches on QK^T and AV (efficiency.attention; the GEMM curve
where the profile has none): the kernel keeps the (s, s) scores on chip, so they stream no HBM bytes, and causal
masking halves its work (Dao 2023); an unfused core (a summary with attention_core_bytes: Megatron-LM 2021) runs as
batched GEMMs on the curve. The streamed bytes are those of the memory-bound operations (layer norm, softmax,
dropout, bias, GeLU, residual adds), at the fraction of HBM bandwidth the profile says they reach
(efficiency.activation_ops, else memory_bound). Counting their reads and writes in a GPT block with
Megatron's fused kernels gives about 76*s*b*h + 13*a*s^2*b bytes in the forward against
34*s*b*h + 5*a*s^2*b bytes saved for backward (Korthikanti Table 2): about STREAMED_PER_SAVED_BYTE = 2.5
bytes streamed per byte saved (of what the block saves: a flash kernel saves no (s, s) bytes, an unfused one
does); the backward streams twice the forward.
Context parallel (cp GPUs share each sequence, 2 cp chunks with rank r holding chunks r and 2cp-1-r: Megatron-LM's
load balancing under the causal mask) gives each GPU the GEMMs, attention, bytes and host work of b / cp sequences
(planner.cost.inputs.gpu_sequences); its K/V all-gathers are planner.cost.step's.
Backward costs twice the forward (Narayanan et al. SC'21, Sec. 5.1: 3x forward for fwd+bwd).
Recompute adds a forward pass (full) or the attention core (selective; Korthikanti et al. 2022,
Sec. 5: softmax/dropout/QK^T/AV are re-run).
Host overhead: every aten op a micro-batch dispatches costs the profile's host_overheads.op_s: on top of its FLOPs
and bytes on a CPU profile, and as a floor under them where the host runs ahead of its GPU (with_host_s: a block,
the embedding and the head each take the longer of the two, so the host shows only where a block's device work is
shorter than its dispatch: small models, small micro-batches). The op counts below were
counted with a TorchDispatchMode (torch 2.13, CPU) over one forward + backward of examples/gpt.py's
pre-LayerNorm Block (h=64, 4 heads), with the runtime's apply_recompute for the recompute modes, and of
its embedding (wte + wpe) and head (ln_f, tied lm_head, next-token cross-entropy); they do not depend on
the tensor sizes. Views, transposes and detaches count: each passes the dispatcher. Recompute's host cost
per block is the profile's measured selective_recompute_s / full_recompute_s where it has them (torch's
selective checkpoint runs every op through a Python dispatch mode, far dearer than op_s), else the
re-run ops (RECOMPUTE_EXTRA_OPS) at op_s.
"""

from __future__ import annotations

import numpy as np

from zplan.planner.cost.inputs import Candidates, ModelNumbers, gpu_sequences
from zplan.planner.cost.memory import block_activation_bytes
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.spec import compute_dtype

BACKWARD_OVER_FORWARD = 2.0
STREAMED_PER_SAVED_BYTE = 2.5
BLOCK_OPS = 132  # aten ops per block per micro-batch: 39 forward + 93 backward
RECOMPUTE_EXTRA_OPS = (0, 80, 79)  # ops added per block by recompute none / selective (SAC) / full
EMBEDDING_OPS = 12  # two lookups, their sum, their backward (embedding_dense_backward x2)
HEAD_OPS = 30  # final LayerNorm, logits GEMM, cross-entropy and their backward
# Bytes the default loss (model.model_file.next_token_loss: cross-entropy on the logits upcast to fp32) streams
# through HBM per logit, forward and backward: the slice copied (2 + 2), the upcast (2 + 4), log-softmax (4 + 4),
# the loss gradient zero-filled (4), log-softmax backward (4 + 4 + 4), the downcast (4 + 2), the slice's backward
# (2 + 2) at 16-bit; fp32 has no casts. Counted from the aten ops of its forward and backward on (B, T, V) logits
# (torch 2.13; nll_loss itself reads and writes (B, T)). The GEMMs that make and consume the logits are FLOPs.
LOSS_STREAMED_BYTES_PER_LOGIT = {"bf16": 44.0, "fp16": 44.0, "fp32": 40.0}
# fp8 training (torchao float8 with dynamic tensorwise scaling, as runtime/float8 converts the blocks' Linears; the
# head stays bf16): each GEMM operand -- a Linear's input X and weight W in the forward, the output gradient G in the
# backward -- is cast twice, once for each layout its two GEMMs read (X for Y = XW^T and dW = G^T X; W for Y and
# dX = GW; G for dX and dW), and each cast reads the bf16 tensor for its amax (2 B), reads it again and writes fp8
# (2 + 1 B): 5 B an element a cast, FP8_CAST_BYTES_PER_ELEMENT = 10 over the two.
FP8_CAST_BYTES_PER_ELEMENT = 10.0
# Elements of X and G a token brings to a block's Linears, per block parameter: sum over Linears of (in + out)
# features against sum of in * out. GPT's block (qkv h->3h, proj h->h, fc h->4h, proj 4h->h) has 16 h of in + out for
# 12 h^2 parameters: 4 / (3 h) a parameter; a Llama block (q, k, v, o, gate, up, down) is within 15 % of it.
FP8_CAST_TOKEN_ELEMENTS_PER_PARAM_H = 4.0 / 3.0
# nvfp4 training (runtime/precision/nvfp4.py; NVIDIA, "Pretraining Large Language Models with NVFP4", 2025: fprop, dgrad
# and wgrad GEMMs all in NVFP4): an NVFP4 operand is blocked along its GEMM's reduction dim, so each of X, W and G is
# quantised twice, as fp8's operands are cast twice (X along its features for Y = X W^T and along the tokens for dW =
# G^T X; W along in for Y and along out for dX = G W; G along out for dX and along the tokens for dW). A cast reads the
# bf16 tensor for its per-tensor amax (2 B), reads it again (2 B) and writes e2m1 values (4 bits: 0.5 B) and one e4m3
# block scale per 16 elements (1/16 B): 4.5625 B an element a cast, NVFP4_CAST_BYTES_PER_ELEMENT = 9.125 over the two.
# Not counted: the paper's 16x16 random Hadamard transform of the wgrad inputs (Transformer Engine fuses it into the
# wgrad cast, the same bytes; runtime/precision/nvfp4.py does not apply it), and the tokens' padding to 16.
NVFP4_CAST_BYTES_PER_ELEMENT = 2.0 * (2.0 + 2.0 + 0.5 + 1.0 / 16.0)


def gemm_efficiency(gemm_flops: np.ndarray, cluster: ClusterSpec, speedup=1.0) -> np.ndarray:
    """The fraction of the peak a GEMM of `gemm_flops` per GPU reaches: gemm_max * x / (x + x_half). Its time is
    (x + x_half) / (gemm_max * peak): x_half / (gemm_max * peak) is a fixed time each GEMM spends beyond its FLOPs
    (launch, prologue and epilogue, the last partial wave), so a GEMM at a peak `speedup` times the compute dtype's
    (fp8, fp4 tensor cores) amortises it over `speedup` times the FLOPs (x_half * speedup)."""
    eff = cluster.efficiency
    return eff.gemm_max * gemm_flops / (gemm_flops + eff.gemm_half_flops * speedup)


def attention_core_fwd_flops(model: ModelNumbers) -> float:
    """QK^T and AV of one causal sample, per block: as traced (heads * head dims need not be h: multi-head latent
    attention, Qwen3's 128-wide heads), else 2 matmuls * 2*s*s*h FLOPs, halved by the causal mask."""
    if model.block_attention_fwd_flops > 0:
        return model.block_attention_fwd_flops
    return 2.0 * 2.0 * model.seq_len**2 * model.hidden / 2.0


def recompute_fwd_flops(model: ModelNumbers, recompute: np.ndarray) -> np.ndarray:
    """Extra forward FLOPs per block and sample re-run in backward: none, selective, full."""
    per_mode = np.array([0.0, attention_core_fwd_flops(model), model.block_fwd_flops])
    return per_mode[recompute]


def block_time_s(
    model: ModelNumbers, cand: Candidates, cluster: ClusterSpec, precision: str
) -> np.ndarray:
    """Forward + backward (+ recompute) seconds of one block for one micro-batch, per GPU."""
    peak = cluster.peak_flops(precision)
    gemm_peak = cluster.gemm_peak_flops(precision)  # the Linears' GEMMs: fp8 under fp8 training
    b, t = gpu_sequences(cand), cand.tp  # context parallel: b / cp sequences' worth of tokens and attention
    gemm_flops = 2.0 * b * model.seq_len * model.hidden * model.ffn_hidden / t
    eff = gemm_efficiency(gemm_flops, cluster, gemm_peak / peak)
    # The attention core runs forward and backward, and again in backward under either recompute mode.
    core = b * attention_core_fwd_flops(model) * ((1.0 + BACKWARD_OVER_FORWARD) + (cand.recompute > 0))
    flops = b * ((1.0 + BACKWARD_OVER_FORWARD) * model.block_fwd_flops + recompute_fwd_flops(model, cand.recompute))
    # Routed experts: every tp rank runs them whole on all its tokens (tp splits only the Linears), at the compute
    # dtype's peak (zplan's fp8 and nvfp4 convert Linears only; a stack whose grouped GEMM runs them in fp8, as
    # Transformer Engine's does, at the GEMM peak: ExpertsSummary.at_gemm_peak, their casts fused into the token
    # permutation and the activation, so no cast bytes), their GEMMs as large as one expert's share of the tokens of
    # the ep ranks that send it theirs (balanced routing)
    experts = b * model.block_expert_fwd_flops * ((1.0 + BACKWARD_OVER_FORWARD) + (cand.recompute == 2))
    expert_tokens = b * model.seq_len * model.top_k * cand.ep / max(model.num_experts, 1)
    expert_peak = gemm_peak if model.experts_at_gemm_peak else peak
    expert_eff = gemm_efficiency(2.0 * expert_tokens * model.hidden * model.expert_ffn_hidden, cluster,
                                 expert_peak / peak)
    busiest = model.busiest_rank(cand.ep)  # the step waits for the rank with the most routed tokens
    experts_s = busiest * experts / (expert_peak * expert_eff) if model.block_expert_fwd_flops > 0 else 0.0
    attention = cluster.efficiency.attention
    unfused = model.block_attention_core_bytes > 0  # batched GEMMs and a softmax streamed through HBM
    attention_eff = eff if attention is None or unfused else attention
    saved_fwd = block_activation_bytes(model, cand.with_recompute(0), precision)  # per GPU, one pass
    # selective re-runs the attention core: FLOPs, and the (s, s) bytes where an unfused core streams them
    core_bytes = b * model.block_attention_core_bytes / t
    recomputed = np.select([cand.recompute == 1, cand.recompute == 2], [core_bytes, saved_fwd], 0.0)
    streamed = STREAMED_PER_SAVED_BYTE * ((1.0 + BACKWARD_OVER_FORWARD) * saved_fwd + recomputed)
    if precision in ("fp8", "nvfp4"):
        streamed = streamed + fp8_cast_bytes(model, b, t, precision)
    device_s = ((flops - core - experts) / t / (gemm_peak * eff) + core / t / (peak * attention_eff) + experts_s
                + streamed / activation_ops_Bps(cluster))
    return with_host_s(device_s, block_host_s(cand.recompute, cluster), cluster)


def fp8_cast_bytes(model: ModelNumbers, micro_batch: np.ndarray, tp: np.ndarray, precision: str = "fp8"
                   ) -> np.ndarray:
    """HBM bytes one block's fp8 (or nvfp4) casts stream per micro-batch, per GPU: X and G of b * s tokens
    (FP8_CAST_TOKEN_ELEMENTS_PER_PARAM_H elements per parameter per token / h) and the weights, each tp-split, at
    FP8_CAST_BYTES_PER_ELEMENT (NVFP4_CAST_BYTES_PER_ELEMENT)."""
    linears = model.block_params - model.block_expert_params  # the Linears fp8 converts (not routed experts)
    per_token = FP8_CAST_TOKEN_ELEMENTS_PER_PARAM_H * linears / model.hidden
    token_elements = micro_batch * model.seq_len * per_token
    per_element = NVFP4_CAST_BYTES_PER_ELEMENT if precision == "nvfp4" else FP8_CAST_BYTES_PER_ELEMENT
    return per_element * (token_elements + linears) / tp


def activation_ops_Bps(cluster: ClusterSpec) -> float:
    """Bytes/s the block's activation ops stream: HBM bandwidth times their achieved fraction."""
    eff = cluster.efficiency
    fraction = eff.activation_ops if eff.activation_ops is not None else eff.memory_bound
    return cluster.gpu.hbm_bandwidth_Bps * fraction


def with_host_s(device_s, host_s, cluster: ClusterSpec):
    """Seconds of work whose device part takes device_s and whose dispatch takes host_s: the longer of the two where
    the host runs ahead of its device (a GPU), else their sum (a CPU profile: the host is the device)."""
    return np.maximum(device_s, host_s) if cluster.host_overheads.runs_ahead else device_s + host_s


def block_host_s(recompute: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """Host seconds of one block per micro-batch: its aten ops times the profile's cost per op, plus what
    recompute adds (measured by mode where the profile has it, else the re-run ops at the cost per op)."""
    host = cluster.host_overheads
    by_mode = [0.0, host.selective_recompute_s, host.full_recompute_s]
    recompute_s = np.array([RECOMPUTE_EXTRA_OPS[i] * host.op_s if s is None else s for i, s in enumerate(by_mode)])
    return BLOCK_OPS * host.op_s + recompute_s[recompute]


def edge_time_s(
    fwd_flops: float, model: ModelNumbers, cand: Candidates, cluster: ClusterSpec, precision: str, ops: int = 0,
    loss: bool = False,
) -> np.ndarray:
    """Forward + backward seconds of the embedding or head for one micro-batch on one GPU, with the host cost
    of its `ops` aten ops (EMBEDDING_OPS or HEAD_OPS) and, for the head (`loss`), the loss's streamed bytes
    (LOSS_STREAMED_BYTES_PER_LOGIT). Where the plan splits the vocabulary over tp (ModelNumbers.vocab_split) a rank
    computes 1/tp of the logits GEMM, (b*s, h) x (h, V/tp), and of the loss; else every tp rank computes all of
    `fwd_flops` (per sample). The embedding's lookup has no FLOPs to split."""
    peak = cluster.peak_flops(precision)
    b = gpu_sequences(cand)
    split = model.vocab_split(cand) if loss else 1.0
    gemm_flops = 2.0 * b * model.seq_len * model.hidden * model.vocab / split  # the logits GEMM, FLOPs per GPU
    eff = gemm_efficiency(gemm_flops, cluster)
    per_logit = LOSS_STREAMED_BYTES_PER_LOGIT[compute_dtype(precision)]
    streamed = b * model.seq_len * model.vocab / split * per_logit if loss else 0.0
    device_s = (b * (1.0 + BACKWARD_OVER_FORWARD) * fwd_flops / split / (peak * eff)
                + streamed / activation_ops_Bps(cluster))
    return with_host_s(device_s, ops * cluster.host_overheads.op_s, cluster)
