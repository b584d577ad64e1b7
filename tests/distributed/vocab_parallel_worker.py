"""Run several emitted train.py scripts one after another in one process group, each with its own arguments (a rank of
tests/distributed/test_vocab_parallel.py).

    python vocab_parallel_worker.py JOBS.json

JOBS.json is a list of [OUT_DIR, [train.py argument, ...]], every OUT_DIR a compiled plan (plan.json, train.py) for
the same world size. For each job, in order, this rank imports OUT_DIR/train.py and calls run_training(args, ctx) with
its constants (runtime/training/main.py), exactly what its main runs with those arguments, the process group started
once for all of them (as tests/distributed/hf_parallel_worker.py does, for the same reason: one launch, torch and
transformers imported once). Before each run trains, every rank prints one line `VOCAB {json}`: the names of its
parameters of V rows (the plan's vocabulary) that are split by rows over the tp mesh (Shard(0) on it), read from the
live DTensors.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from torch import nn
from torch.distributed.tensor import DTensor

import zplan.runtime.training.main as train_main
from zplan.runtime.launch.distributed import RunContext, run_distributed
from zplan.runtime.training.main import parse_script_arguments, run_training, script_of


def _import_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vocabulary_split_over_tp(model: nn.Module, vocab: int) -> list[str]:
    """Names of `model`'s parameters of `vocab` rows that are Shard(0) on the mesh dim named tp."""
    split = []
    for name, param in model.named_parameters(remove_duplicate=False):
        dims = (param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else ()
        if "tp" in dims and param.shape[0] == vocab and param.placements[dims.index("tp")].is_shard(0):
            split.append(name)
    return sorted(split)


def run_jobs(jobs: list[tuple[str, list[str]]], ctx: RunContext) -> None:
    real_train = train_main.train
    for index, (out, args) in enumerate(jobs):
        script = Path(out) / "train.py"
        sys.argv = [str(script), *args]
        vocab = json.loads((Path(out) / "plan.json").read_text())["model"]["vocab"]

        def train(model, *rest, out=out, vocab=vocab):
            record = {"out": Path(out).name, "rank": ctx.rank, "split": vocabulary_split_over_tp(model, vocab)}
            print("VOCAB " + json.dumps(record), flush=True)
            return real_train(model, *rest)

        train_main.train = train
        constants = script_of(_import_script(script, f"zplan_vocab_train_{index}"))
        run_training(parse_script_arguments(constants), ctx, constants)
        if ctx.is_main:
            print(f"vocab_parallel_worker: {Path(out).name} done", flush=True)


def main() -> int:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    run_distributed(lambda ctx: run_jobs(jobs, ctx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
