"""All legal configurations as numpy arrays (docs/design.md decision 3: enumerate, then prune).

Legality (the rules of ``_grid``, each named with the pins it constrains): which combinations of ZeRO stage, offload
tier, compression, context parallel, pipeline, interleave and sequence parallel run is schemas.legality's table,
evaluated here on the candidate arrays (offload only with ZeRO >= 1, a --compress pin only where it runs, context
parallel without offload or compression...); what the runtime runs on this model is schemas.capability's (tp > 1,
sequence parallel, pp > 1, cp > 1 from the traits the tracer found). The sizes are this module's: dp * tp * pp * cp =
gpus; cp > 1 where 2 cp divides the sequence, and unpinned only where a GPU keeps CP_MIN_TOKENS_PER_GPU tokens of a
sequence; heads and kv_heads divisible by tp (a pinned tp too); at least one block per pipeline stage (pp <= blocks)
and, when interleaved, one block, the embedding or the head per chunk (pp * v <= blocks + 2; Megatron-Core's split
that counts the embedding and the head as a block each where the blocks do not divide) and micro-batches divisible
by pp; a pipeline runs at least pp micro-batches (zplan's runtime runs torch's Schedule1F1B, which refuses fewer:
``fills_pipeline``; `zplan estimate` lifts this rule alone, ``fill_pipeline=False``, to price a layout Megatron runs
with a larger bubble); the global batch divisible by dp * micro_batch; sequence parallel where tp divides the tokens
a block sees; NVMe only where the cluster has it.
User pins fix a value; a --compress pin sets every candidate's compression. Every tier the runtime runs is searched
unpinned too: the cost model prices an NVMe candidate (planner.cost.offload), so it is chosen only when it is the
best plan. Where the model states live (parameters on NVMe with ZeRO 3 only...) is the placement's choice, not the
enumeration's (planner.placement).

When the pins leave nothing, ``explain_no_candidates`` says why: the rule that alone rules out every remaining
configuration, naming the pins it constrains, or else which single pin to drop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zplan.planner.cost.inputs import OFFLOAD_TIERS, RECOMPUTE_MODES, Candidates
from zplan.schemas import legality
from zplan.schemas.capability import allows, sequence_parallel_fits
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.model import ModelSummary
from zplan.schemas.spec import CompressionConfig, Pins

INTERLEAVE_CHOICES = (1, 2, 3, 4)
MAX_MICRO_BATCH = 64
# Unpinned, context parallel is searched only where each GPU keeps at least this many tokens of a sequence: below it a
# sequence's attention is a small share of the block and splitting it only adds K/V gathers (a pin overrides it).
CP_MIN_TOKENS_PER_GPU = 4096
# The Pins field that fixes each field of schemas.legality the candidates have.
PIN_OF_FIELD = {field: "compress" for field in legality.COMPRESSION_FIELDS}


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending: each pair (d, n // d) found by trying d up to sqrt(n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _pinned(values: list[int], pin: int | None) -> list[int]:
    return values if pin is None else [pin]


def fills_pipeline(pp, micro_batches):
    """Whether a step's micro-batches fill every pipeline stage (pp == 1 or micro_batches >= pp): what zplan's runtime
    runs (torch.distributed.pipelining's Schedule1F1B raises ValueError below it, and runtime.parallel.pipeline's
    build_pipeline refuses it first). On numbers and numpy arrays alike."""
    return (pp == 1) | (micro_batches >= pp)


@dataclass(frozen=True)
class Rule:
    """One legality rule over the candidate grid: what it says, the Pins fields it constrains, where it holds."""

    text: str
    fields: tuple[str, ...]
    mask: np.ndarray
    name: str = ""  # the schemas.legality rule it is, if one


@dataclass(frozen=True)
class _Grid:
    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    cp: np.ndarray
    ep: np.ndarray
    micro_batch: np.ndarray
    zero: np.ndarray
    recompute: np.ndarray
    sp: np.ndarray
    interleave: np.ndarray
    offload: np.ndarray
    rules: list[Rule]


def _grid(model: ModelSummary, cluster: ClusterSpec, gpus: int, global_batch: int, pins: Pins,
          fill_pipeline: bool = True) -> _Grid | None:
    """Every combination of the axes' values and the rules over it; None when an axis has no value.
    `fill_pipeline` False drops the rule that a pipeline gets at least pp micro-batches (`zplan estimate`).

    Unpinned axes hold only the values their own rules allow (fewer combinations); a pinned value is kept
    as given, and the rules over the grid say whether it is legal (so that a conflict can be explained)."""
    # what the runtime can run on this model (schemas.capability; a pin it rules out failed in zplan.api)
    can_split = allows(model.traits, "tensor_parallel")
    # the FFN's features, and the groups of each fused projection (a rank holds whole groups: runtime/fused_layout)
    features = math.gcd(model.ffn_hidden, *(rule.groups for rule in model.tp_rules if rule.parts))
    tps = _pinned([t for t in divisors(gpus) if model.heads % t == 0 and model.kv_heads % t == 0
                   and features % t == 0 and (t == 1 or can_split)], pins.tp)
    can_pipeline = allows(model.traits, "pipeline")
    pps = _pinned([p for p in divisors(gpus) if p <= model.num_blocks and (p == 1 or can_pipeline)], pins.pp)
    seq = model.seq_len
    can_split_context = allows(model.traits, "context_parallel")
    cps = _pinned([c for c in divisors(gpus) if c == 1 or (can_split_context and seq % (2 * c) == 0
                                                           and seq // c >= CP_MIN_TOKENS_PER_GPU)], pins.cp)
    layouts = [(t, p, c, gpus // (t * p * c)) for t in tps for p in pps for c in cps if gpus % (t * p * c) == 0]
    micro = _pinned([b for b in divisors(global_batch) if b <= MAX_MICRO_BATCH], pins.micro_batch)
    zeros = _pinned([0, 1, 2, 3], pins.zero)
    recompute = _pinned([0, 1, 2], None if pins.recompute is None else RECOMPUTE_MODES.index(pins.recompute))
    sps = ([0, 1] if allows(model.traits, "sequence_parallel") else [0]) if pins.sequence_parallel is None \
        else [int(pins.sequence_parallel)]
    inter = _pinned(list(INTERLEAVE_CHOICES), pins.interleave)
    tiers = [0, 1, 2] if pins.offload is None else [OFFLOAD_TIERS.index(pins.offload)]
    # expert parallel: unpinned, the divisors of the experts whose group stays inside the NVLink domain
    num_experts = model.experts.num_experts if model.experts else 1
    eps = _pinned([e for e in divisors(num_experts) if e == 1 or (e <= cluster.link_domain()
                                                                   and allows(model.traits, "expert_parallel"))],
                  pins.ep)
    if cluster.nvme_bytes == 0 and pins.offload is None:
        tiers = [x for x in tiers if x != 2]
    if not layouts:
        return None
    layout = np.array(layouts, dtype=np.int64)  # (n_layouts, 4): tp, pp, cp, dp
    axes = [np.arange(len(layouts)), micro, zeros, recompute, sps, inter, tiers, eps]
    grid = [g.ravel() for g in np.meshgrid(*[np.asarray(a, dtype=np.int64) for a in axes], indexing="ij")]
    t, p, c, d = (layout[grid[0], i] for i in range(4))
    b, z, r, sp, v, off, e = grid[1:]
    per_replica = global_batch // d
    micro_batches = per_replica // np.maximum(b, 1)
    blocks = model.num_blocks
    compression = pins.compress or CompressionConfig()
    rules = [
        Rule(f"tp divides the {model.heads} attention heads and {model.kv_heads} KV heads", ("tp",),
             (model.heads % t == 0) & (model.kv_heads % t == 0)),
        Rule(f"tp divides {features} (the FFN's features and every fused projection's groups)", ("tp",),
             features % t == 0),
        Rule(f"dp * tp * pp * cp = {gpus} GPUs, with tp from {tps}, pp from {pps} and cp from {cps} (what divides "
             f"the heads, at most the {blocks} blocks, splits the {seq} tokens and runs on this model)",
             ("dp", "tp", "pp", "cp"), d == pins.dp if pins.dp is not None else d > 0),
        Rule(f"context parallel splits each sequence in 2 cp chunks (2 cp divides the {seq} tokens) and runs on this "
             "model (schemas.capability)", ("cp",),
             (c == 1) | ((seq % (2 * c) == 0) & can_split_context)),
        Rule(f"the global batch {global_batch} divides by dp * micro-batch", ("micro_batch", "dp", "tp", "pp"),
             global_batch % (d * b) == 0),
        Rule(f"sequence parallel needs a tp that divides the {model.block_tokens} tokens a block sees (/ cp)",
             ("sequence_parallel", "tp", "cp"), (sp == 0) | sequence_parallel_fits(model.block_tokens, t * c)),
        Rule(f"NVMe offload needs a cluster with NVMe, and {cluster.name} has none", ("offload",),
             (off < 2) | (cluster.nvme_bytes > 0)),
        Rule(f"pp <= the {blocks} blocks, and pp * interleave <= the blocks + 2 when interleaved (the embedding "
             "and the head count as a block each where the blocks do not divide: planner.search."
             "interleaved_partition)", ("pp", "interleave"),
             (p <= blocks) & ((v == 1) | (p * v <= blocks + 2))),
        *([Rule(f"a pipeline gets at least pp micro-batches: the global batch {global_batch} >= dp * micro-batch * "
                "pp (zplan's runtime runs torch's 1F1B, which needs every stage filled)",
                ("pp", "micro_batch", "dp", "tp"), fills_pipeline(p, micro_batches))] if fill_pipeline else []),
        Rule("an interleaved schedule needs the micro-batches per step to divide by pp",
             ("interleave", "pp", "micro_batch", "dp", "tp"), (v == 1) | (micro_batches % p == 0)),
        Rule(f"ep divides the {num_experts} routed experts of each MoE block and dp (expert parallel is carved out of "
             "the data-parallel ranks)" if model.experts else "ep > 1 needs a mixture of experts, and the model has "
             "no routed experts", ("ep", "dp", "tp", "pp"), (e == 1) | ((num_experts % e == 0) & (d % e == 0))),
        Rule(f"unpinned, expert parallel is searched with its ep * tp * cp ranks inside the "
             f"{cluster.link_domain()}-GPU NVLink domain (pin --ep to price any other)", ("ep", "tp", "cp"),
             (e == 1) | (pins.ep is not None) | (e * t * c <= cluster.link_domain())),
    ]
    # the combinations schemas.legality rules out, over the candidates' fields
    values = dict(tp=t, pp=p, cp=c, ep=e, zero=z, offload=off, sequence_parallel=sp, interleave=v,
                  **legality.config(**compression.model_dump()))
    rules += [Rule(rule.reason, tuple(dict.fromkeys(PIN_OF_FIELD.get(f, f) for f in rule.fields)),
                   np.broadcast_to(rule.holds(values), t.shape), rule.name) for rule in legality.applicable(values)]
    return _Grid(tp=t, pp=p, dp=d, cp=c, ep=e, micro_batch=b, zero=z, recompute=r, sp=sp, interleave=v, offload=off,
                 rules=rules)


def enumerate_candidates(
    model: ModelSummary, cluster: ClusterSpec, gpus: int, global_batch: int, pins: Pins, fill_pipeline: bool = True
) -> Candidates:
    """Every legal configuration that respects the pins (may be empty: explain_no_candidates says why).
    `fill_pipeline` False keeps pipelines with fewer micro-batches than stages too (`zplan estimate` prices them;
    the runtime does not run them, so the search never does)."""
    compression = pins.compress or CompressionConfig()
    g = _grid(model, cluster, gpus, global_batch, pins, fill_pipeline)
    if g is None:
        return Candidates.single(tp=1, pp=1, dp=1, micro_batch=1, zero=0, recompute=0, sp=0,
                                 interleave=1, offload=0).take(np.array([], dtype=np.int64))
    legal = np.logical_and.reduce([rule.mask for rule in g.rules])
    idx = np.nonzero(legal)[0]
    return Candidates(tp=g.tp[idx], pp=g.pp[idx], dp=g.dp[idx], micro_batch=g.micro_batch[idx], zero=g.zero[idx],
                      recompute=g.recompute[idx], sp=g.sp[idx], interleave=g.interleave[idx],
                      offload=g.offload[idx], cp=g.cp[idx], ep=g.ep[idx]).with_compression(
                          compression.grad, compression.weights, compression.activations)


def pin_words(pins: Pins, field: str) -> str:
    """A pin as its command-line option, e.g. '--offload nvme', '--sequence-parallel'."""
    value = getattr(pins, field)
    if field == "sequence_parallel":
        return "--sequence-parallel" if value else "--no-sequence-parallel"
    if field == "compress":
        return f"--compress {value.as_option()}"
    return f"--{field.replace('_', '-')} {value}"


def explain_no_candidates(model: ModelSummary, cluster: ClusterSpec, gpus: int, global_batch: int,
                          pins: Pins, fill_pipeline: bool = True) -> str:
    """Why no configuration is legal, for an error message: the rules that each alone rule out every
    configuration the others leave, naming the pins each constrains; else the single pins whose removal leaves
    some; else every rule. `fill_pipeline` as enumerate_candidates'."""
    pinned = pins.model_dump(exclude_none=True)
    head = f"no legal configuration for {gpus} GPUs with pins {pinned}"
    g = _grid(model, cluster, gpus, global_batch, pins, fill_pipeline)
    if g is not None:
        masks = [rule.mask for rule in g.rules]
        alone = [rule for i, rule in enumerate(g.rules)
                 if np.logical_and.reduce(masks[:i] + masks[i + 1:] + [np.ones_like(masks[0])]).any()]
        reasons = []
        for rule in alone:
            named = [pin_words(pins, f) for f in rule.fields if getattr(pins, f) is not None]
            if named:
                pin = f"the pin {named[0]}" if len(named) == 1 else f"the pins {' and '.join(named)}"
                reasons.append(f"{pin} break{'s' if len(named) == 1 else ''} the rule: {rule.text} "
                               f"(change or drop {'it' if len(named) == 1 else 'one of them'})")
            else:
                reasons.append(f"no configuration meets the rule: {rule.text} (change --global-batch or --gpus)")
        if reasons:
            return f"{head}: {'; or '.join(reasons)}."
    drop = [pin_words(pins, f) for f in pinned
            if len(enumerate_candidates(model, cluster, gpus, global_batch, pins.model_copy(update={f: None}),
                                        fill_pipeline))]
    if drop:
        return f"{head}: the pins conflict with each other; dropping any one of {', '.join(drop)} leaves legal ones."
    filled = (", and a pipeline gets at least pp micro-batches (global batch >= dp * micro_batch * pp)"
              if fill_pipeline else "")
    return (f"{head}: check that tp divides the {model.heads} heads, "
            f"pp * interleave <= {model.num_blocks + 2} (the blocks, the embedding and the head), "
            f"dp*tp*pp = {gpus}, the global batch {global_batch} divides by dp*micro_batch{filled}.")
