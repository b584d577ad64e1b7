"""Bytes per GPU, vectorised over candidates; the most loaded of the first and last stage counts.

What is predicted: the peak of allocated bytes (torch.cuda.max_memory_allocated's figure, what the dry run
measures: zplan dryrun, runtime.dryrun.live_memory) plus the cluster's framework reserve, which stands for what
allocation does not count (CUDA context, NCCL's buffers, kernel workspaces, the caching allocator's reserve and
fragmentation). The peak is of one moment (memory_per_gpu's peak): the loss's temporaries and the backward's
buffers are not live together.

Model states as zplan's runtime holds them (Rajbhandari et al., ZeRO, SC'20, Sec. 3 and 5, for the
partitioning; schemas.model_states says which layout runs where):
  - ZeRO 0/1 with mixed precision: the paper's layout. 16-bit parameters and gradients on every rank, the fp32
    master weights and Adam's m and v in the optimizer (runtime.optim.zero1): 2 + 2 + 12 bytes per parameter, the 12
    sharded over dp by ZeRO-1: 4 + 12/dp (the paper's K = 12). The gradients accumulate over micro-batches in the
    16-bit dtype (DDP's buckets) and are reduced in it once a step.
  - fp32, ZeRO 2/3 and 1-bit Adam: fp32 parameters (the masters: FSDP2's MixedPrecisionPolicy under ZeRO 2/3, or
    autocast under 1-bit Adam, make 16-bit copies for compute), fp32 gradients (FSDP2's reduce dtype: ZeRO 2/3
    accumulate over micro-batches in fp32), fp32 m and v: 4 + 4 + 8. ZeRO 2 shards the gradients and (FSDP2 holds
    only shards at rest) the weights too, so 16/dp at rest, 2 + 16/dp at the peak with the gathered 16-bit
    parameters (the paper's 2 + 14/dp, its gradient shard 16-bit); ZeRO 3 16/dp.
The 16-bit copies for compute are transient, a term of the peak (compute_copy_bytes, in comm_buffers): under
ZeRO 2 every unit's gathered parameters (FSDP2 with reshard_after_forward=False), held from its forward until its
backward; ZeRO-3's two in-flight units; with 1-bit Adam autocast's cached copies of the weights.
Activations per block (Korthikanti et al., MLSys'23, Table 2): of the block's saved bytes, 10*s*b*h
(16-bit; layer-norm inputs, dropout masks, first-linear inputs) stay replicated under tensor parallel
unless sequence parallel shards them; the rest is divided by tp. Selective recompute keeps the projections'
outputs and the block input (the runtime's policy, runtime.training.recompute); full recompute keeps only the block
input (2*s*b*h, /tp with sequence parallel) plus one block's activations live while it is recomputed.
Tensor parallel splits the blocks only: the runtime (runtime/parallel/tensor_parallel.py) replicates the embedding,
the final norm and the output head over the tp ranks, so every tp rank holds their whole parameters, their
gradients and optimizer states (sharded over dp by ZeRO like every parameter, never divided by tp), and
computes the whole logits (B, T, V) and the loss on them. The loss's peak (logits_loss_bytes) is
LOSS_BYTES_PER_LOGIT bytes per logit, measured, not divided by tp.
Context parallel (runtime/parallel/context_parallel.py): a GPU holds the activations of b/cp sequences' worth of tokens;
each block's attention keeps the keys and values gathered from the other cp - 1 ranks (gathered_kv_bytes), and one
(s/cp, s) attention mask serves every block (context_parallel_mask_bytes).
Pipeline in-flight micro-batches on the first stage: 1F1B min(p, m); interleaved with v chunks
multiplies by (1 + (p-1)/(p*v)) (Korthikanti et al., Sec. 4.2.3); each in-flight micro-batch keeps each of the rank's
v chunks' outputs (torch.distributed.pipelining's fwd_cache), and the last stage its logits, for its backward. Beside
them torch's PipelineStage allocates one receive buffer per micro-batch of the step for every hidden state and
gradient a stage receives (pipeline_receive_buffer_bytes), live the whole step; a tied embedding and head sum their
table's gradient over their two ranks after the backward (one received copy).
Gradients as bucket views (ZeRO 0/1) are made whole by autograd before they are added into their views: the largest,
a (V, h) table, is a term of the backward. Under ZeRO 2/3 FSDP2's root unit (the embedding, the final norm and head:
whole on every tp rank) reduces its gradients once the blocks' are reduced, through 4 (1 + 1/dp) bytes a parameter;
in a pipeline its first stage does so while the other micro-batches in flight keep their activations, and its last
stage holds the head gathered at the loss and its unsharded gradients through each micro-batch's backward. These
terms were measured with the dry run on the plans of benchmarks/dryrun_memory.py (which print where they bind).
Offload (planner.cost.offload for its traffic): the optimizer states leave the GPU; under ZeRO 2/3 the weight
and gradient shards stay on the GPU where they fit (the optimizer alone on the host, runtime.optim.sharded_cpu_adam),
else go to the host with it (FSDP2's CPUOffloadPolicy: parameters_offloaded). Host bytes per parameter of this
rank's shard: beside device parameters zplan's CPU Adam keeps an fp32 master, m and v and a gradient buffer
(HOST_OPTIMIZER_BYTES + HOST_GRAD_BUFFER_BYTES); under CPUOffloadPolicy the shards and the optimizer's states.
On NVMe the files hold m and v (ADAM_BYTES), and host memory the fp32 master of a 16-bit parameter (ZeRO-1) or
FSDP2's parameter and gradient shards under CPUOffloadPolicy.
Compression (planner.cost.compression) adds to the communication buffers: the int8 gradient hook's copies of
one DDP bucket; 1-bit Adam's error feedback, and its step's transient copies beyond the activations they
outlive (the step runs after the backward has freed them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zplan.planner.cost.compression import (
    INT8_HOOK_BUCKET_COPIES,
    ONE_BIT_ERROR_BYTES_PER_PARAM,
    ONE_BIT_STEP_BYTES_PER_PARAM,
)
from zplan.planner.cost.inputs import Candidates, ModelNumbers, gpu_sequences, gradient_group
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.spec import compute_dtype

DDP_BUCKET_BYTES = 25 * 1024**2  # torch DDP default bucket_cap_mb=25
HOST_USABLE_FRACTION = 0.9  # leave 10% of host memory / NVMe to the OS and the data loader


PARAM_BYTES = 4.0  # fp32 parameters: the master weights (fp32 runs, ZeRO 2/3's FSDP2 shards, 1-bit Adam)
GRAD_BYTES = 4.0  # fp32 gradients (fp32 runs; FSDP2's reduce_dtype=fp32; 1-bit Adam's autocast)
ADAM_BYTES = 8.0  # fp32 m and v
MASTER_BYTES = 4.0  # the optimizer's fp32 master of a 16-bit parameter (ZeRO 0/1 with mixed precision)
# zplan's CPU Adam beside parameters kept on the device (ZeRO-1's runtime.optim.cpu_adam_optimizer, ZeRO 2/3's
# runtime.optim.sharded_cpu_adam), per parameter of this rank's shard, in host memory: an fp32 master copy, m and
# v (12), and the buffers the gradient shard is copied down into before the step (4, with a GPU: fp32, or a 16-bit
# parameter's 16-bit gradient and the 16-bit rows the kernel writes for the copy back up).
HOST_OPTIMIZER_BYTES = 12.0
HOST_GRAD_BUFFER_BYTES = 4.0

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


def element_bytes(precision: str) -> int:
    """Bytes of one value in the compute dtype."""
    return 4 if precision == "fp32" else 2


def logits_loss_bytes(model: ModelNumbers, micro_batch, precision: str):
    """Peak bytes of the logits (b, s, V) and the loss on them for one micro-batch, on every tp rank alike: the
    runtime's head is replicated, not vocabulary-parallel, so nothing here is divided by tp."""
    return (np.asarray(micro_batch, dtype=float) * model.seq_len * model.vocab
            * LOSS_BYTES_PER_LOGIT[compute_dtype(precision)])


def sixteen_bit_states(zero, precision: str, grad_compress) -> np.ndarray:
    """Per candidate: parameters and gradients in the 16-bit compute dtype, the fp32 masters in the optimizer
    (schemas.model_states.parameters_in_compute_dtype, vectorised; grad_compress 2 is 1-bit Adam)."""
    return (np.asarray(zero) <= 1) & (compute_dtype(precision) in ("bf16", "fp16")) & (np.asarray(grad_compress) != 2)


def optimizer_bytes_per_param(precision: str) -> int:
    """Adam with ZeRO-Offload's CPU step (planner.cost.offload, planner.placement): fp32 master + m + v
    (mixed precision, K=12) or m + v (fp32, the weight is the master)."""
    return 8 if precision == "fp32" else 12


def state_bytes_per_param(zero, dp, offloaded, parameters_offloaded=None, sixteen_bit=False) -> tuple:
    """(weights, gradients, optimizer) bytes per parameter on the GPU, arrays or scalars alike: the
    runtime's 4 + 4 + 8, or with `sixteen_bit` (sixteen_bit_states) 2 + 2 + 12, sharded by ZeRO stage; offloaded
    states leave the GPU: the optimizer always (ZeRO-1:
    runtime.optim.cpu_adam_optimizer; ZeRO 2/3 with the parameters on the GPU: runtime.optim.sharded_cpu_adam),
    and under ZeRO 2/3 where `parameters_offloaded` the weight and gradient shards with it (FSDP2's
    CPUOffloadPolicy; planner.placement places them so). Default: every offloaded ZeRO 2/3 candidate offloads
    its parameters too (the conservative end, the least GPU memory)."""
    zero, dp, offloaded = np.asarray(zero), np.asarray(dp, dtype=float), np.asarray(offloaded, dtype=bool)
    params_off = offloaded & (zero >= 2) if parameters_offloaded is None else np.asarray(parameters_offloaded, bool)
    sixteen = np.asarray(sixteen_bit, dtype=bool)
    sharded = np.where(zero >= 2, dp, 1.0)
    weights = np.where(params_off, 0.0, np.where(sixteen, 2.0, PARAM_BYTES) / sharded)
    grads = np.where(params_off, 0.0, np.where(sixteen, 2.0, GRAD_BYTES) / sharded)
    optim = np.where(offloaded, 0.0, (ADAM_BYTES + np.where(sixteen, MASTER_BYTES, 0.0)) / np.where(zero >= 1, dp, 1.0))
    return weights, grads, optim


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-candidate arrays, bytes per GPU on the most loaded stage (host/NVMe: per node)."""

    parameters: np.ndarray
    gradients: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    comm_buffers: np.ndarray
    reserve: np.ndarray
    not_at_peak: np.ndarray  # bytes of the parts above that are not live at the peak moment (memory_per_gpu.peak)
    total: np.ndarray  # the peak: the parts' sum minus not_at_peak
    cpu_bytes_per_node: np.ndarray
    nvme_bytes_per_node: np.ndarray
    fits: np.ndarray  # bool: device, host and NVMe capacity all respected
    stage_params: np.ndarray  # parameters per GPU on the most loaded stage (blocks / tp, embedding and head whole)
    peak_stage_params: np.ndarray  # parameters per GPU on the end stage whose memory peaks (`total`'s stage)
    parameters_offloaded: np.ndarray  # bool: ZeRO 2/3 offload with the weight and gradient shards on the host too


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
    total = b * model.block_act_bytes
    replicated = np.minimum(total, 5.0 * s * h * elem * b)  # 10*s*b*h at 16-bit
    sharded = total - replicated
    # Sequence parallel shards the norms' inputs, but torch's tensor parallel all-gathers the inputs of the
    # column-parallel projections (attention, MLP: 2*s*b*h) and their matmuls save them whole (Megatron re-gathers
    # them in backward instead); measured by the dry run.
    gathered = np.minimum(replicated, 2.0 * s * h * elem * b)
    none = sharded / t + np.where(sp, (replicated - gathered) / t + gathered, replicated)
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
    """Bytes an end rank of a pipeline holds for the hidden states and their gradients that cross stages:
    torch.distributed.pipelining's PipelineStage allocates, when the schedule is built, one receive buffer per
    micro-batch of the step for each input a stage receives (every stage but the first) and for each gradient it
    receives back (every stage but the last), (b, s, h) each, whole (the runtime gathers a sequence-parallel hidden
    state at stage edges), in the compute dtype or as int8 rows (H bytes and a 4-byte scale) under --compress
    act=int8. Pipeline rank 0 (and the last) hold v chunks: 2v - 1 kinds of buffer, m of each."""
    p, v, b = cand.pp, cand.interleave.astype(float), gpu_sequences(cand)
    s, h = model.seq_len, model.hidden
    per_element = np.where(cand.act_compress > 0, 1.0 + 4.0 / h, float(element_bytes(precision)))
    buffers = (2.0 * v - 1.0) * np.asarray(num_micro_batches, dtype=float)
    return np.where(p > 1, buffers * b * s * h * per_element, 0.0)


def compute_copy_bytes(params_gpu: np.ndarray, zero: np.ndarray, precision: str,
                       uncast_params: np.ndarray | float = 0.0, grad_compress: np.ndarray | int = 0) -> np.ndarray:
    """Parameters held in the compute dtype besides the fp32 ones, from forward until backward: ZeRO-2
    (FSDP2, reshard_after_forward=False) the stage's whole parameters, gathered unit by unit; ZeRO 0/1 with
    mixed precision and 1-bit Adam (grad_compress 2: fp32 parameters under autocast) autocast's cached 16-bit
    copies of the weights it casts, which are all but `uncast_params` (an embedding lookup is not an autocast op:
    its table is read in fp32); 0 otherwise (ZeRO 0/1 compute on their 16-bit parameters themselves; ZeRO-3 frees
    each unit after its forward: its two in-flight blocks are counted in comm_buffers)."""
    autocast = (zero <= 1) & (precision != "fp32") & (np.asarray(grad_compress) == 2)
    cast = np.where(autocast, params_gpu - uncast_params, params_gpu)
    return np.where((zero == 2) | autocast, element_bytes(precision) * cast, 0.0)


def memory_per_gpu(
    model: ModelNumbers,
    cand: Candidates,
    cluster: ClusterSpec,
    precision: str,
    num_micro_batches: np.ndarray,
    end_stage_blocks: tuple[np.ndarray, np.ndarray] | None = None,
) -> MemoryEstimate:
    """Bytes per GPU of every candidate (module docstring). `end_stage_blocks`: the blocks the first and the last
    pipeline stage hold, from a partition (default: the uniform split's most, blocks_per_stage)."""
    elem = element_bytes(precision)
    # dp: the ranks ZeRO shards over (dp * cp); b: one GPU's share of a micro-batch (b / cp sequences)
    t, p, dp, z = (cand.tp.astype(float), cand.pp, gradient_group(cand).astype(float), cand.zero)
    b = gpu_sequences(cand)
    s, h = model.seq_len, model.hidden
    offloaded = cand.offload > 0

    first_blocks, last_blocks = end_stage_blocks or (blocks_per_stage(model, cand),) * 2
    single = p == 1
    # Per GPU: the blocks split by tp, the embedding and head whole (replicated over tp; module docstring). A tied
    # head's table (head_shared_params) is the embedding's in one stage, a copy of it on the last stage of a pipeline
    # (runtime/parallel/pipeline.py sums their gradients), with its gradient and optimizer states.
    edges = model.embed_params + model.head_params  # embedding, final norm, head
    whole_model = edges + (model.params - edges) / t
    first_params = np.where(single, whole_model, model.embed_params + first_blocks * model.block_params / t)
    last_params = np.where(single, whole_model,
                           model.head_params + model.head_shared_params + last_blocks * model.block_params / t)

    inflight = inflight_microbatches(cand, num_micro_batches)
    act_block = block_activation_bytes(model, cand, precision)
    live_block = np.where(cand.recompute == 2, b * model.block_act_bytes / t, 0.0)  # recomputed block
    # per micro-batch in flight: its blocks' saved bytes, and each of the rank's v chunks keeps its output (whole: a
    # sequence-parallel hidden state is gathered at stage edges) for that micro-batch's backward
    cp_mask = context_parallel_mask_bytes(model, cand, precision)  # one per stage, beside its blocks' activations
    first_act = inflight * (first_blocks * act_block + cand.interleave * b * s * h * elem) + live_block + cp_mask
    logits = logits_loss_bytes(model, b, precision)  # (b, s, V) on every tp rank, and the loss's fp32 temporaries
    last_act = (last_blocks * act_block + live_block + cp_mask + logits
                + b * model.head_act_bytes)  # replicated head: not / tp
    # a pipeline's last stage: the schedule keeps the stage's output, the logits (b, s, V) in the compute dtype, for
    # that micro-batch's backward (torch.distributed.pipelining's fwd_cache), beside the loss's temporaries
    last_act = last_act + np.where(single, 0.0, elem * b * s * model.vocab)
    first_act = np.where(single, first_act + logits, first_act)

    block_params_gpu = model.block_params / t
    params_gpu = np.maximum(first_params, last_params)
    sixteen = sixteen_bit_states(z, precision, cand.grad_compress)
    grad_elem = np.where(sixteen, 2.0, GRAD_BYTES)  # bytes of one gradient value under ZeRO 0/1
    # ZeRO 0/1: DDP's gradient buckets (and ZeRO-1's parameter all-gather, bucketed the same way).
    comm = np.where(z <= 1, 2.0 * np.minimum(DDP_BUCKET_BYTES, grad_elem * first_params), 0.0)
    # ZeRO 2/3: two blocks' unsharded gradients in the reduce-scatter (one reduced while the next is
    # computed); ZeRO-3 two blocks' gathered parameters (current + prefetched), ZeRO-2 all of them.
    comm = comm + np.where(z >= 2, 2.0 * GRAD_BYTES * block_params_gpu, 0.0)
    comm = comm + np.where(z == 3, 2.0 * elem * block_params_gpu, 0.0)
    comm = comm + np.where(t > 1, 2.0 * b * s * h * elem, 0.0)  # sequence-parallel gather buffers
    standing = pipeline_receive_buffer_bytes(model, cand, num_micro_batches, precision)  # live the whole step
    # ZeRO 2/3: the root unit (the embedding, the final norm and head, whole on every tp rank) reduces its gradients
    # once its backward is done, from an fp32 input of its unsharded size into an fp32 output of its shard's, added
    # to the gradient shard after: after the micro-batch's backward on the last stage and in one stage, but on the
    # first stage of a pipeline while the other micro-batches in flight keep their activations (measured by the dry
    # run: 70B at tp 8 x pp 8 x dp 1, two 3.9 GiB buffers)
    first_root = np.where(single, model.embed_params + model.head_params, model.embed_params)
    last_root = model.head_params + model.head_shared_params
    root_reduce = np.where(z >= 2, GRAD_BYTES * (1.0 + 1.0 / dp), 0.0)  # bytes per parameter of the root unit
    root_reduce_first, root_reduce_last = root_reduce * first_root, root_reduce * last_root
    # the compute copies of each end stage: under 1-bit Adam (DDP, tp 1) autocast's, which leave the embedding table
    # in fp32
    uncast = model.embed_params - model.head_shared_params
    # autocast's copies are saved tensors: a recomputed block (selective or full) recomputes its casts instead
    recomputed = np.where(cand.recompute > 0, model.block_params, 0.0)
    # each micro-batch's forward under autocast casts afresh and its backward keeps them: a pipeline stage holds the
    # copies of every micro-batch in flight (ZeRO-2's gathered parameters are held once)
    per_microbatch = np.where(z <= 1, inflight, 1.0)
    first_copies = per_microbatch * compute_copy_bytes(first_params, z, precision, uncast + first_blocks * recomputed,
                                                       cand.grad_compress)
    last_uncast = np.where(single, uncast, 0.0) + last_blocks * recomputed
    last_copies = compute_copy_bytes(last_params, z, precision, last_uncast, cand.grad_compress)
    # ZeRO-3 in a pipeline: the last stage's root unit (the final norm and head, whole on every tp rank) is still
    # gathered, in the compute dtype, at its loss's peak (measured by the dry run: 70B at tp 4 x pp 2; in one stage,
    # and for the first stage's embedding, it is not)
    last_copies = last_copies + np.where((z == 3) & ~single, elem * last_root, 0.0)
    # Gradients live at the loss's peak: under ZeRO 0/1 the buckets hold them from the build on (DDP's gradient as
    # bucket view; runtime.parallel.grad_reduce's under tensor parallel); else only once a micro-batch's backward has
    # run, i.e. with several micro-batches per step.
    persistent_grads = (z <= 1) | (num_micro_batches > 1)
    # ...and where they are bucket views (ZeRO 0/1), autograd makes each parameter's gradient before adding it to its
    # view: the largest, a (V, h) table of the embedding or the head (whole on every tp rank), is live in backward
    table_grad = np.where(z <= 1, grad_elem * model.vocab * h, 0.0)

    reserve = np.full(len(cand), float(cluster.framework_reserve_bytes))
    # Compression's buffers (module docstring).
    bucket = np.minimum(DDP_BUCKET_BYTES, grad_elem * first_params)
    comm = comm + np.where(cand.grad_compress == 1, INT8_HOOK_BUCKET_COPIES * bucket, 0.0)
    one_bit_errors = ONE_BIT_ERROR_BYTES_PER_PARAM * (1.0 + 1.0 / dp) * params_gpu
    one_bit_errors = one_bit_errors + np.where(z == 1, ADAM_BYTES / 2 * params_gpu, 0.0)  # ZeRO-1: whole momentum

    first_loss = np.where(single, logits, 0.0)
    fp8_casts = fp8_cast_bytes(model, cand, precision)  # in a block's backward (fp8, nvfp4), part of comm_buffers

    def peak(weights, grads, optim, acts, copies, buffers, loss, tied_sum, root_in_backward, root_after,
             root_grads=0.0) -> tuple[np.ndarray, np.ndarray]:
        """(peak bytes, bytes of the parts not live at the peak). The parts do not all peak at one moment: at the
        loss's peak (the log-softmax backward, before any block's backward) every block's activations and compute
        copies are live but no block's backward buffers, and gradients only where they persist; during a block's
        backward its buffers, the block being recomputed (full recompute) and the gradients are, the loss's
        temporaries are gone; after the backward, with the activations gone, a pipeline sums a tied table's
        gradient over the ranks that hold it (`tied_sum`: one received copy, runtime.parallel.pipeline). The pipeline's
        receive buffers (`standing`) are live throughout; ZeRO 2/3's root unit reduces in the backward or after it
        (`root_in_backward`, `root_after`), and on a pipeline's last stage its gradients are held unsharded through the
        micro-batch's backward (`root_grads`). Measured this way by the dry run (zplan dryrun,
        runtime.dryrun.live_memory)."""
        early = np.where(persistent_grads, grads, 0.0)
        parts = (weights + grads + optim + acts + copies + buffers + standing + tied_sum + table_grad + root_in_backward
                 + root_after + root_grads + fp8_casts)
        # the root unit reduces once the blocks' reductions are done: its buffers and theirs are not live together
        backward = (grads - early + np.maximum(buffers, root_in_backward) + live_block + table_grad + root_grads
                    + fp8_casts)
        during = weights + optim + acts - loss - live_block + copies + early + np.maximum(loss, backward)
        after = weights + grads + optim + np.maximum(tied_sum, root_after)
        at_peak = standing + np.maximum(during, after)
        return at_peak, parts - at_peak

    def on_gpu(params_off: np.ndarray) -> tuple[np.ndarray, ...]:
        """(weights, gradients, optimizer, activations, comm buffers, not at the peak, total, parameters) of the more
        loaded end stage."""
        per_param = state_bytes_per_param(z, dp, offloaded, params_off, sixteen)
        w1, g1, o1 = (bytes_per_param * first_params for bytes_per_param in per_param)
        w2, g2, o2 = (bytes_per_param * last_params for bytes_per_param in per_param)
        tied_sum = np.where(single, 0.0, per_param[1] * model.head_shared_params)  # both end stages hold the table

        def buffers_beside(acts):  # 1-bit Adam's step outlives the activations it is larger than
            one_bit_step = np.maximum(0.0, ONE_BIT_STEP_BYTES_PER_PARAM * params_gpu - acts)
            return comm + np.where(cand.grad_compress == 2, one_bit_errors + one_bit_step, 0.0)

        buffers1, buffers2 = buffers_beside(first_act), buffers_beside(last_act)
        pipelined = ~single
        # on a pipeline's first stage the root reduces as the micro-batch's backward ends, its own blocks' activations
        # already freed
        own_acts = first_blocks * act_block + cand.interleave * b * s * h * elem
        root_in_backward = np.where(pipelined, np.maximum(0.0, root_reduce_first - own_acts), 0.0)
        root_after = np.where(pipelined, 0.0, root_reduce_first)
        peak1, slack1 = peak(w1, g1, o1, first_act, first_copies, buffers1, first_loss, tied_sum, root_in_backward,
                             root_after)
        # a pipeline's last stage makes its root's (the head's) unsharded gradients first in each micro-batch's
        # backward and reduces them last (measured by the dry run: GPT-3 175B, tp 8 x pp 2, ZeRO-3)
        root_grads = np.where((z >= 2) & pipelined, elem * last_root, 0.0)
        peak2, slack2 = peak(w2, g2, o2, last_act, last_copies, buffers2, logits, tied_sum, 0.0, root_reduce_last,
                             root_grads)
        use_first = peak1 >= peak2
        weights, grads, optim, acts, buffers, slack, total = (
            np.where(use_first, a, c) for a, c in
            ((w1, w2), (g1, g2), (o1, o2), (first_act, last_act),
             (buffers1 + first_copies + standing + tied_sum + table_grad + root_in_backward + root_after + fp8_casts,
              buffers2 + last_copies + standing + tied_sum + table_grad + root_reduce_last + root_grads + fp8_casts),
             (slack1, slack2), (peak1, peak2)))
        return weights, grads, optim, acts, buffers, slack, total + reserve, np.where(use_first, first_params,
                                                                                 last_params)

    # An offloaded ZeRO 2/3 candidate keeps its weight and gradient shards on the GPU when they fit there (the
    # optimizer alone offloaded: no per-micro-batch traffic), else FSDP2's CPUOffloadPolicy takes them to the host.
    kept_total = on_gpu(np.zeros(len(cand), dtype=bool))[-2]
    params_off = offloaded & (z >= 2) & (kept_total > cluster.gpu.hbm_bytes)
    weights, grads, optim, acts, comm, not_at_peak, total, peak_stage_params = on_gpu(params_off)

    # Host / NVMe: the offloaded states of every GPU of the node. Parameters on the GPU: the optimizer on the CPU
    # holds HOST_OPTIMIZER_BYTES + HOST_GRAD_BUFFER_BYTES per parameter of the shard on the host; on NVMe, its
    # moments (ADAM_BYTES) in files and a 16-bit parameter's fp32 master (ZeRO-1) in host memory. Under FSDP2's
    # CPUOffloadPolicy (params_off) the fp32 parameter shards (the masters) and gradient shards in host memory, and
    # m and v there too (CPU) or in files (NVMe).
    shard = params_gpu / np.where(z >= 1, dp, 1.0)
    beside_device = (HOST_OPTIMIZER_BYTES + HOST_GRAD_BUFFER_BYTES) * shard
    host_shards = np.where(params_off, (PARAM_BYTES + GRAD_BYTES) * shard, 0.0)
    nvme_host_masters = np.where(sixteen, MASTER_BYTES * shard, 0.0)
    gpus = cluster.gpus_per_node
    cpu = np.select([cand.offload == 1, cand.offload == 2],
                    [np.where(params_off, ADAM_BYTES * shard, beside_device) + host_shards,
                     host_shards + nvme_host_masters], 0.0) * gpus
    nvme = np.where(cand.offload == 2, ADAM_BYTES * shard, 0.0) * gpus
    fits = (
        (total <= cluster.gpu.hbm_bytes)
        & (cpu <= HOST_USABLE_FRACTION * cluster.cpu_memory_bytes)
        & (nvme <= HOST_USABLE_FRACTION * cluster.nvme_bytes)
    )
    return MemoryEstimate(
        parameters=weights, gradients=grads, optimizer=optim, activations=acts, comm_buffers=comm,
        reserve=reserve, not_at_peak=not_at_peak, total=total, cpu_bytes_per_node=cpu, nvme_bytes_per_node=nvme,
        fits=fits,
        stage_params=params_gpu, peak_stage_params=peak_stage_params, parameters_offloaded=params_off,
    )
