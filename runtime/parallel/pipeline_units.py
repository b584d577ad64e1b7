"""The units of pipeline stages: which module paths are the embedding, the blocks and the head (unit_roles), and
the modules a stage runs in place of the units of other stages (how a stage runs:
runtime/parallel/pipeline_split.py)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zplan.errors import ZplanError

BLOCK_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class PipelineSplitError(ZplanError):
    """The plan's stages do not fit the model, or the model's forward cannot be cut at them."""


# ---- stand-ins for the units of other stages -----------------------------------------------------


class _Received:
    """The hidden state this stage received for the forward in progress (shared by its stand-ins)."""

    tensor: torch.Tensor | None = None


def _meta_replica(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters and buffers are meta tensors of the same shapes and dtypes (no memory)."""
    def meta(t: torch.Tensor) -> torch.Tensor:  # the global shape of a DTensor too
        return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")

    clone = copy.copy(module)
    clone._parameters = {n: None if p is None else nn.Parameter(meta(p), p.requires_grad)
                         for n, p in module._parameters.items()}
    clone._buffers = {n: None if b is None else meta(b) for n, b in module._buffers.items()}
    clone._modules = {n: None if m is None else _meta_replica(m) for n, m in module._modules.items()}
    return clone


class ZerosForEmbedding(nn.Module):
    """Stands in for an embedding module of stage 0 on a later stage: zeros shaped like the received hidden
    state (B, T, h), in its dtype, so the code between the embedding and the first block runs as in one
    process (what it computes from them is thrown away when the first block hands over the hidden state).
    Other attributes are the embedding's, read from a meta replica (e.g. a forward reading its weight's dtype)."""

    def __init__(self, embedding: nn.Module, received: _Received):
        super().__init__()
        self._received = received
        self._replica = (_meta_replica(embedding),)  # in a tuple: not a submodule

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_replica"][0], name)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        hidden = self._received.tensor
        return torch.zeros(tuple(hidden.shape), dtype=hidden.dtype, device=_local(hidden).device)


class ReceivedForBlock(nn.Module):
    """Stands in for a block of an earlier stage: gives the hidden state this stage received."""

    def __init__(self, received: _Received):
        super().__init__()
        self._received = received

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self._received.tensor


class ReceivedIntoBlock(nn.Module):
    """Wraps this stage's first block (when the stage starts with one): the block is called as the forward calls
    it, with the received hidden state in place of the one the forward computed (from the stand-ins)."""

    def __init__(self, block: nn.Module, received: _Received):
        super().__init__()
        self._block = (block,)  # in a tuple: the block is the chunk's, not this wrapper's
        self._received = received

    def forward(self, *args, **kwargs):
        if args:
            args = (self._received.tensor, *args[1:])
        elif "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": self._received.tensor}
        else:
            raise PipelineSplitError("a pipeline stage hands its successor the hidden state a block is called with: "
                                     "call each block with it as the first argument or as hidden_states=")
        return self._block[0](*args, **kwargs)


class _StageOutput(BaseException):  # not an Exception: a model's own `except Exception` must not catch it
    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class EndOfStage(nn.Module):
    """Stands in for the first unit of a later stage: ends the forward with the hidden state it is given."""

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            raise PipelineSplitError("a pipeline stage hands its successor the hidden state a block is called with: "
                                     "call each block with it as the first argument or as hidden_states=")
        raise _StageOutput(hidden)


# ---- which module does what ----------------------------------------------------------------------


@dataclass(frozen=True)
class UnitRoles:
    """The module paths of all stages, sorted into embedding, blocks and head (see the module docstring)."""

    embedding: tuple[str, ...]  # before the first block: only stage 0 runs them
    head: tuple[str, ...]  # after the last block: the last stage runs them
    block_containers: tuple[str, ...]  # parents of the blocks, e.g. ('model.layers',)
    all_paths: tuple[str, ...]  # every stage's paths, in stage order


def _is_block(model: nn.Module, path: str) -> bool:
    parent, _, _ = path.rpartition(".")
    return bool(parent) and isinstance(model.get_submodule(parent), BLOCK_CONTAINERS)


def unit_roles(model: nn.Module, stage_modules: Sequence[Sequence[str]]) -> UnitRoles:
    """Check that `stage_modules` cover the model's parameters exactly once; sort the paths by role."""
    if len(stage_modules) < 2:
        raise PipelineSplitError(f"a pipeline needs at least 2 stages, got {len(stage_modules)}")
    flat = [path for stage in stage_modules for path in stage]
    for index, stage in enumerate(stage_modules):
        if not stage:
            raise PipelineSplitError(f"pipeline stage {index} runs no module: give every stage at least one unit")
    for path in flat:
        try:
            model.get_submodule(path)
        except AttributeError as error:
            raise PipelineSplitError(
                f"stage module {path!r} is not a module of {type(model).__name__}: the plan was made for "
                "another model; compile it again for this model file") from error
    seen: set[str] = set()
    for path in flat:
        clash = next((p for p in seen if p == path or path.startswith(p + ".") or p.startswith(path + ".")), None)
        if clash is not None:
            raise PipelineSplitError(f"module {path!r} is in two pipeline stages (with {clash!r}): each module "
                                     "must belong to exactly one stage")
        seen.add(path)
    if dict(model.named_parameters(recurse=False)):
        names = ", ".join(dict(model.named_parameters(recurse=False)))
        raise PipelineSplitError(f"{type(model).__name__} holds parameters at its root ({names}), which no "
                                 "pipeline stage can own: move them into a submodule (e.g. the embedding's)")
    uncovered = [name for name, _ in model.named_parameters(remove_duplicate=False)
                 if not any(name.startswith(path + ".") for path in flat)]
    if uncovered:
        raise PipelineSplitError(f"parameters {', '.join(uncovered[:5])} are in no pipeline stage: the stages "
                                 "must list every module that holds parameters")
    blocks = [i for i, path in enumerate(flat) if _is_block(model, path)]
    if not blocks:
        raise PipelineSplitError(f"none of the stage modules of {type(model).__name__} is a block (a child of a "
                                 "ModuleList, ModuleDict or Sequential): keep the repeated blocks in one of those")
    embedding, head = tuple(flat[: blocks[0]]), tuple(flat[blocks[-1] + 1:])
    if not set(embedding) <= set(stage_modules[0]):
        raise PipelineSplitError(f"the embedding modules {list(embedding)} must all be in pipeline stage 0")
    if not set(head) <= set(stage_modules[-1]):
        raise PipelineSplitError(f"the head modules {list(head)} must all be in the last pipeline stage")
    containers = tuple(dict.fromkeys(flat[i].rpartition(".")[0] for i in blocks))
    return UnitRoles(embedding=embedding, head=head, block_containers=containers, all_paths=tuple(flat))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
