"""Files zplan touches on behalf of a file it did not write itself: a path named in a manifest, a lock file, a JSON
state file anyone could have replaced. Torch-free and below every layer (as zplan.errors is): the planner, the
runtime and the CLI use it.

    path = inside(folder, "step-000004/__0_0.distcp", "MANIFEST.json")   # or UnsafeFileError
    data = read_capped(path, 1 << 20, "the checkpoint manifest")          # bytes, at most the cap
    value, raw = read_json_capped(path, 1 << 20, "the index")            # parsed, or UnreadableFileError
    fd = open_regular(path, os.O_RDWR | os.O_CREAT, follow=False)         # a lock file zplan creates
    if disk_is_full(error, folder): message = full_disk_message(path, needed_bytes)   # one message for every write

What each guards against: a name with `..`, an absolute name or a symbolic link leading out of its folder (zplan
would read, hash, move or delete a file elsewhere); a special file in place of a regular one (/dev/zero reads
without end, a FIFO blocks the reader forever), refused by kind after opening without blocking; a file larger
than it should be, refused on the bytes actually read (stat's size is 0 for /dev/zero and /proc files).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

from zplan.errors import ZplanError


class UnsafeFileError(ZplanError):
    """A path that leads out of its folder, a link or special file where a regular file belongs, or a file over its
    size cap."""


class UnreadableFileError(ZplanError):
    """A file that could not be read (missing, unsafe, over its cap) or parsed; the reason is the message."""


KINDS = {stat.S_IFDIR: "folder", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
         stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket", stat.S_IFLNK: "symbolic link"}


def inside(folder: str | Path, name: str, named_in: str) -> Path:
    """folder/name, when `name` (read from the file `named_in`) is a relative path that stays inside `folder`, links
    resolved; UnsafeFileError otherwise."""
    folder = Path(folder)
    relative = Path(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        raise UnsafeFileError(f"{named_in} names {name!r}, a path outside {folder}: refused (nothing was read or "
                              "changed); the file is damaged or was edited by hand")
    path = folder / relative
    if not path.resolve().is_relative_to(folder.resolve()):
        raise UnsafeFileError(f"{named_in} names {name!r}, which leads out of {folder} through a symbolic link: "
                              "refused (nothing was read or changed)")
    return path


def open_regular(path: str | Path, flags: int = os.O_RDONLY, mode: int = 0o644, *, follow: bool = True) -> int:
    """A file descriptor of the regular file `path` (opened without blocking, so a FIFO cannot hang the caller; with
    follow=False a symbolic link is refused, for files zplan creates). UnsafeFileError for any other kind;
    OSError as os.open raises it otherwise."""
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        descriptor = os.open(path, flags, mode)
    except OSError as error:
        if error.errno == errno.ELOOP and not follow:
            raise UnsafeFileError(f"{path} is a symbolic link where zplan keeps a file of its own: remove the link "
                                  "(zplan does not write through links)") from error
        raise
    kind = stat.S_IFMT(os.fstat(descriptor).st_mode)
    if kind != stat.S_IFREG:
        os.close(descriptor)
        raise UnsafeFileError(f"{path} is a {KINDS.get(kind, 'special file')}, not a regular file: refused")
    os.set_blocking(descriptor, True)
    return descriptor


def read_capped(path: str | Path, cap_bytes: int, what: str, *, follow: bool = True) -> bytes:
    """The bytes of the regular file `path`, at most `cap_bytes` of them (UnsafeFileError past that, counted on what
    was read); `what` names the file in messages. follow=False: a symbolic link is refused too (open_regular)."""
    with os.fdopen(open_regular(path, follow=follow), "rb") as stream:
        data = stream.read(cap_bytes + 1)
    if len(data) > cap_bytes:
        raise UnsafeFileError(f"{what} {path} is over {cap_bytes:,} bytes, far more than such a file holds: refused "
                              "(is it the right file?)")
    return data


def read_json_capped(path: str | Path, cap_bytes: int, what: str) -> tuple[object, bytes]:
    """(the JSON value of the regular file `path`, its bytes), at most `cap_bytes` of them; UnreadableFileError
    with the reason (unsafe, unreadable, over the cap, not JSON) for the caller to wrap with its advice."""
    try:
        raw = read_capped(path, cap_bytes, what)
        return json.loads(raw), raw
    except (UnsafeFileError, OSError, ValueError) as error:
        raise UnreadableFileError(str(error)) from error


FULL_DISK_BYTES = 1 << 20  # a write that failed with less than this free (bytes) on its disk failed for want of space


def disk_is_full(error: BaseException, folder: str | Path) -> bool:
    """Whether `error`, raised by a write into `folder`, means its disk is full: ENOSPC or EDQUOT, or any failed write
    (torch.save reports one as a RuntimeError) while the disk has under FULL_DISK_BYTES free."""
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(folder).free < FULL_DISK_BYTES
    except OSError:
        return False


def full_disk_message(path: str | Path, needed_bytes: int | None = None) -> str:
    """'PATH: the disk is full (F free, N needed)', F measured now (call it once the partial output is removed)."""
    free = shutil.disk_usage(Path(path).parent).free
    needed = f"{_size(needed_bytes)} needed" if needed_bytes else "more needed"
    return f"{path}: the disk is full ({_size(free)} free, {needed})"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"
