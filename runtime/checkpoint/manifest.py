"""A checkpoint's MANIFEST.json: the size and XXH3-64 hash of every file in it, so that a flipped byte or a
file cut short is found before its numbers are trained on or exported.

    {"format": 1, "hash": "xxh3_64", "files": {"__0_0.distcp": {"bytes": 123, "xxh3_64": "9f..."}, ...}}

Written by save_checkpoint once every file is on disk and before COMPLETE: the files are dealt out to the
ranks, each hashes its share (xxhash releases the GIL; ~7 GB/s per core on this machine, runtime/offload/nvme.py),
rank 0 writes the manifest. Verified on resume the same way (each rank its share) and, in one process, by
`zplan export` and `--resume latest-valid`.

The manifest is read as hostile data: it is a regular file inside the checkpoint folder (a link, FIFO or device is
refused by kind, without blocking), read up to manifest_cap(folder); every name in it is a plain file name of the
folder (`../x`, `/etc/x`, `sub/x` are refused before anything is opened), and it covers exactly the folder's files:
a file of the folder it leaves out, an entry whose file is absent, anything but a regular file in the folder (a link,
a FIFO, a subfolder) is a problem. Only then are the files hashed, each opened as a regular file without following
a link. A checkpoint without a manifest is unverified: `--resume latest-valid` never takes it, and a resume or an
export reads it only when told to (--allow-unverified).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from zplan.safe_files import KINDS, UnsafeFileError, inside, open_regular, read_capped

MANIFEST_FILE = "MANIFEST.json"
MANIFEST_FORMAT = 1
UNHASHED = {MANIFEST_FILE, "COMPLETE"}  # COMPLETE is written after the manifest
READ_BYTES = 16 << 20  # 16 MiB reads
# The manifest's size cap. Its JSON takes ~85 bytes per file (name, size and hash over 4 indented lines) and a
# checkpoint has 2 files per rank (its DCP shard and its rank file) and 3 more: a few MiB covers runs of ten thousand
# ranks. The cap is 4 MiB plus 256 bytes for every entry of the folder (three times what an entry needs), so that no
# run is too large for its own manifest, while a file past it (a link to /dev/zero, a log written over it) is refused
# after reading a few MiB, not the 23.7 GB it took to find that out before.
MANIFEST_BASE_BYTES = 4 << 20
MANIFEST_BYTES_PER_FILE = 256
_HEX64 = re.compile(r"^[0-9a-f]{16}$")


def _check_name(folder: Path, name: object, named_in: str) -> None:
    """UnsafeFileError unless `name` (read from `named_in`) is a plain file name: no folder part, no `..`, not
    absolute. Nothing is opened."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UnsafeFileError(f"{named_in} names {name!r}, not a file name of {folder}: refused (nothing was read "
                              "or changed); the file is damaged or was edited by hand")


def plain_file(folder: Path, name: object, named_in: str) -> Path:
    """folder/name when `name` (read from the file `named_in`) is a plain file name naming a regular file of
    `folder`, not a link; UnsafeFileError otherwise, FileNotFoundError when there is no such file. Nothing is
    opened."""
    _check_name(folder, name, named_in)
    kind = stat.S_IFMT(os.lstat(folder / name).st_mode)
    if kind != stat.S_IFREG:
        raise UnsafeFileError(f"{folder / name} is a {KINDS.get(kind, 'special file')}, not a regular file: refused "
                              "(a checkpoint holds regular files only; nothing was read through it)")
    return inside(folder, name, named_in)


def read_small_file(folder: Path, name: str, cap_bytes: int, what: str) -> bytes:
    """The bytes of the regular file folder/name (plain_file), at most `cap_bytes` of them (UnsafeFileError past
    that, counted on what was read, so /dev/zero or a growing file cannot fill the memory)."""
    return read_capped(plain_file(folder, name, what), cap_bytes, what, follow=False)


def file_entry(path: Path) -> dict:
    """{"bytes": size, "xxh3_64": hex digest} of one regular file (a link, FIFO or device is refused)."""
    digest, size = xxhash.xxh3_64(), 0
    with os.fdopen(open_regular(path, follow=False), "rb") as f:
        while chunk := f.read(READ_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "xxh3_64": digest.hexdigest()}


def folder_files(folder: Path) -> tuple[list[str], list[str]]:
    """(the regular files of `folder` a manifest covers, sorted: the same list on every rank; a problem for every
    other entry: a link, a FIFO, a device, a subfolder). Links are not followed."""
    names, problems = [], []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name in UNHASHED:
                continue  # each checked where it is read
            if entry.is_file(follow_symlinks=False):
                names.append(entry.name)
            else:
                kind = KINDS.get(stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode), "special file")
                problems.append(f"{folder / entry.name} is a {kind}, not a regular file (a checkpoint holds regular "
                                "files only): refused, nothing read through it")
    return sorted(names), sorted(problems)


def files_to_hash(folder: Path) -> list[str]:
    """Every file of the checkpoint folder the manifest covers, sorted (the same list on every rank)."""
    return folder_files(folder)[0]


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's files to hash: every world_size-th, from the rank-th."""
    return names[rank::world_size]


def write_manifest(folder: Path, entries: dict[str, dict]) -> Path:
    path = folder / MANIFEST_FILE
    path.write_text(json.dumps({"format": MANIFEST_FORMAT, "hash": "xxh3_64", "files": dict(sorted(entries.items()))},
                               indent=1) + "\n")
    return path


def manifest_cap(folder: Path) -> int:
    """The most bytes the manifest of `folder` is read to (MANIFEST_BASE_BYTES, MANIFEST_BYTES_PER_FILE)."""
    with os.scandir(folder) as entries:
        return MANIFEST_BASE_BYTES + MANIFEST_BYTES_PER_FILE * sum(1 for _ in entries)


def has_manifest(folder: Path) -> bool:
    """Whether `folder` has a MANIFEST.json entry at all (of any kind: a link or FIFO there is read, and refused)."""
    return os.path.lexists(folder / MANIFEST_FILE)


class ManifestError(ValueError):
    """A MANIFEST.json that cannot be read (a special file, too big, not JSON) or is malformed."""


def _not_finite(constant: str):
    raise ValueError(f"{constant} is not a number JSON allows")


def read_manifest(folder: Path) -> dict[str, dict] | None:
    """The manifest's files, checked for form (plain names, an integer size and a hash each), or None when the
    checkpoint has none. ManifestError when it cannot be read or is malformed."""
    if not has_manifest(folder):
        return None
    try:
        data = json.loads(read_small_file(folder, MANIFEST_FILE, manifest_cap(folder), "the checkpoint manifest"),
                          parse_constant=_not_finite)
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"),
                                                                                                  dict):
            raise ValueError(f"not {{\"format\": {MANIFEST_FORMAT}, \"files\": {{...}}}}")
        files = data["files"]
    except UnsafeFileError as error:
        raise ManifestError(str(error)) from error
    except (OSError, ValueError, RecursionError) as error:
        raise ManifestError(f"{folder / MANIFEST_FILE} is unreadable ({type(error).__name__}: {error})") from error
    for name, entry in files.items():
        try:
            _check_name(folder, name, str(folder / MANIFEST_FILE))
        except UnsafeFileError as error:
            raise ManifestError(str(error)) from error
        if name in UNHASHED:
            raise ManifestError(f"{folder / MANIFEST_FILE} lists {name}, which it cannot cover: the manifest is "
                                "damaged or was edited by hand")
        size = entry.get("bytes") if isinstance(entry, dict) else None
        digest = entry.get("xxh3_64") if isinstance(entry, dict) else None
        if type(size) is not int or size < 0 or not isinstance(digest, str) or not _HEX64.match(digest):
            raise ManifestError(f"{folder / MANIFEST_FILE} is malformed: the entry of {name!r} is not "
                                "{\"bytes\": size, \"xxh3_64\": 16 hex digits}")
    return files


@dataclass
class ManifestCheck:
    """What checking a folder against its manifest found before hashing anything."""

    files: dict[str, dict] | None  # the manifest's entries; None: no manifest
    problems: list[str] = field(default_factory=list)  # found without hashing: each names its file
    to_hash: list[str] = field(default_factory=list)  # files both listed and present: their hashes are compared

    @property
    def unverified(self) -> bool:
        return self.files is None and not self.problems


def check_manifest(folder: Path) -> ManifestCheck:
    """The folder's manifest against its listing, without hashing: an unreadable or malformed manifest, a file it
    leaves out, an entry whose file is absent, anything but a regular file in the folder."""
    try:
        files = read_manifest(folder)
    except ManifestError as error:
        return ManifestCheck(files={}, problems=[str(error)])
    present, problems = folder_files(folder)
    if files is None:
        return ManifestCheck(files=None, problems=problems)
    problems += [f"{folder / name} is not in {MANIFEST_FILE} (added after the checkpoint was written, or left out "
                 "of its manifest): its bytes cannot be checked" for name in present if name not in files]
    problems += [f"{folder / name} is missing (listed in {MANIFEST_FILE})" for name in sorted(files)
                 if name not in present and not os.path.lexists(folder / name)]
    return ManifestCheck(files=files, problems=problems, to_hash=[name for name in sorted(files) if name in present])


def file_problems(folder: Path, files: dict[str, dict], names: list[str]) -> list[str]:
    """What is wrong with the files `names` of the manifest `files`: missing, another size, another hash."""
    problems = []
    for name in names:
        expected, path = files[name], folder / name
        try:
            got = file_entry(path)
        except FileNotFoundError:
            problems.append(f"{path} is missing (listed in {MANIFEST_FILE})")
            continue
        except (UnsafeFileError, OSError) as error:
            problems.append(f"cannot read {path}: {error}")
            continue
        if got["bytes"] != expected["bytes"]:
            problems.append(f"{path} has {got['bytes']} bytes, the manifest says {expected['bytes']} (cut short "
                            "or overwritten)")
        elif got["xxh3_64"] != expected["xxh3_64"]:
            problems.append(f"{path} does not match its checksum in {MANIFEST_FILE} (its bytes changed since "
                            "it was written)")
    return problems


def no_manifest_problem(folder: Path) -> str:
    return f"{folder} has no {MANIFEST_FILE}: its files cannot be checked (unverified)"


def verify(folder: Path) -> list[str]:
    """Every problem of the checkpoint `folder`, in this process; [no_manifest_problem] when it has none."""
    check = check_manifest(folder)
    if check.files is None:
        return [no_manifest_problem(folder), *check.problems]
    return check.problems + file_problems(folder, check.files, check.to_hash)
