"""Finding checkpoints in a checkpoint folder (--checkpoint-dir): the complete ones, the newest, the newest whose
files match its manifest, and the checkpoint a path names. What a folder holds: runtime/checkpoint/save.py."""

from __future__ import annotations

import re
from pathlib import Path

from zplan.errors import CheckpointError
from zplan.runtime.checkpoint.manifest import verify

COMPLETE_MARKER = "COMPLETE"
LATEST, LATEST_VALID = "latest", "latest-valid"  # --resume's words: the newest, the newest verified
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^\.step-(\d+)\.tmp$")


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
