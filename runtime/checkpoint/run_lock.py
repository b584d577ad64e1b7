"""One run at a time in a checkpoint folder: an advisory lock held for the whole run.

    lock = lock_checkpoint_dir(directory, ctx)   # every rank, before the first step (and before a resume reads)
    ...
    lock.release()                               # or at exit: the kernel drops the lock with the process

Two runs writing step-N folders, train_state.json and the pruning of old checkpoints into one folder corrupt each
other's checkpoints (a relaunch while the killed launcher's workers still train, two jobs given the same
--checkpoint-dir). Rank 0, the rank that writes the checkpoint's metadata, takes an exclusive fcntl.flock on
DIR/.zplan-run.lock (never blocking) and writes its pid, host and start time into it; a run that finds the lock held
stops with RunLockError naming that pid and host, on every rank (rank 0's answer is broadcast). The lock is
the open file: it goes with the process, however the process ends (a SIGKILL too), so a stale lock file left
behind does not stop the next run.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from zplan.errors import RunLockError
from zplan.runtime.launch.distributed import RunContext
from zplan.safe_files import UnsafeFileError, open_regular, read_capped

LOCK_FILE = ".zplan-run.lock"
MAX_LOCK_BYTES = 4096  # the lock's JSON line: pid, host, start time


class RunLock:
    """The held lock (rank 0) or a stand-in (the other ranks, or no checkpoint folder)."""

    def __init__(self, stream=None):
        self._stream = stream

    @property
    def held(self) -> bool:
        return self._stream is not None

    def release(self) -> None:
        if self._stream is not None:
            fcntl.flock(self._stream, fcntl.LOCK_UN)
            self._stream.close()
            self._stream = None


def holder(path: Path) -> str:
    """Who holds the lock at `path`, as its file says."""
    try:
        info = json.loads(read_capped(path, MAX_LOCK_BYTES, "the run lock"))
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError, UnsafeFileError):
        return "a process whose lock file does not say who"


def try_lock(directory: str | Path) -> tuple[RunLock | None, str | None]:
    """(the lock, None) when taken, (None, why not: "is in use: ..." or "cannot be locked: ...") otherwise. The lock
    file is opened without following a link (a link planted there would have the pid written through it into
    another file) and must be a regular file."""
    path = Path(directory) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stream = os.fdopen(open_regular(path, os.O_RDWR | os.O_CREAT, follow=False), "r+")
    except UnsafeFileError as error:
        return None, f"cannot be locked: {error}"
    except OSError as error:
        return None, f"cannot be locked: cannot create {path}: {error.strerror or error}"
    try:
        fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        stream.close()
        return None, (f"is in use: another run holds it ({holder(path)}). Two runs writing one checkpoint folder "
                      "corrupt each other's checkpoints: wait for the other run to end (or stop it), or pass another "
                      "--checkpoint-dir")
    except OSError as error:
        stream.close()
        return None, f"cannot be locked: cannot lock {path}: {error.strerror or error}"
    stream.seek(0)
    stream.truncate()
    stream.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    stream.flush()
    return RunLock(stream), None


def lock_checkpoint_dir(directory: str | Path | None, ctx: RunContext) -> RunLock:
    """Rank 0 locks `directory` for this run; RunLockError on every rank when it cannot (None: no lock needed).
    Collective when directory is given: every rank calls it."""
    if directory is None:
        return RunLock()
    lock, problem = try_lock(directory) if ctx.is_main else (RunLock(), None)
    if ctx.world_size > 1:  # rank 0's answer on every rank, so that all stop with the same message
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem is not None:
        raise RunLockError(f"--checkpoint-dir {directory} {problem}")
    return lock
