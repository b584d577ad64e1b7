"""`zplan export CKPT --to model.safetensors`: one consolidated weights file from a sharded checkpoint; the checkpoint
reading and shard writing that `--hf` (zplan/export_hf.py) shares.

The checkpoint (runtime/checkpoint/save.py) holds each rank's shards in DCP's format; its .metadata names
every tensor with its full shape and dtype, so a safetensors file's header (model/safetensors_format.py) is
written first and the tensors are then read from the shards a chunk at a time (at most `max_chunk_bytes` of
tensors per DCP read, a bigger tensor alone) and appended: the process holds one chunk, never the whole model.
The file is written under a temporary name and renamed when complete. Only the model's tensors are exported
(keys `model.<fqn>`), named as the model file names them, tied weights under each of their names, as
`model.state_dict()` has them.

The checkpoint is read as hostile data (runtime/checkpoint/save.py, runtime/checkpoint/manifest.py): its files are first
checked against MANIFEST.json, which must cover exactly the folder's regular files; one without a manifest is
exported only with allow_unverified (`--allow-unverified`, a warning on stderr); DCP reads only the *.distcp files
of the folder its .metadata names, and train_state.json is read up to its cap, a link, FIFO or device refused.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from zplan.errors import ExportError
from zplan.model.fused_layout import layouts_from_json, to_original
from zplan.model.safetensors_format import PT_METADATA, SAFETENSORS_DTYPES, encode_header, nbytes, tensor_bytes
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
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype


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


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint opened for export: its folder, its model tensors and how they are stored."""

    folder: Path  # the step-N folder
    tensors: dict[str, tuple[torch.dtype, torch.Size]]  # model tensor name (no 'model.' prefix) -> dtype, full shape
    fused: dict  # model.fused_layout's stored orders, by tensor name
    step: str  # optimizer steps done, as text (safetensors metadata is str -> str)


def open_checkpoint(ckpt_dir: Path, *, allow_unverified: bool = False) -> Checkpoint:
    """The checkpoint `ckpt_dir` (a step-N folder, or a checkpoint folder: its newest complete checkpoint), its files
    checked against its MANIFEST.json. CheckpointError when it holds no complete checkpoint, or a damaged or unsafe
    one, or one without a manifest unless allow_unverified (then a warning on stderr)."""
    checkpoint = resolve_checkpoint(ckpt_dir)
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
    tensors = {key[len(MODEL_PREFIX):]: entry for key, entry in _model_tensors(checkpoint).items()}
    step = checkpoint.name.removeprefix("step-").lstrip("0") or "0"
    return Checkpoint(checkpoint, tensors, _fused_layouts(checkpoint), step)


def stream_tensors(ckpt: Checkpoint, names: list[str], *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                   dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full CPU tensor) of `names` in order, read a chunk of at most max_chunk_bytes at a time (a bigger
    tensor alone), fused projections back in the model file's order; floating-point tensors cast to `dtype` when
    given (integer and bool buffers keep theirs)."""
    sizes = {name: nbytes(*ckpt.tensors[name]) for name in names}
    keys = {name: MODEL_PREFIX + name for name in names}
    full = {MODEL_PREFIX + name: entry for name, entry in ckpt.tensors.items()}
    for chunk_names in _chunks(names, sizes, max_chunk_bytes):
        chunk = _load_chunk(ckpt.folder, full, [keys[name] for name in chunk_names])
        for name in chunk_names:
            tensor = chunk.pop(keys[name])
            if name in ckpt.fused:  # stored grouped: back to the model file's order
                tensor = to_original(tensor, *ckpt.fused[name])
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            yield name, tensor


def shard_header(ckpt: Checkpoint, names: list[str], dtype: torch.dtype | None = None,
                 file_names: list[str] | None = None) -> bytes:
    """The safetensors header of a file holding the checkpoint's `names` in order (cast as stream_tensors casts
    them), each under its `file_names` entry (default: its own name)."""
    def stored(entry):
        return dtype if dtype is not None and entry[0].is_floating_point else entry[0]

    return encode_header([(file_name, stored(ckpt.tensors[name]), ckpt.tensors[name][1])
                          for name, file_name in zip(names, file_names or names, strict=True)],
                         {**PT_METADATA, "zplan_checkpoint_step": ckpt.step})


def write_shard(path: Path, ckpt: Checkpoint, names: list[str], *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                dtype: torch.dtype | None = None, file_names: list[str] | None = None) -> None:
    """The safetensors file `path` holding the checkpoint's tensors `names` (under `file_names`, default their own):
    the header, then the tensors streamed a chunk at a time. Not atomic (callers write under a temporary name)."""
    with open(path, "wb") as f:
        f.write(shard_header(ckpt, names, dtype, file_names))
        for _, tensor in stream_tensors(ckpt, names, max_chunk_bytes=max_chunk_bytes, dtype=dtype):
            f.write(tensor_bytes(tensor))
        f.flush()
        os.fsync(f.fileno())


def export_checkpoint(
    ckpt_dir: Path, out_file: Path, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, allow_unverified: bool = False,
    dtype: str | None = None,
) -> Path:
    """Write the model weights of checkpoint `ckpt_dir` (a step-N folder, or a checkpoint folder: its
    newest complete checkpoint) to the safetensors file `out_file`; return `out_file`.

    Raises CheckpointError when `ckpt_dir` holds no complete checkpoint, or a damaged or unsafe one, or one without
    a manifest unless allow_unverified (then a warning on stderr); ExportError when `out_file` cannot be written
    (both ZplanError). dtype: fp32 | bf16 | fp16 for the floating-point tensors (None: as stored). Memory: about
    max_chunk_bytes, or the largest tensor.
    """
    out_file = Path(out_file)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    if out_file.is_dir():
        raise ExportError(f"--to {out_file} is a folder; give a file name such as {out_file / 'model.safetensors'}, "
                          "or --hf to write a Hugging Face folder")
    ckpt = open_checkpoint(ckpt_dir, allow_unverified=allow_unverified)
    tmp = out_file.with_name(f".{out_file.name}.tmp")
    try:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        write_shard(tmp, ckpt, sorted(ckpt.tensors), max_chunk_bytes=max_chunk_bytes,
                    dtype=DTYPES[dtype] if dtype else None)
        tmp.replace(out_file)
    except OSError as error:
        raise ExportError(f"cannot write {out_file}: {error.strerror or error}") from error
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # left only when the export failed
    return out_file
