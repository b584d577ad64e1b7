"""Cost model against published measured training runs (../shared/reference: published_runs.csv, training_runs.csv).

    .venv/bin/python benchmarks/validate_cost_model.py [--json] [--picks] [--reference DIR]

Every row zplan can express (benchmarks/reference_runs.py: the others are listed with the reason) is predicted by
`zplan estimate` of its published configuration (model, GPUs, tp, pp, cp, dp, global batch, micro-batch, recompute,
ZeRO stage) on the built-in profile of its GPU. The built-in profiles describe zplan's own runtime; a run of another
software stack (Megatron 2021, Megatron-Core, DeepSpeed, PyTorch FSDP1 and FSDP2 together: STACK_GROUPS) is matched
through one efficiency per stack, the geometric mean of measured / predicted over the rows it is fitted on (no per-row
correction), after what the stack is known to overlap (STACK_HIDES, not fitted):
- in sample (key mean_abs_error): the stack efficiencies fitted on every row;
- leave one source out (key loso_mean_abs_error, the headline): each source predicted with the efficiencies fitted
  on the other sources only (a stack seen in no other source keeps efficiency 1);
- raw (key raw_mean_abs_error): zplan's runtime profile as is.
coverage: expressible rows over all rows. published_over_memory: the published layouts zplan's memory model does not
fit as they ran (validate's memory_fit: a row that prints no recompute fits when some recompute mode does; a
Megatron-Core row that does not print its optimizer sharding is priced with the stack's default, the distributed
optimizer: reference_runs.STACK_DEFAULT_OPTIMIZER), each listed with how far over and its largest terms in
published_over_memory_rows. --picks also compiles zplan's own plan for each row's model, GPUs and
batch and prints its predicted time over the published layout's, both from the same model (a prediction, not a
measurement; slow: a search per row).

Mixture of experts (../shared/reference/moe_runs.csv and the rows added from the same tables, 25.11 to 26.08,
benchmarks/moe_runs_added.csv: Megatron-Bridge; reference_runs.load_moe_runs): every
expressible row is predicted the same way, its model traced from its architecture's model file at the row's sizes
(benchmarks/moe_models/) with its ep pinned. The MoE rows are the megatron-core stack: they share its efficiency and
attention factor with the dense megatron-core rows; under fp8 its routed experts run at the GEMM peak
(STACK_LOW_PRECISION_EXPERTS), and a row whose recipe overlaps the expert-parallel all-to-all has it taken off as the
stack's other overlaps are (reference_runs.MOE_RECIPES; not fitted). The dense figures above are those of the
dense rows alone, fitted on them alone, as before; the MoE figures (keys moe_*) are:
- in sample (moe_mean_abs_error): the efficiencies fitted on every row, dense and MoE;
- leave one source out (moe_loso_mean_abs_error): each MoE source (its `source` column: one container release) with
  the efficiencies fitted on every other source, dense and MoE;
- fitted on the dense rows only (moe_dense_fit_mean_abs_error): no MoE row in the fit;
- raw (moe_raw_mean_abs_error); moe_coverage: expressible MoE rows over all MoE rows.
Each MoE row also carries its traced total and active parameters beside those the row prints, whether zplan's memory
model fits the published layout, and the all-to-all seconds in its prediction. Slow: each model is traced (~3-10 s).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _residual_table import write_residual_table  # noqa: E402
from reference_runs import ReferenceRun, load_moe_runs, load_reference_runs  # noqa: E402

from zplan.api import compile_plan, prepare  # noqa: E402
from zplan.errors import ZplanError  # noqa: E402
from zplan.estimate_api import estimate_config  # noqa: E402
from zplan.planner.cost.compute import BACKWARD_OVER_FORWARD  # noqa: E402
from zplan.planner.uncertainty import LEVEL, log_bounds, regime_of  # noqa: E402
from zplan.schemas.spec import Pins  # noqa: E402

DEFAULT_REFERENCE = REPO.parent / "shared" / "reference"
INTERVALS_FILE = REPO / "planner" / "prediction_error.py"


# Communication a stack hides behind compute where zplan's runtime does not: Megatron-Core overlaps the tensor-parallel
# all-gathers / reduce-scatters with the GEMMs (Transformer Engine userbuffers, --tp-comm-overlap) and the
# data-parallel gradient reduce-scatter and parameter all-gather with backward and forward (--overlap-grad-reduce,
# --overlap-param-gather), all on in NeMo's and Megatron-LM's performance recipes, and runs context parallel as a
# ring of K/V point-to-point sends overlapped with each attention step (Transformer Engine's cp_comm_type p2p). Their
# predicted seconds (time_breakdown) are taken off the step; nothing is fitted.
STACK_HIDES = {"megatron-core": ("tensor_parallel", "context_parallel", "data_parallel")}

# Stacks whose grouped GEMM runs the routed experts in the training precision (fp8, nvfp4), where zplan's runtime runs
# them in the compute dtype: Megatron-Core's grouped expert MLP is Transformer Engine's GroupedLinear, inside the fp8 /
# fp4 autocast of its recipes. Such a row's experts are priced at the GEMM peak (ExpertsSummary.at_gemm_peak); not
# fitted.
STACK_LOW_PRECISION_EXPERTS = {"megatron-core"}

# Stacks that split a pipeline's blocks evenly over its stages, the embedding on the first and the head on the last,
# where zplan's runtime balances the stages (planner.partition): Megatron-LM requires num_layers to divide by pp
# (Narayanan et al. SC'21), and Megatron-Core does the same unless a recipe sets pipeline_model_parallel_layout or
# account_for_embedding/loss_in_pipeline_split (then interleaved_partition's other case). Priced with that split
# (estimate_config's uniform_stages); not fitted.
STACK_UNIFORM_STAGES = {"megatron-2021", "megatron-core"}


# A stack's attention kernel against the profile's flash figure (cuDNN / Transformer Engine's fused attention in
# Megatron-Core, FlashAttention versions, Triton kernels): its speed relative to efficiency.attention, fitted per stack
# on this grid.
ATTENTION_FACTORS = [round(0.5 + 0.1 * i, 1) for i in range(16)]  # 0.5 .. 2.0


def published_stack(request):
    """The request with its profile's host time unpriced: a published run's host dispatches its stack's way (fused
    kernels, CUDA graphs), not zplan's runtime's, whose measured cost per op the GPU profiles carry."""
    return replace(request, cluster=request.cluster.without_host())


def predict(run: ReferenceRun) -> dict:
    """step_s: iteration seconds of the run's configuration on zplan's profile; predicted_s: those seconds less what
    its stack and its recipe (run.recipe_hides) hide; attention_s: the attention core's seconds in them; fits: whether
    zplan's memory model fits the configuration in the GPU's memory. The attention seconds are what the step gains
    when the profile's flash efficiency is halved, the configuration held (micro-batch and recompute pinned to the first
    estimate's): the step is linear in 1 / efficiency.attention. Profiles with no flash figure (the GEMM curve) give
    0."""
    request = experts_as_run(run, published_stack(
        prepare(run.spec, run.gpus, run.cluster, run.global_batch, None, run.precision, run.pins)))
    uniform = run.stack in STACK_UNIFORM_STAGES
    estimate = estimate_config(request, uniform)
    hidden = sum(estimate["time_breakdown"][part] for part in (*STACK_HIDES.get(run.stack, ()), *run.recipe_hides))
    flash = request.cluster.efficiency.attention
    step = estimate["step_time_s"]
    config = estimate["config"]
    regime = regime_of(config["tp"], config["pp"], config["cp"], config["num_micro_batches"], config["offload"],
                       run.precision, request.summary.seq_len, request.summary.experts is not None)
    result = {"step_s": step, "predicted_s": step - hidden, "attention_s": 0.0, "estimate": estimate,
              "summary": request.summary, "regime": regime, **memory_fit(run, request, estimate, uniform)}
    if flash is None:
        return result
    chosen = estimate["config"]
    slower = replace(
        request, pins=request.pins.model_copy(update={"micro_batch": chosen["micro_batch"],
                                                      "recompute": chosen["recompute"]}),
        cluster=request.cluster.model_copy(
            update={"efficiency": request.cluster.efficiency.model_copy(update={"attention": flash / 2})}))
    return {**result, "attention_s": estimate_config(slower, uniform)["step_time_s"] - step}


def experts_as_run(run: ReferenceRun, request):
    """`request` with its routed experts as the run's stack and recipe run them: at the GEMM peak where the stack runs
    them in its fp8 / fp4 (STACK_LOW_PRECISION_EXPERTS), dispatched as its recipe dispatches them (run.dispatch); as is
    for a dense model and where nothing differs."""
    experts = request.summary.experts
    if experts is None:
        return request
    update = {"dispatch": run.dispatch} if run.dispatch != experts.dispatch else {}
    if run.stack in STACK_LOW_PRECISION_EXPERTS and run.precision in ("fp8", "nvfp4"):
        update["at_gemm_peak"] = True
    if not update:
        return request
    return replace(request, summary=request.summary.model_copy(update={"experts": experts.model_copy(update=update)}))


def memory_fit(run: ReferenceRun, request, estimate: dict, uniform_stages: bool) -> dict:
    """fits: whether zplan's memory model fits the run as it ran: its layout as printed, and where it prints no
    recompute (run.recompute_printed), with the least recompute that fits (fit_recompute); over_memory: for a run that
    does not fit, how far over and the largest terms (zplan.api.over_memory). `uniform_stages`: as predict's."""
    if estimate["feasible"]:
        return {"fits": True, "fit_recompute": estimate["config"]["recompute"], "over_memory": ""}
    for mode in ("selective", "full") if not run.recompute_printed else ():
        deeper = replace(request, pins=request.pins.model_copy(update={"recompute": mode}))
        if estimate_config(deeper, uniform_stages)["feasible"]:
            return {"fits": True, "fit_recompute": mode, "over_memory": ""}
    return {"fits": False, "fit_recompute": None, "over_memory": estimate["over_memory"]["summary"]}


def stack_seconds(row: dict, factor: float) -> float:
    """The row's predicted seconds with its stack's attention kernel `factor` times as fast as the profile's."""
    return row["predicted_s"] - row["attention_s"] + row["attention_s"] / factor


# Stacks that share one efficiency: PyTorch FSDP1 and FSDP2 both run the model's own eager PyTorch code with the same
# kernels (attention, norms, activations); they differ in how the parameters are sharded and gathered, which the cost
# model prices itself. A source of one is predicted with the other's rows where its own stack is in no other source.
STACK_GROUPS = {"fsdp1": "pytorch-fsdp", "fsdp2": "pytorch-fsdp"}


def fit_group(stack: str) -> str:
    """The name a stack's efficiency is fitted under (STACK_GROUPS; else its own)."""
    return STACK_GROUPS.get(stack, stack)


MIN_ATTENTION_ROWS = 10  # rows with a flash attention core a stack needs before its attention factor is fitted


def stack_efficiencies(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """{stack: (efficiency, attention factor)} over `rows`. Per stack, for each attention factor of ATTENTION_FACTORS
    (only 1 where fewer than MIN_ATTENTION_ROWS of its rows have a flash core) the efficiency is the geometric mean of
    measured / predicted. The factor kept is the one nearest 1 whose mean |log error| is within one standard error of
    the least (the one-standard-error rule, Breiman et al. 1984, section 3.4.3): where the rows hardly tell factors
    apart, the fit makes no attention correction it cannot support."""
    by_stack = defaultdict(list)
    for row in rows:
        by_stack[fit_group(row["stack"])].append(row)
    fitted = {}
    for stack, members in by_stack.items():
        with_flash = sum(r["attention_s"] > 0 for r in members)
        candidates = []  # (mean |log error|, its standard error, efficiency, factor)
        for factor in ATTENTION_FACTORS if with_flash >= MIN_ATTENTION_ROWS else [1.0]:
            logs = [math.log(r["measured_s"] / stack_seconds(r, factor)) for r in members]
            centre = sum(logs) / len(logs)
            deviations = [abs(v - centre) for v in logs]
            spread = math.sqrt(mean((d - mean(deviations)) ** 2 for d in deviations) / len(deviations))
            candidates.append((mean(deviations), spread, math.exp(centre), factor))
        best, standard_error, _, _ = min(candidates)
        _, _, efficiency, factor = min((c for c in candidates if c[0] <= best + standard_error),
                                       key=lambda c: abs(c[3] - 1.0))
        fitted[stack] = (efficiency, factor)
    return fitted


def relative_error(row: dict, fitted: dict[str, tuple[float, float]]) -> float:
    efficiency, factor = fitted.get(fit_group(row["stack"]), (1.0, 1.0))
    return stack_seconds(row, factor) * efficiency / row["measured_s"] - 1.0


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def validate(reference: Path, picks: bool = False, moe: bool = True) -> dict:
    """The figures of the module docstring; moe False leaves out the MoE rows (their keys; the dense figures do not
    depend on them)."""
    runs, refused = load_reference_runs(reference)
    total = len(runs) + len(refused)

    def dense_row(run: ReferenceRun, predicted: dict) -> dict:
        row = {"label": run.label, "source": run.source, "stack": run.stack, "cluster": run.cluster,
               "precision": run.precision, "gpus": run.gpus, "measured_s": run.measured_s,
               "predicted_s": predicted["predicted_s"], "attention_s": predicted["attention_s"],
               "fits_in_zplans_memory_model": predicted["fits"], "fit_recompute": predicted["fit_recompute"],
               "over_memory": predicted["over_memory"], "assumed": run.assumed,
               "recompute_printed": run.recompute_printed, "regime": predicted["regime"]}
        if picks:
            chosen = compile_plan(published_stack(prepare(run.spec, run.gpus, run.cluster, run.global_batch, None,
                                                          run.precision, Pins())))
            row["zplan_pick_over_published"] = chosen.prediction.step_time_s / predicted["step_s"]  # both zplan's
        return row

    rows = predicted_rows(runs, refused, dense_row)

    in_sample = stack_efficiencies(rows)
    loso, by_source = leave_one_source_out(rows, rows)
    for row in rows:
        row["error"] = relative_error(row, in_sample)
        row["raw_error"] = relative_error(row, {})
    ratios = sorted(r["zplan_pick_over_published"] for r in rows if "zplan_pick_over_published" in r)
    moe_figures = validate_moe(reference, rows) if moe else {}
    return {
        "rows": rows,
        "refused": refused,
        "picks": {"rows": len(ratios), "median_pick_over_published": ratios[len(ratios) // 2],
                  "pick_faster_by_5pct": sum(x < 0.95 for x in ratios), "pick_slower": sum(x > 1.001 for x in ratios),
                  "published_layout_over_memory": sum(not r["fits_in_zplans_memory_model"] for r in rows)}
        if ratios else None,
        # the published layouts over zplan's memory model, as they ran (memory_fit), each with what overflows
        "published_over_memory": sum(not r["fits_in_zplans_memory_model"] for r in rows),
        "published_over_memory_rows": {r["label"]: r["over_memory"] for r in rows
                                       if not r["fits_in_zplans_memory_model"]},
        "priced_with_stack_default_optimizer": sum("optimizer sharding" in r["assumed"] for r in rows),
        "priced_with_footnoted_precision": sum("precision not printed" in r["assumed"] for r in rows),
        "coverage": len(rows) / total,
        "expressible_rows": len(rows),
        "all_rows": total,
        "stack_efficiencies": in_sample,
        "mean_abs_error": mean(abs(r["error"]) for r in rows),
        "loso_mean_abs_error": mean(abs(r["loso_error"]) for r in rows),
        "raw_mean_abs_error": mean(abs(r["raw_error"]) for r in rows),
        "by_source": {source: {**loso[source],
                               "mean_abs_error": mean(abs(r["error"]) for r in by_source[source]),
                               "raw_mean_abs_error": mean(abs(r["raw_error"]) for r in by_source[source])}
                      for source in by_source},
        # the mean signed error left out: + the model predicts slower than measured, - faster (optimistic)
        "max_abs_source_bias": max(abs(figures["loso_mean_error"]) for figures in loso.values()),
        **interval_figures(rows),
        **moe_figures,
    }


PARAMS_TOLERANCE = 0.02  # a traced total or active parameter count this far from the row's is a finding


def moe_row(run: ReferenceRun, predicted: dict) -> dict:
    """A MoE row's figures: measured and predicted seconds, as the dense rows', and what it was checked on."""
    summary, estimate = predicted["summary"], predicted["estimate"]
    total = summary.params / 1e9
    active = (summary.experts.active_params if summary.experts is not None else summary.params) / 1e9
    published_total, published_active = run.published_params_b
    config = estimate["config"]
    return {"label": run.label, "source": run.source, "stack": run.stack, "cluster": run.cluster,
            "precision": run.precision, "gpus": run.gpus, "measured_s": run.measured_s,
            "predicted_s": predicted["predicted_s"], "attention_s": predicted["attention_s"],
            "step_s": predicted["step_s"], "regime": predicted["regime"],
            "expert_parallel_s": estimate["time_breakdown"]["expert_parallel"],
            "time_breakdown": estimate["time_breakdown"],
            "layout": {key: config.get(key) for key in ("tp", "pp", "dp", "cp", "ep", "interleave", "zero_stage",
                                                        "micro_batch", "recompute")},
            "fits_in_zplans_memory_model": predicted["fits"],
            "memory_per_gpu_gib": estimate["memory_per_gpu_bytes"] / 2**30,
            "traced_params_b": total, "traced_active_params_b": active,
            "published_params_b": published_total, "published_active_params_b": published_active,
            "params_mismatch": [f"{name} {traced:.2f}B traced vs {printed:g}B printed ({traced / printed - 1:+.1%})"
                                for name, traced, printed in (("total", total, published_total),
                                                              ("active", active, published_active))
                                if abs(traced / printed - 1.0) > PARAMS_TOLERANCE],
            # FLOPs a token as the row counts them (TFLOP/s over tokens/s) over the traced model's training FLOPs a
            # token (forward x (1 + backward)): a row whose two rates disagree with its model is worth checking
            "printed_over_traced_flops_per_token": (run.published_flops_per_token / (
                summary.fwd_flops_per_sample * (1.0 + BACKWARD_OVER_FORWARD) / summary.seq_len)
                if run.published_flops_per_token else None),
            "caveat": run.caveat, "assumed": run.assumed,
            "experts_at_gemm_peak": bool(summary.experts is not None and summary.experts.at_gemm_peak),
            "uniform_stages": run.stack in STACK_UNIFORM_STAGES and config["pp"] > 1 and config["interleave"] == 1}


def predicted_rows(runs: list[ReferenceRun], refused: dict[str, str], make_row) -> list[dict]:
    """make_row(run, predict(run)) for every run zplan prices; a run whose layout zplan refuses goes to `refused`
    with the reason."""
    rows = []
    for run in runs:
        try:
            predicted = predict(run)
        except ZplanError as error:
            refused[run.label] = f"zplan refuses the layout: {str(error).splitlines()[0]}"
            continue
        rows.append(make_row(run, predicted))
    return rows


def leave_one_source_out(rows: list[dict], fit_on: list[dict]) -> tuple[dict, dict]:
    """Each row's loso_error (set on it): predicted with the stack efficiencies fitted on the rows of `fit_on` from
    the other sources. Returns (per source: its rows' count, mean absolute error and the efficiencies used; the rows
    by source)."""
    by_source = defaultdict(list)
    for row in rows:
        by_source[row["source"]].append(row)
    loso = {}
    for source, held_out in by_source.items():
        fitted = stack_efficiencies([r for r in fit_on if r["source"] != source])
        for row in held_out:
            row["loso_error"] = relative_error(row, fitted)
        loso[source] = {"rows": len(held_out), "loso_mean_abs_error": mean(abs(r["loso_error"]) for r in held_out),
                        "loso_mean_error": mean(r["loso_error"] for r in held_out),
                        "efficiencies_used": {s: fitted.get(s, (1.0, 1.0))
                                              for s in {fit_group(r["stack"]) for r in held_out}}}
    return loso, by_source


def residual(row: dict) -> float:
    """log(measured / predicted) seconds of a row predicted left one source out (its loso_error)."""
    return -math.log1p(row["loso_error"])


def residuals_by_regime(rows: list[dict]) -> dict[str, tuple[float, ...]]:
    by_regime = defaultdict(list)
    for row in rows:
        by_regime[row["regime"]].append(residual(row))
    return {regime: tuple(sorted(values)) for regime, values in sorted(by_regime.items())}


def interval_figures(rows: list[dict], prefix: str = "", fit_on: list[dict] | None = None) -> dict:
    """The prediction intervals checked left one source out (planner/uncertainty.py): each row's 80 % interval is built
    from the residuals of the rows of `fit_on` (default `rows`) from other sources only, and the row is covered when
    its own residual lies in it. interval_coverage: the share covered; interval_half_width: the median of half the
    interval's width over the central prediction; interval_coverage_by_regime: (rows, covered share) per regime."""
    fit_on = rows if fit_on is None else fit_on
    covered, widths, by_regime = [], [], defaultdict(list)
    for source in sorted({r["source"] for r in rows}):
        table = residuals_by_regime([r for r in fit_on if r["source"] != source])
        for row in (r for r in rows if r["source"] == source):
            (low, high), *_ = log_bounds(row["regime"], table)
            inside = low <= residual(row) <= high
            covered.append(inside)
            widths.append((math.exp(high) - math.exp(low)) / 2.0)
            by_regime[row["regime"]].append(inside)
    widths.sort()
    return {f"{prefix}interval_level": LEVEL, f"{prefix}interval_coverage": mean(covered),
            f"{prefix}interval_half_width": widths[len(widths) // 2] if widths else float("nan"),
            f"{prefix}interval_coverage_by_regime": {regime: (len(inside), mean(inside))
                                                     for regime, inside in sorted(by_regime.items())}}


def write_intervals(rows: list[dict], path: Path = INTERVALS_FILE) -> None:
    """planner/prediction_error.py: every row's residual left one source out, by regime (the table the plans'
    intervals are built from)."""
    write_residual_table(
        path, "The cost model's errors on published runs it was not fitted on, by regime (planner/uncertainty.py): "
        "each run's\nlog(measured / predicted) step seconds, its source left out of the stack efficiencies' fit. "
        "Written by\n`.venv/bin/python benchmarks/validate_cost_model.py --write-intervals`; do not edit.\n",
        "LOG_RESIDUALS", residuals_by_regime(rows))


def validate_moe(reference: Path, dense_rows: list[dict]) -> dict:
    """The moe_* figures (module docstring): the MoE rows predicted, with efficiencies fitted on every row (in
    sample), on every other source (leave one source out) and on the dense rows alone."""
    runs, refused = load_moe_runs(reference)
    total = len(runs) + len(refused)
    rows = predicted_rows(runs, refused, moe_row)
    everything = dense_rows + rows
    in_sample, dense_fit = stack_efficiencies(everything), stack_efficiencies(dense_rows)
    loso, by_source = leave_one_source_out(rows, everything)
    for row in rows:
        row["error"] = relative_error(row, in_sample)
        row["dense_fit_error"] = relative_error(row, dense_fit)
        row["raw_error"] = relative_error(row, {})
        for error, seconds in (("error", "fitted_s"), ("loso_error", "loso_s"), ("dense_fit_error", "dense_fit_s")):
            row[seconds] = row["measured_s"] * (1.0 + row[error])  # the predicted seconds each error is of
    return {
        "moe_rows": rows,
        "moe_refused": refused,
        "moe_coverage": len(rows) / total if total else float("nan"),
        "moe_expressible_rows": len(rows),
        "moe_all_rows": total,
        "moe_stack_efficiencies": in_sample,
        "moe_mean_abs_error": mean(abs(r["error"]) for r in rows),
        "moe_loso_mean_abs_error": mean(abs(r["loso_error"]) for r in rows),
        "moe_dense_fit_mean_abs_error": mean(abs(r["dense_fit_error"]) for r in rows),
        "moe_raw_mean_abs_error": mean(abs(r["raw_error"]) for r in rows),
        "moe_by_source": {source: {**loso[source], "mean_abs_error": mean(abs(r["error"]) for r in by_source[source])}
                          for source in by_source},
        "moe_max_abs_source_bias": max((abs(figures["loso_mean_error"]) for figures in loso.values()), default=0.0),
        **interval_figures(rows, "moe_", dense_rows + rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--picks", action="store_true", help="also compile zplan's own plan for each row (slow)")
    parser.add_argument("--write-intervals", action="store_true",
                        help="write the residuals by regime to planner/prediction_error.py")
    args = parser.parse_args()
    result = validate(args.reference, args.picks)
    if args.write_intervals:
        write_intervals(result["rows"] + result.get("moe_rows", []))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'row':70s} {'measured s':>10s} {'predicted':>10s} {'raw':>7s} {'fitted':>7s} {'loso':>7s}")
    for r in result["rows"]:
        print(f"{r['label'][:70]:70s} {r['measured_s']:10.3f} {r['predicted_s']:10.3f} {r['raw_error']:+7.1%} "
              f"{r['error']:+7.1%} {r['loso_error']:+7.1%}")
    print("\nnot expressible:")
    reasons = defaultdict(int)
    for reason in result["refused"].values():
        reasons[reason.split(":")[0]] += 1
    for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
        print(f"  {count:4d}  {reason}")
    print("\nby source (leave-one-source-out |error| and signed mean, + slower than measured | in sample | raw):")
    for source, figures in result["by_source"].items():
        print(f"  {source[:50]:50s} {figures['rows']:4d} rows  {figures['loso_mean_abs_error']:6.1%} "
              f"({figures['loso_mean_error']:+6.1%}) | {figures['mean_abs_error']:6.1%} | "
              f"{figures['raw_mean_abs_error']:6.1%}")
    print(f"  largest |signed mean| of a source: {result['max_abs_source_bias']:.1%}")
    print(f"\n{result['interval_level']:.0%} intervals, left one source out: the measured step inside on "
          f"{result['interval_coverage']:.1%} of the rows, median half-width {result['interval_half_width']:.1%}; "
          "by regime (rows, inside): " + ", ".join(f"{regime} {n} {share:.0%}" for regime, (n, share)
                                                     in result["interval_coverage_by_regime"].items()))
    print("\nstack efficiencies (all rows): "
          + ", ".join(f"{stack} {e:.2f} (attention x{f:.1f})"
                      for stack, (e, f) in sorted(result["stack_efficiencies"].items())))
    if result["picks"]:
        p = result["picks"]
        print(f"zplan's pick over the published layout, both predicted (not measured): median "
              f"{p['median_pick_over_published']:.2f} over {p['rows']} rows; faster by > 5 % on "
              f"{p['pick_faster_by_5pct']}, slower on {p['pick_slower']} (the published layout is over zplan's "
              f"memory model on {p['published_layout_over_memory']}: the search may not pick it)")
    print(f"\npublished layouts over zplan's memory model: {result['published_over_memory']} of "
          f"{result['expressible_rows']} ({result['priced_with_stack_default_optimizer']} rows priced with their "
          "stack's default optimizer sharding, the distributed optimizer; a row that prints no recompute fits when "
          "some recompute mode fits):")
    for label, over in result["published_over_memory_rows"].items():
        print(f"  {label[:70]}: {over}")
    print(f"{result['priced_with_footnoted_precision']} rows print no precision and are priced with the one their "
          "table's footnote names (reference_runs.printed_precision)")
    print(f"coverage {result['coverage']:.0%} ({result['expressible_rows']} of {result['all_rows']} rows); "
          f"mean |error| leave-one-source-out {result['loso_mean_abs_error']:.1%}, "
          f"in sample {result['mean_abs_error']:.1%}, raw {result['raw_mean_abs_error']:.1%}")
    if "moe_rows" in result:
        print_moe(result)


def print_moe(result: dict) -> None:
    print("\nmixture of experts (moe_runs.csv), step seconds: measured, zplan's (its stack's overlap taken off), "
          "fitted on all rows, leave-one-source-out; errors raw | fitted | loso | fitted on dense rows only")
    for r in result["moe_rows"]:
        print(f"  {r['label']}")
        print(f"    measured {r['measured_s']:7.2f} s  predicted {r['predicted_s']:7.2f} s raw, "
              f"{r['fitted_s']:7.2f} fitted, {r['loso_s']:7.2f} loso  ({r['raw_error']:+.1%} | {r['error']:+.1%} | "
              f"{r['loso_error']:+.1%} | {r['dense_fit_error']:+.1%}); all-to-all {r['expert_parallel_s']:.2f} s")
        layout = ", ".join(f"{key} {value}" for key, value in r["layout"].items())
        fits = "fits" if r["fits_in_zplans_memory_model"] else "OVER zplan's memory model"
        print(f"    {layout}; {r['memory_per_gpu_gib']:.1f} GiB a GPU: {fits}")
        print(f"    params traced {r['traced_params_b']:.2f}B total, {r['traced_active_params_b']:.2f}B active; "
              f"printed {r['published_params_b']:g}B, {r['published_active_params_b']:g}B"
              + (f"; printed/traced FLOPs a token {r['printed_over_traced_flops_per_token']:.2f}"
                 if r["printed_over_traced_flops_per_token"] else "")
              + "".join(f"; MISMATCH {m}" for m in r["params_mismatch"]) + (f"; {r['caveat']}" if r["caveat"] else ""))
        notes = (["routed experts at the fp8 / fp4 GEMM peak (STACK_LOW_PRECISION_EXPERTS)"]
                 if r["experts_at_gemm_peak"] else []) + (
            ["the blocks split evenly over the stages, the head on the last (STACK_UNIFORM_STAGES)"]
            if r["uniform_stages"] else []) + ([r["assumed"]] if r["assumed"] else [])
        if notes:
            print("    priced with: " + "; ".join(notes))
    for label, reason in result["moe_refused"].items():
        print(f"  not expressible: {label}: {reason}")
    print("  by source (leave-one-source-out |error| and signed mean, + slower than measured | in sample):")
    for source, figures in result["moe_by_source"].items():
        print(f"    {source[:50]:50s} {figures['rows']:4d} rows  {figures['loso_mean_abs_error']:6.1%} "
              f"({figures['loso_mean_error']:+6.1%}) | {figures['mean_abs_error']:6.1%}")
    print(f"    largest |signed mean| of a source: {result['moe_max_abs_source_bias']:.1%}")
    print("  stack efficiencies (dense and MoE rows): "
          + ", ".join(f"{stack} {e:.2f} (attention x{f:.1f})"
                      for stack, (e, f) in sorted(result["moe_stack_efficiencies"].items())))
    print(f"MoE coverage {result['moe_coverage']:.0%} ({result['moe_expressible_rows']} of {result['moe_all_rows']} "
          f"rows); mean |error| leave-one-source-out {result['moe_loso_mean_abs_error']:.1%}, in sample "
          f"{result['moe_mean_abs_error']:.1%}, fitted on dense rows only "
          f"{result['moe_dense_fit_mean_abs_error']:.1%}, raw {result['moe_raw_mean_abs_error']:.1%}")


if __name__ == "__main__":
    main()
