"""Seconds per optimizer step, vectorised over candidates; the sum of a breakdown that the report shows.

Pipeline (Narayanan et al., SC'21, Sec. 2.2): with m micro-batches, p stages and v chunks per stage,
    step = m * t_stage + (p - 1) / v * t_stage        (1F1B; interleaving divides the bubble by v)
where t_stage is one micro-batch's forward+backward on the slowest stage; the bubble's (p - 1) / v is
schemas.pipeline_schedule.bubble_stage_times, the schedule the report replays. Interleaving multiplies
stage-to-stage sends by v; sends use the scatter/gather optimisation (b*s*h/tp bytes, Sec. 4.1).
Tensor parallel (Megatron, Shoeybi et al. 2019): 2 all-reduces of b*s*h in the forward and 2 in the
backward per block (+2 for a full recompute); with sequence parallel the same volume as
all-gather + reduce-scatter (Korthikanti et al. Sec. 4.2.2); under fp8, one 8-byte amax all-reduce per cast of a
split tensor (fp8_amax_reduces). Not overlapped.
Context parallel (cp GPUs share each sequence): each GPU computes b / cp sequences' worth of tokens
(planner.cost.inputs.gpu_sequences), and each block all-gathers K and V over the cp group in the forward (again under
recompute) and reduce-scatters their gradients in the backward (context_parallel_block_s). Not overlapped. The
gradients are averaged, and ZeRO shards, over dp * cp (gradient_group).
Data parallel / ZeRO (Rajbhandari et al. SC'20, Sec. 7), as zplan's runtime runs them: stages 0-1
all-reduce the gradients once per step, overlapped with the last micro-batch's backward (DDP buckets),
and stage 1 then all-gathers the updated weights (runtime/optim/layouts.py: buckets of DDP_BUCKET_BYTES, one
all-gather each; its in-place broadcasts of large tensors move the same bytes); stages 2-3 (FSDP2, one
unit per block plus the root) reduce-scatter each unit's gradients in every micro-batch's backward;
stage 3 all-gathers a unit's weights before its forward and again before its backward in every
micro-batch, stage 2 once per step (runtime.training.loop keeps them gathered until the last backward);
each phase's collectives overlap that phase's compute only (the forward's gathers the forward, the backward's gathers
and reduce-scatters the backward and, under full recompute, its re-run forward; of each, the profile's
efficiency.comm_overlap share), and the first gather is exposed.
Where the profile says
communication does not overlap compute (gloo on the CPU cores that compute), every collective adds to
the step, and each FSDP2 unit adds host_overheads.sharded_unit_s per micro-batch. Every step also
all-reduces the loss for logging over all ranks, and under ZeRO-2/3 the gradient norm for clipping.
Compression (--compress; planner/cost/compression.py): int8 or 1-bit gradients replace the ZeRO 0/1 all-reduce by
the runtime's compressed all-to-all + all-gather, not overlapped, plus its quantizing passes; int8 weights shrink
ZeRO-3's all-gathers and add their dequantizing, exposed; int8 activations shrink the stage-to-stage sends and add
their encoding and decoding.
Optimizer: gradient clipping streams CLIP_PASSES (16-bit parameters: CLIP_NORM_PASSES) x the gradients' bytes on the
GPU and AdamW ADAM_BYTES_PER_PARAM per parameter of the shard it steps, at memory bandwidth, with the host cost of
OPTIMIZER_STEP_OPS aten ops (clipping, the fused step, zero_grad) added, or under it as a floor where the host runs
ahead of a GPU (compute.with_host_s).
Offload: planner/cost/offload.py (ZeRO-Offload / ZeRO-Infinity traffic, not overlapped).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zplan.planner.cost.comm import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    group_shape,
    p2p_s,
    per_node_all_to_all_s,
    reduce_scatter_s,
)
from zplan.planner.cost.compression import (
    activation_bytes_per_element,
    activation_codec_s,
    compressed_gradient_reduce_s,
    weight_codec_s,
    weight_gather_bytes_per_element,
)
from zplan.planner.cost.compute import (
    BACKWARD_OVER_FORWARD,
    EMBEDDING_OPS,
    HEAD_OPS,
    block_time_s,
    edge_time_s,
    with_host_s,
)
from zplan.planner.cost.inputs import Candidates, ModelNumbers, gpu_sequences, gradient_group
from zplan.planner.cost.memory import (
    DDP_BUCKET_BYTES,
    GRAD_BYTES,
    MemoryEstimate,
    blocks_per_stage,
    element_bytes,
    memory_per_gpu,
    sixteen_bit_states,
)
from zplan.planner.cost.offload import offload_time_s
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.pipeline_schedule import bubble_stage_times

ADAM_BYTES_PER_PARAM = 30.0  # reads fp32 w, g, m, v (16) + writes w, m, v (12) + 16-bit copy (2)
# Clipping at the default GRAD_CLIP (runtime.training.step.optimizer_step) passes over every gradient the GPU holds (the
# whole gradient under ZeRO 0/1, the shard under 2/3: memory.gradients): clip_grad_norm_ reads it for the norm and
# reads and writes it to scale it; with 16-bit parameters (sixteen_bit_states) only the norm reads it, the step divides
# by the clipping factor as it reads the gradient (ShardedAdamW.grad_divisor)
CLIP_PASSES = 3.0
CLIP_NORM_PASSES = 1.0
# clip_grad_norm_ (8: _foreach_norm, stack, norm, add, reciprocal, mul, clamp, _foreach_mul_), fused AdamW (4),
# zero_grad (2); counted with a TorchDispatchMode on torch 2.13, independent of the parameter count.
OPTIMIZER_STEP_OPS = 14
SCALAR_BYTES = 4.0  # one fp32 scalar: the logged loss, the gradient norm
AMAX_BYTES = 8.0  # torchao's amax all-reduce under tensor parallel: one float64


def fp8_amax_reduces(model: ModelNumbers, recompute: np.ndarray) -> np.ndarray:
    """Amax all-reduces over tp a block's fp8 casts make per micro-batch (runtime/precision/float8.py's tensor-parallel
    styles:
    a split tensor's scale is the whole tensor's): forward, every split weight and each row-split Linear's input
    (c + 2r); backward, every split weight again and each column-split Linear's output gradient (2c + r); a full
    recompute re-runs the forward's. c, r: the block's column- and row-split Linears."""
    c, r = model.block_colwise_linears, model.block_rowwise_linears
    return 3.0 * (c + r) + np.where(recompute == 2, c + 2.0 * r, 0.0)


def context_parallel_block_s(model: ModelNumbers, cand: Candidates, cluster: ClusterSpec, elem: int) -> np.ndarray:
    """Seconds of one block's context-parallel collectives per micro-batch (runtime/parallel/context_parallel.py, the
    all-gather form of Llama 3, Sec. 3.3.2): the forward all-gathers K and V over the cp group (b/cp of the sequences'
    worth of tokens a rank, (b, s, kv features / tp) gathered each), the backward reduce-scatters their gradients, and
    a recompute (selective or full) gathers them again; not overlapped with the attention. 0 when cp = 1."""
    kv_features = model.hidden * (model.kv_heads or model.heads) / model.heads
    gathered = 2.0 * cand.micro_batch * model.seq_len * kv_features * elem / cand.tp  # K and V, whole sequences
    gathers = 1.0 + (cand.recompute > 0)
    return (gathers * all_gather_s(gathered, cand.cp, cand.tp, cluster)
            + reduce_scatter_s(gathered, cand.cp, cand.tp, cluster))


@dataclass(frozen=True)
class StepEstimate:
    """Per-candidate arrays; the time parts add up to step_time_s."""

    num_micro_batches: np.ndarray
    compute_s: np.ndarray
    tensor_parallel_s: np.ndarray
    context_parallel_s: np.ndarray
    expert_parallel_s: np.ndarray
    pipeline_bubble_s: np.ndarray
    pipeline_p2p_s: np.ndarray
    data_parallel_s: np.ndarray
    offload_s: np.ndarray
    optimizer_s: np.ndarray
    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    mfu: np.ndarray
    model_flops_per_step: float
    memory: MemoryEstimate


def stage_blocks_equivalent(model: ModelNumbers, cand: Candidates, edge_over_block: np.ndarray) -> np.ndarray:
    """Load of the slowest stage in block-times when blocks are split as evenly as the embedding and
    head (u block-times, on one stage) allow; the exact split comes later from planner.partition."""
    L, p, u = float(model.num_blocks), cand.pp.astype(float), edge_over_block
    whole = np.ceil((L + np.ceil(u)) / p)  # the edge stage gives up ceil(u) blocks
    shared = np.maximum(0.0, np.ceil((L - (p - 1.0) * np.floor(u)) / p)) + u  # edges added on top
    return np.where(p == 1, L + u, np.minimum(whole, shared))


def gpu_adam_step_s(params: np.ndarray | float, cluster: ClusterSpec) -> np.ndarray | float:
    """Fused AdamW on the GPU is memory-bound: ADAM_BYTES_PER_PARAM streamed per parameter."""
    return params * ADAM_BYTES_PER_PARAM / (cluster.gpu.hbm_bandwidth_Bps * cluster.efficiency.memory_bound)


def gradient_clip_s(gradient_bytes: np.ndarray, sixteen_bit: np.ndarray | bool, cluster: ClusterSpec) -> np.ndarray:
    """Clipping the gradients on the GPU is memory-bound: CLIP_PASSES over their bytes, CLIP_NORM_PASSES where the
    parameters are 16-bit."""
    passes = np.where(sixteen_bit, CLIP_NORM_PASSES, CLIP_PASSES)
    return passes * gradient_bytes / (cluster.gpu.hbm_bandwidth_Bps * cluster.efficiency.memory_bound)


def optimizer_phase_s(device_s, cluster: ClusterSpec):
    """The optimizer phase's seconds from its device work (clipping and AdamW on the GPU, 0 where the optimizer is
    offloaded): with the host's OPTIMIZER_STEP_OPS dispatched ops, added on a CPU, a floor on a GPU (with_host_s)."""
    return with_host_s(device_s, OPTIMIZER_STEP_OPS * cluster.host_overheads.op_s, cluster)


def fsdp_units(model: ModelNumbers, cand: Candidates) -> np.ndarray:
    """FSDP2 units on the most loaded stage: one per block, plus the root of each of its v chunks."""
    return blocks_per_stage(model, cand) + cand.interleave


def data_parallel_s(model: ModelNumbers, cand: Candidates, cluster: ClusterSpec, params_gpu: np.ndarray,
                    elem: int, compute_mb: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Seconds per step of data-parallel / ZeRO collectives (and FSDP2 host work) not hidden behind compute.
    `params_gpu`: this stage's parameters per GPU (its gradients and gathered weights are `elem` bytes each);
    `compute_mb`: one micro-batch's compute on the stage; `m`: micro-batches per step."""
    t, p, dp, z = cand.tp, cand.pp, gradient_group(cand), cand.zero  # dp: every rank holding these parameters
    grads_bytes = elem * params_gpu
    overlap = cluster.overlaps_comm_with_compute
    one = np.ones_like(t)
    # ZeRO 0-1: one gradient all-reduce per step, hidden behind the last backward where comm overlaps.
    reduce_once = all_reduce_s(grads_bytes, dp, t, cluster)
    hides = cluster.efficiency.comm_overlap  # the share of each phase's compute the collectives can hide behind
    backward_window = hides * compute_mb * BACKWARD_OVER_FORWARD / (1.0 + BACKWARD_OVER_FORWARD)
    reduce_exposed = np.maximum(0.0, reduce_once - backward_window) if overlap else reduce_once
    # Compressed gradients instead: the runtime's synchronous compressed all-reduce, per DDP bucket of fp32
    # gradients (int8) or once (1-bit), not hidden.
    grad_buckets = np.maximum(1.0, np.ceil(GRAD_BYTES * params_gpu / DDP_BUCKET_BYTES))
    reduce_exposed = np.where(cand.grad_compress > 0,
                              compressed_gradient_reduce_s(params_gpu, cand, cluster, grad_buckets), reduce_exposed)
    # ZeRO-1 weight sync after the step: the updated weights all-gathered, one all-gather per bucket.
    buckets = np.maximum(1.0, np.ceil(grads_bytes / DDP_BUCKET_BYTES))
    zero1_sync = buckets * all_gather_s(grads_bytes / buckets, dp, t, cluster)
    stage01 = reduce_exposed + np.where(z == 1, zero1_sync, 0.0)
    # ZeRO 2-3 (FSDP2), per unit: a reduce-scatter every micro-batch; gathers before forward and backward
    # every micro-batch (stage 3) or once per step (stage 2); the unit's hooks every micro-batch.
    units = fsdp_units(model, cand)
    unit_bytes = grads_bytes / units
    gathers_per_step = np.where(z == 3, 2.0 * m, 1.0)
    # int8 weights (ZeRO 3): the gathers move the compressed bytes; dequantizing each gathered unit is exposed.
    gather_bytes = np.where(cand.weight_compress > 0,
                            weight_gather_bytes_per_element(cand, elem) * params_gpu / units, unit_bytes)
    gather = all_gather_s(gather_bytes, dp, t, cluster)
    # Each phase hides its own collectives only: the forward's gathers behind the forward, the backward's gathers
    # and reduce-scatters behind the backward (with full recompute, the re-run forward is part of the backward).
    forward_share = 1.0 / (1.0 + BACKWARD_OVER_FORWARD + (cand.recompute == 2))
    gathers_in_forward = np.where(z == 3, 1.0, 1.0 / m)  # stage 2: once a step, in the first forward
    gathers_in_backward = np.where(z == 3, 1.0, 0.0)
    forward_comm = units * gathers_in_forward * gather
    backward_comm = units * (gathers_in_backward * gather + reduce_scatter_s(unit_bytes, dp, t, cluster))
    first_gather = gather  # the first unit's gather cannot overlap
    exposed_mb = (np.maximum(0.0, forward_comm - hides * forward_share * compute_mb)
                  + np.maximum(0.0, backward_comm - hides * (1.0 - forward_share) * compute_mb) + first_gather / m
                  if overlap else forward_comm + backward_comm)
    stage23 = m * (exposed_mb + units * cluster.host_overheads.sharded_unit_s)
    stage23 = stage23 + gathers_per_step * units * weight_codec_s(params_gpu / units, cand, cluster, elem)
    # Every step: the logged loss all-reduced over all ranks; ZeRO 2-3 also all-reduce the gradient norm.
    scalars = (all_reduce_s(SCALAR_BYTES * one, t * p * dp, one, cluster)  # dp * cp: all the ranks
               + np.where(z >= 2, all_reduce_s(SCALAR_BYTES * one, dp, t, cluster), 0.0))
    return np.where(dp > 1, np.where(z <= 1, stage01, stage23), 0.0) + scalars


def expert_parallel_block_s(model: ModelNumbers, cand: Candidates, cluster: ClusterSpec, elem: int) -> np.ndarray:
    """All-to-all seconds of one block for one micro-batch, averaged over the blocks (moe_blocks of num_blocks
    route): each MoE block sends its (b s k, h) routed tokens to their experts' ranks and back, forward and backward
    (4 all-to-alls), twice more where full recompute re-runs its forward; the ep ranks are consecutive dp ranks, t cp
    ranks apart (the mesh is pp, dp, cp, tp); balanced routing, so (ep - 1) / ep of the tokens leave the GPU, each
    (token, expert) copy straight to its rank, or where model.dispatch_per_node one copy of a token to each other
    node it visits (remote_nodes_visited)."""
    exchanges = 4.0 + 2.0 * (cand.recompute == 2)
    routed = gpu_sequences(cand) * model.seq_len * model.top_k * model.hidden * elem  # bytes of (b s k, h)
    routed = routed * model.busiest_rank(cand.ep)  # the busiest rank receives the most
    share = model.moe_blocks / max(model.num_blocks, 1)
    stride = cand.tp * cand.cp
    if not model.dispatch_per_node:
        return share * exchanges * all_to_all_s(routed, cand.ep, stride, cluster)
    inter = routed / model.top_k * remote_nodes_visited(model, cand.ep, stride, cluster)
    return share * exchanges * per_node_all_to_all_s(routed, cand.ep, stride, inter, cluster)


def remote_nodes_visited(model: ModelNumbers, ep: np.ndarray, stride: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """Other nodes one token's k experts sit on, expected under balanced routing (k distinct experts of E drawn
    uniformly): (N - 1) (1 - C(E - m, k) / C(E, k)) for an ep group over N nodes (comm.group_shape) with g of its
    ranks, m = E g / ep experts, on each; C(E - m, k) / C(E, k) = prod_{i<k} (E - m - i) / (E - i)."""
    g, nodes = group_shape(ep, stride, cluster.link_domain())
    experts, k = float(model.num_experts), np.arange(model.top_k)
    on_node = experts * g / np.maximum(ep, 1)
    missed = np.prod(np.clip((experts - on_node[..., None] - k) / (experts - k), 0.0, None), axis=-1)
    return (nodes - 1) * (1.0 - missed)


# torch's loss_parallel (torch/distributed/tensor/parallel/loss.py): the log-softmax all-reduces each token's max and
# its sum of exponentials, the NLL the target's logit from the rank that holds it (a masked partial sum): three
# all-reduces of one fp32 value a token, forward only
LOSS_PARALLEL_REDUCES = 3


def vocab_parallel_s(model: ModelNumbers, cand: Candidates, cluster: ClusterSpec, elem: int) -> np.ndarray:
    """Seconds one micro-batch spends on a split vocabulary's collectives (ParallelConfig.vocab_parallel) on the
    stage that holds the edges: the embedding's (b, s, h) partial lookups all-reduced (forward), the gradient of the
    head's replicated (b, s, h) input all-reduced (backward; Megatron's f and g operators at the edges), and the
    loss's LOSS_PARALLEL_REDUCES (b, s) fp32 all-reduces. One stage holds both edges; a pipeline's first stage the
    embedding, its last the head: the larger, the last, is counted. 0 where the vocabulary is not split."""
    b, t = gpu_sequences(cand), cand.tp
    one = np.ones_like(t)
    hidden = all_reduce_s(b * model.seq_len * model.hidden * elem, t, one, cluster)
    loss = LOSS_PARALLEL_REDUCES * all_reduce_s(b * model.seq_len * 4.0, t, one, cluster)
    return np.where(model.vocab_split(cand) > 1, np.where(cand.pp > 1, 1.0, 2.0) * hidden + loss, 0.0)


def model_flops_per_sample(model: ModelNumbers) -> float:
    """Forward + backward FLOPs of one sample, recompute excluded (the MFU numerator)."""
    forward = model.num_blocks * model.block_fwd_flops + model.embed_fwd_flops + model.head_fwd_flops
    return (1.0 + BACKWARD_OVER_FORWARD) * forward


def estimate_step(
    model: ModelNumbers,
    cand: Candidates,
    cluster: ClusterSpec,
    precision: str,
    global_batch: int,
    stage_blocks: np.ndarray | None = None,
    end_stage_blocks: tuple[np.ndarray, np.ndarray] | None = None,
) -> StepEstimate:
    """Predict every candidate. `stage_blocks` overrides the slowest stage's load (block-times), `end_stage_blocks`
    the blocks the first and last pipeline stage hold (memory_per_gpu), both from a partition."""
    elem = element_bytes(precision)
    t, p, dp, v = cand.tp, cand.pp, cand.dp, cand.interleave.astype(float)
    m = global_batch / (dp * cand.micro_batch)
    b = gpu_sequences(cand)  # one GPU's share of a micro-batch: its tokens' hidden states below
    s, h = model.seq_len, model.hidden

    # One micro-batch on the slowest stage.
    block_s = block_time_s(model, cand, cluster, precision)
    edges_s = (edge_time_s(model.embed_fwd_flops, model, cand, cluster, precision, EMBEDDING_OPS)
               + edge_time_s(model.head_fwd_flops, model, cand, cluster, precision, HEAD_OPS, loss=True))
    load = stage_blocks if stage_blocks is not None else stage_blocks_equivalent(model, cand, edges_s / block_s)
    tp_collectives = 4.0 + 2.0 * (cand.recompute == 2)
    one = np.ones_like(t)
    block_tp_s = tp_collectives * all_reduce_s(b * s * h * elem, t, one, cluster)
    if precision == "fp8":  # each cast of a tp-split tensor all-reduces its amax over tp (runtime/precision/float8.py)
        block_tp_s = block_tp_s + fp8_amax_reduces(model, cand.recompute) * all_reduce_s(
            AMAX_BYTES * one, t, one, cluster)
    compute_mb = load * block_s
    tp_mb = np.floor(load) * block_tp_s + vocab_parallel_s(model, cand, cluster, elem)
    cp_mb = np.floor(load) * context_parallel_block_s(model, cand, cluster, elem)
    ep_mb = blocks_per_stage(model, cand) * expert_parallel_block_s(model, cand, cluster, elem)  # blocks, not edges
    stage_s = compute_mb + tp_mb + cp_mb + ep_mb

    bubble = bubble_stage_times(p, v) * stage_s
    crosses_node = t * cand.cp * dp >= cluster.link_domain()
    p2p = np.where(p > 1, 2.0 * v * m * p2p_s(b * s * h * elem / t, crosses_node, cluster), 0.0)
    # int8 activations: each crossing sends the compressed bytes and is encoded and decoded on the way.
    act_elements = b * s * h / t
    codec_forward, codec_backward = activation_codec_s(act_elements, cand, cluster, elem)
    act_crossing = p2p_s(act_elements * activation_bytes_per_element(cand, h, elem), crosses_node, cluster)
    p2p = np.where((p > 1) & (cand.act_compress > 0),
                   v * m * (2.0 * act_crossing + codec_forward + codec_backward), p2p)

    memory = memory_per_gpu(model, cand, cluster, precision, m, end_stage_blocks)
    params_gpu = memory.stage_params
    dp_s = data_parallel_s(model, cand, cluster, params_gpu, elem, compute_mb, m)

    shard = memory.stage_shard_params  # the parameters this rank's optimizer steps
    offload_s = offload_time_s(cand, params_gpu, m, cluster, precision, memory.parameters_offloaded)
    clip_s = gradient_clip_s(memory.gradients, sixteen_bit_states(cand.zero, precision, cand.grad_compress), cluster)
    optimizer_s = optimizer_phase_s(np.where(cand.offload == 0, gpu_adam_step_s(shard, cluster) + clip_s, 0.0),
                                    cluster)

    compute_s = m * compute_mb
    tp_s = m * tp_mb
    cp_s = m * cp_mb
    ep_s = m * ep_mb
    step = compute_s + tp_s + cp_s + ep_s + bubble + p2p + dp_s + offload_s + optimizer_s
    flops = model_flops_per_sample(model) * global_batch
    gpus = t * p * dp * cand.cp
    return StepEstimate(
        num_micro_batches=m, compute_s=compute_s, tensor_parallel_s=tp_s, context_parallel_s=cp_s,
        expert_parallel_s=ep_s,
        pipeline_bubble_s=bubble,
        pipeline_p2p_s=p2p, data_parallel_s=dp_s, offload_s=offload_s, optimizer_s=optimizer_s,
        step_time_s=step, tokens_per_s=global_batch * s / step,
        mfu=flops / (step * gpus * cluster.peak_flops(precision)), model_flops_per_step=flops, memory=memory,
    )
