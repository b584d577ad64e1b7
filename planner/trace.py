"""Trace a model file on the meta device into a ModelGraph and a ModelSummary.

This file's job is turning a trace into costs: it runs the tracers (zplan.planner.tracers: fx, hooks,
export, tried in TRACERS order; the first that works wins), then costs each operation, builds the graph,
pairs Linears for tensor parallelism and summarises per layer (what one operation costs: planner/op_costs.py).
Every tracer runs the model for one sample (batch 1) of seq_len tokens, so all numbers are per sample.

Known limits: export sees the causal mask Hugging Face materialises for it (attn_mask, is_causal=False)
and so counts attention in full (hooks, which runs first, sees is_causal=True); operations without a rule
(einsum, convolutions, nn.MultiheadAttention as an fx leaf) count 0 FLOPs.
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from zplan.errors import TraceError
from zplan.model.experts import ExpertLayer, find_expert_layers
from zplan.model.model_file import hf_models_see_whole_sequences, load_model_file, next_token_loss
from zplan.model.modules import is_conv1d, parent_path
from zplan.planner.expert_trace import ROUTED_EXPERTS, experts_as_operations
from zplan.planner.graph import ModelGraph
from zplan.planner.op_costs import (
    ADD_OPS,
    ALIAS_OPS,
    MATMUL_OPS,
    NORM_EXTRA_BYTES_PER_ROW,
    causal_attention_flops,
    element_bytes,
    forward_flops,
    saved_tensors,
    tensor_bytes,
)
from zplan.planner.tracers import SDPA, TRACER_FUNCTIONS, MetaOpCache, RawTrace, TracedOp, as_call
from zplan.planner.traits import find_traits, fused_parts
from zplan.schemas.capability import ModelTrait
from zplan.schemas.model import ExpertsSummary, LayerCost, ModelSummary, TensorParallelRule

DEFAULT_SEQ_LEN = 2048  # tokens per sample when neither the caller nor the model file (SEQ_LEN) says
TRACERS = ("fx", "hooks", "export")  # tried in this order

# --- public entry points ------------------------------------------------------------------------------

def trace_model_file(path: str | Path, seq_len: int | None, precision: str, *,
                     build_overrides: dict[str, Any] | None = None, tracers: tuple[str, ...] = TRACERS,
                     runtime_checks: ModuleType | None = None, serving: bool = False
                     ) -> tuple[ModelGraph, ModelSummary]:
    """Load a model file, build it on meta and trace one sample of seq_len tokens (None: the file's
    SEQ_LEN, else DEFAULT_SEQ_LEN); see trace_module."""
    model_file = load_model_file(path)
    seq_len = seq_len or model_file.seq_len or DEFAULT_SEQ_LEN
    model = model_file.build(device="meta", **(build_overrides or {}))
    with torch.device("meta"):
        inputs = model_file.example_inputs(1, seq_len)
    graph, summary = trace_module(model, inputs, seq_len, precision, name=model_file.name, tracers=tracers,
                                  runtime_checks=runtime_checks, serving=serving)
    if model_file.loss_fn is not next_token_loss:  # context parallel splits only the default loss
        own = ModelTrait(kind="own_loss", module="", detail="the model file defines loss_fn")
        summary = summary.model_copy(update={"traits": [*summary.traits, own]})
    return graph, summary


def trace_module(model: nn.Module, example_inputs: Any, seq_len: int, precision: str, *, name: str = "model",
                 tracers: tuple[str, ...] = TRACERS, runtime_checks: ModuleType | None = None,
                 serving: bool = False) -> tuple[ModelGraph, ModelSummary]:
    """Trace `model` (ideally on meta) called with `example_inputs` (a Tensor, tuple or dict of one sample);
    `runtime_checks`: the runtime's answers to what it can run on it (planner/traits.py find_traits); `serving`
    (compile --mode inference): ask them too whether the inference engine serves it (runtime_checks.inference_traits,
    traits that rule out the "inference" capability)."""
    element_bytes(precision)
    hf_models_see_whole_sequences()  # a module handed in directly, not built from a model file
    prefix, num_blocks = find_block_container(model)
    experts = find_expert_layers(model)
    with experts_as_operations(model, experts):  # each priced by top-k (planner/expert_trace.py)
        raw = run_tracers(model, example_inputs, tracers)
    graph = _build_graph(raw, model, prefix, num_blocks, seq_len, precision)
    return graph, _summarize(graph, raw, model, name, as_call(example_inputs), runtime_checks, experts, serving)


# --- running the tracers (zplan.planner.tracers: a model and one sample -> TracedOps) ------------------

def run_tracers(model: nn.Module, example_inputs: Any, tracers: tuple[str, ...] = TRACERS) -> RawTrace:
    """Try each tracer in order; the first that works gives the trace. All failing raises TraceError."""
    args, kwargs = as_call(example_inputs)
    cache, failures = MetaOpCache(), []
    for tracer in tracers:
        if tracer not in TRACER_FUNCTIONS:
            raise ValueError(f"unknown tracer {tracer!r}; known: {TRACERS}")
        try:
            ops = TRACER_FUNCTIONS[tracer](model, args, kwargs, cache)
        except Exception as exc:  # each tracer fails in its own way; the next one may work
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            failures.append(f"{tracer}: {type(exc).__name__}: {message[:300]}")
            continue
        return RawTrace(tracer=tracer, ops=ops)
    raise TraceError(
        f"could not trace {type(model).__name__} ({'; '.join(failures)}). Make forward() run on the meta "
        "device from shapes alone (no .item(), .tolist() or branches on tensor values), and define "
        "example_inputs(batch_size, seq_len) in the model file if forward does not take token ids (B, T)."
    )


# --- structure ------------------------------------------------------------------------------------------

def find_block_container(model: nn.Module) -> tuple[str, int]:
    """The nn.ModuleList / nn.Sequential whose children all share one class and hold the most parameters:
    the repeated transformer blocks, between which a pipeline may cut. Returns (path, number of blocks)."""
    best: tuple[int, str, int] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        classes = {type(child) for child in module.children()}
        if len(classes) != 1 or not path:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or (size, len(module)) > (best[0], best[2]):
            best = (size, path, len(module))
    if best is None:
        raise TraceError(
            f"{type(model).__name__} has no repeated blocks: hold the transformer layers in an nn.ModuleList "
            "(e.g. self.blocks = nn.ModuleList(Block() for _ in range(n))) so zplan can place pipeline cuts."
        )
    return best[1], best[2]


def _block_of(module_path: str, prefix: str) -> int | None:
    if not module_path.startswith(prefix + "."):
        return None
    head = module_path[len(prefix) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


# --- graph ----------------------------------------------------------------------------------------------

def _build_graph(raw: RawTrace, model: nn.Module, prefix: str, num_blocks: int, seq_len: int,
                 precision: str) -> ModelGraph:
    float_bytes = element_bytes(precision)
    ops = raw.ops
    by_name = {op.name: op for op in ops}
    param_rg = {name: p.requires_grad for name, p in model.named_parameters()}

    requires_grad: dict[str, bool] = {}
    alias_root: dict[str, str] = {}
    for op in ops:
        for arg in op.args:
            arg.requires_grad = (param_rg.get(arg.param, False) if arg.param is not None
                                 else requires_grad.get(arg.producer, False))
        floating = op.dtype is None or op.dtype.is_floating_point
        requires_grad[op.name] = floating and any(arg.requires_grad for arg in op.args)
        source = op.args[0].producer if op.op in ALIAS_OPS and op.args else None
        alias_root[op.name] = alias_root.get(source, op.name) if source else op.name

    charged: set[str] = set()  # alias roots already charged
    seen_params: set[str] = set()
    blocks = [_block_of(op.module, prefix) for op in ops]
    last_block_position = max((i for i, b in enumerate(blocks) if b is not None), default=-1)
    graph = ModelGraph(tracer=raw.tracer, block_prefix=prefix, num_blocks=num_blocks, seq_len=seq_len,
                       precision=precision)
    current_block: int | None = None
    for position, op in enumerate(ops):
        saved_args, saves_output, act_bytes = saved_tensors(op, requires_grad, float_bytes)
        saved = [(op.args[i].producer, op.args[i].shape, op.args[i].dtype) for i in saved_args
                 if op.args[i].param is None and op.args[i].producer is not None]
        if saves_output:
            saved.append((op.name, op.shape, op.dtype))
        for producer, shape, dtype in saved:
            root = alias_root.get(producer, producer)
            if root not in charged:
                charged.add(root)
                act_bytes += tensor_bytes(shape, dtype, float_bytes)
        params = 0
        for arg in op.args:
            if arg.param is not None and arg.param not in seen_params:
                seen_params.add(arg.param)
                params += math.prod(arg.shape or ())
        block = blocks[position]
        if block is not None:
            current_block = block
        elif position > last_block_position:
            current_block = None
        if current_block is not None:
            unit = f"{prefix}.{current_block}"
        else:
            unit = "head" if position > last_block_position >= 0 else "embedding"
        fwd = forward_flops(op)
        graph.add_op(
            op.name, inputs=[a.producer for a in op.args if a.producer in by_name], op=op.op, target=op.target,
            module=op.module, shape=op.shape, dtype=str(op.dtype) if op.dtype is not None else None,
            fwd_flops=fwd, bwd_flops=2.0 * fwd, params=params, param_bytes=params * float_bytes,
            act_bytes=act_bytes, block=current_block, unit=unit,
        )
    _mark_tensor_parallel(graph, model, range(num_blocks))
    return graph


PROJECTION_OPS = {"linear", "addmm"}  # the matmul of an nn.Linear; of transformers' Conv1D (addmm(bias, x, weight))


def _projection(model: nn.Module, module: str | None) -> bool:
    """An nn.Linear or a transformers Conv1D (GPT-2): the modules tensor parallel splits."""
    try:
        found = model.get_submodule(module) if module else None
    except AttributeError:
        return False
    return isinstance(found, nn.Linear) or is_conv1d(found)


def _mark_tensor_parallel(graph: ModelGraph, model: nn.Module, blocks: range) -> None:
    """Megatron pairs (Shoeybi 2019): a projection (nn.Linear or Conv1D) whose output reaches another projection
    of the same block through elementwise / attention operations, before rejoining the residual stream or a norm,
    is colwise, and the projection it reaches is rowwise (q/k/v -> attention -> out; up/gate -> act -> down). The
    style is set on the projection's matmul node."""
    for block in blocks:
        members = graph.nodes_of_block(block)
        if not members:
            continue
        inside = set(members)
        width = graph[members[-1]]["shape"]  # the block's output: the residual stream's shape
        stream: set[str] = set()
        for name in members:
            outside_inputs = [p for p in graph.graph.predecessors(name) if p not in inside]
            stream.update(p for p in outside_inputs if graph[p]["shape"] == width)
            if graph[name]["op"] in ADD_OPS and any(p in stream for p in graph.graph.predecessors(name)):
                stream.add(name)
        nodes_of: dict[str, list[str]] = {}  # projection module -> its nodes, in trace order
        for name in members:
            if _projection(model, graph[name]["module"]):
                nodes_of.setdefault(graph[name]["module"], []).append(name)
        matmul = {module: next((n for n in nodes if graph[n]["op"] in PROJECTION_OPS), None)
                  for module, nodes in nodes_of.items()}
        for module, nodes in nodes_of.items():
            if matmul[module] is None or graph[matmul[module]]["tp_style"] == "rowwise":
                continue
            partners: dict[str, None] = {}
            queue = deque(s for n in nodes for s in graph.graph.successors(n) if graph[s]["module"] != module)
            visited: set[str] = set()
            while queue:
                node = queue.popleft()
                if node in visited or node not in inside or node in stream:
                    continue
                visited.add(node)
                if graph[node]["module"] in matmul and matmul[graph[node]["module"]] is not None:
                    partners[graph[node]["module"]] = None
                elif graph[node]["op"] not in NORM_EXTRA_BYTES_PER_ROW:
                    queue.extend(graph.graph.successors(node))
            if partners:
                graph[matmul[module]]["tp_style"] = "colwise"
                for partner in partners:
                    if graph[matmul[partner]]["tp_style"] is None:
                        graph[matmul[partner]]["tp_style"] = "rowwise"


# --- summary --------------------------------------------------------------------------------------------

def _summarize(graph: ModelGraph, raw: RawTrace, model: nn.Module, name: str,
               example_call: tuple[tuple, dict], runtime_checks: ModuleType | None,
               experts: list[ExpertLayer], serving: bool = False) -> ModelSummary:
    prefix, num_blocks = graph.block_prefix, graph.num_blocks
    by_name = {op.name: op for op in raw.ops}
    units = ["embedding"] + [f"{prefix}.{i}" for i in range(num_blocks)] + ["head"]
    params_of = dict.fromkeys(units, 0.0)
    flops_of = dict.fromkeys(units, 0.0)
    act_of = dict.fromkeys(units, 0.0)
    gemm_of = dict.fromkeys(units, 0.0)  # outputs of the matmuls that read a weight (selective recompute keeps them)
    expert_params_of = dict.fromkeys(units, 0)
    expert_flops_of = dict.fromkeys(units, 0.0)
    expert_act_of = dict.fromkeys(units, 0.0)
    attention_of = dict.fromkeys(units, 0.0)  # the attention cores' QK^T and AV, causal
    modules_of: dict[str, dict[str, None]] = {unit: {} for unit in units}  # ordered sets
    for node, data in graph.iter_nodes():
        reads_parameter = any(arg.param is not None for arg in by_name[node].args)
        if data["module"] is not None and data["unit"] in ("embedding", "head") and reads_parameter:
            modules_of[data["unit"]][data["module"]] = None
        params_of[data["unit"]] += data["params"]
        flops_of[data["unit"]] += data["fwd_flops"]
        act_of[data["unit"]] += data["act_bytes"]
        op = by_name[node]
        if op.op == SDPA and len(op.args) >= 3 and all(arg.shape for arg in op.args[:3]):
            attention_of[data["unit"]] += causal_attention_flops(op)
        if op.op == ROUTED_EXPERTS:
            expert_params_of[data["unit"]] += data["params"]
            expert_flops_of[data["unit"]] += data["fwd_flops"]
            expert_act_of[data["unit"]] += data["act_bytes"]
        if op.op in MATMUL_OPS and reads_parameter:
            gemm_of[data["unit"]] += tensor_bytes(op.shape, op.dtype, element_bytes(graph.precision))
    owner: dict[str, str] = {}  # parameter -> the unit that reads it first, which owns it
    shared_of: dict[str, dict[str, int]] = {unit: {} for unit in units}  # unit -> parameters it reads, owned elsewhere
    for node, data in graph.iter_nodes():
        for arg in by_name[node].args:
            if arg.param is not None and owner.setdefault(arg.param, data["unit"]) != data["unit"]:
                shared_of[data["unit"]][arg.param] = math.prod(arg.shape or ())
    all_params = dict(model.named_parameters())
    unread = sum(p.numel() for p in all_params.values()) - sum(params_of.values())
    params_of["embedding"] += max(unread, 0)  # parameters no traced operation reads (unused modules)
    read = {arg.param for op in raw.ops for arg in op.args if arg.param is not None}
    for param_name in all_params:  # their modules go with the embedding, so that a pipeline stage owns them
        if param_name not in read and not param_name.startswith(prefix + "."):
            modules_of["embedding"][parent_path(param_name)] = None
    layers = [
        LayerCost(name=unit, kind="embedding" if unit == "embedding" else "head" if unit == "head" else "block",
                  params=int(params_of[unit]), shared_params=sum(shared_of[unit].values()),
                  fwd_flops=flops_of[unit], act_bytes=act_of[unit], gemm_out_bytes=gemm_of[unit],
                  expert_params=expert_params_of[unit], expert_fwd_flops=expert_flops_of[unit],
                  expert_act_bytes=expert_act_of[unit], attention_fwd_flops=attention_of[unit],
                  modules=_unit_modules(model, list(modules_of[unit]), prefix) or [unit])
        for unit in units
    ]
    block0 = graph.nodes_of_block(0)
    hidden, vocab = _hidden_and_vocab(graph, by_name, block0)
    heads, kv_heads = _heads(graph, by_name, block0)
    styles = graph.tp_styles(0)
    rowwise_inputs = [by_name[n].args[0].shape[-1] for n in block0
                      if graph[n]["tp_style"] == "rowwise" and by_name[n].args[0].shape]
    linear_outputs = [graph[n]["shape"][-1] for n in block0 if graph[n]["op"] == "linear" and graph[n]["shape"]]
    ffn_hidden = max(rowwise_inputs or linear_outputs or [4 * hidden])
    if experts:  # the MLP of a mixture of experts: one expert's width where no dense MLP is wider
        ffn_hidden = max(ffn_hidden if rowwise_inputs else 0, experts[0].ffn_hidden)
    rules = []
    for module, style in styles.items():
        parts, groups = (fused_parts(graph, model, module) if style == "colwise" else None) or ([], 1)
        rules.append(TensorParallelRule(module=module[len(f"{prefix}.0."):], style=style, parts=parts,
                                        groups=max(groups, 1)))
    summary = ModelSummary(
        name=name, source="file", tracer=graph.tracer, num_blocks=num_blocks, hidden=hidden, heads=heads,
        kv_heads=kv_heads, ffn_hidden=ffn_hidden, vocab=vocab, seq_len=graph.seq_len,
        params=sum(p.numel() for p in all_params.values()), layers=layers, block_prefix=prefix, tp_rules=rules,
        block_tokens=_block_tokens(graph, block0), experts=_experts_summary(experts, all_params), traits=[],
    )
    # the engine's recogniser reads the model as built, before find_traits's checks give routed experts zplan's
    # executor
    serving_traits = runtime_checks.inference_traits(model, summary) if serving and runtime_checks else []
    traits = find_traits(model, graph, rules, layers, example_call, runtime_checks)
    vocabulary = runtime_checks.vocabulary_traits(model, prefix, vocab) if runtime_checks else []
    return summary.model_copy(update={"traits": [*traits, *serving_traits, *vocabulary]})


def _experts_summary(experts: list[ExpertLayer], all_params: dict[str, nn.Parameter]) -> ExpertsSummary | None:
    """The routed experts' numbers; TraceError when MoE blocks differ in E, k or F (zplan prices one kind)."""
    if not experts:
        return None
    kinds = {(layer.num_experts, layer.top_k, layer.ffn_hidden) for layer in experts}
    if len(kinds) > 1:
        raise TraceError(f"the model's experts differ between blocks ({sorted(kinds)} as (experts, top-k, width)): "
                         "zplan plans models whose MoE blocks all route alike")
    first = experts[0]
    routed = sum(layer.expert_params * layer.num_experts for layer in experts)
    total = sum(p.numel() for p in all_params.values())
    active = total - routed + sum(layer.expert_params * layer.top_k for layer in experts)
    return ExpertsSummary(num_experts=first.num_experts, top_k=first.top_k, ffn_hidden=first.ffn_hidden,
                          moe_blocks=len(experts), routed_params=routed, active_params=active)


def _block_tokens(graph: ModelGraph, block0: list[str]) -> int | None:
    """T of block 0's output (B, T, h), the hidden states sequence parallel splits; None when not 3-d."""
    shape = graph[block0[-1]]["shape"] if block0 else None
    return int(shape[1]) if shape is not None and len(shape) == 3 else None


def _unit_modules(model: nn.Module, paths: list[str], block_prefix: str) -> list[str]:
    """The modules of the embedding or the head, in order: the outermost of those whose operations read parameters
    (`paths`), each set of them replaced by their parent while the parent holds no parameters but theirs and no
    block ('bert.embeddings' for its embeddings and norm; not 'model', which holds the blocks too)."""
    paths = _outermost(paths)
    while True:
        held = {id(p) for path in paths for p in model.get_submodule(path).parameters()}
        parents = [parent_path(path) for path in paths]
        grown = next((parent for parent in parents if parent and not (block_prefix + ".").startswith(parent + ".")
                      and {id(p) for p in model.get_submodule(parent).parameters()} <= held), None)
        if grown is None:
            return paths
        first = parents.index(grown)
        paths = _outermost([*paths[:first], grown, *paths[first:]])


def _outermost(paths: list[str]) -> list[str]:
    """`paths` without those inside another of them ('bert.embeddings.word_embeddings' runs as part of
    'bert.embeddings'), in order: a pipeline stage owns each module once."""
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q)]


def _hidden_and_vocab(graph: ModelGraph, by_name: dict[str, TracedOp], block0: list[str]) -> tuple[int, int]:
    """(h, V) from the token embedding's weight (V, h): the embedding fed by the model's input ids, else the one whose
    rows are the head's outputs (a Hugging Face GPT-2 reshapes its ids first, and its position table can be the
    larger), else the largest."""
    embeddings = [by_name[n] for n, data in graph.iter_nodes(op="embedding")]
    tables = [(op, arg.shape) for op in embeddings for arg in op.args if arg.param is not None and arg.shape]
    fed_by_input = [(op, shape) for op, shape in tables
                    if any(a.producer and graph[a.producer]["op"] == "input" for a in op.args)]
    outputs = [graph[n]["shape"] for n in graph.nodes() if graph[n]["unit"] == "head" and graph[n]["shape"]]
    head_rows = [(op, shape) for op, shape in tables if outputs and shape[0] == outputs[-1][-1]]
    chosen = fed_by_input or head_rows or sorted(tables, key=lambda t: -t[1][0])
    if chosen:
        return int(chosen[0][1][1]), int(chosen[0][1][0])
    hidden = int(graph[block0[-1]]["shape"][-1]) if block0 else 1
    return hidden, int(outputs[-1][-1]) if outputs else 1


def _heads(graph: ModelGraph, by_name: dict[str, TracedOp], block0: list[str]) -> tuple[int, int]:
    """(heads, kv_heads) from the first attention of block 0: q (B, H, T, D), k (B, Hkv, S, D). When k was
    repeated to H heads before attention, the ratio of the k and q projections' widths gives Hkv."""
    for name in block0:
        op = by_name[name]
        if op.op == SDPA and len(op.args) >= 2 and op.args[0].shape and len(op.args[0].shape) >= 3:
            heads, kv_heads = op.args[0].shape[-3], op.args[1].shape[-3]
            q_linear, k_linear = (_nearest_linear_above(graph, a.producer) for a in op.args[:2])
            if kv_heads == heads and q_linear and k_linear and q_linear != k_linear:
                q_width, k_width = graph[q_linear]["shape"][-1], graph[k_linear]["shape"][-1]
                if k_width < q_width and (heads * k_width) % q_width == 0:
                    kv_heads = heads * k_width // q_width
            return int(heads), int(kv_heads)
        if op.op in {"matmul", "bmm"} and op.shape and len(op.shape) == 4 and all(a.param is None for a in op.args):
            return int(op.shape[-3]), int(op.shape[-3])  # unfused attention scores (B, H, T, S)
    return 1, 1


def _nearest_linear_above(graph: ModelGraph, start: str | None) -> str | None:
    queue, visited = deque([start] if start else []), set()
    while queue:
        name = queue.popleft()
        if name in visited:
            continue
        visited.add(name)
        if graph[name]["op"] == "linear":
            return name
        queue.extend(graph.graph.predecessors(name))
    return None


