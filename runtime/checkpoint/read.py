"""Reading a checkpoint as data, nothing in it run: DCP's .metadata through a restricted unpickler, the files it
names, the rank files and train_state.json.

Reading treats the checkpoint as hostile data (runtime/checkpoint/manifest.py for the manifest): a checkpoint
without MANIFEST.json is read only with allow_unverified (--allow-unverified), never chosen by `latest-valid`; every
file read on behalf of DCP's .metadata (its `relative_path` of each stored item) must be a plain file name of the
checkpoint folder and a regular file, as must the rank files and train_state.json (read up to MAX_TRAIN_STATE_BYTES);
links, FIFOs and devices are refused by kind, nothing outside the folder is opened. A resume checks that the
checkpoint holds exactly the model's tensors (the missing and unexpected names listed) and that train_state.json is
plausible (finite numbers, the step of its folder).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta

from zplan.errors import CheckpointError, short_repr
from zplan.runtime.checkpoint.folders import _STEP_DIR, LATEST_VALID
from zplan.runtime.checkpoint.manifest import plain_file, read_small_file
from zplan.safe_files import UnsafeFileError, open_regular

TRAIN_STATE_FILE = "train_state.json"
# train_state.json holds a dozen numbers and the fused layout of each fused projection (~100 bytes each: 40,000 of
# them fit), so 4 MiB is far more than a real one needs and little enough to read: a link to /dev/zero or a huge file
# put there is refused after 4 MiB.
MAX_TRAIN_STATE_BYTES = 4 << 20
_DATA_SUFFIX = ".distcp"  # DCP's data files (torch.distributed.checkpoint.filesystem.DEFAULT_SUFFIX)


# ---- reading a checkpoint as data: nothing in it runs ---------------------------------------------------

# What DCP's .metadata pickle is made of (torch 2.13): its own metadata classes, torch.Size, dtypes and layouts,
# the checkpoint's path. A pickle naming anything else was not written by DCP and is refused unread.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                   ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES or (module, name) in _METADATA_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class _RegularFiles(FileSystem):
    """DCP's file system for reading: what it opens must be a regular file, not a link (a FIFO, a device or a link is
    refused by kind, opened without blocking)."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        if mode != "rb":
            raise CheckpointError(f"zplan reads checkpoints only; DCP asked to open {path} with mode {mode!r}")
        path = plain_file(Path(path).parent, Path(path).name, "the checkpoint")  # by kind, with its message
        with os.fdopen(open_regular(path, follow=False), "rb") as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with its .metadata unpickled from DCP's own classes only (_METADATA_MODULES) and checked
    before anything it names is read: every item's file (`relative_path`) a DCP data file of the checkpoint folder
    (a plain *.distcp name, a regular file, the item within its size), no stream transforms, only the global
    .metadata (zplan never writes the per-rank ones DCP would fall back to)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _RegularFiles()

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import Metadata

        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path} has no per-rank metadata: zplan's checkpoints hold one .metadata")
        path = self._get_metadata_path()
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except UnsafeFileError as error:
            raise CheckpointError(f"{error} (checkpoint metadata): not loaded") from error
        except OSError as error:
            raise CheckpointError(f"cannot read {path} ({type(error).__name__}: {error}): the checkpoint is damaged; "
                                  f"resume from an older one (--resume {LATEST_VALID})") from error
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError, KeyError,
                RecursionError) as error:
            raise CheckpointError(f"{path} is not checkpoint metadata written by torch.distributed.checkpoint "
                                  f"({type(error).__name__}: {error}): not loaded") from error
        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            raise CheckpointError(f"{path} is not checkpoint metadata written by torch.distributed.checkpoint "
                                  f"(a {type(metadata).__name__}): not loaded")
        self._check_storage(path, metadata.storage_data)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_storage(self, path: os.PathLike, storage_data: Any) -> None:
        """CheckpointError unless every stored item lies in a DCP data file of the checkpoint folder."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        def refuse(why: str) -> CheckpointError:
            return CheckpointError(f"{path} {why}: refused, nothing read (the metadata is damaged or was crafted)")

        if not isinstance(storage_data, dict):
            raise refuse("has no storage table")
        extent: dict[str, int] = {}  # file name -> the end of its last item
        for info in storage_data.values():
            if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) \
                    or type(info.offset) is not int or type(info.length) is not int or info.offset < 0 \
                    or info.length < 0:
                raise refuse(f"stores an item as {short_repr(info)}, not as a file name, offset and length")
            if info.transform_descriptors:
                raise refuse(f"asks for stream transforms {short_repr(info.transform_descriptors)}, which zplan's "
                             "checkpoints never use")
            extent[info.relative_path] = max(extent.get(info.relative_path, 0), info.offset + info.length)
        folder = Path(self.path)
        for name, end in sorted(extent.items()):
            if not name.endswith(_DATA_SUFFIX):
                raise refuse(f"points tensors at {name!r}, not a DCP data file (*{_DATA_SUFFIX}) of {folder}")
            try:
                size = plain_file(folder, name, str(path)).stat().st_size
            except UnsafeFileError as error:
                raise CheckpointError(f"{error}: not loaded") from error
            except FileNotFoundError as error:
                raise CheckpointError(f"{folder / name}, named by {path}, is missing: the checkpoint is damaged; "
                                      f"resume from an older one (--resume {LATEST_VALID})") from error
            if end > size:
                raise CheckpointError(f"{path} stores data up to byte {end:,} of {folder / name}, which has {size:,}: "
                                      f"the checkpoint is damaged or was cut short (--resume {LATEST_VALID})")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading the entries that are not tensors as plain values (weights_only)."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_rank_state(rank_file: Path) -> dict[str, Any]:
    """A rank's RNG, loss-scaler and data-iterator state: tensors and plain values only (weights_only), from a regular
    file of the checkpoint folder."""
    try:
        with os.fdopen(open_regular(plain_file(rank_file.parent, rank_file.name, "the checkpoint"), follow=False),
                       "rb") as stream:
            return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"{rank_file} holds more than tensors and plain values, which zplan's checkpoints "
                              f"never do: not loaded ({str(error).splitlines()[0]})") from error
    except (OSError, RuntimeError, EOFError, UnsafeFileError) as error:  # missing, cut short, not a torch.save file
        raise CheckpointError(f"cannot read {rank_file} ({type(error).__name__}: {str(error)[:200]}): the "
                              f"checkpoint is damaged; resume from an older one (--resume {LATEST_VALID})") from error


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _no_constant(constant: str):
    raise ValueError(f"it holds {constant}")


def train_state_problem(state: Any, path: Path) -> str | None:
    """What makes the train_state.json `state` of checkpoint `path` implausible, or None: a step that is not a
    whole number >= 0 or not the step of its folder, a world size below 1, fields of the wrong type."""
    if not isinstance(state, dict):
        return "not a JSON object"
    step, world_size = state.get("step"), state.get("world_size")
    if type(step) is not int or step < 0 or type(world_size) is not int or world_size < 1:
        return f"no integer 'step' >= 0 and 'world_size' >= 1 (step {short_repr(step)}, world_size " \
               f"{short_repr(world_size)})"
    folder_step = _STEP_DIR.match(path.name)
    if folder_step and int(folder_step.group(1)) != step:
        return f"step {step} in the folder of step {int(folder_step.group(1))}"
    for name, kind in (("layout", dict), ("fused_layouts", dict), ("unverified_origin", str), ("loss", float),
                       ("data", dict)):
        value = state.get(name)
        if value is not None and not isinstance(value, kind) and not (kind is float and type(value) is int):
            return f"'{name}' is {short_repr(value)}, not a {kind.__name__}"
    if any(not isinstance(entry, dict) for entry in state.get("fused_layouts", {}).values()):
        return "'fused_layouts' holds entries that are not objects"
    return None


def read_train_state(path: Path) -> dict[str, Any]:
    """A checkpoint's train_state.json (a regular file of its folder, at most MAX_TRAIN_STATE_BYTES), checked for
    what a resume reads: finite numbers only (no NaN or Infinity), a plausible step and world size
    (train_state_problem)."""
    file = path / TRAIN_STATE_FILE
    try:
        state = json.loads(read_small_file(path, TRAIN_STATE_FILE, MAX_TRAIN_STATE_BYTES, "the train state"),
                           parse_float=_finite_float, parse_constant=_no_constant)
        problem = train_state_problem(state, path)
        if problem:
            raise ValueError(problem)
    except (OSError, ValueError, UnsafeFileError, RecursionError) as error:
        raise CheckpointError(f"cannot read {file} ({error}): the checkpoint is damaged; resume from an older one "
                              f"(--resume {LATEST_VALID})") from error
    return state
