"""Report builders: the chart data and tables of report.html and report.md, read from the Plan.

Charts are plain data here (dataclasses); codegen/svg_charts.py draws them. The pipeline timeline is
a schematic: the schedule's replay (schemas.pipeline_schedule, the model the cost model's bubble comes from) with
forward = 1 unit and backward = 2 units per model chunk, to show the shape of the schedule, not a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zplan.codegen.context import (
    MEMORY_PARTS,
    TIME_PARTS,
    format_bytes,
    format_count,
    format_percent,
    format_rate,
    format_seconds,
    plan_context,
    share,
    yes_no,
)
from zplan.schemas.alternatives import ALTERNATIVES_FILE, Alternatives, Candidate
from zplan.schemas.capability import CAPABILITIES, RULES, blocking
from zplan.schemas.pipeline_schedule import Slot, replay
from zplan.schemas.plan import ParallelConfig, Plan

MAX_DRAWN_MICRO_BATCHES = 16
TABLE_BEST_FEASIBLE = 20  # the candidates table: the chosen plan, this many fastest feasible, the front


@dataclass(frozen=True)
class Segment:
    key: str
    label: str
    value: float  # bytes or seconds
    display: str
    percent: str


@dataclass(frozen=True)
class MemoryChart:
    segments: list[Segment]
    total_bytes: float
    capacity_bytes: float


@dataclass(frozen=True)
class TimeChart:
    segments: list[Segment]
    step_time_s: float


@dataclass(frozen=True)
class PipelineTimeline:
    stages: int
    chunks: int
    schedule: str
    drawn_micro_batches: int
    total_micro_batches: int
    slots: list[Slot]

    @property
    def total_units(self) -> int:
        return max((slot.start + slot.duration for slot in self.slots), default=0)


@dataclass(frozen=True)
class ParetoPoint:
    step_time_s: float
    memory_bytes: float
    feasible: bool
    on_front: bool
    chosen: bool
    label: str


@dataclass(frozen=True)
class ParetoChart:
    points: list[ParetoPoint]
    capacity_bytes: float


def memory_chart(plan: Plan) -> MemoryChart:
    memory = plan.prediction.memory
    segments = [
        Segment(key, label, getattr(memory, key), format_bytes(getattr(memory, key)),
                format_percent(share(getattr(memory, key), memory.capacity)))
        for key, label in MEMORY_PARTS
    ]
    return MemoryChart(segments=segments, total_bytes=memory.total, capacity_bytes=memory.capacity)


def time_chart(plan: Plan) -> TimeChart:
    time, step_time_s = plan.prediction.time, plan.prediction.step_time_s
    segments = [
        Segment(key, label, getattr(time, key), format_seconds(getattr(time, key)),
                format_percent(share(getattr(time, key), step_time_s)))
        for key, label in TIME_PARTS
    ]
    return TimeChart(segments=segments, step_time_s=step_time_s)


def pipeline_timeline(
    parallel: ParallelConfig, max_micro_batches: int = MAX_DRAWN_MICRO_BATCHES
) -> PipelineTimeline:
    """The first micro-batches of one step on every pipeline rank (all of them if few).

    Interleaved schedules need whole groups of `pp` micro-batches, so the cap rounds down to one."""
    stages, chunks, total = parallel.pp, parallel.interleave, parallel.num_micro_batches
    drawn = min(total, max_micro_batches)
    if chunks > 1 and total >= stages:
        drawn = max(stages, drawn - drawn % stages)
    slots = replay(stages, chunks, drawn)
    schedule = parallel.schedule
    if slots is None:  # an order Megatron would not run (fewer micro-batches than stages): draw plain 1F1B
        chunks, schedule = 1, "1f1b"
        slots = replay(stages, 1, drawn) or []
    return PipelineTimeline(stages=stages, chunks=chunks, schedule=schedule, drawn_micro_batches=drawn,
                            total_micro_batches=total, slots=slots)


def timeline_as_text(timeline: PipelineTimeline) -> list[str]:
    """One line per pipeline rank, one character per time unit: F/B for even chunks, f/b for odd, '.' idle."""
    lines = []
    for stage in range(timeline.stages):
        row = ["."] * timeline.total_units
        for slot in (slot for slot in timeline.slots if slot.stage == stage):
            mark = slot.kind if slot.chunk % 2 == 0 else slot.kind.lower()
            row[slot.start:slot.start + slot.duration] = [mark] * slot.duration
        lines.append(f"rank {stage:>2} |{''.join(row)}|")
    return lines


def describe_config(parallel: ParallelConfig) -> str:
    parts = [f"tp={parallel.tp}", f"pp={parallel.pp}", f"dp={parallel.dp}", f"mb={parallel.micro_batch}",
             f"ZeRO-{parallel.zero_stage}", f"recompute={parallel.recompute}"]
    if parallel.cp > 1:
        parts.insert(3, f"cp={parallel.cp}")
    if parallel.sequence_parallel:
        parts.append("SP")
    if parallel.interleave > 1:
        parts.append(f"v={parallel.interleave}")
    if parallel.offload != "none":
        parts.append(f"offload={parallel.offload}")
    if parallel.delayed_update:
        parts.append("delayed update")
    if parallel.compression.enabled:
        parts.append(f"compress={parallel.compression.as_option()}")
    return " ".join(parts)


def _pareto_front(points: list[tuple[float, float]]) -> set[int]:
    """Indices of the points no other point beats on both step time and memory (lower is better)."""
    front, best_time = set(), float("inf")
    for index in sorted(range(len(points)), key=lambda i: (points[i][1], points[i][0])):
        if points[index][0] < best_time:
            front.add(index)
            best_time = points[index][0]
    return front


def pareto_chart(plan: Plan, alternatives: Alternatives | None) -> ParetoChart:
    """The chosen plan and the alternatives (none: the chosen plan alone); the front is drawn over the feasible
    ones."""
    chosen = Candidate(parallel=plan.parallel, step_time_s=plan.prediction.step_time_s,
                       memory_per_gpu_bytes=plan.prediction.memory.total, feasible=plan.prediction.feasible)
    # The search's alternatives carry no delayed-update decision: the chosen configuration is itself with or without it.
    undelayed = plan.parallel.model_copy(update={"delayed_update": False})
    others = alternatives.alternatives if alternatives is not None else []
    candidates = [chosen] + [alt for alt in others if alt.parallel not in (plan.parallel, undelayed)]
    feasible = [i for i, c in enumerate(candidates) if c.feasible]
    front = {feasible[i] for i in _pareto_front(
        [(candidates[i].step_time_s, candidates[i].memory_per_gpu_bytes) for i in feasible])}
    points = [
        ParetoPoint(step_time_s=c.step_time_s, memory_bytes=c.memory_per_gpu_bytes, feasible=c.feasible,
                    on_front=i in front, chosen=i == 0, label=describe_config(c.parallel))
        for i, c in enumerate(candidates)
    ]
    return ParetoChart(points=points, capacity_bytes=plan.prediction.memory.capacity)


def table_points(chart: ParetoChart, best: int = TABLE_BEST_FEASIBLE) -> list[ParetoPoint]:
    """The rows of the candidates table: the chosen plan, the `best` fastest feasible alternatives and the
    Pareto front, fastest first (feasible before infeasible). The rest stay in alternatives.json."""
    ranked = sorted(chart.points, key=lambda p: (not p.feasible, p.step_time_s, p.memory_bytes, p.label))
    fastest = [p for p in ranked if p.feasible and not p.chosen][:best]
    return [p for p in ranked if p.chosen or p.on_front or any(p is q for q in fastest)]


def alternative_rows(chart: ParetoChart, best: int = TABLE_BEST_FEASIBLE) -> list[dict[str, str]]:
    chosen_time = next((p.step_time_s for p in chart.points if p.chosen), 0.0)
    return [
        {"config": p.label, "step_time": format_seconds(p.step_time_s),
         "vs_chosen": "" if p.chosen or not chosen_time else f"{(p.step_time_s / chosen_time - 1) * 100:+.1f} %",
         "memory": format_bytes(p.memory_bytes), "feasible": yes_no(p.feasible),
         "pareto": yes_no(p.on_front), "chosen": yes_no(p.chosen)}
        for p in table_points(chart, best)
    ]


def cluster_rows(plan: Plan) -> list[dict[str, str]]:
    """The hardware numbers the prediction used, from the cluster profile copied into the plan."""
    c, gpu, eff = plan.cluster, plan.cluster.gpu, plan.cluster.efficiency
    rows = [
        ("GPU", gpu.name), ("GPUs per node", str(c.gpus_per_node)),
        ("HBM capacity", f"{format_bytes(gpu.hbm_bytes)} ({gpu.hbm_bytes / 1e9:.0f} GB)"),
        ("HBM bandwidth", format_rate(gpu.hbm_bandwidth_Bps, "B")),
        ("Peak bf16", format_rate(gpu.peak_bf16_flops, "FLOP") if gpu.peak_bf16_flops else "unsupported"),
        ("Peak fp16", format_rate(gpu.peak_fp16_flops, "FLOP")),
        ("Peak fp32", format_rate(gpu.peak_fp32_flops, "FLOP")),
        ("Intra-node bandwidth (per GPU, per direction)", format_rate(c.intra_node_bandwidth_Bps, "B")),
        ("Inter-node bandwidth (per GPU, per direction)", format_rate(c.inter_node_bandwidth_Bps, "B")),
        ("Host-device bandwidth (per GPU)", format_rate(c.host_to_device_bandwidth_Bps, "B")),
        *([("Device-host bandwidth (per GPU)", format_rate(c.device_to_host_bandwidth_Bps, "B"))]
          if c.device_to_host_bandwidth_Bps else []),
        ("Intra-node collective latency", format_seconds(c.intra_node_latency_s)),
        ("Inter-node collective latency", format_seconds(c.inter_node_latency_s)),
        ("CPU memory per node", format_bytes(c.cpu_memory_bytes)),
        ("CPU memory bandwidth per node", format_rate(c.cpu_memory_bandwidth_Bps, "B")),
        *([("CPU Adam throughput per node (measured)", f"{format_count(c.cpu_adam_params_per_s)} parameters/s")]
          if c.cpu_adam_params_per_s else []),
        ("NVMe per node", format_bytes(c.nvme_bytes) if c.nvme_bytes else "none"),
        ("NVMe bandwidth per node", format_rate(c.nvme_bandwidth_Bps, "B")),
        ("Framework reserve per GPU", format_bytes(c.framework_reserve_bytes)),
        ("GEMM efficiency curve",
         f"{eff.gemm_max:.2f} x GEMM / (GEMM + {eff.gemm_half_flops / 1e9:.1f} GFLOP)"),
        ("Memory-bound op efficiency", format_percent(eff.memory_bound)),
        ("Intra-node link efficiency", format_percent(eff.intra_node_link)),
        ("Inter-node link efficiency", format_percent(eff.inter_node_link)),
        ("Host link efficiency", format_percent(eff.host_link)),
    ]
    return [{"name": name, "value": value} for name, value in rows]


def capability_rows(plan: Plan) -> list[dict[str, str]]:
    """What the runtime cannot run on this model and why (schemas.capability), one row per trait and parallelism."""
    return [{"parallelism": capability.replace("_", " "), "module": trait.module or "(the model)",
             "found": trait.detail, "why": RULES[trait.kind].why}
            for capability in CAPABILITIES for trait in blocking(plan.model.traits, capability)
            if capability != "sequence_parallel" or "tensor_parallel" not in RULES[trait.kind].blocks]  # said once


def verification_rows(plan: Plan) -> list[dict[str, str]]:
    """The dry run's numbers per rank (plan.verification, `zplan compile --verify`), beside the plan's; [] when
    the plan was not verified."""
    if plan.verification is None:
        return []
    rows = []
    for rank in plan.verification.ranks:
        error = (rank.predicted_peak_bytes - rank.measured_peak_bytes) / max(1, rank.measured_peak_bytes)
        rows.append({"rank": f"{rank.rank} ({rank.role})", "measured": format_bytes(rank.measured_peak_bytes),
                     "planned": format_bytes(rank.predicted_peak_bytes), "difference": f"{error:+.1%}",
                     "capacity": format_bytes(rank.capacity_bytes),
                     "host": format_bytes(rank.host_peak_bytes) if rank.host_peak_bytes else "-"})
    return rows


def report_context(plan: Plan, alternatives: Alternatives | None = None) -> dict[str, Any]:
    """Everything report.md.j2 and report.html.j2 read: plan_context plus chart data and tables; the search's
    numbers from `alternatives` (alternatives.json), or the chosen plan alone without them."""
    timeline = pipeline_timeline(plan.parallel)
    pareto = pareto_chart(plan, alternatives)
    rows = alternative_rows(pareto)
    return {
        **plan_context(plan),
        "memory_chart": memory_chart(plan),
        "verification": plan.verification,
        "verification_rows": verification_rows(plan),
        "time_chart": time_chart(plan),
        "timeline": timeline,
        "timeline_text": timeline_as_text(timeline),
        "timeline_capped": timeline.drawn_micro_batches < timeline.total_micro_batches,
        "pareto": pareto,
        "alternative_rows": rows,
        "candidate_count": len(pareto.points),
        "alternatives_not_shown": len(pareto.points) - len(rows),
        "alternatives_not_shown_infeasible": sum(not p.feasible for p in pareto.points) - sum(
            row["feasible"] == "no" for row in rows),
        "table_best_feasible": TABLE_BEST_FEASIBLE,
        "pareto_front_count": sum(p.on_front for p in pareto.points),
        "rejected_rows": [r.model_dump() for r in alternatives.rejected] if alternatives is not None else [],
        "candidates_evaluated": (f"{alternatives.candidates_evaluated:,}" if alternatives is not None
                                 else f"not recorded (no {ALTERNATIVES_FILE})"),
        "alternatives_file": ALTERNATIVES_FILE,
        "capability_rows": capability_rows(plan),
        "assumption_rows": [a.model_dump() for a in alternatives.assumptions] if alternatives is not None else [],
        "cluster_rows": cluster_rows(plan),
        "cluster_source": plan.cluster.source,
        "total_params_display": format_count(plan.model.params),
    }
