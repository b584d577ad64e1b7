"""Measure this machine into a ClusterSpec where every CPU process plays the part of one GPU.

    python -m zplan.probe [SECONDS]      # prints the ClusterSpec as JSON

One "device" = one training process pinned to one core (torchrun sets OMP_NUM_THREADS=1 when it
starts several processes), so compute and device-memory numbers are measured with one thread, and
the node holds as many devices as the machine has cores. Times are the fastest of repeated runs: the
machine's own cost, with as little as possible of other processes' load; what one thread computes is
timed in CPU time (time.process_time), which does not count the time another process held the core.
What each number is:

- peak_fp32_flops, efficiency.gemm_half_flops: the asymptote R and half point x_half of the rate
  r(x) = R * x / (x + x_half) fitted (least squares of 1/r against 1/x, a straight line) to the
  forward + backward GEMMs of a transformer's MLP up-projection, Linear(h, 4h) on t tokens, timed as
  the three matmuls autograd runs (Y = X W^T, dX = dY W, dW = dY^T X; 3 x 2 t h 4h FLOPs) at the
  shapes of MLP_GEMM_SHAPES, with x = 2 t h 4h: the GEMM and the x at which planner/cost/compute.py
  evaluates the curve. Skinny GEMMs (h = 32..64) run far below square ones of the same FLOPs on a CPU.
  These are achieved rates, not data-sheet peaks, so efficiency.gemm_max = 1.
- peak_{bf16,fp16}_flops: one square GEMM (n = 256), raised to the asymptote along the fp32 curve:
  torch runs them on a CPU through a slow path where the CPU lacks AVX512-BF16/AMX/FP16 (a measured
  rate far below fp32 is then the truth, and the planner should see it).
- hbm_bandwidth_Bps: one process's copy bandwidth (bytes read + written per second of a tensor far
  larger than the caches), capped at the node's bandwidth divided by the processes sharing it.
- efficiency.memory_bound: the fraction of one core's copy bandwidth an elementwise op (c = a + b)
  achieves (the streaming of the optimizer step).
- efficiency.activation_ops: bytes read + written per second by the activation ops of a transformer
  block (LayerNorm, tanh-GELU, softmax, residual add; one call each on ELEMENTWISE_BYTES), over
  hbm_bandwidth_Bps. On a CPU they are compute-bound (GELU's tanh, the normalisations), far below a copy.
- cpu_memory_bandwidth_Bps: copy bandwidth of the node with every core (torch's default threads).
- host_overheads.op_s: host seconds per aten op of a training step, from one forward + backward of a
  stack of pre-LayerNorm GPT blocks (examples/gpt.py's structure) at negligible sizes (width 8, 4 tokens),
  divided by the aten ops it dispatched (counted with a TorchDispatchMode): dispatcher, autograd and
  Python module calls, with no arithmetic to speak of. Timed in CPU time (time.process_time), the
  process's own work, which other processes on the cores inflate far less than wall time.
- host_overheads.{selective,full}_recompute_s: what zplan's activation recompute (torch's selective
  checkpoint, a Python dispatch mode over every op of the block; torch.utils.checkpoint) adds per block
  to the same forward + backward, in CPU time: the machinery and the re-run ops, with no arithmetic.
- collectives (gloo between two spawned processes, each of all-reduce, all-gather, reduce-scatter):
  the time of an 8-byte and a COLLECTIVE_LARGE_BYTES message gives the fixed cost and the bandwidth of
  that type, read through the ring formulas of planner/cost/comm.py for two ranks:
  all-reduce S / B + 2 latency; all-gather, reduce-scatter S / (2 B) + latency.
  intra_node_bandwidth_Bps and intra_node_latency_s are the all-reduce's (link fraction 1). There is
  no second node: inter-node numbers repeat them.
- host_overheads.sharded_unit_s: the host CPU time one FSDP2 unit (fully_shard, reshard_after_forward=True,
  the ZeRO-3 of zplan's runtime) adds per forward + backward: the slope over the number of units
  (FSDP_UNITS) of a stack of FSDP2-wrapped reference blocks, less the slope of the same stack without
  FSDP2, both in CPU time (hooks, copy-in/out, DTensor bookkeeping; the waits inside its collectives are
  not CPU time, and the cost model prices them with the collective costs above).
- overlaps_comm_with_compute: False, gloo runs its collectives on the cores that compute.
- host_to_device_bandwidth_Bps: the "device" is host memory, so a copy: the per-process bandwidth. On a
  machine with a GPU (torch.cuda.is_available()), the pinned-memory copy rate from the host to GPU 0, and
  device_to_host_bandwidth_Bps the rate back: what offloaded states cross in a run there.
- cpu_adam_params_per_s: parameters per second of zplan.cuda.cpu_adam.adamw_step_ (its C++ kernel, or the
  pure-torch reference where that does not build; the profile's source says which) on fp32 weights,
  gradients and moments of CPU_ADAM_PARAMS each (4 x 64 MiB, far beyond the caches), with every core
  (torch's default threads): the node's ZeRO-Offload CPU step, which planner/cost/offload.py shares
  among the node's devices.
- hbm_bytes: 70 % of host RAM divided by the processes, whole GiB; cpu_memory_bytes: host RAM.
- nvme_bytes, nvme_bandwidth_Bps: free space and fsync'ed write rate of the temporary directory.
- framework_reserve_bytes: resident memory of a process that imported torch and joined gloo.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zplan.schemas.cluster import (
    CPU_PROCESS_GPU,
    ClusterSpec,
    CollectiveCost,
    CollectiveCosts,
    EfficiencySpec,
    GpuSpec,
    HostOverheads,
)

GiB = 1024**3
HOST_SHARE_FOR_DEVICES = 0.7  # fraction of host RAM handed to the device processes
# (tokens, h) of the Linear(h, 4h) forward + backward GEMMs the fp32 curve is fitted to: x = 2 t h 4h
MLP_GEMM_SHAPES = ((64, 32), (256, 32), (64, 64), (256, 64), (1024, 64), (256, 128), (1024, 128), (1024, 256),
                   (2048, 512))
HALF_PRECISION_SIZE = 256  # n of the bf16/fp16 GEMM (slow paths on CPUs without native support)
ELEMENTWISE_BYTES = 16 * 2**20  # tensor size for the memory-bound ops (beyond the L2 cache)
COLLECTIVE_SMALL_BYTES = 8  # two fp32 elements, so that all-gather and reduce-scatter halves are whole
COLLECTIVE_LARGE_BYTES = 8 * 2**20
REFERENCE_WIDTH, REFERENCE_HEADS, REFERENCE_TOKENS = 8, 2, 4  # negligible sizes: time = host overhead
OVERHEAD_BLOCKS = 4  # reference blocks in the op-overhead stack
FSDP_UNITS = (1, 5)  # stack depths whose difference gives the per-unit FSDP2 cost
CPU_ADAM_PARAMS = 16 * 2**20  # fp32 parameters of the CPU Adam measurement: 4 states of 64 MiB each
HOST_DEVICE_BYTES = 256 * 2**20  # size of the pinned host <-> GPU copies


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
    from zplan.cuda.cpu_adam import adamw_step_

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


# ---- host overhead per op ----------------------------------------------------------------------------


class ReferenceBlock(nn.Module):
    """A pre-LayerNorm GPT block (examples/gpt.py's structure) to time host overheads at negligible sizes."""

    def __init__(self, hidden: int = REFERENCE_WIDTH, heads: int = REFERENCE_HEADS):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        batch, seq, hidden = x.shape
        y = self.ln1(x)
        q, k, v = (proj(y).view(batch, seq, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, a, T, d)
        x = x + self.o(attention.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class ReferenceStack(nn.Module):
    """`blocks` reference blocks in a ModuleList named 'blocks', as zplan's runtime finds a model's blocks."""

    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(ReferenceBlock() for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        return x


def reference_stack(blocks: int) -> ReferenceStack:
    return ReferenceStack(blocks)


def reference_input() -> torch.Tensor:
    return torch.randn(1, REFERENCE_TOKENS, REFERENCE_WIDTH)  # (B, T, h)


def count_aten_ops(fn: Callable[[], object]) -> int:
    """aten ops dispatched by one call of `fn` (the ops the cost model counts per block)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.ops += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.ops


def host_seconds_per_op(seconds: float) -> float:
    """Forward + backward of OVERHEAD_BLOCKS reference blocks at negligible sizes, per aten op dispatched."""
    model, x = reference_stack(OVERHEAD_BLOCKS), reference_input()

    def forward_backward():
        model(x).sum().backward()

    forward_backward()  # gradients exist from here on, as in every micro-batch after a step's first
    return _best_time_s(forward_backward, seconds, clock=time.process_time) / count_aten_ops(forward_backward)


def host_seconds_per_recompute(mode: str, seconds: float) -> float:
    """CPU seconds activation recompute (zplan's runtime: runtime.training.recompute.apply_recompute) adds per block to
    a forward + backward of OVERHEAD_BLOCKS reference blocks at negligible sizes: its machinery and re-run ops."""
    from zplan.runtime.training.recompute import apply_recompute

    x = reference_input()
    times = []
    for recompute in ("none", mode):
        model = apply_recompute(reference_stack(OVERHEAD_BLOCKS), recompute, "blocks")
        times.append(_best_time_s(lambda model=model: model(x).sum().backward(), seconds / 2, clock=time.process_time))
    return max(0.0, (times[1] - times[0]) / OVERHEAD_BLOCKS)


# ---- two processes: gloo collectives, FSDP2 ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _synced_best_s(fn: Callable[[], object], seconds: float, min_repeats: int,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Fastest call of `fn` on this rank by `clock`, each call started after a barrier so that both ranks
    enter together."""
    import torch.distributed as dist

    def after_barrier():
        dist.barrier()
        start = clock()
        fn()
        return clock() - start

    def any_rank_continues(more: bool) -> bool:  # every rank must run the same number of calls
        flag = torch.tensor([1.0 if more else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    after_barrier()
    best, deadline, repeats = float("inf"), time.perf_counter() + seconds, 0
    while any_rank_continues(repeats < min_repeats or time.perf_counter() < deadline):
        best = min(best, after_barrier())
        repeats += 1
    return best


def _collective_times_s(seconds: float) -> dict[str, tuple[float, float]]:
    """Per collective type, (time of the small message, time of the large one), S = the full tensor."""
    import torch.distributed as dist

    times = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        pair = []
        for size in (COLLECTIVE_SMALL_BYTES, COLLECTIVE_LARGE_BYTES):
            full, half = torch.ones(size // 4), torch.ones(size // 8)
            run = {
                "all_reduce": lambda full=full: dist.all_reduce(full),
                "all_gather": lambda full=full, half=half: dist.all_gather_into_tensor(full, half),
                "reduce_scatter": lambda full=full, half=half: dist.reduce_scatter_tensor(half, full),
            }[kind]
            small = size == COLLECTIVE_SMALL_BYTES
            pair.append(_synced_best_s(run, seconds / 8, min_repeats=20 if small else 3))
        times[kind] = (pair[0], pair[1])
    return times


def collective_costs(times: dict[str, tuple[float, float]]) -> CollectiveCosts:
    """Read two-rank times through the ring formulas of planner/cost/comm.py: all-reduce t = S/B + 2 lat;
    all-gather, reduce-scatter t = S/(2B) + lat."""
    ring = {"all_reduce": (1.0, 2.0), "all_gather": (0.5, 1.0), "reduce_scatter": (0.5, 1.0)}
    costs = {}
    for kind, (small_s, large_s) in times.items():
        share, steps = ring[kind]
        per_byte_s = max(large_s - small_s, 1e-12) / (COLLECTIVE_LARGE_BYTES - COLLECTIVE_SMALL_BYTES)
        costs[kind] = CollectiveCost(latency_s=small_s / steps, bandwidth_Bps=share / per_byte_s)
    return CollectiveCosts(**costs)


def _fsdp_stack_cpu_s(blocks: int, sharded: bool, seconds: float) -> float:
    """Forward + backward CPU seconds of a stack of reference blocks, each an FSDP2 unit when `sharded`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model, x = reference_stack(blocks), reference_input()
    if sharded:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return _synced_best_s(lambda: model(x).sum().backward(), seconds, min_repeats=5, clock=time.process_time)


def sharded_unit_overhead_s(seconds: float) -> float:
    """Host CPU seconds an FSDP2 unit adds per forward + backward: the slope over units of the FSDP2 stack less
    that of the plain stack. CPU time leaves out the waits inside the collectives, which the cost model
    prices with the collective costs."""
    few, many = FSDP_UNITS
    fsdp = _fsdp_stack_cpu_s(many, True, seconds / 4) - _fsdp_stack_cpu_s(few, True, seconds / 4)
    plain = _fsdp_stack_cpu_s(many, False, seconds / 4) - _fsdp_stack_cpu_s(few, False, seconds / 4)
    return max(0.0, (fsdp - plain) / (many - few))


def _two_process_worker(rank: int, port: int, seconds: float, results) -> None:
    from zplan.runtime.launch.distributed import run_distributed

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))

    def measure(ctx) -> None:
        costs = collective_costs(_collective_times_s(seconds / 2))
        unit_s = sharded_unit_overhead_s(seconds / 2)
        if rank == 0:
            results.put((costs.model_dump(), unit_s, _resident_bytes()))

    run_distributed(measure)


def gloo_two_processes(seconds: float) -> tuple[CollectiveCosts, float, int]:
    """(collective costs, FSDP2 host seconds per unit, resident bytes of one worker) from two spawned
    processes joined by gloo over TCP loopback."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(_two_process_worker, args=(_free_port(), seconds, results), nprocs=2, join=True)
    costs, unit_s, resident = results.get()
    return CollectiveCosts.model_validate(costs), unit_s, resident


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


# ---- the profile ----------------------------------------------------------------------------------------


def _one_core_numbers(unit: float, node_copy_Bps: float, processes: int) -> dict:
    """Everything measured on one thread (one device = one process on one core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sizes, rates = zip(*(mlp_gemm_flops_per_s(t, h, unit / 2) for t, h in MLP_GEMM_SHAPES), strict=True)
        fp32_rate, half_flops = fit_saturating_curve(list(sizes), list(rates))
        # bf16/fp16: one square size, raised to the asymptote along the fp32 curve.
        half_size_flops = 2.0 * HALF_PRECISION_SIZE**3
        along_curve = half_size_flops / (half_size_flops + half_flops)
        one_core_copy_Bps = copy_bandwidth_Bps(256 * 2**20, unit, clock=time.process_time)
        # Processes stream at the same time: each gets at most its share of the node's bandwidth.
        process_copy_Bps = min(one_core_copy_Bps, node_copy_Bps / processes)
        return {
            "fp32": fp32_rate, "half_flops": half_flops,
            "bf16": matmul_flops_per_s(HALF_PRECISION_SIZE, torch.bfloat16, unit) / along_curve,
            "fp16": matmul_flops_per_s(HALF_PRECISION_SIZE, torch.float16, unit) / along_curve,
            "process_copy_Bps": process_copy_Bps,
            "memory_bound": min(1.0, elementwise_bandwidth_Bps(256 * 2**20, unit) / one_core_copy_Bps),
            # over hbm_bandwidth_Bps, so that the cost model's hbm_bandwidth_Bps * activation_ops is the rate measured
            "activation_ops": min(1.0, transformer_elementwise_Bps(ELEMENTWISE_BYTES, unit) / process_copy_Bps),
            "op_s": host_seconds_per_op(unit),
            "selective_recompute_s": host_seconds_per_recompute("selective", unit),
            "full_recompute_s": host_seconds_per_recompute("full", unit),
        }
    finally:
        torch.set_num_threads(threads)


def probe_this_machine(seconds_budget: float = 10, nvme_path: str | None = None) -> ClusterSpec:
    """Measure this machine (about 2-3 x `seconds_budget` seconds) into a ClusterSpec named 'cpu-local'.
    `nvme_path`: the folder offloaded states would be swapped to (default: the temporary directory);
    its free space and the slower of its sequential write and read rates are the profile's NVMe."""
    processes = os.cpu_count() or 1
    unit = seconds_budget / 30  # per measurement: ~18 of them plus process start-up fill the budget
    node_copy_Bps = copy_bandwidth_Bps(512 * 2**20, unit)
    adam_params_per_s, adam_backend = cpu_adam_params_per_s(CPU_ADAM_PARAMS, 2 * unit)
    link = host_device_bandwidths_Bps(HOST_DEVICE_BYTES, unit)
    one = _one_core_numbers(unit, node_copy_Bps, processes)
    costs, sharded_unit_s, resident_bytes = gloo_two_processes(12 * unit)
    host_bytes = host_memory_bytes()
    disk = nvme_path or tempfile.gettempdir()
    disk_write, disk_read = disk_bandwidths_Bps(disk)
    device_bytes = int(HOST_SHARE_FOR_DEVICES * host_bytes / processes) // GiB * GiB
    all_reduce = costs.all_reduce
    return ClusterSpec(
        name="cpu-local",
        description=f"this machine: {processes} CPU processes (one core each) as devices, gloo",
        source=f"measured by zplan.probe.probe_this_machine (CPU Adam: {adam_backend}"
               + ("; host-device: pinned copies to GPU 0)" if link else ")"),
        gpu=GpuSpec(
            name=CPU_PROCESS_GPU,
            hbm_bytes=max(device_bytes, GiB),
            hbm_bandwidth_Bps=one["process_copy_Bps"],
            peak_bf16_flops=one["bf16"],
            peak_fp16_flops=one["fp16"],
            peak_fp32_flops=one["fp32"],
        ),
        gpus_per_node=processes,
        intra_node_bandwidth_Bps=all_reduce.bandwidth_Bps,
        inter_node_bandwidth_Bps=all_reduce.bandwidth_Bps,
        host_to_device_bandwidth_Bps=link[0] if link else one["process_copy_Bps"],
        device_to_host_bandwidth_Bps=link[1] if link else None,
        intra_node_latency_s=all_reduce.latency_s,
        inter_node_latency_s=all_reduce.latency_s,
        cpu_memory_bytes=host_bytes,
        cpu_memory_bandwidth_Bps=node_copy_Bps,
        cpu_adam_params_per_s=adam_params_per_s,
        nvme_bytes=os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize,
        nvme_bandwidth_Bps=min(disk_write, disk_read),  # swapping both reads and writes
        framework_reserve_bytes=resident_bytes,
        efficiency=EfficiencySpec(
            gemm_max=1.0,
            gemm_half_flops=one["half_flops"],
            memory_bound=one["memory_bound"],
            activation_ops=one["activation_ops"],
            intra_node_link=1.0,
            inter_node_link=1.0,
            host_link=1.0,
        ),
        overlaps_comm_with_compute=False,
        collectives=costs,
        host_overheads=HostOverheads(op_s=one["op_s"], sharded_unit_s=sharded_unit_s,
                                     selective_recompute_s=one["selective_recompute_s"],
                                     full_recompute_s=one["full_recompute_s"]),
    )


if __name__ == "__main__":
    print(probe_this_machine(float(sys.argv[1]) if len(sys.argv) > 1 else 10).model_dump_json(indent=2))
