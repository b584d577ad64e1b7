"""Bytes per GPU, vectorised over candidates; the most loaded of the first and last stage counts.

What is predicted: the peak of allocated bytes (torch.cuda.max_memory_allocated's figure, what the dry run
measures: zplan dryrun, runtime.dryrun.live_memory) plus the cluster's framework reserve, which stands for what
allocation does not count (CUDA context, NCCL's buffers, kernel workspaces, the caching allocator's reserve and
fragmentation). The peak is of one moment (memory_per_gpu's peak): the loss's temporaries and the backward's
buffers are not live together, nor, under ZeRO 2/3 with one micro-batch, every saved activation and every gradient
shard (the backward peaks at its start or its end).

Model states (weights, gradients, optimizer states, compute copies): planner.cost.memory_states. Activations,
the loss, context parallel and pipeline buffers: planner.cost.memory_activations.

Gradients as bucket views (ZeRO 0/1) are made whole by autograd before they are added into their views: the largest,
a (V, h) table, is a term of the backward. Under ZeRO 2/3 FSDP2's root unit (the embedding, the final norm and head:
whole on every tp rank) reduces its gradients once the blocks' are reduced, through 4 (1 + 1/dp) bytes a parameter;
in a pipeline its first stage does so while the other micro-batches in flight keep their activations, and its last
stage holds the head gathered at the loss and its unsharded gradients through each micro-batch's backward. These
terms were measured with the dry run on the plans of benchmarks/dryrun_memory.py (which print where they bind).
Offload (planner.cost.offload for its traffic): the optimizer states leave the GPU; under ZeRO 2/3 the weight
and gradient shards stay on the GPU where they fit (the optimizer alone on the host, runtime.optim.host_states),
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
from zplan.planner.cost.memory_activations import (
    FP8_CAST_TEMPORARY_BYTES_PER_ELEMENT,
    LOSS_BYTES_PER_LOGIT,
    NVFP4_CAST_TEMPORARY_BYTES_PER_ELEMENT,
    block_activation_bytes,
    blocks_per_stage,
    context_parallel_mask_bytes,
    fp8_cast_bytes,
    gathered_kv_bytes,
    inflight_microbatches,
    logits_loss_bytes,
    pipeline_receive_buffer_bytes,
)
from zplan.planner.cost.memory_states import (
    ADAM_BYTES,
    GRAD_BYTES,
    HOST_GRAD_BUFFER_BYTES,
    HOST_OPTIMIZER_BYTES,
    MASTER_BYTES,
    PARAM_BYTES,
    compute_copy_bytes,
    element_bytes,
    optimizer_bytes_per_param,
    optimizer_shard_params,
    sixteen_bit_states,
    state_bytes,
    state_bytes_per_param,
)
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.plan import MEMORY_TERMS as TERMS

__all__ = ["ADAM_BYTES", "DDP_BUCKET_BYTES", "FP8_CAST_TEMPORARY_BYTES_PER_ELEMENT", "GRAD_BYTES",
           "HOST_GRAD_BUFFER_BYTES", "HOST_OPTIMIZER_BYTES", "HOST_USABLE_FRACTION", "LOSS_BYTES_PER_LOGIT",
           "MASTER_BYTES", "NVFP4_CAST_TEMPORARY_BYTES_PER_ELEMENT", "PARAM_BYTES", "MemoryEstimate",
           "block_activation_bytes", "blocks_per_stage", "compute_copy_bytes", "context_parallel_mask_bytes",
           "element_bytes", "fp8_cast_bytes", "gathered_kv_bytes", "inflight_microbatches", "logits_loss_bytes",
           "memory_per_gpu", "optimizer_bytes_per_param", "pipeline_receive_buffer_bytes", "sixteen_bit_states",
           "state_bytes_per_param"]

DDP_BUCKET_BYTES = 25 * 1024**2  # torch DDP default bucket_cap_mb=25
HOST_USABLE_FRACTION = 0.9  # leave 10% of host memory / NVMe to the OS and the data loader


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
    stage_shard_params: np.ndarray  # of stage_params, those one rank's optimizer steps (its ZeRO shard)
    peak_stage_params: np.ndarray  # parameters per GPU on the end stage whose memory peaks (`total`'s stage)
    peak_stage_expert_params: np.ndarray  # of peak_stage_params, routed experts' (E / ep of them)
    parameters_offloaded: np.ndarray  # bool: ZeRO 2/3 offload with the weight and gradient shards on the host too
    terms: dict[str, np.ndarray]  # the peak stage's bytes by name (named_terms): they add up to `total`


# the terms (schemas.plan.MEMORY_TERMS) that MemoryEstimate.comm_buffers adds up
BUFFER_TERMS = ("collective buffers", "compute copies", "pipeline receive buffers", "tied table gradient",
                "vocabulary table gradient", "root unit reduce", "low-precision cast temporaries")


def named_terms(weights, grads, optim, acts, logits, buffers, copies, standing, tied_sum, table_grad, root, casts,
                reserve, slack) -> dict[str, np.ndarray]:
    """One end stage's bytes by TERMS' names; `acts` includes `logits`, `slack` is what is not live at the peak."""
    values = (weights, grads, optim, acts - logits, logits, buffers, copies, standing, tied_sum, table_grad, root,
              casts, reserve, -slack)
    return {name: np.asarray(value, dtype=float) + 0.0 * weights for name, value in zip(TERMS, values, strict=True)}


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
    # Routed experts are whole on every tp rank and split over ep (ModelNumbers.block_params_per_rank): their states
    # shard over the dp / ep ranks that hold the same experts, so that sharded they take what they take at ep = 1.
    ep = cand.ep.astype(float)
    # the edges on one rank: whole, their vocabulary tables split over tp where the plan splits the vocabulary
    # (ParallelConfig.vocab_parallel: ModelNumbers.edge_params), and with them the logits (vocab_t)
    embed_gpu, head_gpu, shared_gpu = model.edge_params(cand)
    vocab_t = model.vocab_split(cand)
    edges = model.embed_params + model.head_params  # embedding, final norm, head
    experts = model.num_blocks * model.block_expert_params
    whole_model = embed_gpu + head_gpu + (model.params - edges - experts) / t + experts / ep
    block_params_gpu = model.block_params_per_rank(t, ep)
    first_experts = np.where(single, experts, first_blocks * model.block_expert_params) / ep
    last_experts = np.where(single, experts, last_blocks * model.block_expert_params) / ep
    first_params = np.where(single, whole_model, embed_gpu + first_blocks * block_params_gpu)
    last_params = np.where(single, whole_model, head_gpu + shared_gpu + last_blocks * block_params_gpu)

    inflight = inflight_microbatches(cand, num_micro_batches)
    act_block = block_activation_bytes(model, cand, precision)
    live_block = np.where(cand.recompute == 2, b * model.block_act_bytes / t, 0.0)  # recomputed block
    # per micro-batch in flight: its blocks' saved bytes, and each of the rank's v chunks keeps its output (whole: a
    # sequence-parallel hidden state is gathered at stage edges) for that micro-batch's backward
    cp_mask = context_parallel_mask_bytes(model, cand, precision)  # one per stage, beside its blocks' activations
    first_act = inflight * (first_blocks * act_block + cand.interleave * b * s * h * elem) + live_block + cp_mask
    # (b, s, V / vocab_t) logits on each tp rank and the loss's temporaries (with the in-place loss: the logits alone)
    logits = logits_loss_bytes(model, cand, precision)
    last_act = (last_blocks * act_block + live_block + cp_mask + logits
                + b * model.head_act_bytes)  # the head's input and the final norm's: whole on every tp rank
    # a pipeline's last stage: the schedule keeps the stage's output, the logits (b, s, V / vocab_t) in the compute
    # dtype, for that micro-batch's backward (torch.distributed.pipelining's fwd_cache), beside the loss's temporaries
    # (the in-place loss's logits are that output: counted once, in `logits`)
    in_place = model.default_loss & (cand.cp == 1) & (vocab_t == 1)
    kept_logits = np.where(single | in_place, 0.0, elem * b * s * model.vocab / vocab_t)
    last_act = last_act + kept_logits
    first_act = np.where(single, first_act + logits, first_act)
    first_logits, last_logits = np.where(single, logits, 0.0), logits + kept_logits  # of first_act, last_act

    params_gpu = np.maximum(first_params, last_params)
    sixteen = sixteen_bit_states(z, precision, cand.grad_compress)
    grad_elem = np.where(sixteen, 2.0, GRAD_BYTES)  # bytes of one gradient value under ZeRO 0/1
    # ZeRO 0/1: DDP's gradient buckets (and ZeRO-1's parameter all-gather, bucketed the same way).
    comm = np.where(z <= 1, 2.0 * np.minimum(DDP_BUCKET_BYTES, grad_elem * first_params), 0.0)
    # ZeRO 2/3, in a block's backward (FSDP2, as the dry run measures it): the fp32 reduce-scatter input of the block
    # after it, kept until this block's reduce-scatter; ZeRO-3 the next block's gathered parameters (prefetched); and
    # at the block's end the larger of what it holds before and after its reduce-scatter: its gradients in the
    # compute dtype with (ZeRO-3) its own gathered parameters, or its own fp32 input. At the block's start it holds
    # its own parameters and its recomputed activations (`live_block`), no gradients yet: what those add above its
    # end is `live_beside_buffers`. ZeRO-2's gathered parameters: copies.
    # A pipeline stage keeps the budget from before that measurement, two fp32 reduce-scatter inputs and (ZeRO-3) two
    # gathered blocks beside its recomputed block: with micro-batches in flight the dry run holds more than the
    # one-stage rule gives (GPT-3 175B at tp 8 x pp 2, ZeRO-3: 9 % under with it; what that rule misses there is a
    # first stage's activations, not these buffers).
    reduce_input = GRAD_BYTES * block_params_gpu
    gathered = np.where(z == 3, elem * block_params_gpu, 0.0)
    block_end = np.where(single, np.maximum(elem * block_params_gpu + gathered, reduce_input), reduce_input + gathered)
    comm = comm + np.where(z >= 2, reduce_input + gathered + block_end, 0.0)
    live_beside_buffers = np.where((z >= 2) & single, np.maximum(0.0, gathered + live_block - block_end), live_block)
    comm = comm + np.where(t > 1, 2.0 * b * s * h * elem, 0.0)  # sequence-parallel gather buffers
    # expert parallel: one MoE block's routed tokens (b s k, h) sent and received by all-to-all
    comm = comm + np.where(ep > 1, 2.0 * b * s * model.top_k * h * elem, 0.0)
    standing = pipeline_receive_buffer_bytes(model, cand, num_micro_batches, precision)  # one of each kind
    # ZeRO 2/3: the root unit (the embedding, the final norm and head, whole on every tp rank) reduces its gradients
    # once its backward is done, from an fp32 input of its unsharded size into an fp32 output of its shard's, added
    # to the gradient shard after: after the micro-batch's backward on the last stage and in one stage, but on the
    # first stage of a pipeline while the other micro-batches in flight keep their activations (measured by the dry
    # run: 70B at tp 8 x pp 8 x dp 1, two 3.9 GiB buffers)
    first_root = np.where(single, embed_gpu + head_gpu, embed_gpu)
    last_root = head_gpu + shared_gpu
    root_reduce = np.where(z >= 2, GRAD_BYTES * (1.0 + 1.0 / dp), 0.0)  # bytes per parameter of the root unit
    root_reduce_first, root_reduce_last = root_reduce * first_root, root_reduce * last_root
    # ...and under ZeRO-3 in one stage, at the end of the blocks' backward, before it reduces: its parameters gathered
    # again for its backward and its unsharded gradients, in the compute dtype (measured by the dry run: examples/moe.py
    # at Mixtral-8x7B's sizes on 64 ranks)
    root_at_backward_end = np.where(single & (z == 3), 2.0 * elem * first_root, 0.0)
    # the compute copies of each end stage: under 1-bit Adam (DDP, tp 1) autocast's, which leave the embedding table
    # in fp32
    uncast = embed_gpu - shared_gpu
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
    table_grad = np.where(z <= 1, grad_elem * model.vocab * h / vocab_t, 0.0)

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
        receive buffers (`standing`: one of each kind) are counted throughout; ZeRO 2/3's root unit reduces in the
        backward or after it (`root_in_backward`, `root_after`), and on a pipeline's last stage its gradients are held
        unsharded through the micro-batch's backward (`root_grads`). Measured this way by the dry run (zplan dryrun,
        runtime.dryrun.live_memory)."""
        early = np.where(persistent_grads, grads, 0.0)
        parts = (weights + grads + optim + acts + copies + buffers + standing + tied_sum + table_grad + root_in_backward
                 + root_after + root_grads + fp8_casts)
        # the root unit reduces once the blocks' reductions are done: its buffers and theirs are not live together
        in_block = np.maximum(buffers, root_in_backward) + table_grad + root_grads + fp8_casts
        # Through the backward the saved activations of the blocks still to run shrink and the gradients not made
        # before it (grads - early) grow, both block by block: their sum is largest at one end, at its start (every
        # activation, the first block recomputed) or at its end (every gradient, the last block recomputed, no saved
        # activation left; its recomputed activations, their gradients and its own weights' gradients budgeted as
        # live beside the block's buffers: a tiny Llama's MLP in tests/unit/test_float8_plan.py peaks so).
        during = (weights + optim + acts - loss - live_block + copies + early
                  + np.maximum(loss, in_block + live_beside_buffers))
        backward_end = weights + optim + copies + grads + in_block + live_block + root_at_backward_end
        after = weights + grads + optim + np.maximum(tied_sum, root_after)
        at_peak = standing + np.maximum(np.maximum(during, backward_end), after)
        return at_peak, parts - at_peak

    def on_gpu(params_off: np.ndarray) -> tuple:
        """(weights, gradients, optimizer, activations, comm buffers, not at the peak, total, parameters, routed
        experts' parameters, the named terms) of the more loaded end stage."""
        w1, g1, o1 = state_bytes(z, dp, ep, first_params, first_experts, offloaded, params_off, sixteen)
        w2, g2, o2 = state_bytes(z, dp, ep, last_params, last_experts, offloaded, params_off, sixteen)
        grad_bytes = state_bytes_per_param(z, dp, offloaded, params_off, sixteen)[1]
        tied_sum = np.where(single, 0.0, grad_bytes * shared_gpu)  # both end stages hold the table

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
        first_terms = named_terms(w1, g1, o1, first_act, first_logits, buffers1, first_copies, standing, tied_sum,
                                  table_grad, root_in_backward + root_after, fp8_casts, reserve, slack1)
        last_terms = named_terms(w2, g2, o2, last_act, last_logits, buffers2, last_copies, standing, tied_sum,
                                 table_grad, root_reduce_last + root_grads, fp8_casts, reserve, slack2)
        terms = {name: np.where(use_first, first_terms[name], last_terms[name]) for name in first_terms}
        weights, grads, optim, acts, slack, total = (
            np.where(use_first, a, c) for a, c in
            ((w1, w2), (g1, g2), (o1, o2), (first_act, last_act), (slack1, slack2), (peak1, peak2)))
        buffers = sum(terms[name] for name in BUFFER_TERMS)
        return (weights, grads, optim, acts, buffers, slack, total + reserve,
                np.where(use_first, first_params, last_params), np.where(use_first, first_experts, last_experts),
                terms)

    # An offloaded ZeRO 2/3 candidate keeps its weight and gradient shards on the GPU when they fit there (the
    # optimizer alone offloaded: no per-micro-batch traffic), else FSDP2's CPUOffloadPolicy takes them to the host.
    kept_total = on_gpu(np.zeros(len(cand), dtype=bool))[6]
    params_off = offloaded & (z >= 2) & (kept_total > cluster.gpu.hbm_bytes)
    (weights, grads, optim, acts, comm, not_at_peak, total, peak_stage_params, peak_stage_experts,
     terms) = on_gpu(params_off)

    # Host / NVMe: the offloaded states of every GPU of the node. Parameters on the GPU: the optimizer on the CPU
    # holds HOST_OPTIMIZER_BYTES + HOST_GRAD_BUFFER_BYTES per parameter of the shard on the host; on NVMe, its
    # moments (ADAM_BYTES) in files and a 16-bit parameter's fp32 master (ZeRO-1) in host memory. Under FSDP2's
    # CPUOffloadPolicy (params_off) the fp32 parameter shards (the masters) and gradient shards in host memory, and
    # m and v there too (CPU) or in files (NVMe).
    experts_gpu = np.where(first_params >= last_params, first_experts, last_experts)
    shard = optimizer_shard_params(z, dp, ep, params_gpu, experts_gpu)
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
        stage_params=params_gpu, stage_shard_params=shard, peak_stage_params=peak_stage_params,
        peak_stage_expert_params=peak_stage_experts, parameters_offloaded=params_off, terms=terms,
    )
