"""comm_quant.cu against its pure-torch references, bit for bit (marked gpu; skipped without CUDA)."""

import pytest
import torch

from zplan.cuda import comm_quant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _x(n: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    x[:256] = 0.0  # an all-zero block
    x[300] = 0.5 * (x[256:512].abs().max() / 127)  # halfway cases of the rounding are rare: one forced near
    return x


def test_the_cuda_build_is_used():
    assert comm_quant.load_cuda() is not None


@pytest.mark.parametrize("n", [256, 4096, 1 << 20])
def test_int8_blocks_match_the_reference(n):
    x = _x(n)
    q, scales = comm_quant.quantize_int8_blocks(x.cuda(), 256)
    q_ref, scales_ref = comm_quant.quantize_int8_blocks_reference(x, 256)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scales.cpu(), scales_ref)
    back = comm_quant.dequantize_int8_blocks(q, scales)
    assert torch.equal(back.cpu(), comm_quant.dequantize_int8_blocks_reference(q_ref, scales_ref))


@pytest.mark.parametrize("n", [8, 4096, 1 << 20])
def test_signs_match_the_reference(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    packed = comm_quant.pack_signs(x.cuda())
    assert torch.equal(packed.cpu(), comm_quant.pack_signs_reference(x))
    assert torch.equal(comm_quant.unpack_signs(packed).cpu(), comm_quant.unpack_signs_reference(packed.cpu()))
