"""Pick the plan: score every legal candidate with the cost model, keep those that fit, refine the
best few with the exact pipeline-stage partition (a dynamic program; CP-SAT checks it where memory binds), and
take the fastest.

Ranking: fastest predicted step first; ties go to less memory, then to the smaller (tp, pp, zero,
recompute, offload), so the output is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from zplan.errors import SpecError
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.step import StepEstimate, estimate_step
from zplan.planner.cost.units import UnitCosts, unit_costs
from zplan.planner.enumerate import enumerate_candidates, explain_no_candidates
from zplan.planner.infeasible import raise_infeasible
from zplan.planner.partition import PartitionResult, partition_layers, uniform_partition
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.model import ModelSummary
from zplan.schemas.spec import Pins, TrainSpec

REFINE_TOP_K = 10  # candidates re-scored with the exact stage partition


@dataclass(frozen=True)
class Scored:
    """Every legal candidate with its estimate, plus the ranking."""

    candidates: Candidates
    estimate: StepEstimate
    order: np.ndarray  # indices of feasible candidates, best first


@dataclass(frozen=True)
class Choice:
    """One candidate after refinement with its exact stage partition."""

    candidate: Candidates  # length 1
    estimate: StepEstimate  # length 1
    partition: PartitionResult


def score(
    summary: ModelSummary, cluster: ClusterSpec, gpus: int, train: TrainSpec, pins: Pins, fill_pipeline: bool = True
) -> Scored:
    """Every legal candidate (planner.enumerate; `fill_pipeline` as enumerate_candidates'), estimated, and the
    feasible ones ranked."""
    cand = enumerate_candidates(summary, cluster, gpus, train.global_batch, pins, fill_pipeline)
    est = estimate_step(ModelNumbers.from_summary(summary), cand, cluster, train.precision, train.global_batch)
    feasible = np.nonzero(est.memory.fits)[0]
    keys = (cand.offload[feasible], cand.recompute[feasible], cand.zero[feasible], cand.pp[feasible],
            cand.tp[feasible], est.memory.total[feasible], est.step_time_s[feasible])
    return Scored(candidates=cand, estimate=est, order=feasible[np.lexsort(keys)])


def partition_for(summary: ModelSummary, cand: Candidates, cluster: ClusterSpec, units: UnitCosts,
                  est: StepEstimate, uniform: bool = False) -> PartitionResult:
    """Exact stage boundaries for one candidate; interleaved schedules keep Megatron's uniform chunks
    (their memory was checked by the estimate, which counts the interleaved in-flight factor), and so does every
    pipeline where `uniform` (Megatron-Core's split without a layout: the blocks shared evenly, the embedding on the
    first stage, the head on the last; the validation prices published Megatron runs so)."""
    pp, v = int(cand.pp[0]), int(cand.interleave[0])
    capacity = cluster.gpu.hbm_bytes - float(est.memory.reserve[0]) - float(est.memory.comm_buffers[0])
    if v > 1 or (uniform and pp > 1):
        return interleaved_partition(summary, units.time_s, pp * v)
    inflight = np.minimum(np.arange(pp, 0, -1), est.num_micro_batches[0]).astype(float)
    part = partition_layers(units.time_s, units.static_bytes, units.act_bytes, pp, capacity, inflight)
    if pp == 1:  # one stage, one split: the memory model prices it whole (with what is not live at the peak)
        fits = bool(est.memory.fits[0])
        return replace(part, feasible=fits, min_feasible_capacity_bytes=None if fits else float(est.memory.total[0]))
    return part


def interleaved_partition(summary: ModelSummary, unit_time_s: np.ndarray, chunks: int) -> PartitionResult:
    """Megatron-Core's layout of `chunks` = pp x interleave pieces (no pipeline_model_parallel_layout). When the
    blocks divide by the chunks: an equal share each, the units before the blocks joining the first chunk and
    those after them the last. Otherwise the embedding and the head count as one block each (Megatron-Core's
    account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split): the L + 2 positions are split
    as evenly as they go, so the first chunk gives up a block for the embedding (or holds only it) and the last one
    for the head."""
    kinds = [u.kind for u in summary.layers]
    first = kinds.index("block")
    last = len(kinds) - 1 - kinds[::-1].index("block")
    blocks = last - first + 1
    if blocks % chunks == 0:
        bounds = [(first + a, first + b) for a, b in uniform_partition(blocks, chunks)]
        bounds[0], bounds[-1] = (0, bounds[0][1]), (bounds[-1][0], len(kinds) - 1)
    else:  # positions: the units before the blocks (one), each block, the units after them (one)
        positions = ([(0, first - 1)] if first else []) + [(u, u) for u in range(first, last + 1)] + (
            [(last + 1, len(kinds) - 1)] if last < len(kinds) - 1 else [])
        bounds = [(positions[a][0], positions[b][1]) for a, b in uniform_partition(len(positions), chunks)]
    costs = [float(unit_time_s[a:b + 1].sum()) for a, b in bounds]
    return PartitionResult(boundaries=bounds, stage_cost_s=costs, stage_bytes=[], max_cost_s=max(costs),
                           optimal=False, feasible=True, solver="uniform-interleaved")


def refine(summary: ModelSummary, cand: Candidates, cluster: ClusterSpec, train: TrainSpec,
           uniform_stages: bool = False) -> Choice | None:
    """Re-estimate one candidate with its exact partition (Megatron's uniform one where `uniform_stages`:
    partition_for); None when no partition fits memory."""
    model = ModelNumbers.from_summary(summary)
    est = estimate_step(model, cand, cluster, train.precision, train.global_batch)
    units = unit_costs(summary, cand, cluster, train.precision)
    part = partition_for(summary, cand, cluster, units, est, uniform_stages)
    if not part.feasible:
        return None
    v = int(cand.interleave[0])
    stage_blocks = np.array([part.max_cost_s * v / units.block_time_s])
    end_blocks = None
    if v == 1 and len(part.boundaries) > 1:  # the first and last stages' blocks, for their memory
        kinds = [unit.kind for unit in summary.layers]
        end_blocks = tuple(np.array([float(kinds[a:b + 1].count("block"))])
                           for a, b in (part.boundaries[0], part.boundaries[-1]))
    exact = estimate_step(model, cand, cluster, train.precision, train.global_batch, stage_blocks=stage_blocks,
                          end_stage_blocks=end_blocks)
    return Choice(candidate=cand, estimate=exact, partition=part)


def fastest_fitting_s(scored: Scored) -> float | None:
    """The quick estimate's step time of the fastest candidate that fits memory, None when none does."""
    return float(scored.estimate.step_time_s[scored.order[0]]) if len(scored.order) else None


def choose(summary: ModelSummary, cluster: ClusterSpec, gpus: int, train: TrainSpec, pins: Pins,
           scored: Scored) -> tuple[Choice, dict[int, Choice | None]]:
    """The fastest of the top candidates after refinement, and every refinement made (candidate index ->
    Choice, or None where no stage partition fits memory); raises InfeasibleError when none fits."""
    if len(scored.candidates) == 0:
        raise SpecError(explain_no_candidates(summary, cluster, gpus, train.global_batch, pins))
    refined: dict[int, Choice | None] = {}
    for index in scored.order[: REFINE_TOP_K * 4]:
        refined[int(index)] = refine(summary, scored.candidates.take(np.array([index])), cluster, train)
        if sum(c is not None for c in refined.values()) == REFINE_TOP_K:
            break
    choices = [c for c in refined.values() if c is not None]
    if not choices:
        raise_infeasible(summary, cluster, gpus, pins, scored,
                         fits=lambda n, changed: fastest_fitting_s(score(summary, cluster, n, train, changed)))
    return min(choices, key=lambda c: float(c.estimate.step_time_s[0])), refined
