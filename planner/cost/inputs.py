"""The numbers the cost model reads: candidate arrays and a model reduced to a few floats.

Nothing here imports torch; the cost model is numpy over whole candidate arrays (docs/design.md decision 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np

from zplan.schemas.capability import ModelTrait, vocab_parallel
from zplan.schemas.model import ModelSummary

RECOMPUTE_MODES = ("none", "selective", "full")
OFFLOAD_TIERS = ("none", "cpu", "nvme")
# --compress values (schemas.spec.CompressionConfig), indexed by Candidates' compression fields.
GRAD_COMPRESSION = ("none", "int8", "1bit")
WEIGHT_COMPRESSION = ("none", "int8")
ACTIVATION_COMPRESSION = ("none", "int8")


@dataclass(frozen=True)
class Candidates:
    """One configuration per index; every field is an int64 array of the same length. The compression fields
    (one setting for all candidates of a search: the --compress pin) default to none, the context-parallel degree to
    1. GPUs = tp * pp * dp * cp; dp is the number of replicas the global batch is split over."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    micro_batch: np.ndarray
    zero: np.ndarray
    recompute: np.ndarray  # index into RECOMPUTE_MODES
    sp: np.ndarray  # 0/1 sequence parallel
    interleave: np.ndarray  # model chunks per stage, v
    offload: np.ndarray  # index into OFFLOAD_TIERS
    grad_compress: np.ndarray = field(default=None)  # index into GRAD_COMPRESSION
    weight_compress: np.ndarray = field(default=None)  # index into WEIGHT_COMPRESSION
    act_compress: np.ndarray = field(default=None)  # index into ACTIVATION_COMPRESSION
    cp: np.ndarray = field(default=None)  # context-parallel degree: each sequence split over cp GPUs
    ep: np.ndarray = field(default=None)  # expert-parallel degree: routed experts split over ep of the dp ranks

    def __post_init__(self) -> None:
        for name in ("grad_compress", "weight_compress", "act_compress"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros_like(self.tp))
        for name in ("cp", "ep"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.ones_like(self.tp))

    def __len__(self) -> int:
        return len(self.tp)

    def take(self, index: np.ndarray) -> Candidates:
        return Candidates(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def with_recompute(self, mode: int) -> Candidates:
        return replace(self, recompute=np.full_like(self.recompute, mode))

    def with_compression(self, grad: str, weights: str, activations: str) -> Candidates:
        """The same configurations with one compression setting (values of schemas.spec.CompressionConfig)."""
        return replace(self, grad_compress=np.full_like(self.tp, GRAD_COMPRESSION.index(grad)),
                       weight_compress=np.full_like(self.tp, WEIGHT_COMPRESSION.index(weights)),
                       act_compress=np.full_like(self.tp, ACTIVATION_COMPRESSION.index(activations)))

    @staticmethod
    def single(**values: int) -> Candidates:
        return Candidates(**{k: np.asarray([v], dtype=np.int64) for k, v in values.items()})


def gpu_sequences(cand: Candidates) -> np.ndarray:
    """Sequences' worth of tokens one GPU holds of a micro-batch: b / cp (context parallel gives each GPU s / cp
    tokens of each of the b sequences, balanced under the causal mask, so its GEMMs, attention, activations and
    hidden-state messages are those of b / cp whole sequences)."""
    return cand.micro_batch / cand.cp


def gradient_group(cand: Candidates) -> np.ndarray:
    """Ranks that hold the same parameters and average their gradients (ZeRO shards over them): dp * cp, consecutive
    tp groups apart (the mesh is pp, dp, cp, tp)."""
    return cand.dp * cand.cp


NOT_SPLIT = [ModelTrait(kind="vocab_not_split", module="", detail="ModelNumbers.vocab_splittable is False")]


@dataclass(frozen=True)
class ModelNumbers:
    """A ModelSummary as floats: embedding, one average block, head (per sample at seq_len)."""

    num_blocks: int
    hidden: int
    heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    params: float  # all parameters
    embed_params: float  # units before the first block
    embed_fwd_flops: float
    head_params: float  # units after the last block (0 when tied to the embedding)
    head_fwd_flops: float
    block_params: float  # mean over blocks
    block_fwd_flops: float  # per sample
    block_act_bytes: float  # per sample, no parallelism, at the compute precision
    embed_act_bytes: float
    head_act_bytes: float
    block_gemm_out_bytes: float = 0.0  # the block's projection outputs, per sample (selective recompute keeps them)
    block_attention_core_bytes: float = 0.0  # of block_act_bytes, an unfused attention core's (s, s) bytes per sample
    head_shared_params: float = 0.0  # parameters the head reads that the embedding owns (tied): the last stage's copy
    block_colwise_linears: int = 0  # a block's Linears split by output features under tp (its tp_rules)
    block_rowwise_linears: int = 0  # and by input features
    kv_heads: int = 0  # key/value heads (GQA); 0: as many as the query heads
    moe_blocks: int = 0  # blocks with routed experts
    routing_imbalance: float = 1.0  # the busiest expert-parallel rank's routed tokens over the mean (ExpertsSummary)
    experts_at_gemm_peak: bool = False  # the experts' GEMMs at the fp8 / fp4 GEMM peak (ExpertsSummary.at_gemm_peak)
    dispatch_per_node: bool = False  # a token crosses to each other node once (ExpertsSummary.dispatch "per_node")
    block_attention_fwd_flops: float = 0.0  # per sample, the traced attention cores' (0: 2 s^2 h, planner.cost.compute)
    # Routed experts (mean over blocks; 0 for a dense model): whole on every tp rank, which splits only the Linears
    block_expert_params: float = 0.0  # all E experts of a block
    block_expert_fwd_flops: float = 0.0  # per sample, at top-k, balanced
    block_expert_act_bytes: float = 0.0  # per sample, at the compute precision
    num_experts: int = 0  # E
    top_k: int = 0  # k
    expert_ffn_hidden: int = 0  # F of one expert
    # The vocabulary tables (V, h) of the token embedding (in embed_params) and of an untied head (in head_params; a
    # tied head's is head_shared_params), which the runtime splits by rows over tp where vocab_splittable
    # (runtime/parallel/vocab_parallel.py; schemas.capability.vocab_parallel)
    embed_vocab_params: float = 0.0
    head_vocab_params: float = 0.0
    vocab_splittable: bool = False
    default_loss: bool = False  # the model file has no loss_fn: the runtime's in-place next-token loss runs

    def vocab_split(self, cand: Candidates) -> np.ndarray:
        """Ranks each vocabulary table and the logits are split over: tp where the plan splits the vocabulary
        (ParallelConfig.vocab_parallel: schemas.capability.vocab_parallel), else 1."""
        tp = cand.tp.astype(float)
        return np.where(vocab_parallel([] if self.vocab_splittable else NOT_SPLIT, cand.tp, self.vocab, cand.cp),
                        tp, 1.0)

    def edge_params(self, cand: Candidates) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(embedding, head, tied head's copy) parameters on one rank: whole, but for their vocabulary tables split
        over vocab_split."""
        split = self.vocab_split(cand)
        kept = 1.0 - 1.0 / split
        return (self.embed_params - kept * self.embed_vocab_params, self.head_params - kept * self.head_vocab_params,
                self.head_shared_params / split)

    def block_params_per_rank(self, tp: np.ndarray | float, ep: np.ndarray | float = 1) -> np.ndarray | float:
        """One block's parameters on a rank: its Linears split over tp, its routed experts whole on every tp rank and
        split over ep."""
        return (self.block_params - self.block_expert_params) / tp + self.block_expert_params / ep

    def busiest_rank(self, ep: np.ndarray) -> np.ndarray:
        """The routed tokens of the busiest rank over the mean: routing_imbalance under expert parallel (ep > 1);
        1 otherwise, every rank running all experts on its own tokens."""
        return np.where(ep > 1, self.routing_imbalance, 1.0)

    @staticmethod
    def from_summary(summary: ModelSummary) -> ModelNumbers:
        blocks = [u for u in summary.layers if u.kind == "block"]
        first = next(i for i, u in enumerate(summary.layers) if u.kind == "block")
        pre, post = summary.layers[:first], summary.layers[first + len(blocks):]
        table = summary.vocab * summary.hidden  # one (V, h) table
        return ModelNumbers(
            num_blocks=len(blocks),
            hidden=summary.hidden,
            heads=summary.heads,
            ffn_hidden=summary.ffn_hidden,
            vocab=summary.vocab,
            seq_len=summary.seq_len,
            params=float(summary.params),
            embed_params=float(sum(u.params for u in pre)),
            embed_fwd_flops=float(sum(u.fwd_flops for u in pre)),
            head_params=float(sum(u.params for u in post)),
            head_shared_params=float(sum(u.shared_params for u in post)),
            head_fwd_flops=float(sum(u.fwd_flops for u in post)),
            block_params=float(np.mean([u.params for u in blocks])),
            block_fwd_flops=float(np.mean([u.fwd_flops for u in blocks])),
            block_act_bytes=float(np.mean([u.act_bytes for u in blocks])),
            block_gemm_out_bytes=float(np.mean([u.gemm_out_bytes for u in blocks])),
            block_attention_core_bytes=float(np.mean([u.attention_core_bytes for u in blocks])),
            embed_act_bytes=float(sum(u.act_bytes for u in pre)),
            head_act_bytes=float(sum(u.act_bytes for u in post)),
            block_colwise_linears=sum(rule.style == "colwise" for rule in summary.tp_rules),
            block_rowwise_linears=sum(rule.style == "rowwise" for rule in summary.tp_rules),
            kv_heads=summary.kv_heads,
            block_expert_params=float(np.mean([u.expert_params for u in blocks])),
            block_expert_fwd_flops=float(np.mean([u.expert_fwd_flops for u in blocks])),
            block_expert_act_bytes=float(np.mean([u.expert_act_bytes for u in blocks])),
            num_experts=summary.experts.num_experts if summary.experts else 0,
            top_k=summary.experts.top_k if summary.experts else 0,
            expert_ffn_hidden=summary.experts.ffn_hidden if summary.experts else 0,
            moe_blocks=summary.experts.moe_blocks if summary.experts else 0,
            routing_imbalance=summary.experts.imbalance if summary.experts else 1.0,
            experts_at_gemm_peak=bool(summary.experts and summary.experts.at_gemm_peak),
            dispatch_per_node=bool(summary.experts and summary.experts.dispatch == "per_node"),
            block_attention_fwd_flops=float(np.mean([u.attention_fwd_flops for u in blocks])),
            embed_vocab_params=float(table if sum(u.params for u in pre) >= table else 0),
            head_vocab_params=float(table if sum(u.params for u in post) >= table else 0),  # 0: tied, or no head
            vocab_splittable=bool(vocab_parallel(summary.traits, 2, summary.vocab, 1)),
            default_loss=not any(trait.kind == "own_loss" for trait in summary.traits),
        )
