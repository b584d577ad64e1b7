"""Mixed precision of ZeRO 0/1 models: the compute dtype of a plan's precision, parameters cast to it, or fp32
parameters with the forward under torch.autocast (1-bit Adam). ZeRO 2/3 use FSDP2's MixedPrecisionPolicy instead
(runtime.parallel.data_parallel)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zplan.schemas.spec import Precision
from zplan.schemas.spec import compute_dtype as compute_dtype_name

# the dtype of parameters' compute copies and activations by plan precision; fp8 is bf16's (its fp8 GEMMs are the
# blocks' Float8Linears: runtime.precision.float8)
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_torch_dtype(precision: Precision) -> torch.dtype | None:
    """torch dtype of the mixed-precision compute for `precision` (None: fp32, no mixed precision)."""
    return _COMPUTE_DTYPES.get(compute_dtype_name(precision))


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The floating-point parameters (not the buffers: rotary tables stay as the model made them) in `dtype`, in
    place (the same Parameter objects, so tied ones stay tied; a DTensor's through torch.utils.swap_tensors, a plain
    one's data replaced, which a fake tensor's weak references allow: the dry run), as FSDP2's MixedPrecisionPolicy
    computes: every op in the parameters' dtype, no autocast."""
    for p in dict.fromkeys(model.parameters()):
        if p.is_floating_point() and p.dtype != dtype:
            if isinstance(p, DTensor):
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))
            else:
                p.data = p.detach().to(dtype)
    return model


def forward_under_autocast(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    original_forward = model.forward

    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return original_forward(*args, **kwargs)

    model.forward = forward
