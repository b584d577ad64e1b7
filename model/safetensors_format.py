"""The safetensors format (its specification), written and read without the safetensors package: `zplan export`,
train.py --save-weights and the inference engine use it.

    8 bytes   N, the header's length (little-endian u64)
    N bytes   JSON header: {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
              padded with spaces to a multiple of 8 (the data starts 8-byte aligned)
    ...       the tensors' bytes, little-endian, back to back in header order; offsets count from the data's start

    header = encode_header([(name, dtype, shape), ...], {"format": "pt"})   # then append tensor_bytes(t) in order
    write_safetensors(path, {name: tensor})                                # the whole file at once
    read_safetensors(path)                                                 # {name: tensor}, checked
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch

from zplan.errors import ModelLoadError

# torch dtype -> safetensors dtype name
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
# What transformers' loader requires in __metadata__ (it refuses a file without a known "format").
PT_METADATA = {"format": "pt"}
MAX_HEADER_BYTES = 100 << 20  # the specification's own limit on N (100 MB)


def nbytes(dtype: torch.dtype, shape) -> int:
    """Bytes of a tensor of `dtype` and `shape` (a sequence of ints)."""
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def encode_header(entries: list[tuple[str, torch.dtype, torch.Size]], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and the padded JSON header of a file holding `entries` (name, dtype, shape) in this
    order; the tensors' bytes are to follow in the same order. KeyError names a dtype safetensors lacks."""
    header: dict = {"__metadata__": dict(metadata or PT_METADATA)}
    offset = 0
    for name, dtype, shape in entries:
        end = offset + nbytes(dtype, shape)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, little-endian, as safetensors stores them."""
    flat = tensor.detach().contiguous().reshape(-1)
    if sys.byteorder != "little" and flat.element_size() > 1:  # x86 and ARM are little-endian already
        flat = flat.view(torch.uint8).reshape(-1, flat.element_size()).flip(1).contiguous()
    return flat.view(torch.uint8).numpy().data


def write_safetensors(path: str | Path, state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """`state` (CPU tensors) as one safetensors file at `path` (not atomic: callers write a temporary name).
    A tied weight is written under each of its names."""
    names = list(state)
    with open(path, "wb") as stream:
        stream.write(encode_header([(n, state[n].dtype, state[n].shape) for n in names], metadata))
        for name in names:
            stream.write(tensor_bytes(state[name]))


def _entries(path: Path, header: object, body_bytes: int) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """{name: (dtype, shape, begin, end)} of a parsed header, each checked against the data's length."""
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path} is not a safetensors file: its header is not a JSON object")
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = TORCH_DTYPES[entry["dtype"]]
            shape = [int(n) for n in entry["shape"]]
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: the header entry of tensor {name!r} cannot be read (dtype "
                                 f"{entry.get('dtype') if isinstance(entry, dict) else entry!r}: zplan reads "
                                 f"{', '.join(TORCH_DTYPES)}); is the file damaged?") from exc
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= body_bytes or end - begin != nbytes(dtype, shape):
            raise ModelLoadError(f"{path}: tensor {name!r} ({entry['dtype']} {shape}) does not fit its data offsets "
                                 f"[{begin}, {end}) in {body_bytes} bytes of data: the file is cut short or damaged")
        entries[name] = (dtype, shape, begin, end)
    return entries


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """{name: CPU tensor} of a safetensors file; ModelLoadError naming the file when it is not one, or damaged."""
    path = Path(path)
    try:
        data = bytearray(path.read_bytes())  # writable: the tensors below are views of it
    except OSError as exc:
        raise ModelLoadError(f"cannot read the weights file {path}: {exc.strerror or exc}") from exc
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        if header_len > min(MAX_HEADER_BYTES, len(data) - 8):
            raise ValueError(f"a header of {header_len:,} bytes in a file of {len(data):,}")
        header = json.loads(data[8:8 + header_len])
    except (struct.error, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a safetensors file (its header cannot be read): {exc}") from exc
    body = memoryview(data)[8 + header_len:]
    state = {}
    for name, (dtype, shape, begin, end) in _entries(path, header, len(body)).items():
        flat = torch.frombuffer(body[begin:end], dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
        if sys.byteorder != "little" and flat.element_size() > 1:
            flat = flat.view(torch.uint8).reshape(-1, flat.element_size()).flip(1).contiguous().view(dtype)
        state[name] = flat.reshape(shape)
    return state
