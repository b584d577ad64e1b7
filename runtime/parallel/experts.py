"""zplan's executor of routed experts (model/experts.py finds them), in place of the model's own forward.

    layers = apply_experts(model)            # ep = 1: every experts module runs zplan's forward
    layers = apply_experts(model, ep_mesh)   # ep > 1: its stacked parameters also become Shard(0) DTensors
                                             # over ep_mesh, E/ep experts a rank (runtime.parallel.expert_dispatch)

The forward, for T tokens each routed to k of E experts (experts(hidden (T, h), top_k_index (T, k), top_k_weights (T,
k)) -> (T, h)): the T*k routed copies are grouped by expert (a stable argsort of top_k_index), each expert's gate_up
-> gate -> down runs on its group (one grouped_mm with offsets on a GPU in bf16, else a loop over the experts with
the same numbers), and the results go back to (token, slot) order, weighted by top_k_weights and summed per token. It
is dropless; the loop reads the tokens per expert on the host (one sync), grouped_mm nothing (expert parallelism
reads them to size its exchange). Where values cannot be read (meta tensors, and the dry run's fake tensors:
runtime.dryrun.fake_world), the counts are balanced, T*k/E per expert, the remainder on the first experts: the dry
run then allocates what a balanced real run allocates, as the planner prices it (planner/expert_trace.py).

Which math: the module's own, read from what it declares, never guessed. transformers 5's experts classes
(use_experts_implementation: Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE, GPT-OSS, ...) declare their layout
(is_transposed: (E, h, 2F) / (E, F, h) rather than (E, 2F, h) / (E, h, F); has_bias) and their gate (_apply_gate:
act_fn(gate) * up on the concatenated halves, GPT-OSS's clamped interleaved one): zplan runs transformers' own
grouped-mm computation with them; zplan's examples/moe.py declares the same. At ep = 1 an experts module that
declares nothing keeps its own forward (it runs, but the dry run cannot measure a forward that reads routed values);
expert parallelism refuses it (PlanMismatchError).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from zplan.errors import PlanMismatchError
from zplan.model.experts import ExpertLayer, find_expert_layers
from zplan.runtime.parallel.expert_dispatch import balanced_counts, exchange_and_run, shard_experts, values_unreadable
from zplan.runtime.precision.float8 import on_fake_tensors


@dataclass(frozen=True)
class ExpertsMath:
    """What an experts module computes: its parameters' names, their layout, its gate."""

    up: str  # gate_up (E, 2F, h), or (E, h, 2F) when transposed
    down: str  # (E, h, F), or (E, F, h) when transposed
    up_bias: str | None  # (E, 2F)
    down_bias: str | None  # (E, h)
    transposed: bool
    gate: str  # "module": the module's _apply_gate (2F -> F)


def experts_math(module: nn.Module, path: str) -> ExpertsMath:
    """The math of `module` (module docstring), or PlanMismatchError naming it, its class and what zplan cannot run."""
    math = _math_or_problem(module)
    if isinstance(math, str):
        raise PlanMismatchError(f"{path} ({type(module).__name__}): {math}")
    return math


def experts_problem(module: nn.Module) -> str | None:
    """Why zplan's executor cannot run `module` (a routed-experts module), or None when it can."""
    math = _math_or_problem(module)
    return math if isinstance(math, str) else None


def _math_or_problem(module: nn.Module) -> ExpertsMath | str:
    names = {name for name, p in module._parameters.items() if p is not None}
    if not all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "_apply_gate")):
        return ("it holds stacked experts, but zplan cannot tell what its forward computes: zplan runs experts that "
                "declare has_gate, has_bias, is_transposed and _apply_gate, as transformers 5's MoE classes "
                "(use_experts_implementation) and zplan's examples/moe.py do")
    problems = []  # transformers 5's protocol
    if not module.has_gate:
        problems.append("its experts have no gate (up_proj and an activation)")
    if getattr(module, "has_post_expert_norm", False):
        problems.append("it normalises each expert's output (post_expert_norm)")
    biases = ("gate_up_proj_bias", "down_proj_bias") if module.has_bias else (None, None)
    math = ExpertsMath("gate_up_proj", "down_proj", *biases, bool(module.is_transposed), "module")
    expected = {n for n in (math.up, math.down, math.up_bias, math.down_bias) if n}
    if names != expected:
        problems.append(f"it holds the parameters {sorted(names)}, not {sorted(expected)}")
    if problems:
        return f"zplan's experts executor cannot run it: {'; '.join(problems)}"
    return math


# ---- the experts of one rank on their grouped tokens ---------------------------------------------------


def _use_grouped_mm(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    """One grouped_mm per projection: on a GPU (sm80+), or fake tensors (the dry run measures the GPU's path), in
    bf16, every row 16-byte aligned. Elsewhere (this CPU build's grouped_mm has no backward) the loop."""
    if not hasattr(F, "grouped_mm") or {x.dtype, up.dtype, down.dtype} != {torch.bfloat16}:
        return False
    if any(size % 8 for size in (*up.shape[1:], *down.shape[1:])):  # 8 bf16 = 16 bytes
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device) >= (8, 0)
    return isinstance(x, FakeTensor) or on_fake_tensors()


def run_local_experts(module: nn.Module, math: ExpertsMath, weights: dict[str, torch.Tensor], x: torch.Tensor,
                      counts: torch.Tensor | list[int]) -> torch.Tensor:
    """The experts of `weights` (this rank's: E_l experts leading) on `x` (N, h), its rows grouped by expert,
    counts[e] rows for expert e (a tensor: read on the host by the loop only); returns (N, h) in the same order."""
    up, down = weights[math.up], weights[math.down]
    up_bias, down_bias = weights.get(math.up_bias), weights.get(math.down_bias)
    gate = module._apply_gate
    if _use_grouped_mm(x, up, down):
        per_row = torch.as_tensor(counts, device=x.device)  # (E_l,) rows of each expert
        offsets = per_row.cumsum(0, dtype=torch.int32)  # (E_l,) end row of each expert

        def project(inputs, w, bias):  # (N, in) -> (N, out)
            out = F.grouped_mm(inputs, w if math.transposed else w.transpose(-2, -1), offs=offsets)
            return out if bias is None else out + bias.repeat_interleave(per_row, dim=0, output_size=x.shape[0])

        return project(gate(project(x, up, up_bias)), down, down_bias)
    outputs = []
    sizes = counts if isinstance(counts, list) else counts.tolist()  # one sync
    for e, rows in enumerate(x.split(sizes)):  # every expert, an empty one too: each weight gets its gradient
        if math.transposed:  # as GPT-OSS's own forward: x @ W + b
            inner = rows @ up[e] + up_bias[e] if up_bias is not None else rows @ up[e]  # (n, 2F)
            inner = gate(inner)  # (n, F)
            outputs.append(inner @ down[e] + down_bias[e] if down_bias is not None else inner @ down[e])
        else:  # as Mixtral's: linear(x, W)
            inner = gate(F.linear(rows, up[e], up_bias[e] if up_bias is not None else None))
            outputs.append(F.linear(inner, down[e], down_bias[e] if down_bias is not None else None))  # (n, h)
    return torch.cat(outputs)


# ---- the forward ------------------------------------------------------------------------------------------


class ZplanExperts(nn.Module):
    """Mixed in before an experts module's class (apply_experts): its forward becomes zplan's."""

    _zplan_experts_math: ExpertsMath

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        math = self._zplan_experts_math
        weights, ep_mesh = local_weights(self, math)
        num_experts = getattr(self, math.up).shape[0]  # E, all ranks' together
        tokens, top_k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # (T*k,) expert of each routed copy
        order = flat.argsort(stable=True)  # (T*k,) routed copies grouped by expert
        routed = hidden[order // top_k]  # (T*k, h)
        if values_unreadable(flat):  # meta or fake: balanced (module docstring)
            counts = balanced_counts(flat.numel(), num_experts)
        else:
            counts = torch.bincount(flat, minlength=num_experts)  # (E,) copies per expert
        if ep_mesh is None:
            out = run_local_experts(self, math, weights, routed, counts)
        else:
            out = exchange_and_run(routed, counts, ep_mesh,
                                   lambda x, local: run_local_experts(self, math, weights, x, local))
        combined = torch.empty_like(out).index_copy(0, order, out)  # (T*k, h) back in (token, slot) order
        weighted = combined.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1)  # (T, k, h)
        return weighted.sum(dim=1).to(hidden.dtype)  # (T, h)


def local_weights(module: nn.Module, math: ExpertsMath) -> tuple[dict[str, torch.Tensor], DeviceMesh | None]:
    """This rank's experts' parameters (plain tensors, E_l leading) and the expert-parallel mesh when they are
    Shard(0) DTensors over one (apply_experts with ep > 1), else None."""
    weights, meshes = {}, set()
    for name in (math.up, math.down, math.up_bias, math.down_bias):
        param = getattr(module, name) if name else None
        if isinstance(param, DTensor):
            if param.device_mesh.ndim != 1 or param.placements != (Shard(0),):
                raise PlanMismatchError(f"{type(module).__name__}.{name} is a DTensor placed {param.placements} on "
                                        f"a {param.device_mesh.ndim}-d mesh; zplan's experts take Shard(0) over "
                                        "the expert-parallel ranks")
            meshes.add(param.device_mesh)
            param = param.to_local()  # backward: the gradient of this rank's shard
        if param is not None:
            weights[name] = param
    return weights, (meshes.pop() if meshes else None)


_CLASSES: dict[type, type] = {}


def apply_experts(model: nn.Module, ep_mesh: DeviceMesh | None = None) -> list[ExpertLayer]:
    """Give every routed-experts module of `model` (model.experts.find_expert_layers) zplan's forward, in place
    (its class becomes a subclass of its own with ZplanExperts first; names and state_dict unchanged); with
    `ep_mesh` of more than one rank also shard its parameters over it (expert_dispatch.shard_experts). Works on a
    meta model. An experts module whose math zplan does not know keeps its own forward at ep = 1 and raises
    PlanMismatchError under expert parallelism. Returns the layers zplan's forward runs."""
    layers, expert_parallel = [], ep_mesh is not None and ep_mesh.size() > 1
    for layer in find_expert_layers(model):
        module = model.get_submodule(layer.path)
        try:
            math = experts_math(module, layer.path)
        except PlanMismatchError:
            if expert_parallel:
                raise
            continue
        layers.append(layer)
        cls = type(module)
        if not isinstance(module, ZplanExperts):
            if cls not in _CLASSES:  # the same name, so that the module prints as before
                _CLASSES[cls] = type(cls.__name__, (ZplanExperts, cls), {"__qualname__": cls.__qualname__,
                                                                        "__module__": cls.__module__})
            module.__class__ = _CLASSES[cls]
        module._zplan_experts_math = math
        if expert_parallel:
            shard_experts(module, [n for n in (math.up, math.down, math.up_bias, math.down_bias) if n], ep_mesh)
    return layers


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules zplan's executor runs (apply_experts), in module order."""
    return [module for module in model.modules() if isinstance(module, ZplanExperts)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts modules zplan's executor runs (apply_experts), in module order."""
    return [p for module in expert_modules(model) for p in module.parameters()]
