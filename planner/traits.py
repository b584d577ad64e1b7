"""Find what in a traced model decides which parallelisms zplan's runtime can run on it: ModelTraits
(schemas/capability.py, where RULES says what each rules out).

Each finder mirrors one thing the runtime does (the module docstrings of runtime/parallel/tensor_parallel.py and
runtime/parallel/pipeline.py state those contracts). What the graph shows is judged here; what only running the
runtime's own code on the meta device can tell is asked of `runtime_checks`, which the API layer hands in
(runtime/plan/model_checks.py; without it the planner records only what the graph shows):
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

import math
from collections import deque
from types import ModuleType
from typing import TYPE_CHECKING

from torch import nn

from zplan.model.modules import is_norm, parent_path, unsplit_parameter_owners
from zplan.schemas.capability import ModelTrait
from zplan.schemas.model import LayerCost, TensorParallelRule

if TYPE_CHECKING:
    from zplan.planner.graph import ModelGraph

SLICING_OPS = {"getitem", "split", "chunk", "narrow", "unbind", "split_with_sizes", "tensor_split"}
PASS_THROUGH_OPS = {"dropout", "to", "contiguous", "view", "reshape", "type_as"}


def find_traits(model: nn.Module, graph: ModelGraph, tp_rules: list[TensorParallelRule], layers: list[LayerCost],
                example_call: tuple[tuple, dict], runtime_checks: ModuleType | None = None) -> list[ModelTrait]:
    """Every trait of `model` (on the meta device; `graph` its trace, `tp_rules` the split of each projection of a
    block, `layers` its units in order, `example_call` the (args, kwargs) of one sample); `runtime_checks` the
    runtime's own answers (runtime/plan/model_checks.py, handed in by the API layer), None for the graph's alone."""
    prefix = graph.block_prefix
    block_name = f"{prefix}.0"
    block = model.get_submodule(block_name)
    traits = _tensor_parallel_traits(model, block, block_name, graph, tp_rules)
    pipeline = _block_stacks(model, prefix)
    if runtime_checks is None:
        return [*traits, *pipeline]
    if tp_rules and not traits:
        problem = runtime_checks.rank_block_problem(model, block, tp_rules, example_call)
        if problem:
            traits.append(ModelTrait(kind="forward_not_split_by_heads", module=block_name, detail=problem))
    problem = "" if pipeline else runtime_checks.split_problem(model, layers, example_call)
    if problem:
        pipeline.append(ModelTrait(kind="forward_not_split_by_stages", module="", detail=problem))
    return [*traits, *pipeline, *runtime_checks.fp8_traits(block, block_name),
            *runtime_checks.nvfp4_traits(block, block_name),
            *runtime_checks.context_parallel_traits(model, block, example_call),
            *runtime_checks.expert_traits(model)]


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


def _block_stacks(model: nn.Module, prefix: str) -> list[ModelTrait]:
    """A second stack of blocks beside the one at `prefix`: the pipeline split cuts one stack."""
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
    return traits

