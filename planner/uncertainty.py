"""How sure a prediction is: an 80 % interval around the cost model's step time, from its errors on published runs it
was not fitted on.

    regime = regime_of(tp, pp, cp, num_micro_batches, offload, precision, seq_len, moe)  # e.g. "dense FSDP"
    interval = prediction_interval(prediction, regime)  # schemas.plan.PredictionInterval

benchmarks/validate_cost_model.py predicts every published run it can express with the stack efficiencies fitted on
the other sources (left one source out) and writes each run's residual, log(measured / predicted) seconds, by regime
into planner/prediction_error.py (`--write-intervals`). A regime's interval is the 10th to the 90th percentile of its
residuals (linear interpolation between order statistics, numpy's default) from MIN_RUNS runs on; a regime with fewer
("thin") takes the residuals of every regime at THIN_LEVEL, widened to its own extremes; a regime with none ("unseen")
takes every run at UNSEEN_LEVEL and says so. Checked left one source out (each source's runs against intervals built
from the other sources' residuals): benchmarks/validate_cost_model.py interval_coverage and interval_half_width. The
step time's interval gives the throughput's and MFU's (inversely); memory's is the dry run's agreement with the memory
model (DRY_RUN_MEMORY_AGREEMENT: dense or mixture-of-experts).
"""

from __future__ import annotations

import math

import numpy as np

from zplan.planner.prediction_error import LOG_RESIDUALS
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.model import ModelSummary
from zplan.schemas.plan import ParallelConfig, Prediction, PredictionInterval

LEVEL = 0.8
MIN_RUNS = 9  # the fewest runs of a regime whose own percentiles make its interval
THIN_LEVEL = 0.9  # a regime with 1..8 runs: the pooled residuals' 90 % range
UNSEEN_LEVEL = 0.95  # a regime with none: the pooled residuals' 95 % range
# The dry run (zplan compile --verify; benchmarks/dryrun_memory.py) against the memory model, as the range of
# measured / planned allocated peak bytes (the framework reserve is the plan's own, added after), docs/results.md:
# dense plans, from 1 / 1.054 (GPT-3 175B at tp 8 x pp 2, ZeRO-3, planned over) to 1.058 (the same plan with the
# code of 2026-12-03, planned under; a Hugging Face Llama-3-8B 1.046); mixtures of experts (examples/moe.py at
# Mixtral-8x7B's sizes, 5 plans) planned over by up to 18.9 %, the dense plans' upper end kept for them
DRY_RUN_MEMORY_AGREEMENT = {"dense": (1 / 1.054, 1.058), "MoE": (1 / 1.189, 1.058)}

# Regimes, the first that applies (a layout that offloads and pipelines is "offload"): what makes a layout's
# prediction hard differs between them (host transfers, all-to-all and routing, low-precision kernels, attention at
# long sequences, the bubble, tensor-parallel collectives, data-parallel gathers)
REGIMES = ("offload", "MoE", "fp8/fp4", "long context", "pipeline-heavy", "3D", "dense FSDP")
LONG_CONTEXT_TOKENS = 16384  # a sequence this long, or context parallel, is long context
PIPELINE_HEAVY_STAGES = 8  # this many stages, or fewer than MICRO_BATCHES_PER_STAGE micro-batches a stage
MICRO_BATCHES_PER_STAGE = 4  # below it the bubble, (pp - 1) / (m v), is a quarter of the step or more


def regime_of(tp: int, pp: int, cp: int, num_micro_batches: int, offload: str, precision: str, seq_len: int,
              moe: bool) -> str:
    """The first of REGIMES that applies to a layout."""
    if offload != "none":
        return "offload"
    if moe:
        return "MoE"
    if precision in ("fp8", "nvfp4"):
        return "fp8/fp4"
    if cp > 1 or seq_len >= LONG_CONTEXT_TOKENS:
        return "long context"
    if pp >= PIPELINE_HEAVY_STAGES or (pp > 1 and num_micro_batches < MICRO_BATCHES_PER_STAGE * pp):
        return "pipeline-heavy"
    if tp > 1 or pp > 1:
        return "3D"
    return "dense FSDP"


def quantile_bounds(residuals: list[float] | tuple[float, ...], level: float) -> tuple[float, float]:
    """The ((1 - level) / 2, (1 + level) / 2) percentiles of `residuals`, linearly interpolated."""
    low, high = np.quantile(np.asarray(residuals, dtype=float), [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(low), float(high)


def log_bounds(regime: str, residuals: dict[str, tuple[float, ...]]) -> tuple[tuple[float, float], str, int, str]:
    """(log bounds on measured / predicted, basis, runs, note) for `regime` from residuals by regime."""
    own = residuals.get(regime, ())
    pooled = [r for values in residuals.values() for r in values]
    if len(own) >= MIN_RUNS:
        return (quantile_bounds(own, LEVEL), "validation", len(own),
                f"the cost model's errors on {len(own)} published {regime} runs it was not fitted on")
    if own:
        low, high = quantile_bounds(pooled, THIN_LEVEL)
        return ((min(low, min(own)), max(high, max(own))), "thin", len(own),
                f"only {len(own)} published {regime} runs (fewer than {MIN_RUNS}): every regime's errors at "
                f"{THIN_LEVEL:.0%}, widened to this regime's own")
    return (quantile_bounds(pooled, UNSEEN_LEVEL), "unseen", 0,
            f"no published {regime} run validates the cost model: every regime's errors at {UNSEEN_LEVEL:.0%}; "
            "calibrate on your own runs (zplan calibrate) before relying on it")


def calibrated_bounds(cluster: ClusterSpec | None) -> tuple[tuple[float, float], str, int, str] | None:
    """log_bounds from the runs `cluster` was calibrated on (zplan calibrate: ClusterSpec.calibration_errors) where
    there are MIN_RUNS of them, else None."""
    errors = (cluster.calibration_errors or []) if cluster is not None else []
    if len(errors) < MIN_RUNS:
        return None
    which = "left out of the fit" if cluster.calibration_errors_held_out else "it was fitted on (in sample)"
    return (quantile_bounds(errors, LEVEL), "calibration", len(errors),
            f"the errors on {len(errors)} of your runs under the calibrated profile {cluster.name}, {which}")


def prediction_interval(pred: Prediction, regime: str, residuals: dict[str, tuple[float, ...]] | None = None,
                        cluster: ClusterSpec | None = None, moe: bool = False) -> PredictionInterval:
    """The 80 % interval of `pred` (a plan's, an estimate's) in `regime`: from the runs `cluster` was calibrated on
    where it has MIN_RUNS of them, else from `residuals` (log(measured / predicted) by regime; default:
    planner/prediction_error.py's); memory's from the dry run's agreement on dense or (`moe`) mixture-of-experts
    plans."""
    residuals = LOG_RESIDUALS if residuals is None else residuals
    (low, high), basis, runs, note = calibrated_bounds(cluster) or log_bounds(regime, residuals)
    step = (pred.step_time_s * math.exp(low), pred.step_time_s * math.exp(high))
    slower, faster = step[1] / pred.step_time_s, step[0] / pred.step_time_s
    allocated, reserve = pred.memory.total - pred.memory.reserve, pred.memory.reserve
    memory_low, memory_high = DRY_RUN_MEMORY_AGREEMENT["MoE" if moe else "dense"]
    return PredictionInterval(
        level=LEVEL, regime=regime, basis=basis, runs=runs, step_time_s=step,
        tokens_per_s=(pred.tokens_per_s / slower, pred.tokens_per_s / faster),
        mfu=(pred.mfu / slower, pred.mfu / faster),
        memory_bytes=(allocated * memory_low + reserve, allocated * memory_high + reserve),
        note=note)


def layout_regime(parallel: ParallelConfig, precision: str, model: ModelSummary) -> str:
    return regime_of(parallel.tp, parallel.pp, parallel.cp, parallel.num_micro_batches, parallel.offload, precision,
                     model.seq_len, model.experts is not None)


def with_interval(pred: Prediction, parallel: ParallelConfig, precision: str, model: ModelSummary,
                  cluster: ClusterSpec) -> Prediction:
    """`pred` of a layout `parallel` on `cluster` with its interval (prediction_interval, in the layout's regime)."""
    regime = layout_regime(parallel, precision, model)
    interval = prediction_interval(pred, regime, cluster=cluster, moe=model.experts is not None)
    return pred.model_copy(update={"interval": interval})


def step_interval(step_time_s: float, parallel: ParallelConfig, precision: str, model: ModelSummary,
                  cluster: ClusterSpec) -> tuple[float, float]:
    """[low, high] seconds of a step predicted at `step_time_s` for the layout `parallel` (an alternative's)."""
    (low, high), *_ = calibrated_bounds(cluster) or log_bounds(layout_regime(parallel, precision, model),
                                                               LOG_RESIDUALS)
    return step_time_s * math.exp(low), step_time_s * math.exp(high)
