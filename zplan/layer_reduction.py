"""Layer reduction of a teacher model (zplan.model_reduction): keep some of its repeated blocks, with their weights.

Layer reduction (keep_layers). The student keeps k of the teacher's L repeated blocks, chosen by index, with
their weights: it starts from those teacher layers, as DistilBERT takes every other BERT layer (Sanh et al.
2019, sec. 3) and DeepSpeed's layer reduction takes `teacher_layer` (compression_training.layer_reduction).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from zplan.errors import ZplanError

# Attributes that record the number of layers, updated by keep_layers on the model and on model.config (an
# object or a dict) when they equal the old count. The examples record none (their forward loops over blocks).
LAYER_COUNT_ATTRS = ("n_layers", "num_layers", "n_layer", "num_hidden_layers")


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
