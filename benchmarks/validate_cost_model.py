"""Cost model against published measurements (../shared/reference/published_runs.csv).

For every row: `zplan estimate` of the published configuration (same model, GPUs, tp, pp, dp, global
batch, micro-batch and recompute where published; Megatron's plain data parallel = ZeRO-0) against the
measured iteration time; and `zplan compile`'s own pick for the same model, GPUs and batch, which must
be predicted no slower than the published configuration.

    .venv/bin/python benchmarks/validate_cost_model.py [--json] [--csv PATH]
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from zplan.api import compile_plan, estimate_config, prepare
from zplan.schemas.spec import Pins

DEFAULT_CSV = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "published_runs.csv"
CLUSTER = "dgx-a100-80g"  # both papers ran on Selene (DGX A100 80GB)


def measured_iteration_s(row: dict) -> float:
    """Measured time, or Narayanan's Eq. 3 FLOPs over the published per-GPU throughput."""
    if row["iter_time_s"]:
        return float(row["iter_time_s"])
    B, s, L, h, V = (int(row[k]) for k in ("global_batch", "seq_len", "layers", "hidden", "vocab"))
    flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))  # Narayanan SC'21 Eq. 3
    return flops / (float(row["tflops_per_gpu"]) * 1e12 * int(row["gpus"]))


def published_pins(row: dict) -> Pins:
    recompute = row["recompute"] or "full"
    return Pins(
        tp=int(row["tp"]), pp=int(row["pp"]), dp=int(row["dp"]), zero=0,
        micro_batch=int(row["micro_batch"]) if row["micro_batch"] else None,
        recompute="full" if recompute == "full" else "selective",
        sequence_parallel="sequence" in recompute, interleave=int(row["interleave_v"] or 1), offload="none",
    )


def family_spec(row: dict) -> str:
    return ("gpt:layers={layers},hidden={hidden},heads={heads},seq={seq_len},vocab={vocab}".format(**row))


def validate(csv_path: Path) -> dict:
    rows = []
    for row in csv.DictReader(csv_path.open()):
        gpus, batch = int(row["gpus"]), int(row["global_batch"])
        spec = family_spec(row)
        published = estimate_config(prepare(spec, gpus, CLUSTER, batch, None, "bf16", published_pins(row)))
        measured = measured_iteration_s(row)
        chosen = compile_plan(prepare(spec, gpus, CLUSTER, batch, None, "bf16", Pins()))
        rows.append({
            "source": row["source"], "model": row["model"], "gpus": gpus,
            "measured_s": measured, "predicted_s": published["step_time_s"],
            "error": published["step_time_s"] / measured - 1.0, "published_feasible": published["feasible"],
            "micro_batch_used": published["config"]["micro_batch"],
            "zplan_plan": chosen.parallel.model_dump(), "zplan_predicted_s": chosen.prediction.step_time_s,
            "zplan_not_worse": chosen.prediction.step_time_s <= published["step_time_s"] * (1 + 1e-9),
        })
    errors = [abs(r["error"]) for r in rows]
    by_source = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(abs(r["error"]))
    return {
        "rows": rows,
        "mean_abs_error": sum(errors) / len(errors),
        "max_abs_error": max(errors),
        "mean_abs_error_by_source": {k: sum(v) / len(v) for k, v in by_source.items()},
        "zplan_plan_not_worse_all": all(r["zplan_not_worse"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    result = validate(args.csv)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'model':30s} {'gpus':>5s} {'measured s':>11s} {'predicted s':>12s} {'error':>7s} {'zplan s':>9s}")
    for r in result["rows"]:
        print(f"{r['model'][:30]:30s} {r['gpus']:5d} {r['measured_s']:11.3f} {r['predicted_s']:12.3f} "
              f"{r['error']:+7.1%} {r['zplan_predicted_s']:9.3f}")
    print(f"mean |error| {result['mean_abs_error']:.1%} (max {result['max_abs_error']:.1%}); "
          f"zplan's plan never predicted slower: {result['zplan_plan_not_worse_all']}")


if __name__ == "__main__":
    main()
