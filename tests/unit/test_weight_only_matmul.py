"""zplan.cuda.weight_only_matmul on the CPU, always against references written here from the storage layout (never
through weight_quant's dequantize or weight_only_linear_reference): a float64 sum (naive_linear) and an fp32
F.linear on the weight dequantized by hand (dequantize_by_hand). Checked: the reference, the dispatcher, the
quantization error bound against the unquantized layer, and the C++ kernel (weight_only_matmul.cpp) in every mode,
group sizes with and without a SIMD tail, 1 to 19 rows, one and two threads. The CUDA kernels:
tests/gpu/test_inference_kernels.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zplan.cuda import weight_only_matmul as wom
from zplan.cuda import weight_quant as wq

MODES = [(8, True), (8, False), (4, True), (4, False)]


def naive_linear(x: torch.Tensor, qw: wq.QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 y[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, g]) * scale[n, g] + bias[n], g = k // group_size, with
    q read byte by byte from the storage layout of weight_quant's docstring."""
    rows, cols = qw.shape
    stored = qw.qweight.to(torch.int64)
    if qw.bits == 4:  # column 2j: low nibble of byte j, 2j + 1: high nibble
        q = torch.empty(rows, cols, dtype=torch.int64)
        q[:, 0::2] = stored % 16
        q[:, 1::2] = stored // 16
    else:
        q = stored
    group = torch.arange(cols) // qw.group_size  # (cols,)
    if qw.zeros is not None:
        zero = qw.zeros.to(torch.int64)[:, group]
    else:
        zero = torch.full_like(q, 8 if qw.bits == 4 else 0)
    w = (q - zero).double() * qw.scales.double()[:, group]  # (rows, cols)
    y = x.double().reshape(-1, cols) @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], rows)


def dequantize_by_hand(qw: wq.QuantizedWeight) -> torch.Tensor:
    """fp32 (rows, cols) weight from the storage layout with plain torch ops: unpack the nibbles, subtract the zero
    point (or 8 / nothing when symmetric) in int64, convert (exact: |level| <= 255) and multiply by the group's scale
    in fp32. One rounding per weight, the same one weight_quant's docstring defines, so this equals the library's
    dequantization bit for bit without sharing its code."""
    rows, cols = qw.shape
    stored = qw.qweight.to(torch.int64)
    if qw.bits == 4:
        q = torch.stack([stored & 0xF, stored >> 4], dim=-1).reshape(rows, cols)  # byte j: columns 2j (low), 2j + 1
    else:
        q = stored  # int8 (symmetric) keeps its sign, uint8 (asymmetric) its 0..255
    group = torch.arange(cols) // qw.group_size
    if qw.zeros is not None:
        level = q - qw.zeros.to(torch.int64)[:, group]
    else:
        level = q - (8 if qw.bits == 4 else 0)
    return level.to(torch.float32) * qw.scales[:, group]


def independent_linear(x: torch.Tensor, qw: wq.QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 F.linear on the hand-dequantized weight: the layer the kernels compute, in fp32, written here."""
    return F.linear(x.float(), dequantize_by_hand(qw), None if bias is None else bias.float())


# Tolerances of an fp32 kernel against independent_linear (same fp32 weights and inputs): the two differ only in the
# order of the fp32 sum over in_f <= 256 products x_k w_k of size ~1 (and the CPU GEMV applying each group's scale
# to its partial sum once). Each addition rounds by <= 6e-8 of a partial sum of size ~sqrt(in_f) = 16, so the
# difference is a random walk of ~sqrt(256) * 6e-8 * 16 = 1.5e-5, within the allowance of 1e-5 absolute + 1e-5 * |y|
# (|y| ~ 16: ~1.7e-4). An indexing or nibble-order error moves outputs by O(|y|), and a dropped scale or zero point
# by more, so these bounds catch every layout bug.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16 inputs and outputs (x and bias rounded to bf16 before either side sees them): the C++ GEMV computes in fp32
# (fp32 weights) and rounds the output once, 1 ulp = 2^-8 = 3.9e-3 relative; without the C++ build the dispatcher's
# reference also rounds each weight to bf16 (2^-9 relative) and accumulates the 64-term products in bf16 matmul,
# a random walk of ~sqrt(64) * 2^-9 * |x w| ~ 1.6e-2 absolute. Both fit 2e-2 relative + 5e-2 absolute; a layout
# error moves outputs by O(|y|) ~ 1-10.
BF16_TOL = dict(rtol=2e-2, atol=5e-2)


def _case(rows_x: int, in_f: int, out_f: int, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen)
    x = torch.randn(rows_x, in_f, generator=gen)
    b = torch.randn(out_f, generator=gen) if bias else None
    return w, x, b


@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_reference_matches_naive_sum(bits, symmetric, group_size):
    w, x, b = _case(5, 128, 24, seed=bits * 10 + group_size)
    qw = wq.quantize_groupwise(w, bits, group_size, symmetric)
    got = wom.weight_only_linear_reference(x, qw, b)
    assert got.dtype == torch.float32 and got.shape == (5, 24)
    torch.testing.assert_close(got.double(), naive_linear(x, qw, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits,symmetric", MODES)
def test_hand_dequantization_is_the_layer_s_weight(bits, symmetric):
    """The premise of comparing against dequantize_by_hand: the reference applied to the identity matrix returns its
    weight (row k of the output is column k of the weight: one product by 1.0, plus exact zeros), so that must equal
    the hand dequantization bit for bit."""
    w, _, _ = _case(1, 64, 12, seed=bits + symmetric)  # (12, 64) weight
    qw = wq.quantize_groupwise(w, bits, 16, symmetric)
    columns = wom.weight_only_linear_reference(torch.eye(64), qw, None)  # (64, 12): row k = weight column k
    assert torch.equal(columns.T, dequantize_by_hand(qw))


@pytest.mark.parametrize("bits,symmetric", MODES)
def test_error_against_the_float_layer_is_within_the_quantization_bound(bits, symmetric):
    """|y_q - y| <= sum_k |x_k| * scale_k / 2 (each weight is off by at most half its group's scale)."""
    w, x, b = _case(3, 256, 40, seed=7)
    qw = wq.quantize_groupwise(w, bits, 64, symmetric)
    y = F.linear(x.double(), w.double(), b.double())
    bound = x.double().abs() @ (qw.scales.double().repeat_interleave(64, dim=1) / 2).T  # (3, 40)
    err = (wom.weight_only_linear(x, qw, b).double() - y).abs()
    assert (err <= bound * (1 + 1e-4) + 1e-4).all()
    assert err.max() > 0  # it is a quantized layer


def test_dispatch_keeps_shape_and_dtype():
    w, x, b = _case(6, 64, 10, seed=3)
    qw = wq.quantize_groupwise(w, 8, 32)
    x3 = x.reshape(2, 3, 64)
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
        y = wom.weight_only_linear(x3.to(dtype), qw, b)
        assert y.shape == (2, 3, 10) and y.dtype == dtype
        # x and bias rounded to dtype as the layer sees them, then fp32 F.linear on the hand-dequantized weight
        expected = independent_linear(x3.to(dtype), qw, b.to(dtype))
        torch.testing.assert_close(y.float(), expected, **tol)
    many = torch.randn(wom.CPU_MAX_ROWS + 5, 64)  # more rows than the fused GEMV takes: the buffered path
    torch.testing.assert_close(wom.weight_only_linear(many, qw, None), independent_linear(many, qw, None), **FP32_TOL)
    # float16: no CPU kernel takes it, so the dispatcher runs F.linear on the weight cast to float16. The hand
    # dequantization is bit for bit the library's (dequantize_by_hand), so the same F.linear call on it must give
    # exactly the same tensor.
    f16 = x3.to(torch.float16)
    got = wom.weight_only_linear(f16, qw, b)
    assert got.dtype == torch.float16
    assert torch.equal(got, F.linear(f16, dequantize_by_hand(qw).to(torch.float16), b.to(torch.float16)))


def test_wrong_input_features_is_an_error():
    qw = wq.quantize_groupwise(torch.randn(8, 64), 8, 32)
    with pytest.raises(ValueError, match="64"):
        wom.weight_only_linear(torch.randn(2, 32), qw, None)


@pytest.fixture(scope="module")
def cpu_kernel():
    if wom.load_cpu(warn=False) is None:
        pytest.skip("the C++ extension did not build here")
    return wom


@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("in_f,group_size", [(256, 128), (96, 32), (120, 24), (40, 10), (64, 64), (18, 2)])
def test_cpu_kernel_matches_reference(cpu_kernel, bits, symmetric, in_f, group_size):
    if bits == 4 and group_size % 2:
        pytest.skip("4-bit needs an even group size")
    for rows_x in (1, 2, 5, 8, 9, 19):
        w, x, b = _case(rows_x, in_f, 37, seed=rows_x * 100 + in_f)
        w[::3, :group_size] = 0.0  # zero groups (scale 1, all levels 0)
        qw = wq.quantize_groupwise(w, bits, group_size, symmetric)
        expected = independent_linear(x, qw, b)
        for threads in (1, 2):
            got = cpu_kernel.weight_only_linear_cpu(x, qw, b, threads=threads)
            torch.testing.assert_close(got, expected, **FP32_TOL,
                                       msg=f"bits={bits} sym={symmetric} rows={rows_x} threads={threads}")
        no_bias = cpu_kernel.weight_only_linear_cpu(x, qw, None)
        torch.testing.assert_close(no_bias, independent_linear(x, qw, None), **FP32_TOL)


@pytest.mark.parametrize("bits,symmetric", MODES)
def test_cpu_buffer_path_equals_reference_exactly(cpu_kernel, bits, symmetric):
    """The C++ dequantization is bit for bit dequantize_groupwise, so the buffered path is the reference's result."""
    w, x, b = _case(20, 96, 40, seed=bits)
    w[::5, :32] = 0.0
    qw = wq.quantize_groupwise(w, bits, 32, symmetric)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.reshape(4, 5, 96).to(dtype)
        got = cpu_kernel.weight_only_linear_cpu(xd, qw, b, path="buffer")
        assert got.dtype == dtype and got.shape == (4, 5, 40)
        # the same F.linear call on the same (hand-dequantized, bit-identical) weight: the same bits
        expected = F.linear(xd, dequantize_by_hand(qw).to(dtype), b.to(dtype))
        assert torch.equal(got, expected)


def test_cpu_kernel_bf16_input_and_3d_shape(cpu_kernel):
    w, x, b = _case(4, 128, 16, seed=11)
    qw = wq.quantize_groupwise(w, 4, 64)
    x = x.reshape(2, 2, 128).to(torch.bfloat16)
    got = cpu_kernel.weight_only_linear_cpu(x, qw, b.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and got.shape == (2, 2, 16)
    torch.testing.assert_close(got.double(), naive_linear(x.float(), qw, b.to(torch.bfloat16).float()), **BF16_TOL)


def test_cpu_kernel_large_row_uses_many_tiles(cpu_kernel):
    """A decode-sized layer (more output features than one tile per thread, K with many groups)."""
    w, x, b = _case(1, 2048, 300, seed=12)
    for bits in (8, 4):
        qw = wq.quantize_groupwise(w, bits, 128)
        torch.testing.assert_close(cpu_kernel.weight_only_linear_cpu(x, qw, b).double(), naive_linear(x, qw, b),
                                   rtol=1e-5, atol=1e-4)


def test_gradients_flow_through_the_dispatcher():
    """Where autograd records, the dispatcher runs the reference: dL/dx = dequantize(qw)^T summed over outputs,
    here from the hand dequantization (an fp32 sum of 8 weights per column in another order: default fp32 tolerance)."""
    w, x, b = _case(2, 64, 8, seed=13)
    qw = wq.quantize_groupwise(w, 8, 32)
    x.requires_grad_(True)
    wom.weight_only_linear(x, qw, b).sum().backward()
    torch.testing.assert_close(x.grad, dequantize_by_hand(qw).sum(dim=0).expand(2, 64))
