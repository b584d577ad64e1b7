"""Run compiled train.py scripts one after another in one process group and read back, from the live objects,
what each run applied (a rank of tests/distributed/test_plan_applied.py).

    python plan_applied_worker.py OUT_DIR [OUT_DIR ...]

For each OUT_DIR, this rank imports its train.py and runs what its main runs (runtime/training/main.py: run_training
with the script's constants) for one step, with the runtime's `train` wrapped: before the step the wrapper hooks the
first block and reads the model's structure, after it the optimizer's states and the swap folder. It writes
OUT_DIR/applied.rankR.json. Nothing here uses zplan's own description of a plan: only torch's objects (DTensor
placements and meshes, FSDP2's parameter groups, DDP's communication hooks), the tensors a block sees, and the files
on disk.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

import zplan.runtime.training.main as train_main


def _import_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mesh_size(param: torch.Tensor, dim: str) -> int:
    """The size of mesh dimension `dim` ('dp', 'tp') over which `param` is sharded (1: not sharded over it)."""
    if not isinstance(param, DTensor) or dim not in (param.device_mesh.mesh_dim_names or ()):
        return 1
    index = param.device_mesh.mesh_dim_names.index(dim)
    return param.device_mesh.size(index) if isinstance(param.placements[index], Shard) else 1


def _blocks(model: nn.Module, prefix: str) -> list[nn.Module]:
    chunks = getattr(model, "chunks", None) or [model]
    found = []
    for chunk in chunks:
        module = chunk.module if isinstance(chunk, DistributedDataParallel) else chunk
        try:
            container = module.get_submodule(prefix)
        except AttributeError:
            continue
        found += list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
    return found


def read_structure(model: nn.Module, prefix: str) -> dict:
    params = list(model.parameters())
    ddp = [m for m in [model, *getattr(model, "chunks", [])] if isinstance(m, DistributedDataParallel)]
    blocks = _blocks(model, prefix)
    sharded_block = next((b for b in blocks if isinstance(b, FSDPModule)), None)
    group = sharded_block._get_fsdp_state()._fsdp_param_group if sharded_block is not None else None
    return {
        "tp": max([_mesh_size(p, "tp") for p in params], default=1),
        "dp_sharded": max([_mesh_size(p, "dp") for p in params], default=1),
        "pp": dist.get_world_size(model._group) if hasattr(model, "chunks") else 1,
        "reshard_after_forward": None if group is None else group.post_forward_mesh_info is not None,
        "fsdp_offload_cpu": None if group is None else isinstance(group.offload_policy, CPUOffloadPolicy),
        "fsdp_param_dtype": None if group is None or group.mp_policy.param_dtype is None
        else str(group.mp_policy.param_dtype).removeprefix("torch."),
        "ddp_comm_hooks": sum(len(m._comm_hooks) for m in ddp),
        "ddp_world": dist.get_world_size(ddp[0].process_group) if ddp else None,
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def read_optimizer(model: nn.Module, optimizer) -> dict:
    """Elements of Adam's first moment this rank holds, against the elements of the parameters it holds; the
    devices the parameters, their gradients and the optimizer's moments are on."""
    params = list(model.parameters())
    moments, moment_devices = 0, set()
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if state.get(key) is not None and _local(state[key]).numel():
                moment_devices.add(_local(state[key]).device.type)
        moment = state.get("exp_avg")
        if moment is not None:
            moments += _local(moment).numel()
    return {"param_elements": sum(_local(p).numel() for p in params), "moment_elements": moments,
            "optimizer_class": type(optimizer).__name__,
            "optimizer_parts": [type(getattr(optimizer, part, None)).__name__ for part in ("layout", "states")],
            "param_devices": sorted({_local(p).device.type for p in params}),
            "grad_devices": sorted({_local(p.grad).device.type for p in params if p.grad is not None}),
            "moment_devices": sorted(moment_devices)}


def run_one(out: Path, index: int, ctx) -> None:
    script = out / "train.py"
    module = _import_script(script, f"zplan_applied_train_{index}")
    plan = json.loads((out / "plan.json").read_text())
    prefix = plan["model"]["block_prefix"]
    nvme = out / "nvme"
    seen: dict = {"calls": 0}
    real_train = train_main.train

    def train(model, optimizer, data, loss_fn, config, ctx):
        seen.update(read_structure(model, prefix))
        first = _first_block(model, prefix, plan)
        if first is not None:  # this rank runs block 0: its input is the micro-batch's hidden state
            linear = next(m for m in first.modules() if isinstance(m, nn.Linear))

            def pre_hook(block, args, kwargs):
                hidden = args[0] if args else kwargs.get("hidden_states")
                seen["calls"] += torch.is_grad_enabled()  # not the pipeline's shape-finding forward (no_grad)
                seen["block_input_shape"] = list(getattr(hidden, "_local_tensor", hidden).shape)

            first.register_forward_pre_hook(pre_hook, with_kwargs=True)
            linear.register_forward_hook(lambda m, a, out: seen.update(compute_dtype=str(out.dtype)[6:]))
        # the gradients as the step found them: read just before it (train zeroes them after)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.update(read_optimizer(model, opt)))
        losses = real_train(model, optimizer, data, loss_fn, config, ctx)
        seen.update({k: v for k, v in read_optimizer(model, optimizer).items() if k != "grad_devices"})
        seen["device"] = ctx.device.type
        # os.walk skips a folder the other rank removes meanwhile (its swap folder, at its optimizer's close); rglob
        # raised FileNotFoundError
        seen["nvme_files"] = sum(len(files) for _, _, files in os.walk(nvme))
        return losses

    train_main.train = train
    sys.argv = [str(script), "--steps", "1", *(["--nvme-path", str(nvme)] if plan["parallel"]["offload"] == "nvme"
                                              else [])]
    try:
        script_constants = train_main.script_of(module)
        train_main.run_training(train_main.parse_script_arguments(script_constants), ctx, script_constants)
    finally:
        train_main.train = real_train
    (out / f"applied.rank{ctx.rank}.json").write_text(json.dumps(seen))


def _first_block(model: nn.Module, prefix: str, plan: dict) -> nn.Module | None:
    """Block 0 of the model if this rank holds it (pipeline rank 0, or no pipeline)."""
    blocks = _blocks(model, prefix)
    first_stage = plan["stages"][0]["layer_names"]
    holds = not hasattr(model, "chunks") or 0 in model.stage_indices
    return blocks[0] if blocks and holds and f"{prefix}.0" in first_stage else None


def main() -> int:
    from zplan.runtime.launch.distributed import run_distributed

    outs = [Path(arg) for arg in sys.argv[1:]]
    run_distributed(lambda ctx: [run_one(out, index, ctx) for index, out in enumerate(outs)] and None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
