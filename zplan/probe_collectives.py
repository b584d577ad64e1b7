"""Two-process measurements for zplan.probe: gloo collectives read through the ring formulas, and FSDP2's host
cost per unit."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import torch

from zplan.probe_overheads import reference_input, reference_stack
from zplan.probe_rates import _resident_bytes
from zplan.runtime.launch.distributed import run_distributed
from zplan.schemas.cluster import CollectiveCost, CollectiveCosts

COLLECTIVE_SMALL_BYTES = 8  # two fp32 elements, so that all-gather and reduce-scatter halves are whole
COLLECTIVE_LARGE_BYTES = 8 * 2**20
FSDP_UNITS = (1, 5)  # stack depths whose difference gives the per-unit FSDP2 cost


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
