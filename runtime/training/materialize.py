"""Create the model's weights so that every run of a plan starts from the same numbers, shard by shard.

Contract: the weights equal a single process's `torch.manual_seed(seed); build_fn()` bit for bit, whatever
the plan, so a run under any plan can be compared with a single-process run; and no rank holds the full
model unless the plan keeps it whole (tp = pp = 1 with ZeRO 0/1).

    model, weights = build_meta_model(build_fn, seed)    # structure on the meta device, init recorded
    apply_tensor_parallel / apply_recompute / apply_pipeline [/ apply_data_parallel for ZeRO 2/3]
    report = materialize_weights(model, weights, device)  # this rank's shards, filled by replay

How. build_meta_model runs build_fn once on fake tensors and records the aten ops of its construction
and initialisation (runtime.training.init_replay): the model file's own init (nanoGPT's `_init_weights`, a
scaled residual init, RoPE tables) is what gets replayed, so nothing depends on `reset_parameters()`,
which model files do not all define and which would not reproduce their init. The parallel steps work
on the meta model (DTensor and FSDP2 accept meta parameters). materialize_weights then allocates only
this rank's local tensors (a DTensor's local shard; FSDP2's sharded parameters after fully_shard) and
replays the program on the CPU in the recorded order under the seed: every random op draws what the
full build draws (the Mersenne Twister cannot skip ahead to a shard's part of the stream, so each
random op runs, into a scratch tensor when nobody needs its result), and as soon as a parameter or
buffer has its final value this rank's slice of it is copied in (distribute_tensor with
src_data_rank=None: local slicing, no communication; _StridedShard for FSDP2 x TP included) and the full
value is dropped. Host memory for the weights: this rank's shards plus about the largest single tensor.

When the model file cannot be recorded (it reads tensor values, e.g. `.item()` or `if t.any()`, makes
data-dependent shapes, passes its own torch.Generator, or puts tensors on another device), the model is
built in full on every rank as before (build_model), with a one-line warning that says why; the run is
the same, only the host memory is the full model's. If a recorded program fails to replay, the full
build is made at materialisation time and sliced the same way (also with a warning).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from zplan.errors import ModelLoadError
from zplan.model.fused_layout import stored_layouts, to_stored
from zplan.runtime.parallel.data_parallel import fsdp_param_groups
from zplan.runtime.parallel.pipeline import PipelineRun
from zplan.runtime.training.init_replay import InitProgram, UnsupportedInit, named_tensors, record_init, replay_init

MIB = 2**20


def build_model(build_fn: Callable[[], nn.Module], seed: int, device: torch.device | str) -> nn.Module:
    """The whole model of `build_fn` with the weights of `torch.manual_seed(seed); build_fn()`, on `device`."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = build_fn()
    _check_module(model)
    return model.to(device)


def _check_module(model) -> None:
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"build_model() returned {type(model).__name__}, not a torch.nn.Module")


def _warn(message: str) -> None:
    """One line on stderr, from the first rank only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"zplan: warning: {message}", file=sys.stderr, flush=True)


@dataclass
class DeferredWeights:
    """How to make the weights of a model that build_meta_model returned on meta."""

    build_fn: Callable[[], nn.Module]
    seed: int
    program: InitProgram | None  # None: the model was built in full (fallback_reason says why)
    fallback_reason: str | None = None


@dataclass
class MaterializeReport:
    """What materialisation held on this rank, in bytes."""

    shard_bytes: int  # this rank's parameters, buffers and tensor attributes, as allocated
    largest_full_tensor_bytes: int  # the largest full tensor the replay made
    peak_replay_bytes: int  # most bytes of replay tensors alive at once (full tensors, scratch)
    fallback_reason: str | None = None

    def __str__(self) -> str:
        if self.fallback_reason is not None:
            return (f"weights built in full on this rank ({self.fallback_reason}); this rank keeps "
                    f"{self.shard_bytes / MIB:.1f} MiB")
        return (f"materialised {self.shard_bytes / MIB:.1f} MiB of shards on this rank; largest full tensor "
                f"held {self.largest_full_tensor_bytes / MIB:.1f} MiB (replay peak "
                f"{self.peak_replay_bytes / MIB:.1f} MiB)")


def build_meta_model(build_fn: Callable[[], nn.Module], seed: int,
                     device: torch.device | str = "cpu") -> tuple[nn.Module, DeferredWeights]:
    """The model of `build_fn` on the meta device and how to make its weights later (materialize_weights).

    Falls back to the whole model on `device` (build_model) with a warning when the initialisation
    cannot be recorded (module docstring)."""
    try:
        model, program = record_init(build_fn)
    except UnsupportedInit as error:
        reason = f"its initialisation cannot be replayed shard by shard: {error}"
        _warn(f"building the whole model on every rank: {reason}")
        return build_model(build_fn, seed, device), DeferredWeights(build_fn, seed, None, reason)
    _check_module(model)
    return model, DeferredWeights(build_fn, seed, program)


# ---- allocating this rank's tensors -------------------------------------------------------------------


def weight_roots(model: nn.Module) -> list[nn.Module]:
    """Modules under which every tensor this rank keeps appears with its model-file name: the model, or a
    pipeline's stage modules and the shallow model copies its first and last stage call."""
    if isinstance(model, PipelineRun):
        return model.weight_roots()
    return [getattr(model, "module", model) if isinstance(model, nn.parallel.DistributedDataParallel) else model]


def _cpu_offloaded(roots: list[nn.Module]) -> set[int]:
    """ids of FSDP2 sharded parameters that CPUOffloadPolicy keeps on the host."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    ids: set[int] = set()
    for root in roots:
        for module in root.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in fsdp_param_groups(module):
                if isinstance(group.offload_policy, CPUOffloadPolicy):
                    ids.update(id(fsdp_param.sharded_param) for fsdp_param in group.fsdp_params)
    return ids


def _empty_like(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Uninitialised memory of `tensor`'s (local) size on `device`. A plain tensor's is made from its shape alone:
    a fake mode around (the dry run's, runtime.dryrun.fake_world) would keep a weakref to a meta tensor given as input,
    and swap_tensors refuses tensors with weakrefs (a DTensor's input is its local tensor, not the swapped one)."""
    if isinstance(tensor, DTensor):
        return torch.empty_like(tensor, device=device)
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)


def _allocate(named: dict[str, torch.Tensor], device: torch.device | str, on_cpu: set[int]) -> int:
    """Give every meta tensor of `named` uninitialised memory of its local size on `device`, in place
    (torch.utils.swap_tensors: the same Python objects, so ties, FSDP2's references and pipeline
    skeletons see the new data). Returns the bytes allocated."""
    done: set[int] = set()
    total = 0
    for tensor in named.values():
        if id(tensor) in done or not tensor.is_meta:
            continue
        done.add(id(tensor))
        empty = _empty_like(tensor, "cpu" if id(tensor) in on_cpu else device)
        if isinstance(tensor, nn.Parameter):
            empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, empty)
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def local_piece(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` for `target`: the local shard of a DTensor (sliced here, without
    communication, by the same rule DTensor uses, _StridedShard included), else `full` itself."""
    if isinstance(target, DTensor):
        return distribute_tensor(full.to(target.device), target.device_mesh, target.placements,
                                 src_data_rank=None).to_local()
    return full


def _fill(target: torch.Tensor, name: str, full: torch.Tensor) -> None:
    local = target._local_tensor if isinstance(target, DTensor) else target
    piece = local_piece(full, target)
    if piece.shape != local.shape:
        raise RuntimeError(f"materialising {name}: this rank's piece of the full {tuple(full.shape)} is "
                           f"{tuple(piece.shape)}, its local tensor {tuple(local.shape)}")
    with torch.no_grad():
        local.copy_(piece)


# ---- filling them -------------------------------------------------------------------------------------


def materialize_weights(model: nn.Module, weights: DeferredWeights,
                        device: torch.device | str) -> MaterializeReport:
    """Allocate and fill this rank's part of every parameter, buffer and tensor attribute of `model` (a
    build_meta_model model after any parallel steps), equal to the slices of `torch.manual_seed(seed);
    build_fn()`. Leaves the global RNG where that build leaves it. A model built in full: nothing to do."""
    roots = weight_roots(model)
    named: dict[str, torch.Tensor] = {}
    stored: dict[str, tuple] = {}  # fused projections' tensors: filled in their grouped order (model.fused_layout)
    for root in roots:
        named.update(named_tensors(root))
        stored.update(stored_layouts(root))
    if weights.program is None:
        local_bytes = sum((t._local_tensor if isinstance(t, DTensor) else t).nbytes
                          for t in {id(t): t for t in named.values()}.values())
        return MaterializeReport(local_bytes, 0, 0, weights.fallback_reason)
    shard_bytes = _allocate(named, device, _cpu_offloaded(roots))
    targets = {name: tensor for name, tensor in named.items() if name in weights.program.outputs}
    missing = sorted(set(named) - set(targets))
    if missing:
        raise RuntimeError(f"materialising: {', '.join(missing[:5])} are not tensors of the recorded model")
    filled: set[int] = set()
    largest = 0

    def emit(name: str, full: torch.Tensor) -> None:
        nonlocal largest
        largest = max(largest, full.nbytes)
        target = targets[name]
        if id(target) not in filled:  # a tied tensor is filled once
            filled.add(id(target))
            _fill(target, name, to_stored(full, *stored[name]) if name in stored else full)

    try:
        stats = replay_init(weights.program, weights.seed, list(targets), emit)
    except Exception as error:  # an op that replays differently from its recording: build in full
        reason = f"replaying its initialisation failed ({type(error).__name__}: {error})"
        _warn(f"building the whole model once on every rank to slice its weights: {reason}")
        filled.clear()
        full_model = build_model(weights.build_fn, weights.seed, "cpu")
        for name, full in named_tensors(full_model).items():
            if name in targets:
                emit(name, full.detach())
        return MaterializeReport(shard_bytes, largest, sum(t.nbytes for t in full_model.state_dict().values()),
                                 reason)
    return MaterializeReport(shard_bytes, largest, stats.peak_live_bytes)
