"""How sure a serving prediction is: an 80 % interval around the inference cost model's tokens/s, time per output
token, time to first token and request latency.

    interval = serving_interval(ttft_s, tpot_s, request_latency_s, tokens_per_s)  # schemas.inference.ServingInterval

The errors are another engine's. benchmarks/validate_serving.py prices TensorRT-LLM's published serving runs (two
sources: v0.9.0 and current) with this cost model and three engine constants (compute and memory efficiency, a cost
per forward pass) fitted on the other source only, and writes each run's log(measured / predicted) seconds (a
tokens/s run's: log(predicted / measured) tokens/s) by kind to planner/serving_prediction_error.py
(`--write-intervals`): "throughput", the decode-dominated static-batch and max-load tokens/s runs, and "first
token", the batch-1 TTFT runs. zplan's own engine is not among them: its predictions carry TensorRT-LLM's errors as
the training intervals carry other stacks' (planner/uncertainty.py). Each kind's bounds are uncertainty.log_bounds'
(its 10th to 90th percentile from MIN_RUNS runs on, else the pooled errors' wider range). Tokens/s and time per
output token take the throughput bounds, time to first token the first-token bounds, request latency both (below).
Checked left one source out: validate_serving.py serving_interval_coverage and serving_interval_half_width.
"""

from __future__ import annotations

import math

from zplan.planner.serving_prediction_error import SERVING_LOG_RESIDUALS
from zplan.planner.uncertainty import LEVEL, MIN_RUNS, log_bounds
from zplan.schemas.inference import ServingInterval

THROUGHPUT, FIRST_TOKEN = "throughput", "first token"  # the kinds of residuals
BASES = ("validation", "thin", "unseen")  # from the surest; an interval takes the weaker of its two kinds'


def serving_interval(ttft_s: float, tpot_s: float, request_latency_s: float, tokens_per_s: float,
                     residuals: dict[str, tuple[float, ...]] | None = None) -> ServingInterval:
    """The 80 % interval of a prediction's four figures (schemas.inference.InferencePrediction's, or an alternative
    configuration's) from `residuals` (log(measured / predicted) seconds by kind; default:
    planner/serving_prediction_error.py's)."""
    residuals = SERVING_LOG_RESIDUALS if residuals is None else residuals
    (d_low, d_high), d_basis, d_runs, _ = log_bounds(THROUGHPUT, residuals)
    (f_low, f_high), f_basis, f_runs, _ = log_bounds(FIRST_TOKEN, residuals)
    ttft = (ttft_s * math.exp(f_low), ttft_s * math.exp(f_high))
    # request latency = ttft_s + (gen_len - 1) * tpot_s (schemas.inference): the prefill part scaled by the first-token
    # bounds, the decode part by the throughput bounds, low ends added and high ends added (as if one engine were slow
    # at both: wider than independent errors would give)
    decode_s = request_latency_s - ttft_s
    thin = [f"{kind}: {basis}, {runs} runs (fewer than {MIN_RUNS}: the pooled errors' wider range)"
            for kind, basis, runs in ((THROUGHPUT, d_basis, d_runs), (FIRST_TOKEN, f_basis, f_runs))
            if basis != "validation"]
    return ServingInterval(
        level=LEVEL, basis=max(d_basis, f_basis, key=BASES.index), runs=d_runs + f_runs,
        tokens_per_s=(tokens_per_s / math.exp(d_high), tokens_per_s / math.exp(d_low)),
        ttft_s=ttft, tpot_s=(tpot_s * math.exp(d_low), tpot_s * math.exp(d_high)),
        request_latency_s=(ttft[0] + decode_s * math.exp(d_low), ttft[1] + decode_s * math.exp(d_high)),
        note="; ".join([f"the errors of another engine, TensorRT-LLM, on {d_runs} published throughput runs and "
                        f"{f_runs} time-to-first-token runs, each priced by this cost model with engine constants "
                        "fitted on the other source; zplan's own engine is not among them", *thin]))
