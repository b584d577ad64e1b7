"""Training step with ZeRO-Infinity's NVMe offload against CPU offload, and how much of the I/O is hidden.

    .venv/bin/python benchmarks/nvme_offload.py [--json] [--path P] [--blocks 4] [--width 1024] [--tokens 256]
                                                [--micro-batches 2] [--steps 5]

One process (gloo), a stack of `--blocks` MLP blocks (width -> 4 width -> width, fp32), FSDP2 ZeRO-3 with
CPUOffloadPolicy, `--micro-batches` micro-batches of `--tokens` tokens per step, in the same run:
  cpu   the runtime's ZeRO-3 CPU offload: sharded parameters, gradients and torch's AdamW on the host;
  nvme  the runtime's ZeRO-3 NVMe offload: the same, with the parameter shards and Adam's moments in files
        under --path (runtime.offload.param_swap, runtime.optim.nvme_states).
The two runs take turns step by step (a change of the machine's load hits both); each step is timed in two
phases, forward+backward of all micro-batches, then the optimizer step; medians of `--steps` steps after a
warm-up. Then the nvme run's I/O alone, no compute, in its engine, one request after another:
  layer I/O  every unit's parameter shards read once per forward and once per backward of each micro-batch;
  step I/O   every unit read and written back, Adam's moments read and written.
Hidden share of each, how much of its I/O time did not add to the phase (clipped to [0, 1]):
    io_hidden_fraction      = 1 - (fb_nvme - fb_cpu) / t_layer_io     the layers' reads, prefetched one unit
                                                                     ahead while a unit computes
    step_io_hidden_fraction = 1 - (opt_nvme - opt_cpu) / t_step_io    the step's reads and writes, which overlap
                                                                     only the CPU Adam of the next sub-group
A layer's compute is longer than its read here (~80 ms forward, ~160 ms backward per unit and micro-batch on 2
cores against ~30 ms to read its 32 MiB shard), the case where the issue asks for >= 70 % hidden. Beside it,
reads_in_time_fraction = 1 - parameter_read_wait_s / t_layer_io: the share of the layers' read time the
training thread did not wait for (runtime.offload.param_swap's own count of its waits). The two differ when
the I/O slows the compute without being waited for: on a machine without a GPU the checksums, the system
calls and the kernel's page work of the reads run on the same cores as the layers. The step's I/O cannot
hide behind the layers: the update needs every gradient first (global gradient-norm clipping), and the CPU
Adam of a sub-group is much shorter than its I/O.

Prints a table, then with --json one JSON object: step_time_cpu_s, step_time_nvme_s, nvme_over_cpu,
forward_backward_{cpu,nvme}_s, optimizer_{cpu,nvme}_s, layer_io_s, step_io_s, io_hidden_fraction (target >=
0.7), parameter_read_wait_s, reads_in_time_fraction, step_io_hidden_fraction, io_bytes_per_step, direct_io,
load_average, config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(blocks: int, width: int, mesh) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                            for _ in range(blocks)])
    policy = CPUOffloadPolicy(pin_memory=False)
    for block in model:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    return fully_shard(model, mesh=mesh, offload_policy=policy)


def interleaved_phase_times(runs: dict[str, tuple[nn.Module, torch.optim.Optimizer]], args) -> dict[str, dict]:
    """Per run, the median seconds of forward+backward ('fb') and of the optimizer step ('opt') over `--steps`
    steps after a warm-up step, the runs taking turns step by step on the same inputs."""
    generator = torch.Generator().manual_seed(1)
    times: dict[str, dict[str, list[float]]] = {name: {"fb": [], "opt": []} for name in runs}
    for _ in range(args.steps + 1):  # the first is a warm-up
        inputs = [torch.randn(args.tokens, args.width, generator=generator) for _ in range(args.micro_batches)]
        for name, (model, optimizer) in runs.items():
            start = time.perf_counter()
            for x in inputs:
                model(x).square().mean().backward()
            middle = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            times[name]["fb"].append(middle - start)
            times[name]["opt"].append(time.perf_counter() - middle)
    return {name: {phase: statistics.median(t[1:]) for phase, t in phases.items()} for name, phases in times.items()}


def io_alone(optimizer, args) -> tuple[float, float, int]:
    """The nvme run's per-step I/O without compute: (layer I/O seconds, step I/O seconds, bytes)."""
    swapper, moments, swap = optimizer.param_swapper, optimizer.moments, optimizer.states.swap
    swapper.bring_all_in()
    swapper.reap(wait=True)
    moved = 0

    def units(write: bool = False) -> None:
        nonlocal moved
        for unit in swapper.units:
            for i, data in enumerate(unit.data):
                move = swap.swap_out if write else swap.swap_in
                swap.wait(move(swapper._name(unit, i), data) if write else move(swapper._name(unit, i), out=data))
                moved += data.numel() * 4

    start = time.perf_counter()
    for _ in range(2 * args.micro_batches):  # forward and backward of each micro-batch
        units()
    layer_s = time.perf_counter() - start
    start = time.perf_counter()
    units()
    units(write=True)
    for k in range(len(moments.sub_groups)):  # the moments read and written
        buffer = moments._buffer(k)
        swap.wait(swap.swap_in(moments._name(k), out=buffer))
        swap.wait(swap.swap_out(moments._name(k), buffer))
        moved += 2 * buffer.numel() * 4
    return layer_s, time.perf_counter() - start, moved


def _hidden(slower_s: float, faster_s: float, io_s: float) -> float:
    return min(1.0, max(0.0, 1.0 - (slower_s - faster_s) / io_s))


def measure(args) -> tuple:
    """Both models' phase times, the parameter reads' wait, and the NVMe I/O alone (one process)."""
    from torch.distributed.device_mesh import init_device_mesh

    from zplan.runtime.optim.layouts import WholeShards
    from zplan.runtime.optim.nvme_states import NvmeStates
    from zplan.runtime.optim.sharded_adamw import ShardedAdamW

    mesh = init_device_mesh("cpu", (1,))
    folder = Path(args.path) if args.path else Path(tempfile.mkdtemp(prefix="nvme-offload-", dir=Path(__file__).parent))

    cpu_model, nvme_model = build(args.blocks, args.width, mesh), build(args.blocks, args.width, mesh)
    optimizer = ShardedAdamW(nvme_model.parameters(), WholeShards(), NvmeStates(folder, swap_parameters_of=nvme_model),
                             lr=1e-3)
    times = interleaved_phase_times({
        "cpu": (cpu_model, torch.optim.AdamW(cpu_model.parameters(), lr=1e-3, fused=True)),
        "nvme": (nvme_model, optimizer)}, args)
    read_wait_s = optimizer.param_swapper.read_wait_s / (args.steps + 1)  # per step, the warm-up included
    layer_io_s, step_io_s, io_bytes = io_alone(optimizer, args)
    direct_io = optimizer.states.swap.direct_io
    optimizer.close()
    if not args.path:
        for leftover in sorted(folder.rglob("*"), reverse=True):
            leftover.rmdir() if leftover.is_dir() else leftover.unlink()
        folder.rmdir()
    return times, read_wait_s, layer_io_s, step_io_s, io_bytes, direct_io


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--path", help="swap folder (default: a temporary folder on the repository's disk)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    from zplan.runtime.launch.distributed import run_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1")
    times, read_wait_s, layer_io_s, step_io_s, io_bytes, direct_io = run_distributed(lambda ctx: measure(args))

    cpu, nvme = times["cpu"], times["nvme"]
    t_cpu, t_nvme = cpu["fb"] + cpu["opt"], nvme["fb"] + nvme["opt"]
    result = {
        "step_time_cpu_s": t_cpu, "step_time_nvme_s": t_nvme, "nvme_over_cpu": t_nvme / t_cpu,
        "forward_backward_cpu_s": cpu["fb"], "forward_backward_nvme_s": nvme["fb"],
        "optimizer_cpu_s": cpu["opt"], "optimizer_nvme_s": nvme["opt"],
        "layer_io_s": layer_io_s, "step_io_s": step_io_s, "parameter_read_wait_s": read_wait_s,
        "reads_in_time_fraction": max(0.0, 1.0 - read_wait_s / layer_io_s),
        "io_hidden_fraction": _hidden(nvme["fb"], cpu["fb"], layer_io_s),
        "step_io_hidden_fraction": _hidden(nvme["opt"], cpu["opt"], step_io_s),
        "io_bytes_per_step": io_bytes, "direct_io": direct_io, "load_average": os.getloadavg()[0],
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "path")},
    }
    print(f"{'':16}{'fwd+bwd':>10}{'step':>10}{'total':>10}")
    for name, t in (("CPU offload", cpu), ("NVMe offload", nvme)):
        print(f"{name:16}{t['fb']:9.3f}s{t['opt']:9.3f}s{t['fb'] + t['opt']:9.3f}s")
    print(f"{'its I/O alone':16}{layer_io_s:9.3f}s{step_io_s:9.3f}s   ({io_bytes / 2**20:.0f} MiB per step, "
          f"{'O_DIRECT' if direct_io else 'buffered'})")
    print(f"the training thread waited {read_wait_s:.3f} s per step for parameter reads: "
          f"{result['reads_in_time_fraction']:.0%} of the layers' read time was not waited for")
    print(f"NVMe over CPU offload: {t_nvme / t_cpu:.2f}x; hidden behind compute: the layers' reads "
          f"{result['io_hidden_fraction']:.0%} (target >= 70%), the step's I/O {result['step_io_hidden_fraction']:.0%}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
