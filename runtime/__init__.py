"""zplan's runtime: what the emitted train.py calls (train_main, runtime/training/main.py), in this order
(docs/design.md decision 5).

    run_distributed(run): ctx = init_distributed(); run(ctx); close_distributed(), where run does:
    plan = load_plan(...); check_plan(plan, model_path, ctx.world_size); warn_if_other_devices(plan, ctx)
    check_output_paths(ctx, ...)
    mesh = plan_mesh(plan, device_type); model, weights = build_meta_model(build_fn, seed)
    model, _ = parallelize(model, weights, mesh, plan, model_file, device)   # runtime/plan/apply.py: the fixed
        # order apply_tensor_parallel -> apply_recompute -> apply_pipeline -> apply_data_parallel, weights made
        # before data parallelism (ZeRO 0/1) or after it (ZeRO 2/3)
    optimizer = plan_optimizer(model, mesh, plan, ...)
    train(model, optimizer, plan_data_iter(plan, mesh, make_data_iter(...), model),
          plan_loss_fn(plan, model_file), train_config(plan, ...), ctx)
"""

from __future__ import annotations

import importlib

# Name -> module that defines it. Imported on first use (PEP 562), so that a program that needs one part of the
# runtime (the inference engine, say) does not pay for importing pipelining and distributed checkpointing.
_EXPORTS = {
    "load_model_file": "zplan.model.model_file",
    "apply_tensor_parallel": "zplan.runtime.parallel.tensor_parallel",
    "apply_recompute": "zplan.runtime.training.recompute",
    "apply_pipeline": "zplan.runtime.parallel.pipeline",
    "apply_data_parallel": "zplan.runtime.parallel.data_parallel",
    "build_optimizer": "zplan.runtime.optim.build",
    **dict.fromkeys(["CheckpointConfig", "CheckpointError", "latest_checkpoint", "load_checkpoint",
                     "resolve_checkpoint", "save_checkpoint"], "zplan.runtime.checkpoint.save"),
    **dict.fromkeys(["make_data_iter", "synthetic_token_batch", "synthetic_token_batches"],
                    "zplan.runtime.training.data"),
    **dict.fromkeys(["RunContext", "close_distributed", "init_distributed", "run_distributed"],
                    "zplan.runtime.launch.distributed"),
    **dict.fromkeys(["MaterializeReport", "build_meta_model", "build_model", "materialize_weights"],
                    "zplan.runtime.training.materialize"),
    "build_mesh": "zplan.runtime.parallel.mesh",
    **dict.fromkeys(["check_output_paths", "write_atomically"], "zplan.runtime.training.outputs"),
    **dict.fromkeys(["parallelize", "plan_data_iter", "plan_figures", "plan_loss_fn", "plan_mesh", "plan_optimizer",
                     "train_config", "warn_if_other_devices"],
                    "zplan.runtime.plan.apply"),
    **dict.fromkeys(["check_plan", "load_plan", "model_file_sha256"], "zplan.runtime.plan.check"),
    **dict.fromkeys(["PlanFigures", "TrainConfig", "WarmupCosine", "train"], "zplan.runtime.training.loop"),
    "save_full_weights": "zplan.runtime.checkpoint.weights_file",
    "train_main": "zplan.runtime.training.main",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
