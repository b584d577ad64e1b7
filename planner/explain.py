"""What the report and `zplan explain` show besides the chosen plan (alternatives.json, schemas.alternatives): the
best alternatives, the time-versus-memory Pareto front, and why each family of configurations lost."""

from __future__ import annotations

import numpy as np

from zplan.planner.cost.inputs import OFFLOAD_TIERS, RECOMPUTE_MODES, Candidates
from zplan.planner.cost.step import StepEstimate
from zplan.planner.search import Choice, Scored, refine
from zplan.schemas.alternatives import Candidate, RejectedFamily
from zplan.schemas.capability import vocab_parallel
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.model import ModelSummary
from zplan.schemas.plan import ParallelConfig
from zplan.schemas.spec import TrainSpec

TOP_ALTERNATIVES = 10
MAX_PARETO_POINTS = 30
MAX_BACKGROUND_POINTS = 60
FAMILY_REFINE = 3  # members per family re-scored with the exact partition
GiB = 1024**3


def parallel_config(cand: Candidates, i: int, num_micro_batches: float, summary: ModelSummary) -> ParallelConfig:
    """Candidate i as plan.json's parallel section (`summary`: whether its vocabulary splits over tp)."""
    pp, v = int(cand.pp[i]), int(cand.interleave[i])
    schedule = "none" if pp == 1 else ("interleaved-1f1b" if v > 1 else "1f1b")
    return ParallelConfig(
        tp=int(cand.tp[i]), pp=pp, dp=int(cand.dp[i]), cp=int(cand.cp[i]), ep=int(cand.ep[i]),
        micro_batch=int(cand.micro_batch[i]),
        num_micro_batches=int(round(num_micro_batches)), zero_stage=int(cand.zero[i]),
        recompute=RECOMPUTE_MODES[int(cand.recompute[i])], sequence_parallel=bool(cand.sp[i]),
        vocab_parallel=bool(vocab_parallel(summary.traits, int(cand.tp[i]), summary.vocab, int(cand.cp[i]))),
        interleave=v,
        schedule=schedule, offload=OFFLOAD_TIERS[int(cand.offload[i])],
    )


def _candidate(scored: Scored, i: int, refined: dict[int, Choice | None], summary: ModelSummary) -> Candidate:
    """Quick-estimate numbers, or the exact-partition ones where the search refined the candidate (a
    refinement that found no partition fitting memory marks it infeasible)."""
    est, j, feasible = scored.estimate, i, bool(scored.estimate.memory.fits[i])
    if i in refined:
        feasible = refined[i] is not None
        if feasible:
            est, j = refined[i].estimate, 0
    return Candidate(
        parallel=parallel_config(scored.candidates, i, est.num_micro_batches[j], summary),
        step_time_s=float(est.step_time_s[j]), memory_per_gpu_bytes=float(est.memory.total[j]),
        feasible=feasible,
    )


def pareto_front(time_s: np.ndarray, memory: np.ndarray) -> np.ndarray:
    """Indices not beaten on both time and memory, by increasing memory."""
    order = np.lexsort((time_s, memory))
    best_time = np.minimum.accumulate(time_s[order])
    keep = np.concatenate([[True], best_time[1:] < best_time[:-1]])
    return order[keep]


def alternatives(scored: Scored, refined: dict[int, Choice | None], choice: Choice, summary: ModelSummary,
                 cluster: ClusterSpec, train: TrainSpec) -> list[Candidate]:
    """Top feasible candidates, the Pareto front, and an even sample of the rest (for the scatter).
    Any whose quick estimate beats the chosen plan is refined first, so the lists never show a faster
    configuration that the exact stage partition would not confirm."""
    est = scored.estimate
    top = list(scored.order[:TOP_ALTERNATIVES])
    feasible = scored.order
    front = feasible[pareto_front(est.step_time_s[feasible], est.memory.total[feasible])] if len(feasible) else []
    front = list(front[:MAX_PARETO_POINTS])
    n = len(scored.candidates)
    background = list(np.linspace(0, n - 1, num=min(n, MAX_BACKGROUND_POINTS)).astype(int)) if n else []
    chosen_s = float(choice.estimate.step_time_s[0])
    seen, picked = set(), []
    for i in map(int, top + front + background):
        if i in seen:
            continue
        seen.add(i)
        if i not in refined and est.memory.fits[i] and est.step_time_s[i] <= chosen_s:
            refined[i] = refine(summary, scored.candidates.take(np.array([i])), cluster, train)
        picked.append(_candidate(scored, i, refined, summary))
    return picked


def _families(cand: Candidates, cluster: ClusterSpec) -> dict[str, np.ndarray]:
    return {
        "no pipeline (pp=1)": cand.pp == 1,
        "no tensor parallelism (tp=1)": cand.tp == 1,
        "tensor parallelism across nodes": cand.tp > cluster.link_domain(),
        "deep pipelines (pp >= 8)": cand.pp >= 8,
        "interleaved 1F1B (v > 1)": cand.interleave > 1,
        "ZeRO-0 (replicated optimizer)": cand.zero == 0,
        "ZeRO-3 (sharded parameters)": cand.zero == 3,
        "no activation recompute": cand.recompute == 0,
        "full activation recompute": cand.recompute == 2,
        "sequence parallelism": cand.sp == 1,
        "offload to CPU": cand.offload == 1,
        "offload to NVMe": cand.offload == 2,
    }


def _parts(est: StepEstimate, i: int) -> dict[str, float]:
    return {
        "compute": float(est.compute_s[i]),
        "communication": float(est.tensor_parallel_s[i] + est.context_parallel_s[i] + est.expert_parallel_s[i]
                               + est.data_parallel_s[i] + est.offload_s[i] + est.optimizer_s[i]),
        "bubble": float(est.pipeline_bubble_s[i] + est.pipeline_p2p_s[i]),
    }


def _best_refined(summary, cluster, train, cand, est, members: np.ndarray):
    """The fastest member after the exact stage partition, trying the few best by the quick estimate."""
    ranked = members[np.argsort(est.step_time_s[members], kind="stable")][:FAMILY_REFINE]
    refined = [(int(i), refine(summary, cand.take(np.array([i])), cluster, train)) for i in ranked]
    refined = [(i, r) for i, r in refined if r is not None]
    return min(refined, key=lambda ir: float(ir[1].estimate.step_time_s[0])) if refined else None


def rejected_families(scored: Scored, choice: Choice, summary: ModelSummary, cluster: ClusterSpec,
                      train: TrainSpec) -> list[RejectedFamily]:
    cand, est = scored.candidates, scored.estimate
    chosen_parts = _parts(choice.estimate, 0)
    chosen_time = float(choice.estimate.step_time_s[0])
    out = []
    for name, member in _families(cand, cluster).items():
        if not member.any() or bool(member[_index_of(cand, choice.candidate)]):
            continue
        fits = member & est.memory.fits
        if not fits.any():
            least = float(est.memory.total[member].min())
            out.append(RejectedFamily(family=name, reason="memory", detail=(
                f"its smallest member needs {least / GiB:.1f} GiB per GPU, over the "
                f"{cluster.gpu.hbm_bytes / GiB:.1f} GiB available.")))
            continue
        best = _best_refined(summary, cluster, train, cand, est, np.flatnonzero(fits))
        if best is None:
            continue
        index, refined = best
        parts = _parts(refined.estimate, 0)
        worse = {k: parts[k] - chosen_parts[k] for k in parts}
        reason = max(worse, key=worse.get)
        t = float(refined.estimate.step_time_s[0])
        out.append(RejectedFamily(family=name, reason=reason, detail=(
            f"best member {_short(cand, index)} takes {t:.3f} s/step ({(t / chosen_time - 1) * 100:+.1f}%), "
            f"mostly {worse[reason]:+.3f} s of {reason}.")))
    return out


def _short(cand: Candidates, i: int) -> str:
    cp = f"/cp{cand.cp[i]}" if cand.cp[i] > 1 else ""
    return (f"tp{cand.tp[i]}/pp{cand.pp[i]}/dp{cand.dp[i]}{cp} mb{cand.micro_batch[i]} ZeRO-{cand.zero[i]} "
            f"{RECOMPUTE_MODES[cand.recompute[i]]}")


def _index_of(cand: Candidates, one: Candidates) -> int:
    match = np.ones(len(cand), dtype=bool)
    for field in ("tp", "pp", "dp", "cp", "micro_batch", "zero", "recompute", "sp", "interleave", "offload"):
        match &= getattr(cand, field) == getattr(one, field)[0]
    return int(np.flatnonzero(match)[0])
