"""Can the runtime run this model this way? Answered by the runtime's own code, run on the meta device at compile
time: the API layer (zplan/model_input.py) hands these checks to the planner's tracer (planner/traits.py), which
records their answers as ModelTraits (schemas/capability.py says what each rules out). The planner never imports the
runtime; the runtime's code stays the one judge of what it runs.

  tensor parallel  block 0 run as one of two ranks runs it (each split projection with this rank's slice of its
                   weight, the head counts of modules slicing a fused projection made this rank's) must give the
                   block's output shape (rank_block_problem);
  pipeline         the runtime's split cut in two in the middle of the blocks must reproduce the forward
                   (split_problem);
  fp8, nvfp4       a block with no Linear the conversion takes (fp8_traits, nvfp4_traits);
  context parallel the forward takes position_ids, and its attention is causal self-attention through
                   F.scaled_dot_product_attention (context_parallel_traits);
  inference        the serving engine recognises the model (runtime/inference/decoder_spec.py recognise, the very
                   function the engine runs when it starts; asked by `zplan compile --mode inference` only):
                   inference_traits;
  vocabulary       an nn.Embedding and an nn.Linear head of the vocabulary outside the blocks, which tensor parallel
                   splits by rows (vocabulary_traits).
Each function is torch only: no process group, and torchao is imported by the conversions alone.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zplan.model.experts import find_expert_layers
from zplan.model.fused_layout import FusedLayout
from zplan.model.modules import is_conv1d, parent_path
from zplan.runtime.inference.decoder_spec import UnsupportedExpertsError, UnsupportedModelError, recognise
from zplan.runtime.parallel.context_parallel import accepts_position_ids
from zplan.runtime.parallel.experts import apply_experts, experts_problem
from zplan.runtime.parallel.pipeline import PipelineSplitError, check_split, split_model
from zplan.runtime.parallel.tensor_parallel import localize_head_counts, projection_features
from zplan.runtime.parallel.vocab_parallel import vocabulary_problem
from zplan.runtime.precision.float8 import fp8_convertible
from zplan.runtime.precision.nvfp4 import nvfp4_convertible
from zplan.schemas.capability import FP8_DIM_MULTIPLE, NVFP4_DIM_MULTIPLE, ModelTrait
from zplan.schemas.model import LayerCost, ModelSummary, TensorParallelRule


class _BlockDone(BaseException):  # raised after block 0's forward: the rest of the model need not run
    pass


def context_parallel_traits(model: nn.Module, block: nn.Module, example_call: tuple[tuple, dict]
                             ) -> list[ModelTrait]:
    """What runtime/parallel/context_parallel.py needs of a forward: it takes position_ids, and its attention is causal
    self-attention through F.scaled_dot_product_attention (the calls of the model's forward on meta up to the end of
    block 0, as every block attends alike, are recorded: none, one without a causal flag or mask, one whose queries
    and keys differ in length, or a config's sliding window)."""
    apply_experts(model)  # routed experts run zplan's executor, as parallelize runs them
    traits = []
    if not accepts_position_ids(model.forward):
        traits.append(ModelTrait(kind="no_position_ids", module="", detail="forward() has no position_ids argument"))
    calls: list[tuple[bool, bool]] = []  # (causal: is_causal or a mask, same query and key length)

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention:
                q, k = args[0], args[1]
                masked = kwargs.get("attn_mask", args[3] if len(args) > 3 else None) is not None
                causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
                calls.append((causal or masked, q.shape[-2] == k.shape[-2]))
            return func(*args, **kwargs)

    def done(module, inputs, output):
        raise _BlockDone

    args, kwargs = example_call
    handle = block.register_forward_hook(done)
    try:
        with torch.no_grad(), Record():
            model(*args, **kwargs)
    except _BlockDone:
        pass
    except Exception as error:  # a forward the meta device cannot run: the other traits say so; record nothing here
        return [*traits, ModelTrait(kind="attention_not_sdpa", module="",
                                    detail=f"its forward did not run on the meta device ({type(error).__name__})")]
    finally:
        handle.remove()
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if not calls:
        traits.append(ModelTrait(kind="attention_not_sdpa", module="",
                                 detail="no F.scaled_dot_product_attention call in its first block"))
    elif not all(causal and square for causal, square in calls) or window:
        detail = f"a sliding window of {window}" if window else "an attention call that is not causal self-attention"
        traits.append(ModelTrait(kind="attention_not_causal", module="", detail=detail))
    return traits


def fp8_traits(block: nn.Module, block_name: str) -> list[ModelTrait]:
    """A block with no Linear fp8 training converts (GPT-2's Conv1D projections, widths off the multiple)."""
    if any(fp8_convertible(module) for module in block.modules()):
        return []
    return [ModelTrait(kind="no_fp8_linears", module=block_name,
                       detail=f"no nn.Linear with both widths multiples of {FP8_DIM_MULTIPLE}")]


def expert_traits(model: nn.Module) -> list[ModelTrait]:
    """Each routed-experts module (model.experts.find_expert_layers) whose math zplan's executor does not know
    (runtime.parallel.experts.experts_problem): it runs as the model has it, and expert parallel cannot split it."""
    traits = []
    for layer in find_expert_layers(model):
        module = model.get_submodule(layer.path)
        problem = experts_problem(module)
        if problem:
            traits.append(ModelTrait(kind="experts_not_dispatchable", module=layer.path,
                                     detail=f"{type(module).__name__}: {problem}"))
    return traits


def vocabulary_traits(model: nn.Module, block_prefix: str, vocab: int) -> list[ModelTrait]:
    """vocab_not_split where runtime/parallel/vocab_parallel.py cannot split this model's vocabulary over tp (the very
    check split_vocabulary makes when it runs)."""
    problem = vocabulary_problem(model, block_prefix, vocab)
    return [ModelTrait(kind="vocab_not_split", module="", detail=problem)] if problem else []


def inference_traits(model: nn.Module, summary: ModelSummary) -> list[ModelTrait]:
    """What keeps the inference engine from serving `model` (on the meta device; `summary` its trace), as the engine
    itself judges it when it starts (decoder_spec.recognise): experts_not_served for a mixture of experts,
    decoder_not_recognised for anything else it refuses, with its message; [] when it recognises the model. (The
    engine's start also compares its logits with the model's, which needs weights: compile cannot.)"""
    try:
        recognise(model, summary)
    except UnsupportedExpertsError as error:
        return [ModelTrait(kind="experts_not_served", module=error.module, detail=error.detail)]
    except UnsupportedModelError as error:
        return [ModelTrait(kind="decoder_not_recognised", module=error.module, detail=str(error))]
    return []


def nvfp4_traits(block: nn.Module, block_name: str) -> list[ModelTrait]:
    """A block with no Linear nvfp4 training converts (runtime/precision/nvfp4.py: widths multiples of 16)."""
    if any(nvfp4_convertible(module) for module in block.modules()):
        return []
    return [ModelTrait(kind="no_nvfp4_linears", module=block_name,
                       detail=f"no nn.Linear with both widths multiples of {NVFP4_DIM_MULTIPLE}")]


class _BlockInputs(BaseException):  # raised by the pre-hook: the rest of the model does not run
    pass


def rank_block_problem(model: nn.Module, block: nn.Module, tp_rules: list[TensorParallelRule],
                        example_call: tuple[tuple, dict], tp: int = 2) -> str:
    """Why block 0, run as one of `tp` tensor-parallel ranks runs it (on meta, shapes only: each split projection
    with this rank's slice of its weight, the head counts of modules slicing a fused projection made this rank's,
    as runtime/parallel/tensor_parallel.py does), does not give the block's output shape ('' when it does)."""
    apply_experts(model)  # routed experts run zplan's executor, as parallelize runs them
    def capture(module, args, kwargs):
        raise _BlockInputs(args, kwargs)

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        args, kwargs = example_call
        with torch.no_grad():
            model(*args, **kwargs)
        return ""  # block 0 did not run
    except _BlockInputs as inputs:
        block_args, block_kwargs = inputs.args
    finally:
        handle.remove()
    rank = copy.deepcopy(block)
    for rule in tp_rules:
        projection = rank.get_submodule(rule.module)
        features = projection_features(projection)
        if features is None or features[rule.style == "colwise"] % tp:
            return ""  # the enumerator's divisibility rules decide
        _shrink(projection, rule.style, tp)
        if rule.parts and rule.groups % tp == 0:
            holder = rank.get_submodule(parent_path(rule.module)) if parent_path(rule.module) else rank
            localize_head_counts(holder, FusedLayout(parts=rule.parts, groups=rule.groups), tp)
    def run(module: nn.Module):  # on a copy of the inputs: a key/value cache among them is updated by each call
        args, kwargs = copy.deepcopy((block_args, block_kwargs))
        return module(*args, **kwargs)

    try:
        with torch.no_grad():
            expected, got = run(block), run(rank)
    except Exception as error:
        return f"one rank's part of the block fails ({type(error).__name__}: {str(error)[:200]})"
    expected, got = (out if isinstance(out, torch.Tensor) else out[0] for out in (expected, got))
    if tuple(got.shape) != tuple(expected.shape):
        return f"one rank's part of the block gives {tuple(got.shape)}, the block {tuple(expected.shape)}"
    return ""


def _shrink(projection: nn.Module, style: str, tp: int) -> None:
    """`projection` (an nn.Linear or Conv1D on meta) with one rank's slice of its weight: colwise, out/tp output
    features (Conv1D's nf too, which its forward reads); rowwise, in/tp input features."""
    conv1d = is_conv1d(projection)
    dim = (1 if conv1d else 0) if style == "colwise" else (0 if conv1d else 1)
    shape = list(projection.weight.shape)
    shape[dim] //= tp
    projection.weight = nn.Parameter(torch.empty(shape, device="meta"))
    if style == "colwise" and getattr(projection, "bias", None) is not None:
        projection.bias = nn.Parameter(torch.empty(projection.bias.shape[0] // tp, device="meta"))
    if conv1d and style == "colwise":
        projection.nf //= tp


def split_problem(model: nn.Module, layers: list[LayerCost], example_call: tuple[tuple, dict]) -> str:
    """Why the runtime's own pipeline split (runtime/parallel/pipeline.py), cut in two in the middle of the blocks and
    run on the meta device, does not reproduce the model's forward ('' when it does, or when there are too few
    blocks)."""
    apply_experts(model)  # routed experts run zplan's executor, as parallelize runs them
    blocks = [index for index, layer in enumerate(layers) if layer.kind == "block"]
    if len(blocks) < 2:
        return ""
    cut = blocks[len(blocks) // 2]
    stages = [[path for layer in part for path in layer.modules] for part in (layers[:cut], layers[cut:])]
    args, kwargs = example_call
    if args and kwargs:
        return "the model is called with positional and keyword inputs at once; a pipeline batch is one or the other"
    batch = kwargs if kwargs else args[0] if len(args) == 1 else args
    try:
        check_split(model, split_model(model, stages), batch)
    except PipelineSplitError as error:
        return str(error).split(": every stage")[0]
    return ""
