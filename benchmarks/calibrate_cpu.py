"""`zplan calibrate` on this machine: fit cpu-local to measured runs of 4 tiny plans, check it on 4 others.

    .venv/bin/python benchmarks/calibrate_cpu.py [--json] [--steps 12]

The 8 plans of benchmarks/predicted_vs_measured.py (examples/tiny.py, dp 1-2, ZeRO 0-3, 1-4 micro-batches, recompute
none / selective / full) are compiled for cpu-local and their train.py run once each with --log-json; then

    zplan calibrate PLAN0 PLAN2 PLAN4 PLAN6 --check PLAN1 --check PLAN3 --check PLAN5 --check PLAN7 -o fitted.yaml

fits the profile on the even plans and predicts the odd ones, left out of the fit, before and after. Keys:
fitted_mean_abs_error_before/after, checked_mean_abs_error_before/after (the held-out figure is the honest one).
Wall times on 2 shared cores are noisy: the load average is printed. About 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import ROOT, TINY, compile_plan_files, load_average  # noqa: E402
from predicted_vs_measured import plan_grid, run_plan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12; the first 3 dropped)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step (default 8)")
    args = parser.parse_args()
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="zplan-calibrate-") as tmp:
        specs = plan_grid(args.global_batch)
        dirs = [Path(tmp) / f"plan{i}" for i in range(len(specs))]
        for spec, out_dir in zip(specs, dirs, strict=True):
            compile_plan_files(TINY, spec["gpus"], out_dir, global_batch=args.global_batch, zero=spec["zero"],
                               micro_batch=spec["micro_batch"], recompute=spec["recompute"], dp=spec["gpus"])
            run_plan(out_dir, spec["gpus"], args.steps)
        command = [str(ROOT / ".venv" / "bin" / "zplan"), "calibrate", *map(str, dirs[0::2]),
                   *(a for d in dirs[1::2] for a in ("--check", str(d))), "-o", str(Path(tmp) / "fitted.yaml"),
                   "--json"]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    result = {**json.loads(done.stdout), "load_average": [load_start, load_average()], "steps_per_run": args.steps}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for kind in ("fitted", "checked"):
        for run in result[f"{kind}_runs"]:
            print(f"{kind:7s} {Path(run['name']).name:6s} measured {run['measured_s'] * 1e3:7.2f} ms  predicted "
                  f"{run['before_s'] * 1e3:7.2f} -> {run['after_s'] * 1e3:7.2f} ms")
    print("factors: " + ", ".join(f"{k} x{v:.3g}" for k, v in result["factors"].items()))
    print(f"mean |error| fitted runs {result['fitted_mean_abs_error_before']:.1%} -> "
          f"{result['fitted_mean_abs_error_after']:.1%}; runs left out {result['checked_mean_abs_error_before']:.1%} "
          f"-> {result['checked_mean_abs_error_after']:.1%} (load average {result['load_average']})")


if __name__ == "__main__":
    main()
