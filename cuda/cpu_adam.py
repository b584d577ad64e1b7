"""CPU AdamW for ZeRO-Offload: the C++ kernel (cpu_adam.cpp, SIMD + OpenMP) and its pure-torch reference.

    from zplan.cuda import cpu_adam
    cpu_adam.adamw_step_(master, grads_bf16, exp_avg, exp_avg_sq, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.01, step=t, param_copy_out=params_bf16)

One call updates the fp32 master weights and moments in place from fp32, bf16 or fp16 gradients and, when
`param_copy_out` is given, writes the updated parameters rounded to that tensor's dtype (bf16 / fp16) in the
same pass: the offload step of ZeRO-Offload (Ren et al., USENIX ATC'21, section 4), 28 bytes read and written
a parameter instead of the 46 of upcast + AdamW + downcast. Semantics are torch.optim.AdamW's (decoupled weight
decay, bias correction, eps added to sqrt(v) / sqrt(1 - beta2^t)); amsgrad and maximize are not supported.

The extension is built just in time by zplan.cuda.jit (torch.utils.cpp_extension with ninja) on first use, under a
name that carries a hash of the source and of the flags, so an edited source rebuilds and a cached one loads in
~0.1 s. SIMD is picked from this machine's CPU flags: AVX-512 (avx512f + avx512bw + avx512vl + fma + f16c), else
AVX2 (avx2 + fma + f16c), else scalar; ZPLAN_CPU_ADAM_SIMD=avx512|avx2|scalar overrides it. When the build fails
(no compiler, no ninja, a bad override), `adamw_step_` warns once and runs `adamw_step_reference_`, which has the
same semantics in plain torch ops; `backend()` says which one is in use.

The C++ step runs without the GIL (cpu_adam.cpp's binding releases it for the call), so a Python thread may run
it while another runs the model: ZeRO-Offload's delayed parameter update (runtime.optim.host_states).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from zplan.cuda.jit import JitExtension, SimdLevel

SOURCE = Path(__file__).with_name("cpu_adam.cpp")

SIMD_LEVELS = (  # best first
    SimdLevel("avx512", needs={"avx512f", "avx512bw", "avx512vl", "fma", "f16c"},
              cflags=("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c", "-DZPLAN_AVX512")),
    SimdLevel("avx2", needs={"avx2", "fma", "f16c"}, cflags=("-mavx2", "-mfma", "-mf16c", "-DZPLAN_AVX2")),
    SimdLevel("scalar"),
)

_CPU = JitExtension(SOURCE, cuda=False, cflags=("-O3", "-fopenmp", "-ffp-contract=off"), ldflags=("-fopenmp",),
                    simd=SIMD_LEVELS, simd_env="ZPLAN_CPU_ADAM_SIMD", fallback="the pure-torch reference AdamW")

TensorOrList = torch.Tensor | Sequence[torch.Tensor]


def simd_choice() -> str:
    """The SIMD level the extension is built for: the override ZPLAN_CPU_ADAM_SIMD, else the best this CPU has."""
    return _CPU.simd_level()


def build_name(simd: str | None = None) -> str:
    """Extension name at SIMD level `simd` (None: simd_choice()): changes with the source and the flags."""
    return _CPU.build_name(simd)


def load(warn: bool = True):
    """The built extension, building it on first call; None (after a one-line warning) when the build fails."""
    return _CPU.load(warn=warn)


def backend() -> str:
    """'cpp-avx512', 'cpp-avx2', 'cpp-scalar' when the extension is in use, else 'reference'."""
    module = load()
    return f"cpp-{module.simd()}" if module is not None else "reference"


def _as_list(x: TensorOrList | None) -> list[torch.Tensor]:
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


def adamw_step_(params_fp32: TensorOrList, grads: TensorOrList, exp_avg: TensorOrList, exp_avg_sq: TensorOrList,
                *, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                step: int, param_copy_out: TensorOrList | None = None, threads: int = 0, grad_scale: float = 1.0
                ) -> str:
    """One AdamW step in place (torch.optim.AdamW semantics), step counted from 1, on the gradients times
    `grad_scale` (an inverse loss scale and clipping factor; 1.0 reads them as they are).

    params_fp32, exp_avg, exp_avg_sq: contiguous fp32 CPU tensors (or equal-length lists of them); grads: fp32, bf16
    or fp16, same sizes; param_copy_out: None, or bf16/fp16 tensors receiving the updated parameters.
    threads: OpenMP threads (0: torch.get_num_threads()). Returns the backend used ('cpp-avx2', 'reference', ...).
    """
    module = load()
    p, g, m, v, out = (_as_list(x) for x in (params_fp32, grads, exp_avg, exp_avg_sq, param_copy_out))
    if module is None:
        adamw_step_reference_(p, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                              step=step, param_copy_out=out or None, grad_scale=grad_scale)
        return "reference"
    module.adamw_step(p, g, m, v, out, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                      int(step), int(threads), float(grad_scale))
    return f"cpp-{module.simd()}"


@torch.no_grad()
def adamw_step_reference_(params_fp32: TensorOrList, grads: TensorOrList, exp_avg: TensorOrList,
                          exp_avg_sq: TensorOrList, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                          eps: float = 1e-8, weight_decay: float = 0.0, step: int,
                          param_copy_out: TensorOrList | None = None, grad_scale: float = 1.0) -> None:
    """The same step in plain torch ops: upcast the gradient (times grad_scale, rounded to fp32), AdamW in fp32 (the
    order of torch.optim.AdamW's single-tensor path), downcast the parameter into param_copy_out."""
    p_list, g_list, m_list, v_list, out_list = (_as_list(x) for x in (params_fp32, grads, exp_avg, exp_avg_sq,
                                                                      param_copy_out))
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = lr / bias_correction1
    for k, (p, g, m, v) in enumerate(zip(p_list, g_list, m_list, v_list, strict=True)):
        g32 = g.float()
        if grad_scale != 1.0:
            g32 = g32 * torch.tensor(grad_scale, dtype=torch.float32)  # one fp32 multiply, as the kernel does
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g32, 1 - beta1)
        v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        if out_list:
            out_list[k].copy_(p)
