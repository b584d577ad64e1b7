"""Compressed data-parallel gradients against uncompressed training, in the same run.

    .venv/bin/python benchmarks/compression.py [--json] [--steps 300] [--world 2] [--onebit-warmup 0.3]

examples/tiny.py (2 layers, hidden 64, vocabulary 256) on `--world` processes (gloo), DDP (ZeRO 0), 4
sequences of 64 tokens per rank and step, synthetic tokens, AdamW lr 1e-3 with weight decay 0.1 and gradient
clipping at 1.0, the same seed and data for every run:
  fp32   DDP's reduction, counted (runtime.compression.grad_compression.all_reduce_mean)
  int8   the int8 gradient hook (two-phase compressed all-reduce, one scale per 256 elements)
  1bit   1-bit Adam: exact AdamW for the first `--onebit-warmup` share of the steps, then 1-bit momentum
Bytes are those this rank sent, counted at the collective calls (per-rank ring / all-to-all / all-gather
formulas, grad_compression's docstring). Step time is the median over the steps after the first ten.

Prints a table, then with --json one JSON object: per run final_loss, loss_delta (relative to fp32), bytes_sent,
step_time_s; and int8_bytes_ratio, onebit_bytes_ratio (fp32 bytes over compressed bytes; 1-bit over the steps
after its warm-up, where it compresses), max_loss_delta (target: within 3 %).
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
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RUNS = ("fp32", "int8", "1bit")
PER_RANK, SEQ_LEN, LR, SEED = 4, 64, 1e-3, 0


def _train(run: str, args, rank: int, group) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from examples.tiny import VOCAB_SIZE, build_model
    from zplan.runtime.compression import grad_compression as gc
    from zplan.runtime.optim.build import adamw_param_groups
    from zplan.runtime.optim.device_states import DeviceStates
    from zplan.runtime.optim.layouts import WholeShards
    from zplan.runtime.optim.sharded_adamw import ShardedAdamW
    from zplan.runtime.training.data import synthetic_token_batch

    torch.manual_seed(SEED)
    model = build_model()
    ddp = DistributedDataParallel(model)
    groups = adamw_param_groups(model, 0.1)
    warmup = max(1, int(args.onebit_warmup * args.steps))
    if run == "1bit":
        one_bit = gc.OneBitGradients(ddp, group, warmup_steps=warmup)
        optimizer = ShardedAdamW(groups, WholeShards(), DeviceStates(), one_bit, lr=LR)
        wire = one_bit.wire
    else:
        state = gc.HookState(group, compress=run == "int8")
        ddp.register_comm_hook(state, gc.int8_hook)
        wire, optimizer = state.wire, torch.optim.AdamW(groups, lr=LR)
    losses, times, sent_at_warmup = [], [], 0.0
    for step in range(args.steps):
        if step == warmup:
            sent_at_warmup = wire.total
        tokens = synthetic_token_batch(VOCAB_SIZE, SEQ_LEN, args.world * PER_RANK, SEED, step)
        tokens = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
        start = time.perf_counter()
        logits = ddp(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB_SIZE), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / args.world)
    return {"final_loss": statistics.mean(losses[-10:]), "bytes_sent": wire.total,
            "bytes_after_warmup": wire.total - sent_at_warmup, "step_time_s": statistics.median(times[10:])}


def _rank(rank: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.world))
    from zplan.runtime.launch.distributed import run_distributed

    torch.set_num_threads(1)

    def work(ctx) -> None:
        results = {run: _train(run, args, rank, dist.group.WORLD) for run in RUNS}
        if rank == 0:
            queue.put(results)

    run_distributed(work)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--onebit-warmup", type=float, default=0.3, help="share of the steps 1-bit Adam warms up")
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_rank, args=(r, args, port, queue)) for r in range(args.world)]
    for p in processes:
        p.start()
    results = queue.get()
    for p in processes:
        p.join()

    fp32 = results["fp32"]
    for run in RUNS:
        results[run]["loss_delta"] = results[run]["final_loss"] / fp32["final_loss"] - 1
    summary = {
        "runs": results,
        "int8_bytes_ratio": fp32["bytes_sent"] / results["int8"]["bytes_sent"],
        "onebit_bytes_ratio": fp32["bytes_after_warmup"] / results["1bit"]["bytes_after_warmup"],
        "max_loss_delta": max(abs(results[run]["loss_delta"]) for run in RUNS),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }
    print(f"{'':6}{'final loss':>12}{'vs fp32':>10}{'MiB sent':>10}{'step':>10}")
    for run in RUNS:
        r = results[run]
        print(f"{run:6}{r['final_loss']:12.4f}{r['loss_delta']:+10.2%}{r['bytes_sent'] / 2**20:10.2f}"
              f"{r['step_time_s'] * 1e3:8.1f}ms")
    print(f"bytes: int8 {summary['int8_bytes_ratio']:.2f}x fewer, 1-bit {summary['onebit_bytes_ratio']:.1f}x fewer "
          f"after its warm-up; largest loss change {summary['max_loss_delta']:.2%} (target <= 3%)")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
