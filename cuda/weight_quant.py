"""Group-wise weight quantization, INT8 and packed INT4, symmetric and asymmetric: the pure-torch reference
and the CUDA kernels of weight_quant.cu, which must match it bit for bit.

    from zplan.cuda import weight_quant
    qw = weight_quant.quantize_groupwise(linear.weight, bits=4, group_size=64, symmetric=True)
    w_hat = weight_quant.dequantize_groupwise(qw)  # fp32 (rows, cols)

Groups of `group_size` consecutive input columns of one output row share a scale (GPTQ/AWQ-style group-wise
weight-only quantization; ZeroQuant, Yao et al. 2022, calls it group-wise). For a group x (fp32):

- symmetric: qmax = 2^(bits-1) - 1 (127, 7); scale = max|x| / qmax; q = clamp(round(x / scale), -qmax, qmax);
  x_hat = q * scale.
- asymmetric: qmax = 2^bits - 1 (255, 15); lo = min(min x, 0), hi = max(max x, 0) (the range always holds 0,
  as torch.ao's MinMaxObserver does, so the zero point is in [0, qmax]); scale = (hi - lo) / qmax;
  zero = clamp(round(-lo / scale), 0, qmax); q = clamp(round(x / scale) + zero, 0, qmax);
  x_hat = (q - zero) * scale.

round is round-half-to-even (torch.round, CUDA rintf); a scale of 0 (an all-zero group) becomes 1, so the group
quantizes to q = 0 (asymmetric: zero = 0) and dequantizes to zeros, never NaN. Every step is one IEEE fp32
operation (division, subtraction, addition or multiplication by an integer-valued float) with no fused
multiply-add, which is why the kernels can match the reference bit for bit. Inputs must be finite (NaN and inf
are not handled). |x - x_hat| <= scale / 2 for every element, up to the fp32 rounding of x / scale.

Storage (QuantizedWeight):
- qweight: 8 bits symmetric int8 (rows, cols), q; 8 bits asymmetric uint8 (rows, cols), q;
  4 bits uint8 (rows, cols / 2), two nibbles a byte: column 2j in the low nibble, column 2j + 1 in the high
  nibble of byte j; a symmetric nibble holds q + 8 (in [1, 15]), an asymmetric one holds q.
- scales: fp32 (rows, cols / group_size); zeros: uint8 (rows, cols / group_size), asymmetric only, else None.
cols must be a multiple of group_size (no padding), and group_size even for 4 bits so no byte spans two groups.

fake_quantize is quantize-then-dequantize with a straight-through estimator (the gradient passes unchanged)
for quantization-aware training. The CUDA kernels (weight_quant.cu) are built just in time by load_cuda() only
where torch.cuda.is_available(); the CPU path never builds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from zplan.cuda.jit import JitExtension

CUDA_SOURCE = Path(__file__).with_name("weight_quant.cu")
BITS = (4, 8)

# --fmad=false: no contraction into FMA (the source also uses the explicit __f*_rn intrinsics).
_CUDA = JitExtension(CUDA_SOURCE, cuda=True, cuda_cflags=("-O3", "--fmad=false"))


@dataclass
class QuantizedWeight:
    """A group-wise quantized (rows, cols) weight; layout in the module docstring."""

    qweight: torch.Tensor  # int8 (rows, cols) | uint8 (rows, cols) | uint8 (rows, cols / 2) packed int4
    scales: torch.Tensor  # fp32 (rows, cols / group_size)
    zeros: torch.Tensor | None  # uint8 (rows, cols / group_size) zero points (asymmetric), else None
    bits: int
    group_size: int
    shape: tuple[int, int]  # (rows, cols) of the original weight

    @property
    def symmetric(self) -> bool:
        return self.zeros is None


def qmax_of(bits: int, symmetric: bool) -> int:
    """Largest stored level: 127 / 7 (symmetric, levels -qmax..qmax), 255 / 15 (asymmetric, levels 0..qmax)."""
    return 2 ** (bits - 1) - 1 if symmetric else 2**bits - 1


def check_args(shape: tuple[int, ...], bits: int, group_size: int) -> tuple[int, int]:
    """(rows, cols) after checking that the weight is 2-D, bits is 4 or 8 and group_size tiles cols."""
    if len(shape) != 2:
        raise ValueError(f"weight must be 2-D (rows, cols), got shape {tuple(shape)}")
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    rows, cols = shape
    if group_size <= 0 or cols % group_size:
        raise ValueError(f"group_size {group_size} must be positive and divide cols = {cols}")
    if bits == 4 and group_size % 2:
        raise ValueError(f"4-bit packs two columns a byte: group_size must be even, got {group_size}")
    return rows, cols


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    # Divide by a tensor, not a Python number: torch on CUDA turns division by a scalar into a multiplication
    # by its reciprocal, which would round differently from the kernel's true division.
    return torch.full_like(like, value)


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 (rows, cols) values in [0, 15] -> uint8 (rows, cols / 2): column 2j low nibble, 2j + 1 high."""
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (rows, cols / 2) -> uint8 (rows, cols) nibbles, the inverse of pack_int4."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])


@torch.no_grad()
def quantize_groupwise(w: torch.Tensor, bits: int, group_size: int, symmetric: bool = True) -> QuantizedWeight:
    """Reference group-wise quantization of a float (rows, cols) weight (computed in fp32, on w's device)."""
    rows, cols = check_args(tuple(w.shape), bits, group_size)
    qmax = qmax_of(bits, symmetric)
    wg = w.detach().float().reshape(rows, cols // group_size, group_size)  # (rows, G, group_size)
    if symmetric:
        absmax = wg.abs().amax(dim=-1)  # (rows, G)
        scales = absmax / _full(absmax, qmax)
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        q = torch.round(wg / scales.unsqueeze(-1)).clamp_(-qmax, qmax).reshape(rows, cols)  # integer-valued fp32
        zeros = None
        stored = q.to(torch.int8) if bits == 8 else (q + 8).to(torch.uint8)
    else:
        lo = wg.amin(dim=-1).clamp(max=0)  # (rows, G), range holds 0
        hi = wg.amax(dim=-1).clamp(min=0)
        scales = (hi - lo) / _full(lo, qmax)
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        zero_f = torch.round(-lo / scales).clamp_(0, qmax)  # (rows, G)
        q = (torch.round(wg / scales.unsqueeze(-1)) + zero_f.unsqueeze(-1)).clamp_(0, qmax).reshape(rows, cols)
        zeros = zero_f.to(torch.uint8)
        stored = q.to(torch.uint8)
    if bits == 4:
        stored = pack_int4(stored)
    return QuantizedWeight(stored, scales, zeros, bits, group_size, (rows, cols))


def integer_levels(qw: QuantizedWeight) -> torch.Tensor:
    """int32 (rows, cols): q for symmetric, q - zero for asymmetric (the integer that multiplies the scale)."""
    rows, cols = qw.shape
    if qw.bits == 4:
        q = unpack_int4(qw.qweight).to(torch.int32)
        if qw.symmetric:
            q = q - 8
    else:
        q = qw.qweight.to(torch.int32)
    if not qw.symmetric:
        q = q - qw.zeros.to(torch.int32).repeat_interleave(qw.group_size, dim=1)
    return q


@torch.no_grad()
def dequantize_groupwise(qw: QuantizedWeight) -> torch.Tensor:
    """Reference dequantization: fp32 (rows, cols) = integer level * scale of its group."""
    rows, cols = qw.shape
    q = integer_levels(qw).float().reshape(rows, cols // qw.group_size, qw.group_size)  # exact conversion
    return (q * qw.scales.unsqueeze(-1)).reshape(rows, cols)


def nbytes(qw: QuantizedWeight) -> int:
    """Bytes of qweight + scales + zeros."""
    tensors = [qw.qweight, qw.scales] + ([] if qw.zeros is None else [qw.zeros])
    return sum(t.numel() * t.element_size() for t in tensors)


class _FakeQuantize(torch.autograd.Function):
    """Forward: dequantize(quantize(w)) in w's dtype; backward: the straight-through estimator (identity)."""

    @staticmethod
    def forward(ctx, w, bits, group_size, symmetric):
        return dequantize_groupwise(quantize_groupwise(w, bits, group_size, symmetric)).to(w.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None, None, None


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool = True) -> torch.Tensor:
    """Quantize-dequantize w (same shape and dtype) with a straight-through gradient, for QAT. The forward
    value is exactly dequantize_groupwise(quantize_groupwise(w)) cast to w.dtype."""
    return _FakeQuantize.apply(w, bits, group_size, symmetric)


# --- CUDA kernels (weight_quant.cu) -------------------------------------------------------------------------


def load_cuda(strict: bool = False):
    """The weight_quant.cu extension, built just in time on first call; None where CUDA is not available or
    the build failed (after a one-line warning). strict=True raises instead of returning None."""
    return _CUDA.load(strict)


def quantize_groupwise_cuda(w: torch.Tensor, bits: int, group_size: int, symmetric: bool = True) -> QuantizedWeight:
    """quantize_groupwise with the CUDA kernel (w on a CUDA device); raises where the kernel is unavailable."""
    rows, cols = check_args(tuple(w.shape), bits, group_size)
    qweight, scales, zeros = load_cuda(strict=True).quantize(w.detach().float().contiguous(), bits, group_size,
                                                              symmetric)
    return QuantizedWeight(qweight, scales, None if symmetric else zeros, bits, group_size, (rows, cols))


def dequantize_groupwise_cuda(qw: QuantizedWeight) -> torch.Tensor:
    """dequantize_groupwise with the CUDA kernel (tensors on a CUDA device); fp32 (rows, cols)."""
    zeros = qw.zeros if qw.zeros is not None else torch.empty(0, 0, dtype=torch.uint8, device=qw.scales.device)
    return load_cuda(strict=True).dequantize(qw.qweight.contiguous(), qw.scales.contiguous(), zeros.contiguous(),
                                             qw.bits, qw.group_size, qw.symmetric, qw.shape[1])
