"""runtime/precision/nvfp4.py's quantiser against a hand-written NVFP4 reference (e2m1 values, e4m3 scale per 16, fp32
scale per tensor = amax / (6 * 448))."""

import pytest
import torch

from zplan.runtime.precision.nvfp4 import fake_quantize, per_tensor_scale, quantize

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0..7; the code's last bit is the mantissa


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """|y| <= 6 to the nearest e2m1 value, ties to the even code (the IEEE rule), sign kept."""
    magnitude = y.abs().unsqueeze(-1)
    distance = (magnitude - E2M1).abs()
    nearest = distance.min(dim=-1, keepdim=True).values
    ties = distance == nearest  # one or two candidates
    even = ties & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1, keepdim=True), even, ties).float().argmax(-1)
    return E2M1[code] * torch.sign(y)


def reference_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantise-dequantise of x (rows, K) along K, written out: the per-tensor scale, each block's e4m3 scale
    (its amax / 6 over the tensor scale, rounded to e4m3), each value over both scales rounded to e2m1."""
    x = x.float()
    tensor_scale = x.abs().max() / (6.0 * 448.0)
    blocks = x.reshape(x.shape[0], -1, 16)
    block_scale = (blocks.abs().amax(-1, keepdim=True) / 6.0 / tensor_scale)
    block_scale = block_scale.clamp(torch.finfo(torch.float8_e4m3fn).tiny, 448.0).to(torch.float8_e4m3fn).float()
    # times the reciprocal of the scales, as NVIDIA's cast kernels do (and torchao after them): x / (a * b) can differ
    # from x * (1 / a / b) by an ulp, which moves a bf16 value that sits on a tie of the e2m1 grid to its neighbour
    values = round_to_e2m1((blocks * ((1.0 / tensor_scale) / block_scale)).clamp(-6.0, 6.0))
    return (values * (tensor_scale * block_scale)).reshape(x.shape)


def test_e2m1_values_with_exact_scales_round_trip_exactly():
    """Blocks of e2m1 grid values times a block scale c (an e4m3 value), the tensor's amax 6 * 448 (tensor scale 1):
    every block's scale is c exactly and every value comes back bit for bit."""
    grid = torch.cat([E2M1, -E2M1])  # 16 values: one block
    scales = torch.tensor([448.0, 1.0, 0.25, 16.0, 2.0 ** -6, 96.0])  # e4m3 values; 448: the tensor's amax block
    x = (grid.repeat(2, len(scales)) * scales.repeat_interleave(16)).reshape(2, -1)  # (2, 96)
    assert per_tensor_scale(x).item() == 1.0
    q = quantize(x)
    assert torch.equal(q.scale.float().reshape(2, -1), scales.repeat(2, 1))
    assert torch.equal(q.dequantize(torch.float32), x)


def test_the_block_scale_follows_each_block_amax():
    """A block whose amax is a quarter of the tensor's gets a block scale of 448 / 4 = 112 (e4m3-exact) and its values
    are rounded on that scale, as the reference does."""
    amax = 6.0 * 448.0 * 3.0  # tensor scale 3
    big = torch.full((16,), amax)
    small = torch.linspace(-amax / 4, amax / 4, 16)
    q = quantize(torch.stack([torch.cat([big, small])]))
    assert q.scale.float().flatten().tolist() == [448.0, 112.0]
    assert torch.equal(q.dequantize(torch.float32), reference_fake_quantize(torch.stack([torch.cat([big, small])])))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_tensors_match_the_reference(dtype):
    torch.manual_seed(0)
    x = (torch.randn(64, 128) * torch.logspace(-3, 3, 128)).to(dtype)  # blocks of very different magnitudes
    got, want = fake_quantize(x), reference_fake_quantize(x)
    assert torch.equal(got, want)
    error = ((got - x.float()).norm() / x.float().norm()).item()
    assert 0.02 < error < 0.15  # measured 0.08 to 0.10: 4-bit values, 3 bits of each block's e4m3 scale


def test_an_all_zero_tensor_quantises_to_zeros():
    assert torch.equal(fake_quantize(torch.zeros(4, 32)), torch.zeros(4, 32))
