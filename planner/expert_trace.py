"""Routed experts traced as one operation each, priced by top-k rather than by how a meta tensor happens to route.

A mixture-of-experts layer's work depends on where its tokens go, which the meta device cannot say: transformers'
expert loop branches on routed indices (`nonzero()`), and its grouped GEMM wants bf16 on meta. While the tracers run,
each experts module found by zplan.model.experts is called as one `zplan::routed_experts` operation instead: the
router before it runs as traced (its linear, softmax and top-k are costed as usual), and this operation carries the
shapes its cost needs (zplan.planner.op_costs):

    routed_experts(hidden (T, h), top_k_index (T, k), top_k_weights (T, k), [the experts' parameters]) -> (T, h)

Pricing by top-k assumes the tokens spread evenly over the experts (balanced routing), as published MoE runs force
it; every expert then computes T * k / E tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from zplan.model.experts import ExpertLayer

ROUTED_EXPERTS = "routed_experts"  # the operation's name in traces


@torch.library.custom_op(f"zplan::{ROUTED_EXPERTS}", mutates_args=())
def routed_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   weights: list[torch.Tensor]) -> torch.Tensor:
    raise RuntimeError("zplan::routed_experts stands in for an experts module while zplan traces on the meta "
                       "device; it has no kernel")


@routed_experts.register_fake
def _routed_experts_shape(hidden, top_k_index, top_k_weights, weights):
    return torch.empty_like(hidden)


@contextlib.contextmanager
def experts_as_operations(model: nn.Module, layers: list[ExpertLayer]) -> Iterator[None]:
    """Within the block, each experts module of `layers` runs as one routed_experts operation."""
    patched = []
    for layer in layers:
        module = model.get_submodule(layer.path)
        weights = [p for p in module._parameters.values() if p is not None]

        def forward(hidden, top_k_index, top_k_weights, _weights=weights):
            return torch.ops.zplan.routed_experts(hidden, top_k_index, top_k_weights, _weights)

        patched.append((module, module.__dict__.get("forward")))
        module.forward = forward
    try:
        yield
    finally:
        for module, previous in patched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
