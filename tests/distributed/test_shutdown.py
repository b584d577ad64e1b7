"""Closing the process group joins every gloo worker thread, so the interpreter can exit without SIGABRT.

A gloo worker that frees a finished collective's tensor after the interpreter began to exit aborts the process
("terminate called without an active exception"; runtime/launch/distributed.py explains the path). close_distributed
prevents it by destroying each process group, and so joining its workers, on the main thread before the exit.
torch's DTensor caches keep device meshes, and through them the groups, alive, and so would a parameter hook that
held its parameter (the garbage collector cannot see hooks): this test runs real plans (ZeRO-3 through FSDP2, tensor
parallel through DTensor with ZeRO-1's gradient reducer and with FSDP2, a pipeline, ZeRO-1, the tensor-parallel
inference engine) on 2 ranks each, and after the close checks that no process group is alive and that the process has no
more native threads than before it joined one. (That the abort is gone is
measured by benchmarks/shutdown_stress.py: 50 runs of each emitted program; the stress is too slow for here.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.harness import Ranks

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.py"
BIN = Path(sys.executable).parent

TRAINING_PINS = {
    "zero3": ["--zero", "3", "--dp", "2"],
    "tp2": ["--tp", "2", "--dp", "1", "--zero", "1"],  # the gradient reducer's hooks (runtime.parallel.grad_reduce)
    "tp2-zero3": ["--tp", "2", "--dp", "1", "--zero", "3"],  # FSDP2 over DTensor
    "pp2": ["--pp", "2", "--tp", "1", "--dp", "1"],
    "zero1": ["--zero", "1", "--dp", "2"],
}

DRIVER = '''
import json, os, sys
from pathlib import Path

from tests.distributed.harness import import_file
from zplan.runtime.launch.distributed import close_distributed, init_distributed
from zplan.runtime.inference.build import engine_from_plan, load_inference_plan
from zplan.runtime.inference.sampling import SamplingParams
from zplan.runtime.training.main import parse_script_arguments, run_training, script_of


def native_threads():
    return len(os.listdir("/proc/self/task"))


def train(out):
    module = import_file(Path(out) / "train.py", "train_" + Path(out).name)
    sys.argv = [str(Path(out) / "train.py"), "--steps", "2"]
    script = script_of(module)
    run_training(parse_script_arguments(script), init_distributed(), script)


def generate(out, tiny):
    engine, _, _ = engine_from_plan(load_inference_plan(Path(out) / "plan.json"), Path(tiny))
    engine.generate([[1, 2, 3]], 4, [SamplingParams()])
    engine.close()


before = native_threads()
kind, out = sys.argv[1:3]
train(out) if kind == "train" else generate(out, sys.argv[3])
alive = close_distributed(clean=True)
print("RESULT " + json.dumps({"alive_groups": alive, "extra_threads": native_threads() - before}), flush=True)
'''


def compile_plan(out: Path, *args: str) -> Path:
    subprocess.run([str(BIN / "zplan"), "compile", str(TINY), "--gpus", "2", "--cluster", "cpu-local",
                    "--precision", "fp32", *args, "-o", str(out)], check=True, capture_output=True, text=True,
                   timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
@pytest.mark.parametrize("name", [*TRAINING_PINS, "generate-tp2"])
def test_close_joins_every_process_group_of_a_real_plan(tmp_path, name):
    if name in TRAINING_PINS:
        kind, out = "train", compile_plan(tmp_path / name, "--global-batch", "8", "--seq", "32", *TRAINING_PINS[name])
    else:
        kind, out = "generate", compile_plan(tmp_path / name, "--mode", "inference", "--tp", "2", "--batch", "1",
                                             "--prompt-len", "8", "--gen-len", "4")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    output = Ranks([str(driver), kind, str(out), str(TINY)], 2, tmp_path / "logs",
                   env={"PYTHONPATH": str(ROOT)}).wait_ok()
    results = [json.loads(line.removeprefix("RESULT ")) for line in output.splitlines() if line.startswith("RESULT ")]
    assert results == [{"alive_groups": 0, "extra_threads": 0}] * 2, output[-3000:]
