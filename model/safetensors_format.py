"""The safetensors format (its specification): the dtype names of its header. zplan writes it (zplan export) and
the inference engine reads it."""

from __future__ import annotations

import torch

# torch dtype -> safetensors dtype name
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
