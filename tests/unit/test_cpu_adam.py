"""zplan.cuda.cpu_adam: the C++ AdamW against torch.optim.AdamW (fp32) and against its pure-torch reference
(16-bit gradients in, 16-bit parameter copy out), on odd sizes, and the fallback when the build fails.

The extension builds once per machine (~20-80 s on 2 cores, then cached by torch); each test here is small.
"""

from __future__ import annotations

import sys
import threading
import warnings

import pytest
import torch

from zplan.cuda import cpu_adam, jit

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
# Sizes around the SIMD width (8 AVX2, 16 AVX-512) and the 16384-element OpenMP tile.
ODD_SIZES = [0, 1, 7, 9, 15, 17, 33, 16384 + 3, 3 * 16384 + 5]


@pytest.fixture(scope="module")
def kernel():
    module = cpu_adam.load(warn=False)
    if module is None:
        pytest.skip(f"C++ extension did not build here: {cpu_adam._CPU.error()}")
    return module


def ulp_distance_16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two bf16 (or two fp16) tensors of finite values."""
    def ordered(x):
        bits = x.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def state(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)


def run_both(n, grad_dtype, out_dtype, weight_decay, steps=4, out_offset=0, seed=0):
    """Kernel and reference from the same start over `steps` steps; returns both (p, m, v, out) tuples."""
    p, m, v = state(n, seed)
    p_ref, m_ref, v_ref = p.clone(), m.clone(), v.clone()
    out = out_ref = None
    if out_dtype is not None:
        buffer = torch.empty(n + out_offset, dtype=out_dtype)
        out = buffer[out_offset:]  # out_offset=1: a 2-byte-misaligned view, the plain-store path
        out_ref = torch.empty(n, dtype=out_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        used = cpu_adam.adamw_step_(p, g, m, v, **HYPER, weight_decay=weight_decay, step=step, param_copy_out=out,
                                    threads=2)
        assert used.startswith("cpp-")
        cpu_adam.adamw_step_reference_(p_ref, g, m_ref, v_ref, **HYPER, weight_decay=weight_decay, step=step,
                                       param_copy_out=out_ref)
    return (p, m, v, out), (p_ref, m_ref, v_ref, out_ref)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("fused", [False, True])
def test_fp32_matches_torch_adamw(kernel, weight_decay, fused):
    n = 2 * 16384 + 11
    p, m, v = state(n, 3)
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=weight_decay, fused=fused)
    gen = torch.Generator().manual_seed(4)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen)
        param.grad = g.clone()
        opt.step()
        cpu_adam.adamw_step_(p, g, m, v, **HYPER, weight_decay=weight_decay, step=step, threads=2)
    st = opt.state[param]
    torch.testing.assert_close(p, param.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, st["exp_avg"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_16bit_offload_step_matches_reference(kernel, grad_dtype, out_dtype, weight_decay):
    (p, m, v, out), (p_ref, m_ref, v_ref, out_ref) = run_both(3 * 16384 + 5, grad_dtype, out_dtype, weight_decay)
    torch.testing.assert_close(p, p_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, m_ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(v, v_ref, rtol=1e-6, atol=1e-12)
    # The copy is the kernel's own master rounded to nearest even: bit for bit what torch's .to() gives.
    assert torch.equal(out, p.to(out_dtype))
    # Against the reference's copy: equal except where the fp32 masters differ by an ulp across a rounding
    # boundary (torch's sqrt is not always correctly rounded; the kernel's is), then by 1 ulp of bf16 / fp16.
    assert ulp_distance_16(out, out_ref).max() <= 1
    assert (out != out_ref).float().mean() < 1e-3


@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16)])
def test_odd_sizes(kernel, n, grad_dtype, out_dtype):
    (p, m, v, out), (p_ref, m_ref, v_ref, out_ref) = run_both(n, grad_dtype, out_dtype, 0.05, steps=3, seed=n)
    torch.testing.assert_close(p, p_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, v_ref, rtol=1e-6, atol=1e-12)
    if out is not None:
        assert torch.equal(out, p.to(out_dtype))
        assert n == 0 or ulp_distance_16(out, out_ref).max() <= 1


def test_misaligned_copy_out_equals_aligned(kernel):
    """A 16-bit copy that is not 16-byte aligned takes the plain-store path; results are the same."""
    n = 16384 + 37
    (p_a, _, _, out_a), _ = run_both(n, torch.bfloat16, torch.bfloat16, 0.1, out_offset=0)
    (p_b, _, _, out_b), _ = run_both(n, torch.bfloat16, torch.bfloat16, 0.1, out_offset=1)
    assert out_b.data_ptr() % 16 != 0
    assert torch.equal(p_a, p_b) and torch.equal(out_a, out_b)


def test_lists_of_tensors_equal_one_call_each(kernel):
    sizes = [5, 16384 + 1, 100]
    tensors = [state(n, k) for k, n in enumerate(sizes)]
    grads = [torch.randn(n).to(torch.bfloat16) for n in sizes]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    singles = [tuple(t.clone() for t in ts) for ts in tensors]
    cpu_adam.adamw_step_([t[0] for t in tensors], grads, [t[1] for t in tensors], [t[2] for t in tensors],
                         **HYPER, weight_decay=0.1, step=1, param_copy_out=outs)
    for (p, m, v), g, out, (p1, m1, v1) in zip(tensors, grads, outs, singles, strict=True):
        out1 = torch.empty_like(out)
        cpu_adam.adamw_step_(p1, g, m1, v1, **HYPER, weight_decay=0.1, step=1, param_copy_out=out1)
        assert torch.equal(p, p1) and torch.equal(m, m1) and torch.equal(v, v1) and torch.equal(out, out1)


def test_bad_inputs_are_refused(kernel):
    p, m, v = state(8, 0)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_adam.adamw_step_(p.double(), torch.randn(8), m, v, **HYPER, step=1)
    with pytest.raises(RuntimeError, match="elements"):
        cpu_adam.adamw_step_(p, torch.randn(9), m, v, **HYPER, step=1)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        cpu_adam.adamw_step_(p, torch.randn(8), m, v, **HYPER, step=1, param_copy_out=torch.empty(8))
    with pytest.raises(RuntimeError, match="step"):
        cpu_adam.adamw_step_(p, torch.randn(8), m, v, **HYPER, step=0)


def test_step_releases_the_gil(kernel):
    """A Python thread runs while another thread is inside the C++ step. With a 100 s switch interval Python
    never takes the GIL from a thread that holds it, so the main thread can only read `done` before the step
    ends if the step released the GIL (holding it, the main thread would first run after `done = True`)."""
    n = 1 << 20
    p, m, v = state(n, 5)
    g = torch.randn(n)
    reps = 32  # one call over the same tensors 32 times: ~0.06 s in C++ on one thread (2-core EPYC)
    started, done = threading.Event(), []

    def run():
        started.set()
        cpu_adam.adamw_step_([p] * reps, [g] * reps, [m] * reps, [v] * reps, **HYPER, step=1, threads=1)
        done.append(True)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        started.wait()  # releases the GIL; returns once `run` gives it up: inside the step, or at its end
        ran_during_step = not done
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert done and ran_during_step


def test_build_name_follows_the_simd_level():
    """Each SIMD level is its own build (other flags, another name); the naming itself: tests/unit/test_jit.py."""
    names = {simd: cpu_adam.build_name(simd) for simd in ("avx512", "avx2", "scalar")}
    assert len(set(names.values())) == 3
    assert all(name.startswith(f"zplan_cpu_adam_{simd}_") for simd, name in names.items())
    assert cpu_adam.build_name() == names[cpu_adam.simd_choice()]


def failing_compile(*args, **kwargs):
    raise RuntimeError("Error building extension 'zplan_cpu_adam'\nno compiler")


def test_build_failure_falls_back_to_reference(monkeypatch):
    monkeypatch.setattr(jit, "_LOADED", {})  # this process has tried no build
    monkeypatch.setattr(jit, "_compile", failing_compile)
    n = 37
    p, m, v = state(n, 9)
    p_ref, m_ref, v_ref = p.clone(), m.clone(), v.clone()
    g = torch.randn(n).to(torch.bfloat16)
    out, out_ref = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="build failed.*reference"):
        used = cpu_adam.adamw_step_(p, g, m, v, **HYPER, weight_decay=0.1, step=1, param_copy_out=out)
    assert used == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is given once, not at every step
        assert cpu_adam.backend() == "reference"
        cpu_adam.adamw_step_(p, g, m, v, **HYPER, weight_decay=0.1, step=2, param_copy_out=out)
    for step in (1, 2):
        cpu_adam.adamw_step_reference_(p_ref, g, m_ref, v_ref, **HYPER, weight_decay=0.1, step=step,
                                       param_copy_out=out_ref)
    assert torch.equal(p, p_ref) and torch.equal(m, m_ref) and torch.equal(v, v_ref) and torch.equal(out, out_ref)


def test_a_bad_simd_override_falls_back_to_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(jit, "_LOADED", {})
    monkeypatch.setattr(jit, "_compile", failing_compile)  # never reached: the override is refused first
    monkeypatch.setenv("ZPLAN_CPU_ADAM_SIMD", "avx9000")
    with pytest.raises(ValueError, match="ZPLAN_CPU_ADAM_SIMD"):
        cpu_adam.simd_choice()
    p, m, v = state(5, 3)
    with pytest.warns(RuntimeWarning, match="build failed.*ZPLAN_CPU_ADAM_SIMD.*reference AdamW"):
        assert cpu_adam.adamw_step_(p, torch.zeros(5), m, v, **HYPER, step=1) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_adam.backend() == "reference"
