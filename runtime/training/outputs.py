"""The run's output files: checked before the first step, written atomically.

    check_output_paths(ctx, weights=..., log=..., checkpoint_dir=...)   # every rank, before training
    write_atomically(path, lambda tmp: torch.save(state, tmp))            # the old file stays until the new is whole

A run that trains for hours and then cannot write its weights has lost them: every output path is tried first
(its folder made, a file created and removed in it), and every rank learns whether all ranks could, so that
they stop together (one all-reduce; no rank waits in a collective for one that stopped). A file is written
under a temporary name in its own folder, flushed to disk (fsync) and renamed over the old one: a full disk
or a kill mid-write leaves the previous file as it was and no partial file behind.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from zplan.errors import OutputError
from zplan.runtime.launch.distributed import RunContext
from zplan.safe_files import KINDS, disk_is_full, full_disk_message

FOLDER_OPTIONS = {"tensorboard"}  # options that name a folder without ending in _dir


def _is_folder(name: str) -> bool:
    return name.endswith("_dir") or name in FOLDER_OPTIONS


def _problem(path: Path, kind: str) -> str | None:
    """Why `path` (a file, or a folder when kind is 'folder') cannot be written, or None."""
    folder = path if kind == "folder" else path.parent
    if kind != "folder" and path.is_dir():
        return f"{path} is a folder"
    if kind != "folder" and path.exists() and not path.is_file():  # a FIFO would block the write until read
        return f"{path} is a {KINDS.get(stat.S_IFMT(path.stat().st_mode), 'special file')}, not a regular file"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".zplan-write-check-"):
            pass
    except OSError as error:
        return f"{folder}: {error.strerror or error}"
    return None


def check_output_paths(ctx: RunContext, **paths: str | Path | None) -> None:
    """Raise OutputError on every rank when any rank cannot write one of `paths` (name -> path; a name ending in
    _dir, or in FOLDER_OPTIONS, is a folder; None: not asked for). Collective: every rank calls it, before the first
    step."""
    problems = [f"--{name.replace('_', '-')} {path}: {why}" for name, path in paths.items() if path is not None
                for why in [_problem(Path(path), "folder" if _is_folder(name) else "file")] if why]
    failed = torch.tensor([float(bool(problems))], device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(failed)
    if problems:
        raise OutputError("cannot write " + "; ".join(problems) + ": choose a writable path (nothing was trained)")
    if failed.item():
        raise OutputError("another rank cannot write one of its output paths (its error says which): nothing "
                          "was trained")


def write_atomically(path: str | Path, write: Callable[[Path], None], size_hint_bytes: int | None = None) -> Path:
    """`write(tmp)` to a temporary file beside `path`, fsync it and rename it to `path`. On failure the previous
    file is untouched, the temporary removed, and a full disk says how much was needed (`size_hint_bytes`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as stream:
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
        full = disk_is_full(error, path.parent)
        tmp.unlink(missing_ok=True)
        if full:
            raise OutputError(f"{full_disk_message(path, size_hint_bytes)}; the previous file, if any, is "
                              "unchanged") from error
        if isinstance(error, RuntimeError):
            raise
        raise OutputError(f"{path}: {error.strerror or error}; the previous file, if any, is unchanged") from error
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
