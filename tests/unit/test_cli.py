"""The command line: every bad input gives one ZplanError message, exit status 2, no traceback, and
nothing written; good input writes the outputs and --json parses."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zplan.cli import app

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.py")
GPT_SMALL = "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


BAD_FILES = {
    "missing": (None, "does not exist"),
    "import_error": ("import not_a_module_zplan\n", "not_a_module_zplan"),
    "no_build": ("import torch\nX = 1\n", "build_model"),
    "not_module": ("def build_model():\n    return 42\n", "Module"),
    "untraceable": ("""
        import torch
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(10, 8)
                self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
                self.out = nn.Linear(8, 10)
            def forward(self, x):
                h = self.emb(x)
                for block in self.blocks:
                    h = block(h)
                if h.sum() > 0:  # depends on values: no tracer can follow it
                    h = h * 2
                return self.out(h)
        def build_model():
            return M()
        """, "trace"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_model_file_fails_cleanly(tmp_path, case):
    body, needle = BAD_FILES[case]
    model = str(tmp_path / "absent.py") if body is None else write(tmp_path, f"{case}.py", body)
    out = tmp_path / "out"
    result = run("compile", model, "--gpus", 2, "--cluster", "cpu-local", "-o", out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert needle.lower() in result.output.lower()
    assert not out.exists()


@pytest.mark.parametrize("args,needle", [
    (["--gpus", 8, "--cluster", "no-such-cluster"], "unknown cluster"),
    (["--gpus", 12, "--cluster", "dgx-a100-80g"], "whole number"),
    (["--gpus", 8, "--tp", 3], "divide"),
    (["--gpus", 8, "--tp", 2, "--pp", 2, "--dp", 1], "tp*pp*dp"),
    (["--gpus", 8, "--tp", 1, "--sequence-parallel"], "sequence-parallel"),
    (["--gpus", 8, "--zero", 0, "--offload", "cpu"], "ZeRO"),
    (["--gpus", 8, "--dp", 8, "--global-batch", 12], "does not divide"),
    (["--gpus", 16, "--cluster", "dgx2-v100", "--precision", "bf16"], "fp16"),
])
def test_bad_request_fails_cleanly(tmp_path, args, needle):
    out = tmp_path / "out"
    result = run("compile", GPT_SMALL, *args, "-o", out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert needle.lower() in result.output.lower()
    assert not out.exists()


def test_bad_family_spec_names_the_key(tmp_path):
    result = run("compile", "gpt:layers=4,hiddn=256", "--gpus", 8, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "hiddn" in result.output and "Traceback" not in result.output


def test_nothing_fits_names_the_closest_plan_and_a_fix(tmp_path):
    result = run("compile", "gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200", "--gpus", 8,
                 "--global-batch", 8, "--offload", "none", "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "Closest" in text and "GiB" in text and "--gpus" in text
    assert not (tmp_path / "out").exists()


def test_compile_writes_everything_and_json_parses(tmp_path):
    out = tmp_path / "plan"
    result = run("compile", GPT_SMALL, "--gpus", 8, "--global-batch", 16, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["parallel"]["tp"] * data["parallel"]["pp"] * data["parallel"]["dp"] == 8
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert names == {"plan.json", "alternatives.json", "train.py", "launch/torchrun.sh", "launch/slurm.sbatch",
                     "report.md", "report.html", "ds_config.json", ".zplan-manifest.json"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_pins_are_respected(tmp_path):
    result = run("compile", GPT_SMALL, "--gpus", 8, "--global-batch", 16, "--tp", 2, "--pp", 2, "--zero", 1,
                 "--micro-batch", 2, "--recompute", "full", "-o", tmp_path / "o", "--json")
    assert result.exit_code == 0, result.output
    p = json.loads(result.stdout)["parallel"]
    assert (p["tp"], p["pp"], p["dp"], p["zero_stage"], p["micro_batch"], p["recompute"]) == (2, 2, 2, 1, 2, "full")


def test_a_zero1_cpu_offload_plan_runs(tmp_path):
    """An 8.9B GPT in fp32 with ZeRO-1 fills an A100 with weights and gradients (8 bytes each per
    parameter): the optimizer must go to the host, which the runtime runs with ZeRO-1
    (runtime.optim.host_states) as with ZeRO-2: no runtime gap, no warning. (What the runtime
    cannot run yet is flagged: tests/unit/test_plan_check.py.)"""
    model = "gpt:layers=44,hidden=4096,heads=32,seq=2048,vocab=51200"
    pins = ["--gpus", 8, "--global-batch", 8, "--tp", 1, "--pp", 1, "--micro-batch", 1, "--recompute", "full",
            "--precision", "fp32", "--offload", "cpu"]
    result = run("compile", model, *pins, "--zero", 1, "-o", tmp_path / "o", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["parallel"]["offload"], data["parallel"]["zero_stage"], data["placement"]["optimizer"]) == \
        ("cpu", 1, "cpu")
    assert data["runtime_gaps"] == [] and "warning" not in result.stderr
    runnable = run("compile", model, *pins, "--zero", 2, "-o", tmp_path / "p", "--json")
    assert json.loads(runnable.stdout)["runtime_gaps"] == [] and "warning" not in runnable.stderr


def test_offload_follows_the_placement_and_the_report_shows_its_traffic(tmp_path):
    """A 26B GPT on 8 A100s with ZeRO-2 and --offload cpu: the GPU cannot hold the weight and gradient shards beside
    the gathered bf16 weights, so the optimizer, gradient and weight shards go to the host (FSDP2's
    CPUOffloadPolicy). By hand (planner.placement's traffic rules): per step and GPU, the fp32 gradient
    shard (4 P / 8 bytes) goes down once per micro-batch (1 here) and the fp32 weight shard (4 P / 8) is fetched
    once for the step's all-gather (ZeRO-2 keeps it gathered): 1.0 P.
    The same pin on a small model that fits puts its optimizer alone on the host all the same (a pin is honoured),
    its shards staying on the GPU (runtime.optim.host_states): per step the fp32 gradient shard (4 P / 8)
    down and the fp32 weight shard (4 P / 8) up, 1.0 P again; on the host per GPU the CPU Adam's master, m and v
    and the gradient buffer, 16 B x P / 8, i.e. 16 P per node of 8."""
    big = "gpt:layers=32,hidden=8192,heads=64,seq=2048,vocab=51200"
    pins = ["--gpus", 8, "--global-batch", 8, "--tp", 1, "--pp", 1, "--zero", 2, "--offload", "cpu",
            "--micro-batch", 1, "--recompute", "full"]
    result = run("compile", big, *pins, "-o", tmp_path / "big", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "big" / "plan.json").read_text())
    placement, params = plan["placement"], plan["model"]["params"]
    assert (placement["optimizer"], placement["gradients"], placement["parameters"], plan["parallel"]["offload"]) \
        == ("cpu", "cpu", "cpu", "cpu")
    assert placement["host_device_bytes_per_step"] == pytest.approx(1.0 * params)
    assert placement["host_device_s"] > 0 and placement["cpu_optimizer_s"] > 0
    from zplan.codegen.context import format_bytes

    report = (tmp_path / "big" / "report.md").read_text()
    assert f"| Offload traffic | host-GPU {format_bytes(1.0 * params)} in " in report

    small = run("compile", GPT_SMALL, *pins, "-o", tmp_path / "small", "--json")
    data = json.loads(small.stdout)
    assert data["parallel"]["offload"] == "cpu"
    assert [data["placement"][state] for state in ("parameters", "gradients", "optimizer")] == ["gpu", "gpu", "cpu"]
    small_plan = json.loads((tmp_path / "small" / "plan.json").read_text())
    small_params, memory = small_plan["model"]["params"], small_plan["prediction"]["memory"]
    assert data["placement"]["host_device_bytes_per_step"] == pytest.approx(1.0 * small_params)
    assert memory["parameters"] == memory["gradients"] == pytest.approx(4 * small_params / 8)
    assert memory["optimizer"] == 0.0 and memory["cpu_bytes_per_node"] == pytest.approx(16 * small_params)
    assert "| Offload traffic | host-GPU " in (tmp_path / "small" / "report.md").read_text()


def test_estimate_json_has_the_documented_keys():
    result = run("estimate", GPT_SMALL, "--gpus", 8, "--tp", 2, "--pp", 1, "--global-batch", 16, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("step_time_s", "tokens_per_s", "mfu", "feasible", "memory_per_gpu_bytes", "memory_breakdown"):
        assert key in data
    assert data["config"]["tp"] == 2 and data["config"]["dp"] == 4


def test_explain_and_clusters(tmp_path):
    out = tmp_path / "p"
    assert run("compile", GPT_SMALL, "--gpus", 8, "--global-batch", 16, "-o", out).exit_code == 0
    result = run("explain", out / "plan.json")
    assert result.exit_code == 0 and "best alternatives" in result.output and "why other families lost" in result.output
    # how sure: the chosen plan's 80 % interval (planner/uncertainty.py), each alternative's, and which overlap it
    plan = json.loads((out / "plan.json").read_text())
    low, high = plan["prediction"]["interval"]["step_time_s"]
    assert f"80%: {low:.3f} - {high:.3f} s" in " ".join(result.output.split())
    assert "80 % interval" in result.output and "near-tie" in result.output
    result = run("clusters")
    for name in ("dgx-a100-80g", "dgx-h100", "dgx-h200", "dgx2-v100", "cpu-local"):
        assert name in result.output
    assert run("explain", tmp_path / "missing.json").exit_code == 2


def test_plan_json_holds_the_executed_plan_and_explain_reads_alternatives_json(tmp_path):
    """The tiny example's plan.json stays short: the search's alternatives are alternatives.json beside it, which
    explain reads; an older plan.json with the alternatives inside, a missing alternatives.json and one of another
    compile are refused with the fix (recompile)."""
    out = tmp_path / "tiny"
    assert run("compile", TINY, "--gpus", 8, "-o", out).exit_code == 0
    plan_text, search = (out / "plan.json").read_text(), json.loads((out / "alternatives.json").read_text())
    assert len(plan_text.splitlines()) < 360 and "alternatives" not in json.loads(plan_text)
    assert search["alternatives"] and search["fingerprint"] == json.loads(plan_text)["fingerprint"]
    manifest = json.loads((out / ".zplan-manifest.json").read_text())["files"]
    assert {"plan.json", "alternatives.json"} <= set(manifest)

    old = tmp_path / "old"
    old.mkdir()
    (old / "plan.json").write_text(json.dumps({**json.loads(plan_text), "schema_version": 1,
                                               "alternatives": search["alternatives"]}))
    result = run("explain", old / "plan.json")
    assert result.exit_code == 2 and "older zplan" in result.output and "recompile" in result.output
    (old / "plan.json").write_text(plan_text)
    result = run("explain", old / "plan.json")
    assert result.exit_code == 2 and "no alternatives.json" in result.output
    other = {**search, "fingerprint": {**search["fingerprint"], "world_size": 16}}
    (old / "alternatives.json").write_text(json.dumps(other))
    result = run("explain", old / "plan.json")
    assert result.exit_code == 2 and "another compile" in result.output


def test_cluster_file(tmp_path):
    result = run("clusters", "--json")
    spec = json.loads(result.stdout)["dgx-h100"]
    spec["name"] = "my-h100"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(spec))
    result = run("compile", GPT_SMALL, "--gpus", 8, "--cluster", path, "-o", tmp_path / "o", "--json")
    assert result.exit_code == 0, result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    result = run("compile", GPT_SMALL, "--gpus", 8, "--cluster", bad, "-o", tmp_path / "o2")
    assert result.exit_code == 2 and "not a valid ClusterSpec" in result.output


def test_recompiling_into_a_folder_keeps_files_zplan_did_not_write(tmp_path):
    out = tmp_path / "plan"
    assert run("compile", GPT_SMALL, "--gpus", 8, "--global-batch", 16, "-o", out).exit_code == 0
    (out / "log.jsonl").write_text("keep me\n")
    (out / "ckpt").mkdir()
    (out / "ckpt" / "step-1").write_text("weights\n")
    result = run("compile", GPT_SMALL, "--gpus", 8, "--global-batch", 32, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    assert (out / "log.jsonl").read_text() == "keep me\n" and (out / "ckpt" / "step-1").exists()
    assert json.loads((out / "plan.json").read_text())["train"]["global_batch"] == 32
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_export_of_a_missing_checkpoint_fails_cleanly(tmp_path):
    result = run("export", tmp_path / "no-such-ckpt", "--to", tmp_path / "m.safetensors")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert not (tmp_path / "m.safetensors").exists()


def test_inference_compile_writes_its_outputs_and_json_parses(tmp_path):
    out = tmp_path / "inf"
    result = run("compile", TINY, "--mode", "inference", "--gpus", 1, "--cluster", "cpu-local", "--precision",
                 "fp32", "-o", out, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"out_dir", "parallel", "prediction", "reason"}
    assert (data["parallel"]["tp"], data["parallel"]["weight_precision"], data["parallel"]["weight_tier"]) == \
        (1, "fp32", "gpu")
    assert data["prediction"]["tpot_s"] > 0 and data["reason"].startswith("Target latency")
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {"plan.json", "report.md", "report.html"} <= names and "train.py" not in names
    assert json.loads((out / "plan.json").read_text())["mode"] == "inference"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    explained = run("explain", out / "plan.json")
    assert explained.exit_code == 0, explained.output
    assert "alternatives" in explained.output and "Target latency" in " ".join(explained.output.split())
    summary = run("compile", TINY, "--mode", "inference", "--gpus", 1, "--cluster", "cpu-local", "-o", out)
    assert summary.exit_code == 0 and "TTFT" in summary.output and "tokens/s" in summary.output


INFERENCE = ["--mode", "inference"]


@pytest.mark.parametrize("args,needle", [
    ([*INFERENCE, "--global-batch", 8], "--global-batch is a training option"),
    ([*INFERENCE, "--pp", 2], "--pp is a training option"),
    ([*INFERENCE, "--zero", 1, "--micro-batch", 2], "--zero, --micro-batch are training options"),
    ([*INFERENCE, "--recompute", "full"], "--recompute"),
    ([*INFERENCE, "--delayed-update", "off"], "--delayed-update"),
    ([*INFERENCE, "--prompt-len", 100, "--gen-len", 100], "--gen-len 28 or less"),
    ([*INFERENCE, "--tp", 3], "use one of 1, 2, 4, 8"),
    (["--target", "latency"], "--target is an inference option"),
    (["--batch", 4], "--batch is an inference option"),
    (["--prompt-len", 10, "--gen-len", 5], "--prompt-len, --gen-len are inference options"),
    (["--precision", "int8"], "--precision int8 is an inference option"),
])
def test_bad_or_wrong_mode_options_fail_cleanly(tmp_path, args, needle):
    out = tmp_path / "out"
    result = run("compile", GPT_SMALL, "--gpus", 8, *args, "-o", out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and needle in " ".join(result.output.split())
    assert not out.exists()


def test_inference_that_fits_nowhere_names_what_would_fit(tmp_path):
    result = run("compile", "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200", "--mode", "inference",
                 "--gpus", 1, "--cluster", "dgx-h100", "--offload", "none", "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "Closest" in text and "--offload cpu" in text and "Traceback" not in text
    assert not (tmp_path / "out").exists()


def test_compile_without_cluster_says_which_hardware_it_planned_for(tmp_path):
    result = run("compile", GPT_SMALL, "--gpus", 8, "--global-batch", 16, "-o", tmp_path / "a")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == ("note: no --cluster given: planned for dgx-a100-80g (8 x A100-SXM4-80GB "
                                             "per node); pass --cluster NAME|FILE, see `zplan clusters`")
    assert json.loads((tmp_path / "a" / "plan.json").read_text())["cluster"]["name"] == "dgx-a100-80g"
    assert "4 layers, counted by the family's formulas" in " ".join(result.stdout.split())  # plain words
    given = run("compile", GPT_SMALL, "--gpus", 8, "--global-batch", 16, "--cluster", "dgx-h100", "-o", tmp_path / "b")
    assert given.exit_code == 0 and "--cluster" not in given.stderr, given.output
    estimated = run("estimate", GPT_SMALL, "--gpus", 8, "--tp", 1, "--pp", 1, "--json")
    assert estimated.exit_code == 0 and "no --cluster given: planned for dgx-a100-80g" in estimated.stderr


@pytest.mark.parametrize("args", [["--help"], ["compile", "--help"], ["clusters"]])
def test_help_and_clusters_fit_80_columns(args):
    """As a terminal of 80 columns shows them (COLUMNS=80): no line longer, no word cut to "…"."""
    shown = subprocess.run([sys.executable, "-m", "zplan", *args], capture_output=True, text=True, check=True,
                           env={**os.environ, "COLUMNS": "80"}, stdin=subprocess.DEVNULL).stdout
    lines = shown.splitlines()
    assert len(lines) > 10 and not [line for line in lines if len(line) > 80 or "…" in line], shown
    if args == ["clusters"]:  # every profile with its GPU, and the numbers whole
        for name, spec in json.loads(run("clusters", "--json").stdout).items():
            assert any(line.split()[:2] == [name, spec["gpu"]["name"].split()[0]] for line in lines), name
        assert "2039" in shown and "1979" in shown  # A100 80GB's HBM GB/s, H100's fp8 TFLOP/s
    if args == ["compile", "--help"]:  # the argument says what it takes: a model file or a family spec
        assert lines[0].startswith("Usage:") and "MODEL" in lines[0] and "MODEL_FILE" not in shown
        assert "build_model()" in shown and "gpt:layers=" in shown
