"""Emit the training script and its launchers: out/train.py, out/launch/torchrun.sh, out/launch/slurm.sbatch.

train.py shows the plan for review as a comment table and runs plan.json, the one source of its settings
(runtime/plan/apply.py applies it in docs/design.md decision 5's fixed order), so an edit to the plan is either
checked by check_plan and run, or refused. Output is deterministic: the same plan and model path give the same bytes.
"""

from __future__ import annotations

import json
import re
import shlex
from math import ceil
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from zplan.schemas.digest import plan_digest
from zplan.schemas.model_states import parameters_in_compute_dtype
from zplan.schemas.plan import Plan
from zplan.schemas.spec import ADAMW_DEFAULTS, GRAD_CLIP, compute_dtype

TEMPLATES_DIR = Path(__file__).parent / "templates"
LINE_WIDTH = 100  # wrap long literals in train.py at this width
STAGES_SHOWN = 8  # pipeline stages the review table names at most: the first ones and the last (plan.json has all)


class Code(str):
    """Text a template writes as it is: Python or shell that codegen made, every value in it a literal (py_literal)
    or a comment made safe (comment_text). Any other string a template writes is data, escaped for the file's
    language by the environment (script_environment): no value from a plan, a cluster profile or a file name can
    become code."""


def py_literal(value: Any) -> Code:
    """A Python literal for a scalar: double-quoted strings, None, True/False, ints, short floats."""
    if value is None or isinstance(value, bool):
        return Code(repr(value))
    if isinstance(value, str):
        return Code(json.dumps(value))  # a JSON string is a valid Python string literal (ASCII, escaped)
    if isinstance(value, int):
        return Code(str(value))
    if isinstance(value, float):
        return Code(f"{value:.6g}")
    raise TypeError(f"no literal for {type(value).__name__}")


def comment_text(value: Any) -> str:
    """`value` as text that stays on its line (a comment, a docstring line): control characters as spaces."""
    return re.sub(r"[\x00-\x1f\x7f\u2028\u2029\x85]", " ", str(value))


def python_text(value: Any) -> str:
    """Data written into a Python docstring or comment: on one line, quotes and backslashes escaped."""
    if isinstance(value, Code) or not isinstance(value, str):
        return str(value)
    return json.dumps(comment_text(value))[1:-1]


def shell_text(value: Any) -> str:
    """Data written into a shell script, in a comment or as a word: on one line, quoted unless a plain word."""
    if isinstance(value, Code) or not isinstance(value, str):
        return str(value)
    text = comment_text(value)
    return text if re.fullmatch(r"[A-Za-z0-9_.,:/+=@%-]+", text) else shlex.quote(text)


def _wrapped_items(items: list[str], indent: str) -> list[str]:
    """Comma-separated items packed into lines of at most LINE_WIDTH characters."""
    lines, line = [], ""
    for item in items:
        candidate = f"{line} {item}," if line else f"{item},"
        if line and len(indent) + len(candidate) > LINE_WIDTH:
            lines.append(indent + line)
            candidate = f"{item},"
        line = candidate
    if line:
        lines.append(indent + line)
    return lines


def precision_row(plan: Plan) -> str:
    """What the run computes in and where its fp32 master weights and gradients are (schemas.model_states)."""
    p, precision = plan.parallel, plan.train.precision
    if precision == "fp32":
        return "fp32 throughout"
    dtype = compute_dtype(precision)  # fp8: bf16 but for the blocks' Linear GEMMs (runtime/precision/float8.py)
    fp8 = ("; the blocks' Linear GEMMs in fp8 (torchao Float8Linear, tensorwise dynamic scaling), the head in bf16"
           if precision == "fp8" else
           "; the blocks' Linear GEMMs in NVFP4 (runtime/precision/nvfp4.py: e2m1 values, e4m3 scales per 16, "
           "fp32 per tensor), "
           "the head in bf16" if precision == "nvfp4" else "")
    if parameters_in_compute_dtype(p.zero_stage, precision, p.compression.grad):
        return (f"{dtype} parameters and gradients (accumulated and reduced in {dtype}), fp32 master weights "
                f"and Adam moments in the optimizer{fp8}")
    return (f"{dtype} compute on copies of fp32 parameters (the masters), fp32 gradients (accumulated and "
            f"reduced in fp32), fp32 Adam moments{fp8}")


def stage_ranges(plan: Plan) -> str:
    """Each pipeline stage as its first and last unit (a stage is a run of consecutive units), `a..b`; past
    STAGES_SHOWN stages the middle ones as a count, so that the table stays a few lines for any model."""
    ranges = [" ".join(stage.layer_names[:1]) if len(stage.layer_names) < 2
              else f"{stage.layer_names[0]}..{stage.layer_names[-1]}" for stage in plan.stages]
    if len(ranges) > STAGES_SHOWN:
        hidden = len(ranges) - STAGES_SHOWN + 1
        ranges = [*ranges[:STAGES_SHOWN - 2], f"({hidden} more stages)", ranges[-1]]
    return " | ".join(ranges)


def plan_review(plan: Plan) -> Code:
    """The plan as comment lines of train.py, for a reviewer: what plan.json makes the run do (codegen only shows
    it; the script reads plan.json)."""
    p, prediction = plan.parallel, plan.prediction
    memory = prediction.memory
    tp_rules = ", ".join(f"{rule.module} {rule.style}" for rule in plan.model.tp_rules) if p.tp > 1 else "none"
    states_mib = (memory.parameters + memory.gradients + memory.optimizer) / 2**20
    rows = [
        ("processes", f"{plan.fingerprint.world_size} = pp {p.pp} x dp {p.dp} x tp {p.tp} (tp innermost)"),
        ("blocks", f"{plan.model.block_prefix} ({plan.model.num_blocks})"),
        ("tensor parallel", tp_rules + (", sequence parallel" if p.sequence_parallel else "")),
        ("pipeline", f"{len(plan.stages)} stage(s), schedule {p.schedule}, interleave {p.interleave}: "
                     f"{stage_ranges(plan)}"),
        ("ZeRO stage", f"{p.zero_stage} (0 replicated, 1 + optimizer states sharded, 2 + gradients, 3 + parameters)"),
        ("placement", f"parameters {plan.placement.parameters}, gradients {plan.placement.gradients}, optimizer "
                      f"{plan.placement.optimizer} (offload {p.offload}, delayed update "
                      f"{'on' if p.delayed_update else 'off'})"),
        ("recompute", p.recompute),
        ("compression", f"gradients {p.compression.grad}, weight all-gathers {p.compression.weights}, activations "
                        f"{p.compression.activations}"),
        ("precision", precision_row(plan)),
        ("batch", f"{plan.train.global_batch} sequences of {plan.train.seq_len} tokens per step = micro-batch "
                  f"{p.micro_batch} x {p.num_micro_batches} micro-batches x dp {p.dp}"),
        ("predicted", f"step {prediction.step_time_s * 1e3:.1f} ms, MFU {prediction.mfu:.1%}, model states "
                      f"{states_mib:.1f} MiB per rank"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = []
    for name, value in rows:
        text = f"#   {name:<{width}}  {comment_text(value)}"
        while len(text) > LINE_WIDTH:  # wrap at a space, continuation lines indented under the value
            cut = text.rfind(" ", 0, LINE_WIDTH)
            if cut <= width + 6:
                break
            lines.append(text[:cut])
            text = "#   " + " " * (width + 2) + text[cut + 1:]
        lines.append(text)
    return Code("\n".join(lines))


def launch_shape(plan: Plan) -> tuple[int, int]:
    """(processes per node, nodes): a node holds gpus_per_node processes, fewer when the world is smaller."""
    world = plan.fingerprint.world_size
    per_node = min(plan.cluster.gpus_per_node, world)
    return per_node, ceil(world / per_node)


def script_context(plan: Plan, model_path_for_script: str | None) -> dict[str, Any]:
    """The values the three templates read; literals already formatted as Python or shell text."""
    per_node, nodes = launch_shape(plan)
    return {
        "zplan_version": plan.zplan_version,
        "model_name": plan.model.name,
        "model_ref": plan.fingerprint.model_ref,
        "job_name": re.sub(r"[^A-Za-z0-9_.-]+", "-", plan.model.name).strip("-") or "model",
        "family": plan.model.source == "family",
        "cluster_name": plan.cluster.name,
        "device_name": plan.cluster.gpu.name,
        "world_size": plan.fingerprint.world_size,
        "per_node": per_node,
        "nodes": nodes,
        "model_file": py_literal(model_path_for_script),
        "planned_for": Code("{\n" + "".join(f"    {py_literal(key)}: {py_literal(value)},\n" for key, value
                                             in plan.fingerprint.model_dump().items()) + "}"),
        "plan_digest": py_literal(plan_digest(plan)),
        "plan_review": plan_review(plan),
        "lr": py_literal(ADAMW_DEFAULTS["lr"]),
        "weight_decay": py_literal(ADAMW_DEFAULTS["weight_decay"]),
        "betas": repr(ADAMW_DEFAULTS["betas"]),
        "eps": repr(ADAMW_DEFAULTS["eps"]),
        "grad_clip": py_literal(GRAD_CLIP),
    }


# the escaping of data by the language of the file written (Code passes as it is)
ESCAPE_BY_SUFFIX = {".py": python_text, ".sh": shell_text, ".sbatch": shell_text}


def script_environment(escape=python_text) -> Environment:
    return Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=escape,
    )


def render_script_files(plan: Plan, out_dir: Path, model_path_for_script: str | None) -> list[Path]:
    """Write train.py, launch/torchrun.sh and launch/slurm.sbatch into `out_dir`; return their paths.

    model_path_for_script: the model file as train.py should name it, relative to out_dir (so the
    output folder and the model can move together) or absolute; None for family-spec plans, whose
    train.py explains that families cannot be trained and exits with status 2.
    """
    templates = {"train.py": "train.py.j2", "launch/torchrun.sh": "torchrun.sh.j2",
                 "launch/slurm.sbatch": "slurm.sbatch.j2"}
    return render_executables(templates, script_context(plan, model_path_for_script), Path(out_dir))


def render_executables(templates: dict[str, str], context: dict[str, Any], out_dir: Path) -> list[Path]:
    """Render each template (output path relative to out_dir -> template name) into an executable file."""
    written = []
    for relative, template in templates.items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        environment = script_environment(ESCAPE_BY_SUFFIX[path.suffix])
        path.write_text(environment.get_template(template).render(**context), encoding="utf-8", newline="\n")
        path.chmod(0o755)
        written.append(path)
    return written
