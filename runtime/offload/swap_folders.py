"""The swap folders of the NVMe swap engine (nvme.py): free-space checks, stale folders, cleanup at exit.

Lifetime. The engine owns one subfolder per instance and removes it on `close()`, on leaving a
`with` block, at interpreter exit (atexit) and on SIGTERM (a handler that removes the folders of all
live engines, then runs the previous handler, or the default one, which ends the process). At start it
removes the subfolders that earlier processes of this host left behind (a process killed with
SIGKILL cannot clean up): those whose pid is no longer alive. `check_space` refuses a swap folder that
cannot hold what a run will swap, before training starts.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import socket
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from zplan.errors import SwapError

if TYPE_CHECKING:
    from zplan.runtime.offload.nvme import SwapEngine

log = logging.getLogger(__name__)

FOLDER_PREFIX = "zplan-swap-"


def check_space(folder: str | os.PathLike, needed_bytes: int) -> int:
    """Raise SwapError unless the file system of `folder` has `needed_bytes` free; returns the free bytes."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise SwapError(
            f"the swap folder {folder} has {free} bytes ({free / 2**30:.2f} GiB) free but {needed_bytes} bytes "
            f"({needed_bytes / 2**30:.2f} GiB) are needed: free space there or choose another --nvme-path"
        )
    return free


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


_FOLDER_RE = re.compile(re.escape(FOLDER_PREFIX) + r"(?P<host>.+)-(?P<pid>\d+)-(?P<k>\d+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_folders(folder: str | os.PathLike) -> list[Path]:
    """Remove the swap subfolders of `folder` that processes of this host left behind (their pid is not alive,
    or it is this process's pid but no live engine owns the folder); returns what was removed. Folders of
    other hosts (a shared file system) are kept: their pids mean nothing here."""
    removed: list[Path] = []
    owned = {e.run_folder for e in list(_LIVE_ENGINES)}
    try:
        entries = list(Path(folder).iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = _FOLDER_RE.match(entry.name)
        if not match or match["host"] != _host_tag() or not entry.is_dir():
            continue
        pid = int(match["pid"])
        if (pid == os.getpid() and entry not in owned) or (pid != os.getpid() and not _pid_alive(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            log.info("removed stale swap folder %s (process %d is gone)", entry, pid)
    return removed


# ---- cleanup on exit and SIGTERM ---------------------------------------------------------------------------

_LIVE_ENGINES: weakref.WeakSet[SwapEngine] = weakref.WeakSet()
_previous_sigterm: object = None
_sigterm_installed = False


def _remove_all_folders() -> None:
    for engine in list(_LIVE_ENGINES):
        engine._remove_folder()


def _on_sigterm(signum, frame) -> None:
    _remove_all_folders()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    else:  # SIG_DFL (or a handler not installed from Python): the default action, termination
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_handler() -> None:
    global _previous_sigterm, _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still cleans up
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return  # the process chose to ignore SIGTERM: keep it that way
    _previous_sigterm = previous
    signal.signal(signal.SIGTERM, _on_sigterm)
    _sigterm_installed = True


atexit.register(_remove_all_folders)
