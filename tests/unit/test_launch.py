"""One message and exit status 2 through the launchers: runtime/launch/torchrun.py's report of its workers'
failures (each distinct message once, the first failure's status), a worker's error file, launch/slurm.sbatch on a
path with spaces (fake scontrol and srun), and runtime/plan/origin.py: another compile's or another model's plan
beside train.py is refused saying so."""

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.plan_samples import runnable_plan
from zplan.api import write_outputs
from zplan.errors import PlanMismatchError
from zplan.runtime.launch.torchrun import ERROR_FILE_ENV, LAUNCHER_ENV, describe_failures, report_error
from zplan.runtime.plan.origin import check_plan_origin
from zplan.schemas.digest import plan_digest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.py"


def failure(exitcode: int, timestamp: int, message: str = ""):
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, message=message)


def test_each_distinct_worker_message_is_printed_once_with_the_first_failures_status():
    error = "zplan: error: plan does not match this run: world size"
    lines, status = describe_failures({0: failure(2, 10, error), 1: failure(2, 11, error), 2: failure(-15, 12)})
    assert lines == [error, "zplan: rank 2 was killed by signal 15 (SIGTERM)"] and status == 2
    lines, status = describe_failures({0: failure(-9, 11), 1: failure(1, 10, "To enable traceback see: ...")})
    assert lines == ["zplan: rank 0 was killed by signal 9 (SIGKILL)",
                     "zplan: rank 1 exited with status 1 (its output above says why)"]
    assert status == 1  # rank 1 failed first


def test_a_worker_under_the_launcher_writes_its_error_file_instead_of_stderr(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    assert report_error("bad thing") == 2  # plain torchrun: the worker prints it
    assert capsys.readouterr().err == "zplan: error: bad thing\n" and not error_file.exists()
    monkeypatch.setenv(LAUNCHER_ENV, str(os.getppid()))
    assert report_error("bad thing") == 2
    assert capsys.readouterr().err == ""
    assert json.loads(error_file.read_text())["message"] == "zplan: error: bad thing"


FAKE_SCONTROL = """#!/bin/bash
if [ "$2" = job ]; then echo "   JobId=7 JobName=zplan"; echo "   Command=$SUBMITTED --steps 5"; fi
if [ "$2" = hostnames ]; then echo node1; fi
"""
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$SRUN_ARGS"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("submitted", ["absolute", "relative"])
def test_slurm_sbatch_finds_train_py_on_a_path_with_spaces(tmp_path, submitted):
    out = tmp_path / "my runs" / "out dir"
    plan = runnable_plan(TINY, units=["embed", "blocks.0", "head"], hidden=8, heads=2, vocab=16, seq_len=8,
                         micro_batch=1, num_micro_batches=1)
    write_outputs(plan, out, str(TINY))
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    spool = tmp_path / "spool"  # Slurm runs a copy of the script from its spool folder
    spool.mkdir()
    shutil.copy(out / "launch" / "slurm.sbatch", spool / "slurm_script")
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1", "SRUN_ARGS": str(tmp_path / "srun-args"),
           "SUBMITTED": str(out / "launch" / "slurm.sbatch") if submitted == "absolute" else "launch/slurm.sbatch"}
    env.pop("ZPLAN_DIR", None)
    result = subprocess.run(["bash", str(spool / "slurm_script"), "--steps", "5"], cwd=out, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "srun-args").read_text().splitlines()
    assert str(out / "train.py") in args  # one word, spaces and all
    assert args[-2:] == ["--steps", "5"] and args[2:4] == ["-m", "zplan.runtime.launch.torchrun"]


def test_another_compiles_or_another_models_plan_is_named_as_such(tmp_path):
    units = dict(units=["embed", "blocks.0", "head"], hidden=8, heads=2, vocab=16, seq_len=8, micro_batch=1,
                 num_micro_batches=1)
    plan = runnable_plan(TINY, **units)
    written_for = plan.fingerprint.model_dump()
    assert check_plan_origin(plan, written_for, plan_digest(plan), TINY) is None

    other = tmp_path / "other.py"
    other.write_text(TINY.read_text() + "\n# another model\n")
    with pytest.raises(PlanMismatchError, match="plan.json beside this train.py was made for another model"):
        check_plan_origin(runnable_plan(other, **units), written_for, plan_digest(plan), TINY)
    wider = runnable_plan(TINY, **units, dp=2)
    with pytest.raises(PlanMismatchError, match="made for another compile: .* on 2 x cpu-local"):
        check_plan_origin(wider, written_for, plan_digest(plan), TINY)
    with pytest.raises(PlanMismatchError, match=f"{other} is another model than the plan's"):
        check_plan_origin(plan, written_for, plan_digest(plan), other)  # --model other.py

    edited = plan.model_copy(update={"zplan_version": "edited"})
    note = check_plan_origin(edited, written_for, plan_digest(plan), TINY)
    assert note.startswith("plan.json was edited since zplan wrote this train.py")


def test_train_py_records_the_plan_it_was_written_with(tmp_path):
    plan = runnable_plan(TINY, units=["embed", "blocks.0", "head"], hidden=8, heads=2, vocab=16, seq_len=8,
                         micro_batch=1, num_micro_batches=1)
    write_outputs(plan, tmp_path / "out", str(TINY))
    source = (tmp_path / "out" / "train.py").read_text()
    constants = source[source.index("PLANNED_FOR = "):source.index("# ---- Training hyper-parameters")]
    namespace: dict = {}
    exec(constants, namespace)  # the two literals only
    assert namespace["PLANNED_FOR"] == plan.fingerprint.model_dump()
    assert namespace["PLAN_DIGEST"] == plan_digest(plan)
