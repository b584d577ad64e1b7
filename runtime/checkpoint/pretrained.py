"""train.py --init-from: training starts from pretrained weights, each rank reading only the slices it holds.

    source = init_from_path(args.init_from, plan.fingerprint.init_from, model_path)   # None: the initialisation
    pretrained = open_pretrained(source, model_file)     # files and names checked, before any collective
    model, _ = parallelize(model, weights, mesh, plan, model_file, device)
    load_pretrained(pretrained, model, ctx)               # into the parameters, in place
    optimizer = plan_optimizer(model, ...)                # fp32 masters (ZeRO 0/1, 16-bit) made from them
    load_pretrained_masters(pretrained, model, optimizer, ctx)   # the file's values into the masters

Sources: a .safetensors file, a Hugging Face folder (model.safetensors.index.json and its shards, or one
model.safetensors), or a zplan step-N checkpoint (its model states through DCP, as runtime.checkpoint.load reads
them; the optimizer states and the step are not loaded). Names: the model file builds the Hugging Face model from
its config, so the file's tensor names are the state-dict names, as they are or as transformers loads them (renamed
by the model's conversion mapping, as Mixtral's block_sparse_moe -> mlp, and a mixture of experts' per-expert
tensors joined into its stacked parameters: runtime.checkpoint.expert_weights), the base model's prefix, `model.` or
GPT-2's `transformer.`, added or stripped: whichever matches more names (a base model's file, as the Hub's gpt2 is,
lacks the prefix; a file zplan exported has the stacked names as they are); a tied parameter (lm_head.weight and the
embedding) reads whichever of its names the file has; the file's tensors that transformers also leaves unread (the
model class's _keys_to_ignore_on_load_unexpected, such as GPT-2's attn.bias masks, and old checkpoints'
rotary_emb.inv_freq) are named in the load's line and not read.

Slices: for every parameter and persistent buffer this rank holds (a plain tensor, or a DTensor under tensor
parallel / FSDP2 / expert parallel, _StridedShard included), the global indices of its local shard in each
dimension are the ones DTensor's own rule gives (distribute_tensor of an index vector, sliced locally), a fused
projection's stored order (model.fused_layout) maps them to the file's order, and
runtime.checkpoint.safetensors_read reads just those rows and columns (of a joined tensor, those of its pieces:
the experts on dim 0, the gate or up rows on the concatenated dim); they are copied into the existing storage (the
same Parameter objects), cast to its dtype. A pipeline stage reads its own modules' tensors only. The fp32 masters
of 16-bit parameters get the file's values the same way once the optimizer exists, and the parameters are rounded
from them (ShardedAdamW.parameters_from_masters).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from zplan.errors import CheckpointError
from zplan.model.fused_layout import FusedLayout, stored_layouts
from zplan.model.model_file import ModelFile
from zplan.runtime.checkpoint.expert_weights import Joined, loaded_names, read_joined
from zplan.runtime.checkpoint.folders import _STEP_DIR, _TMP_DIR, complete_checkpoints, resolve_checkpoint
from zplan.runtime.checkpoint.load import _check_model_keys, verify_checkpoint
from zplan.runtime.checkpoint.read import SafeFileSystemReader, SafeLoadPlanner, read_train_state
from zplan.runtime.checkpoint.safetensors_read import TensorEntry, read_slice, weights_of
from zplan.runtime.checkpoint.state import _OPTIONS, _check_fused_layouts, model_fused_layouts
from zplan.runtime.launch.distributed import RunContext
from zplan.runtime.optim.layouts import with_master_weights
from zplan.runtime.training.materialize import weight_roots

NONE = "none"  # --init-from none: the model's own initialisation
MIB = 2**20
_PREFIX = "model."  # what a bare Hugging Face base model's names lack


@dataclass
class Pretrained:
    """Checked weights to start from: a safetensors source (`tensors`, and the file name of each model tensor), or
    a zplan checkpoint (`checkpoint`, loaded through DCP)."""

    path: Path
    tensors: dict[str, TensorEntry]
    file_names: dict[str, str | Joined]  # model state-dict name -> the file's tensor name, or its per-expert ones
    checkpoint: Path | None = None
    ignored: list[str] = field(default_factory=list)  # the file's tensors transformers leaves unread too


def init_from_path(value: str | None, recorded: str | None, model_path: str | Path | None) -> Path | None:
    """The weights a run starts from: --init-from's PATH (None: not given), else the plan's record `recorded`
    (plan.fingerprint.init_from, relative to the model folder `model_path`), else None; 'none' is None."""
    if value is not None:
        return None if value == NONE else Path(value)
    if recorded and model_path is not None:
        return Path(model_path) / recorded
    return None


def _is_zplan_checkpoint(path: Path) -> bool:
    return path.is_dir() and bool(_STEP_DIR.match(path.name) or _TMP_DIR.match(path.name)
                                  or complete_checkpoints(path))


def open_pretrained(path: Path | None, model_file: ModelFile) -> Pretrained | None:
    """The weights at `path` checked against the model of `model_file` (built on meta): every file's header, the
    index, every tensor's name, shape and dtype. CheckpointError naming the file and the fix; no collective."""
    if path is None:
        return None
    if _is_zplan_checkpoint(path):
        step = resolve_checkpoint(path)
        read_train_state(step)  # a plausible checkpoint; its tensors are checked as DCP loads them
        return Pretrained(step, {}, {}, checkpoint=step)
    tensors = weights_of(path)
    model = model_file.build(device="meta")
    file_names, ignored = _match_names(path, model, tensors)
    return Pretrained(path, tensors, file_names, ignored=ignored)


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _prefixes(model: nn.Module) -> list[str]:
    """The prefixes a file's names may have where the model's lack them, or lack where the model's have them: a
    Hugging Face model's base_model_prefix ('model', GPT-2's 'transformer'), and 'model.'."""
    base = getattr(model, "base_model_prefix", None)
    return list(dict.fromkeys(([f"{base}."] if isinstance(base, str) and base else []) + [_PREFIX]))


def _ignored_on_load(model: nn.Module) -> re.Pattern | None:
    """The file names transformers' from_pretrained leaves unread without a word for this model
    (PreTrainedModel._adjust_missing_and_unexpected_keys): its class's _keys_to_ignore_on_load_unexpected, and the
    rotary_emb.inv_freq and position_ids buffers older checkpoints saved."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None


def _pieces(source: str | Joined, shape: torch.Size) -> list[tuple[str, tuple[int, ...]]]:
    """(file tensor name, its shape) of every tensor of the file a model tensor of `shape` is read from."""
    return source.pieces(tuple(shape)) if isinstance(source, Joined) else [(source, tuple(shape))]


def _match_names(path: Path, model: nn.Module,
                 tensors: dict[str, TensorEntry]) -> tuple[dict[str, str | Joined], list[str]]:
    """({model tensor name: file tensor name, or the Joined of its per-expert tensors} for every parameter and
    persistent buffer the file holds, the file's names left unread as transformers leaves them); every parameter
    must be there (every piece of a joined one), of its shape and a floating-point dtype, and the file must hold
    nothing else."""
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}  # tied parameters: every name of one tensor
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    buffers = [name for name in state if id(state[name]) not in groups]

    def rename(name: str, how: tuple[str, str]) -> str:
        change, prefix = how
        return {"": name, "add": prefix + name, "strip": name.removeprefix(prefix)}[change]

    # the file's names as they are, or as transformers loads them ({name: file tensor name or Joined}), with a
    # prefix changed or not: whichever matches more of the model's (ties: the names as they are)
    views = [{name: name for name in tensors}, loaded_names(model, tensors)]
    hows = [("", ""), *((change, p) for p in _prefixes(model) for change in ("add", "strip"))]
    view, how = max(((v, h) for v in views for h in hows),
                    key=lambda pair: sum(rename(n, pair[1]) in pair[0] for n in state))
    matched, used, missing, shapes, types = {}, set(), [], [], []
    for names in [*groups.values(), *([b] for b in buffers)]:
        candidates = [rename(n, how) for n in names]
        sources = [view[c] for c in candidates if c in view]
        if not sources:
            if names[0] not in buffers:  # a buffer the file lacks keeps its initialisation
                missing.append(candidates[0])
            continue
        tensor = state[names[0]]
        used.update(name for source in sources for name, _ in _pieces(source, tensor.shape))
        for name, shape in _pieces(sources[0], tensor.shape):
            entry = tensors.get(name)
            if entry is None:
                missing.append(name)
            elif entry.shape != shape:
                shapes.append(f"{name} {list(entry.shape)} (the model's {list(shape)})")
            elif tensor.is_floating_point() and not entry.dtype.is_floating_point:
                types.append(f"{name} {entry.dtype} (the model's {tensor.dtype})")
        matched.update(dict.fromkeys(names, sources[0]))
    ignore = _ignored_on_load(model)
    unused = sorted(set(tensors) - used)
    ignored = [name for name in unused if ignore is not None and ignore.search(name)]
    unexpected = [name for name in unused if name not in ignored]
    problems = [f"missing {len(missing)} of the model's tensors ({_names(missing)})" if missing else "",
                f"{len(unexpected)} unexpected ({_names(unexpected)})" if unexpected else "",
                f"{len(shapes)} of another shape ({_names(shapes, 3)})" if shapes else "",
                f"{len(types)} not floating point ({_names(types, 3)})" if types else ""]
    if any(problems):
        raise CheckpointError(
            f"--init-from {path} does not hold this model's weights: {'; '.join(p for p in problems if p)}. Pass the "
            "weights of the model the plan was compiled for (the Hugging Face folder whose config.json builds it), "
            "or --init-from none to start from the model's initialisation")
    return matched, ignored


# ---- this rank's slices --------------------------------------------------------------------------------


def _on_dim0(placement):
    """`placement` (a Shard or _StridedShard) moved to dimension 0, for a vector of one dimension's indices."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor)
    return Shard(0)


def global_indices(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Per dimension, the global indices (int64, CPU) of the elements this rank holds of `tensor`: all of a plain
    tensor, the local shard's of a DTensor (by DTensor's own rule: distribute_tensor of an index vector, local)."""
    if not isinstance(tensor, DTensor):
        return [torch.arange(n) for n in tensor.shape]
    mesh, indices = tensor.device_mesh, []
    for d, n in enumerate(tensor.shape):
        on_d = [_on_dim0(p) if isinstance(p, (Shard, _StridedShard)) and p.dim == d else Replicate()
                for p in tensor.placements]
        if all(isinstance(p, Replicate) for p in on_d):
            indices.append(torch.arange(n))
            continue
        vector = torch.arange(n, device=mesh.device_type)
        indices.append(distribute_tensor(vector, mesh, on_d, src_data_rank=None).to_local().cpu())
    return indices


def _fill(pretrained: Pretrained, name: str, target: torch.Tensor, like: torch.Tensor,
          layout: tuple[FusedLayout, int] | None) -> int:
    """Read this rank's slice of `name` into `target` (in place, cast); `like`: the tensor whose placement gives
    the slice when `target` is a plain tensor of its local shape (a master of a tensor-parallel parameter).
    Returns the bytes read."""
    local = target._local_tensor if isinstance(target, DTensor) else target
    placed = target if isinstance(target, DTensor) or not isinstance(like, DTensor) else like
    indices = global_indices(placed)
    if layout is not None:  # stored order -> the file's order (model.fused_layout)
        fused, dim = layout
        indices[dim] = fused.stored_order()[indices[dim]]
    source = pretrained.file_names[name]
    if isinstance(source, Joined):
        piece = read_joined(source, pretrained.tensors, indices)
    else:
        piece = read_slice(pretrained.tensors[source], source, indices)
    if piece.shape != local.shape:
        label = source.name if isinstance(source, Joined) else source
        raise RuntimeError(f"--init-from: this rank's slice of {label} is {tuple(piece.shape)}, its local "
                           f"tensor {tuple(local.shape)}")
    with torch.no_grad():
        local.copy_(piece)
    return piece.nbytes


def _targets(model: nn.Module, file_names: dict[str, str | Joined]):
    """(name, tensor, fused layout or None) of every parameter and persistent buffer this rank holds that the file
    has, once per tensor (ties, and a pipeline's stage modules and skeletons, share tensors)."""
    seen: set[int] = set()
    for root in weight_roots(model):
        layouts = stored_layouts(root)
        named = [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
        for name, tensor in named:
            if name in file_names and id(tensor) not in seen and not tensor.is_meta:
                seen.add(id(tensor))
                yield name, tensor, layouts.get(name)


def load_pretrained(pretrained: Pretrained | None, model: nn.Module, ctx: RunContext) -> str | None:
    """The weights into the parallelized `model`, this rank's slices only; one line saying what was read."""
    if pretrained is None:
        return None
    if pretrained.checkpoint is not None:
        return _load_checkpoint_weights(pretrained.checkpoint, model, ctx)
    read = count = joined = 0
    for name, tensor, layout in _targets(model, pretrained.file_names):
        read += _fill(pretrained, name, tensor, tensor, layout)
        count += 1
        joined += isinstance(pretrained.file_names[name], Joined)
    total = sum(e.dtype.itemsize * torch.Size(e.shape).numel() for e in pretrained.tensors.values())
    left = (f"; {len(pretrained.ignored)} not this model's, left unread as transformers leaves them "
            f"({_names(pretrained.ignored, 3)})" if pretrained.ignored else "")
    pieces = f" ({joined} of them joined from per-expert tensors)" if joined else ""
    return (f"weights from {pretrained.path}: {count} tensors{pieces}, {read / MIB:.1f} MiB read on this rank of "
            f"{total / MIB:.1f} MiB{left}")


def load_pretrained_masters(pretrained: Pretrained | None, model: nn.Module, optimizer: torch.optim.Optimizer,
                            ctx: RunContext) -> None:
    """The file's values into the fp32 masters the optimizer keeps of 16-bit parameters (ZeRO 0/1 with mixed
    precision), then the parameters rounded from them (collective over dp); nothing where there are none."""
    masters = optimizer.master_weights() if pretrained is not None and hasattr(optimizer, "master_weights") else {}
    if not masters:  # the same on every rank: the plan's precision and ZeRO stage decide
        return
    if pretrained.checkpoint is not None:
        state, replaced = with_master_weights(get_model_state_dict(model, options=_OPTIONS), optimizer)
        wanted = {key: state[key] for key in replaced}
        dcp.load({"model": wanted}, storage_reader=SafeFileSystemReader(pretrained.checkpoint),
                 planner=SafeLoadPlanner())
    else:
        for name, tensor, layout in _targets(model, pretrained.file_names):
            master = optimizer.master(tensor) if tensor in optimizer.state else None
            if master is not None:
                _fill(pretrained, name, master, tensor, layout)
    optimizer.parameters_from_masters()


def _load_checkpoint_weights(path: Path, model: nn.Module, ctx: RunContext) -> str:
    """A zplan checkpoint's model states into `model` (runtime.checkpoint.load's checks, then DCP in this run's
    layout); its optimizer states, step and RNG are not read. Collective."""
    verify_checkpoint(path, ctx)
    train_state = read_train_state(path)
    _check_fused_layouts(path, train_state.get("fused_layouts", {}), model_fused_layouts(model))
    state = get_model_state_dict(model, options=_OPTIONS)
    _check_model_keys(path, state, ctx)
    try:
        dcp.load({"model": state}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"cannot load the weights of checkpoint {path} into this model: {error}") from error
    set_model_state_dict(model, state, options=_OPTIONS)
    return f"weights from checkpoint {path} (step {train_state['step']}; optimizer states and step not loaded)"
