"""Checkpoints that survive a kill and load under another plan (torch.distributed.checkpoint, DCP).

A checkpoint folder (--checkpoint-dir) holds:

    step-000120/                a complete checkpoint; the newest `keep` of them are kept
        .metadata, *.distcp     DCP: the model's and the optimizer's state, keyed by parameter name
        rank-00000.pt, ...      each rank's own state: RNG, data-iterator state, loss scaler
        train_state.json        optimizer steps done, world size, wrappers of the run that wrote it, the stored
                                order of fused projections (runtime.fused_layout; `zplan export` undoes it)
        MANIFEST.json           size and XXH3-64 hash of every file above (runtime/checkpoint_manifest.py), checked
                                before a resume or an export reads them
        COMPLETE                written last: a step-* folder without it is not a checkpoint
    .step-000140.tmp/           being written, or left by a crash: never read, removed by the next save

Writing: every rank writes its shards into `.step-N.tmp` (DCP writes `.metadata` once all shards are
on disk), then its rank file, rank 0 train_state.json; every rank hashes its share of the files (when one
could not write, e.g. on a full disk, the partial folder is removed and every rank raises the same error);
rank 0 writes MANIFEST.json and COMPLETE, fsyncs, and
renames the folder to `step-N` (atomic on a POSIX file system, which every rank must share); a
barrier. A kill at any moment leaves either the previous checkpoints untouched plus a `.tmp` folder,
or the new checkpoint complete.

Resharding: tensors are saved as what get_state_dict returns with the default options, i.e. each
rank's DTensor shards under FSDP2 (ZeRO 2/3) and replicated plain tensors under DDP (ZeRO 0/1; DCP
writes each once), named by parameter FQN without wrapper prefixes; the optimizer's state is flattened
to one entry per parameter (`optimizer.state.<fqn>.exp_avg`). ZeRO-1's optimizer (runtime.zero1) holds
each moment as a DTensor of the parameter's shape, Shard(0) over dp, the layout FSDP2 gives it too
(with tensor parallel: on the (dp, tp) mesh, laid out as FSDP2 lays out a tensor-parallel parameter).
Loading asks DCP for the tensors in the layout of the run that loads, whatever layout wrote them, so a
checkpoint of ZeRO-3 or ZeRO-1 on 2 ranks loads under ZeRO-0, another ZeRO stage or on 1 rank.

Hyper-parameters (the optimizer's param_groups: lr, betas, weight decay, ...) are saved for reference
but not loaded: they come from the script that resumes, as the LR schedule does (a function of the step).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from zplan.errors import CheckpointError
from zplan.runtime.checkpoint_manifest import (
    MANIFEST_FILE,
    file_entry,
    file_problems,
    files_to_hash,
    read_manifest,
    share,
    verify,
    write_manifest,
)
from zplan.runtime.distributed import RunContext
from zplan.runtime.zero1 import with_master_weights

COMPLETE_MARKER = "COMPLETE"
LATEST_VALID = "latest-valid"
TRAIN_STATE_FILE = "train_state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^\.step-(\d+)\.tmp$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # per-parameter keys: reshardable
_PARAM_GROUPS_PREFIX = "param_groups."
# Test-only hook: ZPLAN_TEST_PAUSE="<point>:<step>" makes every rank sleep at that point so that a test
# can SIGKILL the run there. Points: "after-step" (train loop, step logged) and "before-rename"
# (checkpoint written and marked complete, not yet renamed).
TEST_PAUSE_ENV = "ZPLAN_TEST_PAUSE"


@dataclass(frozen=True)
class CheckpointConfig:
    """What the training loop saves and where it resumes from."""

    directory: Path | None = None  # where step-N folders go; None: save nothing
    every: int = 0  # save after every `every` optimizer steps (0: only after the last step)
    keep: int = 3  # complete checkpoints kept in `directory`, newest first
    # None: start fresh; "latest": newest in `directory`; "latest-valid": newest whose files match its manifest;
    # or a path
    resume: str | Path | None = None

    def __post_init__(self):
        if self.every < 0:
            raise CheckpointError(f"--checkpoint-every must be >= 0, got {self.every}")
        if self.keep < 1:
            raise CheckpointError(f"--keep must be >= 1 (checkpoints kept), got {self.keep}")
        if self.resume in ("latest", LATEST_VALID) and self.directory is None:
            raise CheckpointError(f"--resume {'' if self.resume == 'latest' else LATEST_VALID + ' '}without a path "
                                  "needs --checkpoint-dir: give either")

    def should_save(self, steps_done: int, total_steps: int) -> bool:
        if self.directory is None:
            return False
        return steps_done == total_steps or (self.every > 0 and steps_done % self.every == 0)


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    step: int  # optimizer steps done when it was saved
    train_state: dict[str, Any]  # train_state.json
    # This rank's rank file; when another world size or layout wrote the checkpoint, rank 0's file without its
    # RNG and data-iterator state (which belong to a rank of the other layout).
    rank_state: dict[str, Any]


# ---- finding checkpoints -------------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def is_complete(path: Path) -> bool:
    return _STEP_DIR.match(path.name) is not None and (path / COMPLETE_MARKER).is_file()


def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in `directory`, oldest first; [] when there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_valid_checkpoint(directory: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint in `directory` whose files match its manifest (one without a manifest
    counts as valid: it cannot be checked), and why each newer one was passed over. In this process."""
    skipped = []
    for _, path in reversed(complete_checkpoints(directory)):
        problems = verify(path) if read_manifest(path) is not None else []
        if not problems:
            return path, skipped
        skipped.append(f"{path.name}: {problems[0]}")
    return None, skipped


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in `directory` (incomplete and .tmp folders are ignored)."""
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """`path` itself when it is a complete checkpoint, else the newest complete one inside it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; give a checkpoint folder (step-N) or the folder holding them")
    if _STEP_DIR.match(path.name) or _TMP_DIR.match(path.name):
        if is_complete(path):
            return path
        raise CheckpointError(
            f"{path} is an incomplete checkpoint (no {COMPLETE_MARKER} marker, or never renamed from .tmp): "
            f"its run was killed while writing it; use an older step-N folder beside it"
        )
    newest = latest_checkpoint(path)
    if newest is None:
        raise CheckpointError(
            f"no complete checkpoint in {path}: expected step-N folders with a {COMPLETE_MARKER} marker "
            "(train.py --checkpoint-dir writes them)"
        )
    return newest


# ---- state dicts ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _gradients_set_aside(optimizer: torch.optim.Optimizer):
    """DCP's state-dict calls give an optimizer without states its states by a step on zero gradients, but only where
    no parameter has a gradient; DDP's always exist (runtime.apply: views of its buckets), so they step aside."""
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


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_dcp_error(error: BaseException) -> str:
    """One line per distinct cause of a DCP failure (its CheckpointException carries every rank's
    exception with a traceback, too long for a message that says what to do)."""
    if not isinstance(error, CheckpointException):
        return f"{type(error).__name__}: {error}"
    causes: dict[str, list[int]] = {}
    for rank, (exception, _) in sorted(error.failures.items()):
        causes.setdefault(f"{type(exception).__name__}: {exception}", []).append(rank)
    return "; ".join(f"{cause} (rank {', '.join(map(str, ranks))})" for cause, ranks in causes.items())


def pause_if_requested(point: str, step: int) -> None:
    """Test-only: sleep forever at `point` of step `step` when ZPLAN_TEST_PAUSE says so."""
    if os.environ.get(TEST_PAUSE_ENV) == f"{point}:{step}":
        print(f"zplan test hook: paused at {point}:{step}", flush=True)
        while True:
            time.sleep(60)


# ---- saving --------------------------------------------------------------------------------------


def save_checkpoint(
    directory: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: RunContext,
    *,
    keep: int,
    layout: dict[str, Any] | None = None,
    rank_state: dict[str, Any] | None = None,
    data_state: Any = None,
) -> Path:
    """Write checkpoint `step` into `directory` (all ranks call it: DCP and the barriers are
    collective) and keep the newest `keep`; return the complete checkpoint's folder.

    layout: how this run splits the work (e.g. {"data_parallel_size": 2}); rank files are restored only
    by a run of the same world size and layout. rank_state: this rank's extra state (e.g. the loss
    scaler), saved beside its RNG state; data_state: the data iterator's state_dict() when it has one.
    """
    directory = Path(directory)
    final = directory / step_dir_name(step)
    tmp = directory / f".{final.name}.tmp"
    if ctx.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.iterdir():  # crashed writes, ours included when re-saving a step
            if _TMP_DIR.match(stale.name):
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()

    model_state, optimizer_state, _ = _state_dicts(model, optimizer)
    fused_layouts = model_fused_layouts(model)  # collective: a pipeline rank knows its own stages' only
    failure = None
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
        rank_file = tmp / f"rank-{ctx.rank:05d}.pt"
        torch.save({"rng": _rng_state(ctx.device), "data": data_state, **(rank_state or {})}, rank_file)
        _fsync_file(rank_file)
        if ctx.is_main:
            train_state = {
                "format": FORMAT_VERSION,
                "step": step,
                "world_size": ctx.world_size,
                "layout": layout or {},
                "model_wrapper": type(model).__name__,
                "optimizer": type(optimizer).__name__,
                "torch": torch.__version__,
                "fused_layouts": fused_layouts,
            }
            (tmp / TRAIN_STATE_FILE).write_text(json.dumps(train_state, indent=2) + "\n")
            _fsync_file(tmp / TRAIN_STATE_FILE)
    except (OSError, CheckpointException) as error:  # CheckpointException: DCP's, raised on every rank
        failure = describe_dcp_error(error) if isinstance(error, CheckpointException) else str(error)
    _stop_if_any_rank_failed(failure, directory, tmp, step, model_state, optimizer_state, ctx)  # also the barrier
    entries = _hash_files(tmp, ctx)  # every rank hashes its share of the files

    if ctx.is_main:
        _fsync_file(write_manifest(tmp, entries))
        (tmp / COMPLETE_MARKER).write_text(f"step {step}\n")
        _fsync_file(tmp / COMPLETE_MARKER)
        _fsync_dir(tmp)
        pause_if_requested("before-rename", step)
        if final.exists():  # re-saving a step (a run resumed from an older checkpoint): replace it
            replaced = directory / f".{final.name}.replaced"
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
            tmp.rename(final)
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(directory)
        _prune(directory, keep, just_written=final)
    dist.barrier()
    return final


def _stop_if_any_rank_failed(failure: str | None, directory: Path, tmp: Path, step: int, model_state: dict,
                             optimizer_state: dict, ctx: RunContext) -> None:
    """Collective: when a rank could not write its part, remove the partial folder and raise the same
    CheckpointError on every rank (on a full disk: how much the checkpoint needs and how much is free). The
    previous checkpoints are untouched."""
    local_bytes = sum(_local_tensor(t).nbytes for state in (model_state, optimizer_state) for t in state.values()
                      if isinstance(t, torch.Tensor))
    reports: list[tuple[str | None, int]] = [(None, 0)] * ctx.world_size
    dist.all_gather_object(reports, (failure, local_bytes))
    failures = [(rank, message) for rank, (message, _) in enumerate(reports) if message]
    if not failures:
        return
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    rank, message = failures[0]
    text = f"cannot write checkpoint {step_dir_name(step)} into {directory} (rank {rank}: {message})"
    if any("No space left" in m for _, m in failures):
        previous = complete_checkpoints(directory)
        needed = (sum(e.get("bytes", 0) for e in (read_manifest(previous[-1][1]) or {}).values()) if previous
                  else sum(b for _, b in reports))
        text += (f": the disk is full. The checkpoint needs about {needed / 2**30:.2f} GiB, "
                 f"{shutil.disk_usage(directory).free / 2**30:.2f} GiB are free; the previous checkpoints are kept "
                 "and the partial one removed. Free space, or give --checkpoint-dir on a larger disk")
    raise CheckpointError(text)


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _hash_files(folder: Path, ctx: RunContext) -> dict[str, dict]:
    """{file name: size and hash} of every file of the checkpoint being written, each rank hashing its share;
    complete on rank 0 (collective)."""
    names: list[list[str] | None] = [files_to_hash(folder) if ctx.is_main else None]
    dist.broadcast_object_list(names, src=0)
    mine = {name: file_entry(folder / name) for name in share(names[0], ctx.rank, ctx.world_size)}
    gathered: list[dict] = [{} for _ in range(ctx.world_size)]
    dist.all_gather_object(gathered, mine)
    return {name: entry for part in gathered for name, entry in part.items()}


def verify_checkpoint(path: Path, ctx: RunContext) -> None:
    """Collective: each rank checks its share of the files against the manifest; every rank raises the same
    CheckpointError, naming the first damaged file, when one is. A checkpoint without a manifest: a warning."""
    files = read_manifest(path)
    if files is None:
        if ctx.is_main:
            print(f"zplan: warning: {path} has no {MANIFEST_FILE} (written before checkpoints carried checksums): "
                  "loaded without verifying it", flush=True)
        return
    mine = file_problems(path, files, share(sorted(files), ctx.rank, ctx.world_size))
    gathered: list[list[str]] = [[] for _ in range(ctx.world_size)]
    dist.all_gather_object(gathered, mine)
    problems = [problem for part in gathered for problem in part]
    if problems:
        more = f" ({len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {path} is damaged: {problems[0]}{more}. Resume from an older complete "
                              "checkpoint with --resume latest-valid, or give its step-N folder")


def model_fused_layouts(model: nn.Module) -> dict[str, dict]:
    """{parameter name: its fused layout as JSON} of the whole model, on every rank (collective)."""
    from zplan.runtime.fused_layout import layouts_as_json, stored_layouts
    from zplan.runtime.materialize import weight_roots

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
            f"{ours.get(name) or 'one projection in the model file order'} (runtime/fused_layout.py): the checkpoint "
            f"is of another model or of a zplan that stored fused projections differently"
            + (f" ({len(differ) - 1} more tensors)" if len(differ) > 1 else ""))


def _prune(directory: Path, keep: int, just_written: Path) -> None:
    """Delete all but the newest `keep` complete checkpoints (never the one just written)."""
    found = complete_checkpoints(directory)
    for _, path in found[: max(0, len(found) - keep)]:
        if path != just_written:
            shutil.rmtree(path, ignore_errors=True)


# ---- loading -------------------------------------------------------------------------------------


def _tied_key(key: str, tied_names: dict[str, str]) -> str:
    """'state.lm_head.weight.exp_avg' -> 'state.wte.weight.exp_avg' for tied_names {'lm_head.weight': 'wte.weight'}."""
    for name, first_name in tied_names.items():
        if key.startswith(f"state.{name}."):
            return f"state.{first_name}." + key[len(f"state.{name}."):]
    return key


# ---- reading a checkpoint as data: nothing in it runs ---------------------------------------------------

# What DCP's .metadata pickle is made of (torch 2.13): its own metadata classes, torch.Size, dtypes and layouts,
# the checkpoint's path. A pickle naming anything else was not written by DCP and is refused unread.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                   ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES or (module, name) in _METADATA_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with its .metadata unpickled from DCP's own classes only (_METADATA_MODULES)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as error:
                raise CheckpointError(f"{path} is not checkpoint metadata written by torch.distributed.checkpoint "
                                      f"({type(error).__name__}: {error}): not loaded") from error
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading the entries that are not tensors as plain values (weights_only)."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_rank_state(rank_file: Path) -> dict[str, Any]:
    """A rank's RNG, loss-scaler and data-iterator state: tensors and plain values only (weights_only)."""
    try:
        return torch.load(rank_file, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"{rank_file} holds more than tensors and plain values, which zplan's checkpoints "
                              f"never do: not loaded ({str(error).splitlines()[0]})") from error
    except (OSError, RuntimeError, EOFError) as error:  # missing, cut short, not a torch.save file
        raise CheckpointError(f"cannot read {rank_file} ({type(error).__name__}: {str(error)[:200]}): the "
                              "checkpoint is damaged; resume from an older one (--resume latest-valid)") from error


def read_train_state(path: Path) -> dict[str, Any]:
    """A checkpoint's train_state.json, checked for what a resume reads."""
    file = path / TRAIN_STATE_FILE
    try:
        state = json.loads(file.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int) \
                or not isinstance(state.get("world_size"), int):
            raise ValueError("no integer 'step' and 'world_size'")
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {file} ({error}): the checkpoint is damaged; resume from an older one "
                              "(--resume latest-valid)") from error
    return state


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: RunContext,
    *, layout: dict[str, Any] | None = None, verify: bool = True,
) -> LoadedCheckpoint:
    """Load checkpoint `path` (a step-N folder, or a folder of them: the newest complete one) into the
    model and optimizer as this run lays them out. All ranks call it (DCP's load is collective).
    The RNG state comes back in `rank_state["rng"]` (same world size and layout only): restore it with
    restore_rng_state once the data iterator has been fast-forwarded, which may draw random numbers.
    verify: check every file against the checkpoint's manifest first (verify_checkpoint); False when the caller
    just did (--resume latest-valid)."""
    path = resolve_checkpoint(path)
    if verify:
        verify_checkpoint(path, ctx)
    train_state = read_train_state(path)
    _check_fused_layouts(path, train_state.get("fused_layouts", {}), model_fused_layouts(model))
    model_state, optimizer_state, replaced = _state_dicts(model, optimizer)
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
                            rank_state=rank_state)
