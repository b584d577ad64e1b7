"""Find what in a traced model decides which parallelisms zplan's runtime can run on it: ModelTraits
(schemas/capability.py, where RULES says what each rules out).

Each finder mirrors one thing the runtime does (the module docstrings of runtime/parallel/tensor_parallel.py and
runtime/parallel/pipeline.py state those contracts):
  tensor parallel  splits the nn.Linear (or Conv1D) pairs the trace marked colwise / rowwise, whole heads per
                   rank, a fused projection by its parts (which the trace must tell); a module with parameters
                   inside a module that holds split Linears (a q/k norm, a post-LN LayerNorm, a relative
                   position bias) would see one rank's features only; block 0 is run on the meta device as one
                   of two ranks runs it and must give the block's output shape;
  sequence parallel runs the blocks' norms on this rank's tokens; any other module with parameters, or a norm
                   applied to a row-split Linear's output before the residual add (sandwich norms), breaks it;
  pipeline         runs the model's own forward on every stage with the other stages' units stood in for, one
                   stack of blocks: the runtime's split is run on the meta device at a two-stage cut and must
                   reproduce the forward's output.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from typing import TYPE_CHECKING

import torch
from torch import nn

from zplan.model.modules import is_conv1d, is_norm, parent_path, unsplit_parameter_owners
from zplan.schemas.capability import FP8_DIM_MULTIPLE, NVFP4_DIM_MULTIPLE, ModelTrait
from zplan.schemas.model import LayerCost, TensorParallelRule

if TYPE_CHECKING:  # runtime/parallel/tensor_parallel.py imports this module: no networkx at run time
    from zplan.planner.graph import ModelGraph

SLICING_OPS = {"getitem", "split", "chunk", "narrow", "unbind", "split_with_sizes", "tensor_split"}
PASS_THROUGH_OPS = {"dropout", "to", "contiguous", "view", "reshape", "type_as"}


def find_traits(model: nn.Module, graph: ModelGraph, tp_rules: list[TensorParallelRule], layers: list[LayerCost],
                example_call: tuple[tuple, dict]) -> list[ModelTrait]:
    """Every trait of `model` (on the meta device; `graph` its trace, `tp_rules` the split of each projection of a
    block, `layers` its units in order, `example_call` the (args, kwargs) of one sample)."""
    prefix = graph.block_prefix
    block = model.get_submodule(f"{prefix}.0")
    traits = _tensor_parallel_traits(model, block, f"{prefix}.0", graph, tp_rules)
    if tp_rules and not traits:
        problem = _rank_block_problem(model, block, tp_rules, example_call)
        if problem:
            traits.append(ModelTrait(kind="forward_not_split_by_heads", module=f"{prefix}.0", detail=problem))
    return [*traits, *_pipeline_traits(model, prefix, layers, example_call), *_fp8_traits(block, f"{prefix}.0"),
            *_nvfp4_traits(block, f"{prefix}.0"), *_context_parallel_traits(model, block, example_call)]


class _BlockDone(BaseException):  # raised after block 0's forward: the rest of the model need not run
    pass


def _context_parallel_traits(model: nn.Module, block: nn.Module, example_call: tuple[tuple, dict]
                             ) -> list[ModelTrait]:
    """What runtime/parallel/context_parallel.py needs of a forward: it takes position_ids, and its attention is causal
    self-attention through F.scaled_dot_product_attention (the calls of the model's forward on meta up to the end of
    block 0, as every block attends alike, are recorded: none, one without a causal flag or mask, one whose queries
    and keys differ in length, or a config's sliding window)."""
    from torch.overrides import TorchFunctionMode

    from zplan.runtime.parallel.context_parallel import accepts_position_ids

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


def _fp8_traits(block: nn.Module, block_name: str) -> list[ModelTrait]:
    """A block with no Linear fp8 training converts (GPT-2's Conv1D projections, widths off the multiple)."""
    from zplan.runtime.precision.float8 import (
        fp8_convertible,  # torch only; torchao is imported by the conversion alone
    )

    if any(fp8_convertible(module) for module in block.modules()):
        return []
    return [ModelTrait(kind="no_fp8_linears", module=block_name,
                       detail=f"no nn.Linear with both widths multiples of {FP8_DIM_MULTIPLE}")]


def _nvfp4_traits(block: nn.Module, block_name: str) -> list[ModelTrait]:
    """A block with no Linear nvfp4 training converts (runtime/precision/nvfp4.py: widths multiples of 16)."""
    from zplan.runtime.precision.nvfp4 import (
        nvfp4_convertible,  # torch only; torchao is imported by the conversion alone
    )

    if any(nvfp4_convertible(module) for module in block.modules()):
        return []
    return [ModelTrait(kind="no_nvfp4_linears", module=block_name,
                       detail=f"no nn.Linear with both widths multiples of {NVFP4_DIM_MULTIPLE}")]


# ---- tensor and sequence parallel -----------------------------------------------------------------------------


def _tensor_parallel_traits(model: nn.Module, block: nn.Module, block_name: str, graph: ModelGraph,
                            tp_rules: list[TensorParallelRule]) -> list[ModelTrait]:
    if not tp_rules:
        return [ModelTrait(kind="no_tensor_parallel_rules", module=block_name,
                           detail="no nn.Linear or Conv1D feeds another through attention or an activation")]
    traits = []
    for name, module, role in unsplit_parameter_owners(block, {rule.module for rule in tp_rules}):
        where = f"{block_name}.{name}" if name else block_name
        holder = f"{block_name}.{parent_path(name) or name}"
        if role == "beside":
            traits.append(ModelTrait(kind="parameters_beside_split_linears", module=where,
                                     detail=f"a {type(module).__name__} inside {holder}"))
        elif role == "other":
            traits.append(ModelTrait(kind="parameters_outside_split_linears", module=where,
                                     detail=f"a {type(module).__name__} with parameters, not a norm"))
    styles = {f"{block_name}.{rule.module}": rule for rule in tp_rules}
    for node in graph.nodes_of_block(0):
        data = graph[node]
        rule = styles.get(data["module"]) if data["tp_style"] else None
        if rule and rule.style == "colwise" and fused_parts(graph, model, data["module"]) == ([], 0):
            traits.append(ModelTrait(kind="fused_projection", module=data["module"],
                                     detail="one projection whose output is cut into parts of unknown widths"))
        if rule and rule.style == "rowwise" and _norm_before_residual(graph, node, block):
            traits.append(ModelTrait(kind="parameters_outside_split_linears", module=data["module"],
                                     detail="its output goes through a norm before the residual add"))
    return traits


def fused_parts(graph: ModelGraph, model: nn.Module, module: str) -> tuple[list[int], int] | None:
    """(parts, groups) of a colwise projection whose output the forward cuts into several projections, or None
    when it is one projection. parts: the widths of the slices of its output, in trace order (split / chunk:
    their results in order; slices qkv[..., a:b]: one after another), which must add up to its output features;
    groups: each part cut into whole heads (head_dim of the module holding it) or features, the most groups that
    divide every part. ([], 0) when it is cut in a way this cannot describe, or reshaped so that its features
    become three dimensions or more (view(B, T, 3, heads, head_dim) cut later: a rank's features would mix q, k
    and v whatever the order, so tensor parallel is refused)."""
    nodes = [n for n, data in graph.iter_nodes() if data["module"] == module]
    output = nodes[-1]
    out_features = graph[output]["shape"][-1] if graph[output]["shape"] else None
    consumers = [n for n in graph.graph.successors(output) if graph[n]["module"] != module]
    sliced = [n for n in consumers if graph[n]["op"] in SLICING_OPS]
    out_shape = graph[output]["shape"]
    for n in consumers:  # (B, T, F) viewed as (B, T, 3, heads, head_dim)
        shape = graph[n]["shape"]
        if (graph[n]["op"] in ("view", "reshape") and out_shape and shape and len(shape) >= len(out_shape) + 2
                and tuple(shape[:len(out_shape) - 1]) == tuple(out_shape[:-1])):
            return [], 0
    if not sliced or (len(sliced) == 1 and graph[sliced[0]]["op"] == "getitem"):
        return None
    if out_features is None or len(sliced) != len(consumers):
        return [], 0
    if len(sliced) == 1:  # split / chunk / unbind: the getitems of its results, in order
        sliced = list(graph.graph.successors(sliced[0]))
    shapes = [graph[n]["shape"] for n in sliced]
    if any(not shape or len(shape) != len(graph[output]["shape"]) for shape in shapes):
        return [], 0
    parts = [s[-1] for s in shapes]
    if sum(parts) != out_features:
        return [], 0
    holder = model.get_submodule(parent_path(module)) if parent_path(module) else None
    head_dim = getattr(holder, "head_dim", None)
    unit = head_dim if isinstance(head_dim, int) and all(p % head_dim == 0 for p in parts) else 1
    return parts, math.gcd(*(p // unit for p in parts))


class _BlockInputs(BaseException):  # raised by the pre-hook: the rest of the model does not run
    pass


def _rank_block_problem(model: nn.Module, block: nn.Module, tp_rules: list[TensorParallelRule],
                        example_call: tuple[tuple, dict], tp: int = 2) -> str:
    """Why block 0, run as one of `tp` tensor-parallel ranks runs it (on meta, shapes only: each split projection
    with this rank's slice of its weight, the head counts of modules slicing a fused projection made this rank's,
    as runtime/parallel/tensor_parallel.py does), does not give the block's output shape ('' when it does)."""
    from zplan.model.fused_layout import FusedLayout
    from zplan.runtime.parallel.tensor_parallel import localize_head_counts, projection_features

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


def _norm_before_residual(graph: ModelGraph, node: str, block: nn.Module) -> bool:
    """A rowwise Linear whose output reaches a norm module before any add (Gemma-2's post-attention norm)."""
    prefix = graph[node]["module"].split(".")
    block_path = ".".join(prefix[:len(graph.block_prefix.split(".")) + 1])
    queue, seen = deque(graph.graph.successors(node)), set()
    while queue:
        name = queue.popleft()
        if name in seen:
            continue
        seen.add(name)
        data = graph[name]
        if data["op"] in ("add", "add_"):
            return False
        module = data["module"] or ""
        relative = module[len(block_path) + 1:] if module.startswith(block_path + ".") else None
        if relative and is_norm(block.get_submodule(relative)):
            return True
        if data["op"] in PASS_THROUGH_OPS or (relative is not None and data["op"] != "linear"):
            queue.extend(graph.graph.successors(name))
    return False


# ---- pipeline ------------------------------------------------------------------------------------------------


def _pipeline_traits(model: nn.Module, prefix: str, layers: list[LayerCost],
                     example_call: tuple[tuple, dict]) -> list[ModelTrait]:
    traits = []
    stack_params = sum(p.numel() for p in model.get_submodule(prefix).parameters())
    for path, module in model.named_modules():
        if (not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2 or path == prefix
                or path.startswith(prefix + ".") or prefix.startswith(path + ".")
                or len({type(child) for child in module.children()}) != 1):
            continue
        if sum(p.numel() for p in module.parameters()) >= stack_params / 4:  # another stack of blocks, not a list
            traits.append(ModelTrait(kind="several_block_stacks", module=path,
                                     detail=f"a second stack of {len(module)} {type(module[0]).__name__}"))
    problem = "" if traits else _split_problem(model, layers, example_call)
    if problem:
        traits.append(ModelTrait(kind="forward_not_split_by_stages", module="", detail=problem))
    return traits


def _split_problem(model: nn.Module, layers: list[LayerCost], example_call: tuple[tuple, dict]) -> str:
    """Why the runtime's own pipeline split (runtime/parallel/pipeline.py), cut in two in the middle of the blocks and
    run on the meta device, does not reproduce the model's forward ('' when it does, or when there are too few
    blocks)."""
    from zplan.runtime.parallel.pipeline import (  # torch only, no process group
        PipelineSplitError,
        check_split,
        split_model,
    )

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
