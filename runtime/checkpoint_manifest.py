"""A checkpoint's MANIFEST.json: the size and XXH3-64 hash of every file in it, so that a flipped byte or a
file cut short is found before its numbers are trained on or exported (issue 13).

    {"format": 1, "hash": "xxh3_64", "files": {"__0_0.distcp": {"bytes": 123, "xxh3_64": "9f..."}, ...}}

Written by save_checkpoint once every file is on disk and before COMPLETE: the files are dealt out to the
ranks, each hashes its share (xxhash releases the GIL; ~7 GB/s per core on this machine, runtime/offload/nvme.py),
rank 0 writes the manifest. Verified on resume the same way (each rank its share) and, in one process, by
`zplan export` and `--resume latest-valid`. A checkpoint written before manifests existed is loaded with a
warning that it was not verified.
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

MANIFEST_FILE = "MANIFEST.json"
MANIFEST_FORMAT = 1
UNHASHED = {MANIFEST_FILE, "COMPLETE"}  # COMPLETE is written after the manifest
READ_BYTES = 16 << 20  # 16 MiB reads


def file_entry(path: Path) -> dict:
    """{"bytes": size, "xxh3_64": hex digest} of one file."""
    digest, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "xxh3_64": digest.hexdigest()}


def files_to_hash(folder: Path) -> list[str]:
    """Every file of the checkpoint folder the manifest covers, sorted (the same list on every rank)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in UNHASHED)


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's files to hash: every world_size-th, from the rank-th."""
    return names[rank::world_size]


def write_manifest(folder: Path, entries: dict[str, dict]) -> Path:
    path = folder / MANIFEST_FILE
    path.write_text(json.dumps({"format": MANIFEST_FORMAT, "hash": "xxh3_64", "files": dict(sorted(entries.items()))},
                               indent=1) + "\n")
    return path


def read_manifest(folder: Path) -> dict[str, dict] | None:
    """The manifest's files, or None when the checkpoint has none (written before manifests)."""
    path = folder / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if data.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {data.get('format')!r}")
        return files
    except (OSError, ValueError, KeyError, TypeError) as error:
        return {MANIFEST_FILE: {"error": f"unreadable ({error})"}}


def file_problems(folder: Path, files: dict[str, dict], names: list[str]) -> list[str]:
    """What is wrong with the files `names` of the manifest `files`: missing, another size, another hash."""
    problems = []
    for name in names:
        expected, path = files[name], folder / name
        if "error" in expected:
            problems.append(f"{path} is {expected['error']}")
        elif not path.is_file():
            problems.append(f"{path} is missing")
        else:
            got = file_entry(path)
            if got["bytes"] != expected["bytes"]:
                problems.append(f"{path} has {got['bytes']} bytes, the manifest says {expected['bytes']} (cut short "
                                "or overwritten)")
            elif got["xxh3_64"] != expected["xxh3_64"]:
                problems.append(f"{path} does not match its checksum in {MANIFEST_FILE} (its bytes changed since "
                                "it was written)")
    return problems


def verify(folder: Path) -> list[str]:
    """Every problem of the checkpoint `folder`, in this process; ['... no manifest'] when it has none."""
    files = read_manifest(folder)
    if files is None:
        return [f"{folder} has no {MANIFEST_FILE} (written before checkpoints carried checksums)"]
    return file_problems(folder, files, sorted(files))
