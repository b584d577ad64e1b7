"""Predicted against measured on this machine: the inference planner's time to first token (TTFT) and time per
output token (TPOT) for 10 plans on the cpu-local profile, against the engine those plans build, run in this
process on one thread; the Spearman rank correlation of the TPOTs (and TTFTs).

    .venv/bin/python benchmarks/inference_prediction.py [--json] [--rounds 3] [--prompt-len 48] [--gen-len 16]

Each plan is what `zplan compile MODEL --mode inference --gpus 1 --cluster cpu-local --tp 1 --batch B --precision
fp32|int8 --offload none|cpu|nvme --prompt-len P --gen-len G` makes (zplan.inference_api.prepare and
compile_inference_plan, no files written), for benchmarks/_small_gpt.py (4 layers, hidden 256, vocabulary 8192:
decode reads 21 MB of fp32 weights per step) at batch 1 / 4 / 8, fp32 and int8, weights resident ("gpu") or
streamed from host memory or NVMe, and for examples/tiny.py (2 layers, hidden 64: host overhead only) at batch 1
and 8 (on cpu-local the planner computes in fp32, the profile's fastest dtype, as the engine does on a CPU).

The engine is built as the emitted generate.py builds it (runtime.inference.build.engine_from_plan with the plan's
EngineSettings, seeded random weights), with torch.set_num_threads(1): the profile's device is one process on one
core. Each plan: one warm-up generation, then `--rounds` generations of G tokens for B random prompts of P tokens
through engine.stream; TTFT is the wall time to the first yielded step (prefill of the batch and the first
sampling), TPOT the median interval between later steps (one decode step and its sampling). The fastest round
counts (other processes on this shared machine slow whichever round they overlap); the CPU time of the same steps
is reported too. The aten ops of one prefill and one decode step are counted against the cost model's
39 per block + 8 (BLOCK_FORWARD_OPS, EDGE_FORWARD_OPS), each charged the profile's op_s of host time.

Probes beside the plans, to tell which term is off: the engine's wall seconds per aten op of a decode step (tiny
at batch 1, whose weights are negligible) against the profile's op_s; and one-row Linears, fp32 F.linear
against the int8 weight_only_linear the engine calls, at hidden 256 -> 1024 and 4096 -> 4096, in weight bytes read
per second against the profile's hbm_bandwidth_Bps, which the cost model charges both at.
Takes about a minute on the 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import ROOT, SMALL_GPT, TINY, load_average, spearman  # noqa: E402

from zplan.cuda.weight_only_matmul import weight_only_linear  # noqa: E402
from zplan.cuda.weight_quant import quantize_groupwise  # noqa: E402
from zplan.inference_api import compile_inference_plan, prepare  # noqa: E402
from zplan.planner.clusters import load_cluster  # noqa: E402
from zplan.planner.inference.cost import BLOCK_FORWARD_OPS, EDGE_FORWARD_OPS  # noqa: E402
from zplan.runtime.inference.build import engine_from_plan  # noqa: E402

SEED = 0
# (model file, batch, weight precision, weight tier)
PLANS = [
    (SMALL_GPT, 1, "fp32", "gpu"), (SMALL_GPT, 4, "fp32", "gpu"), (SMALL_GPT, 8, "fp32", "gpu"),
    (SMALL_GPT, 1, "int8", "gpu"), (SMALL_GPT, 8, "int8", "gpu"),
    (SMALL_GPT, 1, "fp32", "cpu"), (SMALL_GPT, 8, "fp32", "cpu"), (SMALL_GPT, 1, "fp32", "nvme"),
    (TINY, 1, "fp32", "gpu"), (TINY, 8, "fp32", "gpu"),
]


def compile_plan(model: Path, batch: int, precision: str, tier: str, prompt_len: int, gen_len: int):
    """The plan `zplan compile MODEL --mode inference` makes for these flags on one cpu-local device."""
    offload = "none" if tier == "gpu" else tier
    return compile_inference_plan(prepare(str(model), gpus=1, cluster="cpu-local", target="latency", batch=batch,
                                          prompt_len=prompt_len, gen_len=gen_len, precision=precision, tp=1,
                                          offload=offload))


class CountOps:
    """Counts the aten ops dispatched while `mode` is active."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count = 0
        self.mode = Mode()


def timed_stream(engine, prompts: list[list[int]], gen_len: int) -> tuple[float, list[float], list[float]]:
    """(TTFT s, wall s of each later step, CPU s of each later step) of one generation."""
    steps = engine.stream(prompts, gen_len)
    start = time.perf_counter()
    next(steps)
    ttft = time.perf_counter() - start
    walls, cpus = [], []
    while True:
        a, cpu = time.perf_counter(), time.process_time()
        try:
            next(steps)
        except StopIteration:
            return ttft, walls, cpus
        walls.append(time.perf_counter() - a)
        cpus.append(time.process_time() - cpu)


def ops_per_pass(engine, prompts: list[list[int]]) -> tuple[int, int]:
    """aten ops of one prefill (with the first sampling) and of one decode step (with its sampling)."""
    steps = engine.stream(prompts, 2)
    counts = []
    for _ in range(2):
        counter = CountOps()
        with counter.mode:
            next(steps)
        counts.append(counter.count)
    return counts[0], counts[1]


def measure(plan, model: Path, rounds: int, nvme_dir: str) -> dict:
    spec = plan.spec
    notes = io.StringIO()
    with contextlib.redirect_stderr(notes):  # the engine's "no --weights: noise" warning and its CPU fp32 note
        engine, _, _ = engine_from_plan(plan, model, seed=SEED, nvme_dir=nvme_dir)
    try:
        gen = torch.Generator().manual_seed(spec.batch)
        prompts = torch.randint(0, engine.vocab_size, (spec.batch, spec.prompt_len), generator=gen).tolist()
        engine.generate(prompts, spec.gen_len)  # warm-up: first allocations, oneDNN primitives, page cache
        runs = [timed_stream(engine, prompts, spec.gen_len) for _ in range(rounds)]
        prefill_ops, decode_ops = ops_per_pass(engine, prompts)
    finally:
        engine.close()
    tpots = [statistics.median(walls) for _, walls, _ in runs]
    best = min(range(rounds), key=lambda k: tpots[k])
    return {
        "measured_ttft_s": min(ttft for ttft, _, _ in runs), "measured_tpot_s": tpots[best],
        "measured_tpot_cpu_s": statistics.median(runs[best][2]),
        "measured_ttft_s_by_round": [ttft for ttft, _, _ in runs], "measured_tpot_s_by_round": tpots,
        "prefill_aten_ops": prefill_ops, "decode_aten_ops": decode_ops,
        "engine_notes": [line.removeprefix("zplan: ") for line in notes.getvalue().splitlines()
                         if "no --weights" not in line],
    }


def linear_probe(rows_in_out: tuple[int, int, int], reps: int) -> dict:
    """Median seconds of one (rows, in) x (out, in)^T Linear, fp32 and int8 weight-only (group 128), and the
    weight bytes each reads per second."""
    rows, fan_in, fan_out = rows_in_out
    gen = torch.Generator().manual_seed(SEED)
    w, x = torch.randn(fan_out, fan_in, generator=gen), torch.randn(rows, fan_in, generator=gen)
    qw = quantize_groupwise(w, bits=8, group_size=128)

    def median_s(fn) -> float:
        for _ in range(5):
            fn()
        times = []
        for _ in range(reps):
            a = time.perf_counter()
            fn()
            times.append(time.perf_counter() - a)
        return statistics.median(times)

    with torch.no_grad():
        fp32_s, int8_s = median_s(lambda: torch.nn.functional.linear(x, w)), median_s(lambda: weight_only_linear(x, qw))
    return {"shape": [rows, fan_in, fan_out], "fp32_s": fp32_s, "int8_s": int8_s,
            "fp32_weight_Bps": 4.0 * w.numel() / fp32_s, "int8_weight_Bps": 1.0 * w.numel() / int8_s}


def row(model: Path, plan, measured: dict) -> dict:
    p, pred = plan.parallel, plan.prediction
    layers = sum(1 for u in plan.model.layers if u.kind == "block")
    model_ops = BLOCK_FORWARD_OPS * layers + EDGE_FORWARD_OPS
    out = {
        "model": str(model.relative_to(ROOT)), "batch": plan.spec.batch, "weight_precision": p.weight_precision,
        "compute_dtype": p.compute_dtype, "weight_tier": p.weight_tier,
        "predicted_ttft_s": pred.ttft_s, "predicted_tpot_s": pred.tpot_s,
        "predicted_time": pred.time.model_dump(),
        # which term set the predicted decode step: weight + KV bytes, or FLOPs + host dispatch (planner/inference/cost)
        "predicted_decode_bound": "bytes+host" if pred.time.decode_weights_s > 0 else "FLOPs+host",
        "predicted_host_s": model_ops * plan.cluster.host_overheads.op_s, "model_aten_ops_per_pass": model_ops,
        **measured,
    }
    out["ttft_ratio"] = out["measured_ttft_s"] / out["predicted_ttft_s"]
    out["tpot_ratio"] = out["measured_tpot_s"] / out["predicted_tpot_s"]
    return out


def label(r: dict) -> str:
    return f"{Path(r['model']).stem} b{r['batch']} {r['weight_precision']} {r['weight_tier']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--rounds", type=int, default=3, help="timed generations per plan (the fastest counts)")
    parser.add_argument("--prompt-len", type=int, default=48, help="prompt tokens per sequence (P)")
    parser.add_argument("--gen-len", type=int, default=16, help="generated tokens per sequence (G)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # the cpu-local profile: one device = one process on one core
    start, load_start = time.perf_counter(), load_average()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zplan-inference-prediction-") as nvme_dir:
        for model, batch, precision, tier in PLANS:
            plan = compile_plan(model, batch, precision, tier, args.prompt_len, args.gen_len)
            rows.append(row(model, plan, measure(plan, model, args.rounds, nvme_dir)))
    engine_op_s = next(r["measured_tpot_s"] / r["decode_aten_ops"] for r in rows
                       if r["model"].endswith("tiny.py") and r["batch"] == 1)
    cluster = load_cluster("cpu-local")
    probes = {"engine_wall_s_per_decode_aten_op": engine_op_s, "profile_op_s": cluster.host_overheads.op_s,
              "profile_hbm_bandwidth_Bps": cluster.gpu.hbm_bandwidth_Bps,
              "linear": [linear_probe((1, 256, 1024), 200), linear_probe((1, 4096, 4096), 20)]}
    pairs = {k: ([r[f"predicted_{k}_s"] for r in rows], [r[f"measured_{k}_s"] for r in rows]) for k in ("tpot", "ttft")}
    result = {
        "cluster": "cpu-local", "prompt_len": args.prompt_len, "gen_len": args.gen_len, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "rows": rows,
        "tpot_rank_correlation": spearman(*pairs["tpot"]), "ttft_rank_correlation": spearman(*pairs["ttft"]),
        "median_tpot_ratio": statistics.median(r["tpot_ratio"] for r in rows),
        "median_ttft_ratio": statistics.median(r["ttft_ratio"] for r in rows),
        "probes": probes,
        "wall_s": time.perf_counter() - start, "load_average": [load_start, load_average()], "cores": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"cpu-local, tp 1, one thread; prompt {args.prompt_len}, {args.gen_len} new tokens; fastest of "
          f"{args.rounds} rounds (ms; ratio = measured / predicted)")
    print("  plan                         TTFT pred   meas  ratio   TPOT pred   meas  ratio  (cpu)  "
          "aten ops/decode (model)  decode bound")
    for r in rows:
        print(f"  {label(r):<28} {r['predicted_ttft_s'] * 1e3:9.2f} {r['measured_ttft_s'] * 1e3:6.2f} "
              f"{r['ttft_ratio']:5.2f}x {r['predicted_tpot_s'] * 1e3:9.2f} {r['measured_tpot_s'] * 1e3:6.2f} "
              f"{r['tpot_ratio']:5.2f}x {r['measured_tpot_cpu_s'] * 1e3:6.2f}  {r['decode_aten_ops']:4d} "
              f"({r['model_aten_ops_per_pass']})  {r['predicted_decode_bound']}"
              + (f" + stream {r['predicted_time']['decode_stream_s'] * 1e3:.1f}" if r["weight_tier"] != "gpu" else ""))
    print(f"Spearman rank correlation, predicted vs measured: TPOT {result['tpot_rank_correlation']:.2f}, TTFT "
          f"{result['ttft_rank_correlation']:.2f}; median ratio TPOT {result['median_tpot_ratio']:.2f}x, TTFT "
          f"{result['median_ttft_ratio']:.2f}x")
    print(f"probes: the engine's decode step costs {engine_op_s * 1e6:.1f} us wall per aten op (tiny b1; profile op_s "
          f"{probes['profile_op_s'] * 1e6:.1f} us)")
    for p in probes["linear"]:
        print(f"  Linear {p['shape'][0]}x{p['shape'][1]}->{p['shape'][2]}: fp32 {p['fp32_s'] * 1e6:.0f} us "
              f"({p['fp32_weight_Bps'] / 1e9:.1f} GB/s of weights), int8 {p['int8_s'] * 1e6:.0f} us "
              f"({p['int8_weight_Bps'] / 1e9:.2f} GB/s); cost model: both at "
              f"{probes['profile_hbm_bandwidth_Bps'] / 1e9:.2f} GB/s")
    print(f"({result['wall_s']:.0f} s; load average {result['load_average'][0]:.1f} at the start, "
          f"{result['load_average'][1]:.1f} at the end, on {result['cores']} cores)")


if __name__ == "__main__":
    main()
