"""ZeRO-Offload's one-step delayed parameter update (DPU): step time of ZeRO-1 with CPU offload
(runtime.optim.sharded_adamw.ShardedAdamW, runtime.optim.host_states.HostStates) with and without delayed_update,
same processes.

    .venv/bin/python benchmarks/delayed_update.py [--json] [--world 2] [--rounds 3] [--steps 12] [--batch 1]
                                                  [--seq-len 8]

The model is benchmarks/_small_gpt.py (5.3M parameters), `--batch` sequences of `--seq-len` tokens per rank and
step: few tokens, so that the CPU Adam step over a rank's rows (5.3M / world parameters, one OpenMP thread, ~28
bytes of memory traffic a parameter) is a visible share of the step, as it is when a GPU runs the model. Each
rank runs DDP + ZeRO-1 host-state AdamW (gloo, one thread each, as the other runtime benchmarks), the exact and the
delayed optimizer alternately, `--rounds` runs each of `--steps` steps; a step is timed from the outside
(forward, backward, clipping, step(), zero_grad, the loss read back). The delayed runs start the delay after 2
exact steps; the first 4 steps of every run are left out.

Figures (medians over the timed steps of all rounds, rank 0):
  step_time_exact_s, step_time_delayed_s, step_time_ratio = delayed / exact;
  cpu_step_s: the CPU Adam kernel calls of one update (HostStates.last_cpu_step_s);
  wait_s: what step() waited for them on a delayed step (HostStates.last_wait_s; the whole cpu_step_s when exact);
  hidden_fraction = 1 - sum(wait_s) / sum(cpu_step_s) over the delayed steps: the share of the CPU step that ran
  behind forward and backward; hidden_fraction_by_wall = (exact - delayed step time) / cpu_step_s of the exact
  runs: the same seen on the step time.
No targets: on a 2-core machine with 2 ranks both cores already run a rank's main thread, so the background step
mostly takes turns with them rather than running beside them; --world 1 leaves it a core of its own. The load
average is printed: other processes take cores too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _launch import SMALL_GPT, load_average, run_workers  # noqa: E402

DELAY_AFTER = 2  # exact steps before the delay of the delayed runs
SKIP = 4  # steps left out of every run: start-up, the exact warm-up, the first delayed step
LR = 1e-4


def _run(build_model, mesh, *, delayed: bool, steps: int, batch: int, seq_len: int, vocab: int) -> dict:
    """One run; per timed step: wall seconds, the optimizer's last_wait_s and last_cpu_step_s."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from zplan.runtime.optim.build import adamw_param_groups
    from zplan.runtime.optim.host_states import HostStates
    from zplan.runtime.optim.layouts import RowShards
    from zplan.runtime.optim.sharded_adamw import ShardedAdamW
    from zplan.runtime.training.data import synthetic_token_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model()
    ddp = DistributedDataParallel(model) if world > 1 else model
    states = HostStates(delayed_update=delayed, delay_after_steps=DELAY_AFTER)
    optimizer = ShardedAdamW(adamw_param_groups(model, 0.1), RowShards(mesh), states, lr=LR)
    record = {"step_s": [], "wait_s": [], "cpu_step_s": []}
    for step in range(steps):
        tokens = synthetic_token_batch(vocab, seq_len, world * batch, 0, step)[rank * batch:(rank + 1) * batch]
        start = time.perf_counter()
        logits = ddp(tokens)  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss.item()
        if step >= SKIP:
            record["step_s"].append(time.perf_counter() - start)
            record["wait_s"].append(states.last_wait_s)
            record["cpu_step_s"].append(states.last_cpu_step_s)
    optimizer.flush()
    return record


def worker(result: Path, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(SMALL_GPT.parent))
    import _small_gpt

    from zplan.runtime.launch.distributed import run_distributed

    torch.set_num_threads(1)

    def work(ctx) -> None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        runs: dict[str, dict[str, list[float]]] = {mode: {"step_s": [], "wait_s": [], "cpu_step_s": []}
                                                   for mode in ("exact", "delayed")}
        for r in range(args.rounds):
            for mode in (("exact", "delayed") if r % 2 == 0 else ("delayed", "exact")):
                record = _run(_small_gpt.build_model, mesh, delayed=mode == "delayed", steps=args.steps,
                              batch=args.batch, seq_len=args.seq_len, vocab=_small_gpt.VOCAB_SIZE)
                for key, values in record.items():
                    runs[mode][key] += values
        if dist.get_rank() == 0:
            result.write_text(json.dumps(runs))

    run_distributed(work)


def summarize(runs: dict, args: argparse.Namespace) -> dict:
    exact, delayed = runs["exact"], runs["delayed"]
    step_exact, step_delayed = statistics.median(exact["step_s"]), statistics.median(delayed["step_s"])
    cpu_exact = statistics.median(exact["cpu_step_s"])
    return {
        "world": args.world, "batch_per_rank": args.batch, "seq_len": args.seq_len, "rounds": args.rounds,
        "timed_steps_per_mode": len(exact["step_s"]),
        "step_time_exact_s": step_exact,
        "step_time_delayed_s": step_delayed,
        "step_time_ratio": step_delayed / step_exact,
        "cpu_step_exact_s": cpu_exact,
        "cpu_step_delayed_s": statistics.median(delayed["cpu_step_s"]),
        "wait_delayed_s": statistics.median(delayed["wait_s"]),
        "hidden_fraction": 1 - sum(delayed["wait_s"]) / sum(delayed["cpu_step_s"]),
        "hidden_fraction_by_wall": (step_exact - step_delayed) / cpu_exact,
        "cpu_step_share_of_exact_step": cpu_exact / step_exact,
        "load_average": load_average(),
        "cores": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--world", type=int, default=2, help="processes (gloo)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="steps per run, the first 4 not timed")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=8, help="tokens per sequence (at most 64)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= SKIP:
        parser.error(f"--steps must be more than {SKIP}")
    if args.worker is not None:
        worker(args.worker, args)
        return
    runs = run_workers(Path(__file__), args.world, ["--world", str(args.world), "--rounds", str(args.rounds),
                                                    "--steps", str(args.steps), "--batch", str(args.batch),
                                                    "--seq-len", str(args.seq_len)],
                       timeout_s=900)
    figures = summarize(runs, args)
    if args.json:
        print(json.dumps(figures))
        return
    for key, value in figures.items():
        print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")


if __name__ == "__main__":
    main()
