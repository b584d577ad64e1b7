"""The inference kernels against their pure-torch references (marked gpu; skipped without CUDA):
weight_only_matmul.cu (the fused GEMV for few rows and the dequantize-to-buffer path, every mode, fp32 / fp16 / bf16
activations, aligned and unaligned rows) and fused_norm_rope.cu (RMSNorm, RoPE with every broadcast form of cos/sin).
The first test of each module builds its extension just in time (nvcc, about a minute each).

The kernels are called through the *_cuda functions, which load the built module with strict=True: a failed build
fails these tests rather than letting a dispatcher's fallback compare the reference with itself. Where the kernel's
arithmetic is exact or elementwise in a fixed order (the dequantized buffer, the dispatchers' choice of kernel) the
check is torch.equal; float accumulations in another order than torch's get the tolerances stated beside them.
"""

from __future__ import annotations

import pytest
import torch

from zplan.cuda import fused_norm_rope as fnr
from zplan.cuda import weight_only_matmul as wom
from zplan.cuda import weight_quant as wq

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = [(8, True), (8, False), (4, True), (4, False)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fused kernels accumulate in fp32 in another order than cuBLAS (which may reduce 16-bit products in 16 bits); the
# output's own rounding dominates for 16 bits. (rtol, atol as a fraction of the largest |output|): an indexing
# error changes outputs by their own size, far beyond these.
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-2, 5e-3), torch.bfloat16: (5e-2, 2e-2)}


def assert_near(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    scale = max(1.0, expected.float().abs().max().item())
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=atol * scale)


def _gpu(qw: wq.QuantizedWeight) -> wq.QuantizedWeight:
    return wq.QuantizedWeight(qw.qweight.cuda(), qw.scales.cuda(), None if qw.zeros is None else qw.zeros.cuda(),
                              qw.bits, qw.group_size, qw.shape)


def test_extensions_build_and_compute_the_references():
    """One small fp32 case through each kernel (built here; strict loads raise with the build error) against the
    pure-torch references and, for the GEMV, a float64 sum on the CPU of the weight dequantized there."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 64, generator=gen)
    qw_cpu = wq.quantize_groupwise(w, 8, 32)
    qw = _gpu(qw_cpu)
    x = torch.randn(2, 64, generator=gen)
    got = wom.weight_only_linear_cuda(x.cuda(), qw, None, path="gemv")
    assert got.is_cuda and got.dtype == torch.float32 and got.shape == (2, 8)
    assert_near(got, wom.weight_only_linear_reference(x.cuda(), qw, None), torch.float32)
    # fp32 sums of 64 products ~1 against float64: ~sqrt(64) * 6e-8 * 8 = 4e-6, inside TOL[float32]
    assert_near(got.cpu(), (x.double() @ wq.dequantize_groupwise(qw_cpu).double().T).float(), torch.float32)
    buf = wom.weight_only_linear_cuda(x.cuda(), qw, None, path="buffer")  # dequantize_to, then the same F.linear
    assert torch.equal(buf, wom.weight_only_linear_reference(x.cuda(), qw, None))
    h = torch.randn(3, 64, generator=gen).cuda()
    # fp32 RMSNorm: a block tree sum of 64 squares vs torch's mean, and rsqrtf: a few ulps, inside 1e-5
    torch.testing.assert_close(fnr.rms_norm_cuda(h, None, 1e-5), fnr.rms_norm_reference(h, None, 1e-5),
                               rtol=1e-5, atol=1e-5)
    q = torch.randn(1, 2, 3, 8, generator=gen).cuda()
    angles = torch.rand(3, 4, generator=gen).repeat(1, 2).cuda()
    # fp32 RoPE: two products and a sum per element; the kernel may fuse them (one rounding less): ~1 ulp
    torch.testing.assert_close(fnr.apply_rotary_cuda(q, angles.cos(), angles.sin()),
                               fnr.apply_rotary_reference(q, angles.cos(), angles.sin()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
# (out, in, group_size): rows of 4-byte multiples (the vectorised load) and not (in = 42: 42 or 21 bytes a row);
# groups of 6 and 2 columns: a loaded word spans several groups
@pytest.mark.parametrize("out_f,in_f,group_size", [(64, 256, 128), (33, 96, 32), (17, 42, 14), (9, 48, 6),
                                                   (8, 96, 2), (256, 4096, 128)])
def test_gemv_matches_reference(bits, symmetric, dtype, out_f, in_f, group_size):
    gen = torch.Generator().manual_seed(out_f + in_f)
    w = torch.randn(out_f, in_f, generator=gen)
    w[::4, :group_size] = 0.0
    qw = _gpu(wq.quantize_groupwise(w, bits, group_size, symmetric))
    bias = torch.randn(out_f, generator=gen).to(dtype).cuda()
    for rows in (1, 3, wom.GEMV_MAX_ROWS):
        x = torch.randn(rows, in_f, generator=gen).to(dtype).cuda()
        expected = wom.weight_only_linear_reference(x, qw, bias)
        got = wom.weight_only_linear_cuda(x, qw, bias, path="gemv")
        assert got.dtype == dtype and got.shape == (rows, out_f)
        assert_near(got, expected, dtype)
        # the dispatcher picks the gemv for these rows: the very same kernel call (one warp an output, a fixed
        # shuffle order, no atomics), so the same bits
        no_bias = wom.weight_only_linear_cuda(x, qw, None, path="gemv")
        assert_near(no_bias, wom.weight_only_linear_reference(x, qw, None), dtype)
        assert torch.equal(wom.weight_only_linear(x, qw, None), no_bias)


@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_buffer_path_equals_reference_exactly(bits, symmetric, dtype):
    """Many rows: the dequantized buffer is bit for bit the reference's weight, and the same matmul follows."""
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(48, 192, generator=gen)
    qw = _gpu(wq.quantize_groupwise(w, bits, 64, symmetric))
    buf = wom.load_cuda(strict=True).dequantize_to(qw.qweight, qw.scales, wom._zeros_or_empty(qw), bits, 64, 192,
                                                   dtype)
    assert torch.equal(buf.view(torch.uint8).cpu(), wq.dequantize_groupwise(qw).to(dtype).view(torch.uint8).cpu())
    x = torch.randn(37, 192, generator=gen).to(dtype).cuda()
    bias = torch.randn(48, generator=gen).to(dtype).cuda()
    got = wom.weight_only_linear_cuda(x, qw, bias, path="buffer")  # the kernel's buffer, then F.linear
    assert torch.equal(got, wom.weight_only_linear_reference(x, qw, bias))
    assert torch.equal(wom.weight_only_linear(x, qw, bias), got)  # 37 rows: the dispatcher takes this path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 4096), (1, 1000)])
def test_rms_norm_kernel_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).cuda()
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype).cuda()
    for wt in (weight, None):
        got = fnr.rms_norm_cuda(x, wt, 1e-5)
        assert got.dtype == dtype and got.shape == x.shape
        # Both compute in fp32 (the kernel's sum of squares in another order, rsqrtf) and round to dtype once: fp32
        # differs by a few ulps (1e-5), 16 bits by at most one ulp of the output where the fp32 values straddle a
        # rounding boundary: fp16 2^-10 ~ 1e-3, bf16 2^-7 ~ 8e-3 relative (|y| ~ 1-4 here).
        rtol, atol = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}[dtype]
        torch.testing.assert_close(got, fnr.rms_norm_reference(x, wt, 1e-5), rtol=rtol, atol=atol)
        assert torch.equal(fnr.rms_norm(x, wt, 1e-5), got)  # the dispatcher runs this kernel (fixed reduction order)
    norm = torch.nn.RMSNorm(shape[-1], eps=1e-5).to(dtype).cuda()
    torch.testing.assert_close(fnr.rms_norm(x, norm.weight, 1e-5).float(), norm(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kernel_matches_reference(dtype):
    gen = torch.Generator().manual_seed(9)
    B, H, T, d = 2, 4, 7, 64
    x = torch.randn(B, H, T, d, generator=gen).to(dtype).cuda()
    angles = torch.rand(B, 1, T, d // 2, generator=gen) * 50
    angles = torch.cat((angles, angles), dim=-1)
    cos_b, sin_b = angles.cos().to(dtype).cuda(), angles.sin().to(dtype).cuda()  # (B, 1, T, d)
    forms = [(cos_b, sin_b), (cos_b[0, 0], sin_b[0, 0]), (cos_b[:1], sin_b[:1]),
             (cos_b.expand(B, H, T, d).contiguous(), sin_b.expand(B, H, T, d).contiguous())]
    # The kernel rounds x * cos + partner * sin once (fp32 inside); the reference rounds each product and the sum in
    # dtype: fp32 ~1 ulp (1e-6), 16 bits up to ~2 ulps of |out| <= ~4: fp16 2 * 2^-11 relative, bf16 2 * 2^-8.
    rtol, atol = {torch.float32: (1e-6, 1e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    for cos, sin in forms:
        got = fnr.apply_rotary_cuda(x, cos, sin)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got, fnr.apply_rotary_reference(x, cos, sin), rtol=rtol, atol=atol)
        assert torch.equal(fnr.apply_rotary(x, cos, sin), got)  # the dispatcher takes the kernel (elementwise)
    # a non-contiguous x (the engine's q after a transpose) goes through .contiguous() first
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(fnr.apply_rotary(xt, cos_b, sin_b), fnr.apply_rotary_reference(x, cos_b, sin_b),
                               rtol=rtol, atol=atol)


# ---- ZeRO-Inference weight streaming on a CUDA device (side stream, events, pinned buffers) ----------------------


def _stream_layers(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(n)
    return [{"w": torch.randn(256, 256, generator=gen) + i, "q": torch.randint(-128, 128, (999,), generator=gen,
                                                                                 dtype=torch.int8),
             "b": torch.randn(17, generator=gen).to(torch.bfloat16), "mask": torch.rand(5, generator=gen) > 0.5}
            for i in range(n)]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_streamed_weights_on_cuda_are_exact_and_wait_for_compute(tier, prefetch, tmp_path):
    """Slow compute is queued on each layer before done(i): a copy into its slot that did not wait for the `free`
    event would change what that compute read. Results are checked after all passes."""
    from zplan.runtime.inference.zero_inference import StreamedWeights

    layers = _stream_layers(5)
    device = torch.device("cuda")
    big = torch.randn(256, 256, device=device)
    expected = [float((layer["w"].double() @ big.double().cpu()).sum()) for layer in layers]
    weights = StreamedWeights(layers, device, tier, str(tmp_path), prefetch)
    assert len(weights.device_buffers()) == prefetch + 1
    results = []
    for _ in range(3):
        for i, layer in enumerate(layers):
            got = weights.layer(i)
            for name, t in layer.items():
                assert got[name].is_cuda and got[name].dtype == t.dtype
            y = got["w"] @ big
            for _ in range(50):  # keep the GPU busy reading the slot after done(i) returns
                y = got["w"] @ (big + 0 * y)
            results.append(y.sum())
            copies = {n: t.clone() for n, t in got.items()}  # cloned on the current stream, before done(i)
            weights.done(i)
            for name, t in layer.items():
                assert torch.equal(copies[name].cpu(), t), (i, name)
    torch.cuda.synchronize()
    for k, r in enumerate(results):
        assert abs(float(r) - expected[k % 5]) <= 1e-3 * abs(expected[k % 5]) + 1e-2, k
    weights.close()
