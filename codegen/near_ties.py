"""The report's near-ties: the search's alternatives whose 80 % step-time interval overlaps the chosen plan's
(planner/uncertainty.py), which the cost model cannot tell apart from it, and the runs that would: ten steps of each
on the cluster, then `zplan calibrate` on them (docs/commands.md)."""

from __future__ import annotations

from zplan.codegen.context import format_seconds
from zplan.codegen.report import describe_config
from zplan.schemas.alternatives import Alternatives
from zplan.schemas.plan import Plan

NEAR_TIES_SHOWN = 3  # the fastest overlapping alternatives the report names; the rest stay in alternatives.json
CALIBRATION_STEPS = 10


def near_ties(plan: Plan, alternatives: Alternatives | None) -> list:
    """The feasible alternatives (schemas.alternatives.Candidate) whose interval overlaps the plan's, fastest first
    (all of them: the report names the first NEAR_TIES_SHOWN)."""
    mine = plan.prediction.interval
    if mine is None or alternatives is None:
        return []
    undelayed = plan.parallel.model_copy(update={"delayed_update": False})
    tied = [alt for alt in alternatives.alternatives
            if alt.feasible and alt.step_time_s_interval is not None and alt.parallel not in (plan.parallel, undelayed)
            and mine.overlaps(alt.step_time_s_interval)]
    return sorted(tied, key=lambda alt: alt.step_time_s)


def near_tie_rows(plan: Plan, alternatives: Alternatives | None) -> list[dict[str, str]]:
    """One row a near-tie: its layout, step time and interval, and the commands of its calibration run."""
    model, world, cluster = plan.fingerprint.model_ref, plan.fingerprint.world_size, plan.cluster.name
    rows = []
    for k, alt in enumerate(near_ties(plan, alternatives)[:NEAR_TIES_SHOWN], start=1):
        low, high = alt.step_time_s_interval
        folder = f"near-tie-{k}"
        rows.append({
            "config": describe_config(alt.parallel), "step_time": format_seconds(alt.step_time_s),
            "interval": f"{format_seconds(low)} - {format_seconds(high)}",
            "vs_chosen": f"{(alt.step_time_s / plan.prediction.step_time_s - 1) * 100:+.1f} %",
            "commands": (f"zplan compile {model} --gpus {world} --cluster {cluster} {alt.parallel.pin_flags()} "
                         f"-o {folder} && bash {folder}/launch/torchrun.sh --steps {CALIBRATION_STEPS} "
                         f"--log-json {folder}/log.jsonl")})
    return rows
