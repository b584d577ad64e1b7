"""fp8 W8A8 Linears for the inference engine (weight precision "fp8").

    qweight, scale = quantize_weight(w)             # (out, in) -> float8_e4m3fn (out, in), fp32 (out,)
    y = fp8_linear(x, qweight, scale, bias)          # x (..., in) in the compute dtype -> (..., out), same dtype

Weights: e4m3 (4 exponent bits, 3 mantissa bits, largest finite 448) with one fp32 scale per output channel,
scale = amax(|w_row|) / 448, so every row uses e4m3's whole range; quantized once when the engine is built.
Activations: cast to e4m3 per token (dynamic, one scale per row of x: amax(|x_row|) / 448) at every block Linear.
The GEMM: torch._scaled_mm(x8, w8^T, scale_a (M, 1), scale_b (1, N)) -- fp8 tensor cores, fp32 accumulation,
out = scale_a * (x8 @ w8^T) * scale_b -- in one of three ways, chosen once per (device, dtype) by running each on
a small problem against the reference (kernel_for):
  "rowwise"     _scaled_mm with the row-wise scales and out_dtype the compute dtype (CUDA capability 9.0 with
                bf16 out; torch's CPU kernel with any float out);
  "tensorwise"  _scaled_mm with unit scales and fp32 out, the two scale vectors applied after (capability 8.9, or
                fp16 out): the same numbers up to fp32 rounding;
  "reference"   NOT fp8 tensor cores: both operands dequantized to fp32 and multiplied with torch.matmul -- the
                same quantization error, for a device whose torch has no _scaled_mm.
A CUDA device below capability 8.9 (no fp8 tensor cores: A100, V100) is refused at engine build (check_device),
as are Linear widths that are not multiples of 16 there (_scaled_mm's requirement on CUDA).

Rounding: e4m3 keeps 3 mantissa bits, so a value of normal range is stored with a relative error of at most
2^-4 (half a unit in the last place at the bottom of a binade); an entry far below its row's amax falls into
e4m3's subnormals (below 2^-6 * scale) and keeps fewer bits. The rounding error of one operand is then about
uniform in +-ulp/2, an rms of ulp / sqrt(12): 2^-3 / sqrt(12) = 0.036 relative at the bottom of a binade, about
0.026 over values spread through it; a dot product of both operands' errors, independent, has a relative error of
sqrt(2) times that, 0.037 (0.051 at worst) -- the bound tests/unit/test_inference_fp8.py measures against.
"""

from __future__ import annotations

from functools import cache

import torch

from zplan.errors import ZplanError
from zplan.runtime.precision.float8 import FP8_MIN_CAPABILITY
from zplan.schemas.capability import FP8_DIM_MULTIPLE

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row keeps a positive scale (its fp8 values are 0)
KERNELS = ("rowwise", "tensorwise", "reference")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (e4m3 (M, K), fp32 scales (M, 1)) with x ~ q * scale, scale = amax(|row|) / 448."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear weight (out, in) -> (e4m3 (out, in), fp32 per-output-channel scales (out,))."""
    q, scale = quantize_rows(w.detach())
    return q.contiguous(), scale.reshape(-1).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 (R, C) and scales (R,) or (R, 1) -> fp32 (R, C)."""
    return q.float() * scale.reshape(-1, 1)


def _matmul(kernel: str, xq, sx, wq, sw, out_dtype: torch.dtype) -> torch.Tensor:
    """(M, K) e4m3 x (N, K) e4m3 with row scales sx (M, 1), sw (N,) -> (M, N) in out_dtype."""
    if kernel == "rowwise":
        return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.reshape(1, -1), out_dtype=out_dtype)
    if kernel == "tensorwise":
        one = torch.ones((), dtype=torch.float32, device=xq.device)
        y = torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (y * sx * sw.reshape(1, -1)).to(out_dtype)
    # reference: not fp8 tensor cores -- both dequantized, fp32 matmul
    return torch.matmul(dequantize(xq, sx), dequantize(wq, sw).t()).to(out_dtype)


@cache
def kernel_for(device: torch.device, dtype: torch.dtype) -> str:
    """The first of KERNELS that runs on `device` with `dtype` output and matches the reference on a small
    problem (16 x 32 x 16, within the fp32 rounding of the scales)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=gen).to(device)
    w = torch.randn(16, 32, generator=gen).to(device)
    xq, sx = quantize_rows(x)
    wq, sw = quantize_weight(w)
    want = _matmul("reference", xq, sx, wq, sw, torch.float32)
    for kernel in KERNELS[:-1]:
        try:
            got = _matmul(kernel, xq, sx, wq, sw, dtype).float()
        except (RuntimeError, NotImplementedError):
            continue
        if torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
            return kernel
    return "reference"


def check_device(device: torch.device) -> str:
    """Refuse a CUDA device without fp8 tensor cores (capability < 8.9); the kernel fp8_linear will use."""
    device = torch.device(device)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ZplanError(
                f"weight precision fp8 needs fp8 tensor cores (CUDA capability 8.9 or newer: L40S, H100, H200, B200); "
                f"{name} has {capability[0]}.{capability[1]}. Recompile for a cluster with fp8 (zplan refuses "
                "--precision fp8 where the profile has no fp8 peak) or use --precision int8.")
    return kernel_for(_canonical(device), torch.float32)


def check_shape(name: str, out_features: int, in_features: int, device: torch.device) -> None:
    """_scaled_mm on CUDA needs both widths of the weight to be multiples of FP8_DIM_MULTIPLE."""
    if torch.device(device).type == "cuda" and (out_features % FP8_DIM_MULTIPLE or in_features % FP8_DIM_MULTIPLE):
        raise ZplanError(f"{name} is {out_features} x {in_features} on this tensor-parallel rank: fp8 GEMMs on CUDA "
                         "need both widths to be multiples of 16; use --precision int8 or bf16 for this model.")


def _canonical(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x (..., in) -> (..., out) in x's dtype: x cast to e4m3 per token, times the e4m3 weight (out, in) with its
    per-output-channel scales (module docstring), plus bias."""
    lead, width = x.shape[:-1], x.shape[-1]
    xq, sx = quantize_rows(x.reshape(-1, width))
    y = _matmul(kernel_for(_canonical(x.device), x.dtype), xq, sx, qweight, scale, x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.view(*lead, -1)
