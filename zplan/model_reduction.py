"""Smaller models from a teacher: layer reduction and attention-head pruning, and a model file for the result.

Layer reduction (keep_layers). The student keeps k of the teacher's L repeated blocks, chosen by index, with
their weights: it starts from those teacher layers, as DistilBERT takes every other BERT layer (Sanh et al.
2019, sec. 3) and DeepSpeed's layer reduction takes `teacher_layer` (compression_training.layer_reduction).

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

Model file (write_reduced_model_file). Writes a Python model file whose build_model() imports the teacher file
(by its path relative to the new file), builds it, loads teacher weights if given (not on the meta device,
where there are no values), keeps the chosen layers and prunes the chosen heads; the choices are written in
the file as literals, so the file is deterministic and the planner (`zplan compile`) takes it like any other.
The runtime records and replays the file's initialisation shard by shard (runtime.training.materialize) when there are
no weights; loaded weights cannot be replayed, so with weights each rank builds the whole model (with a warning).
The teacher's build_model() must build the same structure for the recorded choices to fit (BUILD_KWARGS fixes
its arguments); moving the written file away from the teacher breaks its relative import.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import os
import pprint
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zplan.errors import ZplanError

# Attributes that record the number of layers, updated by keep_layers on the model and on model.config (an
# object or a dict) when they equal the old count. The examples record none (their forward loops over blocks).
LAYER_COUNT_ATTRS = ("n_layers", "num_layers", "n_layer", "num_hidden_layers")
# Attributes of an attention module that record its head count, updated by prune_heads when they equal it.
HEAD_COUNT_ATTRS = ("heads", "n_heads", "num_heads", "n_head", "num_attention_heads")
PROJECTION_NAMES = (("q", "k", "v", "o"), ("q_proj", "k_proj", "v_proj", "o_proj"))
FUSED_QKV_NAMES = ("qkv", "c_attn", "query_key_value", "Wqkv", "qkv_proj", "in_proj")


class ReductionError(ZplanError, ValueError):
    """A layer or head choice that does not fit the model, or a model layout this module does not know."""


# ---- layer reduction -------------------------------------------------------------------------------------


def block_container(model: nn.Module, block_prefix: str) -> nn.Module:
    """The ModuleList / Sequential / ModuleDict of repeated blocks at `block_prefix` (e.g. 'blocks')."""
    try:
        container = model.get_submodule(block_prefix) if block_prefix else None
    except AttributeError:
        container = None
    if container is None:
        raise ReductionError(f"{type(model).__name__} has no submodule {block_prefix!r}: pass the module path of "
                             "the container of its blocks (e.g. 'blocks' or 'model.layers').")
    if not isinstance(container, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        raise ReductionError(f"{block_prefix} is a {type(container).__name__}, not a ModuleList, Sequential or "
                             "ModuleDict of blocks.")
    return container


def keep_layers(model: nn.Module, block_prefix: str, keep: Sequence[int]) -> nn.Module:
    """Keep the teacher blocks `keep` (indices into the container at `block_prefix`, in the given order) with
    their weights and drop the others, in place; returns `model`.

    The container becomes a new nn.ModuleList / nn.Sequential holding the kept blocks (renumbered 0..k-1), or
    an nn.ModuleDict of the kept (key, block) pairs. Ints in LAYER_COUNT_ATTRS on the model or model.config that
    equal the old count become k. Indices out of range, repeated or empty: ReductionError.
    """
    container = block_container(model, block_prefix)
    count = len(container)
    keep = list(keep)
    bad = [i for i in keep if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count]
    if bad:
        raise ReductionError(f"layer indices {bad} are out of range: {block_prefix} has {count} layers, "
                             f"numbered 0..{count - 1}.")
    if not keep:
        raise ReductionError("keep at least one layer.")
    if len(set(keep)) != len(keep):
        raise ReductionError(f"layer indices {keep} repeat a layer: a repeated layer would share its weights.")
    if isinstance(container, nn.ModuleDict):
        items = list(container.items())
        reduced: nn.Module = nn.ModuleDict([items[i] for i in keep])
    else:
        blocks = list(container)
        chosen = [blocks[i] for i in keep]
        reduced = nn.Sequential(*chosen) if isinstance(container, nn.Sequential) else nn.ModuleList(chosen)
    parent_path, _, name = block_prefix.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, reduced)
    _update_count(model, LAYER_COUNT_ATTRS, count, len(keep))
    _update_count(getattr(model, "config", None), LAYER_COUNT_ATTRS, count, len(keep))
    return model


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _update_count(holder: Any, attrs: Sequence[str], old: int, new: int) -> None:
    """Set each attribute (or dict key) in `attrs` of `holder` that is the int `old` to `new`."""
    if holder is None:
        return
    for attr in attrs:
        value = holder.get(attr) if isinstance(holder, dict) else getattr(holder, attr, None)
        if _is_int(value) and value == old:
            if isinstance(holder, dict):
                holder[attr] = new
            else:
                setattr(holder, attr, new)


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
    from zplan.planner.trace import find_block_container

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
    from zplan.model.model_file import next_token_loss

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


# ---- the reduced model and its file ----------------------------------------------------------------------


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors file or a torch.save'd dict of tensors (loaded with weights_only)."""
    path = Path(path)
    if not path.is_file():
        raise ReductionError(f"teacher weights {path} do not exist: pass a state-dict file (.pt or .safetensors).")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ReductionError(f"{path} is not a state dict (a dict of tensors, as model.state_dict() gives).")
    return state


def reduce_model(model: nn.Module, block_prefix: str, keep: Sequence[int] | None = None,
                 prune: Mapping[int, Sequence[int]] | None = None, weights: str | Path | None = None) -> nn.Module:
    """Load the teacher `weights` (skipped on the meta device, where there are no values), then keep_layers,
    then prune_heads (`prune` indexes the layers left by `keep`); in place, returns `model`."""
    if weights is not None and not any(p.is_meta for p in model.parameters()):
        try:
            model.load_state_dict(load_state_dict_file(weights))
        except RuntimeError as exc:
            raise ReductionError(f"teacher weights {weights} do not fit the teacher: {str(exc).strip()}") from exc
    if keep is not None:
        keep_layers(model, block_prefix, keep)
    if prune:
        prune_heads(model, prune, block_prefix)
    return model


def import_model_file(path: str | Path) -> Any:
    """The module of a model file, imported fresh as zplan's loader does (model.model_file.load_model_file)."""
    from zplan.model.model_file import load_model_file

    return load_model_file(path).module


@dataclass
class ReducedModelFile:
    """What write_reduced_model_file wrote."""

    path: Path
    block_prefix: str
    teacher_layers: int
    keep: list[int] | None  # teacher layer indices kept; None: all
    prune: dict[int, list[int]]  # {student layer: [heads]}
    params_before: int  # teacher parameters (tied ones once)
    params_after: int


FORWARDED = ("SEQ_LEN", "VOCAB_SIZE", "example_inputs", "loss_fn", "train_data")

FILE_DOC = ("Written by zplan.model_reduction.write_reduced_model_file: write it again rather "
            "than editing it. Heads pruned: {source}. build_model() imports the teacher file at TEACHER (relative "
            "to this file), builds it with BUILD_KWARGS, loads the teacher state dict WEIGHTS if set (not on the "
            "meta device), keeps the teacher blocks KEEP_LAYERS of BLOCK_PREFIX (None: all) and prunes the "
            "attention heads PRUNE_HEADS ({{student layer: [heads]}}).")

FILE_TEMPLATE = '''"""A reduced {teacher_name}: {keep_text}, {prune_count} attention heads pruned.

{doc}
"""

from pathlib import Path

from zplan.model_reduction import import_model_file, reduce_model

HERE = Path(__file__).resolve().parent
TEACHER = {teacher_rel!r}
WEIGHTS = {weights_rel!r}
BUILD_KWARGS = {build_kwargs}
BLOCK_PREFIX = {block_prefix!r}
KEEP_LAYERS = {keep}
PRUNE_HEADS = {prune}

teacher = import_model_file(HERE / TEACHER)
{forwards}

def build_model():
    model = teacher.build_model(**BUILD_KWARGS)
    return reduce_model(model, BLOCK_PREFIX, KEEP_LAYERS, PRUNE_HEADS, WEIGHTS and HERE / WEIGHTS)
'''


def write_reduced_model_file(teacher_path: str | Path, out_path: str | Path, keep_layers: Sequence[int] | None = None,
                             prune: Mapping | None = None, weights: str | Path | None = None,
                             calibration_batches: int | Iterable[Any] = 8, *, block_prefix: str | None = None,
                             build_kwargs: Mapping[str, Any] | None = None, batch_size: int = 4,
                             seq_len: int | None = None, seed: int = 0) -> ReducedModelFile:
    """Write a model file for the teacher model file `teacher_path` reduced (module docstring, "Model file").

    keep_layers: teacher block indices to keep (None: all). prune: None, {"heads_per_layer": n} (the n heads of
    lowest head_importance in each layer of the layer-reduced model, computed once here, on the CPU, from the
    teacher weights if given, else from its initialisation under torch.manual_seed(seed)) or an explicit
    {student layer: [heads]}. weights: a teacher state-dict file (.pt or .safetensors). calibration_batches:
    a count of batches of (batch_size, seq_len) from the teacher's train_data, else its example_inputs, else
    synthetic tokens (seq_len default: the teacher's SEQ_LEN, at most 128), or the batches themselves.
    block_prefix: the block container (default: the planner's). build_kwargs: passed to the teacher's
    build_model, written in the file (literals only). The file forwards the teacher's FORWARDED names.
    Raises ZplanError subclasses (ReductionError, ModelLoadError) with nothing written.
    """
    from zplan.model.model_file import default_example_inputs, load_model_file

    teacher = load_model_file(teacher_path)
    build_kwargs = dict(build_kwargs or {})
    _check_literal(build_kwargs, "build_kwargs")
    out_path = Path(out_path)
    if out_path.resolve() == teacher.path.resolve():
        raise ReductionError(f"{out_path} is the teacher file itself: write the reduced model to another file.")
    if weights is not None and not Path(weights).is_file():
        raise ReductionError(f"teacher weights {weights} do not exist: pass a state-dict file (.pt or .safetensors).")
    # Choices are checked on the meta device (no memory); the head scores need values (CPU).
    student = teacher.build("meta", **build_kwargs)
    params_before = sum(p.numel() for p in student.parameters())
    block_prefix = block_prefix or default_block_prefix(student)
    layers = len(block_container(student, block_prefix))
    keep = None if keep_layers is None else list(keep_layers)
    reduce_model(student, block_prefix, keep)

    source = "none" if prune is None else "chosen by the caller"
    if prune is None:
        heads: dict[int, list[int]] = {}
    elif set(prune) == {"heads_per_layer"}:
        heads_per_layer = prune["heads_per_layer"]
        fewest = min(a.heads for a in attention_modules(student, block_prefix))  # the layout, checked on meta
        if not _is_int(heads_per_layer) or not 0 < heads_per_layer < fewest:
            raise ReductionError(f"heads_per_layer must be an int between 1 and {fewest - 1} (a layer has {fewest} "
                                 f"heads), got {heads_per_layer!r}.")
        with torch.random.fork_rng():  # the caller's RNG state is left as it was
            torch.manual_seed(seed)
            model = reduce_model(teacher.build(**build_kwargs), block_prefix, keep, None, weights)
            if isinstance(calibration_batches, int):
                seq = seq_len or min(teacher.seq_len or 128, 128)
                if teacher.user_train_data is None and teacher.example_inputs is not default_example_inputs:
                    batches = [teacher.example_inputs(batch_size, seq)]  # a fixed sample: one batch
                else:
                    batches = list(itertools.islice(teacher.train_data(batch_size, seq, seed=seed),
                                                    calibration_batches))
            else:
                batches = list(calibration_batches)
            scores = head_importance(model, batches, teacher.loss_fn, block_prefix)
        heads = least_important_heads(scores, heads_per_layer)
        source = (f"the {heads_per_layer} least important heads per layer by Michel et al. 2019's score on "
                  f"{len(batches)} calibration batches, {'teacher weights' if weights else 'initial weights'}")
    elif all(_is_int(layer) for layer in prune):
        heads = {layer: list(prune[layer]) for layer in prune if list(prune[layer])}
    else:
        raise ReductionError(f"prune must be None, {{'heads_per_layer': n}} or {{layer: [heads]}}, got {prune!r}.")
    prune_heads(student, heads, block_prefix)  # checks the choice
    heads = {layer: sorted(heads[layer]) for layer in sorted(heads)}

    teacher_rel = Path(os.path.relpath(Path(teacher_path).resolve(), out_path.resolve().parent)).as_posix()
    weights_rel = None if weights is None else \
        Path(os.path.relpath(Path(weights).resolve(), out_path.resolve().parent)).as_posix()
    forwards = "".join(f"{name} = teacher.{name}\n" for name in FORWARDED if hasattr(teacher.module, name))
    keep_text = f"{len(keep)} of {layers} teacher layers kept" if keep is not None else f"all {layers} layers kept"
    text = FILE_TEMPLATE.format(
        teacher_name=teacher.path.name, keep_text=keep_text, prune_count=sum(map(len, heads.values())),
        doc=textwrap.fill(FILE_DOC.format(source=source), width=110), teacher_rel=teacher_rel,
        weights_rel=weights_rel, block_prefix=block_prefix,
        build_kwargs=_literal(build_kwargs), keep=_literal(keep), prune=_literal(heads), forwards=forwards)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)
    return ReducedModelFile(out_path, block_prefix, layers, keep, heads, params_before,
                            sum(p.numel() for p in student.parameters()))


def _literal(value: Any) -> str:
    """Python source for a literal, sorted and wrapped at 100 characters (deterministic)."""
    return pprint.pformat(value, width=100, compact=True, sort_dicts=True)


def _check_literal(value: Any, name: str) -> None:
    try:
        same = ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise ReductionError(f"{name} must hold Python literals only (numbers, strings, lists, dicts), got {value!r}.")
