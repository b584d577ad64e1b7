"""Where the zplan command writes: the folder of `zplan compile -o DIR`, checked first, built beside it and
swapped in all or nothing; the one file of `zplan probe -o` and `zplan reduce -o`, checked before the work.

    check_out_dir(DIR)                          # before tracing: DIR is not a file, nor under one, and can be made
    write_out_dir(DIR, render, force=False)     # render(tmp) writes the files into a temporary sibling of DIR
    check_out_file(PATH, "-o")                  # before measuring or reducing: PATH can be written

Every file is rendered into a temporary folder beside DIR first, so a failure while rendering changes nothing. A
new DIR is that folder renamed. An existing DIR keeps the files zplan did not write (logs, checkpoints); before
anything in it is touched, every path zplan is about to write is checked: a file where zplan needs a folder (a
user's file named `launch`), a folder where zplan writes a file, and a file the user changed since zplan wrote it
(told by the SHA-256 zplan recorded in DIR/.zplan-manifest.json; a file without a record is the user's too) are
refused, naming the path, and nothing is changed. --force overwrites changed files (never a file or folder in the
way). The old versions are then moved aside and the new ones moved in; a failure on the way moves everything back.
Files of the previous compile that this one does not write (train.py after a switch to --mode inference) are
removed with it when unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from zplan import __version__
from zplan.errors import OutputError
from zplan.safe_files import UnsafeFileError, disk_is_full, full_disk_message, inside, read_capped

MANIFEST = ".zplan-manifest.json"
MAX_MANIFEST_BYTES = 1 << 20


def _parent_problem(path: Path) -> str | None:
    """Why no file or folder can be made at `path` (absolute) for want of a folder to make it in, or None."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, so nothing can be made under it"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


def check_out_dir(out_dir: Path) -> None:
    """OutputError when `out_dir` cannot be an output folder: it is a file, a parent is a file, or the nearest
    existing parent cannot be written."""
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"-o {out_dir} is a file: pass a folder (existing or new) for the outputs")
    problem = None if out_dir.is_dir() else _parent_problem(out_dir)
    if problem is None and out_dir.is_dir() and not os.access(out_dir, os.W_OK | os.X_OK):
        problem = f"{out_dir} is not writable"
    if problem:
        raise OutputError(f"-o {out_dir}: {problem}: pass another -o")


def check_out_file(path: Path, option: str) -> None:
    """OutputError when the file `path` cannot be written: it is a folder, or no folder can hold it."""
    path = Path(path).absolute()
    if path.is_dir():
        problem = f"{path} is a folder"
    elif path.exists():
        problem = None if os.access(path, os.W_OK) else f"{path} is not writable"
    else:
        problem = _parent_problem(path)
    if problem:
        raise OutputError(f"cannot write {option} {path}: {problem}; pass another {option} (nothing was done)")


def write_text_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it (fsync, rename): the old file stays until the new one
    is whole. OutputError when it cannot be written."""
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        tmp = Path(name)
        os.chmod(handle, 0o666 & ~_umask())  # as open() would make it (mkstemp's is private)
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except OSError as error:
        full = disk_is_full(error, path.parent)
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if full:
            raise OutputError(f"{full_disk_message(path, len(text.encode()))}; the previous file, if any, is "
                              "unchanged") from error
        raise OutputError(f"cannot write {path}: {error.strerror or error}") from error


def _umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(out_dir: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of the files zplan wrote into `out_dir` last time ({} when there is no readable
    manifest: every existing file then counts as the user's). Entries whose path would lead out of `out_dir` are
    dropped: the manifest is data anyone with the folder could have edited, and zplan moves and removes the files it
    names."""
    try:
        files = json.loads(read_capped(out_dir / MANIFEST, MAX_MANIFEST_BYTES, "the compile manifest"))["files"]
    except (OSError, ValueError, KeyError, TypeError, UnsafeFileError):
        return {}
    if not isinstance(files, dict):
        return {}
    recorded = {}
    for rel, digest in files.items():
        try:
            inside(out_dir, str(rel), MANIFEST)
        except UnsafeFileError:
            continue
        recorded[str(rel)] = str(digest)
    return recorded


def _manifest_text(tmp: Path, written: list[str]) -> str:
    files = {rel: sha256_file(tmp / rel) for rel in written}
    return json.dumps({"written_by": f"zplan {__version__}", "files": files}, indent=2, sort_keys=True) + "\n"


def _problems(out_dir: Path, tmp: Path, written: list[str], recorded: dict[str, str], force: bool) -> list[str]:
    """Why the files `written` (relative paths) cannot be moved into `out_dir`: paths in the way, files changed."""
    problems = []
    for rel in written:
        for parent in reversed(Path(rel).parents[:-1]):  # launch/ of launch/torchrun.sh
            if (out_dir / parent).is_symlink():
                problems.append(f"{out_dir / parent} is a symbolic link where zplan writes the folder {parent}/ "
                                "(zplan does not write through links): move it away")
            elif (out_dir / parent).exists() and not (out_dir / parent).is_dir():
                problems.append(f"{out_dir / parent} is a file where zplan writes the folder {parent}/: move it away")
        target = out_dir / rel
        if target.is_dir():
            problems.append(f"{target} is a folder where zplan writes a file: move it away")
        elif target.exists() and not target.is_file():
            problems.append(f"{target} is a special file where zplan writes a file: move it away")
        elif target.exists() and not force and sha256_file(target) not in (recorded.get(rel), sha256_file(tmp / rel)):
            problems.append(f"{target} was changed since zplan wrote it (or zplan did not write it): move it away, "
                            "or pass --force to overwrite it")
    return sorted(set(problems))


def _stale(out_dir: Path, written: list[str], recorded: dict[str, str]) -> list[str]:
    """Files of the previous compile that this one does not write, unchanged since: removed with the swap."""
    return [rel for rel, digest in recorded.items() if rel not in written and rel != MANIFEST
            and (out_dir / rel).is_file() and not (out_dir / rel).is_symlink()
            and sha256_file(out_dir / rel) == digest]


def _swap_in(out_dir: Path, tmp: Path, written: list[str], stale: list[str]) -> None:
    """Move the old versions of `written` and the `stale` files aside, then the new files in (the manifest last); on
    a failure put everything back as it was and raise OutputError."""
    aside = Path(tempfile.mkdtemp(prefix=".previous.", dir=tmp))
    moved_aside, moved_in, made = [], [], []
    try:
        for rel in [r for r in written if (out_dir / r).exists()] + stale:
            (aside / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(out_dir / rel, aside / rel)
            moved_aside.append(rel)
        for rel in written:
            for parent in reversed(Path(rel).parents[:-1]):
                if not (out_dir / parent).exists():
                    (out_dir / parent).mkdir()
                    made.append(out_dir / parent)
            os.replace(tmp / rel, out_dir / rel)
            moved_in.append(rel)
    except OSError as error:
        for rel in moved_in:
            os.replace(out_dir / rel, tmp / rel)
        for folder in reversed(made):
            folder.rmdir()
        for rel in moved_aside:
            os.replace(aside / rel, out_dir / rel)
        raise OutputError(f"cannot write {out_dir}: {error.strerror or error}; nothing in it was changed") from error


def write_out_dir(out_dir: Path, render: Callable[[Path], list[Path]], force: bool = False) -> list[Path]:
    """`render(folder)` writes the outputs into a temporary folder beside `out_dir`; they replace their old versions
    in `out_dir` all together, or OutputError says why not and nothing is changed (see the module's docstring).
    Returns the written paths in `out_dir`."""
    out_dir = Path(out_dir).absolute()
    check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o777 & ~_umask())  # a folder as mkdir makes it (mkdtemp's is private)
    try:
        try:
            written = sorted(p.relative_to(tmp).as_posix() for p in render(tmp))
            (tmp / MANIFEST).write_text(_manifest_text(tmp, written))
        except OSError as error:
            full = disk_is_full(error, out_dir.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            problem = full_disk_message(out_dir) if full else f"{out_dir}: {error.strerror or error}"
            raise OutputError(f"{problem}; nothing was written") from error
        if not out_dir.exists():
            tmp.rename(out_dir)
        else:
            recorded = read_manifest(out_dir)
            problems = _problems(out_dir, tmp, written, recorded, force)
            if problems:
                raise OutputError("not written, nothing in the folder was changed: " + "; ".join(problems))
            _swap_in(out_dir, tmp, [*written, MANIFEST], _stale(out_dir, written, recorded))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out_dir / rel for rel in written]
