"""Each distinct operation on meta tensors run once: a forward of a deep model on the meta device in the time of a
few blocks. The tracer (planner/tracers.py) and the pipeline split's check on the meta device
(runtime/parallel/pipeline_split.py) both run under it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size, torch.layout,
                   torch.memory_format, type(Ellipsis))


_UNCACHEABLE = object()


def is_inplace(raw: str) -> bool:
    return (raw.endswith("_") and not raw.startswith("_")) or raw in {"__iadd__", "__imul__", "iadd", "imul",
                                                                        "__isub__", "__itruediv__", "__setitem__"}


def function_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # a property such as Tensor.T or Tensor.data
        name = getattr(getattr(func, "__self__", None), "__name__", "get")
    return name


def _cache_key(value: Any) -> Any:
    """A hashable description of an argument: tensors by metadata, constants by value."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta" or type(value) not in (torch.Tensor, nn.Parameter):
            return _UNCACHEABLE  # a DTensor's op gives a DTensor: never the plain output cached for its shape
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.requires_grad)
    if isinstance(value, (tuple, list)):
        parts = tuple(_cache_key(item) for item in value)
        return _UNCACHEABLE if any(p is _UNCACHEABLE for p in parts) else (type(value).__name__, parts)
    if isinstance(value, dict):
        parts = tuple((key, _cache_key(item)) for key, item in value.items())
        return _UNCACHEABLE if any(p is _UNCACHEABLE for _, p in parts) else ("dict", parts)
    if isinstance(value, slice):
        return _cache_key((value.start, value.stop, value.step))
    if isinstance(value, _CONSTANT_TYPES):
        return (type(value).__name__, value)
    return _UNCACHEABLE


class MetaOpCache:
    """Outputs of operations on meta tensors, keyed by the operation and its arguments' metadata.

    Meta kernels cost about a millisecond an operation (Python decompositions); blocks repeat, so a
    96-block GPT runs each distinct operation once instead of 96 times (175B: 5 s -> 0.3 s)."""

    def __init__(self) -> None:
        self.specs: dict[Any, Any] = {}

    def call(self, head: Any, fn: Any, args: tuple, kwargs: dict) -> Any:
        key = _cache_key((args, kwargs))
        if key is not _UNCACHEABLE:
            key = (head, key)
            try:
                hash(key)
            except TypeError:  # e.g. an unhashable callable as the operation
                key = _UNCACHEABLE
        if key is not _UNCACHEABLE and key in self.specs:
            return self._rebuild(self.specs[key])
        out = fn(*args, **kwargs)
        spec = self._spec(out)
        if key is not _UNCACHEABLE and spec is not _UNCACHEABLE:
            self.specs[key] = spec
        return out

    def _spec(self, value: Any) -> Any:
        if type(value) is torch.Tensor and value.device.type == "meta":
            return ("T", tuple(value.shape), value.stride(), value.dtype, value.requires_grad)
        if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
            parts = [self._spec(item) for item in value]
            return _UNCACHEABLE if any(p is _UNCACHEABLE for p in parts) else (type(value), parts)
        return ("C", value) if isinstance(value, _CONSTANT_TYPES) else _UNCACHEABLE

    def _rebuild(self, spec: Any) -> Any:
        if spec[0] == "T":
            _, shape, stride, dtype, grad = spec
            tensor = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            if grad and (dtype.is_floating_point or dtype.is_complex):  # an operation's output: not a leaf, so
                return tensor.requires_grad_().clone()  # the model may change it in place (x /= x.sum())
            return tensor
        if spec[0] == "C":
            return spec[1]
        return spec[0](self._rebuild(item) for item in spec[1])


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensors inside nested tuples, lists, dicts and Hugging Face ModelOutputs, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    return []


# Grouped GEMMs (mixture-of-experts layers): torch 2.13's meta kernel accepts bf16 only, the CPU and CUDA kernels
# fp32 too; on meta tensors the shape is all that matters, so CachedMetaOps runs them in bf16 and casts back.
GROUPED_GEMMS = tuple(f for f in (getattr(torch, "_grouped_mm", None),
                                  getattr(torch.nn.functional, "grouped_mm", None)) if f is not None)


def _grouped_gemm_in_bf16(func: Any, args: tuple, kwargs: dict) -> Any:
    dtype = next(t.dtype for t in tensors_in(args))

    def cast(value: Any) -> Any:
        return value.to(torch.bfloat16) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    return func(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()}).to(dtype)


class CachedMetaOps(torch.overrides.TorchFunctionMode):
    """Runs the torch functions called inside it through `cache` (each distinct operation on meta tensors once):
    a forward of a deep model on the meta device in the time of a few blocks. Grouped GEMMs on meta tensors of
    another dtype than bf16 run in bf16 (GROUPED_GEMMS)."""

    def __init__(self, cache: MetaOpCache) -> None:
        super().__init__()
        self.cache = cache

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if is_inplace(function_name(func)):
            return func(*args, **kwargs)
        tensors = tensors_in(args)
        if func in GROUPED_GEMMS and tensors and tensors[0].is_meta and tensors[0].dtype != torch.bfloat16:
            return self.cache.call(("function", func), lambda *a, **k: _grouped_gemm_in_bf16(func, a, k), args,
                                   kwargs)
        return self.cache.call(("function", func), func, args, kwargs)
