"""Write a plan's outputs: plan.json, alternatives.json (when the search's alternatives are given), report.md,
report.html, ds_config.json, and (from zplan.codegen.script) the training script and launch scripts. An inference
plan: plan.json, alternatives.json, the reports, and (from zplan.codegen.inference_script) generate.py, serve.py and
their launch scripts.

The caller owns the output folder (a temporary folder it renames atomically). Output is
deterministic: the same plan gives byte-identical files (no timestamps, fixed float formatting,
sorted JSON keys where order carries no meaning).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

from zplan.codegen import svg_charts
from zplan.codegen.ds_config import deepspeed_config, deepspeed_config_notes
from zplan.codegen.inference_report import inference_report_context
from zplan.codegen.inference_script import render_inference_scripts
from zplan.codegen.near_ties import near_tie_rows, near_ties
from zplan.codegen.report import report_context
from zplan.schemas.alternatives import ALTERNATIVES_FILE, Alternatives, InferenceAlternatives
from zplan.schemas.inference import InferencePlan
from zplan.schemas.plan import Plan

TEMPLATES_DIR = Path(__file__).parent / "templates"
SCRIPT_MODULE = "zplan.codegen.script"


def markdown_cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def report_environment() -> Environment:
    """Jinja environment for the reports: HTML escaped, undefined names an error, trailing newline kept."""
    environment = Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        autoescape=select_autoescape(enabled_extensions=("html", "html.j2"), default_for_string=False),
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters["cell"] = markdown_cell
    return environment


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8", newline="\n")
    return path


def _json(model: Plan | InferencePlan | Alternatives | InferenceAlternatives) -> str:
    return model.model_dump_json(indent=2) + "\n"


def _write_plan(out_dir: Path, plan: Plan | InferencePlan,
                alternatives: Alternatives | InferenceAlternatives | None) -> list[Path]:
    """plan.json, and alternatives.json beside it when given."""
    written = [_write(out_dir / "plan.json", _json(plan))]
    if alternatives is not None:
        if alternatives.fingerprint != plan.fingerprint:
            raise ValueError("the alternatives are of another compile than the plan (another fingerprint)")
        written.append(_write(out_dir / ALTERNATIVES_FILE, _json(alternatives)))
    return written


def render_reports(plan: Plan, alternatives: Alternatives | None = None) -> dict[str, str]:
    """File name -> text of report.md and report.html (without `alternatives`: the chosen plan alone)."""
    context: dict[str, Any] = {**report_context(plan, alternatives), "ds_notes": deepspeed_config_notes(plan),
                               "near_tie_rows": near_tie_rows(plan, alternatives),
                               "near_tie_count": len(near_ties(plan, alternatives))}
    charts = {
        "memory": svg_charts.memory_svg(context["memory_chart"]),
        "time": svg_charts.time_svg(context["time_chart"]),
        "pipeline": svg_charts.pipeline_svg(context["timeline"]),
        "pareto": svg_charts.pareto_svg(context["pareto"]),
    }
    environment = report_environment()
    return {
        "report.md": environment.get_template("report.md.j2").render(**context),
        "report.html": environment.get_template("report.html.j2").render(**context, charts=charts),
    }


def _render_script_files(plan: Plan, out_dir: Path, model_path_for_script: str | None) -> list[Path]:
    """train.py and launch/ from zplan.codegen.script, skipped while that module does not exist."""
    try:
        script = importlib.import_module(SCRIPT_MODULE)
    except ModuleNotFoundError as error:
        if error.name == SCRIPT_MODULE:
            return []
        raise
    return list(script.render_script_files(plan, out_dir, model_path_for_script) or [])


def render_inference_reports(plan: InferencePlan, alternatives: InferenceAlternatives | None = None) -> dict[str, str]:
    """File name -> text of an inference plan's report.md and report.html."""
    context = inference_report_context(plan, alternatives)
    charts = {"serving": svg_charts.serving_svg(context["serving_curve"], plan.parallel.replicas)
              if context["serving_curve"] is not None else ""}
    environment = report_environment()
    return {
        "report.md": environment.get_template("report_inference.md.j2").render(**context),
        "report.html": environment.get_template("report_inference.html.j2").render(**context, charts=charts),
    }


def render_inference_outputs(plan: InferencePlan, out_dir: Path, model_path_for_script: str | None,
                             alternatives: InferenceAlternatives | None = None) -> list[Path]:
    """Write plan.json, alternatives.json (when given), the reports, generate.py, serve.py and launch/ into the
    existing folder `out_dir`; return the written paths."""
    out_dir = Path(out_dir)
    written = _write_plan(out_dir, plan, alternatives)
    written += [_write(out_dir / name, text) for name, text in render_inference_reports(plan, alternatives).items()]
    written += render_inference_scripts(plan, out_dir, model_path_for_script)
    return written


def render_outputs(plan: Plan, out_dir: Path, model_path_for_script: str | None,
                   alternatives: Alternatives | None = None) -> list[Path]:
    """Write every output of `plan` (and alternatives.json when given) into the existing folder `out_dir`; return the
    written paths."""
    out_dir = Path(out_dir)
    written = _write_plan(out_dir, plan, alternatives)
    written += [_write(out_dir / name, text) for name, text in render_reports(plan, alternatives).items()]
    ds_config_text = json.dumps(deepspeed_config(plan), indent=2, sort_keys=True) + "\n"
    written.append(_write(out_dir / "ds_config.json", ds_config_text))
    written += _render_script_files(plan, out_dir, model_path_for_script)
    return written
