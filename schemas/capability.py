"""What zplan's runtime can execute for a model, as data (docs/design.md decision 8).

The tracer records what it finds in the model that matters to the runtime as ModelTraits (planner/traits.py:
a fused projection, a block that takes more than the hidden states, a router, ...). RULES says, for each kind
of trait, which parallelisms the runtime cannot run on such a model and what to do instead. Everything that
decides or checks a plan reads this one table: the enumerator proposes only what it allows, a pin it rules out
is refused at compile time, and the emitted program's check_plan refuses a plan.json that contradicts it
before any collective. When the runtime learns to run a trait, its rule goes, and nothing else changes.

Serving is one more capability, "inference": `zplan compile --mode inference` asks the engine's own recogniser
(runtime/inference/decoder_spec.py, run on the meta model by runtime/plan/model_checks.py inference_traits) and
records what it refuses as a trait, so that compile refuses (inference_problems) what the engine would refuse when it
starts. Training compiles do not ask, so their plans never hold these traits.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Capability = Literal["tensor_parallel", "sequence_parallel", "pipeline", "fp8", "nvfp4", "context_parallel",
                     "expert_parallel", "inference", "vocab_parallel"]
CAPABILITIES: tuple[str, ...] = Capability.__args__

TraitKind = Literal[
    "no_tensor_parallel_rules",
    "fused_projection",
    "parameters_beside_split_linears",
    "parameters_outside_split_linears",
    "forward_not_split_by_heads",
    "forward_not_split_by_stages",
    "several_block_stacks",
    "no_fp8_linears",
    "no_nvfp4_linears",
    "no_position_ids",
    "attention_not_sdpa",
    "attention_not_causal",
    "own_loss",
    "experts_not_dispatchable",
    "experts_not_served",
    "decoder_not_recognised",
    "vocab_not_split",
]
FP8_DIM_MULTIPLE = 16  # an fp8 GEMM (torch._scaled_mm) needs both of a Linear's widths divisible by 16
# An NVFP4 operand is quantised in blocks of 16 along its GEMM's reduction dim, and a Linear's three GEMMs reduce over
# its in features (forward), its out features (input gradient) and the tokens (weight gradient, padded by
# runtime/precision/nvfp4.py): both widths divisible by 16, torchao's own filter for NVFP4 Linears (torchao 0.18
# prototype/mx_formats/inference_workflow.py: K % 16 == 0 and N % 16 == 0; the GEMM's swizzled scale layout pads
# its (rows, K / 16) scales to (128, 4) tiles itself, torchao's to_blocked).
NVFP4_DIM_MULTIPLE = 16


class ModelTrait(BaseModel):
    """One thing the tracer found in the model that the runtime's capabilities depend on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: TraitKind = Field(description="What was found (schemas.capability.RULES says what it rules out).")
    module: str = Field(description="Module path in the model where it was found ('' for the model as a whole).")
    detail: str = Field(description="What exactly, in a few words, for the error message.")


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    blocks: tuple[Capability, ...] = Field(description="Parallelisms the runtime cannot run on a model with it.")
    why: str = Field(description="Why, in terms of what the runtime does.")


RULES: dict[str, Rule] = {
    "no_tensor_parallel_rules": Rule(
        blocks=("tensor_parallel", "sequence_parallel"),
        why="tensor parallel splits nn.Linear pairs inside the blocks (column- then row-wise) and the trace found "
            "none"),
    "fused_projection": Rule(
        blocks=("tensor_parallel", "sequence_parallel"),
        why="its output is cut into several projections (q/k/v or gate/up); a column split would give each rank "
            "a slice across them"),
    "parameters_beside_split_linears": Rule(
        blocks=("tensor_parallel", "sequence_parallel"),
        why="a module with parameters of its own sits beside the split Linears and would see only this rank's "
            "features or heads"),
    "parameters_outside_split_linears": Rule(
        blocks=("sequence_parallel",),
        why="a module with parameters that is not a norm would see only this rank's tokens under sequence "
            "parallel"),
    "forward_not_split_by_heads": Rule(
        blocks=("tensor_parallel", "sequence_parallel"),
        why="each tensor-parallel rank runs the block on its slice of the split projections' weights, and on this "
            "model that does not give the block's output (run on the meta device at tp=2)"),
    "forward_not_split_by_stages": Rule(
        blocks=("pipeline",),
        why="each pipeline stage runs the model's forward with the other stages' modules stood in for, and on this "
            "model that does not reproduce the forward at a two-stage cut"),
    "several_block_stacks": Rule(
        blocks=("pipeline",),
        why="the model runs more than one stack of blocks (an encoder and a decoder), and a pipeline cuts one"),
    "no_fp8_linears": Rule(
        blocks=("fp8",),
        why=f"fp8 training converts the blocks' nn.Linear modules whose widths are multiples of {FP8_DIM_MULTIPLE} "
            "(runtime/precision/float8.py), and a block has none"),
    "no_nvfp4_linears": Rule(
        blocks=("nvfp4",),
        why=f"nvfp4 training converts the blocks' nn.Linear modules whose widths are multiples of "
            f"{NVFP4_DIM_MULTIPLE} (runtime/precision/nvfp4.py), and a block has none"),
    "no_position_ids": Rule(
        blocks=("context_parallel",),
        why="context parallel gives each rank parts of every sequence and passes their global positions as "
            "position_ids (runtime/parallel/context_parallel.py), which this forward does not take"),
    "attention_not_sdpa": Rule(
        blocks=("context_parallel",),
        why="context parallel gathers keys and values inside F.scaled_dot_product_attention, which this model's "
            "attention does not call (Hugging Face: attn_implementation='sdpa')"),
    "attention_not_causal": Rule(
        blocks=("context_parallel",),
        why="context parallel masks the gathered keys causally by global position, and this attention is not plain "
            "causal self-attention (a sliding window, bidirectional or cross-attention)"),
    "own_loss": Rule(
        blocks=("context_parallel",),
        why="context parallel splits the default next-token loss over the ranks' tokens, and the model file defines "
            "its own loss_fn"),
    "experts_not_dispatchable": Rule(
        blocks=("expert_parallel",),
        why="expert parallel runs each rank's experts with zplan's own executor (runtime/parallel/experts.py), which "
            "must know an experts module's projections and activation, and this one does not declare them (it "
            "trains as the model has it, with every expert on every rank)"),
    "experts_not_served": Rule(
        blocks=("inference",),
        why="the inference engine does not run expert layers yet: it serves dense decoders, one MLP per block "
            "(runtime/inference/decoder.py), and this model routes its tokens to experts"),
    "decoder_not_recognised": Rule(
        blocks=("inference",),
        why="the inference engine serves only the pre-norm decoders it recognises module by module "
            "(runtime/inference/decoder.py)"),
    "vocab_not_split": Rule(
        blocks=("vocab_parallel",),
        why="tensor parallel splits the vocabulary of an nn.Embedding and an nn.Linear output head outside the blocks "
            "(runtime/parallel/vocab_parallel.py), and this model's are not such modules: they stay replicated over "
            "tp"),
}

# The pin that asks for each capability, and the plan.json field that holds it.
PIN_OF: dict[str, str] = {"tensor_parallel": "--tp", "sequence_parallel": "--sequence-parallel", "pipeline": "--pp",
                          "fp8": "--precision fp8", "nvfp4": "--precision nvfp4", "context_parallel": "--cp",
                          "expert_parallel": "--ep", "inference": "--mode inference",
                          "vocab_parallel": "--tp"}  # the vocabulary is split wherever tp > 1 and the model allows
FIELD_OF: dict[str, str] = {"tensor_parallel": "parallel.tp", "sequence_parallel": "parallel.sequence_parallel",
                            "pipeline": "parallel.pp", "fp8": "train.precision", "nvfp4": "train.precision",
                            "context_parallel": "parallel.cp", "expert_parallel": "parallel.ep",
                            "inference": "an InferencePlan", "vocab_parallel": "parallel.vocab_parallel"}
FIX_OF: dict[str, str] = {"tensor_parallel": "--tp 1", "sequence_parallel": "no --sequence-parallel",
                          "pipeline": "--pp 1", "fp8": "--precision bf16", "nvfp4": "--precision bf16",
                          "context_parallel": "--cp 1", "expert_parallel": "--ep 1",
                          "inference": "--mode training (zplan plans its training), or serve it with another engine",
                          "vocab_parallel": "a plan compiled for this model (it keeps the vocabulary replicated)"}


def blocking(traits: list[ModelTrait], capability: str) -> list[ModelTrait]:
    """The traits of the model that rule `capability` out."""
    return [trait for trait in traits if capability in RULES[trait.kind].blocks]


def allows(traits: list[ModelTrait], capability: str) -> bool:
    return not blocking(traits, capability)


def explain(traits: list[ModelTrait], capability: str) -> str:
    """Why the runtime cannot run `capability` on this model: the first blocking trait, with its module."""
    trait = blocking(traits, capability)[0]
    where = f"{trait.module} " if trait.module else ""
    more = len(blocking(traits, capability)) - 1
    return f"{where}({trait.detail}): {RULES[trait.kind].why}" + (f" (and {more} more)" if more else "")


def inference_problems(traits: list[ModelTrait], names: dict[str, str] = PIN_OF) -> list[str]:
    """Why the inference engine cannot serve a model with `traits` (one message naming what asked for it, the module
    and the fix); empty when it can."""
    if allows(traits, "inference"):
        return []
    return [f"{names['inference']}: the inference engine cannot serve this model: {explain(traits, 'inference')}; "
            f"use {FIX_OF['inference']}"]


def vocab_parallel(traits: list[ModelTrait], tp, vocab: int, cp=1):
    """Whether a plan splits the vocabulary over tp (ParallelConfig.vocab_parallel): wherever tp > 1, cp = 1 (context
    parallel's loss sees whole logits) and the model has a vocabulary whose embedding and head the runtime can split
    (any loss: the runtime's, or the model file's under torch's loss_parallel; tp and cp ints or integer arrays)."""
    return (tp > 1) & (cp == 1) & (vocab > 0) & allows(traits, "vocab_parallel")


def sequence_parallel_fits(block_tokens: int | None, tp):
    """Sequence parallel gives each tp rank T/tp of the tokens between blocks: T must divide (tp an int or an
    integer array; the answer has its shape)."""
    return tp > 0 if block_tokens is None else block_tokens % tp == 0


def capability_problems(traits: list[ModelTrait], tp: int, pp: int, sequence_parallel: bool,
                        names: dict[str, str] = FIELD_OF, block_tokens: int | None = None,
                        fp8: bool = False, nvfp4: bool = False, cp: int = 1, ep: int = 1,
                        vocab_split: bool = False) -> list[str]:
    """What in a configuration (tp, pp, sequence_parallel, fp8 or nvfp4 training, cp, ep, a split vocabulary) the
    runtime cannot run on a model with `traits`, one message per capability naming what asked for it (`names`: the
    plan field, or PIN_OF for the pin), the module and the fix; empty when it runs."""
    asked = {"tensor_parallel": tp > 1, "sequence_parallel": sequence_parallel, "pipeline": pp > 1, "fp8": fp8,
             "nvfp4": nvfp4, "context_parallel": cp > 1, "expert_parallel": ep > 1, "vocab_parallel": vocab_split}
    problems = [f"{names[c]}: the runtime cannot run {c.replace('_', ' ')} on this model: {explain(traits, c)}; "
                f"use {FIX_OF[c]}" for c, wanted in asked.items() if wanted and not allows(traits, c)]
    if sequence_parallel and allows(traits, "sequence_parallel") and not sequence_parallel_fits(block_tokens, tp):
        problems.append(f"{names['sequence_parallel']}: the blocks see {block_tokens} tokens per sample, which "
                        f"tp={tp} does not divide; use {FIX_OF['sequence_parallel']}")
    return problems
