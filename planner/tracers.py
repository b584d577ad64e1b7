"""Tracers: run a model for one sample on the meta device and record its operations as TracedOps.

Three tracers produce the same normalised list of operations (TracedOp), in execution order:
  fx      torch.fx.symbolic_trace, then shapes by running the graph on meta tensors;
  hooks   the forward runs eagerly on meta tensors under a TorchFunctionMode that records every torch
          call, with module forward hooks naming the module that made it (handles Python control flow,
          e.g. Hugging Face models, which symbolic tracing cannot);
  export  torch.export.export(strict=False) on meta, read from its aten graph.
Which to try, in what order, and what the operations cost is zplan.planner.trace's job.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zplan.model.meta_ops import (
    MetaOpCache,
    function_name,
    is_inplace,
    tensors_in,
)

SDPA = "scaled_dot_product_attention"  # normalised name of attention in any of its forms (see _op_name)
DROPOUT_OPS = {"dropout", "native_dropout", "feature_dropout"}  # their attrs carry dropout_p


@dataclass
class TensorArg:
    """One tensor an operation reads: another operation's output, a parameter, or a constant."""

    producer: str | None  # name of the TracedOp that made it (None for parameters and constants)
    param: str | None  # canonical parameter name (tied weights share one) when it is a parameter
    shape: tuple[int, ...] | None  # None for a tuple of tensors (the input of a getitem)
    dtype: torch.dtype | None
    requires_grad: bool = False  # filled in by trace._build_graph


@dataclass
class TracedOp:
    name: str
    op: str  # normalised: 'linear', 'scaled_dot_product_attention', 'add', 'view', 'input', ...
    target: str
    module: str  # innermost module path that ran it ('' at the top level)
    args: list[TensorArg]
    shape: tuple[int, ...] | None  # None when the operation returns several tensors
    dtype: torch.dtype | None
    attrs: dict[str, Any] = field(default_factory=dict)  # is_causal, dropout_p


@dataclass
class RawTrace:
    tracer: str
    ops: list[TracedOp]


_OPERATOR_NAMES = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_", "iadd": "add_", "__sub__": "sub", "__rsub__": "sub",
    "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "imul": "mul_", "__truediv__": "div",
    "__rtruediv__": "div", "truediv": "div", "__matmul__": "matmul", "__rmatmul__": "matmul",
    "__getitem__": "getitem", "__neg__": "neg", "__pow__": "pow", "__rpow__": "pow",
}
_MODULE_OPS = {nn.Linear: "linear", nn.Embedding: "embedding", nn.LayerNorm: "layer_norm", nn.RMSNorm: "rms_norm",
               nn.GroupNorm: "group_norm", nn.Dropout: "dropout", nn.Identity: "identity"}
def _op_name(raw: str) -> str:
    if "scaled_dot_product" in raw:
        return SDPA  # F.scaled_dot_product_attention and its aten kernels
    return _OPERATOR_NAMES.get(raw, raw)


class _ParamNames:
    """Canonical names of a model's parameters and buffers, by object identity (tied weights: first name)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {id(p): name for name, p in model.named_parameters()}

    def arg(self, value: torch.Tensor, producer: str | None) -> TensorArg:
        return TensorArg(producer=None if id(value) in self.params else producer, param=self.params.get(id(value)),
                         shape=tuple(value.shape), dtype=value.dtype)


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph nodes an fx node reads, in argument order, repeats kept (mul(x, x) reads x twice)."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _argument(args: tuple, kwargs: dict, name: str, index: int, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _attrs(op: str, args: tuple, kwargs: dict, schema: Any = None, module: nn.Module | None = None) -> dict:
    """The non-tensor arguments the cost rules need: is_causal for attention, p for dropout."""
    def value(name: str, index: int, default: Any) -> Any:
        if schema is not None:
            names = [a.name for a in schema.arguments]
            index = names.index(name) if name in names else 10**6
        return _argument(args, kwargs, name, index, default)

    if op == SDPA:
        return {"is_causal": bool(value("is_causal", 5, False))}
    if op in DROPOUT_OPS:
        if isinstance(module, nn.Dropout):
            return {"dropout_p": module.p if module.training else 0.0}
        training = value("training" if schema is None else "train", 2, True)
        return {"dropout_p": float(value("p", 1, 0.5)) if training else 0.0}
    return {}


def as_call(example_inputs: Any) -> tuple[tuple, dict]:
    """Tensor -> (tensor,); tuple/list -> positional; dict -> keywords; tensors moved to meta."""
    def meta(value: Any) -> Any:
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    if isinstance(example_inputs, dict):
        return (), {key: meta(value) for key, value in example_inputs.items()}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(meta(value) for value in example_inputs), {}
    return (meta(example_inputs),), {}


class _CachingInterpreter(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, cache: MetaOpCache) -> None:
        super().__init__(module, garbage_collect_values=False)
        self.cache = cache

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        module = self.fetch_attr(target)
        shapes = tuple((n, tuple(t.shape), t.dtype) for n, t in module.state_dict(keep_vars=True).items())
        return self.cache.call(("module", type(module), module.extra_repr(), shapes), module, args, kwargs)

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if is_inplace(function_name(target)):
            return target(*args, **kwargs)
        return self.cache.call(("function", target), target, args, kwargs)

    def call_method(self, target: str, args: tuple, kwargs: dict) -> Any:
        if is_inplace(target):
            return getattr(args[0], target)(*args[1:], **kwargs)
        return self.cache.call(("method", target), lambda s, *a, **k: getattr(s, target)(*a, **k), args, kwargs)


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict, cache: MetaOpCache) -> list[TracedOp]:
    if kwargs:
        raise TypeError("fx replays positional inputs only; example_inputs returned keywords")
    # inputs the call leaves at a default of None (a position_ids=None) are traced as None, not as proxies
    unset = list(inspect.signature(model.forward).parameters.values())[len(args):]
    module = torch.fx.symbolic_trace(model, concrete_args={p.name: None for p in unset if p.default is None} or None)
    interpreter = _CachingInterpreter(module, cache)
    interpreter.run(*args)
    values, names, ops = interpreter.env, _ParamNames(model), []
    for node in module.graph.nodes:
        value = values.get(node)
        if node.op in ("get_attr", "output") or not tensors_in(value):
            continue
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        path, module_type = (stack[-1][0], stack[-1][1]) if stack else ("", None)
        args_out = []
        for arg_node in _input_nodes(node):
            arg_value = values.get(arg_node)
            if isinstance(arg_value, torch.Tensor):
                args_out.append(names.arg(arg_value, None if arg_node.op == "get_attr" else arg_node.name))
            elif tensors_in(arg_value):
                args_out.append(TensorArg(arg_node.name, None, None, None))
        leaf = module.get_submodule(node.target) if node.op == "call_module" else None
        if leaf is not None:
            raw = _MODULE_OPS.get(type(leaf), type(leaf).__name__.lower())
            args_out += [names.arg(p, None) for p in leaf.parameters()]
        elif node.op == "placeholder":
            raw = "input"
        else:
            raw = node.target if node.op == "call_method" else function_name(node.target)
        op = _op_name(raw)
        single = isinstance(value, torch.Tensor)
        ops.append(TracedOp(
            name=node.name, op=op, target=str(node.target), module=path if module_type is not None else "",
            args=args_out, shape=tuple(value.shape) if single else None, dtype=value.dtype if single else None,
            attrs=_attrs(op, node.args, node.kwargs, module=leaf),
        ))
    return ops


class _FunctionRecorder(torch.overrides.TorchFunctionMode):
    """Records every torch function / Tensor method call that returns tensors (the 'hooks' tracer)."""

    def __init__(self, names: _ParamNames, cache: MetaOpCache, module_stack: list[str]) -> None:
        super().__init__()
        self.names, self.cache, self.module_stack = names, cache, module_stack
        self.ops: list[TracedOp] = []
        self.producer: dict[int, str] = {}  # id(tensor) -> op name
        self.keep_alive: list[Any] = []  # outputs stay referenced so ids stay unique

    def add(self, op: TracedOp, outputs: list[torch.Tensor]) -> None:
        self.ops.append(op)
        self.keep_alive.append(outputs)
        if op.shape is not None:
            self.producer[id(outputs[0])] = op.name
            return
        for index, tensor in enumerate(outputs):
            name = f"{op.name}_{index}"
            self.ops.append(TracedOp(name, "getitem", "getitem", op.module, [TensorArg(op.name, None, None, None)],
                                     tuple(tensor.shape), tensor.dtype))
            self.producer[id(tensor)] = name

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        raw = function_name(func)
        if is_inplace(raw):
            out = func(*args, **kwargs)
        else:
            out = self.cache.call(("function", func), func, args, kwargs)
        outputs = tensors_in(out) if isinstance(out, (torch.Tensor, tuple, list)) else []
        if outputs:
            op = _op_name(raw)
            tensor_args = [self.names.arg(t, self.producer.get(id(t))) for t in tensors_in((args, kwargs))]
            single = isinstance(out, torch.Tensor)
            self.add(TracedOp(f"{op}_{len(self.ops)}", op, raw, self.module_stack[-1] if self.module_stack else "",
                              tensor_args, tuple(out.shape) if single else None, out.dtype if single else None,
                              _attrs(op, args, kwargs)), outputs)
        return out


def _trace_hooks(model: nn.Module, args: tuple, kwargs: dict, cache: MetaOpCache) -> list[TracedOp]:
    stack: list[str] = []
    recorder = _FunctionRecorder(_ParamNames(model), cache, stack)
    for index, tensor in enumerate(tensors_in((args, kwargs))):
        recorder.add(TracedOp(f"input_{index}", "input", "input", "", [], tuple(tensor.shape), tensor.dtype),
                     [tensor])

    def enter(path: str) -> Any:
        return lambda _module, _args: stack.append(path)  # returns None: inputs unchanged

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        stack.pop()  # returning None keeps the output unchanged

    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(path)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with torch.device("meta"), recorder:
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return recorder.ops


class _TensorOutputs(nn.Module):
    """Wraps a model so its outputs are a tuple of tensors (export rejects e.g. Hugging Face caches)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return tuple(tensors_in(self.inner(*args, **kwargs)))


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch.export logs graphs and guard failures at warning level; a failed fallback must not spill
    them onto the user's terminal (the TraceError says what went wrong)."""
    logging.disable(logging.CRITICAL)  # torch sets levels on its child loggers: disable them all
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def _trace_export(model: nn.Module, args: tuple, kwargs: dict, cache: MetaOpCache) -> list[TracedOp]:
    wrapper = _TensorOutputs(model)
    with _quiet_torch_logs():
        program = torch.export.export(wrapper, args, kwargs, strict=False)
    signature, names = program.graph_signature, _ParamNames(model)
    param_of = {placeholder: names.params.get(id(wrapper.get_parameter(fqn)))
                for placeholder, fqn in signature.inputs_to_parameters.items()}
    user_inputs, ops = set(signature.user_inputs), []
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" and node.name not in user_inputs or not tensors_in(value):
            continue
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        path = stack[-1][0].removeprefix("inner").removeprefix(".") if stack else ""
        args_out: list[TensorArg] = []
        for arg in _input_nodes(node):
            arg_value = arg.meta.get("val")
            if arg.name in param_of:
                args_out.append(TensorArg(None, param_of[arg.name], tuple(arg_value.shape), arg_value.dtype))
            elif isinstance(arg_value, torch.Tensor):
                producer = arg.name if arg.op == "call_function" or arg.name in user_inputs else None
                args_out.append(TensorArg(producer, None, tuple(arg_value.shape), arg_value.dtype))
            elif tensors_in(arg_value):
                args_out.append(TensorArg(arg.name, None, None, None))
        schema = getattr(node.target, "_schema", None)
        raw = "input" if node.op == "placeholder" else getattr(node.target, "_opname", function_name(node.target))
        op = _op_name(raw)
        single = isinstance(value, torch.Tensor)
        ops.append(TracedOp(node.name, op, str(node.target), path, args_out,
                            tuple(value.shape) if single else None, value.dtype if single else None,
                            _attrs(op, node.args, node.kwargs, schema=schema)))
    return ops


TRACER_FUNCTIONS = {"fx": _trace_fx, "hooks": _trace_hooks, "export": _trace_export}
