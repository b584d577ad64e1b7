"""NVFP4 training of the blocks' Linears (plan.train.precision 'nvfp4').

    model = convert_blocks_to_nvfp4(model, plan.model.block_prefix, device)   # first step of parallelize

NVFP4 (NVIDIA Blackwell): e2m1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6} (and their negatives), one e4m3 scale per 16
consecutive elements and one fp32 scale per tensor, amax / (6 * 448), so that the largest block's e4m3 scale is
e4m3's largest value (torchao's per_tensor_amax_to_scale). The recipe (NVIDIA, "Pretraining Large Language Models
with NVFP4", 2025) runs the three GEMMs of a Linear in NVFP4, each operand blocked along its GEMM's reduction dim:

    forward   Y  = q(X) @ q(W)^T        X (T, in), W (out, in): both blocked along in
    backward  dX = q(G) @ q(W^T)^T      G (T, out), W^T (in, out): both blocked along out
              dW = q(G^T) @ q(X^T)^T    G^T (out, T), X^T (in, T): both blocked along the T tokens (zero-padded to 16)

q is torchao 0.18's NVFP4Tensor.to_nvfp4 with the per-tensor scale (round to nearest even, no stochastic rounding
of G and no random Hadamard transform of the wgrad inputs, both of which the paper adds). What a Linear saves for
backward is its bf16 input and weight, quantised again there (as torchao's float8 does): activation memory is
bf16's.

Where the GEMM runs: a CUDA device of compute capability 10.0 or more (Blackwell: fp4 tensor cores) runs it as
torch._scaled_mm on float4_e2m1fn_x2 operands with swizzled e4m3 block scales, through NVFP4Tensor's own mm, the
per-tensor scales applied to the output. THAT PATH IS UNTESTED ON A GPU: this project has no Blackwell GPU (the same
call runs in tests/unit/test_nvfp4_linear.py through torch 2.13's CPU _scaled_mm float4 kernel, which equals the
emulation; the training run on 2 processes uses the emulation). Everywhere else
(the CPU: tests and the dry run) the GEMM is EMULATED: the operands are quantised exactly as on the GPU and
dequantised to fp32, and an fp32 matmul of them gives the GPU's numbers up to the order of fp32 accumulation. The
emulation prices nothing: it is slower than bf16. A CUDA GPU below 10.0 is refused (compile refuses clusters without
an fp4 peak).

Which Linears: every nn.Linear under `block_prefix` with both widths multiples of 16 (NVFP4_DIM_MULTIPLE) becomes an
NVFP4Linear in place (its class swapped: the same Parameter objects, names, init replay and state dicts). The head,
the embedding, norms and attention stay bf16. Tensor parallel is not run (compile pins tp 1; train.py refuses a
plan with tp > 1): the per-tensor scale of a split tensor would need its amax all-reduced.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from zplan.errors import PlanMismatchError
from zplan.runtime.precision.float8 import _quiet_torchao_import, on_tensor_cores
from zplan.schemas.capability import NVFP4_DIM_MULTIPLE

NVFP4_MIN_CAPABILITY = (10, 0)  # sm_100 (Blackwell) and later have fp4 tensor cores
NVFP4_BLOCK = 16  # elements per e4m3 block scale (NVIDIA's NVFP4; torchao's block_size)
F4_E2M1_MAX = 6.0  # e2m1's largest value
F8_E4M3_MAX = 448.0  # e4m3's largest value


def nvfp4_convertible(module: nn.Module) -> bool:
    """A plain nn.Linear (not a subclass: the conversion swaps its class) whose in and out features are both multiples
    of 16 (NVFP4_DIM_MULTIPLE)."""
    return type(module) in (nn.Linear, NVFP4Linear) and all(
        features % NVFP4_DIM_MULTIPLE == 0 for features in (module.in_features, module.out_features))


def nvfp4_on_tensor_cores(device: torch.device | str) -> bool:
    """True on a CUDA device of capability 10.0 or more (the GEMMs run on fp4 tensor cores, untested here); False on
    the CPU (emulated GEMMs); an older GPU or another device raises PlanMismatchError."""
    return on_tensor_cores(device, "nvfp4", "fp4", NVFP4_MIN_CAPABILITY, "10.0 or more: B200, GB200, GB300",
                           "fp8 or bf16")


@functools.cache
def _nvfp4_tensor() -> type:
    """torchao's NVFP4Tensor, imported lazily (only nvfp4 runs import torchao), its CPU warnings quieted."""
    def load():
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

        return NVFP4Tensor

    return _quiet_torchao_import(load)


MIN_TENSOR_SCALE = 2.0 ** -100  # torchao multiplies by 1 / scale / (an e4m3 block scale >= 2^-6): finite in fp32


def per_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 scale of the whole tensor, amax / (6 * 448), at least MIN_TENSOR_SCALE: an all-zero tensor (amax 0) would
    make torchao's reciprocal 1 / 0 and its values 0 * inf = NaN; with the floor its blocks quantise to 0."""
    amax = x.detach().abs().amax().float()
    return torch.clamp(amax / (F4_E2M1_MAX * F8_E4M3_MAX), min=MIN_TENSOR_SCALE)


def quantize(x: torch.Tensor):
    """`x` (rows, K), K a multiple of 16, as an NVFP4Tensor blocked along K (the GEMM's reduction dim)."""
    return _nvfp4_tensor().to_nvfp4(x.contiguous(), block_size=NVFP4_BLOCK, per_tensor_scale=per_tensor_scale(x))


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """quantize then dequantize, in fp32: the values the NVFP4 GEMM multiplies."""
    return quantize(x).dequantize(torch.float32)


def nvfp4_mm(a: torch.Tensor, b: torch.Tensor, tensor_cores: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b^T with a (M, K) and b (N, K) each quantised along K: torch._scaled_mm on fp4 tensor cores
    (NVFP4Tensor's mm: swizzled e4m3 scales, the per-tensor scales applied to the output; untested here), else
    emulated in fp32 on the dequantised operands."""
    qa, qb = quantize(a), quantize(b)
    if tensor_cores:  # NVFP4Tensor's aten.mm: b given as (K, N), its qdata (N, K) contiguous, as _scaled_mm wants
        return torch.mm(qa, qb.t()).to(out_dtype)
    return (qa.dequantize(torch.float32) @ qb.dequantize(torch.float32).t()).to(out_dtype)


def _pad_rows(x: torch.Tensor, multiple: int = NVFP4_BLOCK) -> torch.Tensor:
    """`x` (T, n) with zero rows added up to a multiple of 16 (the wgrad GEMM reduces over T; zeros add nothing)."""
    pad = -x.shape[0] % multiple
    return F.pad(x, (0, 0, 0, pad)) if pad else x


class _NVFP4Matmul(torch.autograd.Function):
    """Y = q(X) q(W)^T; dX = q(G) q(W^T)^T; dW = q(G^T) q(X^T)^T (module docstring). X (T, in), W (out, in)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tensor_cores: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)  # high precision: quantised again in backward
        ctx.tensor_cores = tensor_cores
        return nvfp4_mm(x, weight.to(x.dtype), tensor_cores, x.dtype)  # (T, out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # (T, out) @ (out, in), reduced over out
            grad_x = nvfp4_mm(grad, weight.to(grad.dtype).t(), ctx.tensor_cores, x.dtype)
        if ctx.needs_input_grad[1]:  # (out, T) @ (T, in), reduced over the tokens
            grad_w = nvfp4_mm(_pad_rows(grad).t(), _pad_rows(x.to(grad.dtype)).t(), ctx.tensor_cores, weight.dtype)
        return grad_x, grad_w, None


class NVFP4Linear(nn.Linear):
    """An nn.Linear whose GEMMs run in NVFP4 (module docstring); the bias is added in the input's dtype. Made by
    convert_blocks_to_nvfp4 from an nn.Linear (its class swapped), `tensor_cores` set there."""

    tensor_cores: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (T, in), T = every leading dim
        y = _NVFP4Matmul.apply(flat, self.weight, self.tensor_cores)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def convert_blocks_to_nvfp4(model: nn.Module, block_prefix: str, device: torch.device | str, say=print,
                            tensor_cores: bool | None = None) -> list[str]:
    """Make the nvfp4-convertible Linears under `block_prefix` NVFP4Linears, in place; returns their paths. Others
    stay bf16 (named through `say`); a model none of whose block Linears converts is refused (the plan priced its
    block GEMMs at the fp4 peak). `tensor_cores` None: as the device runs them (nvfp4_on_tensor_cores)."""
    tensor_cores = nvfp4_on_tensor_cores(device) if tensor_cores is None else tensor_cores
    _nvfp4_tensor()  # torchao present, or a PlanMismatchError saying how to get it
    blocks = model.get_submodule(block_prefix)
    converted, skipped = [], []
    for name, module in blocks.named_modules():
        if not isinstance(module, nn.Linear) or type(module) is NVFP4Linear:
            continue
        path = f"{block_prefix}.{name}"
        if not nvfp4_convertible(module):
            skipped.append(f"{path} ({module.in_features} -> {module.out_features})")
            continue
        module.__class__ = NVFP4Linear
        module.tensor_cores = tensor_cores
        converted.append(path)
    if not converted:
        raise PlanMismatchError(f"the plan trains in nvfp4 but no Linear under {block_prefix} has in and out features "
                                f"that are multiples of {NVFP4_DIM_MULTIPLE}: recompile with --precision bf16")
    how = ("torch._scaled_mm on fp4 tensor cores (untested: no Blackwell GPU in zplan's tests)" if tensor_cores
           else "emulated: NVFP4 quantisation, fp32 GEMMs on the dequantised operands")
    say(f"zplan: NVFP4 GEMMs in {len(converted)} block Linears ({how}); bf16 elsewhere")
    if skipped:
        say(f"zplan: kept in bf16 (a dim not a multiple of {NVFP4_DIM_MULTIPLE}): {', '.join(skipped[:4])}"
            + (f" and {len(skipped) - 4} more" if len(skipped) > 4 else ""))
    return converted
