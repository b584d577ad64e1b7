"""End to end, the emitted programs: a user error of train.py comes out of launch/torchrun.sh once, with exit
status 2 and no torchrun traceback; train.py refuses a checkpoint folder another run holds, a plan.json made for
another model, and --steps 0, each with one message and exit status 2, before anything is trained."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zplan.api import compile_plan, prepare, write_outputs
from zplan.runtime.checkpoint.run_lock import try_lock
from zplan.schemas.spec import Pins

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.py"
BIN = Path(sys.executable).parent


def compile_tiny(out: Path, gpus: int, model: Path = TINY) -> Path:
    plan = compile_plan(prepare(str(model), gpus, "cpu-local", 8, 32, "fp32", Pins(tp=1, pp=1)))
    write_outputs(plan, out, str(model))
    return out


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1"}
    env.pop("TORCHRUN", None)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_one_error(result: subprocess.CompletedProcess, needle: str) -> None:
    errors = [line for line in result.stderr.splitlines() if line.startswith("zplan: error:")]
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-4000:]
    assert len(errors) == 1 and needle in errors[0], result.stderr[-4000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_torchrun_sh_passes_a_user_error_through_once_with_exit_status_2(tmp_path):
    out = compile_tiny(tmp_path / "out", 2)
    result = run(["bash", str(out / "launch" / "torchrun.sh"), "--steps", "2", "--model", str(tmp_path / "no.py")],
                 tmp_path)
    assert_one_error(result, "model file")  # both ranks had it


def test_train_py_refuses_a_locked_checkpoint_folder_another_models_plan_and_no_steps(tmp_path):
    out = compile_tiny(tmp_path / "out", 1)
    lock, problem = try_lock(tmp_path / "ckpt")
    assert problem is None
    try:
        result = run([sys.executable, str(out / "train.py"), "--steps", "1", "--checkpoint-dir",
                      str(tmp_path / "ckpt")], tmp_path)
    finally:
        lock.release()
    assert_one_error(result, f"--checkpoint-dir {tmp_path / 'ckpt'} is in use: another run holds it (pid "
                             f"{os.getpid()} on host")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".zplan-run.lock"]  # nothing trained

    assert_one_error(run([sys.executable, str(out / "train.py"), "--steps", "0"], tmp_path),
                     "argument --steps: must be a whole number from 1 to 1,000,000,000 (got '0')")

    other_model = tmp_path / "other.py"
    other_model.write_text(TINY.read_text() + "\n# another model\n")
    other = compile_tiny(tmp_path / "other", 1, other_model)
    shutil.copy(other / "plan.json", out / "plan.json")
    assert_one_error(run([sys.executable, str(out / "train.py"), "--steps", "1"], tmp_path),
                     "plan.json beside this train.py was made for another model")
