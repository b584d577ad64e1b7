"""Predicted against measured on this machine: the planner's step time and model-state bytes for 8 plans
of examples/tiny.py on the cpu-local profile, against the emitted train.py run on 1 or 2 processes;
the Spearman rank correlation of the step times, and where the measured time goes.

    .venv/bin/python benchmarks/predicted_vs_measured.py [--json] [--steps 12] [--rounds 3] [--no-breakdown]
    .venv/bin/python benchmarks/predicted_vs_measured.py --model benchmarks/_small_gpt.py --global-batch 4 --steps 8

Each plan is `zplan compile MODEL --gpus G --cluster cpu-local --precision fp32 --tp 1 --pp 1 --zero Z
--micro-batch M [--dp 1] --recompute R --global-batch B -o DIR`: ZeRO 0-3, data parallel 1 and 2,
micro-batches from B down to 1 (1 to 4 per step), recompute none / selective / full. The emitted
train.py runs with `--steps N --log-json log.jsonl` on G processes (gloo, one thread each, started as
torchrun starts them), the 8 plans one after the other, in `--rounds` rounds; a round's step time of a
plan is the median of the logged step_time_s over the steps after the first 3, and the measured step
time is the fastest round's: other processes on the machine (its load comes and goes over seconds)
slow whichever plan runs while they do, and the round least disturbed is the nearest to the machine
itself. The model-state bytes are the script's own (logged next to the plan's).

The breakdown (on by default) reruns two of the 2-process plans (ZeRO 0 with DDP, and ZeRO 3 with
FSDP2 over 4 micro-batches) with the runtime's calls, timing each phase of a step (data, forward,
backward with its communication, clipping, optimizer, the logging all-reduce) in wall and CPU time,
the same step without data parallelism (compute only), the aten ops and collectives per step,
torch.profiler's top operators, each Linear's GEMM against the profile's efficiency curve, gloo's
all-reduce latency and bandwidth and the cost of one tiny aten op. The machine's load average is
printed: the emitted scripts' step times are wall times, which other processes on the 2 cores inflate.
Target: rank_correlation >= 0.8. Takes about 2 minutes on a quiet 2-core machine (5 loaded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    ROOT,
    TINY,
    compile_plan_files,
    launch,
    load_average,
    median,
    run_workers,
    spearman,
    write_result,
)

SKIP_STEPS = 3  # left out of each run's median: lazy initialisation, first allocations, warm caches
SEED = 0


def plan_grid(global_batch: int) -> list[dict]:
    """The plans: (gpus, ZeRO, micro-batch, recompute), spanning dp 1/2, ZeRO 0-3, 1-4 micro-batches."""
    b = global_batch
    grid = [
        (1, 0, b, "none"), (1, 0, max(1, b // 4), "none"),
        (2, 0, b // 2, "none"), (2, 1, max(1, b // 4), "none"), (2, 2, b // 2, "none"),
        (2, 3, max(1, b // 8), "none"), (2, 0, b // 2, "full"), (2, 3, b // 2, "selective"),
    ]
    return [{"gpus": g, "zero": z, "micro_batch": m, "recompute": r} for g, z, m, r in grid]


def _label(p: dict) -> str:
    return f"dp{p['gpus']} ZeRO-{p['zero']} mb{p['micro_batch']}x{p['num_micro_batches']} {p['recompute']}"


def _row(spec: dict, plan, plan_runs: list[tuple[list[dict], float]]) -> dict:
    """One plan's result: the fastest round's median step time, every round's median and load average."""
    round_medians = [median([r["step_time_s"] for r in records[SKIP_STEPS:]]) for records, _ in plan_runs]
    best = min(range(len(plan_runs)), key=lambda k: round_medians[k])
    records = plan_runs[best][0]
    kept = [r["step_time_s"] for r in records[SKIP_STEPS:]]
    par = plan.parallel
    return {
        "gpus": spec["gpus"], "zero": par.zero_stage, "micro_batch": par.micro_batch,
        "num_micro_batches": par.num_micro_batches, "recompute": par.recompute,
        "predicted_step_s": plan.prediction.step_time_s, "measured_step_s": round_medians[best],
        "measured_step_s_quartiles": statistics.quantiles(kept, n=4) if len(kept) > 1 else kept,
        "measured_step_s_by_round": round_medians, "load_average_by_round": [load for _, load in plan_runs],
        "predicted_time_breakdown": plan.prediction.time.model_dump(),
        "predicted_model_state_bytes": records[0]["predicted_model_state_bytes"],
        "measured_model_state_bytes": records[0]["model_state_bytes"],
        "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"],
    }


def run_plan(out_dir: Path, gpus: int, steps: int) -> list[dict]:
    """Run the emitted train.py on `gpus` processes; its per-step JSON records."""
    log = out_dir / "log.jsonl"
    launch([out_dir / "train.py", "--steps", steps, "--seed", SEED, "--log-json", log], gpus, timeout_s=600)
    return [json.loads(line) for line in log.read_text().splitlines()]


# ---- the breakdown worker: one plan, timed phase by phase -------------------------------------------------


class _CountOps:
    """Counts aten ops dispatched while active (a TorchDispatchMode)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def _phase_times(model, optimizer, data, loss_fn, num_micro: int, steps: int, distributed: bool,
                 skip: int = SKIP_STEPS) -> dict:
    """Median seconds per step of each phase of train()'s loop body (runtime/training/loop.py), by perf_counter;
    total_cpu: this process's CPU seconds per step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    phases = {k: [] for k in ("data", "forward", "backward", "clip", "optimizer", "zero_grad", "log_allreduce",
                              "total", "total_cpu")}
    for step in range(steps):
        t0, cpu0 = time.perf_counter(), time.process_time()
        acc = dict.fromkeys(phases, 0.0)
        loss_sum = torch.zeros(())
        for micro in range(num_micro):
            a = time.perf_counter()
            batch = next(data)
            b = time.perf_counter()
            no_sync = isinstance(model, DistributedDataParallel) and micro < num_micro - 1
            with model.no_sync() if no_sync else contextlib.nullcontext():
                loss = loss_fn(model(batch), batch) / num_micro
                c = time.perf_counter()
                loss.backward()
            d = time.perf_counter()
            loss_sum += loss.detach()
            acc["data"] += b - a
            acc["forward"] += c - b
            acc["backward"] += d - c
        a = time.perf_counter()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # FSDP2: all-reduces the norm
        b = time.perf_counter()
        optimizer.step()
        c = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        d = time.perf_counter()
        if distributed:
            dist.all_reduce(loss_sum)
        loss_sum.item()
        e = time.perf_counter()
        acc.update(clip=b - a, optimizer=c - b, zero_grad=d - c, log_allreduce=e - d, total=e - t0,
                   total_cpu=time.process_time() - cpu0)
        if step >= skip:
            for k, v in acc.items():
                phases[k].append(v)
    return {k: statistics.median(v) for k, v in phases.items()}


def _gemm_check(model, tokens: int, cluster) -> list[dict]:
    """Each distinct Linear shape at `tokens` rows: measured forward time against the profile's
    FLOPs / (peak * eff(x)), eff(x) = gemm_max * x / (x + gemm_half_flops) (planner/cost/compute.py)."""
    import torch
    import torch.nn.functional as F

    eff = cluster.efficiency
    rows, seen = [], set()
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module.weight.shape in seen:
            continue
        seen.add(module.weight.shape)
        out_features, in_features = module.weight.shape
        x = torch.randn(tokens, in_features)
        times = []
        for _ in range(30):
            a = time.perf_counter()
            F.linear(x, module.weight.detach(), None if module.bias is None else module.bias.detach())
            times.append(time.perf_counter() - a)
        flops = 2.0 * tokens * in_features * out_features
        predicted = flops / (cluster.gpu.peak_fp32_flops * eff.gemm_max * flops / (flops + eff.gemm_half_flops))
        rows.append({"shape": [tokens, in_features, out_features], "flops": flops,
                     "measured_s": statistics.median(times[5:]), "predicted_s": predicted})
    return rows


def _breakdown_one(plan, model_file, ctx, steps: int) -> dict:
    import torch

    from zplan.runtime import (
        apply_data_parallel,
        apply_recompute,
        build_mesh,
        build_model,
        build_optimizer,
        make_data_iter,
    )

    p, prefix = plan.parallel, plan.model.block_prefix
    mesh = build_mesh(pp=1, dp=p.dp, tp=1, device_type="cpu")

    def fresh(distributed: bool):
        model = build_model(model_file.build_model, seed=SEED, device=ctx.device)
        model = apply_recompute(model, p.recompute, prefix)
        if distributed:
            model = apply_data_parallel(model, mesh["dp"], p.zero_stage, "fp32", p.offload, prefix)
            optimizer = build_optimizer(model, mesh["dp"], p.zero_stage, lr=3e-4, weight_decay=0.1,
                                        offload=p.offload)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        data = make_data_iter(model_file, vocab=plan.model.vocab, seq_len=plan.train.seq_len,
                              micro_batch=p.micro_batch, num_micro_batches=p.num_micro_batches,
                              dp_rank=ctx.rank, dp_size=p.dp, seed=SEED)
        return model, optimizer, data

    out = {"plan": {"dp": p.dp, "zero": p.zero_stage, "micro_batch": p.micro_batch,
                    "num_micro_batches": p.num_micro_batches, "recompute": p.recompute},
           "predicted": {"step_time_s": plan.prediction.step_time_s, **plan.prediction.time.model_dump()}}
    model, optimizer, data = fresh(True)
    out["phases_runtime"] = _phase_times(model, optimizer, data, model_file.loss_fn, p.num_micro_batches,
                                         SKIP_STEPS + steps, True)
    # the same step with no data parallelism at all: each process computes alone (compute only)
    local_model, local_optimizer, local_data = fresh(False)
    out["phases_local"] = _phase_times(local_model, local_optimizer, local_data, model_file.loss_fn,
                                       p.num_micro_batches, SKIP_STEPS + steps, False)

    # aten ops per step without data parallelism (forward + backward + clip + optimizer)
    counter = _CountOps()
    with counter.mode:
        for _ in range(p.num_micro_batches):
            batch = next(local_data)
            model_file.loss_fn(local_model(batch), batch).backward()
        torch.nn.utils.clip_grad_norm_(local_model.parameters(), 1.0)
        local_optimizer.step()
        local_optimizer.zero_grad(set_to_none=True)
    out["aten_ops_per_step"] = sum(counter.counts.values())

    # torch.profiler over 3 steps of the data-parallel run: operators by self CPU time, calls per step
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _phase_times(model, optimizer, data, model_file.loss_fn, p.num_micro_batches, 3, True, skip=0)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    out["profile_top"] = [{"op": e.key, "self_cpu_share": e.self_cpu_time_total / total_us, "calls": e.count / 3}
                          for e in events[:14]]
    out["profile_collectives_per_step"] = {e.key: e.count / 3 for e in events if e.key.startswith("c10d::")}
    out["gemm_check"] = _gemm_check(local_model, p.micro_batch * plan.train.seq_len, plan.cluster)
    return out


def breakdown_worker(args, ctx) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from zplan.runtime import load_model_file, load_plan

    model_file = load_model_file(args.model)
    plans = [load_plan(Path(d) / "plan.json") for d in args.plan_dir]
    out = {"plans": [_breakdown_one(plan, model_file, ctx, args.steps) for plan in plans]}
    cluster = plans[0].cluster
    dist.barrier()

    # gloo's collectives at several sizes against the cost model's (planner/cost/comm.py, n = 2, each type with
    # the profile's own latency and bandwidth): all-reduce S / B + 2 latency; all-gather and reduce-scatter
    # S / (2 B) + latency (S: the full tensor)
    import numpy as np

    from zplan.planner.cost import comm

    formulas = {"all_reduce": comm.all_reduce_s, "all_gather": comm.all_gather_s,
                "reduce_scatter": comm.reduce_scatter_s}
    num_params = sum(q.numel() for q in model_file.build_model().parameters())
    out["grad_bytes"] = 4 * num_params
    out["num_params"] = num_params
    out["num_tensors"] = len(list(model_file.build_model().parameters()))
    out["collectives"] = []
    for size_bytes in (8, 64 * 1024, out["grad_bytes"], 1 << 20, 16 << 20):
        full = torch.zeros(max(2, size_bytes // 4 // 2 * 2))  # (S / 4,) elements, even
        half = torch.zeros(full.numel() // 2)
        for name in ("all_reduce", "all_gather", "reduce_scatter"):
            times = []
            for _ in range(12 if size_bytes >= 16 << 20 else 30):
                dist.barrier()
                a = time.perf_counter()
                if name == "all_reduce":
                    dist.all_reduce(full)
                elif name == "all_gather":
                    dist.all_gather_into_tensor(full, half)
                else:
                    dist.reduce_scatter_tensor(half, full)
                times.append(time.perf_counter() - a)
            size = full.numel() * 4
            predicted = float(formulas[name](np.array([float(size)]), np.array([2]), np.array([1]), cluster)[0])
            out["collectives"].append({"op": name, "bytes": size, "measured_s": statistics.median(times[3:]),
                                       "predicted_s": predicted})
    x, times = torch.ones(4), []
    for _ in range(5):
        a = time.perf_counter()
        for _ in range(2000):
            torch.add(x, x)
        times.append((time.perf_counter() - a) / 2000)
    out["tiny_op_s"] = min(times)
    out["profile_op_s"] = cluster.host_overheads.op_s
    if ctx.is_main:
        write_result(args.worker, out)


def _size(num_bytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.0f} {unit}"
    return f"{num_bytes:.0f} B"


def _print_breakdown(b: dict) -> None:
    ms = 1e3
    for one in b["plans"]:
        runtime, local, pred, p = one["phases_runtime"], one["phases_local"], one["predicted"], one["plan"]
        kind = "DDP" if p["zero"] <= 1 else "FSDP2"
        print(f"\nWhere a step goes: dp{p['dp']} ZeRO-{p['zero']} mb{p['micro_batch']}x{p['num_micro_batches']} "
              f"{p['recompute']} (median ms per step): runtime ({kind}) | same step without data parallel")
        for k in ("data", "forward", "backward", "clip", "optimizer", "zero_grad", "log_allreduce", "total"):
            print(f"  {k:<14} {runtime[k] * ms:7.2f} | {local[k] * ms:7.2f}")
        print(f"  cpu time       {runtime['total_cpu'] * ms:7.2f} | {local['total_cpu'] * ms:7.2f}   "
              "(process CPU seconds per step: wall above it = waiting, for peers or for a core)")
        print(f"  predicted: step {pred['step_time_s'] * ms:.2f} = compute {pred['compute'] * ms:.2f} + data parallel "
              f"{pred['data_parallel'] * ms:.2f} + optimizer {pred['optimizer'] * ms:.2f}")
        print(f"  {one['aten_ops_per_step']:,} aten ops per step without data parallel; collectives per step: "
              + (", ".join(f"{k[6:]} {v:g}" for k, v in one["profile_collectives_per_step"].items()) or "none"))
        print("  torch.profiler, self CPU time: " + ", ".join(
            f"{e['op']} {e['self_cpu_share']:.0%}" for e in one["profile_top"][:8]))
        print("  GEMMs (tokens x in x out): measured vs the profile's curve: " + ", ".join(
            f"{'x'.join(map(str, g['shape']))} {g['measured_s'] * 1e6:.0f} vs {g['predicted_s'] * 1e6:.0f} us"
            for g in one["gemm_check"]))
    print(f"\n{b['num_params']:,} parameters in {b['num_tensors']} tensors ({b['grad_bytes'] / 2**20:.2f} MiB of "
          f"gradients); one tiny aten op (torch.add of 4 floats) {b['tiny_op_s'] * 1e6:.1f} us; the profile's host "
          f"time per aten op of a training step (with autograd and module calls) {b['profile_op_s'] * 1e6:.1f} us")
    print("gloo on 2 processes, measured vs the cost model (us), by size of the full tensor:")
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        print(f"  {op:<15}" + "  ".join(
            f"{_size(c['bytes']):>8} {c['measured_s'] * 1e6:6.0f} vs {c['predicted_s'] * 1e6:5.0f}"
            for c in b["collectives"] if c["op"] == op))


# ---- parent ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--model", type=Path, default=TINY, help="model file (default examples/tiny.py)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--steps", type=int, default=12, help=f"steps per run (default 12; first {SKIP_STEPS} dropped)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every plan, round-robin (default 3); "
                                                                 "the fastest round's median counts")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the per-phase breakdown")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plan-dir", action="append", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from zplan.runtime import run_distributed

        run_distributed(lambda ctx: breakdown_worker(args, ctx))
        return

    start, load_start = time.perf_counter(), load_average()
    model = args.model.resolve()
    specs = plan_grid(args.global_batch)
    with tempfile.TemporaryDirectory(prefix="zplan-predicted-") as tmp:
        dirs = [Path(tmp) / f"plan{i}" for i in range(len(specs))]
        plans = [compile_plan_files(model, spec["gpus"], out_dir, global_batch=args.global_batch, zero=spec["zero"],
                                    micro_batch=spec["micro_batch"], recompute=spec["recompute"], dp=spec["gpus"])
                 for spec, out_dir in zip(specs, dirs, strict=True)]
        runs = [[] for _ in specs]  # per plan: one (records, load average) per round
        for _ in range(args.rounds):
            for i, (spec, out_dir) in enumerate(zip(specs, dirs, strict=True)):
                runs[i].append((run_plan(out_dir, spec["gpus"], args.steps), load_average()))
        rows = [_row(spec, plan, plan_runs) for spec, plan, plan_runs in zip(specs, plans, runs, strict=True)]
        # ZeRO 0 (DDP) and the many-micro-batch ZeRO 3 (FSDP2)
        breakdown_dirs = [d for spec, d in zip(specs, dirs, strict=True)
                          if spec["gpus"] == 2 and spec["recompute"] == "none" and spec["zero"] in (0, 3)]
        breakdown = None if args.no_breakdown else run_workers(
            Path(__file__).resolve(), 2,
            ["--model", model, "--steps", "6", *(a for d in breakdown_dirs for a in ("--plan-dir", d))],
            timeout_s=600)
    for r in rows:
        r["ratio_measured_over_predicted"] = r["measured_step_s"] / r["predicted_step_s"]
        r["model_state_relative_error"] = r["measured_model_state_bytes"] / r["predicted_model_state_bytes"] - 1
    predicted = [r["predicted_step_s"] for r in rows]
    measured = [r["measured_step_s"] for r in rows]
    result = {
        "model": str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else str(model),
        "cluster": "cpu-local", "global_batch": args.global_batch, "steps_per_run": args.steps,
        "rounds": args.rounds, "rows": rows,
        "rank_correlation": spearman(predicted, measured),
        "median_measured_over_predicted": median([r["ratio_measured_over_predicted"] for r in rows]),
        "max_model_state_relative_error": max(abs(r["model_state_relative_error"]) for r in rows),
        "breakdown": breakdown, "wall_s": time.perf_counter() - start,
        "load_average": [load_start, load_average()], "cores": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    mib = 2**20
    print(f"{result['model']} on cpu-local, global batch {args.global_batch}, fp32; median of "
          f"{args.steps - SKIP_STEPS} steps per plan, fastest of {args.rounds} rounds (each round's median and "
          "load average in --json)")
    print("  plan                              predicted  measured  measured/predicted  model states MiB "
          "(measured / planned)")
    for r in rows:
        label = _label(r)
        print(f"  {label:<32} {r['predicted_step_s'] * 1e3:7.1f} ms {r['measured_step_s'] * 1e3:7.1f} ms "
              f"{r['ratio_measured_over_predicted']:10.1f}x         {r['measured_model_state_bytes'] / mib:6.2f} / "
              f"{r['predicted_model_state_bytes'] / mib:6.2f} ({r['model_state_relative_error']:+.1%})")
    print(f"rank_correlation {result['rank_correlation']:.2f} (Spearman, target >= 0.8); measured/predicted median "
          f"{result['median_measured_over_predicted']:.1f}x; model states max error "
          f"{result['max_model_state_relative_error']:.1%}")
    if breakdown:
        _print_breakdown(breakdown)
    print(f"({result['wall_s']:.0f} s; load average {result['load_average'][0]:.1f} at the start, "
          f"{result['load_average'][1]:.1f} at the end, on {result['cores']} cores)")


if __name__ == "__main__":
    main()
