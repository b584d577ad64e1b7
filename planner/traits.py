"""Find what in a traced model decides which parallelisms zplan's runtime can run on it: ModelTraits
(schemas/capability.py, where RULES says what each rules out).

Each finder mirrors one thing the runtime does (the module docstrings of runtime/tensor_parallel.py and
runtime/pipeline.py state those contracts):
  tensor parallel  splits the nn.Linear pairs the trace marked colwise / rowwise, whole heads per rank; a
                   module with parameters inside a module that holds split Linears (a q/k norm, a post-LN
                   LayerNorm, a relative position bias) would see one rank's features only;
  sequence parallel runs the blocks' norms on this rank's tokens; any other module with parameters, or a norm
                   applied to a row-split Linear's output before the residual add (sandwich norms), breaks it;
  pipeline         runs the model's own forward on every stage with the other stages' units stood in for, one
                   stack of blocks: the runtime's split is run on the meta device at a two-stage cut and must
                   reproduce the forward's output.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Literal

from torch import nn

from zplan.schemas.capability import ModelTrait
from zplan.schemas.model import LayerCost

if TYPE_CHECKING:  # runtime/tensor_parallel.py imports this module: no networkx at run time
    from zplan.planner.graph import ModelGraph

SLICING_OPS = {"getitem", "split", "chunk", "narrow", "unbind", "split_with_sizes", "tensor_split"}
PASS_THROUGH_OPS = {"dropout", "to", "contiguous", "view", "reshape", "type_as"}


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm and model files' own *Norm classes (e.g. LlamaRMSNorm)."""
    return type(module).__name__.endswith("Norm")


def parent_path(path: str) -> str:
    """'attn.q' -> 'attn'; 'qkv' -> '' (the block itself)."""
    return path.rpartition(".")[0]


def unsplit_parameter_owners(block: nn.Module, split: set[str]
                             ) -> list[tuple[str, nn.Module, Literal["beside", "norm", "other"]]]:
    """The modules of `block` that own parameters and are not among the `split` Linears (paths in the block),
    each with its role under tensor parallel: 'beside' (inside a module holding split Linears: it would see one
    rank's features or heads), 'norm' (elsewhere, a norm: sequence parallel runs it on this rank's tokens) or
    'other' (elsewhere: replicated, but under sequence parallel it would see one rank's tokens). The runtime's
    check_block_split and the tracer's traits both judge by this."""
    holders = {parent_path(path) for path in split} - {""}
    owners = []
    for name, module in block.named_modules():
        if name in split or not any(p is not None for p in module._parameters.values()):
            continue
        if name in holders or any(name.startswith(holder + ".") for holder in holders):
            owners.append((name, module, "beside"))
        else:
            owners.append((name, module, "norm" if name and is_norm(module) else "other"))
    return owners


def find_traits(model: nn.Module, graph: ModelGraph, tp_rules: dict[str, str], layers: list[LayerCost],
                example_call: tuple[tuple, dict]) -> list[ModelTrait]:
    """Every trait of `model` (on the meta device; `graph` its trace, `tp_rules` block-relative Linear path ->
    style, `layers` its units in order, `example_call` the (args, kwargs) of one sample)."""
    prefix = graph.block_prefix
    block = model.get_submodule(f"{prefix}.0")
    return [*_tensor_parallel_traits(block, f"{prefix}.0", graph, tp_rules),
            *_pipeline_traits(model, prefix, layers, example_call)]


# ---- tensor and sequence parallel -----------------------------------------------------------------------------


def _tensor_parallel_traits(block: nn.Module, block_name: str, graph: ModelGraph,
                            tp_rules: dict[str, str]) -> list[ModelTrait]:
    if not tp_rules:
        kinds = sorted({type(m).__name__ for m in block.modules() if type(m).__name__ in ("Conv1D", "Conv1d")})
        detail = (f"its projections are {', '.join(kinds)} modules, not nn.Linear" if kinds
                  else "no nn.Linear feeds another through attention or an activation")
        return [ModelTrait(kind="no_tensor_parallel_rules", module=block_name, detail=detail)]
    traits = []
    for name, module, role in unsplit_parameter_owners(block, set(tp_rules)):
        where = f"{block_name}.{name}" if name else block_name
        holder = f"{block_name}.{parent_path(name) or name}"
        if role == "beside":
            traits.append(ModelTrait(kind="parameters_beside_split_linears", module=where,
                                     detail=f"a {type(module).__name__} inside {holder}"))
        elif role == "other":
            traits.append(ModelTrait(kind="parameters_outside_split_linears", module=where,
                                     detail=f"a {type(module).__name__} with parameters, not a norm"))
    first = graph.nodes_of_block(0)
    for node in first:
        data = graph[node]
        if data["tp_style"] == "colwise" and _is_fused(graph, node):
            traits.append(ModelTrait(kind="fused_projection", module=data["module"],
                                     detail="one Linear whose output is sliced into several projections"))
        if data["tp_style"] == "rowwise" and _norm_before_residual(graph, node, block):
            traits.append(ModelTrait(kind="parameters_outside_split_linears", module=data["module"],
                                     detail="its output goes through a norm before the residual add"))
    return traits


def _is_fused(graph: ModelGraph, node: str) -> bool:
    """The Linear's output is cut into parts: sliced twice or more, or split / chunked / unbound once."""
    consumers = [graph[n]["op"] for n in graph.graph.successors(node)]
    slices = [op for op in consumers if op in SLICING_OPS]
    return len(slices) >= 2 or any(op in SLICING_OPS - {"getitem"} for op in slices)


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
    """Why the runtime's own pipeline split (runtime/pipeline.py), cut in two in the middle of the blocks and run on
    the meta device, does not reproduce the model's forward ('' when it does, or when there are too few blocks)."""
    from zplan.runtime.pipeline import PipelineSplitError, check_split, split_model  # torch only, no process group

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
