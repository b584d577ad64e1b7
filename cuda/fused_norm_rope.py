"""RMSNorm and rotary position embedding (RoPE) for the inference engine: pure-torch references and one-pass CUDA
kernels (fused_norm_rope.cu, built just in time only where torch.cuda.is_available()).

    y = rms_norm(x, weight, eps)        # x (..., h), weight (h,) or None -> (..., h) in x.dtype
    q = apply_rotary(q, cos, sin)       # q (B, H, T, d), cos/sin broadcastable to it, e.g. (T, d) or (B, 1, T, d)

rms_norm: y = x * rsqrt(mean(x^2, -1) + eps) * weight (Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization", eq. 4), computed in fp32 and cast to x.dtype once; torch.nn.RMSNorm gives the same up to float
rounding (it casts to x.dtype before multiplying by the weight).

apply_rotary: the rotate-half form of RoPE (Su et al. 2021, as in GPT-NeoX / Llama and examples/llama.py):
    out = x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin
in torch's type promotion of x, cos and sin. The kernel computes each element in fp32 and rounds once, so for bf16 /
fp16 it may differ from the reference (which rounds each product) by one unit in the last place.

CUDA tensors go to the kernels when the build is available and the inputs are ones they handle (floating x;
for RoPE, cos and sin of x's dtype with a last dimension d; no autograd to record); everything else runs the
reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zplan.cuda.jit import JitExtension, needs_autograd

CUDA_SOURCE = Path(__file__).with_name("fused_norm_rope.cu")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

_CUDA = JitExtension(CUDA_SOURCE, cuda=True, cuda_cflags=("-O3",))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight, in fp32, cast to x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., h)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate half the head dimensions: x (B, H, T, d), cos/sin broadcastable to x (examples/llama.py)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, H, T, d)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; the fused kernel on CUDA tensors, else the reference."""
    if x.is_cuda and x.dtype in _FLOATS and x.numel() > 0 and (weight is None or weight.numel() == x.shape[-1]) \
            and not needs_autograd(x, weight) and load_cuda() is not None:
        return rms_norm_cuda(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half; the fused kernel on CUDA tensors it handles, else the reference."""
    if _kernel_handles_rotary(x, cos, sin) and not needs_autograd(x, cos, sin) and load_cuda() is not None:
        return apply_rotary_cuda(x, cos, sin)
    return apply_rotary_reference(x, cos, sin)


def _kernel_handles_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if not (x.is_cuda and x.dim() == 4 and x.dtype in _FLOATS and x.numel() > 0 and x.shape[-1] % 2 == 0):
        return False
    if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.device != x.device or sin.device != x.device:
        return False
    if cos.dim() > 4 or sin.dim() > 4 or cos.shape[-1] != x.shape[-1] or sin.shape[-1] != x.shape[-1]:
        return False
    try:
        return torch.broadcast_shapes(x.shape, cos.shape, sin.shape) == x.shape
    except RuntimeError:
        return False


# --- CUDA kernels (fused_norm_rope.cu) ------------------------------------------------------------------------


def load_cuda(strict: bool = False):
    """The fused_norm_rope.cu extension, built just in time where CUDA is available; None otherwise or when the
    build failed (after a one-line warning). strict=True raises instead of returning None."""
    return _CUDA.load(strict)


def rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The RMSNorm kernel (x a floating CUDA tensor); one block a row."""
    h = x.shape[-1]
    w = torch.empty(0, device=x.device) if weight is None else weight.float().contiguous()
    y = load_cuda(strict=True).rms_norm(x.contiguous().view(-1, h), w, float(eps))  # (rows, h)
    return y.view(x.shape)


def apply_rotary_cuda(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The RoPE kernel: x (B, H, T, d) CUDA; cos/sin of x's dtype, broadcastable to x, last dimension d."""
    if not _kernel_handles_rotary(x, cos, sin):
        raise ValueError("apply_rotary_cuda: x must be a 4-D floating CUDA tensor with even d, and cos/sin of its "
                         f"dtype broadcastable to it; got x {tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)} "
                         f"{cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}")
    # expand() gives the broadcast dimensions stride 0; the kernel reads cos/sin through these strides
    cos4 = cos.expand(x.shape)
    sin4 = sin.expand(x.shape)
    if cos4.stride(-1) != 1:
        cos4 = cos4.contiguous()
    if sin4.stride(-1) != 1:
        sin4 = sin4.contiguous()
    return load_cuda(strict=True).apply_rotary(x.contiguous(), cos4, sin4)
