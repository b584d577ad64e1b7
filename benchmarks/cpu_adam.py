"""CPU AdamW (cuda/cpu_adam.cpp) against torch's own CPU AdamW, and against this machine's memory bandwidth.

    .venv/bin/python benchmarks/cpu_adam.py [--json] [--params 100000000] [--reps 7] [--warmup 2]

Three figures, each the median over `--reps` timed repetitions after `--warmup` untimed ones, the two sides of
a ratio alternating which runs first; OpenMP / torch threads = the machine's cores:

(a) speedup_vs_torch_pipeline: the offload step of ZeRO-Offload (bf16 gradients in, fp32 master weights and
    moments updated, bf16 parameters out) done by zplan's kernel in one pass, against torch's three passes over
    preallocated buffers: g32.copy_(g16); torch.optim.AdamW(fused=True).step(); p16.copy_(p32). Target >= 1.3.
(b) speedup_vs_fused: the plain fp32 step (fp32 params and grads) against torch.optim.AdamW(fused=True).
    Target >= 1.0.
(c) bandwidth_fraction: the offload step's bytes over its median time, divided by the best streaming
    bandwidth of a triad a[i] = b[i] + s * c[i] (fp32, 3 arrays of --triad-elems, far larger than the caches,
    OpenMP over the same threads), timed in the same rounds as (a) so both see the same neighbours. Bytes are
    what crosses the memory bus, write-allocate counted where it happens:
      triad:        read b, c (8) + write a (4) + write-allocate a (4, plain stores)         = 16 bytes an element
      offload step: read p, m, v (12) + read g16 (2) + write p, m, v (12) + write p16 (2)    = 28 bytes a param
                    (p, m, v lines are in cache from their reads; the kernel writes p16 with non-temporal
                    stores, so no write-allocate; with plain stores it would be 30)
    bandwidth_fraction_best uses the offload step's best time instead of its median. Target >= 0.7.

The load average is printed with the results: this machine is shared, and other processes take cores and
memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import interleaved_times  # noqa: E402

from zplan.cuda import cpu_adam  # noqa: E402

OFFLOAD_BYTES_PER_PARAM = 28
TRIAD_BYTES_PER_ELEM = 16
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def make_torch_adamw(p32: torch.Tensor, g32: torch.Tensor) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    param = torch.nn.Parameter(p32.clone())
    param.grad = g32
    opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], fused=True)
    return param, opt


def bench_offload(n: int, threads: int, reps: int, warmup: int, triad_elems: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    g16 = torch.randn(n, generator=gen).to(torch.bfloat16)
    p32 = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    p16 = torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def ours():
        step[0] += 1
        cpu_adam.adamw_step_(p32, g16, m, v, **HYPER, step=step[0], param_copy_out=p16, threads=threads)

    g32 = torch.empty(n)
    param, opt = make_torch_adamw(p32, g32)
    p16_torch = torch.empty(n, dtype=torch.bfloat16)

    def torch_pipeline():
        g32.copy_(g16)  # upcast the gradients
        opt.step()  # fused AdamW on fp32
        p16_torch.copy_(param.detach())  # downcast the parameters for the device

    module = cpu_adam.load()
    a, b, c = torch.zeros(triad_elems), torch.rand(triad_elems), torch.rand(triad_elems)

    def triad():
        module.triad(a, b, c, 3.0, threads)

    t_ours, t_torch, t_triad = interleaved_times([ours, torch_pipeline, triad], reps, warmup)
    return {"offload_ours_s": statistics.median(t_ours), "offload_ours_best_s": min(t_ours),
            "offload_torch_pipeline_s": statistics.median(t_torch), "triad_best_s": min(t_triad)}


def bench_fp32(n: int, threads: int, reps: int, warmup: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    g32 = torch.randn(n, generator=gen)
    p32 = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    step = [0]

    def ours():
        step[0] += 1
        cpu_adam.adamw_step_(p32, g32, m, v, **HYPER, step=step[0], threads=threads)

    _, opt = make_torch_adamw(p32, g32)
    t_ours, t_fused = interleaved_times([ours, opt.step], reps, warmup)
    return {"fp32_ours_s": statistics.median(t_ours), "fp32_torch_fused_s": statistics.median(t_fused)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--params", type=int, default=100_000_000, help="parameters in the flat fp32 partition")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions before timing")
    parser.add_argument("--triad-elems", type=int, default=64 * 2**20,
                        help="fp32 elements per triad array (3 arrays; default 256 MiB each)")
    args = parser.parse_args()

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    build_start = time.perf_counter()
    backend = cpu_adam.backend()
    build_s = time.perf_counter() - build_start
    if cpu_adam.load(warn=False) is None:
        sys.exit("benchmarks/cpu_adam.py: the C++ extension did not build; nothing to measure")

    load_before = os.getloadavg()
    offload = bench_offload(args.params, threads, args.reps, args.warmup, args.triad_elems)
    fp32 = bench_fp32(args.params, threads, args.reps, args.warmup)
    load_after = os.getloadavg()

    n = args.params
    offload_bytes_per_s = OFFLOAD_BYTES_PER_PARAM * n / offload["offload_ours_s"]
    triad_bytes_per_s = TRIAD_BYTES_PER_ELEM * args.triad_elems / offload["triad_best_s"]
    result = {
        "params": n,
        "threads": threads,
        "backend": backend,
        "build_or_load_s": round(build_s, 3),
        **{k: round(val, 5) for k, val in offload.items()},
        **{k: round(val, 5) for k, val in fp32.items()},
        "speedup_vs_torch_pipeline": round(offload["offload_torch_pipeline_s"] / offload["offload_ours_s"], 3),
        "speedup_vs_fused": round(fp32["fp32_torch_fused_s"] / fp32["fp32_ours_s"], 3),
        "triad_gb_s": round(triad_bytes_per_s / 1e9, 2),
        "offload_gb_s": round(offload_bytes_per_s / 1e9, 2),
        "bandwidth_fraction": round(offload_bytes_per_s / triad_bytes_per_s, 3),
        "bandwidth_fraction_best": round(OFFLOAD_BYTES_PER_PARAM * n / offload["offload_ours_best_s"]
                                         / triad_bytes_per_s, 3),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
    }
    if not args.json:
        rows = [
            ("offload step (bf16 g in, bf16 p out): zplan one pass", f"{offload['offload_ours_s'] * 1e3:.1f} ms"),
            ("  torch: upcast + AdamW(fused) + downcast", f"{offload['offload_torch_pipeline_s'] * 1e3:.1f} ms"),
            ("  speedup_vs_torch_pipeline (target >= 1.3)", f"{result['speedup_vs_torch_pipeline']:.2f}x"),
            ("fp32 step: zplan", f"{fp32['fp32_ours_s'] * 1e3:.1f} ms"),
            ("  torch.optim.AdamW(fused=True)", f"{fp32['fp32_torch_fused_s'] * 1e3:.1f} ms"),
            ("  speedup_vs_fused (target >= 1.0)", f"{result['speedup_vs_fused']:.2f}x"),
            ("triad bandwidth (16 B/elem, best)", f"{result['triad_gb_s']:.1f} GB/s"),
            ("offload step bandwidth (28 B/param, median)", f"{result['offload_gb_s']:.1f} GB/s"),
            ("  bandwidth_fraction (target >= 0.7)", f"{result['bandwidth_fraction']:.2f}"),
            ("  bandwidth_fraction_best (best offload step)", f"{result['bandwidth_fraction_best']:.2f}"),
        ]
        print(f"CPU AdamW, {n / 1e6:.1f}M params, {threads} threads, backend {backend}, "
              f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
        width = max(len(r[0]) for r in rows)
        for name, value in rows:
            print(f"  {name:<{width}}  {value:>10}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
