"""Plan -> flat template context: every number the reports show, formatted for humans.

Nothing here predicts anything: values are read from the Plan and only converted (bytes to GiB,
seconds to ms), or related to each other for display (a part as a percentage of the step time).
Formatting is fixed-precision so the same plan renders to the same bytes.
"""

from __future__ import annotations

from math import ceil
from typing import Any

from zplan.schemas.plan import MEMORY_TERMS, Plan

TiB = 1024**4
GiB = 1024**3
MiB = 1024**2
KiB = 1024

# (field of MemoryBreakdown, label): the parts of the per-GPU memory, bottom of the stack first.
MEMORY_PARTS: tuple[tuple[str, str], ...] = (
    ("parameters", "Parameters"),
    ("gradients", "Gradients"),
    ("optimizer", "Optimizer states"),
    ("activations", "Activations"),
    ("comm_buffers", "Communication buffers"),
    ("reserve", "Framework reserve"),
)

# (field of TimeBreakdown, label): the parts of one optimizer step, in the order a step runs them.
TIME_PARTS: tuple[tuple[str, str], ...] = (
    ("compute", "Compute (forward, backward, recompute)"),
    ("tensor_parallel", "Tensor-parallel collectives"),
    ("context_parallel", "Context-parallel K/V gathers"),
    ("expert_parallel", "Expert-parallel all-to-alls"),
    ("pipeline_bubble", "Pipeline bubble"),
    ("pipeline_p2p", "Pipeline point-to-point"),
    ("data_parallel", "Data-parallel / ZeRO collectives"),
    ("offload", "Offload transfers and CPU optimizer"),
    ("optimizer", "Optimizer step (GPU)"),
)


def format_bytes(num_bytes: float) -> str:
    """Binary units: '58.75 GiB', '24.0 MiB'."""
    if abs(num_bytes) >= TiB:
        return f"{num_bytes / TiB:.2f} TiB"
    if abs(num_bytes) >= GiB:
        return f"{num_bytes / GiB:.2f} GiB"
    if abs(num_bytes) >= MiB:
        return f"{num_bytes / MiB:.1f} MiB"
    if abs(num_bytes) >= KiB:
        return f"{num_bytes / KiB:.1f} KiB"
    return f"{num_bytes:.0f} B"


def format_seconds(seconds: float) -> str:
    """'54.05 s', '210.0 ms', '35.0 us', '0 s'."""
    if seconds == 0:
        return "0 s"
    if abs(seconds) >= 1:
        return f"{seconds:.2f} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_percent(fraction: float) -> str:
    return f"{fraction * 100:.1f} %"


def format_count(count: float) -> str:
    """Large counts with a decimal suffix: '174.6 B', '1.2 M', '950'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= scale:
            return f"{count / scale:.1f} {suffix}"
    return f"{count:.0f}"


def format_flops(flops: float) -> str:
    """'549.3 PFLOP', '1.2 GFLOP'."""
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if abs(flops) >= scale:
            return f"{flops / scale:.1f} {prefix}FLOP"
    return f"{flops:.0f} FLOP"


def format_rate(per_second: float, unit: str) -> str:
    """Decimal prefixes as data sheets use them, 4 significant digits: '2.039 TB/s', '312 TFLOP/s'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(per_second) >= scale:
            return f"{per_second / scale:.4g} {prefix}{unit}/s"
    return f"{per_second:.4g} {unit}/s"


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def share(part: float, whole: float) -> float:
    """part / whole for display, 0 when whole is 0."""
    return part / whole if whole else 0.0


def plan_context(plan: Plan) -> dict[str, Any]:
    """The flat values and row lists both report templates read."""
    parallel, prediction, cluster = plan.parallel, plan.prediction, plan.cluster
    memory, time = prediction.memory, prediction.time
    world = plan.fingerprint.world_size
    # the mesh's axes as the report names them, cp only where sequences are split (cp > 1)
    mesh_axes = [("dp", parallel.dp), ("pp", parallel.pp), *([("cp", parallel.cp)] if parallel.cp > 1 else []),
                 ("tp", parallel.tp)]
    tokens_per_step = plan.train.global_batch * plan.train.seq_len
    peak_flops = cluster.peak_flops(plan.train.precision)
    achieved_flops_per_gpu = share(prediction.model_flops_per_step, prediction.step_time_s * world)
    placement = [(state, getattr(plan.placement, state)) for state in ("parameters", "gradients", "optimizer")]
    tiers = plan.placement
    pinned = [(name, value) for name, value in plan.pins.model_dump().items() if value is not None]
    if plan.pins.compress is not None:  # as given on the command line
        pinned = [(name, plan.pins.compress.as_option() if name == "compress" else value) for name, value in pinned]
    return {
        "title": f"{plan.model.name} on {world} x {cluster.gpu.name}",
        "zplan_version": plan.zplan_version,
        "schema_version": plan.schema_version,
        "model_name": plan.model.name,
        "model_ref": plan.fingerprint.model_ref,
        "model_sha256_short": plan.fingerprint.model_sha256[:12],
        "model_source": plan.model.source,
        "tracer": plan.model.tracer,
        "params_display": format_count(plan.model.params),
        "params_exact": f"{plan.model.params:,}",
        "model_shape": _model_shape(plan),
        "cluster_name": cluster.name,
        "cluster_description": cluster.description,
        "gpu_name": cluster.gpu.name,
        "world_size": world,
        "gpus_per_node": cluster.gpus_per_node,
        "num_nodes": ceil(world / cluster.gpus_per_node),
        "precision": plan.train.precision,
        "global_batch": plan.train.global_batch,
        "seq_len": plan.train.seq_len,
        "tokens_per_step": f"{tokens_per_step:,}",
        "tp": parallel.tp,
        "pp": parallel.pp,
        "dp": parallel.dp,
        "cp": parallel.cp,
        "mesh_axes": mesh_axes,  # (name, size), the report's Mesh card
        "mesh_display": " x ".join(f"{name} {size}" for name, size in mesh_axes) + f" = {world} GPUs",
        "micro_batch": parallel.micro_batch,
        "num_micro_batches": parallel.num_micro_batches,
        "zero_stage": parallel.zero_stage,
        "recompute": parallel.recompute,
        "sequence_parallel": yes_no(parallel.sequence_parallel),
        "interleave": parallel.interleave,
        "schedule": parallel.schedule,
        "offload": parallel.offload,
        "placement_display": ", ".join(f"{state} on {tier}" for state, tier in placement),
        "offload_traffic_display": (
            f"host-GPU {format_bytes(tiers.host_device_bytes_per_step)} in {format_seconds(tiers.host_device_s)}, "
            f"NVMe {format_bytes(tiers.nvme_bytes_per_step)} in {format_seconds(tiers.nvme_s)}, "
            f"CPU optimizer step {format_seconds(tiers.cpu_optimizer_s)} (per step and GPU, "
            + ("the CPU step overlapped by the delayed parameter update, below)" if parallel.delayed_update
               else "not overlapped)")
            if plan.parallel.offload != "none" else "none (nothing offloaded)"),
        "delayed_update": "on" if parallel.delayed_update else "off",
        "delayed_update_display": delayed_update_display(plan),
        "compression_display": plan.compression.reason or "off",
        "pins_display": ", ".join(f"{name}={value}" for name, value in pinned) or "none",
        "step_time": format_seconds(prediction.step_time_s),
        "tokens_per_s": f"{prediction.tokens_per_s:,.0f}",
        **interval_context(prediction),
        "mfu": format_percent(prediction.mfu),
        "achieved_tflops_per_gpu": format_rate(achieved_flops_per_gpu, "FLOP"),
        "peak_flops": format_rate(peak_flops, "FLOP"),
        "model_flops_per_step": format_flops(prediction.model_flops_per_step),
        "feasible": yes_no(prediction.feasible),
        "memory_total": format_bytes(memory.total),
        "memory_not_at_peak": format_bytes(memory.not_at_peak),
        "memory_capacity": format_bytes(memory.capacity),
        "memory_headroom": format_bytes(memory.capacity - memory.total),
        "memory_used_percent": format_percent(share(memory.total, memory.capacity)),
        "cpu_bytes_per_node": format_bytes(memory.cpu_bytes_per_node),
        "nvme_bytes_per_node": format_bytes(memory.nvme_bytes_per_node),
        # the peak by named term (schemas.plan.MEMORY_TERMS), the zero ones left out; empty for older plans
        "memory_terms": [
            {"label": name, "display": format_bytes(value) if value >= 0 else f"-{format_bytes(-value)}",
             "what": MEMORY_TERMS.get(name, ""), "percent": format_percent(share(abs(value), memory.capacity))}
            for name, value in memory.terms.items() if value],
        "memory_rows": [
            {"key": key, "label": label, "display": format_bytes(getattr(memory, key)),
             "percent": format_percent(share(getattr(memory, key), memory.capacity))}
            for key, label in MEMORY_PARTS
        ],
        "time_rows": [
            {"key": key, "label": label, "display": format_seconds(getattr(time, key)),
             "percent": format_percent(share(getattr(time, key), prediction.step_time_s))}
            for key, label in TIME_PARTS
        ],
        "stage_rows": [
            {"index": stage.index, "pipeline_rank": stage.index % parallel.pp,
             "chunk": stage.index // parallel.pp,
             "layers": f"{stage.first_layer}-{stage.last_layer}", "units": len(stage.layer_names),
             "names": _name_range(stage.layer_names), "params": format_count(stage.params),
             "fwd_flops": format_flops(stage.fwd_flops_per_sample)}
            for stage in plan.stages
        ],
    }


def interval_context(prediction) -> dict[str, str]:
    """The prediction's 80 % interval in words (planner/uncertainty.py); '' for plans without one."""
    interval = prediction.interval
    if interval is None:
        return {"step_time_interval": "", "tokens_per_s_interval": "", "mfu_interval": "", "memory_interval": "",
                "interval_note": ""}
    (t0, t1), (r0, r1), (m0, m1) = interval.step_time_s, interval.tokens_per_s, interval.mfu
    b0, b1 = interval.memory_bytes
    return {"step_time_interval": f"{format_seconds(t0)} - {format_seconds(t1)}",
            "tokens_per_s_interval": f"{r0:,.0f} - {r1:,.0f}",
            "mfu_interval": f"{format_percent(m0)} - {format_percent(m1)}",
            "memory_interval": f"{format_bytes(b0)} - {format_bytes(b1)}, the dry run's agreement",
            "interval_note": (f"{interval.level:.0%} intervals, regime '{interval.regime}' ({interval.basis}): "
                              f"{interval.note}.")}


def delayed_update_display(plan: Plan) -> str:
    """The planner's decision on the delayed parameter update in words: its reason (with the time saved per
    step) and, when on, what it changes in training."""
    if plan.parallel.delayed_update:
        return (f"{plan.delayed_update.reason} The weights lag one step: the forward and backward of iteration "
                "i+1 use the weights from before step i's update (Ren et al., ZeRO-Offload, ATC'21, Sec. 5.2); "
                "the warm-up steps update exactly, without the delay.")
    if plan.parallel.offload == "none":
        return "off (nothing offloaded)"
    return plan.delayed_update.reason or "off"


def _model_shape(plan: Plan) -> str:
    model = plan.model
    experts = f"; {model.experts.describe()}, {format_count(model.experts.active_params)} parameters active a token" \
        if model.experts else ""
    return (f"{model.num_blocks} blocks, hidden {model.hidden}, {model.heads} heads ({model.kv_heads} KV), "
            f"FFN {model.ffn_hidden}, vocab {model.vocab}{experts}")


def _name_range(names: list[str]) -> str:
    if not names:
        return ""
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
