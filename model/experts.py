"""Mixture-of-experts layers in a model's module tree: which modules hold routed experts, their router and top-k.

What tracing (the planner prices experts by top-k) and running (expert parallel) both need to know. A routed-experts
module is recognised by its parameters, as transformers 5 stores every MoE family (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3, OLMoE, GPT-OSS):

    experts   parameters stacked over E experts: gate_up_proj (E, 2F, h), down_proj (E, h, F) (some families store
              them transposed, or with biases (E, n)); at least two of them 3-d, every one with E leading, E >= 2
    router    a sibling module (or the parent) with a weight (E, h) and a `top_k`: it picks k experts per token

and the experts module is called as experts(hidden (T, h), top_k_index (T, k), top_k_weights (T, k)). Stacked
parameters without a router and a top-k beside them, or a module called otherwise (transformers' Llama 4 runs every
expert on every token, its routing folded into the input), are not routed experts: they are traced and run as the
model computes them, densely. Shared experts (DeepSeek-V3's shared_experts, Qwen2-MoE's shared_expert) are plain
Linears: dense, not found here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from zplan.model.modules import parent_path

TOP_K_NAMES = ("top_k", "num_experts_per_tok", "router_top_k", "moe_topk")  # attributes and config keys, in order
CALL_ARGUMENTS = 3  # experts(hidden, top_k_index, top_k_weights)


@dataclass(frozen=True)
class ExpertLayer:
    """One routed-experts module: where it is, how many experts, how many each token visits."""

    path: str  # the experts module, e.g. 'model.layers.3.mlp.experts'
    router: str  # the module that picks the experts, e.g. 'model.layers.3.mlp.gate'
    num_experts: int  # E
    top_k: int  # k experts per token
    hidden: int  # h, the width of the tokens it takes and gives back
    ffn_hidden: int  # F, one expert's inner width (down projection's input)
    expert_params: int  # parameters of one expert (the module's / E)
    matrix_params: int  # of those, in its matrices (3-d parameters): 2 * matrix_params FLOPs per routed token


def stacked_parameters(module: nn.Module) -> int | None:
    """E when `module`'s own parameters are stacked over experts (every one with E leading, at least two 3-d,
    E >= 2), else None."""
    params = [p for p in module._parameters.values() if p is not None]
    leading = {p.shape[0] for p in params if p.dim() >= 2}
    if sum(p.dim() == 3 for p in params) < 2 or len(leading) != 1 or any(p.dim() < 2 for p in params):
        return None
    experts = leading.pop()
    return experts if experts >= 2 else None


def _top_k(modules: list[nn.Module], config: object) -> int | None:
    for source in [*modules, config]:
        for name in TOP_K_NAMES:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _router(model: nn.Module, parent: str, experts_path: str, num_experts: int) -> tuple[str, int] | None:
    """(path, h) of the module beside the experts whose weight is (E, h): the router."""
    holder = model.get_submodule(parent)
    candidates = [(f"{parent}.{name}" if parent else name, child) for name, child in holder.named_children()]
    for path, module in [*candidates, (parent, holder)]:
        weight = getattr(module, "weight", None)
        if path != experts_path and isinstance(weight, nn.Parameter) and weight.dim() == 2 \
                and weight.shape[0] == num_experts:
            return path, int(weight.shape[1])
    return None


def _called_with_routing(module: nn.Module) -> bool:
    """Whether `module` is called as experts(hidden, top_k_index, top_k_weights): three positional arguments."""
    arguments = [p for p in inspect.signature(module.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(arguments) == CALL_ARGUMENTS


def find_expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """Every routed-experts module of `model`, in module order (module docstring: stacked parameters beside a router
    with a top-k, called as experts(hidden, top_k_index, top_k_weights)); other stacked parameters are left out."""
    found = []
    config = getattr(model, "config", None)
    for path, module in model.named_modules():
        num_experts = stacked_parameters(module)
        if num_experts is None or not _called_with_routing(module):
            continue
        parent = parent_path(path)
        router = _router(model, parent, path, num_experts)
        if router is None:
            continue
        router_path, hidden = router
        top_k = _top_k([model.get_submodule(router_path), model.get_submodule(parent), module], config)
        if top_k is None or top_k > num_experts:
            continue
        params = [p for p in module._parameters.values() if p is not None]
        matrices = [p for p in params if p.dim() == 3]
        down = matrices[-1]  # (E, h, F) or (E, F, h): its other side is F
        ffn_hidden = int(down.shape[2] if down.shape[1] == hidden else down.shape[1])
        found.append(ExpertLayer(
            path=path, router=router_path, num_experts=num_experts, top_k=top_k, hidden=hidden, ffn_hidden=ffn_hidden,
            expert_params=sum(p.numel() for p in params) // num_experts,
            matrix_params=sum(p[0].numel() for p in matrices)))
    return found
