"""Token files: a flat binary of token ids (uint16 or uint32, little-endian, as nanoGPT's train.bin and Megatron's
.bin) with a JSON sidecar `<file>.json` saying how to read it; read memory-mapped (numpy.memmap), never whole.

    tokens.bin        token ids, back to back, each document followed by the separator token
    tokens.bin.json   {"format": "zplan-tokens", "version": 1, "dtype": "uint16", "vocab_size": 50257,
                       "separator": 50256, "tokenizer": "gpt2", "num_tokens": 9035582, "documents": 8013}

A token file is checked before it is used: its size a whole number of ids, the size its sidecar says, every id below
the vocabulary (a scan in chunks: ~1 GB/s, once per run).

A memory map's pages count in the process's resident set (VmRSS, VmHWM) once read, as long as the kernel leaves them
mapped: the scan and the batches (batches.py) hand back the pages they have read (release_pages: madvise
MADV_DONTNEED) every chunk / every RELEASE_BYTES read, so streaming a file of any size keeps ~RELEASE_BYTES of it
resident. The pages are clean copies of the file: the next read maps them again from the page cache, same ids.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zplan.runtime.data.errors import DataError
from zplan.safe_files import UnreadableFileError, read_json_capped

SIDECAR_FORMAT = "zplan-tokens"
SIDECAR_VERSION = 1
SIDECAR_SUFFIX = ".json"
MAX_SIDECAR_BYTES = 1 << 20  # a sidecar is ~200 bytes; refuse more than this unread
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SCAN_TOKENS = 1 << 24  # ids per chunk of the vocabulary scan (32-64 MiB)
RELEASE_BYTES = 96 << 20  # bytes of a memory map mapped (an upper bound) between two releases of its pages
# a read maps the whole page-cache folio it falls in: up to a PMD (2 MiB on x86-64; measured on Linux 6.18 / ext4,
# one random id read maps 2 MiB), not one 4 KiB page
MAP_AROUND_BYTES = 2 << 20


def sidecar_path(path: str | Path) -> Path:
    """`tokens.bin` -> `tokens.bin.json`."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def dtype_for(vocab_size: int) -> str:
    """The narrowest dtype that holds ids below `vocab_size`."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class TokenFile:
    """An opened token file: its ids memory-mapped, what its sidecar says, and what identifies it."""

    path: Path
    tokens: np.ndarray  # np.memmap, (num_tokens,) of `dtype`
    dtype: str
    vocab_size: int
    separator: int | None
    tokenizer: str | None
    size_bytes: int
    sidecar_sha256: str  # of the sidecar's bytes: with size_bytes, the identity of the data


def sidecar_text(*, dtype: str, vocab_size: int, separator: int | None, tokenizer: str | None, num_tokens: int,
                 documents: int | None) -> str:
    """The sidecar's JSON text (keys in a fixed order: the same inputs write the same bytes)."""
    return json.dumps({"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "dtype": dtype, "vocab_size": vocab_size,
                       "separator": separator, "tokenizer": tokenizer, "num_tokens": num_tokens,
                       "documents": documents}, indent=2) + "\n"


def _example_sidecar(path: Path) -> str:
    return (f'{{"dtype": "uint16", "vocab_size": V, "num_tokens": {path.stat().st_size // 2}, "separator": null}} '
            "(num_tokens for uint16 ids)")


def _read_sidecar(path: Path) -> tuple[dict, str]:
    """(the sidecar of token file `path`, checked field by field; its SHA-256)."""
    side = sidecar_path(path)
    if not side.exists():
        raise DataError(f"token file {path} has no sidecar {side}: write it with `zplan data prepare`, or by hand as "
                        f"{_example_sidecar(path)}")
    try:
        meta, raw = read_json_capped(side, MAX_SIDECAR_BYTES, "token sidecar")
    except UnreadableFileError as error:
        raise DataError(f"cannot read the sidecar {side} of {path} ({error}): write it again with `zplan data "
                        "prepare`") from error
    if not isinstance(meta, dict):
        raise DataError(f"sidecar {side} is not a JSON object: write it again with `zplan data prepare`")

    def field(name: str, kinds: tuple[type, ...], required: bool = True):
        value = meta.get(name)
        if value is None and not required:
            return None
        if type(value) not in kinds or (int in kinds and type(value) is int and value < 0):
            raise DataError(f"sidecar {side}: '{name}' is {value!r}, not a "
                            f"{'whole number >= 0' if int in kinds else 'string'}: fix it, or write it again with "
                            "`zplan data prepare`")
        return value

    if meta.get("dtype") not in DTYPES:
        raise DataError(f"sidecar {side}: 'dtype' is {meta.get('dtype')!r}; token files hold uint16 or uint32 ids")
    field("vocab_size", (int,)), field("num_tokens", (int,))
    field("separator", (int,), required=False), field("tokenizer", (str,), required=False)
    return meta, hashlib.sha256(raw).hexdigest()


def open_token_file(path: str | Path) -> TokenFile:
    """The token file `path` memory-mapped, its size checked against its dtype and its sidecar (DataError)."""
    path = Path(path)
    meta, digest = _read_sidecar(path)
    dtype = DTYPES[meta["dtype"]]
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"token file {path} has {size:,} bytes, not a whole number of {meta['dtype']} ids "
                        f"({dtype.itemsize} bytes each): it was cut short; write it again with `zplan data prepare`")
    if size // dtype.itemsize != meta["num_tokens"]:
        raise DataError(f"token file {path} holds {size // dtype.itemsize:,} {meta['dtype']} ids, its sidecar "
                        f"{sidecar_path(path)} says {meta['num_tokens']:,}: the two do not belong together; write "
                        "both again with `zplan data prepare`")
    if size == 0:
        raise DataError(f"token file {path} is empty: prepare it from your text with `zplan data prepare`")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return TokenFile(path, tokens, meta["dtype"], meta["vocab_size"], meta.get("separator"), meta.get("tokenizer"),
                     size, digest)


def is_mapped(tokens: np.ndarray) -> bool:
    """Whether `tokens` is (a view of) a memory map whose pages release_pages can hand back."""
    mapping = getattr(tokens, "_mmap", None)  # np.memmap keeps its mmap.mmap there (views share it)
    return isinstance(mapping, mmap.mmap) and not mapping.closed and hasattr(mapping, "madvise") \
        and hasattr(mmap, "MADV_DONTNEED") and tokens.ndim == 1 and tokens.flags.c_contiguous


def release_pages(tokens: np.ndarray, start: int = 0, stop: int | None = None) -> None:
    """Drop ids [start, stop) of the memory map `tokens` (whole pages around them) from this process's resident set
    (madvise MADV_DONTNEED); nothing for ids in memory. Read again, they are mapped again from the page cache."""
    if not is_mapped(tokens) or len(tokens) == 0:
        return
    mapping: mmap.mmap = tokens._mmap
    stop = len(tokens) if stop is None else min(stop, len(tokens))
    if stop <= start:
        return
    first = np.frombuffer(mapping, dtype=np.uint8, count=1)  # the mapping's start address (a view, no copy)
    base = first.__array_interface__["data"][0]
    del first  # the view pins the mmap (it could not be closed) until dropped
    begin = tokens.__array_interface__["data"][0] - base + start * tokens.itemsize  # bytes into the mapping
    end = begin + (stop - start) * tokens.itemsize
    page_start = begin - begin % mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, page_start, min(end, len(mapping)) - page_start)


def check_ids_below(tokens: np.ndarray, vocab: int, what: str) -> None:
    """DataError unless every id of `tokens` is below `vocab` (scanned in chunks, never read whole; a memory map's
    pages handed back after each chunk)."""
    for start in range(0, len(tokens), SCAN_TOKENS):
        chunk = tokens[start:start + SCAN_TOKENS]
        top = int(chunk.max())
        release_pages(tokens, start, start + SCAN_TOKENS)
        if top >= vocab:
            where = start + int(np.argmax(chunk >= vocab))
            raise DataError(f"{what} holds token id {top} (first too large at token {where:,}), but the model's "
                            f"vocabulary has {vocab} ids (0 to {vocab - 1}): tokenize with the model's tokenizer, or "
                            "compile for a model with a larger vocabulary")


def write_token_file(path: str | Path, chunks, *, dtype: str, vocab_size: int, separator: int | None,
                     tokenizer: str | None, documents: int | Callable[[], int] | None) -> int:
    """Write the ids of `chunks` (arrays, in order) to `path` and its sidecar, each under a temporary name renamed
    into place (the sidecar last; an error removes both temporaries); the number of ids written. `documents` may be
    a function, called once the chunks are written."""
    path = Path(path)
    tmp, side_tmp = path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.json.tmp")
    count = 0
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                array = np.asarray(chunk, dtype=DTYPES[dtype])
                out.write(array.tobytes())
                count += len(array)
            out.flush()
            os.fsync(out.fileno())
        side_tmp.write_text(sidecar_text(dtype=dtype, vocab_size=vocab_size, separator=separator, tokenizer=tokenizer,
                                         num_tokens=count, documents=documents() if callable(documents) else documents))
        os.replace(tmp, path)
        os.replace(side_tmp, sidecar_path(path))
    finally:
        tmp.unlink(missing_ok=True)
        side_tmp.unlink(missing_ok=True)
    return count
