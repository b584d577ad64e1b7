"""Weight-only quantized linear layer: y = x @ dequantize(qw)^T + bias, with the weight kept as INT8 or packed INT4
(group-wise scales, layout in zplan.cuda.weight_quant's docstring) and the activations in floating point.

    from zplan.cuda import weight_only_matmul as wom
    qw = weight_quant.quantize_groupwise(linear.weight, bits=8, group_size=128)
    y = wom.weight_only_linear(x, qw, linear.bias)  # x (..., in) -> y (..., out) in x.dtype

Decoding reads every weight once per generated token, so a decode step is memory-bound: reading one byte (INT8)
or half a byte (INT4) a weight instead of two or four is where the speed comes from (weight-only group-wise
quantization as in GPTQ, Frantar et al. 2023, and AWQ, Lin et al. 2024). That holds only when the floating-point
weight is never written to memory, so for few rows (the decode case) the kernels dequantize inside the dot product:

- CUDA (weight_only_matmul.cu): rows <= GEMV_MAX_ROWS: one warp per output feature reads its int8 / int4 row once
  and accumulates all rows of x in fp32 (GEMV); more rows: dequantize to a buffer in x.dtype, then cuBLAS.
- CPU (weight_only_matmul.cpp, AVX2 + OpenMP, built just in time like cpu_adam.cpp), fp32 or bf16 x: rows <=
  CPU_MAX_ROWS: the same fused GEMV over output features split across threads; more rows: a C++ dequantization
  into an fp32 buffer, then F.linear. Other dtypes, or no C++ build: the reference. benchmarks/weight_only_matmul.py
  measures both paths against fp32 F.linear.

The reference (weight_only_linear_reference) is F.linear(x, dequantize_groupwise(qw).to(x.dtype), bias). The
kernels accumulate in fp32 in another order (and the CPU kernel multiplies each group's partial sum by its scale
once, instead of every weight), so they agree with it to float tolerance, not bit for bit; the buffered paths
(many rows) equal it exactly, since they materialise the same weight and call the same matmul. The kernels are for
inference: where autograd would record (grad enabled and x or bias requiring grad) the reference runs.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from zplan.cuda.jit import JitExtension, SimdLevel, needs_autograd
from zplan.cuda.weight_quant import QuantizedWeight, dequantize_groupwise

CUDA_SOURCE = Path(__file__).with_name("weight_only_matmul.cu")
CPU_SOURCE = Path(__file__).with_name("weight_only_matmul.cpp")
GEMV_MAX_ROWS = 8  # CUDA: rows of x up to which the fused GEMV kernel runs (its per-thread accumulators)
# CPU: rows of x up to which the fused C++ GEMV runs; above, the C++ dequantization + F.linear. The GEMV was 1.5x
# faster than that at 128 rows, about even at 256 (benchmarks/weight_only_matmul.py, 4096 x 4096, 2 cores)
CPU_MAX_ROWS = 128
CPU_SIMD_LEVELS = (SimdLevel("avx2", needs={"avx2", "fma"}, cflags=("-mavx2", "-mfma", "-DZPLAN_AVX2")),
                   SimdLevel("scalar"))

_CUDA = JitExtension(CUDA_SOURCE, cuda=True, variant="cuda", cuda_cflags=("-O3",))
_CPU = JitExtension(CPU_SOURCE, cuda=False, cflags=("-O3", "-fopenmp"), ldflags=("-fopenmp",), simd=CPU_SIMD_LEVELS,
                    simd_env="ZPLAN_WOM_SIMD")


def weight_only_linear_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
                                 ) -> torch.Tensor:
    """F.linear(x, dequantize_groupwise(qw).to(x.dtype), bias): x (..., in) -> (..., out) in x.dtype."""
    _check(x, qw)
    w = dequantize_groupwise(qw).to(device=x.device, dtype=x.dtype)  # (out, in)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def weight_only_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ dequantize(qw)^T + bias -> (..., out) in x.dtype; the fused kernel where one applies (see the
    module docstring), else the reference."""
    _check(x, qw)
    rows = x.numel() // max(x.shape[-1], 1)
    if needs_autograd(x, bias):
        return weight_only_linear_reference(x, qw, bias)  # the kernels record no gradient
    if x.is_cuda:
        module = load_cuda()
        if module is not None and rows > 0 and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return _run_cuda(module, x, qw, bias)
    elif x.device.type == "cpu" and rows > 0 and x.dtype in (torch.float32, torch.bfloat16):
        if load_cpu() is not None:
            return weight_only_linear_cpu(x, qw, bias)
    return weight_only_linear_reference(x, qw, bias)


def _check(x: torch.Tensor, qw: QuantizedWeight) -> None:
    if x.shape[-1] != qw.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} input features but the quantized weight {qw.shape} expects "
                         f"{qw.shape[1]}")


def _zeros_or_empty(qw: QuantizedWeight) -> torch.Tensor:
    if qw.zeros is not None:
        return qw.zeros.contiguous()
    return torch.empty(0, dtype=torch.uint8, device=qw.scales.device)


# --- CPU: weight_only_matmul.cpp ------------------------------------------------------------------------------


def cpu_simd() -> str:
    """'avx2' where this CPU has AVX2 + FMA (x86-64), else 'scalar'; ZPLAN_WOM_SIMD=avx2|scalar overrides (another
    value: ValueError). The CPU's flags are read once: the decode loop asks for the kernel on every matmul."""
    return _CPU.simd_level()


def load_cpu(warn: bool = True):
    """The C++ extension (weight_only_matmul.cpp), built just in time and cached; None (after one warning) when
    the build fails. A ZPLAN_WOM_SIMD naming no level raises ValueError."""
    cpu_simd()  # raises on a bad override, where the builder would fall back to the reference
    return _CPU.load(warn=warn)


def cpu_backend() -> str:
    """'cpp-avx2' / 'cpp-scalar' when the C++ kernel is in use for few-row CPU inputs, else 'reference'."""
    return f"cpp-{cpu_simd()}" if load_cpu() is not None else "reference"


def weight_only_linear_cpu(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                           threads: int = 0, path: str | None = None) -> torch.Tensor:
    """The C++ kernels on CPU tensors; raises where the extension is unavailable. path 'gemv': the fused GEMV (x
    upcast to fp32, fp32 accumulation); 'buffer': the C++ dequantization into an fp32 buffer (bit for bit the
    reference's weight), then F.linear in x.dtype, so bit for bit the reference; None: 'gemv' up to CPU_MAX_ROWS
    rows. threads: OpenMP threads (0: torch.get_num_threads())."""
    _check(x, qw)
    module = load_cpu()
    if module is None:
        raise RuntimeError("zplan.cuda.weight_only_matmul: the C++ kernel is unavailable (build failed)")
    threads = threads or torch.get_num_threads()
    rows = x.numel() // max(x.shape[-1], 1)
    if path == "buffer" or (path is None and rows > CPU_MAX_ROWS):
        w = module.dequantize(qw.qweight.contiguous(), qw.scales.contiguous(), _zeros_or_empty(qw), qw.bits,
                              qw.group_size, qw.shape[1], threads)  # fp32 (out, in)
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()  # (M, in)
    b = torch.empty(0) if bias is None else bias.float().contiguous()
    y = module.gemv(x2, qw.qweight.contiguous(), qw.scales.contiguous(), _zeros_or_empty(qw), b, qw.bits,
                    qw.group_size, threads)  # (M, out) fp32
    return y.to(x.dtype).reshape(*x.shape[:-1], qw.shape[0])


# --- CUDA: weight_only_matmul.cu ------------------------------------------------------------------------------


def load_cuda(strict: bool = False):
    """The weight_only_matmul.cu extension, built just in time where torch.cuda.is_available(); None otherwise or
    when the build failed (after a one-line warning). strict=True raises instead of returning None."""
    return _CUDA.load(strict)


def _run_cuda(module, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
              force_path: str | None = None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, in)
    b = torch.empty(0, dtype=x.dtype, device=x.device) if bias is None else bias.to(x.dtype).contiguous()
    rows = x2.shape[0]
    use_gemv = rows <= GEMV_MAX_ROWS if force_path is None else force_path == "gemv"
    args = (qw.qweight.contiguous(), qw.scales.contiguous(), _zeros_or_empty(qw), qw.bits, qw.group_size)
    if use_gemv:
        y = module.gemv(x2, *args, b)
    else:
        w = module.dequantize_to(*args, qw.shape[1], x.dtype)  # (out, in) in x.dtype
        y = F.linear(x2, w, None if bias is None else b)
    return y.reshape(*x.shape[:-1], qw.shape[0])


def weight_only_linear_cuda(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                            path: str | None = None) -> torch.Tensor:
    """The CUDA kernels on CUDA tensors; path 'gemv' or 'buffer' forces one (tests), None picks by rows."""
    _check(x, qw)
    return _run_cuda(load_cuda(strict=True), x, qw, bias, force_path=path)
