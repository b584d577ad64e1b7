"""The state a checkpoint holds: the model's and the optimizer's state dicts as DCP saves and loads them (fp32
masters in place of 16-bit parameters), the fused layouts, each rank's RNG state; DCP's errors in one line.

Resharding: tensors are saved as what get_state_dict returns with the default options, i.e. each
rank's DTensor shards under FSDP2 (ZeRO 2/3) and replicated plain tensors under DDP (ZeRO 0/1; DCP
writes each once), named by parameter FQN without wrapper prefixes; the optimizer's state is flattened
to one entry per parameter (`optimizer.state.<fqn>.exp_avg`). ZeRO-1's optimizer (runtime.optim.layouts) holds
each moment as a DTensor of the parameter's shape, Shard(0) over dp, the layout FSDP2 gives it too
(with tensor parallel: on the (dp, tp) mesh, laid out as FSDP2 lays out a tensor-parallel parameter).
Loading asks DCP for the tensors in the layout of the run that loads, whatever layout wrote them, so a
checkpoint of ZeRO-3 or ZeRO-1 on 2 ranks loads under ZeRO-0, another ZeRO stage or on 1 rank.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from zplan.errors import CheckpointError
from zplan.model.fused_layout import layouts_as_json, stored_layouts
from zplan.runtime.optim.layouts import with_master_weights
from zplan.runtime.training.materialize import weight_roots

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # per-parameter keys: reshardable


# ---- state dicts ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _gradients_set_aside(optimizer: torch.optim.Optimizer):
    """DCP's state-dict calls give an optimizer without states its states by a step on zero gradients, but only where
    no parameter has a gradient; DDP's always exist (runtime.parallel.data_parallel: views of its buckets), so they step
    aside."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    """(model state, optimizer state, {key: the 16-bit parameter's entry} of the model entries that are fp32 masters
    in its place: with_master_weights)."""
    with _gradients_set_aside(optimizer):
        model_state, optimizer_state = get_state_dict(model, optimizer, options=_OPTIONS)
    model_state, replaced = with_master_weights(model_state, optimizer)
    return model_state, optimizer_state, replaced


def _rng_state(device: torch.device) -> dict[str, Any]:
    import random

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(rank_state: dict[str, Any], device: torch.device) -> bool:
    """Set this process's RNGs as they were at the checkpoint; False when the checkpoint has no RNG
    state for this rank (written by another world size or layout)."""
    import random

    state = rank_state.get("rng")
    if state is None:
        return False

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    return True


def describe_dcp_error(error: BaseException) -> str:
    """One line per distinct cause of a DCP failure (its CheckpointException carries every rank's
    exception with a traceback, too long for a message that says what to do)."""
    if not isinstance(error, CheckpointException):
        return f"{type(error).__name__}: {error}"
    causes: dict[str, list[int]] = {}
    for rank, (exception, _) in sorted(error.failures.items()):
        causes.setdefault(f"{type(exception).__name__}: {exception}", []).append(rank)
    return "; ".join(f"{cause} (rank {', '.join(map(str, ranks))})" for cause, ranks in causes.items())


def model_fused_layouts(model: nn.Module) -> dict[str, dict]:
    """{parameter name: its fused layout as JSON} of the whole model, on every rank (collective)."""
    local = {name: layout for root in weight_roots(model) for name, layout in stored_layouts(root).items()}
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, layouts_as_json(local))
    return {name: entry for part in gathered for name, entry in part.items()}


def _check_fused_layouts(path: Path, saved: dict[str, dict], ours: dict[str, dict]) -> None:
    """A checkpoint's fused projections must be stored in the order this run stores them: the same tensors with
    other meanings of their rows would load without an error and train on permuted weights."""
    differ = sorted(name for name in set(saved) | set(ours) if saved.get(name) != ours.get(name))
    if differ:
        name = differ[0]
        raise CheckpointError(
            f"{path} stores {name} as {saved.get(name) or 'one projection in the model file order'}, this run as "
            f"{ours.get(name) or 'one projection in the model file order'} (model/fused_layout.py): the checkpoint "
            f"is of another model or of a zplan that stored fused projections differently"
            + (f" ({len(differ) - 1} more tensors)" if len(differ) > 1 else ""))
