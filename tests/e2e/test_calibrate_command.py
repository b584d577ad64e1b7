"""`zplan calibrate` end to end on this machine: two tiny plans compiled for cpu-local and run by their own scripts
with --log-json (which logs each step's phases too), the profile fitted on one and checked on the other; the fitted
profile is a cluster file that --cluster loads. (The fit itself against a known profile:
tests/unit/test_calibrate.py; 4 + 4 runs: benchmarks/calibrate_cpu.py.)"""

import json
import math
import subprocess

import pytest
import yaml

from tests.e2e.test_compile_and_run import BIN, compile_tiny, run_script
from zplan.planner.clusters import load_cluster


def test_calibrate_fits_on_measured_runs_and_the_profile_compiles(tmp_path):
    fitted_dir, checked_dir = tmp_path / "zero0", tmp_path / "one"
    compile_tiny(fitted_dir, 2, "--zero", "0", "--tp", "1", "--pp", "1")
    compile_tiny(checked_dir, 1, "--micro-batch", "2")
    for out in (fitted_dir, checked_dir):
        for record in run_script(out, 6):  # each step's phases, timed inside it (runtime.training.loop)
            phases = record["phases_s"]
            assert 0 < phases["forward_backward_s"] and 0 < phases["optimizer_s"]
            assert phases["forward_backward_s"] + phases["optimizer_s"] <= record["step_time_s"]
    profile = tmp_path / "fitted.yaml"
    done = subprocess.run([str(BIN / "zplan"), "calibrate", str(fitted_dir), "--check", str(checked_dir), "-o",
                           str(profile), "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["fitted_mean_abs_error_after"] <= result["fitted_mean_abs_error_before"] + 1e-9
    assert [run["name"] for run in result["checked_runs"]] == [str(checked_dir)]
    assert all(run["measured_s"] > 0 and run["after_s"] > 0 for run in result["fitted_runs"] + result["checked_runs"])
    cluster = load_cluster(str(profile))
    assert cluster.name == "cpu-local-calibrated" and cluster == load_cluster(str(profile))
    assert yaml.safe_load(profile.read_text())["efficiency"]["gemm_max"] <= 1.0  # load_cluster: what --cluster reads
    # the run left out of the fit, its error under the fitted profile, for the plans' intervals (planner/uncertainty)
    checked = result["checked_runs"][0]
    assert cluster.calibration_errors_held_out
    assert cluster.calibration_errors == [pytest.approx(math.log(checked["measured_s"] / checked["after_s"]))]


def test_calibrate_refuses_folders_without_a_plan_or_a_log(tmp_path):
    compile_tiny(tmp_path / "never-run", 1)
    for folder, words in ((tmp_path, "holds no plan.json"), (tmp_path / "never-run", "does not exist: run")):
        done = subprocess.run([str(BIN / "zplan"), "calibrate", str(folder), "-o", str(tmp_path / "x.yaml")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr
        assert not (tmp_path / "x.yaml").exists()
