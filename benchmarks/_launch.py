"""What the runtime benchmarks share: start N processes as torchrun does, compile plans in process, time
steps from the outside, time functions in process (interleaved_times), and the statistics they print
(median, Spearman rank correlation).

A benchmark script runs in two roles: the parent (what the user starts) compiles plans and launches
`python SCRIPT --worker RESULT.json ...` on N processes; rank 0 of the workers writes its measurements
to RESULT.json, which the parent reads and prints. Workers get one core's worth of threads each
(OMP_NUM_THREADS=1), as the cpu-local profile assumes: one process plays one GPU.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL_GPT = ROOT / "benchmarks" / "_small_gpt.py"
TINY = ROOT / "examples" / "tiny.py"
CLUSTER = "cpu-local"


# ---- launching -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: one thread per process, unbuffered output, the caller's extras."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            **(extra or {})}


def launch(argv: Sequence[str], world: int, *, timeout_s: float, env: dict[str, str] | None = None,
           cwd: Path = ROOT) -> str:
    """Run `python argv...` on `world` processes with the environment torchrun gives them (RANK,
    WORLD_SIZE, MASTER_ADDR, ...), without torchrun's own start-up; return their joined output.
    Raises RuntimeError with the output's tail when a process fails or runs past timeout_s."""
    port = str(free_port())
    base = worker_env(env)
    with tempfile.TemporaryDirectory(prefix="zplan-launch-") as tmp:
        # output to files, not pipes: a pipe nobody reads yet would block its writer (and its peers)
        logs = [open(Path(tmp) / f"rank{rank}.log", "w+") for rank in range(world)]
        processes = [
            subprocess.Popen(
                [sys.executable, *map(str, argv)], cwd=cwd, stdout=logs[rank], stderr=subprocess.STDOUT, text=True,
                env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                     "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
            )
            for rank in range(world)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            for process in processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for process in processes:  # only the processes started here
                process.kill()
                process.wait()
            timed_out = True
        else:
            timed_out = False
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    output = "\n".join(outputs)
    command = " ".join(map(str, argv))
    if timed_out:
        raise RuntimeError(f"{command} on {world} processes ran past {timeout_s:.0f} s:\n{output[-6000:]}")
    if any(p.returncode != 0 for p in processes):
        codes = [p.returncode for p in processes]
        raise RuntimeError(f"{command} failed on {world} processes (exit codes {codes}):\n{output[-6000:]}")
    return output


def run_workers(script: Path, world: int, args: Sequence[str], *, timeout_s: float,
                env: dict[str, str] | None = None) -> dict:
    """Launch `script --worker RESULT ...args` on `world` processes and return what rank 0 wrote."""
    with tempfile.TemporaryDirectory(prefix="zplan-bench-") as tmp:
        result = Path(tmp) / "result.json"
        launch([script, "--worker", result, *args], world, timeout_s=timeout_s, env=env)
        return json.loads(result.read_text())


# ---- compiling -----------------------------------------------------------------------------------


def compile_plan_files(model: Path, gpus: int, out_dir: Path, *, global_batch: int, zero: int,
                       micro_batch: int | None = None, recompute: str | None = None, dp: int | None = None):
    """`zplan compile MODEL --gpus G --cluster cpu-local --precision fp32 --tp 1 --pp 1 --zero Z [pins]
    -o OUT`, in this process (zplan.api, as the CLI calls it); returns the Plan read back from OUT/plan.json."""
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.schemas.plan import Plan
    from zplan.schemas.spec import Pins

    pins = Pins(tp=1, pp=1, dp=dp, zero=zero, micro_batch=micro_batch, recompute=recompute)
    plan = compile_plan(prepare(str(model), gpus, CLUSTER, global_batch, None, "fp32", pins))
    write_outputs(plan, out_dir, str(model))
    return Plan.model_validate_json((out_dir / "plan.json").read_text())


def predicted_model_state_bytes(plan) -> float:
    memory = plan.prediction.memory
    return memory.parameters + memory.gradients + memory.optimizer


# ---- timing and statistics -----------------------------------------------------------------------


class StepClock:
    """Wraps a micro-batch iterator and notes the time of every fetch. A step starts at the fetch of its
    first micro-batch, so the time between two such fetches is the whole step as the caller runs it:
    forward, backward, communication, clipping, the optimizer, logging and the loop's own overhead."""

    def __init__(self, batches: Iterator, num_micro_batches: int):
        self.batches = batches
        self.num_micro_batches = num_micro_batches
        self.fetch_times_s: list[float] = []
        self.fetch_cpu_s: list[float] = []  # this process's CPU time (all its threads) at each fetch

    def __iter__(self):
        return self

    def __next__(self):
        self.fetch_times_s.append(time.perf_counter())
        self.fetch_cpu_s.append(time.process_time())
        return next(self.batches)

    def step_times_s(self, skip: int) -> list[float]:
        """Wall seconds of the steps after the first `skip` (the last step has no next fetch: not counted)."""
        starts = self.fetch_times_s[:: self.num_micro_batches]
        return [b - a for a, b in zip(starts, starts[1:], strict=False)][skip:]

    def step_cpu_s(self, skip: int) -> list[float]:
        """CPU seconds of this process in the steps after the first `skip`: unlike wall time, it does not
        grow when other processes take the core, so it shows extra work apart from extra waiting."""
        starts = self.fetch_cpu_s[:: self.num_micro_batches]
        return [b - a for a, b in zip(starts, starts[1:], strict=False)][skip:]


def apply_plan(plan, model_file, mesh, ctx, *, seed: int, lr: float, weight_decay: float, steps: int = 1):
    """The emitted train.py's calls for `plan`, in its order: (model, optimizer, data iterator)."""
    from zplan.runtime import build_meta_model, make_data_iter, parallelize, plan_optimizer

    p = plan.parallel
    model, weights = build_meta_model(model_file.build_model, seed=seed, device=ctx.device)
    model, _ = parallelize(model, weights, mesh, plan, model_file, ctx.device)
    optimizer = plan_optimizer(model, mesh, plan, lr=lr, weight_decay=weight_decay, steps=steps)
    data = make_data_iter(model_file, vocab=plan.model.vocab, seq_len=plan.train.seq_len,
                          micro_batch=p.micro_batch, num_micro_batches=p.num_micro_batches,
                          dp_rank=mesh["dp"].get_local_rank(), dp_size=p.dp, seed=seed)
    return model, optimizer, data


def interleaved_times(fns, reps: int, warmup: int) -> list[list[float]]:
    """Seconds of each function over `reps` rounds; round r starts with function r % len(fns), so that a slow
    moment of this shared machine does not fall on one side only."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(reps):
        for k in range(len(fns)):
            j = (r + k) % len(fns)
            start = time.perf_counter()
            fns[j]()
            times[j].append(time.perf_counter() - start)
    return times


def load_average() -> float:
    """The machine's 1-minute load average: above the core count, benchmark processes wait for a core."""
    return os.getloadavg()[0]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            result[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return result


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties get mean ranks)."""
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var_x = sum((a - mx) ** 2 for a in rx)
    var_y = sum((b - my) ** 2 for b in ry)
    return cov / (var_x * var_y) ** 0.5 if var_x and var_y else float("nan")


def write_result(path: str | Path, result: dict) -> None:
    Path(path).write_text(json.dumps(result))
