"""The command line's choices, made from the schemas' Literal types: one list of names from the CLI to the runtime
(typer takes an Enum; its values are the Literal's, in the Literal's order)."""

from __future__ import annotations

from enum import Enum
from typing import Any, get_args

from zplan.schemas import inference, plan, spec


def _choices(name: str, *literals: Any) -> type[Enum]:
    values = dict.fromkeys(value for literal in literals for value in get_args(literal))
    return Enum(name, {value: value for value in values}, type=str)


Precision = _choices("Precision", spec.Precision)
# compile's --precision: the training compute precision, or an inference weight precision
WeightPrecision = _choices("WeightPrecision", spec.Precision, inference.WeightPrecision)
Recompute = _choices("Recompute", spec.Recompute)
Offload = _choices("Offload", spec.Tier)
DelayedUpdate = _choices("DelayedUpdate", plan.DelayedUpdateMode)
Target = _choices("Target", inference.Target)


class Mode(str, Enum):
    training = "training"
    inference = "inference"
