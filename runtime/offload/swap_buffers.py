"""Aligned host buffers and positional file I/O for the NVMe swap engine (nvme.py): O_DIRECT needs 4096-byte
aligned addresses, offsets and lengths.

Why a thread pool and not Linux AIO. Measured on this repository's development machine (2 cores, ext4
on a virtual disk, shared with other work, load average 2.4-2.5): 1 GiB in 16 MiB O_DIRECT requests,
4 in flight, three rounds each, alternating: the thread pool wrote 0.40-0.68 GB/s and read 1.39-2.39 GB/s,
python-libaio 0.9.5 (a ctypes binding of libaio) 0.65-0.70 and 1.03-2.35 GB/s: the same within this
machine's noise, because both keep the device's queue full and the GIL is released during each request.
libaio would add a system library (libaio1) and a PyPI package for no measured gain, and kernel AIO is
only asynchronous with O_DIRECT (it blocks on buffered files, this engine's fallback); the Python
bindings of io_uring are young. `benchmarks/nvme_swap.py` measures the engine against raw sequential
I/O on the same path.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import torch

ALIGN_BYTES = 4096  # O_DIRECT alignment of addresses, offsets and lengths (logical block size <= 4096)


def round_up(n: int, multiple: int = ALIGN_BYTES) -> int:
    return -(-n // multiple) * multiple



def aligned_empty(nbytes: int, alignment: int = ALIGN_BYTES) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` whose first byte sits at an `alignment` boundary and whose
    storage extends to the next boundary after its end (so O_DIRECT can move whole blocks in place)."""
    padded = round_up(max(nbytes, 0), alignment)
    raw = torch.empty(padded + alignment, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % alignment
    return raw[offset : offset + nbytes]


def aligned_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised, contiguous CPU tensor of `shape` and `dtype` in an aligned buffer (`aligned_empty`)."""
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return aligned_empty(nbytes).view(dtype).view(shape)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable memoryview of contiguous uint8 CPU tensor `t`'s bytes (the tensor must outlive it). Not
    t.numpy(): that makes the storage non-resizable for good, and runtime.offload.param_swap frees parameter
    storages (resize to 0) and brings them back."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B")


def _byte_view(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """uint8 view of `nbytes` bytes of contiguous `t`'s storage, starting at its first element."""
    start = t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), start, (nbytes,))


def _in_place_ok(t: torch.Tensor, nbytes: int) -> bool:
    """Can O_DIRECT move `t`'s bytes without a bounce buffer: aligned start, storage up to the next boundary."""
    start = t.storage_offset() * t.element_size()
    return t.data_ptr() % ALIGN_BYTES == 0 and t.untyped_storage().nbytes() - start >= round_up(nbytes)



def _probe_o_direct(path: Path) -> None:
    """Write one aligned block with O_DIRECT (raises OSError EINVAL where the file system refuses it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        block = aligned_empty(ALIGN_BYTES)
        block.zero_()
        os.pwrite(fd, block.numpy(), 0)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _pread_all(fd: int, data, offset: int, need: int) -> None:
    """Read into `data` from `offset` until at least `need` bytes arrived (the rest may lie past the end of file,
    as the padding of the last O_DIRECT block does); EOFError when the file ends before."""
    view = memoryview(data).cast("B")
    done = 0
    while done < need:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"end of file at {offset + done}")
        done += n
