"""End to end: compile examples/tiny.py for 1 and 2 CPU processes (data parallel, each ZeRO stage the
runtime has), run the emitted launch script, and check the loss falls and the log has its keys."""

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


@pytest.mark.slow
@pytest.mark.parametrize("gpus,pins", [(1, []), (2, ["--zero", "0"]), (2, ["--zero", "3"])])
def test_compiled_script_trains(tmp_path, gpus, pins):
    out = tmp_path / "plan"
    plan = compile_tiny(out, gpus, "--tp", "1", "--pp", "1", *pins)
    assert plan["parallel"]["dp"] == gpus
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
    assert len(files) == 7
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
