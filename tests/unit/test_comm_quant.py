"""The quantizers of the compressed collectives (zplan.cuda.comm_quant) against hand computations."""

import pytest
import torch

from zplan.cuda.comm_quant import dequantize_int8_blocks, pack_signs, quantize_int8_blocks, unpack_signs


def test_int8_blocks_by_hand():
    x = torch.tensor([1.0, -2.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])  # block 4: absmax 2 -> scale 2/127; all zero
    q, scales = quantize_int8_blocks(x, 4)
    # 1 / (2/127) = 63.5 -> 64 (half to even), -2 -> -127, 0.5 / (2/127) = 31.75 -> 32
    assert q.tolist() == [64, -127, 32, 0, 0, 0, 0, 0]
    assert scales.tolist() == pytest.approx([2 / 127, 0.0])
    back = dequantize_int8_blocks(q, scales)
    assert back.tolist() == pytest.approx([64 * 2 / 127, -2.0, 32 * 2 / 127, 0, 0, 0, 0, 0])


def test_int8_round_trip_error_is_at_most_half_a_step():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    q, scales = quantize_int8_blocks(x, 256)
    error = (dequantize_int8_blocks(q, scales) - x).abs().view(-1, 256)
    assert (error <= scales[:, None] / 2 + 1e-7).all()
    assert q.dtype == torch.int8 and q.numel() == 4096 and scales.numel() == 16


def test_signs_pack_into_bits_lowest_first():
    x = torch.tensor([1.0, -1.0, 0.0, -3.0, 2.0, 2.0, -0.5, -0.1, -1.0, -1, -1, -1, -1, -1, -1, 5.0])
    packed = pack_signs(x)
    # byte 0: bits 0,2,4,5 set (x >= 0) -> 1 + 4 + 16 + 32 = 53; byte 1: bit 7 set -> 128
    assert packed.dtype == torch.uint8 and packed.tolist() == [53, 128]
    assert unpack_signs(packed).tolist() == [1, -1, 1, -1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 1]


@pytest.mark.parametrize("call", [lambda: quantize_int8_blocks(torch.zeros(10), 4), lambda: pack_signs(torch.zeros(9))])
def test_lengths_that_do_not_divide_are_refused(call):
    with pytest.raises(ValueError, match="divides by"):
        call()
