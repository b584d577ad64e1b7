"""End to end: compile examples/tiny.py for 1 and 2 CPU processes with each pin (every ZeRO stage, tensor
parallel with sequence parallel, pipeline parallel with 1F1B (tiny.py's 2 blocks leave no room to
interleave; tests/distributed covers interleaving), recompute, micro-batch, an offload pin), run the emitted
launch script under torchrun (unless RUN_ELSEWHERE names the test that trains that layout), and check the plan
kept the pins, the loss falls and the log has its keys."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def compile_tiny(out: Path, gpus: int, *pins: str) -> dict:
    result = subprocess.run(
        [str(BIN / "zplan"), "compile", str(ROOT / "examples" / "tiny.py"), "--gpus", str(gpus), "--cluster",
         "cpu-local", "--global-batch", "8", "--precision", "fp32", *pins, "-o", str(out), "--json"],
        capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def run_script(out: Path, steps: int) -> list[dict]:
    log = out / "log.jsonl"
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(out / "launch" / "torchrun.sh"), "--steps", str(steps), "--log-json",
                             str(log), "--lr", "3e-3"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


PINNED_RUNS = {  # name: (processes, pins, what the plan must then say)
    "one-process": (1, {}, {"dp": 1}),
    "zero0": (2, {"zero": 0}, {"dp": 2, "zero_stage": 0}),
    "zero1": (2, {"zero": 1, "micro-batch": 1}, {"dp": 2, "zero_stage": 1, "micro_batch": 1}),
    "zero2-selective": (2, {"zero": 2, "recompute": "selective"}, {"zero_stage": 2, "recompute": "selective"}),
    # a pin is honoured: the optimizer on the host although tiny.py fits on the device
    "zero3-offload-cpu": (2, {"zero": 3, "offload": "cpu", "recompute": "full"},
                          {"zero_stage": 3, "offload": "cpu", "recompute": "full"}),
    "tp2-sp": (2, {"tp": 2, "sequence-parallel": True}, {"tp": 2, "sequence_parallel": True}),
    "pp2-1f1b": (2, {"pp": 2, "interleave": 1}, {"pp": 2, "schedule": "1f1b"}),
}


# Plans whose program another test already trains through the emitted train.py (the suite's time is bounded): here
# their compile is checked, not rerun. name -> the test that runs the same parallel layout.
RUN_ELSEWHERE = {
    "zero0": "tests/e2e/test_hf_zoo.py (every unpinned 2-process plan is ZeRO-0 DDP)",
    "zero1": "tests/distributed/test_checkpoint.py (zero1_script)",
    "zero1-nvme": "tests/distributed/test_checkpoint.py::test_checkpoint_resumes_into_offloaded_states[1-nvme-gpu]",
    "zero2-cpu": "tests/distributed/test_checkpoint.py::test_checkpoint_resumes_into_offloaded_states[2-cpu-gpu]",
    "zero3-nvme": "tests/distributed/test_checkpoint.py (zero3_nvme_run)",
    "cpu-unpinned-zero": "tests/distributed/test_data_parallel.py::test_cpu_offload_matches_single_process (ZeRO-1)",
}


def pin_args(pins: dict) -> list[str]:
    """CLI flags for `pins`; tp and pp default to 1 (the search would otherwise pick them)."""
    args = []
    for name, value in {"tp": 1, "pp": 1, **pins}.items():
        args += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return args


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PINNED_RUNS))
def test_compiled_script_trains(tmp_path, name):
    gpus, pins, expected = PINNED_RUNS[name]
    out = tmp_path / "plan"
    plan = compile_tiny(out, gpus, *pin_args(pins))
    assert {key: plan["parallel"][key] for key in expected} == expected
    assert plan["runtime_gaps"] == []
    if name in RUN_ELSEWHERE:
        return
    records = run_script(out, steps=12)
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("loss", "tokens_per_s", "step_time_s"):
        assert all(key in r for r in records)
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 0.3, (first, last)


@pytest.mark.slow
def test_compile_is_deterministic(tmp_path):
    """Golden check: the same inputs emit byte-identical files."""
    for name in ("a", "b"):
        compile_tiny(tmp_path / name, 2)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == 9  # with .zplan-manifest.json and alternatives.json
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


OFFLOAD_PIN_RUNS = {  # name: the pins; each plan must offload to the pinned tier and put the optimizer there
    "zero1-nvme": {"zero": 1, "offload": "nvme"},
    "zero2-nvme": {"zero": 2, "offload": "nvme"},
    "zero3-nvme": {"zero": 3, "offload": "nvme"},
    "zero2-cpu": {"zero": 2, "offload": "cpu"},
    "cpu-unpinned-zero": {"offload": "cpu"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OFFLOAD_PIN_RUNS))
def test_offload_pin_is_honoured_and_runs(tmp_path, name):
    """An --offload pin is a requirement (the optimizer states go to the pinned tier, even when tiny.py
    fits on the device), NVMe runs with ZeRO 1, 2 and 3, and train.py runs the plan for 3 steps (here, or in the
    test RUN_ELSEWHERE names)."""
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.runtime.plan.check import runtime_gaps
    from zplan.schemas.spec import Pins

    pins = Pins(**OFFLOAD_PIN_RUNS[name])
    model, out = str(ROOT / "examples" / "tiny.py"), tmp_path / "plan"
    plan = compile_plan(prepare(model, 2, "cpu-local", 8, None, "fp32", pins))
    write_outputs(plan, out, model)
    assert plan.parallel.offload == pins.offload
    assert plan.placement.optimizer == pins.offload
    if pins.zero is not None:
        assert plan.parallel.zero_stage == pins.zero
    assert runtime_gaps(plan) == []
    saved = json.loads((out / "plan.json").read_text())
    assert (saved["parallel"]["offload"], saved["placement"]["optimizer"]) == (pins.offload, pins.offload)
    if name in RUN_ELSEWHERE:
        return
    nvme = tmp_path / "nvme"
    args = ["--nvme-path", str(nvme)] if pins.offload == "nvme" else []
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(out / "launch" / "torchrun.sh"), "--steps", "3", *args],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trained 3 steps" in result.stdout + result.stderr
    if pins.offload == "nvme":  # the swap files were written there, and removed at exit with the rank folders
        assert nvme.is_dir() and not list(nvme.iterdir())
