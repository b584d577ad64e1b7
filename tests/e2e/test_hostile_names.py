"""Values that reach the emitted programs are data, never code: a cluster profile whose names carry
Python, and a model file whose name carries shell, compile into programs that run none of it.

Each payload would create a file named PWNED in the output folder if it ran; the test runs what a user runs
(`python train.py --help`, `python generate.py --help`, `bash launch/torchrun.sh`, `bash -n` on every script) and
checks that no such file appears.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import zplan.examples
from zplan.api import compile_plan, prepare, write_outputs
from zplan.planner.clusters import load_cluster
from zplan.schemas import Pins

TINY = Path(zplan.examples.__file__).parent / "tiny.py"


def python_payload(out: Path) -> str:
    """Closes a docstring or a comment line and runs Python that creates out/PWNED."""
    return f'x"""\nopen({str(out / "PWNED")!r}, "w")\n"""\n# \\'


def shell_payload() -> str:
    """Starts a new line, and substitutes commands, each creating PWNED in the folder the script runs in."""
    return "x\ntouch PWNED\n$(touch PWNED)`touch PWNED`"


def hostile_cluster(tmp_path: Path, out: Path) -> Path:
    cluster = load_cluster("cpu-local")
    payload = python_payload(out)
    hostile = cluster.model_copy(update={"name": payload, "description": payload,
                                         "gpu": cluster.gpu.model_copy(update={"name": payload})})
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(hostile.model_dump()))
    return path


def run_quietly(argv: list[str], cwd: Path) -> int:
    env = {**os.environ, "TORCHRUN": str(cwd / "no-such-torchrun"), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, timeout=120).returncode


def test_a_cluster_profile_cannot_put_code_in_the_training_script(tmp_path):
    out = tmp_path / "out"
    cluster = hostile_cluster(tmp_path, out)
    write_outputs(compile_plan(prepare(str(TINY), 2, str(cluster), 8, 32, "fp32", Pins())), out, str(TINY))
    for script in (out / "train.py", out / "launch" / "torchrun.sh", out / "launch" / "slurm.sbatch"):
        text = script.read_text()
        if script.suffix == ".py":
            compile(text, str(script), "exec")
        else:
            assert run_quietly(["bash", "-n", str(script)], out) == 0
    assert run_quietly([sys.executable, str(out / "train.py"), "--help"], out) == 0
    assert not (out / "PWNED").exists()


def test_a_cluster_profile_cannot_put_code_in_the_inference_programs(tmp_path):
    from zplan.inference_api import compile_inference_plan
    from zplan.inference_api import prepare as prepare_inference

    out = tmp_path / "out"
    cluster = hostile_cluster(tmp_path, out)
    write_outputs(compile_inference_plan(prepare_inference(str(TINY), 1, str(cluster))), out, str(TINY))
    for name in ("generate.py", "serve.py"):
        compile((out / name).read_text(), name, "exec")
        assert run_quietly([sys.executable, str(out / name), "--help"], out) == 0
    for name in ("generate.sh", "serve.sh"):
        assert run_quietly(["bash", "-n", str(out / "launch" / name)], out) == 0
    assert not (out / "PWNED").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_model_file_name_cannot_put_commands_in_the_launch_scripts(tmp_path):
    out = tmp_path / "out"
    model = tmp_path / f"{shell_payload()}.py"
    model.write_text(TINY.read_text())
    write_outputs(compile_plan(prepare(str(model), 2, "cpu-local", 8, 32, "fp32", Pins())), out, str(model))
    for script in (out / "launch" / "torchrun.sh", out / "launch" / "slurm.sbatch"):
        assert run_quietly(["bash", "-n", str(script)], out) == 0
    assert run_quietly(["bash", str(out / "launch" / "torchrun.sh")], out) == 2  # the TORCHRUN check, nothing else
    compile((out / "train.py").read_text(), "train.py", "exec")
    assert not (out / "PWNED").exists()
