"""Per-pipeline-unit time and bytes for ONE candidate: the numbers planner.partition balances.

Tensor parallel divides the blocks' parameters, compute and most activations by tp; the embedding and head's
vocabulary tables, the logits GEMM and the logits with the loss's peak (planner.cost.memory.logits_loss_bytes) by tp
where the plan splits the vocabulary (ModelNumbers.vocab_split), else they are whole on every tp rank, as the final
norm and a position table always are (runtime/parallel/tensor_parallel.py, runtime/parallel/vocab_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zplan.planner.cost.comm import all_reduce_s
from zplan.planner.cost.compute import EMBEDDING_OPS, HEAD_OPS, block_time_s, edge_time_s
from zplan.planner.cost.inputs import Candidates, ModelNumbers, gpu_sequences, gradient_group
from zplan.planner.cost.memory import (
    block_activation_bytes,
    element_bytes,
    logits_loss_bytes,
    sixteen_bit_states,
    state_bytes_per_param,
)
from zplan.planner.cost.step import context_parallel_block_s
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.model import ModelSummary


@dataclass(frozen=True)
class UnitCosts:
    """Arrays over ModelSummary.layers for one candidate (per GPU, one micro-batch)."""

    time_s: np.ndarray  # forward + backward (+ recompute) + tensor-parallel collectives
    static_bytes: np.ndarray  # model states held on the GPU, bytes (blocks / tp; embedding and head whole but for
    # their vocabulary tables where the plan splits them, ModelNumbers.vocab_split)
    act_bytes: np.ndarray  # activations saved per in-flight micro-batch, bytes (the head's: + logits and loss peak)
    block_time_s: float  # one average block, for converting a stage's time to block-times


def unit_costs(summary: ModelSummary, cand: Candidates, cluster: ClusterSpec, precision: str) -> UnitCosts:
    assert len(cand) == 1, "unit costs are for one candidate"
    model = ModelNumbers.from_summary(summary)
    elem = element_bytes(precision)
    t, dp, z, off = int(cand.tp[0]), int(gradient_group(cand)[0]), int(cand.zero[0]), int(cand.offload[0])
    b = float(gpu_sequences(cand)[0])  # one GPU's share of a micro-batch (context parallel: b / cp)
    tp_collectives = 4.0 + 2.0 * (cand.recompute[0] == 2)
    block_s = float(block_time_s(model, cand, cluster, precision)[0])
    block_s += float(tp_collectives * all_reduce_s(
        np.array([b * model.seq_len * model.hidden * elem]), cand.tp, np.ones(1), cluster)[0])
    block_s += float(context_parallel_block_s(model, cand, cluster, elem)[0])
    block_act = float(block_activation_bytes(model, cand, precision)[0])

    sixteen_bit = sixteen_bit_states(z, precision, cand.grad_compress[0])
    per_param = float(sum(state_bytes_per_param(z, dp, off > 0, None, sixteen_bit)))

    vocab_t = float(model.vocab_split(cand)[0])  # the vocabulary tables and logits split over tp, or 1 (whole)
    table = model.vocab * model.hidden  # a (V, h) table in the embedding's or the head's parameters
    times, static, acts = [], [], []
    for unit in summary.layers:
        if unit.kind == "block":  # tensor parallel splits the blocks
            params = unit.params / t
        elif unit.kind in ("embedding", "head") and unit.params >= table > 0:  # a vocabulary table, split or whole
            params = unit.params - table * (1.0 - 1.0 / vocab_t)
        else:  # replicated
            params = unit.params
        static.append(params * per_param)
        if unit.kind == "block":
            scale = unit.fwd_flops / model.block_fwd_flops if model.block_fwd_flops else 1.0
            times.append(block_s * scale)
            acts.append(block_act * (unit.act_bytes / model.block_act_bytes if model.block_act_bytes else 1.0))
        else:
            ops = {"embedding": EMBEDDING_OPS, "head": HEAD_OPS}.get(unit.kind, 0)
            times.append(float(edge_time_s(unit.fwd_flops, model, cand, cluster, precision, ops,
                                           loss=unit.kind == "head")[0]))
            # the head's (b, s, V / vocab_t) logits and the loss's peak on each tp rank
            logits = float(logits_loss_bytes(model, cand, precision)[0]) if unit.kind == "head" else 0.0
            acts.append(b * model.seq_len * model.hidden * elem + logits)
    return UnitCosts(time_s=np.array(times), static_bytes=np.array(static), act_bytes=np.array(acts),
                     block_time_s=block_s)
