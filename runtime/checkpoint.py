"""Checkpoints that survive a kill and load under another plan (torch.distributed.checkpoint, DCP).

A checkpoint folder (--checkpoint-dir) holds:

    step-000120/                a complete checkpoint; the newest `keep` of them are kept
        .metadata, *.distcp     DCP: the model's and the optimizer's state, keyed by parameter name
        rank-00000.pt, ...      each rank's own state: RNG, data-iterator state, loss scaler
        train_state.json        optimizer steps done, world size, wrappers of the run that wrote it, the stored
                                order of fused projections (runtime.fused_layout; `zplan export` undoes it), the
                                loss of the last step, and `unverified_origin` when the run resumed from an
                                unverified checkpoint (or from one that had it)
        MANIFEST.json           size and XXH3-64 hash of every file above (runtime/checkpoint_manifest.py), checked
                                before a resume or an export reads them
        COMPLETE                written last: a step-* folder without it is not a checkpoint
    .step-000140.tmp/           being written, or left by a crash: never read, removed by the next save

Writing: every rank writes its shards into `.step-N.tmp` (DCP writes `.metadata` once all shards are
on disk), then its rank file, rank 0 train_state.json; every rank hashes its share of the files (when one
could not write, e.g. on a full disk, the partial folder is removed and every rank raises the same error);
rank 0 writes MANIFEST.json and COMPLETE, fsyncs, and
renames the folder to `step-N` (atomic on a POSIX file system, which every rank must share), then tells every rank
how it went (a full disk there too removes the folder and raises the same error everywhere). A kill at any moment
leaves either the previous checkpoints untouched plus a `.tmp` folder, or the new checkpoint complete. `keep` prunes
the oldest, but never the newest verified checkpoint: one whose files match its manifest and whose run did not start
from an unverified checkpoint (a run resumed with --allow-unverified writes checkpoints of unknown worth).

Reading treats the checkpoint as hostile data (runtime/checkpoint_manifest.py for the manifest): a checkpoint
without MANIFEST.json is read only with allow_unverified (--allow-unverified), never chosen by `latest-valid`; every
file read on behalf of DCP's .metadata (its `relative_path` of each stored item) must be a plain file name of the
checkpoint folder and a regular file, as must the rank files and train_state.json (read up to MAX_TRAIN_STATE_BYTES);
links, FIFOs and devices are refused by kind, nothing outside the folder is opened. A resume checks that the
checkpoint holds exactly the model's tensors (the missing and unexpected names listed) and that train_state.json is
plausible (finite numbers, the step of its folder).

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
import math
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
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from zplan.errors import CheckpointError, short_repr
from zplan.runtime.checkpoint_manifest import (
    MANIFEST_FILE,
    ManifestError,
    check_manifest,
    file_entry,
    file_problems,
    files_to_hash,
    no_manifest_problem,
    plain_file,
    read_manifest,
    read_small_file,
    share,
    verify,
    write_manifest,
)
from zplan.runtime.distributed import RunContext
from zplan.runtime.zero1 import with_master_weights
from zplan.safe_files import UnsafeFileError, disk_is_full, full_disk_message, open_regular

COMPLETE_MARKER = "COMPLETE"
LATEST_VALID = "latest-valid"
TRAIN_STATE_FILE = "train_state.json"
FORMAT_VERSION = 1
# train_state.json holds a dozen numbers and the fused layout of each fused projection (~100 bytes each: 40,000 of
# them fit), so 4 MiB is far more than a real one needs and little enough to read: a link to /dev/zero or a huge file
# put there is refused after 4 MiB.
MAX_TRAIN_STATE_BYTES = 4 << 20
ALLOW_UNVERIFIED_FLAG = "--allow-unverified"  # train.py's and `zplan export`'s
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^\.step-(\d+)\.tmp$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # per-parameter keys: reshardable
_PARAM_GROUPS_PREFIX = "param_groups."
_MODEL_PREFIX = "model."  # the model's entries in DCP's metadata
_DATA_SUFFIX = ".distcp"  # DCP's data files (torch.distributed.checkpoint.filesystem.DEFAULT_SUFFIX)
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
    # load a checkpoint without a manifest (its files cannot be checked); latest-valid never takes one
    allow_unverified: bool = False

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
    # None: verified against its manifest, and of a verified run; else why not ("step-000004 has no MANIFEST.json"):
    # the checkpoints of a run resumed from it carry this in their train_state.json (unverified_origin)
    unverified_origin: str | None = None


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
    """The newest complete checkpoint in `directory` whose files match its manifest (one without a manifest is
    never taken: it cannot be checked), and why each newer one was passed over. In this process."""
    skipped = []
    for _, path in reversed(complete_checkpoints(directory)):
        problems = verify(path)
        if not problems:
            return path, skipped
        skipped.append(f"{path.name}: {problems[0]}" + (f" ({len(problems) - 1} more)" if len(problems) > 1 else ""))
    return None, skipped


def newest_verified_checkpoint(directory: str | Path, just_written: Path | None = None) -> Path | None:
    """The newest complete checkpoint in `directory` that is verified: its files match its manifest and its run did
    not resume from an unverified checkpoint (train_state.json's unverified_origin). `just_written`, when given and
    clean of that, counts as verified without hashing (this process wrote and hashed it). In this process."""
    for _, path in reversed(complete_checkpoints(directory)):
        try:
            if read_train_state(path).get("unverified_origin"):
                continue
        except CheckpointError:
            continue
        if path == just_written or not verify(path):
            return path
    return None


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
    loss: float | None = None,
    unverified_origin: str | None = None,
) -> Path:
    """Write checkpoint `step` into `directory` (all ranks call it: DCP and the barriers are
    collective) and keep the newest `keep`, and the newest verified one; return the complete checkpoint's folder.

    layout: how this run splits the work (e.g. {"data_parallel_size": 2}); rank files are restored only
    by a run of the same world size and layout. rank_state: this rank's extra state (e.g. the loss
    scaler), saved beside its RNG state; data_state: the data iterator's state_dict() when it has one.
    loss: the last step's loss (recorded when finite). unverified_origin: why the run's state is not verified (it
    resumed from an unverified checkpoint), recorded so that retention does not take this checkpoint for a verified
    one. A write that fails (a full disk) removes the partial folder and raises the same CheckpointError on every
    rank; the previous checkpoints are untouched.
    """
    directory = Path(directory)
    final = directory / step_dir_name(step)
    tmp = directory / f".{final.name}.tmp"
    if ctx.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.iterdir():  # crashed writes, ours included when re-saving a step
            if _TMP_DIR.match(stale.name):
                _remove(stale)
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
                "loss": loss if loss is not None and math.isfinite(loss) else None,
                "unverified_origin": unverified_origin,
            }
            _write_text(tmp / TRAIN_STATE_FILE, json.dumps(train_state, indent=2, allow_nan=False) + "\n")
    # CheckpointException: DCP's, raised on every rank; RuntimeError: torch.save's on a full disk
    except (OSError, RuntimeError, CheckpointException) as error:
        failure = _failure(error, directory)
    # also the barrier
    _stop_if_any_rank_failed(failure, directory, tmp, step, model_state, optimizer_state, ctx)
    entries = _hash_files(tmp, ctx)  # every rank hashes its share of the files

    failure = None
    if ctx.is_main:
        try:
            _finish(directory, tmp, final, step, entries)
        except OSError as error:  # a full disk at the manifest or the marker: the partial folder goes
            failure = _failure(error, directory)
    outcome: list[tuple[str, bool] | None] = [failure]
    dist.broadcast_object_list(outcome, src=0)  # every rank learns how the rename went (and waits for it)
    _stop_if_any_rank_failed(outcome[0], directory, tmp, step, model_state, optimizer_state, ctx, collected=True)
    if ctx.is_main:
        _prune(directory, keep, just_written=final)
    dist.barrier()
    return final


def _failure(error: BaseException, directory: Path) -> tuple[str, bool]:
    """(message, whether the disk is full) of a write into `directory` that failed (DCP's CheckpointException carries
    each rank's error as text)."""
    text = describe_dcp_error(error) if isinstance(error, CheckpointException) else str(error)
    if not isinstance(error, CheckpointException):
        text = f"{type(error).__name__}: {text}"
    full = disk_is_full(error, directory) or "No space left" in text or "Disk quota exceeded" in text
    return text, full


def _write_text(path: Path, text: str) -> None:
    """Write and fsync a small file of the checkpoint being written."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _finish(directory: Path, tmp: Path, final: Path, step: int, entries: dict[str, dict]) -> None:
    """Rank 0: MANIFEST.json, COMPLETE, and the rename of `tmp` to `final`. OSError when a write fails, with `tmp`
    and the previous checkpoints as they were (the caller removes `tmp`)."""
    _fsync_file(write_manifest(tmp, entries))
    _write_text(tmp / COMPLETE_MARKER, f"step {step}\n")
    _fsync_dir(tmp)
    pause_if_requested("before-rename", step)
    if final.exists():  # re-saving a step (a run resumed from an older checkpoint): replace it
        replaced = directory / f".{final.name}.replaced"
        _remove(replaced)
        final.rename(replaced)
        try:
            tmp.rename(final)
        except OSError:
            replaced.rename(final)  # the old one back
            raise
        _remove(replaced)
    else:
        tmp.rename(final)
    _fsync_dir(directory)


def _remove(path: Path) -> None:
    """Remove a folder zplan wrote in the checkpoint folder; a link in its place is removed itself, never followed."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _stop_if_any_rank_failed(failure: tuple[str, bool] | None, directory: Path, tmp: Path, step: int,
                             model_state: dict, optimizer_state: dict, ctx: RunContext, *,
                             collected: bool = False) -> None:
    """Collective: when a rank could not write its part, remove the partial folder and raise the same
    CheckpointError on every rank (on a full disk: how much the checkpoint needs and how much is free). The
    previous checkpoints are untouched. collected: `failure` is already every rank's (rank 0's, broadcast)."""
    if collected:
        failures = [(0, failure)] if failure else []
    else:
        reports: list[tuple[str, bool] | None] = [None] * ctx.world_size
        dist.all_gather_object(reports, failure)
        failures = [(rank, report) for rank, report in enumerate(reports) if report]
    if not failures:
        return
    if ctx.is_main:
        _remove(tmp)
    rank, (message, _) = failures[0]
    text = f"cannot write checkpoint {step_dir_name(step)} into {directory} (rank {rank}: {message})"
    if any(full for _, (_, full) in failures):
        # collective: once it returns, rank 0 has removed the partial folder, so the free space measured is what is left
        needed = _checkpoint_bytes(model_state, optimizer_state, directory, ctx)
        text += (f": {full_disk_message(directory / step_dir_name(step), needed)}; the previous checkpoints are kept "
                 "and the partial one removed. Free space, or give --checkpoint-dir on a larger disk")
    raise CheckpointError(text)


def _checkpoint_bytes(model_state: dict, optimizer_state: dict, directory: Path, ctx: RunContext) -> int:
    """Collective: about what a checkpoint of these states takes on disk: every tensor once at its full size (DCP
    writes a replicated tensor once, each shard of a sharded one once), or the previous checkpoint's size (its
    manifest, which counts the rank files and the metadata too) when that is more."""
    mine = {f"{prefix}.{key}": _full_bytes(value) for prefix, state in (("model", model_state),
                                                                       ("optimizer", optimizer_state))
            for key, value in state.items() if isinstance(value, torch.Tensor)}
    gathered: list[dict[str, int]] = [{} for _ in range(ctx.world_size)]
    dist.all_gather_object(gathered, mine)
    tensors = sum({key: size for part in gathered for key, size in part.items()}.values())
    previous = complete_checkpoints(directory)
    try:
        files = read_manifest(previous[-1][1]) if previous else None
    except ManifestError:
        files = None
    return max(tensors, sum(entry["bytes"] for entry in (files or {}).values()))


def _full_bytes(tensor: torch.Tensor) -> int:
    """The bytes of the whole tensor (a DTensor's over all its shards)."""
    return tensor.numel() * tensor.element_size()


def _hash_files(folder: Path, ctx: RunContext) -> dict[str, dict]:
    """{file name: size and hash} of every file of the checkpoint being written, each rank hashing its share;
    complete on rank 0 (collective)."""
    names: list[list[str] | None] = [files_to_hash(folder) if ctx.is_main else None]
    dist.broadcast_object_list(names, src=0)
    mine = {name: file_entry(folder / name) for name in share(names[0], ctx.rank, ctx.world_size)}
    gathered: list[dict] = [{} for _ in range(ctx.world_size)]
    dist.all_gather_object(gathered, mine)
    return {name: entry for part in gathered for name, entry in part.items()}


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
    """Delete all but the newest `keep` complete checkpoints, never the one just written nor the newest verified one
    (newest_verified_checkpoint: when this run resumed from an unverified checkpoint, the last one it can trust).
    A step-N that is a link is left alone (what it points to is not this folder's to delete)."""
    found = complete_checkpoints(directory)
    old = [path for _, path in found[: max(0, len(found) - keep)] if path != just_written and not path.is_symlink()]
    if not old:
        return
    kept = newest_verified_checkpoint(directory, just_written)
    for path in old:
        if path != kept:
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


class _RegularFiles(FileSystem):
    """DCP's file system for reading: what it opens must be a regular file, not a link (a FIFO, a device or a link is
    refused by kind, opened without blocking)."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        if mode != "rb":
            raise CheckpointError(f"zplan reads checkpoints only; DCP asked to open {path} with mode {mode!r}")
        path = plain_file(Path(path).parent, Path(path).name, "the checkpoint")  # by kind, with its message
        with os.fdopen(open_regular(path, follow=False), "rb") as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with its .metadata unpickled from DCP's own classes only (_METADATA_MODULES) and checked
    before anything it names is read: every item's file (`relative_path`) a DCP data file of the checkpoint folder
    (a plain *.distcp name, a regular file, the item within its size), no stream transforms, only the global
    .metadata (zplan never writes the per-rank ones DCP would fall back to)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _RegularFiles()

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import Metadata

        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path} has no per-rank metadata: zplan's checkpoints hold one .metadata")
        path = self._get_metadata_path()
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except UnsafeFileError as error:
            raise CheckpointError(f"{error} (checkpoint metadata): not loaded") from error
        except OSError as error:
            raise CheckpointError(f"cannot read {path} ({type(error).__name__}: {error}): the checkpoint is damaged; "
                                  f"resume from an older one (--resume {LATEST_VALID})") from error
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError, KeyError,
                RecursionError) as error:
            raise CheckpointError(f"{path} is not checkpoint metadata written by torch.distributed.checkpoint "
                                  f"({type(error).__name__}: {error}): not loaded") from error
        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            raise CheckpointError(f"{path} is not checkpoint metadata written by torch.distributed.checkpoint "
                                  f"(a {type(metadata).__name__}): not loaded")
        self._check_storage(path, metadata.storage_data)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_storage(self, path: os.PathLike, storage_data: Any) -> None:
        """CheckpointError unless every stored item lies in a DCP data file of the checkpoint folder."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        def refuse(why: str) -> CheckpointError:
            return CheckpointError(f"{path} {why}: refused, nothing read (the metadata is damaged or was crafted)")

        if not isinstance(storage_data, dict):
            raise refuse("has no storage table")
        extent: dict[str, int] = {}  # file name -> the end of its last item
        for info in storage_data.values():
            if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) \
                    or type(info.offset) is not int or type(info.length) is not int or info.offset < 0 \
                    or info.length < 0:
                raise refuse(f"stores an item as {short_repr(info)}, not as a file name, offset and length")
            if info.transform_descriptors:
                raise refuse(f"asks for stream transforms {short_repr(info.transform_descriptors)}, which zplan's "
                             "checkpoints never use")
            extent[info.relative_path] = max(extent.get(info.relative_path, 0), info.offset + info.length)
        folder = Path(self.path)
        for name, end in sorted(extent.items()):
            if not name.endswith(_DATA_SUFFIX):
                raise refuse(f"points tensors at {name!r}, not a DCP data file (*{_DATA_SUFFIX}) of {folder}")
            try:
                size = plain_file(folder, name, str(path)).stat().st_size
            except UnsafeFileError as error:
                raise CheckpointError(f"{error}: not loaded") from error
            except FileNotFoundError as error:
                raise CheckpointError(f"{folder / name}, named by {path}, is missing: the checkpoint is damaged; "
                                      f"resume from an older one (--resume {LATEST_VALID})") from error
            if end > size:
                raise CheckpointError(f"{path} stores data up to byte {end:,} of {folder / name}, which has {size:,}: "
                                      f"the checkpoint is damaged or was cut short (--resume {LATEST_VALID})")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading the entries that are not tensors as plain values (weights_only)."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_rank_state(rank_file: Path) -> dict[str, Any]:
    """A rank's RNG, loss-scaler and data-iterator state: tensors and plain values only (weights_only), from a regular
    file of the checkpoint folder."""
    try:
        with os.fdopen(open_regular(plain_file(rank_file.parent, rank_file.name, "the checkpoint"), follow=False),
                       "rb") as stream:
            return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"{rank_file} holds more than tensors and plain values, which zplan's checkpoints "
                              f"never do: not loaded ({str(error).splitlines()[0]})") from error
    except (OSError, RuntimeError, EOFError, UnsafeFileError) as error:  # missing, cut short, not a torch.save file
        raise CheckpointError(f"cannot read {rank_file} ({type(error).__name__}: {str(error)[:200]}): the "
                              f"checkpoint is damaged; resume from an older one (--resume {LATEST_VALID})") from error


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _no_constant(constant: str):
    raise ValueError(f"it holds {constant}")


def train_state_problem(state: Any, path: Path) -> str | None:
    """What makes the train_state.json `state` of checkpoint `path` implausible, or None: a step that is not a
    whole number >= 0 or not the step of its folder, a world size below 1, fields of the wrong type."""
    if not isinstance(state, dict):
        return "not a JSON object"
    step, world_size = state.get("step"), state.get("world_size")
    if type(step) is not int or step < 0 or type(world_size) is not int or world_size < 1:
        return f"no integer 'step' >= 0 and 'world_size' >= 1 (step {short_repr(step)}, world_size " \
               f"{short_repr(world_size)})"
    folder_step = _STEP_DIR.match(path.name)
    if folder_step and int(folder_step.group(1)) != step:
        return f"step {step} in the folder of step {int(folder_step.group(1))}"
    for name, kind in (("layout", dict), ("fused_layouts", dict), ("unverified_origin", str), ("loss", float)):
        value = state.get(name)
        if value is not None and not isinstance(value, kind) and not (kind is float and type(value) is int):
            return f"'{name}' is {short_repr(value)}, not a {kind.__name__}"
    if any(not isinstance(entry, dict) for entry in state.get("fused_layouts", {}).values()):
        return "'fused_layouts' holds entries that are not objects"
    return None


def read_train_state(path: Path) -> dict[str, Any]:
    """A checkpoint's train_state.json (a regular file of its folder, at most MAX_TRAIN_STATE_BYTES), checked for
    what a resume reads: finite numbers only (no NaN or Infinity), a plausible step and world size
    (train_state_problem)."""
    file = path / TRAIN_STATE_FILE
    try:
        state = json.loads(read_small_file(path, TRAIN_STATE_FILE, MAX_TRAIN_STATE_BYTES, "the train state"),
                           parse_float=_finite_float, parse_constant=_no_constant)
        problem = train_state_problem(state, path)
        if problem:
            raise ValueError(problem)
    except (OSError, ValueError, UnsafeFileError, RecursionError) as error:
        raise CheckpointError(f"cannot read {file} ({error}): the checkpoint is damaged; resume from an older one "
                              f"(--resume {LATEST_VALID})") from error
    return state


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
