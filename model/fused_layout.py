"""How zplan stores a fused projection (Phi-3's qkv_proj and gate_up_proj, GPT-2's c_attn), so that tensor
parallel can split it and a checkpoint means the same at every tp.

A fused projection computes several projections with one module and the forward slices its output:
qkv_proj's output features are [q (H*d) | k (KV*d) | v (KV*d)]. A plain column split would give rank 0
all of q and none of k. So the runtime stores the output features grouped instead (Megatron-LM keeps its
fused QKV weight per query group for the same reason):

    model file's order   [ q0 q1 | k0 k1 | v0 v1 ]          parts (q, k, v), each cut into `groups` groups
    stored order         [ q0 k0 v0 | q1 k1 v1 ]            group g of every part side by side

where a group is one kv-head group (Phi-3: H/KV query heads, one k and one v head), one head (GPT-2), or
one feature (gate_up). Any tp that divides `groups` then gives each rank a contiguous slice of the stored
order holding whole groups of every part, which is what an unfused column split of each part would give
it. The order does not depend on tp, so DCP checkpoints reshard across tp (and ZeRO stages) as for any
other parameter. The module's output is put back in the model file's order on the rank's own features
by a forward hook (a copy of the (B, T, out/tp) output; the forward then slices its local parts).

The stored order applies to the weight's output-feature dimension (0 for nn.Linear's (out, in), 1 for
transformers' Conv1D (in, out)) and the bias. Everything the run reads in or writes out goes through
this module: materialize fills the stored order (to_stored), save_full_weights and `zplan export` write
the model file's order (to_original), and a checkpoint records the layouts it was written with.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from zplan.model.modules import is_conv1d

LAYOUT_ATTRIBUTE = "_zplan_fused_layout"


class FusedLayout(BaseModel):
    """The stored order of one fused projection's output features."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    parts: tuple[int, ...]  # output features of each fused projection, model file's order
    groups: int  # groups each part is cut into (heads, kv-head groups, features)

    def local(self, tp: int) -> FusedLayout:
        """The layout of one tp rank's slice: every part and the group count divided by tp."""
        return FusedLayout(parts=tuple(p // tp for p in self.parts), groups=self.groups // tp)

    def stored_order(self) -> torch.Tensor:
        """(sum(parts),) int64: stored feature i is the model file's feature stored_order()[i]."""
        starts = [0]
        for size in self.parts[:-1]:
            starts.append(starts[-1] + size)
        per_group = [size // self.groups for size in self.parts]
        return torch.cat([torch.arange(start + g * width, start + (g + 1) * width)
                          for g in range(self.groups) for start, width in zip(starts, per_group, strict=True)])

    def original_order(self) -> torch.Tensor:
        """(sum(parts),) int64, the inverse: model file's feature i is stored feature original_order()[i]."""
        return torch.argsort(self.stored_order())


def check_layout(parts: list[int] | tuple[int, ...], groups: int) -> str:
    """Why (parts, groups) is not a layout ('' when it is)."""
    if not parts or groups < 1 or any(p <= 0 or p % groups for p in parts):
        return f"fused parts {list(parts)} cannot each be cut into {groups} equal groups"
    return ""


def output_dim(module: nn.Module) -> int:
    """The weight dimension of the output features: 1 for transformers' Conv1D (weight (in, out)), else 0."""
    return 1 if is_conv1d(module) else 0


def to_stored(tensor: torch.Tensor, layout: FusedLayout, dim: int) -> torch.Tensor:
    return tensor.index_select(dim, layout.stored_order().to(tensor.device))


def to_original(tensor: torch.Tensor, layout: FusedLayout, dim: int) -> torch.Tensor:
    return tensor.index_select(dim, layout.original_order().to(tensor.device))


def mark_fused(module: nn.Module, layout: FusedLayout) -> None:
    """Store `module`'s output features in `layout`'s order: its parameters permuted now unless on meta (where
    materialize fills them in that order). Before tensor parallel splits it; then give_output_in_file_order."""
    if getattr(module, LAYOUT_ATTRIBUTE, None) is not None:
        raise ValueError(f"{type(module).__name__} already has a fused layout")
    with torch.no_grad():
        for name, dim in (("weight", output_dim(module)), ("bias", 0)):
            param = module._parameters.get(name)
            if param is not None and not param.is_meta:
                param.copy_(to_stored(param.detach(), layout, dim))
    setattr(module, LAYOUT_ATTRIBUTE, layout)


def give_output_in_file_order(module: nn.Module, tp: int) -> None:
    """A forward hook putting the marked `module`'s output (this rank's out/tp features, a plain tensor) back in
    the model file's order; registered after the tensor-parallel style's hooks, so that it runs after them."""
    back = getattr(module, LAYOUT_ATTRIBUTE).local(tp).original_order()

    def file_order(mod: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return output.index_select(-1, back.to(output.device))

    module.register_forward_hook(file_order)


def stored_layouts(model: nn.Module) -> dict[str, tuple[FusedLayout, int]]:
    """{tensor name: (layout, dim)} of every fused parameter of `model`, named as named_parameters() and
    state_dict() name them (FSDP2 and the activation-checkpoint wrapper keep names; DDP's 'module.' prefix is
    dropped, as torch.distributed.checkpoint.state_dict drops it)."""
    layouts = {}
    for path, module in model.named_modules():
        layout = getattr(module, LAYOUT_ATTRIBUTE, None)
        if layout is None:
            continue
        path = path.removeprefix("module.")
        for name, dim in (("weight", output_dim(module)), ("bias", 0)):
            if module._parameters.get(name) is not None:
                layouts[f"{path}.{name}" if path else name] = (layout, dim)
    return layouts


def to_original_state(state: dict[str, torch.Tensor], layouts: dict[str, tuple[FusedLayout, int]]
                      ) -> dict[str, torch.Tensor]:
    """`state` (full tensors by name) with every fused tensor put back in the model file's order."""
    return {name: to_original(t, *layouts[name]) if name in layouts else t for name, t in state.items()}


def layouts_as_json(layouts: dict[str, tuple[FusedLayout, int]]) -> dict[str, dict]:
    return {name: {"parts": list(layout.parts), "groups": layout.groups, "dim": dim}
            for name, (layout, dim) in sorted(layouts.items())}


def layouts_from_json(data: dict[str, dict]) -> dict[str, tuple[FusedLayout, int]]:
    return {name: (FusedLayout(parts=tuple(entry["parts"]), groups=entry["groups"]), entry["dim"])
            for name, entry in data.items()}
