"""Emit the inference programs of an InferencePlan: out/generate.py, out/serve.py, out/launch/generate.sh and
out/launch/serve.sh.

generate.py and serve.py state the plan's choices as constants (tp, weight precision and tier, batch, sequence
length) and call zplan.runtime.inference.cli, which builds the engine from them; the launch scripts start one
replica (torchrun --nproc-per-node tp, or plain python when tp = 1). Output is deterministic: the same plan and
model path give the same bytes.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from zplan.codegen.script import Code, comment_text, py_literal, render_executables
from zplan.schemas.inference import InferencePlan

BASE_PORT = 8000  # serve.sh's default PORT (replica r: BASE_PORT + r)
COMMENT_WIDTH = 100  # wrap the plan's reason at this width


def plan_constants_code(plan: InferencePlan, model_path_for_script: str | None) -> Code:
    """The constants block both scripts share: MODEL_FILE, the engine's choices, the prediction, SETTINGS."""
    p, prediction = plan.parallel, plan.prediction
    family_note = ""
    if plan.model.source == "family":
        family_note = (f"# Made for the family spec {comment_text(plan.fingerprint.model_ref)}: families are for "
                       "planning only, "
                       "there is no model\n# code to run. Compile a model file to get a script that generates.\n")
    constants = [
        ("MODEL_FILE", py_literal(model_path_for_script), "relative to this file; --model PATH overrides"),
        ("TP", str(p.tp), "tensor-parallel degree: processes (GPUs) of one replica"),
        ("REPLICAS", str(p.replicas), f"copies of the model over the plan's {plan.fingerprint.world_size} GPU(s); "
                                      "this program runs one"),
        ("WEIGHT_PRECISION", py_literal(p.weight_precision), "the blocks' Linear weights (int8/int4: weight-only, "
                                                             "group-wise; fp8: W8A8, per-channel scales)"),
        ("QUANT_GROUP_SIZE", str(p.quant_group_size), "input features per int8/int4 scale"),
        ("COMPUTE_DTYPE", py_literal(p.compute_dtype), "activations and KV cache (fp32 on a machine without CUDA)"),
        ("WEIGHT_TIER", py_literal(p.weight_tier), "where block weights live: gpu (resident), cpu or nvme (streamed)"),
        ("PREFETCH_LAYERS", str(p.prefetch_layers), "layers streamed ahead of the one computing"),
        ("MAX_BATCH", str(p.max_batch), "sequences in flight at most (serve.py: decoded together each step)"),
        ("MAX_SEQ_LEN", str(p.max_seq_len), "prompt + generated tokens per sequence"),
        ("KV_BLOCKS", str(p.kv_blocks), "serve.py's paged KV cache, in blocks of 16 tokens"),
        ("GEN_LEN", str(plan.spec.gen_len), f"default --max-new-tokens (the plan's gen_len; prompt_len "
                                            f"{plan.spec.prompt_len})"),
    ]
    lines = [f"{name} = {value}  # {comment}" for name, value, comment in constants]
    reason = textwrap.wrap(" ".join(comment_text(plan.reason).split()), COMMENT_WIDTH - 2)
    if reason:
        lines += [f"# {line}" for line in reason]
    lines += [
        "",
        f"# ---- What the plan predicts ({plan.spec.target}: batch {plan.spec.batch}, {plan.spec.prompt_len} prompt "
        f"+ {plan.spec.gen_len} new tokens) ----",
        f"PREDICTED_TTFT_S = {py_literal(float(prediction.ttft_s))}  # time to first token",
        f"PREDICTED_TPOT_S = {py_literal(float(prediction.tpot_s))}  # time per output token",
        f"PREDICTED_TOKENS_PER_S = {py_literal(float(prediction.tokens_per_s))}  # over all replicas",
        "",
        "SETTINGS = EngineSettings(",
        "    tp=TP, weight_precision=WEIGHT_PRECISION, group_size=QUANT_GROUP_SIZE, compute_dtype=COMPUTE_DTYPE,",
        "    weight_tier=WEIGHT_TIER, prefetch_layers=PREFETCH_LAYERS, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN,",
        "    kv_blocks=KV_BLOCKS,",
        ")",
    ]
    return Code(family_note + "\n".join(lines))


def inference_script_context(plan: InferencePlan, model_path_for_script: str | None) -> dict[str, Any]:
    """The values the four templates read."""
    p = plan.parallel
    return {
        "zplan_version": plan.zplan_version,
        "model_name": plan.model.name,
        "cluster_name": plan.cluster.name,
        "device_name": plan.cluster.gpu.name,
        "tp": p.tp,
        "replicas": p.replicas,
        "replicas_per_node": max(1, plan.cluster.gpus_per_node // p.tp),
        "base_port": BASE_PORT,
        "plan_constants": plan_constants_code(plan, model_path_for_script),
    }


def render_inference_scripts(plan: InferencePlan, out_dir: Path, model_path_for_script: str | None) -> list[Path]:
    """Write generate.py, serve.py, launch/generate.sh and launch/serve.sh into `out_dir`; return their paths.

    model_path_for_script: the model file as the scripts should name it, relative to out_dir or absolute;
    None for family-spec plans, whose scripts say that families cannot be run and exit with status 2."""
    templates = {"generate.py": "generate.py.j2", "serve.py": "serve.py.j2", "launch/generate.sh": "generate.sh.j2",
                 "launch/serve.sh": "serve.sh.j2"}
    return render_executables(templates, inference_script_context(plan, model_path_for_script), Path(out_dir))
