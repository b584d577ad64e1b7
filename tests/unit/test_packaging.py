"""DESIGN.md 'Layout': the folders install under the zplan.* namespace. Build a wheel, install it into a
fresh virtual environment, and run the installed `zplan`."""

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installs_and_runs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("zplan-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("zplan/cli.py", "zplan/planner/search.py", "zplan/planner/cost/step.py",
                     "zplan/codegen/templates/train.py.j2", "zplan/schemas/json/plan.schema.json",
                     "zplan/runtime/apply.py", "zplan/examples/tiny.py"):
        assert expected in names, expected

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # Dependencies come from this environment's site-packages (no download), the package from the wheel.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    help_text = subprocess.run([str(venv / "bin" / "zplan"), "--help"], check=True, capture_output=True,
                               text=True, cwd=tmp_path).stdout
    assert "compile" in help_text and "estimate" in help_text
    where = subprocess.run([str(py), "-c", "import zplan.planner.search as s; print(s.__file__)"], check=True,
                           capture_output=True, text=True, cwd=tmp_path).stdout
    assert str(venv) in where  # the installed copy, not the source tree
    out = subprocess.run([str(venv / "bin" / "zplan"), "compile", "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000",
                          "--gpus", "8", "-o", str(tmp_path / "plan"), "--json"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "plan" / "report.html").exists()
