"""User errors: every bad flag and bad file of the zplan command gives one message naming what is wrong,
exit status 2, no traceback and nothing written; inputs that made it hang (huge GPU counts and batches, a family
of 10^8 layers, a YAML alias bomb) are refused at once; outputs under a file are refused before any work."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from zplan.cli import app
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.enumerate import divisors

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.py")
GPT_SMALL = "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_error(result, *needles):
    """Exit status 2, no traceback, each needle in the message (whitespace as one space)."""
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    for needle in needles:
        assert needle in text, text


@pytest.mark.parametrize("args,needles", [
    (["--global-batch", 0], ["--global-batch must be 1 to", "(got 0)"]),
    (["--global-batch", -3], ["--global-batch must be 1 to", "(got -3)"]),
    (["--seq", -5], ["--seq must be 1 to", "(got -5)"]),
    (["--seq", 0], ["--seq must be 1 to", "(got 0)"]),  # was taken as "no --seq"
])
def test_batch_and_sequence_must_be_positive(tmp_path, args, needles):
    out = tmp_path / "out"
    assert_clean_error(run("compile", TINY, "--gpus", 1, "--cluster", "cpu-local", *args, "-o", out), *needles)
    assert not out.exists()


def cluster_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def cpu_local_yaml(**changes) -> str:
    data = BUILTIN_CLUSTERS["cpu-local"].model_dump()
    data.update(name="edited", **changes)
    return yaml.safe_dump(data)


@pytest.mark.parametrize("field,text,needle", [
    ("intra_node_bandwidth_Bps", ".inf", "intra_node_bandwidth_Bps = inf: Input should be a finite number"),
    ("intra_node_bandwidth_Bps", ".nan", "intra_node_bandwidth_Bps = nan"),
    ("intra_node_bandwidth_Bps", "1.0e-300", "intra_node_bandwidth_Bps = 1e-300: implausible"),
    ("cpu_memory_bandwidth_Bps", "1.0e+300", "cpu_memory_bandwidth_Bps = 1e+300: implausible"),
    ("intra_node_latency_s", "1.0e+30", "intra_node_latency_s = 1e+30: implausible"),
])
def test_a_cluster_with_infinite_or_implausible_numbers_is_refused_naming_the_field(tmp_path, field, text, needle):
    body = cpu_local_yaml(**{field: 12345.0}).replace(f"{field}: 12345.0", f"{field}: {text}")
    out = tmp_path / "out"
    result = run("compile", TINY, "--gpus", 2, "--cluster", cluster_file(tmp_path, body), "-o", out)
    assert_clean_error(result, "is not a valid ClusterSpec", needle)
    assert not out.exists()


def test_a_nested_field_is_named_with_its_path(tmp_path):
    data = BUILTIN_CLUSTERS["cpu-local"].model_dump()
    data["gpu"]["hbm_bytes"] = -1
    result = run("compile", TINY, "--gpus", 2, "--cluster", cluster_file(tmp_path, yaml.safe_dump(data)))
    assert_clean_error(result, "gpu.hbm_bytes = -1: Input should be greater than 0")


CASES_IN_A_CHILD = """
import json, sys
from typer.testing import CliRunner
from zplan.cli import app
results = [CliRunner().invoke(app, args) for args in json.loads(sys.argv[1])]
print(json.dumps([[r.exit_code, r.output] for r in results]))
"""


def test_inputs_that_hung_are_refused_at_once(tmp_path):
    """Run in a child stopped after 120 s: each of these hung or ran for minutes before."""
    bomb = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    bomb += [f"{chr(97 + i)}: &{chr(97 + i)} [{', '.join(['*' + chr(96 + i)] * 9)}]" for i in range(1, 10)]
    bomb_file = cluster_file(tmp_path, "\n".join(bomb) + "\n")
    out = ["-o", str(tmp_path / "out")]
    cases = [
        (["compile", GPT_SMALL, "--gpus", "1000000000", *out], "--gpus must be 1 to 1,048,576"),
        (["compile", GPT_SMALL, "--gpus", "8", "--global-batch", "1000000000000", *out], "--global-batch must be 1 to"),
        (["compile", "gpt:layers=100000000,hidden=256,heads=8", "--gpus", "8", *out], "layers=100000000"),
        (["compile", GPT_SMALL, "--gpus", "8", "--cluster", str(bomb_file), *out], "is not a valid ClusterSpec"),
    ]
    child = subprocess.run([sys.executable, "-c", CASES_IN_A_CHILD, json.dumps([args for args, _ in cases])],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert child.returncode == 0, child.stderr
    for (status, output), (_, needle) in zip(json.loads(child.stdout), cases, strict=True):
        assert status == 2 and needle in " ".join(output.split()) and "Traceback" not in output, output
        assert len(output) < 2000  # the alias bomb's message is not built from the expanded input
    assert not (tmp_path / "out").exists()


class CountingInt(int):
    """An int that counts the remainders taken of it."""

    taken = 0

    def __mod__(self, other):
        CountingInt.taken += 1
        return int(self) % other


def test_divisors_are_found_up_to_the_square_root():
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 400))
    CountingInt.taken = 0
    found = divisors(CountingInt(10**6))  # 2^6 * 5^6: 7 * 7 divisors
    assert len(found) == 49 and found == sorted(found) and found[-1] == 10**6
    assert CountingInt.taken <= 1001  # trial divisions up to sqrt(n), not n (--global-batch 1e12 never ended)


def test_output_folder_that_is_a_file_or_under_one_is_refused_before_tracing(tmp_path):
    (tmp_path / "file").write_text("mine\n")
    result = run("compile", GPT_SMALL, "--gpus", 8, "-o", tmp_path / "file")
    assert_clean_error(result, "is a file: pass a folder")
    result = run("compile", GPT_SMALL, "--gpus", 8, "-o", tmp_path / "file" / "sub")
    assert_clean_error(result, "file is a file, so nothing can be made under it")
    assert (tmp_path / "file").read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_explain_of_deeply_nested_json_says_it_is_not_a_plan(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert_clean_error(run("explain", deep), "is not a plan", "nested too deeply")


def test_a_plan_schema_error_names_the_field_and_the_value(tmp_path):
    out = tmp_path / "p"
    assert run("compile", GPT_SMALL, "--gpus", 8, "--global-batch", 16, "-o", out).exit_code == 0
    plan = json.loads((out / "plan.json").read_text())
    plan["parallel"]["tp"] = -4
    (out / "plan.json").write_text(json.dumps(plan))
    assert_clean_error(run("explain", out / "plan.json"), "parallel.tp = -4: Input should be greater than 0")


def test_probe_and_reduce_check_their_output_and_arguments_before_any_work(tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("measured or reduced before the output was checked")

    monkeypatch.setattr("zplan.probe.probe_this_machine", no_work)
    monkeypatch.setattr("zplan.model_reduction.write_reduced_model_file", no_work)
    (tmp_path / "file").write_text("mine\n")
    under_a_file = tmp_path / "file" / "x.yaml"
    assert_clean_error(run("probe", "-o", under_a_file, "--seconds", 1), "file is a file", "nothing was done")
    assert_clean_error(run("probe", "-o", tmp_path, "--seconds", 1), "is a folder")
    assert_clean_error(run("probe", "-o", tmp_path / "p.yaml", "--seconds", -1), "--seconds must be more than 0")
    assert_clean_error(run("reduce", TINY, "-o", tmp_path / "file" / "r.py"), "file is a file", "nothing was done")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_probe_writes_its_profile_atomically(tmp_path, monkeypatch):
    monkeypatch.setattr("zplan.probe.probe_this_machine", lambda seconds, nvme: BUILTIN_CLUSTERS["cpu-local"])
    target = tmp_path / "local.yaml"
    result = run("probe", "-o", target, "--seconds", 1)
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(target.read_text())["name"] == "cpu-local"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local.yaml"]  # no temporary file left
