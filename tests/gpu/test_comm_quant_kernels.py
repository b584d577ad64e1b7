"""comm_quant.cu against its pure-torch references, bit for bit (marked gpu; skipped without CUDA).

Every op here is integer or correctly rounded work (absmax, one IEEE division, round half to even, one product, sign
bits), so the kernels must give the reference's exact bits: torch.equal throughout. The kernels are called through the
built module itself, so a failed build fails these tests instead of comparing the reference with itself (the
dispatchers fall back to the reference); the dispatchers are then checked to return the kernels' results.
"""

import pytest
import torch

from zplan.cuda import comm_quant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK = 256
# Block 3 (with scale exactly 1.0) holds exact halfway cases of the rounding: x / scale = these values, rounded half
# to even by both sides. A kernel rounding half away from zero (roundf) would give 1, 2, 3, -1, -2, -3.
TIES = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -0.0, 126.5])
TIES_ROUNDED = torch.tensor([0, 2, 2, 0, -2, -2, 0, 126], dtype=torch.int8)


def _x(n: int) -> torch.Tensor:
    """n (a multiple of 256) values: block 0 all zero (scale 0), block 1 random with one value at half its scale,
    block 2 exact ties at scale 1, the rest random."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    x[:BLOCK] = 0.0  # an all-zero block
    if n >= 2 * BLOCK:
        x[300] = 0.5 * (x[BLOCK:2 * BLOCK].abs().max() / 127)  # below the absmax, so the block's scale is unchanged
    if n >= 3 * BLOCK:
        ties = x[2 * BLOCK:3 * BLOCK]
        ties.uniform_(-1.0, 1.0, generator=torch.Generator().manual_seed(1))
        ties[0] = 127.0  # absmax 127: scale = 127 / 127 = 1.0 exactly, so x / scale = x
        ties[1:1 + len(TIES)] = TIES
    return x


@pytest.fixture(scope="module")
def kernels():
    module = comm_quant.load_cuda()
    assert module is not None, "comm_quant.cu did not build (see the RuntimeWarning)"
    return module


def test_the_kernels_are_built_and_compute_the_reference(kernels):
    """A small case through every kernel of the module, against the references, bit for bit."""
    x = _x(3 * BLOCK)
    q, scales = kernels.quantize_int8_blocks(x.cuda(), BLOCK)
    q_ref, scales_ref = comm_quant.quantize_int8_blocks_reference(x, BLOCK)
    assert q.is_cuda and q.dtype == torch.int8 and scales.dtype == torch.float32
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scales.cpu(), scales_ref)
    assert torch.equal(kernels.dequantize_int8_blocks(q, scales).cpu(),
                       comm_quant.dequantize_int8_blocks_reference(q_ref, scales_ref))
    packed = kernels.pack_signs(x.cuda())
    assert torch.equal(packed.cpu(), comm_quant.pack_signs_reference(x))
    assert torch.equal(kernels.unpack_signs(packed).cpu(), comm_quant.unpack_signs_reference(packed.cpu()))


@pytest.mark.parametrize("n", [256, 768, 4096, 1 << 20])
def test_int8_blocks_match_the_reference(kernels, n):
    x = _x(n)
    q, scales = kernels.quantize_int8_blocks(x.cuda(), BLOCK)
    q_ref, scales_ref = comm_quant.quantize_int8_blocks_reference(x, BLOCK)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scales.cpu(), scales_ref)
    assert scales_ref[0] == 0 and torch.equal(q_ref[:BLOCK], torch.zeros(BLOCK, dtype=torch.int8))
    if n >= 2 * BLOCK:
        assert q_ref[300] == 0  # 0.5 rounds to even
    if n >= 3 * BLOCK:  # the reference's own rounding is half to even, so matching it pins the kernel's
        assert scales_ref[2] == 1.0
        assert torch.equal(q_ref[2 * BLOCK + 1:2 * BLOCK + 1 + len(TIES)], TIES_ROUNDED)
    back = kernels.dequantize_int8_blocks(q, scales)
    assert torch.equal(back.cpu(), comm_quant.dequantize_int8_blocks_reference(q_ref, scales_ref))
    # the dispatchers take the kernels for CUDA tensors
    q_d, scales_d = comm_quant.quantize_int8_blocks(x.cuda(), BLOCK)
    assert q_d.is_cuda and torch.equal(q_d, q) and torch.equal(scales_d, scales)
    assert torch.equal(comm_quant.dequantize_int8_blocks(q, scales), back)


@pytest.mark.parametrize("n", [8, 4096, 1 << 20])
def test_signs_match_the_reference(kernels, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[0], x[1] = -0.0, 0.0  # both count as >= 0 (bit set), on both sides
    packed = kernels.pack_signs(x.cuda())
    assert torch.equal(packed.cpu(), comm_quant.pack_signs_reference(x))
    unpacked = kernels.unpack_signs(packed)
    assert torch.equal(unpacked.cpu(), comm_quant.unpack_signs_reference(packed.cpu()))
    assert torch.equal(unpacked.cpu(), torch.where(x >= 0, 1.0, -1.0))  # the round trip keeps every sign
    assert torch.equal(comm_quant.pack_signs(x.cuda()), packed)
    assert torch.equal(comm_quant.unpack_signs(packed), unpacked)
