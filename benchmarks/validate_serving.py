"""Serving throughput and first-token latency against published TensorRT-LLM runs (serving_runs.csv).

    .venv/bin/python benchmarks/validate_serving.py [--json] [--reference DIR] [--write-intervals]

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

How sure (planner/serving_uncertainty.py): each row's residual is the log of measured over predicted seconds, left
one source out: log(measured / predicted_loso) of a time to first token, log(predicted_loso / measured) of a tokens/s
(kinds: "throughput", the static and max-load tokens/s rows; "first token", the TTFT rows). Each source's rows are
checked against 80 % intervals built from the other source's residuals only (uncertainty.log_bounds by kind: a kind
the other source lacks takes its pooled residuals' 95 % range, "unseen"): serving_interval_coverage (the share whose
measured value lies inside), serving_interval_half_width (the median half-width of the time's interval over the
central prediction), and both by kind (serving_interval_by_kind). --write-intervals writes every row's residual by kind
to planner/serving_prediction_error.py, the table the inference plans' intervals are built from.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _residual_table import write_residual_table  # noqa: E402
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
from zplan.planner.serving_uncertainty import FIRST_TOKEN, THROUGHPUT  # noqa: E402
from zplan.planner.uncertainty import LEVEL, log_bounds  # noqa: E402

DEFAULT_REFERENCE = REPO.parent / "shared" / "reference"
INTERVALS_FILE = REPO / "planner" / "serving_prediction_error.py"
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
        row["kind"] = FIRST_TOKEN if row["metric"] == "ttft_s" else THROUGHPUT
        row["residual"] = residual(row)

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
        **interval_figures(rows),
    }


def residual(row: dict) -> float:
    """log(measured / predicted) seconds of a row predicted left one source out: of its time to first token, or of
    the time its tokens take (log(predicted / measured) tokens/s)."""
    ratio = math.log(row["measured"] / row["predicted_loso"])
    return ratio if row["metric"] == "ttft_s" else -ratio


def residuals_by_kind(rows: list[dict]) -> dict[str, tuple[float, ...]]:
    by_kind = defaultdict(list)
    for row in rows:
        by_kind[row["kind"]].append(row["residual"])
    return {kind: tuple(sorted(values)) for kind, values in sorted(by_kind.items())}


def interval_figures(rows: list[dict]) -> dict:
    """The serving intervals checked left one source out (module docstring): each row against the 80 % interval of
    its kind built from the other source's residuals only."""
    covered, widths, bases = defaultdict(list), defaultdict(list), defaultdict(lambda: defaultdict(int))
    for source in sorted({r["source"] for r in rows}):
        table = residuals_by_kind([r for r in rows if r["source"] != source])
        for row in (r for r in rows if r["source"] == source):
            (low, high), basis, *_ = log_bounds(row["kind"], table)
            covered[row["kind"]].append(low <= row["residual"] <= high)
            widths[row["kind"]].append((math.exp(high) - math.exp(low)) / 2.0)
            bases[row["kind"]][basis] += 1
    every = [inside for values in covered.values() for inside in values]
    return {
        "serving_interval_level": LEVEL,
        "serving_interval_coverage": mean(every),
        "serving_interval_half_width": float(np.median([w for values in widths.values() for w in values])),
        "serving_interval_by_kind": {kind: {"rows": len(covered[kind]), "coverage": mean(covered[kind]),
                                            "half_width": float(np.median(widths[kind])), "bases": dict(bases[kind])}
                                     for kind in sorted(covered)},
    }


def write_intervals(rows: list[dict], path: Path = INTERVALS_FILE) -> None:
    """planner/serving_prediction_error.py: every row's residual left one source out, by kind (the table the
    inference plans' intervals are built from)."""
    write_residual_table(
        path, "TensorRT-LLM's published serving runs predicted by the inference cost model, by kind\n"
        "(planner/serving_uncertainty.py): each run's log(measured / predicted) seconds, its source left out of the "
        "engine\nconstants' fit. Written by "
        "`.venv/bin/python benchmarks/validate_serving.py --write-intervals`; do not edit.\n",
        "SERVING_LOG_RESIDUALS", residuals_by_kind(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--write-intervals", action="store_true",
                        help="write the residuals by kind to planner/serving_prediction_error.py")
    args = parser.parse_args()
    result = validate(args.reference)
    if args.write_intervals:
        write_intervals(result["rows"])
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
    print(f"{result['serving_interval_level']:.0%} intervals, left one source out: the measured value inside on "
          f"{result['serving_interval_coverage']:.1%} of the rows, median half-width "
          f"{result['serving_interval_half_width']:.1%}; by kind (rows, inside, half-width, bases): "
          + ", ".join(f"{kind} {f['rows']} {f['coverage']:.0%} {f['half_width']:.1%} "
                      f"({', '.join(f'{basis} {n}' for basis, n in f['bases'].items())})"
                      for kind, f in result["serving_interval_by_kind"].items()))


if __name__ == "__main__":
    main()
