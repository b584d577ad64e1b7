"""Numbers the planner knows about a model: what tracing (or a family formula) produced.

The cost model and the solvers read only this, never torch objects.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from zplan.schemas.capability import ModelTrait

LayerKind = Literal["embedding", "block", "head", "other"]
# written only where set: the mixture-of-experts fields, and the attention FLOPs of the units that have attention
WHEN_SET_FIELDS = ("expert_params", "expert_fwd_flops", "expert_act_bytes", "experts", "attention_fwd_flops")


def _without_defaults(data: dict) -> dict:
    """plan.json without WHEN_SET_FIELDS at their defaults (0, None): a dense model's reads as before them."""
    return {key: value for key, value in data.items() if key not in WHEN_SET_FIELDS or value}
TPStyle = Literal["colwise", "rowwise"]


class LayerCost(BaseModel):
    """One pipeline unit: a top-level slice of the model that a stage boundary may not split."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Name of the unit: a block's module path ('blocks.3'), or 'embedding' / 'head' "
                                  "for the modules before / after the blocks.")
    modules: list[str] = Field(default_factory=list, description="Top-level module paths the unit runs, in order "
                               "(e.g. ['wte', 'wpe']); empty for closed-form family models.")
    kind: LayerKind = Field(description="embedding, block (a repeated unit), head, or other.")
    params: int = Field(ge=0, description="Parameters owned by the unit.")
    shared_params: int = Field(default=0, ge=0, description="Parameters the unit reads that an earlier unit owns "
                               "(a tied output head reads the embedding's): a pipeline stage that runs this unit "
                               "without that one holds its own copy.")
    fwd_flops: float = Field(ge=0, description="Forward FLOPs for one sample (one sequence of seq_len).")
    act_bytes: float = Field(
        ge=0, description="Bytes saved for backward for one sample, no parallelism, at compute precision."
    )
    gemm_out_bytes: float = Field(
        default=0.0, ge=0, description="Bytes of the outputs of the unit's projections (matmuls with a weight), one "
        "sample, no parallelism, at compute precision: what selective recompute keeps (runtime.training.recompute)."
    )
    attention_core_bytes: float = Field(
        default=0.0, ge=0, description="Of act_bytes, what an unfused attention core saves over (s, s) scores "
        "(softmax output, dropout mask), one sample; 0 where a fused (flash) kernel keeps the scores on chip."
    )
    attention_fwd_flops: float = Field(default=0.0, ge=0, description="Of fwd_flops, the fused attention cores' "
                                       "QK^T and AV for one sample over a causal square, from their traced shapes "
                                       "(0: not traced; the cost model then takes 2 s^2 h).")
    expert_params: int = Field(default=0, ge=0, description="Of params, the routed experts' (zplan.model.experts): "
                               "whole on every tensor-parallel rank, which splits only the Linears.")
    expert_fwd_flops: float = Field(default=0.0, ge=0, description="Of fwd_flops, the routed experts' for one sample "
                                    "at top-k, routing balanced (planner/expert_trace.py); not split by tp.")
    expert_act_bytes: float = Field(default=0.0, ge=0, description="Of act_bytes, what the routed experts save for "
                                    "one sample (planner/op_costs.py); not split by tp.")

    @model_serializer(mode="wrap")
    def _fields_when_set(self, handler):
        return _without_defaults(handler(self))


class ExpertsSummary(BaseModel):
    """The routed experts of a mixture-of-experts model (zplan.model.experts), the same in every MoE block."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_experts: int = Field(ge=2, description="Routed experts E per MoE block.")
    top_k: int = Field(ge=1, description="Experts each token visits, k.")
    ffn_hidden: int = Field(gt=0, description="One expert's inner width F.")
    moe_blocks: int = Field(gt=0, description="Blocks holding routed experts (DeepSeek-V3's first blocks are dense).")
    routed_params: int = Field(gt=0, description="Parameters of every routed expert of every block.")
    active_params: int = Field(gt=0, description="Parameters one token uses: all but the routed experts', plus k / E "
                               "of theirs.")
    imbalance: float = Field(default=1.0, ge=1.0, description="Routing assumed: the tokens of the busiest expert-"
                             "parallel rank over the mean (1: balanced, as the published benchmarks force it; "
                             "--moe-imbalance).")
    at_gemm_peak: bool = Field(default=False, description="Whether the experts' GEMMs run at the training "
                               "precision's GEMM peak (fp8, nvfp4), as Transformer Engine's grouped GEMM runs them "
                               "under Megatron-Core's fp8 and fp4 recipes; False: at the compute dtype's, as zplan's "
                               "runtime runs them (its fp8 and nvfp4 convert nn.Linear only).")
    dispatch: Literal["all_to_all", "per_node"] = Field(
        default="all_to_all", description="How routed tokens cross nodes: all_to_all sends each (token, expert) copy "
        "straight to its expert's rank, as zplan's runtime does (all_to_all_single); per_node sends a token once to "
        "each other node that hosts any of its experts, and that node forwards it over NVLink (DeepEP's and "
        "HybridEP's hierarchical dispatch, Megatron-Core's flex token dispatcher).")

    def describe(self) -> str:
        """'8 routed experts of FFN 14336, top-2, in 32 blocks', for the reports."""
        return (f"{self.num_experts} routed experts of FFN {self.ffn_hidden}, top-{self.top_k}, in {self.moe_blocks} "
                f"block{'s' if self.moe_blocks != 1 else ''}")


class TensorParallelRule(BaseModel):
    """How one Linear is split under tensor parallelism (Megatron column/row pairs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    module: str = Field(description="Module path relative to its block, e.g. 'attn.qkv' or 'mlp.down'.")
    style: TPStyle = Field(description="colwise: output features split; rowwise: input features split.")
    parts: list[int] = Field(default_factory=list, description=(
        "A fused projection: the output features of each projection it computes, in the order its forward slices "
        "them (q, k, v or gate, up); empty for one projection."))
    groups: int = Field(1, ge=1, description=(
        "A fused projection: each part is cut into this many equal groups (kv-head groups, heads or features), "
        "stored group by group (model/fused_layout.py) so that a tp rank holds whole groups; tp must divide it."))


class ModelSummary(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Human name: file stem or family spec.")
    source: Literal["file", "family"] = Field(description="Traced from a model file or a closed-form family.")
    tracer: str = Field(description="How the numbers were obtained: fx, export, hooks, or closed-form.")
    num_blocks: int = Field(gt=0, description="Repeated blocks (transformer layers).")
    hidden: int = Field(gt=0, description="Model width h.")
    heads: int = Field(gt=0, description="Attention heads a.")
    kv_heads: int = Field(gt=0, description="Key/value heads (grouped-query attention); = heads for MHA.")
    ffn_hidden: int = Field(gt=0, description="MLP inner width.")
    vocab: int = Field(gt=0, description="Vocabulary size V.")
    seq_len: int = Field(gt=0, description="Sequence length s the FLOPs and activations are counted at.")
    params: int = Field(gt=0, description="All parameters (tied weights once).")
    layers: list[LayerCost] = Field(description="Pipeline units in execution order.")
    block_prefix: str = Field(description="Module path of the block container, e.g. 'blocks' or 'model.layers'.")
    tp_rules: list[TensorParallelRule] = Field(description="Column/row split of each Linear in a block.")
    block_tokens: Optional[int] = Field(default=None, gt=0, description="Tokens per sample in the hidden states "
                                        "between blocks (B, T, h), as traced: may differ from seq_len (a ViT's "
                                        "patches and class token); sequence parallel splits them over tp. None: "
                                        "seq_len.")
    experts: Optional[ExpertsSummary] = Field(default=None, description="The routed experts; None for a dense "
                                              "model.")
    traits: list[ModelTrait] = Field(default_factory=list, description="What the tracer found that rules out a "
                                     "parallelism the runtime cannot run on this model (schemas.capability.RULES); "
                                     "empty for closed-form families.")

    @model_serializer(mode="wrap")
    def _fields_when_set(self, handler):
        return _without_defaults(handler(self))

    @property
    def fwd_flops_per_sample(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)
