"""Choose the serving configuration: enumerate (tp, weight precision, weight tier, batch) with numpy, score them
with planner.inference.cost, pick one, and say why.

Preference before speed: quantization changes the outputs and streaming is slow, so a configuration of a
later class in PREFERENCE is chosen only when no earlier class fits (or a pin asks for it):
unquantized resident, int8 resident, fp8 resident, int4 resident, then streamed from host memory or NVMe
(unquantized first). fp8 (W8A8, only on GPUs with an fp8 peak) is chosen only when pinned (--precision fp8), not
by int8's rule: it stores the same byte a weight as int8 (its per-channel scales save only int8's group scales, 3 %
at groups of 128), so it rescues next to no configuration int8 cannot, while it rounds the activations too
(logits further from the model's than int8's); its gain is the fp8 GEMMs' speed, which the user asks for with the
pin. Its place in PREFERENCE (after int8) only orders a pinned fp8's tiers.
Within the first class that fits: target latency takes the smallest time per output token (then time to first
token); target throughput the most tokens/s, each configuration at its best batch when the batch is not given.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zplan.planner.inference.cost import (
    WEIGHT_PRECISIONS,
    WEIGHT_TIERS,
    InferenceCandidates,
    InferenceEstimate,
    InferenceModel,
    Workload,
    estimate,
)
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.inference import InferencePins

GiB = 1024**3
MAX_AUTO_BATCH = 256  # throughput without --batch: powers of two up to this
QUANTIZED = ("int8", "fp8", "int4")  # in preference order
AUTO_QUANTIZED = ("int8", "int4")  # what the search may choose unpinned (module docstring: fp8 only when pinned)
# (quantized precision or None for the compute dtype, tier), most preferred first.
PREFERENCE: tuple[tuple[str | None, str], ...] = (
    (None, "gpu"), ("int8", "gpu"), ("fp8", "gpu"), ("int4", "gpu"),
    (None, "cpu"), (None, "nvme"), ("int8", "cpu"), ("int8", "nvme"), ("fp8", "cpu"), ("fp8", "nvme"),
    ("int4", "cpu"), ("int4", "nvme"),
)


def quantized_for(cluster: ClusterSpec) -> tuple[str, ...]:
    """The quantized precisions the cluster's GPUs run: fp8 only with an fp8 peak (fp8 tensor cores)."""
    return tuple(p for p in QUANTIZED if p != "fp8" or cluster.gpu.peak_fp8_flops > 0)


@dataclass(frozen=True)
class SearchSpace:
    """The values each choice may take (pins leave one)."""

    tps: tuple[int, ...]
    precisions: tuple[str, ...]  # weight precisions
    tiers: tuple[str, ...]
    batches: tuple[int, ...]


@dataclass(frozen=True)
class Scored:
    cand: InferenceCandidates
    est: InferenceEstimate
    rank: np.ndarray  # index into PREFERENCE


def legal_tps(model: InferenceModel, gpus: int, cluster: ClusterSpec) -> list[int]:
    """Divisors of gpus inside one node that split the heads and the KV heads evenly."""
    return [t for t in range(1, min(gpus, cluster.gpus_per_node) + 1)
            if gpus % t == 0 and model.heads % t == 0 and model.kv_heads % t == 0]


def auto_batches() -> tuple[int, ...]:
    return tuple(2**i for i in range(int(np.log2(MAX_AUTO_BATCH)) + 1))


def enumerate_space(space: SearchSpace) -> InferenceCandidates:
    grid = np.meshgrid(np.array(space.tps), np.array([WEIGHT_PRECISIONS.index(p) for p in space.precisions]),
                       np.array([WEIGHT_TIERS.index(t) for t in space.tiers]), np.array(space.batches),
                       indexing="ij")
    tp, precision, tier, batch = (a.ravel().astype(np.int64) for a in grid)
    return InferenceCandidates(tp=tp, precision=precision, tier=tier, batch=batch)


def preference_rank(cand: InferenceCandidates) -> np.ndarray:
    names = np.array(WEIGHT_PRECISIONS)[cand.precision]
    tiers = np.array(WEIGHT_TIERS)[cand.tier]
    rank = np.full(len(cand), len(PREFERENCE), dtype=np.int64)
    for i, (precision, tier) in enumerate(PREFERENCE):
        wanted = ~np.isin(names, QUANTIZED) if precision is None else names == precision
        rank = np.where(wanted & (tiers == tier), np.minimum(rank, i), rank)
    return rank


def score(model: InferenceModel, cluster: ClusterSpec, work: Workload, space: SearchSpace) -> Scored:
    cand = enumerate_space(space)
    return Scored(cand=cand, est=estimate(model, cand, cluster, work), rank=preference_rank(cand))


def target_key(scored: Scored, target: str) -> np.ndarray:
    """Sort keys, smaller is better: (rank, metric, tie-break) as a lexsort-ready tuple of arrays."""
    est = scored.est
    if target == "latency":
        return np.stack([scored.rank, est.tpot_s, est.ttft_s, scored.cand.tp])
    return np.stack([scored.rank, -est.tokens_per_s, est.tpot_s, scored.cand.tp])


def ordered(scored: Scored, target: str, among: np.ndarray) -> np.ndarray:
    """Indices in `among`, best first."""
    keys = target_key(scored, target)[:, among]
    return among[np.lexsort(keys[::-1])]


def best_per_config(scored: Scored, target: str) -> np.ndarray:
    """One index per (tp, precision, tier): its best batch (the feasible one if any), best first: feasible
    configurations in preference and target order, then the rest by memory."""
    cand, fits = scored.cand, scored.est.fits
    config = cand.tp * 100 + cand.precision * 10 + cand.tier
    picks = []
    for key in np.unique(config):
        members = np.flatnonzero(config == key)
        feasible = members[fits[members]]
        picks.append(ordered(scored, target, feasible)[0] if len(feasible)
                     else members[np.argmin(scored.est.total[members])])
    picks = np.array(picks, dtype=np.int64)
    good = ordered(scored, target, picks[fits[picks]])
    bad = picks[~fits[picks]]
    return np.concatenate([good, bad[np.argsort(scored.est.total[bad], kind="stable")]])


def choose(scored: Scored, target: str) -> int | None:
    feasible = np.flatnonzero(scored.est.fits)
    return int(ordered(scored, target, feasible)[0]) if len(feasible) else None


TIER_TEXT = {"gpu": "on the GPU", "cpu": "streamed from host memory", "nvme": "streamed from NVMe"}


def describe(scored: Scored, i: int, with_batch: bool = False) -> str:
    """'tp=8 bf16 weights on the GPU' (', batch 64')."""
    cand = scored.cand
    text = f"tp={cand.tp[i]} {WEIGHT_PRECISIONS[cand.precision[i]]} weights {TIER_TEXT[WEIGHT_TIERS[cand.tier[i]]]}"
    return text + (f", batch {cand.batch[i]}" if with_batch else "")


def seconds_text(seconds: float) -> str:
    """3 significant digits in us, ms or s."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e6:.3g} us"


def metric_text(scored: Scored, i: int, target: str) -> str:
    est = scored.est
    if target == "latency":
        return f"{seconds_text(est.tpot_s[i])} per output token, {seconds_text(est.ttft_s[i])} to the first token"
    return f"{est.tokens_per_s[i]:,.0f} tokens/s"


def versus(scored: Scored, i: int, chosen: int, target: str) -> str:
    """How i compares with chosen on the target, e.g. '1.85x slower per output token'."""
    est = scored.est
    if target == "latency":
        ratio = est.tpot_s[i] / est.tpot_s[chosen]
        return f"{ratio:.3g}x slower per output token" if ratio >= 1 else f"{1 / ratio:.3g}x faster per output token"
    ratio = est.tokens_per_s[chosen] / max(est.tokens_per_s[i], 1e-30)
    return f"{ratio:.3g}x fewer tokens/s" if ratio >= 1 else f"{1 / ratio:.3g}x more tokens/s"


def note(scored: Scored, i: int, chosen: int, target: str, capacity: float) -> str:
    """Why alternative i lost or was refused, one sentence."""
    if i == chosen:
        return ""
    est, rank = scored.est, scored.rank
    if not est.fits[i]:
        if est.total[i] > capacity:
            return f"does not fit: {est.total[i] / GiB:.1f} GiB per GPU of {capacity / GiB:.1f} GiB."
        return "does not fit the host memory or NVMe of a node."
    if rank[i] > rank[chosen]:
        precision, tier = PREFERENCE[rank[i]]
        why = "quantizes the weights" if precision else "streams the weights"
        if precision and tier != "gpu":
            why = "quantizes and streams the weights"
        return f"{why} although {describe(scored, chosen)} fits ({versus(scored, i, chosen, target)})."
    return f"{versus(scored, i, chosen, target)}."


def reason(scored: Scored, chosen: int, target: str, order: np.ndarray, pins: InferencePins, batch_chosen: bool,
           gpus: int, capacity: float) -> str:
    """One to three sentences: the target, what the choice beat and by how much, why quantized or streamed."""
    est, cand, rank = scored.est, scored.cand, scored.rank
    precision, tier = WEIGHT_PRECISIONS[cand.precision[chosen]], WEIGHT_TIERS[cand.tier[chosen]]
    replicas = gpus // int(cand.tp[chosen])
    what = describe(scored, chosen) + (f" x {replicas} replicas" if replicas > 1 else "")
    if batch_chosen:
        what += f" at batch {cand.batch[chosen]} (the batch with the most tokens/s that fits)"
    rivals = [int(i) for i in order if i != chosen and est.fits[i] and rank[i] == rank[chosen]]
    text = f"Target {target}: {what} gives {metric_text(scored, chosen, target)}"
    if rivals:
        text += (f"; the next best, {describe(scored, rivals[0])}, is {versus(scored, rivals[0], chosen, target)} "
                 f"({metric_text(scored, rivals[0], target)})")
    elif pins.tp is not None:
        text += f" (tp={pins.tp} as pinned)"
    elif len(np.unique(cand.tp)) == 1:
        text += f" (tp={cand.tp[chosen]}: the only tensor-parallel degree for {gpus} GPU{'s' if gpus > 1 else ''})"
    else:
        text += f"; no other tensor-parallel degree fits with {precision} weights {TIER_TEXT[tier]}"
    return text + "." + why_quantized_or_streamed(scored, chosen, pins, capacity)


def why_quantized_or_streamed(scored: Scored, chosen: int, pins: InferencePins, capacity: float) -> str:
    """' Weights are quantized ... Weights stream ...': why the chosen weights are quantized and/or streamed (a
    pin, or the smallest more preferred configuration's memory); '' for unquantized weights on the GPU."""
    est, cand, rank = scored.est, scored.cand, scored.rank
    precision, tier = WEIGHT_PRECISIONS[cand.precision[chosen]], WEIGHT_TIERS[cand.tier[chosen]]
    text = ""
    preferred = np.flatnonzero(rank < rank[chosen])
    smallest = int(preferred[np.argmin(est.total[preferred])]) if len(preferred) else None
    closest = (f" (the smallest, {describe(scored, smallest)}, needs {est.total[smallest] / GiB:.1f} GiB per GPU "
               f"of {capacity / GiB:.1f} GiB)") if smallest is not None else ""
    if precision in QUANTIZED:
        tried = sorted({WEIGHT_PRECISIONS[p] for p in cand.precision[preferred]}, key=WEIGHT_PRECISIONS.index)
        text += (f" Weights are {precision} as pinned (--precision {precision}); quantization changes the outputs."
                 if pins.precision is not None else
                 f" Weights are quantized to {precision} because {' and '.join(tried) or 'nothing else'} weights do "
                 f"not fit on the GPUs{closest}; quantization changes the outputs slightly.")
    if tier != "gpu":
        source = "host memory" if tier == "cpu" else "NVMe"
        text += (f" Weights stream from {source} as pinned (--offload {tier})." if pins.offload is not None else
                 f" Weights stream from {source} layer by layer because no configuration fits on the GPUs"
                 f"{closest if precision not in QUANTIZED else ''}.")
    return text
