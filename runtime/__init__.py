"""zplan's runtime: what the emitted train.py calls, in this order (DESIGN.md decision 5).

    ctx = init_distributed(); plan = load_plan(...); check_plan(plan, model_path, ctx.world_size)
    mesh = build_mesh(pp, dp, tp, device_type); model, weights = build_meta_model(build_fn, seed)
    apply_tensor_parallel -> apply_recompute -> apply_pipeline -> apply_data_parallel -> build_optimizer,
    with materialize_weights(model, weights, device) before apply_data_parallel (ZeRO 0/1: DDP needs real
    tensors) or after it (ZeRO 2/3: only FSDP2's shards are made)
    train(model, optimizer, make_data_iter(...), loss_fn, ..., checkpoint=CheckpointConfig(...))
"""

from zplan.planner.model_file import load_model_file  # the planner owns the model-file contract
from zplan.runtime.apply import (
    apply_data_parallel,
    apply_pipeline,
    apply_recompute,
    apply_tensor_parallel,
    build_optimizer,
)
from zplan.runtime.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from zplan.runtime.data import make_data_iter, synthetic_token_batch, synthetic_token_batches
from zplan.runtime.distributed import RunContext, close_distributed, init_distributed
from zplan.runtime.materialize import MaterializeReport, build_meta_model, build_model, materialize_weights
from zplan.runtime.mesh import build_mesh
from zplan.runtime.plan_check import check_plan, load_plan, model_file_sha256
from zplan.runtime.train_loop import WarmupCosine, train
from zplan.runtime.weights_file import save_full_weights

__all__ = [
    "CheckpointConfig", "CheckpointError", "MaterializeReport", "RunContext", "WarmupCosine", "apply_data_parallel",
    "apply_pipeline", "apply_recompute", "apply_tensor_parallel", "build_mesh", "build_meta_model", "build_model",
    "build_optimizer", "check_plan", "close_distributed", "init_distributed", "latest_checkpoint",
    "load_checkpoint", "load_model_file", "load_plan", "make_data_iter", "materialize_weights", "model_file_sha256",
    "resolve_checkpoint", "save_checkpoint", "save_full_weights", "synthetic_token_batch",
    "synthetic_token_batches", "train",
]
