"""MODEL on the command line -> ModelSummary: a family spec, or a model file that is traced.

A string with ':' that names no existing file is a family spec ('gpt:layers=96,hidden=12288,heads=96');
anything else is a path to a model file. A model file is counted at seq_len when given, else at the
SEQ_LEN the file defines, else at DEFAULT_SEQ_LEN (2048) tokens; a family spec at seq_len, else its seq.

This is where the planner's tracer meets the runtime: a traced model's traits include the runtime's own answers
to what it can run on it (runtime/plan/model_checks.py), handed to the tracer as data-producing checks, so that the
planner itself never imports the runtime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from zplan.planner import trace
from zplan.planner.family import family_summary
from zplan.planner.graph import ModelGraph
from zplan.planner.trace import DEFAULT_SEQ_LEN, TRACERS
from zplan.runtime.plan import model_checks
from zplan.schemas.model import ModelSummary

__all__ = ["DEFAULT_SEQ_LEN", "is_family_reference", "summarize_model", "trace_model_file", "trace_module"]


def is_family_reference(model_ref: str) -> bool:
    return ":" in model_ref and not Path(model_ref).exists()


def trace_model_file(path: str | Path, seq_len: int | None, precision: str, *,
                     build_overrides: dict[str, Any] | None = None,
                     tracers: tuple[str, ...] = TRACERS, serving: bool = False) -> tuple[ModelGraph, ModelSummary]:
    """planner.trace.trace_model_file with the runtime's checks: every trait of the model (`serving`: whether the
    inference engine serves it too, compile --mode inference)."""
    return trace.trace_model_file(path, seq_len, precision, build_overrides=build_overrides, tracers=tracers,
                                  runtime_checks=model_checks, serving=serving)


def trace_module(model: nn.Module, example_inputs: Any, seq_len: int, precision: str, *, name: str = "model",
                 tracers: tuple[str, ...] = TRACERS, serving: bool = False) -> tuple[ModelGraph, ModelSummary]:
    """planner.trace.trace_module with the runtime's checks: every trait of the model (`serving`: as
    trace_model_file)."""
    return trace.trace_module(model, example_inputs, seq_len, precision, name=name, tracers=tracers,
                              runtime_checks=model_checks, serving=serving)


def summarize_model(model_ref: str, seq_len: int | None, precision: str, *,
                    build_overrides: dict[str, Any] | None = None,
                    serving: bool = False) -> tuple[ModelGraph | None, ModelSummary]:
    """(graph, summary) of a model file, or (None, summary) of a family spec (`serving`: as trace_model_file; a family
    spec has no modules to ask about)."""
    if is_family_reference(model_ref):
        return None, family_summary(model_ref, seq_len, precision)
    return trace_model_file(model_ref, seq_len, precision, build_overrides=build_overrides, serving=serving)
