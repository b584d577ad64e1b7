"""`zplan export CKPT --to model.safetensors`: one consolidated weights file from a sharded checkpoint.

The checkpoint (runtime/checkpoint/save.py) holds each rank's shards in DCP's format; its .metadata names
every tensor with its full shape and dtype. The safetensors file's layout follows from that alone:

    8 bytes   N, the header's length (little-endian u64)
    N bytes   JSON header: {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
              padded with spaces to a multiple of 8
    ...       the tensors' bytes, back to back, in header order

so the header is written first and the tensors are then read from the shards a chunk at a time (at
most `max_chunk_bytes` of tensors per DCP read, a bigger tensor alone) and appended: the process holds
one chunk, never the whole model. The file is written under a temporary name and renamed when complete.
Only the model's tensors are exported (keys `model.<fqn>`), named as the model file names them, tied
weights under each of their names, as `model.state_dict()` has them.

The checkpoint is read as hostile data (runtime/checkpoint/save.py, runtime/checkpoint/manifest.py): its files are first
checked against MANIFEST.json, which must cover exactly the folder's regular files; one without a manifest is
exported only with allow_unverified (`--allow-unverified`, a warning on stderr); DCP reads only the *.distcp files
of the folder its .metadata names, and train_state.json is read up to its cap, a link, FIFO or device refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from zplan.errors import ExportError
from zplan.model.fused_layout import layouts_from_json, to_original
from zplan.model.safetensors_format import SAFETENSORS_DTYPES
from zplan.runtime.checkpoint.manifest import has_manifest, no_manifest_problem, verify
from zplan.runtime.checkpoint.save import (
    ALLOW_UNVERIFIED_FLAG,
    TRAIN_STATE_FILE,
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    describe_dcp_error,
    read_train_state,
    resolve_checkpoint,
)

MODEL_PREFIX = "model."
DEFAULT_MAX_CHUNK_BYTES = 1 << 30  # 1 GiB of tensors in memory at a time


def _model_tensors(checkpoint: Path) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """{checkpoint key: (dtype, full shape)} of the model's tensors, from DCP's metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = SafeFileSystemReader(checkpoint).read_metadata()
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"cannot read the checkpoint metadata in {checkpoint}: {error}") from error
    tensors = {
        key: (entry.properties.dtype, entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    if not tensors:
        raise CheckpointError(f"{checkpoint} holds no model tensors (no '{MODEL_PREFIX}*' entries)")
    unsupported = sorted({str(dtype) for dtype, _ in tensors.values() if dtype not in SAFETENSORS_DTYPES})
    if unsupported:
        raise ExportError(f"safetensors has no dtype for {', '.join(unsupported)} in {checkpoint}")
    return tensors


def _fused_layouts(checkpoint: Path) -> dict:
    """The stored order of the checkpoint's fused projections (model.fused_layout), from its train_state.json (read
    as a resume reads it: runtime.checkpoint.save.read_train_state)."""
    state = read_train_state(checkpoint)
    try:
        return layouts_from_json(state.get("fused_layouts", {}))
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"cannot read the fused layouts of {checkpoint / TRAIN_STATE_FILE}: "
                              f"{type(error).__name__}: {error}") from error


def _nbytes(dtype: torch.dtype, shape: torch.Size) -> int:
    return shape.numel() * torch.empty((), dtype=dtype).element_size()


def _chunks(keys: list[str], sizes: dict[str, int], max_chunk_bytes: int) -> Iterator[list[str]]:
    """Consecutive runs of `keys` of at most max_chunk_bytes each (a bigger tensor makes a chunk alone)."""
    chunk, chunk_bytes = [], 0
    for key in keys:
        if chunk and chunk_bytes + sizes[key] > max_chunk_bytes:
            yield chunk
            chunk, chunk_bytes = [], 0
        chunk.append(key)
        chunk_bytes += sizes[key]
    if chunk:
        yield chunk


def _load_chunk(checkpoint: Path, tensors: dict[str, tuple[torch.dtype, torch.Size]], keys: list[str]):
    """The full tensors `keys`, assembled by DCP from whatever shards wrote them, in this process only."""
    import torch.distributed.checkpoint as dcp

    chunk = {key: torch.empty(tensors[key][1], dtype=tensors[key][0]) for key in keys}
    with warnings.catch_warnings():  # no_dist=True is what we mean; DCP warns about it on every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(chunk, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as error:  # a shard file missing or cut short
            names = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            raise CheckpointError(
                f"cannot read {names} from {checkpoint} (a shard file lost or cut short?): "
                f"{describe_dcp_error(error)}"
            ) from error
    return chunk


def _header(tensors: dict[str, tuple[torch.dtype, torch.Size]], keys: list[str], step: str) -> bytes:
    header: dict = {"__metadata__": {"format": "pt", "zplan_checkpoint_step": step}}
    offset = 0
    for key in keys:
        dtype, shape = tensors[key]
        end = offset + _nbytes(dtype, shape)
        header[key[len(MODEL_PREFIX):]] = {
            "dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end],
        }
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded


def export_checkpoint(
    ckpt_dir: Path, out_file: Path, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, allow_unverified: bool = False,
) -> Path:
    """Write the model weights of checkpoint `ckpt_dir` (a step-N folder, or a checkpoint folder: its
    newest complete checkpoint) to the safetensors file `out_file`; return `out_file`.

    Raises CheckpointError when `ckpt_dir` holds no complete checkpoint, or a damaged or unsafe one, or one without
    a manifest unless allow_unverified (then a warning on stderr); ExportError when `out_file` cannot be written
    (both ZplanError). Memory: about max_chunk_bytes, or the largest tensor.
    """
    checkpoint = resolve_checkpoint(ckpt_dir)
    out_file = Path(out_file)
    if out_file.is_dir():
        raise ExportError(f"--to {out_file} is a folder; give a file name such as {out_file / 'model.safetensors'}")
    unverified = not has_manifest(checkpoint)
    problems = verify(checkpoint)[1 if unverified else 0:]  # without a manifest, the first says so
    if problems:  # also without a manifest: a link, FIFO or folder among its files
        raise CheckpointError(f"checkpoint {checkpoint} is damaged: {problems[0]}"
                              + (f" ({len(problems) - 1} more)" if len(problems) > 1 else ""))
    if unverified:
        if not allow_unverified:
            raise CheckpointError(f"{no_manifest_problem(checkpoint)}: not exported. Export a verified checkpoint, "
                                  f"or give {ALLOW_UNVERIFIED_FLAG} to export it anyway (a damaged file then goes "
                                  "unnoticed)")
        print(f"zplan: warning: {no_manifest_problem(checkpoint)}: exported without verifying it "
              f"({ALLOW_UNVERIFIED_FLAG})", file=sys.stderr, flush=True)
    tensors = _model_tensors(checkpoint)
    keys = sorted(tensors)
    sizes = {key: _nbytes(*tensors[key]) for key in keys}
    step = checkpoint.name.removeprefix("step-").lstrip("0") or "0"
    fused = _fused_layouts(checkpoint)

    tmp = out_file.with_name(f".{out_file.name}.tmp")
    try:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(_header(tensors, keys, step))
            for chunk_keys in _chunks(keys, sizes, max_chunk_bytes):
                chunk = _load_chunk(checkpoint, tensors, chunk_keys)
                for key in chunk_keys:
                    tensor = chunk.pop(key)
                    if key[len(MODEL_PREFIX):] in fused:  # stored grouped: back to the model file's order
                        tensor = to_original(tensor, *fused[key[len(MODEL_PREFIX):]])
                    # Raw bytes in the host's order (little-endian on x86 and ARM), as safetensors stores them.
                    f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(out_file)
    except OSError as error:
        raise ExportError(f"cannot write {out_file}: {error.strerror or error}") from error
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # left only when the export failed
    return out_file
