"""MODEL on the command line -> ModelSummary: a family spec, or a model file that is traced.

A string with ':' that names no existing file is a family spec ('gpt:layers=96,hidden=12288,heads=96');
anything else is a path to a model file. A model file is counted at seq_len when given, else at the
SEQ_LEN the file defines, else at DEFAULT_SEQ_LEN (2048) tokens; a family spec at seq_len, else its seq.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zplan.planner.family import family_summary
from zplan.planner.graph import ModelGraph
from zplan.planner.trace import DEFAULT_SEQ_LEN, trace_model_file
from zplan.schemas.model import ModelSummary

__all__ = ["DEFAULT_SEQ_LEN", "is_family_reference", "summarize_model"]


def is_family_reference(model_ref: str) -> bool:
    return ":" in model_ref and not Path(model_ref).exists()


def summarize_model(model_ref: str, seq_len: int | None, precision: str, *,
                    build_overrides: dict[str, Any] | None = None) -> tuple[ModelGraph | None, ModelSummary]:
    """(graph, summary) of a model file, or (None, summary) of a family spec."""
    if is_family_reference(model_ref):
        return None, family_summary(model_ref, seq_len, precision)
    return trace_model_file(model_ref, seq_len, precision, build_overrides=build_overrides)
