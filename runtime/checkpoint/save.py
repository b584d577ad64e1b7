"""Checkpoints that survive a kill and load under another plan (torch.distributed.checkpoint, DCP).

A checkpoint folder (--checkpoint-dir) holds:

    step-000120/                a complete checkpoint; the newest `keep` of them are kept
        .metadata, *.distcp     DCP: the model's and the optimizer's state, keyed by parameter name
        rank-00000.pt, ...      each rank's own state: RNG, data-iterator state, loss scaler
        train_state.json        optimizer steps done, world size, wrappers of the run that wrote it, the stored
                                order of fused projections (model.fused_layout; `zplan export` undoes it), the
                                loss of the last step, `unverified_origin` when the run resumed from an
                                unverified checkpoint (or from one that had it), and `data`: --data's position
                                (sequences consumed) and identity (runtime/data/position.py)
        MANIFEST.json           size and XXH3-64 hash of every file above (runtime/checkpoint/manifest.py), checked
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

The other parts: finding checkpoints (runtime/checkpoint/folders.py), the state they hold and how it reshards
(runtime/checkpoint/state.py), loading (runtime/checkpoint/load.py), reading as hostile data
(runtime/checkpoint/read.py), the manifest (runtime/checkpoint/manifest.py). This module writes checkpoints; what the
runtime, train.py and `zplan export` take from the others is importable from here too.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from zplan.errors import CheckpointError
from zplan.runtime.checkpoint.folders import (
    _TMP_DIR,
    COMPLETE_MARKER,
    LATEST,
    LATEST_VALID,
    complete_checkpoints,
    step_dir_name,
)
from zplan.runtime.checkpoint.folders import latest_checkpoint as latest_checkpoint
from zplan.runtime.checkpoint.folders import latest_valid_checkpoint as latest_valid_checkpoint
from zplan.runtime.checkpoint.folders import resolve_checkpoint as resolve_checkpoint
from zplan.runtime.checkpoint.load import ALLOW_UNVERIFIED_FLAG as ALLOW_UNVERIFIED_FLAG
from zplan.runtime.checkpoint.load import load_checkpoint as load_checkpoint
from zplan.runtime.checkpoint.manifest import (
    ManifestError,
    file_entry,
    files_to_hash,
    read_manifest,
    share,
    verify,
    write_manifest,
)
from zplan.runtime.checkpoint.read import TRAIN_STATE_FILE, read_train_state
from zplan.runtime.checkpoint.read import SafeFileSystemReader as SafeFileSystemReader
from zplan.runtime.checkpoint.read import SafeLoadPlanner as SafeLoadPlanner
from zplan.runtime.checkpoint.read import load_rank_state as load_rank_state
from zplan.runtime.checkpoint.state import _rng_state, _state_dicts, describe_dcp_error, model_fused_layouts
from zplan.runtime.checkpoint.state import restore_rng_state as restore_rng_state
from zplan.runtime.launch.distributed import RunContext
from zplan.safe_files import disk_is_full, full_disk_message

FORMAT_VERSION = 1
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
    model_ref: str | None = None  # what the plan was compiled from (recorded for `zplan export --hf`)

    def __post_init__(self):
        if self.every < 0:
            raise CheckpointError(f"--checkpoint-every must be >= 0, got {self.every}")
        if self.keep < 1:
            raise CheckpointError(f"--keep must be >= 1 (checkpoints kept), got {self.keep}")
        if self.resume in (LATEST, LATEST_VALID) and self.directory is None:
            raise CheckpointError(f"--resume {'' if self.resume == 'latest' else LATEST_VALID + ' '}without a path "
                                  "needs --checkpoint-dir: give either")

    def should_save(self, steps_done: int, total_steps: int) -> bool:
        if self.directory is None:
            return False
        return steps_done == total_steps or (self.every > 0 and steps_done % self.every == 0)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    model_ref: str | None = None,
    data_position: dict | None = None,
) -> Path:
    """Write checkpoint `step` into `directory` (all ranks call it: DCP and the barriers are
    collective) and keep the newest `keep`, and the newest verified one; return the complete checkpoint's folder.

    layout: how this run splits the work (e.g. {"data_parallel_size": 2}); rank files are restored only
    by a run of the same world size and layout. rank_state: this rank's extra state (e.g. the loss
    scaler), saved beside its RNG state; data_state: the data iterator's state_dict() when it has one.
    loss: the last step's loss (recorded when finite). unverified_origin: why the run's state is not verified (it
    resumed from an unverified checkpoint), recorded so that retention does not take this checkpoint for a verified
    one. model_ref: the run's model file or Hugging Face folder (a folder recorded as an absolute path: `zplan export
    --hf` takes its config.json and tokenizer). A write that fails (a full disk) removes the partial folder and raises
    the same CheckpointError on every rank; the previous checkpoints are untouched.
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
                "model_ref": str(Path(model_ref).resolve()) if model_ref and Path(model_ref).is_dir() else model_ref,
                "data": data_position,  # --data's position and identity (runtime/data/position.py), or None
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
