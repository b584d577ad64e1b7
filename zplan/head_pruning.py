"""Attention-head pruning of a model (zplan.model_reduction): head importance scores and the removal of heads.

Head pruning (Michel et al. 2019, "Are Sixteen Heads Really Better than One?"). A gate xi_h multiplies the
output of head h; its importance is the expected absolute gradient of the loss through that gate at xi = 1,
    I_h = E_x |dL(x)/d xi_h|                                                         (Michel et al. sec. 4.1)
(the expectation: the mean over calibration batches of |.| of the batch's gradient, as in their code). The
gate sits at the input of the attention's output projection o, which is the concatenation of the heads'
outputs (B, T, heads * d), so xi_h scales slice [h*d, (h+1)*d) (mask_heads). prune_heads removes heads
physically: their rows of the q, k, v projections (weights and biases) and their columns of o; the pruned
model computes exactly what the unpruned one computes with those gates at 0 (o's bias is kept).

Attention layout. An attention module is a submodule of a block with separate nn.Linear children q, k, v, o
(examples/tiny.py, examples/gpt.py) or q_proj, k_proj, v_proj, o_proj, where q, k and v map to heads * d
features and o maps heads * d back, and whose forward splits heads by the head size (view(B, T, -1, d)).
The head size d is the module's int `head_dim`, else q's width over a head-count attribute (HEAD_COUNT_ATTRS).
Fused q/k/v projections (qkv, c_attn, nn.MultiheadAttention), grouped-query attention (k, v narrower than q,
examples/llama.py) and blocks with no or several attention modules raise ReductionError: not supported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zplan.layer_reduction import ReductionError, _is_int, _update_count, block_container
from zplan.model.model_file import next_token_loss
from zplan.planner.trace import find_block_container

# Attributes of an attention module that record its head count, updated by prune_heads when they equal it.
HEAD_COUNT_ATTRS = ("heads", "n_heads", "num_heads", "n_head", "num_attention_heads")
PROJECTION_NAMES = (("q", "k", "v", "o"), ("q_proj", "k_proj", "v_proj", "o_proj"))
FUSED_QKV_NAMES = ("qkv", "c_attn", "query_key_value", "Wqkv", "qkv_proj", "in_proj")


# ---- attention layout ------------------------------------------------------------------------------------


@dataclass
class Attention:
    """One attention module: q, k, v (h -> heads * head_dim) and o (heads * head_dim -> h) projections."""

    path: str  # e.g. 'blocks.0.attn'
    module: nn.Module
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    head_dim: int

    @property
    def heads(self) -> int:
        return self.q.out_features // self.head_dim


def find_attention(block: nn.Module, where: str = "block") -> Attention:
    """The one attention module in `block` (module docstring, "Attention layout"); ReductionError otherwise."""
    found = []
    for path, module in block.named_modules():
        full = f"{where}.{path}" if path else where
        if isinstance(module, nn.MultiheadAttention):
            raise ReductionError(f"{full} is an nn.MultiheadAttention, whose q, k, v share one in_proj_weight: "
                                 "head pruning supports separate nn.Linear q, k, v, o projections only.")
        children = dict(module.named_children())
        fused = [name for name in FUSED_QKV_NAMES if name in children]
        if fused:
            raise ReductionError(f"{full}.{fused[0]} is a fused q/k/v projection: head pruning supports "
                                 "separate nn.Linear q, k, v, o projections only.")
        for names in PROJECTION_NAMES:
            if all(isinstance(children.get(name), nn.Linear) for name in names):
                found.append((full, module, [children[name] for name in names]))
    wanted = " or ".join(", ".join(names) for names in PROJECTION_NAMES)
    if not found:
        raise ReductionError(f"{where} ({type(block).__name__}) has no attention module with nn.Linear children "
                             f"{wanted}: this attention layout is not supported by head pruning.")
    if len(found) > 1:
        raise ReductionError(f"{where} has several attention modules ({', '.join(f[0] for f in found)}): head "
                             "pruning supports one per block.")
    path, module, (q, k, v, o) = found[0]
    head_dim = getattr(module, "head_dim", None)
    if not (_is_int(head_dim) and head_dim > 0):
        counts = [getattr(module, attr) for attr in HEAD_COUNT_ATTRS if _is_int(getattr(module, attr, None))]
        if not counts or counts[0] <= 0 or q.out_features % counts[0]:
            raise ReductionError(f"{path}: cannot tell the head size: give {type(module).__name__} an int "
                                 f"attribute head_dim or one of {', '.join(HEAD_COUNT_ATTRS)}.")
        head_dim = q.out_features // counts[0]
    width = q.out_features  # heads * head_dim
    if k.out_features != width or v.out_features != width:
        raise ReductionError(f"{path}: k and v have {k.out_features} and {v.out_features} outputs, q has {width}: "
                             "grouped-query attention is not supported by head pruning.")
    if width % head_dim or o.in_features != width:
        raise ReductionError(f"{path}: q has {width} outputs and o {o.in_features} inputs, not a multiple of the "
                             f"head size {head_dim} shared by both.")
    return Attention(path, module, q, k, v, o, head_dim)


def attention_modules(model: nn.Module, block_prefix: str | None = None) -> list[Attention]:
    """The attention module of each block, in block order (block_prefix None: found as the planner finds it)."""
    prefix = block_prefix or default_block_prefix(model)
    container = block_container(model, prefix)
    names = list(container.keys()) if isinstance(container, nn.ModuleDict) else range(len(container))
    blocks = container.values() if isinstance(container, nn.ModuleDict) else container
    return [find_attention(block, f"{prefix}.{name}") for name, block in zip(names, blocks, strict=True)]


def default_block_prefix(model: nn.Module) -> str:
    """The block container the planner cuts pipelines at (planner.trace.find_block_container)."""
    return find_block_container(model)[0]


# ---- head masking and importance -------------------------------------------------------------------------


@contextlib.contextmanager
def mask_heads(model: nn.Module, gates: Sequence[torch.Tensor], block_prefix: str | None = None) -> Iterator[None]:
    """While inside, multiply head h of layer l's output by gates[l][h] (1 keeps it, 0 removes it).

    gates: one (heads,) tensor per layer, or a (layers, heads) tensor; it may require grad (head_importance).
    A forward pre-hook on each attention's o rescales its input (B, T, heads * d) viewed as (B, T, heads, d).
    """
    attentions = attention_modules(model, block_prefix)
    if len(gates) != len(attentions):
        raise ReductionError(f"{len(gates)} rows of gates for {len(attentions)} layers.")

    def gate_hook(attention: Attention, gate: torch.Tensor) -> Callable:
        def hook(module: nn.Module, args: tuple) -> tuple:
            x = args[0]  # (B, T, heads * d)
            per_head = x.unflatten(-1, (attention.heads, attention.head_dim))  # (B, T, heads, d)
            scaled = per_head * gate.to(device=x.device, dtype=x.dtype)[:, None]  # gate (heads,) -> (heads, 1)
            return (scaled.flatten(-2), *args[1:])  # (B, T, heads * d)

        return hook

    handles = []
    try:
        for attention, gate in zip(attentions, gates, strict=True):
            if tuple(gate.shape) != (attention.heads,):
                raise ReductionError(f"{attention.path} has {attention.heads} heads, its gates have shape "
                                     f"{tuple(gate.shape)}.")
            handles.append(attention.o.register_forward_pre_hook(gate_hook(attention, gate)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def head_importance(model: nn.Module, batches: Iterable[Any], loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                    block_prefix: str | None = None, normalize: bool = False) -> torch.Tensor:
    """Michel et al. 2019's head importance (module docstring): (layers, heads) float32 on the CPU, the mean
    over `batches` of |dL/d gate| per head, where L = loss_fn(model(batch), batch) (default: next-token
    cross-entropy). A batch is passed as model(batch), or model(**batch) for a dict, as zplan's train loop does.
    Layers with fewer heads than the widest are padded with NaN. normalize: divide each layer's scores by
    their l2 norm (Michel et al. sec. 4.1, for ranking heads across layers).

    Runs in eval mode (no dropout) without parameter gradients; the model's modes and flags are restored.
    """
    loss_fn = loss_fn or next_token_loss
    attentions = attention_modules(model, block_prefix)
    device = next(model.parameters()).device
    gates = [torch.ones(a.heads, device=device, requires_grad=True) for a in attentions]  # (heads,) each
    totals = [torch.zeros(a.heads, dtype=torch.float64) for a in attentions]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training, count = model.training, 0
    try:
        model.eval()
        for parameter, _ in flags:
            parameter.requires_grad_(False)
        with mask_heads(model, gates, block_prefix):
            for batch in batches:
                outputs = model(**batch) if isinstance(batch, dict) else model(batch)
                grads = torch.autograd.grad(loss_fn(outputs, batch), gates, allow_unused=True)
                for total, grad in zip(totals, grads, strict=True):
                    if grad is not None:
                        total += grad.detach().abs().double().cpu()
                count += 1
    finally:
        model.train(was_training)
        for parameter, flag in flags:
            parameter.requires_grad_(flag)
    if count == 0:
        raise ReductionError("head_importance needs at least one calibration batch.")
    scores = torch.full((len(totals), max(len(t) for t in totals)), float("nan"), dtype=torch.float64)
    for layer, total in enumerate(totals):
        scores[layer, : len(total)] = total / count
    if normalize:
        scores = scores / scores.nan_to_num(0.0).norm(dim=1, keepdim=True).clamp_min(1e-30)
    return scores.float()


def least_important_heads(scores: torch.Tensor, heads_per_layer: int) -> dict[int, list[int]]:
    """{layer: the `heads_per_layer` heads of lowest score, ascending index}; ties go to the lower index."""
    chosen = {}
    for layer, row in enumerate(scores.tolist()):
        heads = [h for h, score in enumerate(row) if score == score]  # NaN pads are not heads
        if not 0 < heads_per_layer < len(heads):
            raise ReductionError(f"cannot prune {heads_per_layer} heads per layer: layer {layer} has "
                                 f"{len(heads)}; prune between 1 and {len(heads) - 1}.")
        chosen[layer] = sorted(sorted(heads, key=lambda h: (row[h], h))[:heads_per_layer])
    return chosen


# ---- pruning ---------------------------------------------------------------------------------------------


def prune_heads(model: nn.Module, heads_to_prune: Mapping[int, Sequence[int]],
                block_prefix: str | None = None) -> nn.Module:
    """Remove heads {layer: [head, ...]} (indices as the model stands now) in place; returns `model`.

    Per pruned head of size d in a layer of width h: q, k, v each lose d rows of weight (d, h) and d bias
    entries, o loses d columns of weight (h, d): 4*d*h + 3*d parameters with biases. An int head-count attribute
    (HEAD_COUNT_ATTRS) equal to the old count is lowered. Everything is checked before anything is changed.
    """
    attentions = attention_modules(model, block_prefix)
    plan: dict[int, list[int]] = {}
    for layer, heads in heads_to_prune.items():
        if not _is_int(layer) or not 0 <= layer < len(attentions):
            raise ReductionError(f"layer {layer!r} is out of range: the model has {len(attentions)} layers, "
                                 f"numbered 0..{len(attentions) - 1}.")
        heads = list(heads)
        count = attentions[layer].heads
        bad = [h for h in heads if not _is_int(h) or not 0 <= h < count]
        if bad or len(set(heads)) != len(heads):
            raise ReductionError(f"heads {heads} of layer {layer}: each must appear once and lie in 0..{count - 1}.")
        if len(heads) >= count:
            raise ReductionError(f"pruning {len(heads)} heads of layer {layer} would leave none of its {count}.")
        if heads:
            plan[layer] = heads
    for layer, heads in plan.items():
        _remove_heads(attentions[layer], heads)
    return model


def _remove_heads(attention: Attention, heads: list[int]) -> None:
    old_heads, d = attention.heads, attention.head_dim
    kept = [h for h in range(old_heads) if h not in set(heads)]

    def kept_slices(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        # Slices and cat only (no index tensor), so this runs on meta and fake tensors as well.
        return torch.cat([tensor.narrow(dim, h * d, d) for h in kept], dim=dim)

    with torch.no_grad():
        for linear in (attention.q, attention.k, attention.v):
            linear.weight = nn.Parameter(kept_slices(linear.weight, 0), linear.weight.requires_grad)  # (kept*d, h)
            if linear.bias is not None:
                linear.bias = nn.Parameter(kept_slices(linear.bias, 0), linear.bias.requires_grad)  # (kept*d,)
            linear.out_features = len(kept) * d
        o = attention.o
        o.weight = nn.Parameter(kept_slices(o.weight, 1), o.weight.requires_grad)  # (h, kept*d)
        o.in_features = len(kept) * d
    _update_count(attention.module, HEAD_COUNT_ATTRS, old_heads, len(kept))
