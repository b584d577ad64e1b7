"""Planner speed: cost-model throughput, and `zplan compile` end to end (a fresh process each, as a
user runs it) for the 1T-parameter GPT family spec on 3072 GPUs and the traced 175B examples/gpt.py.

    .venv/bin/python benchmarks/compile_speed.py [--json]

Targets: >= 100,000 candidates/s on 2 cores; 1T family < 10 s; 175B traced < 15 s;
peak RSS < 2 GB.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GPT_1T = "gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200"


def candidates_per_s(repeats: int = 5) -> tuple[float, int]:
    """Score the whole legal space of the 1T model on 3072 GPUs; best of `repeats` runs."""
    from zplan.model_input import summarize_model
    from zplan.planner.clusters import load_cluster
    from zplan.planner.cost.inputs import ModelNumbers
    from zplan.planner.cost.step import estimate_step
    from zplan.planner.enumerate import enumerate_candidates
    from zplan.schemas.spec import Pins

    _, summary = summarize_model(GPT_1T, None, "bf16")
    cluster = load_cluster("dgx-a100-80g")
    cand = enumerate_candidates(summary, cluster, 3072, 3072, Pins())
    numbers = ModelNumbers.from_summary(summary)
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        estimate_step(numbers, cand, cluster, "bf16", 3072)
        best = min(best, time.perf_counter() - start)
    return len(cand) / best, len(cand)


def timed_compile(args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "zplan", "compile", *args, "-o", f"{out}/plan", "--json"],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    rate, n = candidates_per_s()
    t_1t = timed_compile([GPT_1T, "--gpus", "3072", "--global-batch", "3072"])
    t_175 = timed_compile(["examples/gpt.py", "--gpus", "1024", "--global-batch", "1536"])
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux reports KiB
    result = {"candidates": n, "candidates_per_s": rate, "compile_1t_s": t_1t, "compile_175b_traced_s": t_175,
              "peak_rss_bytes": rss}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"cost model: {rate:,.0f} candidates/s ({n:,} candidates; target >= 100,000)")
        print(f"compile 1T family on 3072 GPUs: {t_1t:.2f} s (target < 10 s)")
        print(f"compile traced 175B examples/gpt.py on 1024 GPUs: {t_175:.2f} s (target < 15 s)")
        print(f"peak RSS of the compile processes: {rss / 2**30:.2f} GiB (target < 2 GiB)")


if __name__ == "__main__":
    main()
