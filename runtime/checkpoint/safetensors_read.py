"""Reading safetensors weights as hostile data, one rank's slices at a time: what --init-from reads
(runtime.checkpoint.pretrained).

    tensors = weights_of(path)                   # {name: TensorEntry} of a file, an index or a Hugging Face folder
    piece = read_slice(tensors[name], name, [rows, cols])   # just those rows and columns of the tensor

Every header is checked before a tensor is read (its length within the file and a cap, JSON, each entry's dtype,
shape and byte range inside the data area and matching its shape), and an index's shards must be plain names
inside its folder (zplan.safe_files) that exist and hold the tensors it names: a bad file is one CheckpointError
naming it. read_slice opens the file with safetensors' lazy slicing for each tensor (safe_open maps the file; its
pages leave the process when it closes, so the host memory of a read is the slice plus at most one tensor's mapped
pages) and reads the slice as contiguous runs of the given global indices of each dimension.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from zplan.errors import CheckpointError
from zplan.model.hf_folder import INDEX_FILE, SINGLE_FILE
from zplan.model.safetensors_format import SAFETENSORS_DTYPES
from zplan.safe_files import UnreadableFileError, UnsafeFileError, inside, open_regular, read_json_capped

HEADER_CAP_BYTES = 100 << 20  # safetensors' own limit on a header
INDEX_CAP_BYTES = 64 << 20  # an index of the largest models is a few MiB
DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}  # safetensors name -> torch dtype
_FIX = "download or save it again (save_pretrained(..., safe_serialization=True) writes whole files)"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def _bad(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a whole safetensors file: {problem}; {_FIX}")


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """{name: TensorEntry} of the safetensors file `path`, its header checked (module docstring)."""
    path = Path(path)
    try:
        descriptor = open_regular(path)
    except (UnsafeFileError, OSError) as error:
        raise CheckpointError(f"cannot read {path}: {error}; pass a .safetensors file") from error
    with os.fdopen(descriptor, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        prefix = stream.read(8)
        if len(prefix) < 8:
            raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
        length = int.from_bytes(prefix, "little")  # u64, little-endian (the format's specification)
        if length > HEADER_CAP_BYTES or 8 + length > size:
            raise _bad(path, f"its header says {length:,} bytes, the file has {size - 8:,} after the length "
                             "(a truncated header)")
        raw = stream.read(length)
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise _bad(path, f"its header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise _bad(path, "its header is not a JSON object")
    data_bytes = size - 8 - length
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, entry, data_bytes)
    return entries


def _entry(path: Path, name: str, entry: object, data_bytes: int) -> TensorEntry:
    """The header's `entry` for tensor `name`, checked against the file's `data_bytes` after the header."""
    if not isinstance(entry, dict):
        raise _bad(path, f"the header's entry of {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise _bad(path, f"{name} has dtype {dtype!r}, not one of {', '.join(sorted(DTYPES))}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        raise _bad(path, f"{name} has shape {shape!r}, not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)):
        raise _bad(path, f"{name} has data_offsets {offsets!r}, not [begin, end]")
    begin, end = offsets
    numel = 1
    for n in shape:
        numel *= n
    expected = numel * DTYPES[dtype].itemsize
    if not 0 <= begin <= end <= data_bytes or end - begin != expected:
        raise _bad(path, f"{name} ({dtype} {shape}, {expected:,} bytes) lies at bytes {begin:,} to {end:,} of "
                         f"{data_bytes:,} (truncated or damaged)")
    return TensorEntry(path, DTYPES[dtype], tuple(shape))


def read_index(path: str | Path) -> dict[str, TensorEntry]:
    """{name: TensorEntry} of the sharded weights an index names ({"weight_map": {tensor: shard file}}), each
    shard's header read and holding the tensors the index gives it."""
    path = Path(path)
    try:
        index, _ = read_json_capped(path, INDEX_CAP_BYTES, "the safetensors index")
    except UnreadableFileError as error:
        raise CheckpointError(f"cannot read {path} as JSON ({error}): put back the index save_pretrained "
                              "wrote") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{path} has no \"weight_map\" of tensor names to shard files: put back the index "
                              "save_pretrained wrote")
    headers: dict[str, dict[str, TensorEntry]] = {}
    entries = {}
    for name, shard in sorted(weight_map.items()):
        if shard not in headers:
            shard_path = inside(path.parent, shard, str(path))
            if not shard_path.is_file():
                raise CheckpointError(f"{path} names the shard {shard}, which is not in {path.parent}: copy every "
                                      "shard of the checkpoint into that folder (or download it again)")
            headers[shard] = read_header(shard_path)
        if name not in headers[shard]:
            raise CheckpointError(f"{path} puts {name} in {shard}, whose header does not hold it: the index is of "
                                  "other shards; download or save the checkpoint again")
        entries[name] = headers[shard][name]
    return entries


def weights_of(path: str | Path) -> dict[str, TensorEntry]:
    """The tensors of a .safetensors file, an index (.json), or a folder holding an index or model.safetensors."""
    path = Path(path)
    if path.is_dir():
        for name, read in ((INDEX_FILE, read_index), (SINGLE_FILE, read_header)):
            if (path / name).is_file():
                return read(path / name)
        raise CheckpointError(f"{path} holds neither {INDEX_FILE} nor {SINGLE_FILE}: it is not a Hugging Face "
                              "checkpoint folder (nor a zplan step-N checkpoint); pass a folder with its weights, a "
                              ".safetensors file, or --init-from none")
    if not path.exists():
        raise CheckpointError(f"--init-from {path} does not exist: pass a .safetensors file, a Hugging Face folder "
                              "or a zplan step-N checkpoint folder")
    if path.suffix == ".json":
        return read_index(path)
    return read_header(path)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """[(start, stop)] of the consecutive runs of `indices`, in their order: [0, 1, 2, 8, 9] -> [(0, 3), (8, 10)]."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(a, b) for a, b in runs]


def read_slice(entry: TensorEntry, name: str, indices: list[torch.Tensor]) -> torch.Tensor:
    """Tensor `name` of `entry`'s file at the global indices `indices` (one int64 vector per dimension), in the
    file's dtype: the dimension whose indices are not one run is read run by run; any other such dimension is
    read over its range and selected."""
    # safetensors: zplan's dependency, loaded for --init-from only (start-up time)
    from safetensors import safe_open

    runs = [_runs(i.tolist()) for i in indices]
    split = next((d for d, r in enumerate(runs) if len(r) > 1), None)
    box = [slice(int(i.min()), int(i.max()) + 1) if len(i) else slice(0, 0) for i in indices]
    with safe_open(str(entry.file), framework="pt") as stream:  # per tensor: its mapped pages go when it closes
        view = stream.get_slice(name)
        if not indices:  # a scalar
            return stream.get_tensor(name)
        if split is None:
            piece = view[tuple(box)]
        else:
            piece = torch.cat([view[tuple(box[:split] + [slice(a, b)] + box[split + 1:])] for a, b in runs[split]],
                              dim=split)
    for d, dim_runs in enumerate(runs):
        if d != split and len(dim_runs) > 1:
            piece = piece.index_select(d, indices[d] - box[d].start)
    return piece
