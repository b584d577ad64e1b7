"""Files zplan reads as data, replaced by what a careless or hostile user could put there: a link to /dev/zero
(endless bytes, stat says 0), a FIFO (blocks its reader), a folder, a file of gigabytes in all but name. Each is
refused with exit status 2 and one message, at once, and nothing outside the case's folder changes
(zplan.safe_files)."""

import hashlib
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zplan.cli import app

GPT_SMALL = "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000"
runner = CliRunner()


def hashed_tree(root: Path) -> dict[str, str]:
    """Every path under `root`, links not followed -> a digest of what it is."""
    listing = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            listing[str(path)] = f"-> {os.readlink(path)}"
        elif path.is_file():
            listing[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            listing[str(path)] = "folder" if path.is_dir() else "special"
    return listing


def hostile(path: Path, kind: str, big_bytes: int) -> Path:
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:  # a regular file over the cap: its start is valid, its size is not
        with open(path, "w") as stream:
            stream.write("name: big\n")
            stream.seek(big_bytes)
            stream.write("\n")
    return path


@pytest.mark.parametrize("kind,needle", [("dev-zero", "is a character device, not a regular file"),
                                         ("fifo", "is a FIFO, not a regular file"),
                                         ("folder", "is a folder, not a regular file"),
                                         ("huge", "is over 1,048,576 bytes")])
def test_a_cluster_file_that_is_special_or_huge_is_refused_by_kind_or_by_the_bytes_read(tmp_path, kind, needle):
    cluster = hostile(tmp_path / "cluster.yaml", kind, 2 << 20)
    before = hashed_tree(tmp_path)
    result = runner.invoke(app, ["compile", GPT_SMALL, "--gpus", "8", "--cluster", str(cluster),
                                 "-o", str(tmp_path / "out")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert needle in text and "not a cluster profile" in text, text
    assert hashed_tree(tmp_path) == before


KINDS = [("dev-zero", "is a character device, not a regular file"), ("fifo", "is a FIFO, not a regular file"),
         ("huge", "bytes, far more than such a file holds")]


@pytest.mark.parametrize("kind,needle", KINDS)
def test_a_plan_that_is_special_or_huge_is_refused_by_explain_and_by_train_py(tmp_path, kind, needle):
    from zplan.errors import PlanMismatchError
    from zplan.runtime.plan.check import load_plan
    from zplan.schemas.plan import MAX_PLAN_FILE_BYTES

    plan = hostile(tmp_path / "plan.json", kind, MAX_PLAN_FILE_BYTES + 1)
    before = hashed_tree(tmp_path)
    result = runner.invoke(app, ["explain", str(plan)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert needle in " ".join(result.output.split())
    with pytest.raises(PlanMismatchError, match=needle):
        load_plan(plan)
    assert hashed_tree(tmp_path) == before


@pytest.mark.parametrize("kind,needle", KINDS)
def test_a_calibration_log_that_is_special_or_huge_is_refused(tmp_path, kind, needle):
    from zplan.calibrate_cli import MAX_LOG_BYTES

    out = tmp_path / "run"
    assert runner.invoke(app, ["compile", GPT_SMALL, "--gpus", "8", "--cluster", "cpu-local", "-o", str(out)]
                         ).exit_code == 0
    hostile(out / "log.jsonl", kind, MAX_LOG_BYTES + 1)
    before = hashed_tree(tmp_path)
    result = runner.invoke(app, ["calibrate", str(out), "-o", str(tmp_path / "fitted.yaml")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert needle in " ".join(result.output.split())
    assert hashed_tree(tmp_path) == before
