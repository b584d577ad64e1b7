"""Emit the training script and its launchers: out/train.py, out/launch/torchrun.sh, out/launch/slurm.sbatch.

train.py states the plan's choices as constants (mesh, tensor-parallel plan, stages, ZeRO stage, ...)
and then calls the runtime's steps in their fixed order (DESIGN.md decision 5), so a reviewer reads
the plan in the code. Output is deterministic: the same plan and model path give the same bytes.
"""

from __future__ import annotations

import json
import re
from math import ceil
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from zplan.planner.compression import ONE_BIT_WARMUP_STEPS
from zplan.schemas.plan import Plan
from zplan.schemas.spec import ADAMW_DEFAULTS, GRAD_CLIP

TEMPLATES_DIR = Path(__file__).parent / "templates"
LINE_WIDTH = 100  # wrap long literals in train.py at this width


def py_literal(value: Any) -> str:
    """A Python literal for a scalar: double-quoted strings, None, True/False, ints, short floats."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid Python string literal
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    raise TypeError(f"no literal for {type(value).__name__}")


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


def stages_code(stages: list[list[str]]) -> str:
    """STAGES as a list of lists, one stage per line where it fits."""
    lines = ["["]
    for names in stages:
        one_line = "    [" + ", ".join(py_literal(n) for n in names) + "],"
        if len(one_line) <= LINE_WIDTH:
            lines.append(one_line)
        else:
            lines.append("    [")
            lines += _wrapped_items([py_literal(n) for n in names], indent="        ")
            lines.append("    ],")
    lines.append("]")
    return "\n".join(lines)


def tp_plan_code(tp_plan: dict[str, str]) -> str:
    """TP_PLAN as a dict literal, one Linear per line."""
    if not tp_plan:
        return "{}"
    body = [f"    {py_literal(module)}: {py_literal(style)}," for module, style in tp_plan.items()]
    return "\n".join(["{", *body, "}"])


def launch_shape(plan: Plan) -> tuple[int, int]:
    """(processes per node, nodes): a node holds gpus_per_node processes, fewer when the world is smaller."""
    world = plan.fingerprint.world_size
    per_node = min(plan.cluster.gpus_per_node, world)
    return per_node, ceil(world / per_node)


def script_context(plan: Plan, model_path_for_script: str | None) -> dict[str, Any]:
    """The values the three templates read; literals already formatted as Python or shell text."""
    parallel, prediction = plan.parallel, plan.prediction
    memory = prediction.memory
    per_node, nodes = launch_shape(plan)
    model_state_bytes = memory.parameters + memory.gradients + memory.optimizer
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
        "pp": parallel.pp,
        "dp": parallel.dp,
        "tp": parallel.tp,
        "block_prefix": py_literal(plan.model.block_prefix),
        "tp_plan": tp_plan_code({rule.module: rule.style for rule in plan.model.tp_rules}),
        "sequence_parallel": py_literal(parallel.sequence_parallel),
        "stages": stages_code([stage.layer_names for stage in plan.stages]),
        "schedule": py_literal(parallel.schedule),
        "interleave": parallel.interleave,
        "zero_stage": parallel.zero_stage,
        "offload": py_literal(parallel.offload),
        "delayed_update": py_literal(parallel.delayed_update),  # ZeRO-Offload's one-step delayed update
        "nvme_offload": parallel.offload == "nvme",  # train.py then takes --nvme-path
        "grad_compression": py_literal(parallel.compression.grad),
        "weight_compression": py_literal(parallel.compression.weights),
        "activation_compression": py_literal(parallel.compression.activations),
        "onebit_adam": parallel.compression.grad == "1bit",  # train.py then takes --onebit-warmup-steps
        "onebit_warmup_steps": ONE_BIT_WARMUP_STEPS,
        "lr": py_literal(ADAMW_DEFAULTS["lr"]),
        "weight_decay": py_literal(ADAMW_DEFAULTS["weight_decay"]),
        "betas": repr(ADAMW_DEFAULTS["betas"]),
        "eps": repr(ADAMW_DEFAULTS["eps"]),
        "grad_clip": py_literal(GRAD_CLIP),
        "parameters_on_nvme": plan.placement.parameters == "nvme",
        "recompute": py_literal(parallel.recompute),
        "precision": py_literal(plan.train.precision),
        "micro_batch": parallel.micro_batch,
        "num_micro_batches": parallel.num_micro_batches,
        "global_batch": plan.train.global_batch,
        "seq_len": plan.train.seq_len,
        "vocab": plan.model.vocab,
        "predicted_step_time_s": py_literal(float(prediction.step_time_s)),
        "predicted_mfu": py_literal(float(prediction.mfu)),
        "predicted_model_state_bytes": py_literal(int(model_state_bytes)),
        "predicted_state_bytes_by_tier": repr({  # per GPU: the placement's bytes on each tier
            "gpu": int(model_state_bytes),
            "cpu": int(memory.cpu_bytes_per_node / plan.cluster.gpus_per_node),
            "nvme": int(memory.nvme_bytes_per_node / plan.cluster.gpus_per_node)}),
        "model_flops_per_step": py_literal(float(prediction.model_flops_per_step)),
        "peak_flops": py_literal(float(plan.cluster.peak_flops(plan.train.precision))),
    }


def script_environment() -> Environment:
    return Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
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
    environment = script_environment()
    written = []
    for relative, template in templates.items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(environment.get_template(template).render(**context), encoding="utf-8", newline="\n")
        path.chmod(0o755)
        written.append(path)
    return written
