"""Estimate one layout as the user pinned it (`zplan estimate`; zplan.calibrate re-predicts runs through it): every
pin kept, what is not pinned at its fastest value that fits, and a layout that does not fit or does not fill its
pipeline priced as pinned with a warning."""

from __future__ import annotations

import numpy as np

from zplan.api import Request, prediction
from zplan.errors import SpecError, ZplanError
from zplan.planner.compression import compression_decision
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.step import StepEstimate, estimate_step
from zplan.planner.enumerate import explain_no_candidates, fills_pipeline
from zplan.planner.explain import parallel_config
from zplan.planner.infeasible import overflow, suggestions
from zplan.planner.search import Scored, fastest_fitting_s, refine, score
from zplan.planner.uncertainty import with_interval
from zplan.schemas import legality
from zplan.schemas.plan import ParallelConfig, Prediction
from zplan.schemas.spec import CompressionConfig, Pins


def estimate_config(req: Request, uniform_stages: bool = False) -> dict:
    """One fixed layout (tp, pp, [dp]), estimated as pinned: every pin is kept, and what is not pinned (micro-batch,
    recompute, ZeRO stage, ...) takes the fastest value that fits memory.

    A layout with fewer micro-batches than pipeline stages is priced (Megatron runs it, with a larger bubble) only where
    the pins leave no layout that fills the pipeline; it is marked `runtime_runs_it` False with a warning (zplan's
    runtime runs torch's Schedule1F1B, which refuses it; `zplan compile` never chooses it).
    When nothing fits memory, the estimate is of the closest layout to the pins: no offload unless --offload is
    pinned (where a layout without offload exists), and among what remains the least memory, so that an unpinned
    recompute, micro-batch, ZeRO stage, sequence parallel or interleave takes its least-memory value; it is marked
    infeasible, with `over_memory` (how far over, and the single changes that fit) and a warning.
    `warnings`: strings, empty when none. `uniform_stages`: the pipeline split Megatron-Core makes without a layout
    (planner.search.partition_for), where zplan's runtime balances the stages; the validation prices Megatron's
    published runs so."""
    scored = _score_as_pinned(req)
    cand, est = scored.candidates, scored.estimate
    if len(scored.order):
        best = int(scored.order[0])
    else:  # the closest configuration to the pins, marked infeasible
        best = _closest_as_pinned(cand, est, req.pins)
    one = cand.take(np.array([best]))
    refined = refine(req.summary, one, req.cluster, req.train, uniform_stages) if len(scored.order) else None
    final = refined.estimate if refined is not None else estimate_step(
        ModelNumbers.from_summary(req.summary), one, req.cluster, req.train.precision, req.train.global_batch)
    pred = prediction(final, req.cluster)
    cfg = parallel_config(one, 0, final.num_micro_batches[0], req.summary).model_copy(
        update={"compression": req.pins.compress or CompressionConfig()})
    pred = with_interval(pred, cfg, req.train.precision, req.summary, req.cluster)
    compression = (compression_decision(req.summary, req.cluster, req.train, refined, pred.step_time_s)
                   if refined is not None else None)
    feasible = pred.feasible and refined is not None
    over = None if feasible else over_memory(req, final.memory, pred.step_time_s)
    refused = legality.problems(legality.config(precision=req.train.precision, tp=cfg.tp))
    filled = bool(fills_pipeline(cfg.pp, cfg.num_micro_batches))
    warnings = [f"{problem}: a prediction only, zplan's runtime refuses it" for problem in refused]
    if not filled:
        warnings.append(unfilled_pipeline_warning(cfg, pred))
    if over is not None:
        why = (over["summary"] if over["over_bytes"] > 0 else
               "no split of the blocks over the pipeline stages keeps every stage within memory")
        warnings.append(f"does not fit in GPU memory: {why}; estimated as pinned (over_memory lists the single "
                        "changes that fit)")
    return {
        "model": req.summary.name, "cluster": req.cluster.name, "gpus": req.gpus,
        "global_batch": req.train.global_batch, "seq_len": req.train.seq_len, "precision": req.train.precision,
        "config": cfg.model_dump(), "feasible": feasible,
        "step_time_s": pred.step_time_s, "tokens_per_s": pred.tokens_per_s, "mfu": pred.mfu,
        # 80 % intervals, [low, high] (planner/uncertainty.py)
        "step_time_s_interval": list(pred.interval.step_time_s),
        "tokens_per_s_interval": list(pred.interval.tokens_per_s), "interval": pred.interval.model_dump(),
        "memory_per_gpu_bytes": pred.memory.total, "memory_breakdown": pred.memory.model_dump(),
        "time_breakdown": pred.time.model_dump(), "candidates_evaluated": len(cand),
        "compression": compression.model_dump() if compression is not None else None,
        "runtime_runs_it": not refused and filled,
        "over_memory": over,
        "warnings": warnings,
    }


def _score_as_pinned(req: Request) -> Scored:
    """planner.search.score of the request; where the pins leave no layout that fills the pipeline, the layouts
    with fewer micro-batches than stages instead (fill_pipeline False). SpecError naming the rule or pin when neither
    leaves any."""
    scored = score(req.summary, req.cluster, req.gpus, req.train, req.pins)
    if len(scored.candidates):
        return scored
    scored = score(req.summary, req.cluster, req.gpus, req.train, req.pins, fill_pipeline=False)
    if len(scored.candidates) == 0:
        raise SpecError(explain_no_candidates(req.summary, req.cluster, req.gpus, req.train.global_batch, req.pins,
                                              fill_pipeline=False))
    return scored


def _closest_as_pinned(cand: Candidates, est: StepEstimate, pins: Pins) -> int:
    """The candidate an infeasible estimate reports: offload none unless --offload is pinned (where any candidate
    has none), then the least memory per GPU. The other pins hold already (planner.enumerate)."""
    keep = np.ones(len(cand), dtype=bool)
    if pins.offload is None and (cand.offload == 0).any():
        keep = cand.offload == 0
    kept = np.nonzero(keep)[0]
    return int(kept[np.argmin(est.memory.total[kept])])


def unfilled_pipeline_warning(cfg: ParallelConfig, pred: Prediction) -> str:
    """The warning of a layout with fewer micro-batches (m) than pipeline stages (p): its bubble, (p - 1) stage
    times against m (Narayanan et al. SC'21 Sec. 2.2: the step takes m + p - 1 stage times), and the global batch
    that fills the pipeline."""
    m, p = int(cfg.num_micro_batches), cfg.pp
    share = pred.time.pipeline_bubble / pred.step_time_s
    return (f"{m} micro-batch{'es' if m != 1 else ''} on {p} pipeline stages: fewer micro-batches than stages, priced "
            f"as Megatron runs it (the step takes m + p - 1 = {m + p - 1} stage times; the bubble is {share:.0%} of "
            f"the step); zplan's runtime does not run it (torch's Schedule1F1B needs at least {p} micro-batches) and "
            f"`zplan compile` never chooses it: a global batch of {cfg.dp * cfg.micro_batch * p} or more fills the "
            "pipeline")


def over_memory(req: Request, memory, step_s: float) -> dict:
    """For an estimate that does not fit (`step_s`: its step time): how far over the GPU it is, its terms
    largest first (schemas.plan.MEMORY_TERMS), and the single changes to the pins that fit, each with its predicted
    step time and what it adds, the fastest first (planner.infeasible)."""
    def fits(gpus: int, pins: Pins) -> float | None:
        try:
            return fastest_fitting_s(score(req.summary, req.cluster, gpus, req.train, pins))
        except ZplanError:  # a change the legality table or the pins rule out
            return None

    terms = sorted(((float(v[0]), name) for name, v in memory.terms.items()), reverse=True)
    return {"over_bytes": float(memory.total[0] - req.cluster.gpu.hbm_bytes),
            "summary": overflow(memory, 0, req.cluster.gpu.hbm_bytes),
            "terms": {name: value for value, name in terms},
            "fixes": suggestions(fits, req.cluster, req.gpus, req.pins, step_s)}


__all__ = ["estimate_config"]
