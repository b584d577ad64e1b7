"""Run several emitted train.py scripts one after another in one process group (a rank of
tests/distributed/test_hf_parallel.py).

    python hf_parallel_worker.py --steps N --seed S --lr LR OUT_DIR [OUT_DIR ...]

Each OUT_DIR holds a compiled plan (plan.json, train.py) for the same world size. For each one, this rank
imports that train.py and calls run_training(args, ctx) with its constants (runtime/training/main.py): exactly
what its main runs, with `--log-json OUT_DIR/log.jsonl --save-weights OUT_DIR/weights.pt` added, except that the
process group is started once for all of them (run_distributed around the whole sequence): a fresh launch per model
would spend most of the test's time importing torch and transformers, and a process group cannot be started twice in
one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from zplan.runtime.launch.distributed import RunContext, run_distributed
from zplan.runtime.training.main import parse_script_arguments, run_training, script_of


def _import_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_all(out_dirs: list[Path], train_args: list[str], ctx: RunContext) -> None:
    for index, out in enumerate(out_dirs):
        script = out / "train.py"
        module = _import_script(script, f"zplan_hf_train_{index}")
        sys.argv = [str(script), *train_args, "--log-json", str(out / "log.jsonl"),
                    "--save-weights", str(out / "weights.pt")]
        script_constants = script_of(module)
        run_training(parse_script_arguments(script_constants), ctx, script_constants)
        if ctx.is_main:
            print(f"hf_parallel_worker: {out.name} done", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", required=True)
    parser.add_argument("--seed", required=True)
    parser.add_argument("--lr", required=True)
    parser.add_argument("out_dirs", nargs="+", type=Path)
    args = parser.parse_args()
    train_args = ["--steps", args.steps, "--seed", args.seed, "--lr", args.lr]
    run_distributed(lambda ctx: run_all(args.out_dirs, train_args, ctx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
