"""zplan.cuda.fused_norm_rope on the CPU (its references): RMSNorm against a naive per-row loop and torch.nn.RMSNorm,
RoPE against a naive per-element loop and examples/llama.py's apply_rotary, with every broadcast form of cos/sin.
The CUDA kernels are compared with these references in tests/gpu/test_inference_kernels.py."""

from __future__ import annotations

import math

import pytest
import torch

from zplan.cuda import fused_norm_rope as fnr
from zplan.examples import llama


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Row by row in float64 with Python's math: y_j = x_j / sqrt(sum(x^2) / h + eps) * w_j."""
    rows = x.double().reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        values = rows[r].tolist()
        inv = 1.0 / math.sqrt(sum(v * v for v in values) / len(values) + eps)
        for j, v in enumerate(values):
            out[r, j] = v * inv * (1.0 if weight is None else float(weight[j]))
    return out.reshape(x.shape)


def naive_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Element by element: out[..., j] = x_j cos_j - x_{j+d/2} sin_j (j < d/2), x_j cos_j + x_{j-d/2} sin_j (else)."""
    cos, sin = cos.expand(x.shape).double(), sin.expand(x.shape).double()
    x = x.double()
    d = x.shape[-1]
    half = d // 2
    out = torch.empty_like(x)
    for j in range(d):
        partner = -x[..., j + half] if j < half else x[..., j - half]
        out[..., j] = x[..., j] * cos[..., j] + partner * sin[..., j]
    return out


@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 64), (1, 1, 7)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_reference_matches_naive_formula(shape, with_weight):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen) if with_weight else None
    got = fnr.rms_norm_reference(x, weight, 1e-5)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), naive_rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_torch_rmsnorm(dtype):
    gen = torch.Generator().manual_seed(2)
    h = 96
    norm = torch.nn.RMSNorm(h, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(h, generator=gen) + 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(4, 3, h, generator=gen) * 2).to(dtype)
    got = fnr.rms_norm(x, norm.weight, 1e-6)  # the dispatcher: the reference on the CPU
    expected = norm(x)
    assert got.dtype == dtype
    # fp32 agrees to rounding; 16-bit differs by torch's extra rounding to x.dtype before the weight multiply
    tol = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}[dtype]
    torch.testing.assert_close(got, expected, rtol=tol[0], atol=tol[1])


def test_rms_norm_of_zero_row_is_zero_not_nan():
    out = fnr.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6)
    assert torch.equal(out, torch.zeros(2, 8))


def _cos_sin(T: int, d: int, dtype=torch.float32):
    like = torch.empty(0, dtype=dtype)
    return llama.rotary_cos_sin(T, d, 10000.0, like)  # each (T, d)


@pytest.mark.parametrize("B,H,T,d", [(1, 1, 1, 2), (2, 3, 5, 8), (1, 4, 17, 64)])
def test_rotary_reference_matches_naive_and_llama(B, H, T, d):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, H, T, d, generator=gen)
    cos, sin = _cos_sin(T, d)
    got = fnr.apply_rotary(x, cos, sin)
    assert torch.equal(got, llama.apply_rotary(x, cos, sin))  # the same formula, bit for bit
    torch.testing.assert_close(got.double(), naive_rotary(x, cos, sin), rtol=1e-6, atol=1e-6)


def test_rotary_broadcast_forms_agree():
    """cos/sin as (T, d), (1, 1, T, d) and per-batch positions (B, 1, T, d) give the same rotation."""
    gen = torch.Generator().manual_seed(4)
    B, H, T, d = 2, 3, 6, 16
    x = torch.randn(B, H, T, d, generator=gen)
    cos, sin = _cos_sin(T, d)
    expected = naive_rotary(x, cos, sin)
    for c, s in [(cos, sin), (cos[None, None], sin[None, None]), (cos.expand(B, 1, T, d), sin.expand(B, 1, T, d))]:
        torch.testing.assert_close(fnr.apply_rotary(x, c, s).double(), expected, rtol=1e-6, atol=1e-6)
    # per-batch positions: batch 1 at positions 10.., batch 0 at 0.. (the decode case with ragged lengths)
    cos_all, sin_all = _cos_sin(T + 10, d)
    cos_b = torch.stack([cos_all[:T], cos_all[10:]])[:, None]  # (B, 1, T, d)
    sin_b = torch.stack([sin_all[:T], sin_all[10:]])[:, None]
    got = fnr.apply_rotary(x, cos_b, sin_b)
    torch.testing.assert_close(got[1].double(), naive_rotary(x[1:], cos_all[10:], sin_all[10:])[0], rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(got[0].double(), naive_rotary(x[:1], cos, sin)[0], rtol=1e-6, atol=1e-6)


def test_rotary_preserves_pairwise_norm():
    """A rotation: |(x_j, x_{j+d/2})| is unchanged for every pair (an independent property of RoPE)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, 9, 32, generator=gen, dtype=torch.float64)
    angles = torch.rand(9, 16, generator=gen, dtype=torch.float64) * 100  # (T, d/2), any angles
    angles = torch.cat((angles, angles), dim=-1)  # (T, d): pair (j, j + d/2) shares an angle
    cos, sin = angles.cos(), angles.sin()
    y = fnr.apply_rotary(x, cos, sin)
    norm = lambda t: t[..., :16] ** 2 + t[..., 16:] ** 2  # noqa: E731
    torch.testing.assert_close(norm(y), norm(x), rtol=1e-12, atol=1e-12)
