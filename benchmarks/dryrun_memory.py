"""The planner's predicted peak memory per GPU against the dry run's measurement, for plans of large models.

    .venv/bin/python benchmarks/dryrun_memory.py [--json] [--quick] [--only NAME...]

Each plan is `zplan compile MODEL --gpus G --cluster C PINS -o DIR` for a model file that builds one of the
example models at a published size (examples/llama.py as Llama-3-8B and 70B, 128k vocabulary; examples/gpt.py as
GPT-3 175B; examples/moe.py as Mixtral-8x7B, ZeRO-3 and expert parallel), 8 to 1024 GPUs, ZeRO 0-3, tp 1-8, pp
1-8, context parallel 2, recompute none / selective / full, micro-batch 1-8, CPU offload. `zplan dryrun DIR` then
runs the plan's program on fake tensors for the pipeline's end stages (the planner prices the more loaded of the
first and last: planner/cost/memory.py) and the figure compared is peak allocated bytes on the most loaded rank:
measured by the dry run (runtime.dryrun.live_memory), predicted as the plan's total minus its framework reserve.

Besides: the Llama-3-8B plan at 64 GPUs is dry-run as `python -m zplan dryrun` in a child process whose wall time
and peak RSS are the keys dryrun_8b_64_s and dryrun_peak_rss_bytes (target: under 60 s, 4 GB on 2 cores).
Prints one row per plan and the mean and max relative error (keys plans, max_rel_error, mean_rel_error).
Takes about 2 hours on 2 cores (each 70B or 175B plan 3-13 min; --quick: 6 plans, about 4 min).
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {  # name -> (example file, build_model keyword arguments)
    "llama3-8b": ("llama.py", {}),
    "llama3-70b": ("llama.py", dict(num_layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672)),
    "gpt3-175b": ("gpt.py", {}),
    "mixtral-8x7b": ("moe.py", {}),  # examples/moe.py's defaults: 8 experts, top-2
}
# (name, model, gpus, cluster, pins): pins as zplan compile's options
PLANS = [
    ("8b-8-z3", "llama3-8b", 8, "dgx-h100", dict(zero=3, micro_batch=1, recompute="none", seq=4096)),
    ("8b-8-z3-sel", "llama3-8b", 8, "dgx-h100", dict(zero=3, micro_batch=2, recompute="selective", seq=4096)),
    ("8b-8-z3-full-mb8", "llama3-8b", 8, "dgx-h100", dict(zero=3, micro_batch=8, recompute="full", seq=2048)),
    ("8b-8-z2", "llama3-8b", 8, "dgx-h100", dict(zero=2, micro_batch=1, recompute="full", seq=4096)),
    ("8b-8-z1-tp2", "llama3-8b", 8, "dgx-h100", dict(tp=2, zero=1, micro_batch=1, recompute="full", seq=4096)),
    ("8b-8-z0-tp8", "llama3-8b", 8, "dgx-h100", dict(tp=8, zero=0, micro_batch=1, recompute="selective")),
    ("8b-8-tp4-pp2", "llama3-8b", 8, "dgx-h100", dict(tp=4, pp=2, zero=1, micro_batch=1, recompute="none")),
    ("8b-8-z3-offload", "llama3-8b", 8, "dgx-a100-80g", dict(zero=3, offload="cpu", micro_batch=1, seq=4096)),
    ("8b-8-z1-offload", "llama3-8b", 8, "dgx-a100-80g", dict(tp=2, zero=1, offload="cpu", micro_batch=1,
                                                             recompute="full")),
    ("8b-64", "llama3-8b", 64, "dgx-h100", {}),
    ("8b-64-tp2", "llama3-8b", 64, "dgx-h100", dict(tp=2, zero=3, micro_batch=2, recompute="selective")),
    ("8b-64-pp4", "llama3-8b", 64, "dgx-h100", dict(tp=2, pp=4, zero=1, micro_batch=1)),
    ("8b-128-pp2", "llama3-8b", 128, "dgx-h100", dict(pp=2, tp=1, zero=1, micro_batch=1, recompute="full")),
    ("8b-256-z3", "llama3-8b", 256, "dgx-h100", dict(zero=3, micro_batch=4, recompute="full", seq=2048)),
    ("8b-1024-z3", "llama3-8b", 1024, "dgx-h100", dict(zero=3, tp=1, micro_batch=1, seq=4096)),
    ("70b-64-tp8", "llama3-70b", 64, "dgx-h100", dict(tp=8, zero=3, micro_batch=1, recompute="selective",
                                                      seq=4096)),
    ("70b-64-tp8-pp2", "llama3-70b", 64, "dgx-h100", dict(tp=8, pp=2, zero=1, micro_batch=1, recompute="full",
                                                          seq=4096)),
    ("70b-128-tp4-pp4", "llama3-70b", 128, "dgx-h100", dict(tp=4, pp=4, zero=1, micro_batch=1, recompute="full",
                                                            seq=4096)),
    ("70b-256-tp8-pp8", "llama3-70b", 256, "dgx-h100", dict(tp=8, pp=8, zero=1, micro_batch=1, seq=4096)),
    ("70b-512-z3", "llama3-70b", 512, "dgx-h100", dict(tp=4, zero=3, micro_batch=1, recompute="full",
                                                       seq=4096)),
    ("70b-1024-tp8-pp4", "llama3-70b", 1024, "dgx-h100", dict(tp=8, pp=4, zero=1, micro_batch=2,
                                                              recompute="selective", seq=4096)),
    ("70b-64-offload", "llama3-70b", 64, "dgx-a100-80g", dict(tp=8, zero=3, offload="cpu", micro_batch=1,
                                                              recompute="full", seq=4096)),
    ("175b-1024-tp8-pp8", "gpt3-175b", 1024, "dgx-a100-80g", dict(tp=8, pp=8, zero=1, micro_batch=1,
                                                                  recompute="full")),
    ("175b-1024-tp4-z3", "gpt3-175b", 1024, "dgx-a100-80g", dict(tp=4, zero=3, micro_batch=1,
                                                                 recompute="selective")),
    ("175b-512-tp8-pp4", "gpt3-175b", 512, "dgx-h100", dict(tp=8, pp=4, zero=1, micro_batch=1, recompute="full")),
    ("175b-256-tp8-pp8-mb2", "gpt3-175b", 256, "dgx-h100", dict(tp=8, pp=8, zero=1, micro_batch=2,
                                                                recompute="full")),
    ("175b-1024-z3-pp2", "gpt3-175b", 1024, "dgx-h100", dict(tp=8, pp=2, zero=3, micro_batch=1,
                                                             recompute="full")),
    ("175b-128-offload", "gpt3-175b", 128, "dgx-a100-80g", dict(tp=8, zero=3, offload="cpu", micro_batch=1,
                                                                recompute="full")),
    ("8b-16-z0-pp8", "llama3-8b", 16, "dgx-h100", dict(pp=8, tp=1, dp=2, zero=0, micro_batch=1, seq=4096)),
    ("8b-32-z2-tp4", "llama3-8b", 32, "dgx-h100", dict(tp=4, zero=2, micro_batch=4, recompute="full")),
    # pipelines of 32+ micro-batches: receive buffers for the micro-batches in flight only
    ("8b-8-pp4-m32", "llama3-8b", 8, "dgx-h100", dict(pp=4, tp=1, dp=2, zero=1, micro_batch=1, recompute="full",
                                                      batch=64, seq=4096)),
    ("8b-64-tp8-pp2-m32", "llama3-8b", 64, "dgx-h100", dict(tp=8, pp=2, dp=4, zero=1, micro_batch=1,
                                                            recompute="selective", batch=128, seq=8192)),
    ("8b-8-pp2-v2-m32", "llama3-8b", 8, "dgx-h100", dict(pp=2, tp=1, dp=4, zero=1, micro_batch=1, interleave=2,
                                                         recompute="full", batch=128, seq=4096)),
    ("175b-256-tp8-pp8-m64", "gpt3-175b", 256, "dgx-a100-80g", dict(tp=8, pp=8, zero=1, micro_batch=1,
                                                                     recompute="full", batch=256)),
    ("70b-64-tp4-pp4-m32", "llama3-70b", 64, "dgx-h100", dict(tp=4, pp=4, zero=1, micro_batch=1, recompute="full",
                                                              batch=128, seq=4096)),
    ("8b-8-cp2-z3", "llama3-8b", 8, "dgx-h100", dict(dp=4, cp=2, zero=3, micro_batch=1, recompute="none",
                                                     seq=8192)),
    # mixtures of experts: 8 experts over 64 ranks (ZeRO-3 shards them on another dim), and expert parallel
    ("moe-64-z3", "mixtral-8x7b", 64, "dgx-h100", dict(tp=1, pp=1, ep=1, zero=3, micro_batch=1, recompute="full",
                                                       seq=4096)),
    ("moe-64-z3-pp4", "mixtral-8x7b", 64, "dgx-h100", dict(tp=1, pp=4, ep=1, zero=3, micro_batch=1,
                                                           recompute="full", seq=4096)),
    ("moe-128-ep8-pp4", "mixtral-8x7b", 128, "dgx-h100", dict(tp=1, pp=4, ep=8, zero=0, micro_batch=1,
                                                              recompute="full", seq=4096)),
    ("moe-64-ep8-z3", "mixtral-8x7b", 64, "dgx-h100", dict(tp=1, pp=1, ep=8, zero=3, micro_batch=1,
                                                           recompute="full", seq=4096)),
    ("moe-256-ep4-tp2-z2", "mixtral-8x7b", 256, "dgx-h100", dict(tp=2, pp=1, ep=4, zero=2, micro_batch=2,
                                                                 recompute="full", seq=4096)),
]
QUICK = ["8b-8-z3", "8b-8-z1-tp2", "8b-8-tp4-pp2", "8b-64", "70b-64-tp8", "175b-1024-tp8-pp8"]


def model_file(folder: Path, name: str) -> Path:
    """A model file building the example at the published size (it imports the example from this repository)."""
    example, sizes = MODELS[name]
    path = folder / f"{name.replace('-', '_')}.py"
    path.write_text(
        f'"""{name}: examples/{example} at {sizes or "its default sizes"}."""\n'
        "import importlib.util\n"
        f"_spec = importlib.util.spec_from_file_location('example', {str(REPO / 'examples' / example)!r})\n"
        "_example = importlib.util.module_from_spec(_spec)\n_spec.loader.exec_module(_example)\n"
        "SEQ_LEN, VOCAB_SIZE = _example.SEQ_LEN, _example.VOCAB_SIZE\n\n\n"
        f"def build_model():\n    return _example.build_model(**{sizes!r})\n")
    return path


def compile_plan(model: Path, gpus: int, cluster: str, pins: dict, out: Path) -> None:
    from zplan.api import compile_plan as compile_
    from zplan.api import prepare, write_outputs
    from zplan.schemas.spec import Pins

    pins = dict(pins)
    seq, batch = pins.pop("seq", None), pins.pop("batch", None)
    plan = compile_(prepare(str(model), gpus, cluster, batch, seq, None, Pins(**pins)))
    write_outputs(plan, out, str(model))


def dry_run_in_child(out: Path) -> tuple[dict, float, int]:
    """`python -m zplan dryrun OUT --json --stages 0,last` in a child: its result, wall seconds, peak RSS bytes."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "zplan", "dryrun", str(out), "--json", "--end-stages"],
                          capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1, 2):  # 1: over capacity or failing, 2: a plan the dry run cannot run (offload)
        raise RuntimeError(done.stderr[-2000:])
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux; the largest child so far
    lines = [line for line in done.stderr.splitlines() if not line.startswith("[rank")]
    return json.loads(done.stdout) if done.stdout.strip() else {"error": "\n".join(lines)[-400:]}, seconds, rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--only", nargs="*", help="plan names to run")
    args = parser.parse_args()
    chosen = [p for p in PLANS if (not args.quick or p[0] in QUICK) and (not args.only or p[0] in args.only)]
    rows = []
    timing = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        models = {name: model_file(folder, name) for name in MODELS}
        for name, model, gpus, cluster, pins in chosen:
            out = folder / name
            try:
                compile_plan(models[model], gpus, cluster, pins, out)
            except Exception as error:  # an infeasible pin set: reported, not measured
                rows.append({"name": name, "error": f"compile: {error}"[:300]})
                continue
            result, seconds, rss = dry_run_in_child(out)
            if "ranks" not in result:
                rows.append({"name": name, "error": result.get("error", "")})
                print(f"{name:24s} dry run failed: {rows[-1]['error'][-200:]}", file=sys.stderr, flush=True)
                continue
            plan = json.loads((out / "plan.json").read_text())
            top = max(result["ranks"], key=lambda r: r["measured_peak_bytes"])
            row = {"name": name, "model": model, "gpus": gpus, "cluster": cluster, "parallel": plan["parallel"],
                   "seq": plan["train"]["seq_len"], "measured_peak_bytes": top["measured_peak_bytes"],
                   "predicted_peak_bytes": top["predicted_peak_bytes"], "rel_error": result["max_rel_error"],
                   "measured_by_category": top["by_category"], "predicted_by_category": top["predicted_by_category"],
                   "host_peak_bytes": top["host_peak_bytes"], "predicted_host_bytes": top["predicted_host_bytes"],
                   "dryrun_s": seconds}
            rows.append(row)
            if name == "8b-64":
                timing = {"dryrun_8b_64_s": seconds, "dryrun_peak_rss_bytes": rss}
            p = plan["parallel"]
            print(f"{name:24s} tp{p['tp']} pp{p['pp']} dp{p['dp']} z{p['zero_stage']} mb{p['micro_batch']} "
                  f"{p['recompute']:9s} {p['offload']:4s}  measured {row['measured_peak_bytes'] / 2**30:7.2f} GiB  "
                  f"predicted {row['predicted_peak_bytes'] / 2**30:7.2f} GiB  error {row['rel_error']:6.1%}  "
                  f"({seconds:.0f} s)", file=sys.stderr, flush=True)
    measured = [r for r in rows if "rel_error" in r]
    errors = [r["rel_error"] for r in measured]
    summary = {"plans": rows, "plans_measured": len(measured),
               "max_rel_error": max(errors) if errors else None,
               "mean_rel_error": sum(errors) / len(errors) if errors else None, **timing}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{len(measured)} plans measured (of {len(rows)}); relative error of the predicted peak: mean "
              f"{summary['mean_rel_error']:.1%}, max {summary['max_rel_error']:.1%}; " + ", ".join(
                  f"{k} {v:.3g}" for k, v in timing.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
