"""Activation bytes per GPU for planner.cost.memory: a block's saved bytes by recompute mode, the loss on the logits,
context parallel's gathered keys and values and mask, pipeline micro-batches in flight and receive buffers, and the
low-precision casts' temporaries.

Activations per block (Korthikanti et al., MLSys'23, Table 2): of the block's saved bytes, 10*s*b*h
(16-bit; layer-norm inputs, dropout masks, first-linear inputs) stay replicated under tensor parallel
unless sequence parallel shards them; the rest is divided by tp. Selective recompute keeps the projections'
outputs and the block input (the runtime's policy, runtime.training.recompute); full recompute keeps only the block
input (2*s*b*h, /tp with sequence parallel) plus one block's activations live while it is recomputed.
Tensor parallel splits the blocks and, where the plan splits the vocabulary (ParallelConfig.vocab_parallel; tp > 1
and a model whose embedding and head the runtime can split, runtime/parallel/vocab_parallel.py), the embedding and
head tables by vocabulary rows: each tp rank holds V/tp rows of each, with their gradients and optimizer states, and
computes (B, T, V/tp) logits and the loss on them with the max and the sum all-reduced (ModelNumbers.edge_params,
vocab_split). Otherwise, and always for the final norm, they are whole on every tp rank. The loss's peak
(logits_loss_bytes) is LOSS_BYTES_PER_LOGIT bytes per logit a rank holds, measured.
Context parallel (runtime/parallel/context_parallel.py): a GPU holds the activations of b/cp sequences' worth of tokens;
each block's attention keeps the keys and values gathered from the other cp - 1 ranks (gathered_kv_bytes), and one
(s/cp, s) attention mask serves every block (context_parallel_mask_bytes).
Pipeline in-flight micro-batches on the first stage: 1F1B min(p, m); interleaved with v chunks
multiplies by (1 + (p-1)/(p*v)) (Korthikanti et al., Sec. 4.2.3); each in-flight micro-batch keeps each of the rank's
v chunks' outputs (torch.distributed.pipelining's fwd_cache), and the last stage its logits, for its backward. The
runtime's stages hold receive buffers for the micro-batches in flight only, not torch's one per micro-batch of the
step: a received hidden state is the first block's saved input, counted with the blocks, and beside them stay a
gradient a chunk and what of a received state that input does not cover (pipeline_receive_buffer_bytes); a tied
embedding and head sum their table's gradient over their two ranks after the backward (one received copy).
"""

from __future__ import annotations

import numpy as np

from zplan.planner.cost.inputs import Candidates, ModelNumbers, gpu_sequences
from zplan.planner.cost.memory_states import element_bytes
from zplan.schemas.spec import compute_dtype

# Peak live bytes per logit while the runtime's default loss (model.model_file.next_token_loss: cross-entropy on
# logits[:, :-1].flatten(0, 1).float()) runs its forward and backward on the (B, T, V) logits the head's matmul made:
# at the peak (the log-softmax backward) the fp32 log-softmax output, its gradient and the gradient of its input,
# 3 * 4 bytes; nothing holds the logits themselves by then (the train loop drops them once the loss is computed, and
# the head's backward needs its input, not its output), and the forward's own peak (the logits, the copy flatten
# makes when B > 1, the fp32 upcast, the log-softmax output) is no higher. Measured exactly, counting live storages
# with a TorchDispatchMode on fake tensors (torch 2.13, CPU), and the same in the dry run (zplan dryrun):
#     .venv/bin/python benchmarks/loss_memory.py --json
# which prints 12.0 bytes per logit (within 0.2 %) for several (B, T, V) in every precision.
LOSS_BYTES_PER_LOGIT = {"fp32": 12.0, "bf16": 12.0, "fp16": 12.0}  # fp8: bf16's (compute_dtype), the head is bf16


# fp8 (runtime/precision/float8.py, torchao's Float8Linear in eager mode): its activations are bf16's (torchao saves the
# bf16 input and weight for backward and casts them again there), but each cast to fp8 makes fp32 temporaries of the
# tensor it casts (x.float() * scale, clamped, then the 1-byte copy), live during one Linear's backward at a time. The
# largest is an MLP projection's (b, s, ffn) input or output gradient. Measured with the dry run (zplan dryrun, fake
# tensors, torch._scaled_mm's meta kernel) on tiny Llamas (b 4, s 256; h 256 / 512, ffn 1024 / 2048, 2 or 4 layers; ZeRO
# 1 and 3, recompute none / full), the fp8 peak less the same plan's bf16 peak: 6.25 to 7.5 bytes per (b, s, ffn)
# element where the backward binds, independent of the number of layers; budgeted at the most. With it the 12 plans'
# fp8 predictions err as their bf16 twins' do (within 1.5 points, or above); without it up to 10 % under the dry run
# (tests/unit/test_float8_plan.py checks one).
FP8_CAST_TEMPORARY_BYTES_PER_ELEMENT = 7.5
# nvfp4 (runtime/precision/nvfp4.py): activations are bf16's likewise (an NVFP4Linear saves its bf16 input and weight),
# and each quantisation runs torchao 0.18's eager nvfp4_quantize, whose fp32 temporaries (the upcast, |x|, the scaled
# values, their clamp, the integer bit manipulation of f32_to_f4_unpacked) and the transposed copies the backward's
# operands need (G^T, X^T blocked along the tokens) are live during one Linear's backward. Measured as fp8's was (the
# dry run, whose fake tensors run the GPU's code path through torch._scaled_mm's meta kernel; the tiny Llama of
# tests/unit/test_float8_plan.py, b 4, s 256, h 256, ffn 2048, ZeRO 3, dgx-b200): the nvfp4 peak less the bf16 peak is
# 29.88 bytes per (b, s, ffn) element with recompute full and none alike; budgeted at 30, the nvfp4 predictions are
# +4.5 % (full) and +8.0 % (none) over the dry run, their bf16 twins +8.1 % and +13.5 %. Transformer Engine's fused
# NVFP4 cast kernels make far fewer: this is zplan's runtime, not theirs.
NVFP4_CAST_TEMPORARY_BYTES_PER_ELEMENT = 30.0


def fp8_cast_bytes(model: ModelNumbers, cand: Candidates, precision: str) -> np.ndarray:
    """fp8's (nvfp4's) cast temporaries in a block Linear's backward (FP8_CAST_TEMPORARY_BYTES_PER_ELEMENT,
    NVFP4_CAST_TEMPORARY_BYTES_PER_ELEMENT), 0 in other precisions."""
    per_element = {"fp8": FP8_CAST_TEMPORARY_BYTES_PER_ELEMENT,
                   "nvfp4": NVFP4_CAST_TEMPORARY_BYTES_PER_ELEMENT}.get(precision, 0.0)
    widest = max(model.ffn_hidden, model.hidden)  # the MLP's (b, s, ffn) tensors, split by tp
    return per_element * gpu_sequences(cand) * model.seq_len * widest / cand.tp


# The runtime's default loss (model/model_file.py next_token_loss, a model file without its own loss_fn, outside context
# parallel) writes the gradient with the loss (model/cross_entropy.py), a chunk of IN_PLACE_LOSS_CHUNK_ELEMENTS at a
# time: on the whole vocabulary over the logits themselves, so their storage (the compute dtype's bytes a logit) is all
# that lives beside one chunk's fp32 upcast (in 16-bit; in fp32 the upcast is the logits themselves); on a split
# vocabulary into a buffer of the local logits' size beside them (a DTensor's to_local() view, which autograd forbids
# writing over), its passes over the chunks making two fp32 chunk temporaries in 16-bit and one in fp32. Measured on
# fake tensors (benchmarks/loss_memory.py, the default loss): whole, 4.03 bytes a logit in fp32 and in bf16 2.26 at
# (2, 1024, 128256) and 3.03 at (1, 2048, 32000); split over tp 2 and 4, 8.5 / 5.0 bytes a local logit (fp32 / bf16)
# at (2, 1024, 128256) tp 2 and 12.0 at (1, 2048, 32000) tp 4, where one chunk is all the local logits.
IN_PLACE_LOSS_CHUNK_ELEMENTS = 2**24  # model/cross_entropy.py CHUNK_ELEMENTS (tests/unit/test_cost_memory.py)
# A model file's own loss on a split vocabulary runs under torch's loss_parallel (runtime/parallel/vocab_parallel.py):
# 16 bytes a local logit at its peak in every precision (benchmarks/loss_memory.py --tp 2 4, flat over the shapes)
LOSS_PARALLEL_BYTES_PER_LOGIT = 16.0


def logits_loss_bytes(model: ModelNumbers, cand: Candidates, precision: str) -> np.ndarray:
    """Peak bytes on one rank of the logits and the loss on them for one micro-batch: (b, s, V / split) logits, split
    where the plan splits the vocabulary (ModelNumbers.vocab_split). The runtime's default loss (above: no loss_fn of
    the model file's, cp 1): the logits in the compute dtype (twice under a split: their gradient beside them) and its
    chunks' fp32 temporaries; a model file's own loss LOSS_BYTES_PER_LOGIT a logit on the whole vocabulary,
    LOSS_PARALLEL_BYTES_PER_LOGIT on a split one."""
    split = model.vocab_split(cand)
    logits = gpu_sequences(cand) * model.seq_len * model.vocab / split
    elem = float(element_bytes(precision))
    chunks = np.where(split > 1, 2.0 if elem < 4 else 1.0, 1.0 if elem < 4 else 0.0)  # fp32 chunk temporaries
    default = np.where(split > 1, 2.0 * elem, elem) * logits + chunks * 4.0 * np.minimum(
        logits, IN_PLACE_LOSS_CHUNK_ELEMENTS)
    own = logits * np.where(split > 1, LOSS_PARALLEL_BYTES_PER_LOGIT, LOSS_BYTES_PER_LOGIT[compute_dtype(precision)])
    return np.where(model.default_loss & (cand.cp == 1), default, own)


def blocks_per_stage(model: ModelNumbers, cand: Candidates) -> np.ndarray:
    """Most blocks any stage holds (uniform split rounded up)."""
    return np.ceil(model.num_blocks / cand.pp)


def inflight_microbatches(cand: Candidates, num_micro_batches: np.ndarray) -> np.ndarray:
    p, v = cand.pp.astype(float), cand.interleave.astype(float)
    base = np.minimum(p, num_micro_batches)
    return np.where(v > 1, base * (1.0 + (p - 1.0) / (p * v)), base)


def gathered_kv_bytes(model: ModelNumbers, cand: Candidates, precision: str) -> np.ndarray:
    """Bytes a block saves beyond its own tokens' under context parallel without recompute: the keys and values
    all-gathered from the other cp - 1 ranks (runtime/parallel/context_parallel.py), which the attention keeps for its
    backward; (b/cp, s, kv features / tp) each of K and V from every other rank. Recompute (selective keeps only the
    projections' outputs) gathers them again in the backward."""
    kv_features = model.hidden * (model.kv_heads or model.heads) / model.heads
    elem = element_bytes(precision)
    return (cand.cp - 1.0) * 2.0 * gpu_sequences(cand) * model.seq_len * kv_features * elem / cand.tp


def context_parallel_mask_bytes(model: ModelNumbers, cand: Candidates, precision: str) -> np.ndarray:
    """Bytes of context parallel's attention mask on a GPU, 0 at cp 1: (s/cp) * s elements in the compute dtype, the
    additive causal mask of this rank's s/cp queries over the whole sequence's s keys
    (runtime/parallel/context_parallel.py: causal_bias, rows padded to 16 elements). ContextParallelAttention makes it
    once per scope (a micro-batch's forward and backward; a pipeline's step) and every block's
    scaled_dot_product_attention saves that one tensor for its backward (a recomputed block's too), so it is live from
    the first block's forward until the last block's backward, once: not per block, not per micro-batch in flight, not
    divided by tp (every tp rank holds it whole) nor multiplied by the micro-batch (broadcast over its sequences and
    heads). E.g. s = 8192, cp 2, bf16: 4096 * 8192 * 2 = 64 MiB (a mask per block, as the runtime held before, was 2 GiB
    over Llama-3-8B's 32)."""
    s = float(model.seq_len)
    return np.where(cand.cp > 1, s / cand.cp * s * element_bytes(precision), 0.0)


def block_activation_bytes(model: ModelNumbers, cand: Candidates, precision: str) -> np.ndarray:
    """Saved bytes of one block for one micro-batch on one GPU, by recompute mode."""
    elem = element_bytes(precision)
    b, t, sp = gpu_sequences(cand), cand.tp.astype(float), cand.sp.astype(bool)
    s, h = model.seq_len, model.hidden
    experts = b * model.block_expert_act_bytes  # whole on every tp rank (tp splits only the Linears)
    experts_here = experts * model.busiest_rank(cand.ep)  # the busiest ep rank holds the most routed tokens' bytes
    total = b * model.block_act_bytes - experts
    replicated = np.minimum(total, 5.0 * s * h * elem * b)  # 10*s*b*h at 16-bit
    sharded = total - replicated
    # Sequence parallel shards the norms' inputs, but torch's tensor parallel all-gathers the inputs of the
    # column-parallel projections (attention, MLP: 2*s*b*h) and their matmuls save them whole (Megatron re-gathers
    # them in backward instead); measured by the dry run.
    gathered = np.minimum(replicated, 2.0 * s * h * elem * b)
    none = sharded / t + np.where(sp, (replicated - gathered) / t + gathered, replicated) + experts_here
    none = none + gathered_kv_bytes(model, cand, precision)  # selective and full recompute re-gather them
    block_input = np.where(sp, s * b * h * elem / t, s * b * h * elem)
    # Selective: the runtime keeps the projections' outputs and recomputes everything else (runtime.training.recompute's
    # policy: aten.mm / addmm saved), plus the block input the checkpoint keeps. Under tp the column-parallel outputs
    # are split; the two row-parallel ones (attention out, MLP down: 2*s*h) are whole partial sums, also under
    # sequence parallel (the mm's output, before its reduce-scatter). A trace without the projections' outputs
    # (older summaries) keeps the attention-core rule.
    gemm = b * model.block_gemm_out_bytes
    rowwise = np.minimum(gemm, 2.0 * s * h * elem * b)
    kept = (gemm - rowwise) / t + rowwise + block_input
    selective = np.where(gemm > 0, np.minimum(kept, none),
                         none - b * model.block_attention_core_bytes / t)
    full = block_input
    return np.select([cand.recompute == 0, cand.recompute == 1], [none, selective], full)


def pipeline_receive_buffer_bytes(model: ModelNumbers, cand: Candidates, num_micro_batches: np.ndarray,
                                  precision: str) -> np.ndarray:
    """Bytes an end rank of a pipeline holds for the hidden states and gradients that cross stages, beyond what the
    activations count (a received hidden state is the first block's saved input, each chunk's output its saved
    output: memory_per_gpu's first_act and last_act, per micro-batch in flight), at the rank's peak; the larger of the
    two end ranks', as memory_per_gpu adds it to both.

    What crosses is (b, s, h) whole (the runtime gathers a sequence-parallel hidden state at stage edges:
    runtime/parallel/tensor_parallel.py) in the compute dtype, or under --compress act=int8 int8 rows, h bytes and a
    4-byte scale a row (runtime/compression/activations.py): `crossing`. The runtime's stages
    (runtime/parallel/pipeline_buffers.py) allocate a micro-batch's receive buffers when its receive is posted and
    drop them after its backward, so what stays is
    - gradients, v of them (one a chunk): on the first rank the one received for the backward under way; on the last
      under 1F1B the gradient it sent back for the micro-batch before (the schedule's P2P op holds it until the next
      one), under interleaved 1F1B those received ahead of their backward (2 at pp 4, 3 at pp 8 at the peak: torch's
      schedule posts a receive when the sender's step is scheduled);
    - of each received hidden state in flight, what the first block's saved input does not cover (torch's fwd_cache
      keeps the stage's inputs to its backward): the int8 rows beside their decoded copy, and under sequence parallel
      the (1 - 1/tp) of the whole state beyond the block's own slice. In flight: the last stage's one (v = 1), or
      inflight_microbatches on each of the first rank's v - 1 chunks that receive (interleaved).
    Measured by the dry run (benchmarks/dryrun_memory.py, pipelines of 32 and 64 micro-batches among its plans), where
    torch's own stages held a buffer for every micro-batch of the step (num_micro_batches) of every kind a rank
    receives, (2v - 1) of them: 9 GiB a GPU for GPT-3 175B at tp 8 x pp 8 with 64 micro-batches."""
    p, v, b, t = cand.pp, cand.interleave.astype(float), gpu_sequences(cand), cand.tp.astype(float)
    s, h, elem = model.seq_len, model.hidden, float(element_bytes(precision))
    int8 = cand.act_compress > 0
    crossing = b * s * np.where(int8, h + 4.0, h * elem)
    beyond_saved_input = np.where(int8, crossing, 0.0) + np.where(cand.sp > 0, b * s * h * elem * (1.0 - 1.0 / t), 0.0)
    received_in_flight = np.where(v > 1, inflight_microbatches(cand, num_micro_batches) * (v - 1.0), 1.0)
    return np.where(p > 1, v * crossing + received_in_flight * beyond_saved_input, 0.0)
