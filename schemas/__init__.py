"""Pydantic models that cross module boundaries; their JSON Schema lives in schemas/json/."""

from zplan.schemas.alternatives import Alternatives, Candidate, RejectedFamily
from zplan.schemas.capability import ModelTrait
from zplan.schemas.cluster import ClusterSpec, EfficiencySpec, GpuSpec
from zplan.schemas.model import LayerCost, ModelSummary, TensorParallelRule
from zplan.schemas.plan import (
    PLAN_SCHEMA_VERSION,
    Assumption,
    CompressionDecision,
    CompressionOption,
    Fingerprint,
    MemoryBreakdown,
    ParallelConfig,
    Placement,
    Plan,
    Prediction,
    Stage,
    TimeBreakdown,
)
from zplan.schemas.spec import CompressionConfig, Pins, TrainSpec

__all__ = [
    "PLAN_SCHEMA_VERSION", "Alternatives", "Assumption", "Candidate", "ClusterSpec", "CompressionConfig",
    "CompressionDecision", "CompressionOption", "EfficiencySpec", "Fingerprint", "GpuSpec", "LayerCost",
    "MemoryBreakdown", "ModelSummary", "ModelTrait", "ParallelConfig", "Pins", "Placement", "Plan",
    "Prediction", "RejectedFamily", "Stage", "TensorParallelRule", "TimeBreakdown", "TrainSpec",
]
