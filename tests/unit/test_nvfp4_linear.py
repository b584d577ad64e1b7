"""runtime/precision/nvfp4.py's NVFP4Linear: its forward and gradients against an independent fake-quant reference (the
three GEMMs written out on test_nvfp4_quantize's hand-written quantiser) and against float; the conversion and the
device check."""

import pytest
import torch
from torch import nn

from tests.unit.test_nvfp4_quantize import reference_fake_quantize as fq
from zplan.errors import PlanMismatchError
from zplan.runtime.precision.nvfp4 import NVFP4Linear, convert_blocks_to_nvfp4, nvfp4_on_tensor_cores

T, IN, OUT = 24, 64, 48  # 24 tokens: the weight gradient's reduction pads them to 32


def reference(x, w, b, g):
    """(Y, dX, dW, db) with each GEMM operand fake-quantised along that GEMM's reduction dim (fp32)."""
    pad = torch.zeros(-T % 16, x.shape[1]), torch.zeros(-T % 16, g.shape[1])
    y = fq(x) @ fq(w).t() + b
    dx = fq(g) @ fq(w.t().contiguous()).t()
    dw = fq(torch.cat([g, pad[1]]).t().contiguous()) @ fq(torch.cat([x, pad[0]]).t().contiguous()).t()
    return y, dx, dw, g.sum(0)


def linear_run(module, x, g):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(g)
    return y.detach(), x.grad, module.weight.grad, module.bias.grad


def data():
    torch.manual_seed(0)
    linear = nn.Linear(IN, OUT)
    x, g = torch.randn(T, IN), torch.randn(T, OUT) * 1e-3
    return linear, x, g


def nvfp4_copy(linear):
    blocks = nn.ModuleList([nn.Sequential(linear)])
    convert_blocks_to_nvfp4(nn.ModuleDict({"blocks": blocks}), "blocks", "cpu", say=lambda message: None)
    return blocks[0][0]


def test_forward_and_gradients_match_the_fake_quant_reference():
    linear, x, g = data()
    w, b = linear.weight.detach().clone(), linear.bias.detach().clone()
    got = linear_run(nvfp4_copy(linear), x, g)
    for name, a, e in zip(("Y", "dX", "dW", "db"), got, reference(x, w, b, g), strict=True):
        assert torch.allclose(a, e, rtol=1e-5, atol=1e-6 * e.abs().max().item()), name


def test_forward_and_gradients_are_within_fp4_error_of_float():
    """Two 4-bit operands a GEMM: relative error (Frobenius) 0.05 to 0.25 against the float Linear (measured
    Y 0.134, dX 0.146, dW 0.130 on Gaussian data)."""
    linear, x, g = data()
    exact = linear_run(linear, x, g)
    linear.weight.grad = linear.bias.grad = None
    got = linear_run(nvfp4_copy(linear), x, g)
    for name, a, e in zip(("Y", "dX", "dW"), got[:3], exact[:3], strict=True):
        error = ((a - e).norm() / e.norm()).item()
        assert 0.05 < error < 0.25, (name, error)


def test_leading_dims_and_bf16_run_and_keep_their_dtype():
    linear, _, _ = data()
    module = nvfp4_copy(linear.to(torch.bfloat16))
    x = torch.randn(2, 8, IN, dtype=torch.bfloat16, requires_grad=True)
    y = module(x)
    y.sum().backward()
    assert y.shape == (2, 8, OUT) and y.dtype == x.grad.dtype == module.weight.grad.dtype == torch.bfloat16


def test_conversion_keeps_the_parameters_and_skips_widths_off_16():
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 30))])
    weight = blocks[0][0].weight
    said = []
    paths = convert_blocks_to_nvfp4(nn.ModuleDict({"blocks": blocks}), "blocks", "cpu", say=said.append)
    assert paths == ["blocks.0.0"] and type(blocks[0][0]) is NVFP4Linear and blocks[0][0].weight is weight
    assert type(blocks[0][1]) is nn.Linear and "blocks.0.1 (64 -> 30)" in said[1]
    with pytest.raises(PlanMismatchError, match="multiples of 16"):
        convert_blocks_to_nvfp4(nn.ModuleDict({"b": nn.ModuleList([nn.Linear(8, 8)])}), "b", "cpu")


def test_gpus_without_fp4_tensor_cores_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    with pytest.raises(PlanMismatchError, match="no fp4 tensor cores"):
        nvfp4_on_tensor_cores(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert nvfp4_on_tensor_cores(torch.device("cuda", 0)) and not nvfp4_on_tensor_cores("cpu")


def test_the_tensor_core_path_runs_on_torchs_cpu_kernel_as_the_emulation_does():
    """The GPU's code path (NVFP4Tensor's mm: torch._scaled_mm on float4_e2m1fn_x2 with swizzled e4m3 scales, the
    per-tensor scales applied after) through torch 2.13's CPU kernel gives the emulation's GEMM: measured equal (fp32
    operands; an fp32 output). This checks the call, not a Blackwell GPU's kernel."""
    from zplan.runtime.precision.nvfp4 import nvfp4_mm

    torch.manual_seed(0)
    a, b = torch.randn(40, 64), torch.randn(48, 64)
    emulated = nvfp4_mm(a, b, False, torch.float32)
    assert torch.allclose(nvfp4_mm(a, b, True, torch.float32), emulated, rtol=1e-6, atol=1e-6)
