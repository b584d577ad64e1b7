"""Loading a checkpoint into the model and optimizer of the run that resumes: its files checked against its
manifest, its train_state.json and tensor names checked, then DCP's load in this run's layout.

Hyper-parameters (the optimizer's param_groups: lr, betas, weight decay, ...) are saved for reference
but not loaded: they come from the script that resumes, as the LR schedule does (a function of the step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_state_dict

from zplan.errors import CheckpointError
from zplan.runtime.checkpoint.folders import LATEST_VALID, resolve_checkpoint
from zplan.runtime.checkpoint.manifest import MANIFEST_FILE, check_manifest, file_problems, no_manifest_problem, share
from zplan.runtime.checkpoint.read import SafeFileSystemReader, SafeLoadPlanner, load_rank_state, read_train_state
from zplan.runtime.checkpoint.state import (
    _OPTIONS,
    _check_fused_layouts,
    _gradients_set_aside,
    _state_dicts,
    describe_dcp_error,
    model_fused_layouts,
)
from zplan.runtime.launch.distributed import RunContext

ALLOW_UNVERIFIED_FLAG = "--allow-unverified"  # train.py's and `zplan export`'s
_PARAM_GROUPS_PREFIX = "param_groups."
_MODEL_PREFIX = "model."  # the model's entries in DCP's metadata


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    step: int  # optimizer steps done when it was saved
    train_state: dict[str, Any]  # train_state.json
    # This rank's rank file; when another world size or layout wrote the checkpoint, rank 0's file without its
    # RNG and data-iterator state (which belong to a rank of the other layout).
    rank_state: dict[str, Any]
    # None: verified against its manifest, and of a verified run; else why not ("step-000004 has no MANIFEST.json"):
    # the checkpoints of a run resumed from it carry this in their train_state.json (unverified_origin)
    unverified_origin: str | None = None


def verify_checkpoint(path: Path, ctx: RunContext, *, allow_unverified: bool = False) -> bool:
    """Collective: rank 0 checks the manifest against the folder's listing (every file covered, every entry present,
    regular files only), then each rank hashes its share of the files; every rank raises the same CheckpointError,
    naming the first problem, when there is one. A checkpoint without a manifest: CheckpointError, or with
    allow_unverified a warning and False. True: verified."""
    found: list[Any] = [check_manifest(path) if ctx.is_main else None]
    dist.broadcast_object_list(found, src=0)
    check = found[0]
    if check.files is None and not check.problems:
        if not allow_unverified:
            raise CheckpointError(f"{no_manifest_problem(path)}: not loaded. Resume from a verified checkpoint "
                                  f"(--resume {LATEST_VALID} takes the newest), or give {ALLOW_UNVERIFIED_FLAG} to "
                                  "load it anyway (a damaged file then goes unnoticed)")
        if ctx.is_main:
            print(f"zplan: warning: {no_manifest_problem(path)}: loaded without verifying it "
                  f"({ALLOW_UNVERIFIED_FLAG}); the checkpoints of this run are not counted as verified", flush=True)
        return False
    mine = file_problems(path, check.files, share(check.to_hash, ctx.rank, ctx.world_size)) if check.files else []
    gathered: list[list[str]] = [[] for _ in range(ctx.world_size)]
    dist.all_gather_object(gathered, mine)
    problems = check.problems + [problem for part in gathered for problem in part]
    if problems:
        more = f" ({len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {path} is damaged: {problems[0]}{more}. Resume from an older complete "
                              f"checkpoint with --resume {LATEST_VALID}, or give its step-N folder")
    return True


# ---- loading -------------------------------------------------------------------------------------


def _tied_key(key: str, tied_names: dict[str, str]) -> str:
    """'state.lm_head.weight.exp_avg' -> 'state.wte.weight.exp_avg' for tied_names {'lm_head.weight': 'wte.weight'}."""
    for name, first_name in tied_names.items():
        if key.startswith(f"state.{name}."):
            return f"state.{first_name}." + key[len(f"state.{name}."):]
    return key


def _saved_model_keys(path: Path, ctx: RunContext) -> list[str]:
    """The model's entries (without 'model.') in the checkpoint's .metadata, read on rank 0 (every rank gets them, or
    the same CheckpointError)."""
    found: list[Any] = [None]
    if ctx.is_main:
        try:
            metadata = SafeFileSystemReader(path).read_metadata()
            found = [sorted(key[len(_MODEL_PREFIX):] for key in metadata.state_dict_metadata
                            if isinstance(key, str) and key.startswith(_MODEL_PREFIX))]
        except Exception as error:  # CheckpointError, or anything else: every rank raises it
            found = [str(error) if isinstance(error, CheckpointError) else
                     f"cannot read the metadata of {path} ({type(error).__name__}: {error})"]
    dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], str):
        raise CheckpointError(found[0])
    return found[0]


def _names(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_model_keys(path: Path, model_state: dict, ctx: RunContext) -> None:
    """Collective: the checkpoint must hold exactly the model's entries (every rank's, a pipeline stage has its own):
    a missing one would stop DCP with one name, an unexpected one would be ignored without a word."""
    saved = set(_saved_model_keys(path, ctx))
    gathered: list[list[str]] = [[] for _ in range(ctx.world_size)]
    dist.all_gather_object(gathered, sorted(model_state))
    ours = {key for part in gathered for key in part}
    missing, unexpected = sorted(ours - saved), sorted(saved - ours)
    if missing or unexpected:
        what = [f"missing {len(missing)} of the model's tensors ({_names(missing)})" if missing else "",
                f"{len(unexpected)} unexpected ({_names(unexpected)})" if unexpected else ""]
        raise CheckpointError(f"checkpoint {path} does not hold this model's tensors: "
                              f"{'; '.join(w for w in what if w)}. It is a checkpoint of another model (or of another "
                              "version of this model file): not loaded")


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: RunContext,
    *, layout: dict[str, Any] | None = None, verify: bool = True, allow_unverified: bool = False,
    total_steps: int | None = None,
) -> LoadedCheckpoint:
    """Load checkpoint `path` (a step-N folder, or a folder of them: the newest complete one) into the
    model and optimizer as this run lays them out. All ranks call it (DCP's load is collective).
    The RNG state comes back in `rank_state["rng"]` (same world size and layout only): restore it with
    restore_rng_state once the data iterator has been fast-forwarded, which may draw random numbers.
    verify: check every file against the checkpoint's manifest first (verify_checkpoint); False when the caller
    just did (--resume latest-valid). allow_unverified: load a checkpoint without a manifest (with a warning).
    total_steps: the run's length; a checkpoint past it is refused before anything is loaded.
    Before DCP reads a tensor: train_state.json must be plausible (read_train_state) and the checkpoint must hold
    exactly the model's tensors (_check_model_keys)."""
    path = resolve_checkpoint(path)
    verified = verify_checkpoint(path, ctx, allow_unverified=allow_unverified) if verify else True
    train_state = read_train_state(path)
    if total_steps is not None and train_state["step"] > total_steps:
        raise CheckpointError(f"{path} is at step {train_state['step']}, beyond --steps {total_steps}: "
                              "pass the total number of steps of the run (at least the checkpoint's)")
    unverified_origin = train_state.get("unverified_origin") or (
        None if verified else f"{path.name} has no {MANIFEST_FILE}")
    _check_fused_layouts(path, train_state.get("fused_layouts", {}), model_fused_layouts(model))
    model_state, optimizer_state, replaced = _state_dicts(model, optimizer)
    _check_model_keys(path, model_state, ctx)
    # Ask DCP for every tensor in this run's layout; param_groups stay this script's hyper-parameters.
    wanted_optimizer = {k: v for k, v in optimizer_state.items() if not k.startswith(_PARAM_GROUPS_PREFIX)}
    # A tied parameter's optimizer state is saved under its first name ('wte.weight'); a pipeline rank that
    # holds it under another name ('lm_head.weight') reads that entry (PipelineRun.tied_names).
    reads_from = {key: _tied_key(key, getattr(model, "tied_names", {})) for key in wanted_optimizer}
    wanted_optimizer = {reads_from[key]: value for key, value in wanted_optimizer.items()}
    try:
        dcp.load({"model": model_state, "optimizer": wanted_optimizer}, storage_reader=SafeFileSystemReader(path),
                 planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as error:  # CheckpointException: every rank's errors
        raise CheckpointError(
            f"cannot load checkpoint {path} into this model and optimizer: {describe_dcp_error(error)}"
        ) from error
    optimizer_state.update({key: wanted_optimizer[reads_from[key]] for key in reads_from})
    if replaced:  # the fp32 masters were loaded in place: the 16-bit parameters from them, then as themselves
        optimizer.parameters_from_masters()
        model_state.update(replaced)
    with _gradients_set_aside(optimizer):
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                       options=_OPTIONS)

    same_world = train_state["world_size"] == ctx.world_size and train_state.get("layout", {}) == (layout or {})
    rank_file = path / f"rank-{(ctx.rank if same_world else 0):05d}.pt"
    rank_state = load_rank_state(rank_file)
    if not same_world:
        rank_state = {k: v for k, v in rank_state.items() if k not in ("rng", "data")}
        if ctx.is_main:
            print(f"zplan: {path} was written by {train_state['world_size']} processes "
                  f"{train_state.get('layout', {})}, this run has {ctx.world_size} {layout or {}}: model and "
                  "optimizer resharded; RNG and data-iterator state not restored", flush=True)
    return LoadedCheckpoint(path=path, step=int(train_state["step"]), train_state=train_state,
                            rank_state=rank_state, unverified_origin=unverified_origin)
