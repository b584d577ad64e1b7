"""Quantizers of the compressed data-parallel collectives (runtime.compression.grad_compression), as pure-torch
references: the CPU path runs these; a CUDA kernel of the same op must match them bit for bit.

    quantize_int8_blocks(x, block)      x (N,) fp32, N a multiple of block -> q (N,) int8, scales (N/block,) fp32
    dequantize_int8_blocks(q, scales)   -> (N,) fp32
    pack_signs(x)                       x (N,), N a multiple of 8 -> (N/8,) uint8, bit i of byte j = x[8j+i] >= 0
    unpack_signs(packed)                -> (8 * len,) fp32 of +1.0 / -1.0

int8: symmetric per block, scale = absmax / 127, q = round-half-to-even(x / scale) (an all-zero block has scale
0 and q 0). 1-bit: the sign only (1-bit Adam, Tang et al. 2021, sec. 3.1: the magnitude travels as one scale per
block, and the error is fed back by the caller).

CUDA tensors go to the kernels of comm_quant.cu (built just in time by zplan.cuda.jit on first use; the reference
when the build fails, with a warning); CPU tensors to the references.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zplan.cuda.jit import JitExtension

CUDA_SOURCE = Path(__file__).with_name("comm_quant.cu")
_BIT_WEIGHTS = 2 ** torch.arange(8, dtype=torch.int32)  # bit i of a byte has weight 2^i

_CUDA = JitExtension(CUDA_SOURCE, cuda=True, fallback="the references")


def load_cuda(strict: bool = False):
    """The CUDA extension (comm_quant.cu), built just in time on first call; None without CUDA or when it does not
    build (after a one-line warning). strict=True raises RuntimeError instead of returning None."""
    return _CUDA.load(strict)


def _kernels(t: torch.Tensor):
    return load_cuda() if t.is_cuda else None


def quantize_int8_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = _kernels(x)
    if kernels is not None and x.dim() == 1 and x.numel() % block == 0:
        q, scales = kernels.quantize_int8_blocks(x.float().contiguous(), block)
        return q, scales
    return quantize_int8_blocks_reference(x, block)


def dequantize_int8_blocks(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    kernels = _kernels(q)
    if kernels is not None:
        return kernels.dequantize_int8_blocks(q.contiguous(), scales.contiguous())
    return dequantize_int8_blocks_reference(q, scales)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    kernels = _kernels(x)
    if kernels is not None and x.dim() == 1 and x.numel() % 8 == 0:
        return kernels.pack_signs(x.float().contiguous())
    return pack_signs_reference(x)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    kernels = _kernels(packed)
    if kernels is not None:
        return kernels.unpack_signs(packed.contiguous())
    return unpack_signs_reference(packed)


# ---- the references -----------------------------------------------------------------------------------------


def quantize_int8_blocks_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 1 or x.numel() % block:
        raise ValueError(f"quantize_int8_blocks takes a flat tensor whose length divides by block={block}, "
                         f"got shape {tuple(x.shape)}")
    blocks = x.float().view(-1, block)  # (N / block, block)
    scales = blocks.abs().amax(dim=1) / 127.0  # (N / block,)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1), scales


def dequantize_int8_blocks_reference(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.view(scales.numel(), -1).float() * scales[:, None]).view(-1)


def pack_signs_reference(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 1 or x.numel() % 8:
        raise ValueError(f"pack_signs takes a flat tensor whose length divides by 8, got shape {tuple(x.shape)}")
    bits = (x >= 0).view(-1, 8).to(torch.int32)  # (N / 8, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(dim=1).to(torch.uint8)


def unpack_signs_reference(packed: torch.Tensor) -> torch.Tensor:
    bits = (packed.to(torch.int32)[:, None] // _BIT_WEIGHTS.to(packed.device)) % 2  # (len, 8)
    return (bits.float() * 2.0 - 1.0).view(-1)
