"""Serving throughput and first-token latency against published TensorRT-LLM runs (serving_runs.csv).

    .venv/bin/python benchmarks/validate_serving.py [--json] [--reference DIR]

Every row zplan can express (benchmarks/serving_runs.py: the others are listed with the reason) is predicted by
planner/inference/throughput.py on the built-in profile of its GPU: static batching (v0.9.0 "Peak Throughput":
output tokens/s), in-flight batching at maximum load (current: output tokens/s) and batch-1 time to first token
(v0.9.0 "Low Latency"). The max-load rows send R requests of one fixed length at once, so they run as waves of N
requests (throughput.max_load_waves, N from the KV cache left after the weights). FP8 rows run on zplan's own fp8
numerics (W8A8 block Linears at the fp8 peak, the head in bf16: what runtime/inference/fp8.py runs), with TensorRT-LLM's
fp8 KV cache and fp8 attention, which zplan's engine does not build, as that engine's condition (serving_runs.py).

The profiles describe zplan's assumptions (GEMM efficiency curve, achieved memory bandwidth). TensorRT-LLM is matched
through three named constants shared by both its versions -- `compute`, the factor on the FLOPs time's achieved
rate, `memory`, on the bytes time's, and `pass_overhead_s`, a fixed cost per forward pass (launches, scheduling,
sampling) (throughput.EngineEfficiency) -- fitted by a grid search for the smallest mean |relative error| over the
rows they are fitted on; nothing per row:
- in sample (key serving_mean_abs_error): fitted on every row;
- leave one source out (key serving_loso_mean_abs_error, the headline): each source predicted with the
  constants fitted on the other source only;
- raw (key serving_raw_mean_abs_error): the profiles as they are, efficiencies (1, 1), no overhead.
The error of a row is predicted / measured - 1 of its metric (tokens/s, or seconds to the first token).
coverage: expressible rows over all rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from serving_runs import ServingRun, load_serving_runs  # noqa: E402

from zplan.planner.clusters import load_cluster  # noqa: E402
from zplan.planner.inference.throughput import (  # noqa: E402
    EngineEfficiency,
    Steps,
    max_load_concurrency,
    max_load_waves_steps,
    static_batch_steps,
    ttft_steps,
)

DEFAULT_REFERENCE = REPO.parent / "shared" / "reference"
RATIOS = np.geomspace(0.05, 20.0, 241)  # memory / compute efficiency
MEMORY = np.geomspace(0.1, 2.0, 241)  # memory efficiency
PASS_OVERHEAD_S = np.array([0.0, 0.25e-3, 0.5e-3, 1e-3, 2e-3, 3e-3, 5e-3, 8e-3, 12e-3, 20e-3])  # per forward pass


@dataclass(frozen=True)
class Priced:
    """A row's passes and how its metric follows from their total seconds: metric = numerator / seconds, or the
    seconds themselves (numerator None)."""

    run: ServingRun
    steps: Steps
    numerator: float | None
    note: str

    def predict(self, eff: EngineEfficiency) -> float:
        seconds = self.steps.seconds(eff)
        return seconds if self.numerator is None else self.numerator / seconds

    def predict_grid(self) -> np.ndarray:
        """The metric over RATIOS x MEMORY x PASS_OVERHEAD_S: max(c / e_c, m / e_m) = max(c * r, m) / e_m with
        r = e_m / e_c, plus the overhead times the passes."""
        s = self.steps
        shape = np.sum(s.count[:, None] * np.maximum(s.compute_s[:, None] * RATIOS[None, :], s.memory_s[:, None]),
                       axis=0)
        seconds = shape[:, None] / MEMORY[None, :] + float(np.sum(s.count * s.comm_s))
        seconds = seconds[:, :, None] + PASS_OVERHEAD_S[None, None, :] * float(np.sum(s.count))
        return seconds if self.numerator is None else self.numerator / seconds


def price(run: ServingRun) -> Priced | str:
    model, cluster, num = run.model(), load_cluster(run.cluster), run.numerics()
    if run.condition == "ttft":
        return Priced(run, ttft_steps(model, cluster, run.tp, num, run.input_len), None, "")
    if run.condition == "static":
        prefill, decode = static_batch_steps(model, cluster, run.tp, num, run.batch, run.input_len, run.output_len)
        both = Steps(*(np.concatenate([getattr(prefill, k), getattr(decode, k)])
                       for k in ("count", "compute_s", "memory_s", "comm_s")))
        return Priced(run, both, run.batch * run.output_len, "")
    conc = max_load_concurrency(model, cluster, run.tp, num, run.input_len, run.output_len, run.batch)
    if conc.requests < 1:
        return "not one request fits the KV cache left after the weights"
    waves = max_load_waves_steps(model, cluster, run.tp, num, run.input_len, run.output_len, run.requests,
                                 conc.requests)
    full, rest = divmod(run.requests, conc.requests)
    return Priced(run, waves, float(run.requests * run.output_len),
                  f"N={conc.requests} ({conc.limited_by}): {full} waves + {rest}")


def fit(priced: list[Priced]) -> EngineEfficiency:
    """The (compute, memory, per-pass overhead) of the grid with the smallest mean |relative error| over `priced`."""
    errors = np.mean([np.abs(p.predict_grid() / p.run.measured - 1.0) for p in priced], axis=0)
    i, j, k = np.unravel_index(int(np.argmin(errors)), errors.shape)
    return EngineEfficiency(compute=float(MEMORY[j] / RATIOS[i]), memory=float(MEMORY[j]),
                            pass_overhead_s=float(PASS_OVERHEAD_S[k]))


def named(eff: EngineEfficiency) -> dict[str, float]:
    return {"tensorrt-llm compute": eff.compute, "tensorrt-llm memory": eff.memory,
            "tensorrt-llm pass overhead s": eff.pass_overhead_s}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def validate(reference: Path) -> dict:
    runs, refused = load_serving_runs(reference)
    total = len(runs) + len(refused)
    priced = []
    for run in runs:
        result = price(run)
        if isinstance(result, str):
            refused[run.label] = result
        else:
            priced.append(result)
    in_sample = fit(priced)
    raw = EngineEfficiency()
    rows, loso = [], {}
    by_source = defaultdict(list)
    for p in priced:
        by_source[p.run.source].append(p)
    for source in by_source:
        loso[source] = fit([p for p in priced if p.run.source != source])
    for p in priced:
        r = p.run
        rows.append({
            "label": r.label, "source": r.source, "engine": r.engine, "cluster": r.cluster, "tp": r.tp,
            "precision": r.precision, "condition": r.condition, "batch": r.batch, "input_len": r.input_len,
            "output_len": r.output_len, "metric": r.metric, "measured": r.measured, "note": p.note,
            "predicted_raw": p.predict(raw), "predicted": p.predict(in_sample),
            "predicted_loso": p.predict(loso[r.source]),
        })
    for row in rows:
        for key, suffix in (("raw_error", "_raw"), ("error", ""), ("loso_error", "_loso")):
            row[key] = row["predicted" + suffix] / row["measured"] - 1.0

    def summary(selected: list[dict]) -> dict:
        return {"rows": len(selected), "mean_abs_error": mean(abs(r["error"]) for r in selected),
                "loso_mean_abs_error": mean(abs(r["loso_error"]) for r in selected),
                "raw_mean_abs_error": mean(abs(r["raw_error"]) for r in selected)}

    conditions = defaultdict(list)
    for row in rows:
        conditions[f"{row['condition']} ({row['metric']})"].append(row)
    return {
        "rows": rows,
        "refused": refused,
        "coverage": len(rows) / total,
        "expressible_rows": len(rows),
        "all_rows": total,
        "engine_efficiencies": named(in_sample),
        "serving_mean_abs_error": mean(abs(r["error"]) for r in rows),
        "serving_loso_mean_abs_error": mean(abs(r["loso_error"]) for r in rows),
        "serving_raw_mean_abs_error": mean(abs(r["raw_error"]) for r in rows),
        "by_source": {source: {**summary([r for r in rows if r["source"] == source]),
                               "efficiencies_used": named(loso[source])}
                      for source in by_source},
        "by_condition": {name: summary(selected) for name, selected in conditions.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    result = validate(args.reference)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'row':62s} {'condition':9s} {'batch':>5s} {'measured':>9s} {'predicted':>9s} {'raw':>7s} {'fitted':>7s} "
          f"{'loso':>7s}  note")
    for r in result["rows"]:
        unit = 1e3 if r["metric"] == "ttft_s" else 1.0  # ms
        print(f"{r['label'][:62]:62s} {r['condition']:9s} {r['batch']:5d} {r['measured'] * unit:9.4g} "
              f"{r['predicted'] * unit:9.4g} {r['raw_error']:+7.1%} {r['error']:+7.1%} {r['loso_error']:+7.1%}  "
              f"{r['note']}")
    print("(tokens/s rows: output tokens/s of the row's GPUs; ttft rows: ms)")
    if result["refused"]:
        print("\nnot expressible:")
        reasons = defaultdict(int)
        for reason in result["refused"].values():
            reasons[reason] += 1
        for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
            print(f"  {count:4d}  {reason}")
    print("\nby source (leave-one-source-out | in sample | raw), efficiencies used when held out:")
    for source, f in result["by_source"].items():
        used = f["efficiencies_used"]
        print(f"  {source[:45]:45s} {f['rows']:4d} rows  {f['loso_mean_abs_error']:6.1%} | {f['mean_abs_error']:6.1%}"
              f" | {f['raw_mean_abs_error']:6.1%}   compute {used['tensorrt-llm compute']:.2f}, memory "
              f"{used['tensorrt-llm memory']:.2f}, {used['tensorrt-llm pass overhead s'] * 1e3:.2f} ms a pass")
    print("by condition:")
    for name, f in result["by_condition"].items():
        print(f"  {name:45s} {f['rows']:4d} rows  {f['loso_mean_abs_error']:6.1%} | {f['mean_abs_error']:6.1%}"
              f" | {f['raw_mean_abs_error']:6.1%}")
    eff = result["engine_efficiencies"]
    print("\nengine constants (all rows): " + ", ".join(f"{k} {v:.4g}" for k, v in eff.items()))
    print(f"coverage {result['coverage']:.0%} ({result['expressible_rows']} of {result['all_rows']} rows); "
          f"mean |error| leave-one-source-out {result['serving_loso_mean_abs_error']:.1%}, "
          f"in sample {result['serving_mean_abs_error']:.1%}, raw {result['serving_raw_mean_abs_error']:.1%}")


if __name__ == "__main__":
    main()
