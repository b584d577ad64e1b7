"""All legal configurations as numpy arrays (DESIGN.md decision 3: enumerate, then prune).

Legality: dp * tp * pp = gpus; heads and kv_heads divisible by tp; at least one block per pipeline
chunk (pp * v <= blocks) and, when interleaved, blocks divisible by pp * v and micro-batches by pp
(Megatron's interleaved schedule); a pipeline runs at least pp micro-batches (1F1B's warm-up fills every stage);
tp > 1, sequence parallel and pp > 1 only where the runtime runs them on this model (schemas.capability, from
the traits the tracer found); the global batch divisible by dp * micro_batch; sequence parallel
only with tp > 1; offload only with ZeRO >= 1 (each rank steps its own shard), NVMe only with ZeRO-3
(ZeRO-Infinity) and only where the cluster has it; user pins fix a value; a --compress pin keeps the
configurations that support it (planner.compression.supported_mask) and sets every candidate's compression.
What the runtime cannot run yet (runtime.plan_check.runtime_gaps: NVMe offload; CPU offload with ZeRO 0,
which the legality above already excludes) is chosen only when the user's pins ask for it (--offload nvme),
so that an unpinned compile emits a plan its train.py runs; `zplan compile` warns when a pin does. CPU
offload runs with ZeRO 1 (runtime.offload.cpu_adam_optimizer) and ZeRO 2/3 (FSDP2's CPUOffloadPolicy).
"""

from __future__ import annotations

import numpy as np

from zplan.planner.compression import supported_mask
from zplan.planner.cost.inputs import OFFLOAD_TIERS, RECOMPUTE_MODES, Candidates
from zplan.schemas.capability import allows, sequence_parallel_fits
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.model import ModelSummary
from zplan.schemas.spec import CompressionConfig, Pins

INTERLEAVE_CHOICES = (1, 2, 3, 4)
MAX_MICRO_BATCH = 64


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pinned(values: list[int], pin: int | None) -> list[int]:
    return values if pin is None else [pin]


def enumerate_candidates(
    model: ModelSummary, cluster: ClusterSpec, gpus: int, global_batch: int, pins: Pins
) -> Candidates:
    """Every legal configuration that respects the pins (may be empty)."""
    # what the runtime can run on this model (schemas.capability; a pin it rules out failed in zplan.api)
    can_split = allows(model.traits, "tensor_parallel")
    tps = [t for t in divisors(gpus) if model.heads % t == 0 and model.kv_heads % t == 0 and (t == 1 or can_split)]
    tps = _pinned(tps, pins.tp)
    can_pipeline = allows(model.traits, "pipeline")
    pps = _pinned([p for p in divisors(gpus) if p <= model.num_blocks and (p == 1 or can_pipeline)], pins.pp)
    layouts = [(t, p, gpus // (t * p)) for t in tps for p in pps if gpus % (t * p) == 0]
    if pins.dp is not None:
        layouts = [lay for lay in layouts if lay[2] == pins.dp]
    micro = _pinned([b for b in divisors(global_batch) if b <= MAX_MICRO_BATCH], pins.micro_batch)
    zeros = _pinned([0, 1, 2, 3], pins.zero)
    recompute = _pinned([0, 1, 2], None if pins.recompute is None else RECOMPUTE_MODES.index(pins.recompute))
    sps = ([0, 1] if allows(model.traits, "sequence_parallel") else [0]) if pins.sequence_parallel is None \
        else [int(pins.sequence_parallel)]
    inter = _pinned(list(INTERLEAVE_CHOICES), pins.interleave)
    tiers = [0, 1, 2] if pins.offload is None else [OFFLOAD_TIERS.index(pins.offload)]
    if cluster.nvme_bytes == 0:
        tiers = [x for x in tiers if x != 2]

    if not layouts or not micro or not tiers:
        return Candidates.single(tp=1, pp=1, dp=1, micro_batch=1, zero=0, recompute=0, sp=0,
                                 interleave=1, offload=0).take(np.array([], dtype=np.int64))
    layout = np.array(layouts, dtype=np.int64)  # (n_layouts, 3)
    axes = [np.arange(len(layouts)), micro, zeros, recompute, sps, inter, tiers]
    grid = [g.ravel() for g in np.meshgrid(*[np.asarray(a, dtype=np.int64) for a in axes], indexing="ij")]
    t, p, d = (layout[grid[0], i] for i in range(3))
    b, z, r, sp, v, off = grid[1:]
    per_replica = global_batch // d
    legal = (
        (global_batch % (d * b) == 0)
        & ((sp == 0) | ((t > 1) & sequence_parallel_fits(model.block_tokens, t)))
        & ((off == 0) | (z >= 1))
        & ((off < 2) | (z == 3))  # NVMe optimizer swapping is ZeRO-3's (ZeRO-Infinity)
        & ((v == 1) | (p > 1))
        & ((p == 1) | (per_replica // np.maximum(b, 1) >= p))  # 1F1B runs at least one micro-batch per stage
        & (p * v <= model.num_blocks)
        & ((v == 1) | ((model.num_blocks % (p * v) == 0) & ((per_replica // np.maximum(b, 1)) % p == 0)))
    )
    pinned_gap = pins.offload == "nvme"
    legal &= (off < 2) | pinned_gap  # what the runtime runs (see above): CPU offload with ZeRO >= 1
    compression = pins.compress or CompressionConfig()
    legal &= supported_mask(compression, t, p, z, off)
    idx = np.nonzero(legal)[0]
    return Candidates(tp=t[idx], pp=p[idx], dp=d[idx], micro_batch=b[idx], zero=z[idx], recompute=r[idx],
                      sp=sp[idx], interleave=v[idx], offload=off[idx]).with_compression(
                          compression.grad, compression.weights, compression.activations)
