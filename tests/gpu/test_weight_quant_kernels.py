"""weight_quant.cu against the pure-torch reference (zplan.cuda.weight_quant), bit for bit, every mode (INT8 and
packed INT4, symmetric and asymmetric), on random weights, weights full of x.5 ties, zero groups, groups smaller
and larger than a warp, and an empty weight (marked gpu; skipped without CUDA). The first test builds the
extension just in time (nvcc, about a minute).
"""

from __future__ import annotations

import pytest
import torch

from zplan.cuda import weight_quant as wq

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = [(8, True), (8, False), (4, True), (4, False)]
# (rows, cols, group_size): groups below, at and above the 32 lanes of a warp, odd ones (8 bits only), groups that
# are not a multiple of 32, and an empty weight
SHAPES = [(1, 32, 32), (7, 96, 32), (3, 48, 2), (4, 45, 15), (5, 200, 50), (64, 4096, 128), (2, 1000, 1000),
          (0, 64, 64)]


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so that -0.0 and 0.0 (or any two encodings) count as different."""
    return t.contiguous().view(torch.uint8)


def assert_same(got: wq.QuantizedWeight, ref: wq.QuantizedWeight, what: str) -> None:
    assert got.qweight.dtype == ref.qweight.dtype and got.qweight.shape == ref.qweight.shape, what
    assert torch.equal(bits_of(got.qweight.cpu()), bits_of(ref.qweight.cpu())), what
    assert got.scales.dtype == torch.float32 and torch.equal(bits_of(got.scales.cpu()), bits_of(ref.scales.cpu())), what
    if ref.zeros is None:
        assert got.zeros is None, what
    else:
        assert torch.equal(got.zeros.cpu(), ref.zeros.cpu()), what


def weights(rows: int, cols: int, group_size: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, 2, max(rows, 1))[:rows].unsqueeze(1)
    w = torch.randn(rows, cols, generator=gen) * scale
    zero_groups = w.clone()
    zero_groups[::2, :group_size] = 0.0  # an all-zero group in every other row
    ties = torch.randint(-254, 255, (rows, cols), generator=gen).float() * 0.5  # many x.5 levels when scale = 1
    ties.view(rows, cols // group_size, group_size)[..., 0] = 127.0
    shifted = w.abs() + 1.0  # all positive: asymmetric range [0, max]
    return {"random": w, "zero_groups": zero_groups, "ties": ties, "positive": shifted,
            "bf16": w.to(torch.bfloat16)}


@pytest.mark.parametrize("bits,symmetric", MODES)
def test_the_kernels_build_and_compute_the_reference(bits, symmetric):
    """The built module itself (load_cuda(strict=True) raises with the build error), on one small weight with a zero
    group and x.5 ties, against the reference: quantize and dequantize bit for bit, and the stored levels checked
    against round-half-to-even by hand."""
    module = wq.load_cuda(strict=True)
    w = torch.tensor([[0.0] * 8 + [7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -7.0]])  # (1, 16), two groups of 8
    ref = wq.quantize_groupwise(w, bits, 8, symmetric)
    qweight, scales, zeros = module.quantize(w.cuda(), bits, 8, symmetric)
    got = wq.QuantizedWeight(qweight, scales, None if symmetric else zeros, bits, 8, (1, 16))
    assert qweight.is_cuda
    assert_same(got, ref, "small weight")
    if bits == 4 and symmetric:  # scale 7 / 7 = 1: levels are the values rounded half to even, stored as q + 8
        levels = wq.unpack_int4(qweight.cpu()).to(torch.int32) - 8
        assert levels.tolist() == [[0] * 8 + [7, 0, 2, 2, 0, -2, -2, -7]]
    back = module.dequantize(qweight, scales, zeros.contiguous(), bits, 8, symmetric, 16)
    assert torch.equal(bits_of(back.cpu()), bits_of(wq.dequantize_groupwise(ref)))


@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("rows,cols,group_size", SHAPES)
def test_kernels_equal_the_reference(bits, symmetric, rows, cols, group_size):
    if bits == 4 and group_size % 2:
        pytest.skip("4-bit needs an even group size")
    for name, w in weights(rows, cols, group_size, seed=rows * 131 + cols).items():
        ref = wq.quantize_groupwise(w, bits, group_size, symmetric)  # on the CPU
        assert_same(wq.quantize_groupwise_cuda(w.cuda(), bits, group_size, symmetric), ref, f"kernel, {name}")
        # the reference on the GPU too (it avoids torch's division-by-scalar-as-reciprocal on CUDA)
        assert_same(wq.quantize_groupwise(w.cuda(), bits, group_size, symmetric), ref, f"reference on GPU, {name}")
        on_gpu = wq.QuantizedWeight(ref.qweight.cuda(), ref.scales.cuda(),
                                    None if ref.zeros is None else ref.zeros.cuda(), bits, group_size, ref.shape)
        expected = bits_of(wq.dequantize_groupwise(ref))
        assert torch.equal(bits_of(wq.dequantize_groupwise_cuda(on_gpu).cpu()), expected), f"kernel, {name}"
        assert torch.equal(bits_of(wq.dequantize_groupwise(on_gpu).cpu()), expected), f"reference on GPU, {name}"
