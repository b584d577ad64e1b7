"""docs/design.md 'Packages': the folders install under the zplan.* namespace. Build a wheel, install it into a
fresh virtual environment, and run the installed `zplan`. The installed versions are the lock's
(constraints.txt, docs/dependencies.md)."""

import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
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
                     "zplan/runtime/plan/apply.py", "zplan/model/model_file.py", "zplan/examples/tiny.py"):
        assert expected in names, expected
    # every module of every folder the package installs is in the wheel (a folder missing from pyproject.toml's
    # package lists would leave its modules out)
    folders = {"zplan": "zplan", **{name: f"zplan/{name}" for name in
                                    ("schemas", "model", "planner", "runtime", "codegen", "cuda", "examples")}}
    sources = {f"{target}/{path.relative_to(ROOT / folder).as_posix()}" for folder, target in folders.items()
               for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts}
    assert sources <= set(names), sorted(sources - set(names))[:10]

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


def locked_versions() -> dict[str, str]:
    """constraints.txt: normalised package name -> the exact version locked."""
    lock = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            lock[canonical(name)] = version.strip()
    return lock


def _installed_version(name: str) -> str | None:
    """The version of the distribution `name` that imports find: the first on sys.path (setuptools, once imported,
    appends its _vendor folder, which holds copies of packaging and others at other versions)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.skipif(bool(os.environ.get("UNLOCKED")), reason="`make UNLOCKED=1`: the newest releases, not the lock")
def test_the_environment_holds_exactly_the_locked_versions():
    """The Makefile installs through constraints.txt: every locked package is installed at its locked version
    (torch's local label, +cpu, aside), and the project's dependencies are all locked."""
    lock = locked_versions()
    installed = {name: _installed_version(name) for name in lock}  # the copy imports find (first on sys.path)
    differ = {name: (version, installed[name]) for name, version in lock.items()
              if (installed[name] or "").split("+")[0] != version}
    assert not differ, f"locked vs installed: {differ}; `make` reinstalls from the lock, `make lock` rewrites it"
    requirements = [canonical(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in metadata.requires("zplan")]
    assert set(requirements) <= set(lock), set(requirements) - set(lock)


def test_pyproject_bounds_the_major_versions_of_torch_transformers_and_torchao():
    requirements = {canonical(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]): r for r in metadata.requires("zplan")}
    for name, bound in (("torch", "<3"), ("transformers", "<6"), ("torchao", "<1")):
        assert bound in requirements[name], requirements[name]
