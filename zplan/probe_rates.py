"""One process's measurements for zplan.probe: compute rates, copy and link bandwidths, host memory and disk."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from zplan.cuda.cpu_adam import adamw_step_


def _best_time_s(fn: Callable[[], object], seconds: float, min_repeats: int = 3,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """Fastest of repeated calls of `fn` (after one warm-up call) within about `seconds`, by `clock`
    (wall time; time.process_time for the host work of a call, which other processes' load inflates less)."""
    fn()
    best, deadline, repeats = float("inf"), time.perf_counter() + seconds, 0
    while repeats < min_repeats or time.perf_counter() < deadline:
        start = clock()
        fn()
        best = min(best, clock() - start)
        repeats += 1
    return best


# ---- compute ---------------------------------------------------------------------------------------


def matmul_flops_per_s(n: int, dtype: torch.dtype, seconds: float) -> float:
    """FLOP/s of an n x n by n x n matmul (2 n^3 FLOPs) on the current torch threads."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2.0 * n**3 / _best_time_s(lambda: torch.mm(a, b), seconds, clock=time.process_time)


def mlp_gemm_flops_per_s(tokens: int, hidden: int, seconds: float) -> tuple[float, float]:
    """(x, FLOP/s) of Linear(h, 4h)'s forward + backward GEMMs on `tokens` rows, x = 2 t h 4h the forward's
    FLOPs: Y = X W^T (t x h x 4h), dX = dY W (t x 4h x h), dW = dY^T X (4h x t x h), 3 x FLOPs in all."""
    x, w = torch.randn(tokens, hidden), torch.randn(4 * hidden, hidden)
    dy = torch.randn(tokens, 4 * hidden)

    def forward_backward():
        torch.mm(x, w.t())
        torch.mm(dy, w)
        torch.mm(dy.t(), x)

    flops = 2.0 * tokens * hidden * 4 * hidden
    return flops, 3.0 * flops / _best_time_s(forward_backward, seconds, clock=time.process_time)


def fit_saturating_curve(sizes_flops: list[float], rates: list[float]) -> tuple[float, float]:
    """(R, x_half) of r(x) = R * x / (x + x_half), by least squares of 1/r = 1/R + (x_half/R) / x."""
    xs = [1.0 / x for x in sizes_flops]
    ys = [1.0 / r for r in rates]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    intercept = mean_y - slope * mean_x
    if intercept <= 0:  # no saturation seen: take the fastest measured rate as the asymptote
        return max(rates), min(sizes_flops)
    return 1.0 / intercept, max(slope / intercept, 1.0)


def copy_bandwidth_Bps(num_bytes: int, seconds: float, clock: Callable[[], float] = time.perf_counter) -> float:
    """Bytes read + written per second by dst.copy_(src) of `num_bytes` (by wall time: all threads)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2.0 * num_bytes / _best_time_s(lambda: dst.copy_(src), seconds, clock=clock)


def elementwise_bandwidth_Bps(num_bytes: int, seconds: float) -> float:
    """Bytes read + written per second by torch.add(a, b, out=c) on tensors of `num_bytes`."""
    a, b = torch.ones(num_bytes // 4), torch.ones(num_bytes // 4)
    c = torch.empty_like(a)
    return 3.0 * num_bytes / _best_time_s(lambda: torch.add(a, b, out=c), seconds, clock=time.process_time)


def transformer_elementwise_Bps(num_bytes: int, seconds: float) -> float:
    """Bytes read + written per second by one call each of LayerNorm, tanh-GELU, softmax (rows of 64) and a
    residual add on fp32 tensors of `num_bytes`: a transformer block's memory-bound ops, equal bytes each."""
    a, b = torch.randn(num_bytes // 4), torch.randn(num_bytes // 4)
    rows = a.view(-1, 64)
    ops = (
        (lambda: F.layer_norm(rows, (64,)), 2),  # bytes moved per input byte: read x, write y
        (lambda: F.gelu(a, approximate="tanh"), 2),
        (lambda: torch.softmax(rows, dim=-1), 2),
        (lambda: torch.add(a, b), 3),  # read a, b; write the sum
    )
    total_s = sum(_best_time_s(fn, seconds / len(ops), clock=time.process_time) for fn, _ in ops)
    return sum(moved for _, moved in ops) * num_bytes / total_s


def cpu_adam_params_per_s(num_params: int, seconds: float) -> tuple[float, str]:
    """(parameters per second, backend) of zplan.cuda.cpu_adam.adamw_step_ on fp32 weights, gradients and
    Adam moments of `num_params` each, on torch's current threads (the kernel's default), by wall time."""
    weights, grads = torch.randn(num_params), torch.randn(num_params) * 1e-3
    exp_avg, exp_avg_sq = torch.zeros(num_params), torch.zeros(num_params)
    steps, backends = iter(range(1, 1 << 30)), []

    def one_step():
        backends.append(adamw_step_(weights, grads, exp_avg, exp_avg_sq, lr=1e-4, weight_decay=0.01,
                                    step=next(steps)))

    return num_params / _best_time_s(one_step, seconds), backends[-1]


def host_device_bandwidths_Bps(num_bytes: int, seconds: float) -> tuple[float, float] | None:
    """(host to device, device to host) bytes/s of copies of `num_bytes` between pinned host memory and GPU 0,
    each direction's bytes counted once; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return (num_bytes / _best_time_s(lambda: copy(device, host), seconds),
            num_bytes / _best_time_s(lambda: copy(host, device), seconds))


# ---- host memory and disk ------------------------------------------------------------------------------


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def disk_write_Bps(directory: str, num_bytes: int = 128 * 2**20) -> float:
    """fsync'ed sequential write rate of `num_bytes` into `directory`."""
    return disk_bandwidths_Bps(directory, num_bytes)[0]


def disk_bandwidths_Bps(directory: str, num_bytes: int = 128 * 2**20) -> tuple[float, float]:
    """(write, read) sequential rates of a `num_bytes` file in `directory`, bytes/s: the write fsync'ed,
    the read after its pages were dropped from the page cache (posix_fadvise DONTNEED: works without
    root for clean pages), so that both rates are the device's, not memory's."""
    block = os.urandom(2**20)
    with tempfile.NamedTemporaryFile(dir=directory) as f:
        start = time.perf_counter()
        for _ in range(num_bytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        write_Bps = num_bytes / (time.perf_counter() - start)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        with open(f.name, "rb", buffering=0) as reader:
            while reader.read(len(block)):
                pass
        return write_Bps, num_bytes / (time.perf_counter() - start)
