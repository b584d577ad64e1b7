"""InferencePlan -> the flat context of report_inference.md.j2 and report_inference.html.j2.

Nothing here predicts anything: values are read from the plan and formatted (fixed precision, so the same plan
renders to the same bytes), or related to each other for display (a part as a share of its whole).
"""

from __future__ import annotations

from collections.abc import Callable
from math import ceil
from typing import Any

from zplan.codegen.context import format_bytes, format_count, format_percent, format_rate, format_seconds, share, yes_no
from zplan.codegen.report import cluster_rows
from zplan.schemas.alternatives import ALTERNATIVES_FILE, InferenceAlternatives
from zplan.schemas.inference import InferenceCandidate, InferencePlan, InferencePrediction
from zplan.schemas.plan import intervals_overlap

# (field of InferenceMemory, label): the parts of the per-GPU memory.
MEMORY_PARTS = (
    ("weights", "Weights"),
    ("kv_cache", "KV cache"),
    ("activations", "Activations (prefill, logits)"),
    ("reserve", "Framework reserve"),
)
# (field of InferenceTime, label): prefill parts add up to the time to first token, decode parts to a step.
PREFILL_PARTS = (
    ("prefill_compute_s", "Compute (matmuls, attention)"),
    ("prefill_tp_s", "Tensor-parallel all-reduces"),
    ("prefill_stream_s", "Waiting for streamed weights"),
)
DECODE_PARTS = (
    ("decode_weights_s", "Reading the weights (HBM)"),
    ("decode_kv_s", "Reading the KV cache (HBM)"),
    ("decode_compute_s", "Compute (where compute bound)"),
    ("decode_tp_s", "Tensor-parallel all-reduces"),
    ("decode_stream_s", "Waiting for streamed weights"),
)
TIER_TEXT = {"gpu": "resident on the GPU", "cpu": "host memory, streamed layer by layer",
             "nvme": "NVMe, streamed layer by layer"}


def share_rows(values: object, parts: tuple[tuple[str, str], ...], whole: float,
               display: Callable[[float], str]) -> list[dict[str, str]]:
    """One row per (field, label) of `parts`: the field of `values` shown with `display`, and its share of
    `whole` as a percentage and a bar width."""
    return [{"label": label, "display": display(getattr(values, key)),
             "percent": format_percent(share(getattr(values, key), whole)),
             "width": f"{100 * share(getattr(values, key), whole):.2f}"}
            for key, label in parts]


def describe_candidate(c: InferenceCandidate) -> str:
    return f"tp={c.tp} {c.weight_precision} {c.weight_tier}"


def alternative_rows(plan: InferencePlan, alternatives: InferenceAlternatives | None) -> list[dict[str, str]]:
    """Every scored configuration, best first, against the chosen one on the plan's target ([] without them), with
    the 80 % interval of the compared figure; a feasible alternative whose interval overlaps the chosen one's is a
    near-tie (the cost model cannot tell the two apart)."""
    pred = plan.prediction
    figure = "tpot_s" if plan.spec.target == "latency" else "tokens_per_s"  # what "vs chosen" compares
    chosen_bounds = getattr(pred.interval, figure) if pred.interval is not None else None
    rows = []
    for c in alternatives.alternatives if alternatives is not None else []:
        # one alternative per (tp, precision, tier): the chosen one matches the plan on all three
        chosen = (c.tp, c.weight_precision, c.weight_tier) == (
            plan.parallel.tp, plan.parallel.weight_precision, plan.parallel.weight_tier)
        vs = share(getattr(c, figure), getattr(pred, figure)) - 1
        bounds = getattr(c.interval, figure) if c.interval is not None else None
        near_tie = (not chosen and c.feasible and bounds is not None and chosen_bounds is not None
                    and intervals_overlap(bounds, chosen_bounds))
        rows.append({"config": describe_candidate(c), "ttft": format_seconds(c.ttft_s),
                     "tpot": format_seconds(c.tpot_s), "tokens_per_s": f"{c.tokens_per_s:,.1f}",
                     "interval": "" if bounds is None else (
                         f"{format_seconds(bounds[0])} - {format_seconds(bounds[1])}" if figure == "tpot_s"
                         else f"{bounds[0]:,.1f} - {bounds[1]:,.1f}"),
                     "vs_chosen": "" if chosen or not c.feasible else f"{vs * 100:+.1f} %"
                                                                       + (" (near-tie)" if near_tie else ""),
                     "memory": format_bytes(c.memory_per_gpu_bytes), "feasible": yes_no(c.feasible),
                     "chosen": yes_no(chosen), "note": c.note})
    return rows


def serving_rows(plan: InferencePlan) -> list[dict[str, str]]:
    """The continuous-batching curve (plan.prediction.continuous_batching), one row per concurrency ([] in a plan
    without it)."""
    curve = plan.prediction.continuous_batching
    return [{"concurrency": f"{p.concurrency:,}", "tokens_per_s": f"{p.tokens_per_s:,.1f}",
             "tpot": format_seconds(p.tpot_s), "ttft": format_seconds(p.ttft_s),
             "prefill_steps": f"{p.prefill_steps:,}"}
            for p in (curve.points if curve is not None else [])]


def serving_band(pred: InferencePrediction) -> str:
    """The prediction's 80 % interval as factors on its figures ('tokens/s x0.79-x1.10, ...'), which hold for every
    point of the curve as well (the bounds are relative); '' without an interval."""
    if pred.interval is None:
        return ""
    return ", ".join(f"{name} x{low / value:.2f}-x{high / value:.2f}" for name, (low, high), value in (
        ("tokens/s", pred.interval.tokens_per_s, pred.tokens_per_s), ("TPOT", pred.interval.tpot_s, pred.tpot_s),
        ("TTFT", pred.interval.ttft_s, pred.ttft_s)) if value > 0)


def serving_context(plan: InferencePlan) -> dict[str, Any]:
    """The paged KV cache and the continuous-batching curve, formatted; has_serving False in a plan without them."""
    curve, par = plan.prediction.continuous_batching, plan.parallel
    if curve is None or par.kv_blocks is None:
        return {"has_serving": False, "serving_rows": [], "serving_curve": None}
    return {
        "has_serving": True,
        "serving_band": serving_band(plan.prediction),
        "serving_curve": curve,
        "serving_rows": serving_rows(plan),
        "kv_blocks": f"{par.kv_blocks:,}",
        "kv_block_tokens": par.kv_block_tokens,
        "kv_block_bytes": format_bytes(curve.kv_block_bytes),
        "kv_budget": format_bytes(curve.kv_budget_bytes),
        "blocks_per_request": f"{curve.blocks_per_request:,}",
        "max_concurrency": f"{curve.max_concurrency:,}",
        "step_tokens": f"{curve.step_tokens:,}",
    }


def interval_context(plan: InferencePlan) -> dict[str, str]:
    """The prediction's 80 % interval (planner/serving_uncertainty.py) as 'low - high'; '' for plans without one."""
    interval = plan.prediction.interval
    if interval is None:
        return {"ttft_interval": "", "tpot_interval": "", "request_latency_interval": "", "tokens_per_s_interval": "",
                "interval_note": ""}
    return {**{f"{name}_interval": f"{format_seconds(low)} - {format_seconds(high)}"
               for name, (low, high) in (("ttft", interval.ttft_s), ("tpot", interval.tpot_s),
                                         ("request_latency", interval.request_latency_s))},
            "tokens_per_s_interval": f"{interval.tokens_per_s[0]:,.1f} - {interval.tokens_per_s[1]:,.1f}",
            "interval_note": f"{interval.level:.0%} intervals ({interval.basis}): {interval.note}."}


def run_commands(plan: InferencePlan) -> list[dict[str, str]]:
    """How to run the emitted programs (codegen.inference_script writes them)."""
    return [
        {"command": 'echo "The plan is" | bash launch/generate.sh --max-new-tokens 32',
         "what": f"generate.py on {plan.parallel.tp} process(es): one completion per prompt line, in batches of up "
                 f"to {plan.parallel.max_batch}"},
        {"command": "bash launch/generate.sh --prompts prompts.txt --weights model.safetensors",
         "what": "prompts from a file and trained weights (without --weights the model keeps a random "
                 "initialisation)"},
        {"command": "bash launch/serve.sh",
         "what": f"serve.py: an HTTP server with {plan.parallel.replicas} replica(s) of tp={plan.parallel.tp}; "
                 "`python serve.py --help` lists its options"},
        *([{"command": "bash launch/generate.sh --nvme-path /local/nvme/folder",
            "what": "the folder on a local NVMe drive the streamed weights are written to and read from"}]
          if plan.parallel.weight_tier == "nvme" else []),
    ]


def inference_report_context(plan: InferencePlan, alternatives: InferenceAlternatives | None = None) -> dict[str, Any]:
    """Everything report_inference.md.j2 and report_inference.html.j2 read; the scored configurations from
    `alternatives` (alternatives.json), none without them."""
    par, pred, spec, model, cluster = plan.parallel, plan.prediction, plan.spec, plan.model, plan.cluster
    mem, time = pred.memory, pred.time
    world = plan.fingerprint.world_size
    pinned = [(name, value) for name, value in plan.pins.model_dump().items() if value is not None]
    quantized = par.weight_precision in ("int8", "int4")
    return {
        "title": f"{model.name} on {world} x {cluster.gpu.name}",
        "zplan_version": plan.zplan_version,
        "schema_version": plan.schema_version,
        "model_name": model.name,
        "model_ref": plan.fingerprint.model_ref,
        "model_sha256_short": plan.fingerprint.model_sha256[:12],
        "model_source": model.source,
        "tracer": model.tracer,
        "params_display": format_count(model.params),
        "params_exact": f"{model.params:,}",
        "model_shape": (f"{model.num_blocks} blocks, hidden {model.hidden}, {model.heads} heads "
                        f"({model.kv_heads} KV heads), MLP {model.ffn_hidden}, vocabulary {model.vocab}, "
                        f"sequence {model.seq_len}" + (f"; {model.experts.describe()}" if model.experts else "")),
        "cluster_name": cluster.name,
        "cluster_description": cluster.description,
        "cluster_source": cluster.source,
        "gpu_name": cluster.gpu.name,
        "world_size": world,
        "gpus_per_node": cluster.gpus_per_node,
        "num_nodes": ceil(world / cluster.gpus_per_node),
        "target": spec.target,
        "batch": spec.batch,
        "prompt_len": spec.prompt_len,
        "gen_len": spec.gen_len,
        "tp": par.tp,
        "replicas": par.replicas,
        "weight_precision": par.weight_precision,
        "quantization": (f"weight-only {par.weight_precision}, one scale per {par.quant_group_size} inputs"
                         if quantized else "W8A8 e4m3: one scale per output channel, activations per token; fp8 GEMMs"
                         if par.weight_precision == "fp8" else "not quantized"),
        "compute_dtype": par.compute_dtype,
        "weight_tier": TIER_TEXT[par.weight_tier] + (f", {par.prefetch_layers} layer(s) prefetched"
                                                     if par.weight_tier != "gpu" else ""),
        "max_batch": par.max_batch,
        "max_seq_len": par.max_seq_len,
        "pins_display": ", ".join(f"{name}={value}" for name, value in pinned) or "none",
        "reason": plan.reason,
        "ttft": format_seconds(pred.ttft_s),
        "tpot": format_seconds(pred.tpot_s),
        "request_latency": format_seconds(pred.request_latency_s),
        "tokens_per_s": f"{pred.tokens_per_s:,.1f}",
        "tokens_per_s_per_replica": f"{pred.tokens_per_s / par.replicas:,.1f}",
        "feasible": yes_no(pred.feasible),
        "candidates_evaluated": (f"{alternatives.candidates_evaluated:,}" if alternatives is not None
                                 else f"not recorded (no {ALTERNATIVES_FILE})"),
        "memory_rows": share_rows(mem, MEMORY_PARTS, mem.capacity, format_bytes),
        "memory_total": format_bytes(mem.total),
        "memory_capacity": format_bytes(mem.capacity),
        "memory_headroom": format_bytes(mem.capacity - mem.total),
        "memory_used_percent": format_percent(share(mem.total, mem.capacity)),
        "cpu_bytes_per_node": format_bytes(mem.cpu_bytes_per_node),
        "nvme_bytes_per_node": format_bytes(mem.nvme_bytes_per_node),
        "prefill_rows": share_rows(time, PREFILL_PARTS, pred.ttft_s, format_seconds),
        "decode_rows": share_rows(time, DECODE_PARTS, pred.tpot_s, format_seconds),
        "alternative_rows": alternative_rows(plan, alternatives),
        "alternative_intervals": alternatives is not None and any(c.interval for c in alternatives.alternatives),
        "assumption_rows": [a.model_dump() for a in alternatives.assumptions] if alternatives is not None else [],
        "cluster_rows": cluster_rows(plan),
        "peak_flops": format_rate(cluster.peak_flops(par.compute_dtype), "FLOP"),
        "run_commands": run_commands(plan),
        **serving_context(plan),
        **interval_context(plan),
    }
