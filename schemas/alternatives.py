"""alternatives.json: what the search scored besides the chosen plan and what its prediction assumed, written beside
plan.json.

The report (its Pareto chart, candidates table, rejected families and assumptions), `zplan explain` and the dry run's
next plan read it; the runtime never does (plan.json is the contract, schemas.plan). It names the plan it goes with
by the plan's fingerprint: both are written by one compile (zplan.out_dir swaps them in at once).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from zplan.schemas.frozen import Frozen
from zplan.schemas.inference import InferenceCandidate
from zplan.schemas.plan import Assumption, Fingerprint, ParallelConfig

ALTERNATIVES_SCHEMA_VERSION = 1
ALTERNATIVES_FILE = "alternatives.json"  # beside plan.json



class Candidate(Frozen):
    """One evaluated configuration, for the report's Pareto chart and `zplan explain`."""

    parallel: ParallelConfig = Field(description="The configuration.")
    step_time_s: float = Field(description="Predicted seconds per step.")
    memory_per_gpu_bytes: float = Field(description="Predicted bytes per GPU.")
    feasible: bool = Field(description="Fits memory.")
    step_time_s_interval: Optional[tuple[float, float]] = Field(
        default=None, description="[low, high] seconds per step, 80 % (planner/uncertainty.py).")


class RejectedFamily(Frozen):
    family: str = Field(description="A group of configurations, e.g. 'pp=1 (no pipeline)'.")
    reason: Literal["memory", "bubble", "communication", "compute", "illegal"] = Field(
        description="Dominant reason its best member lost."
    )
    detail: str = Field(description="One sentence with the numbers.")


class Alternatives(Frozen):
    """A training plan's search: its best other configurations, the Pareto front and why other families lost; and
    the numbers its prediction assumed."""

    schema_version: int = Field(default=ALTERNATIVES_SCHEMA_VERSION, description="alternatives.json format version.")
    mode: Literal["training"] = Field(default="training", description="Tells a training search from a serving one.")
    fingerprint: Fingerprint = Field(description="The fingerprint of the plan.json these alternatives go with.")
    candidates_evaluated: int = Field(ge=0, description="Configurations the search scored.")
    alternatives: list[Candidate] = Field(description="Best other configurations and the Pareto front.")
    rejected: list[RejectedFamily] = Field(description="Why other families lost.")
    assumptions: list[Assumption] = Field(description="Every number the prediction assumed.")


class InferenceAlternatives(Frozen):
    """An inference plan's search: every scored configuration, best first (the chosen one among them); and the
    numbers its prediction assumed."""

    schema_version: int = Field(default=ALTERNATIVES_SCHEMA_VERSION, description="alternatives.json format version.")
    mode: Literal["inference"] = Field(default="inference", description="Tells a serving search from a training one.")
    fingerprint: Fingerprint = Field(description="The fingerprint of the plan.json these alternatives go with.")
    candidates_evaluated: int = Field(ge=0, description="Configurations the planner scored.")
    alternatives: list[InferenceCandidate] = Field(description="Every scored configuration, best first.")
    assumptions: list[Assumption] = Field(description="Every number the prediction assumed.")
