"""Issue 13: `zplan compile -o DIR` into an existing folder is all or nothing, and never overwrites a file the user
changed since zplan wrote it (zplan.out_dir: the outputs built beside DIR, checked against DIR and its manifest of
SHA-256s, then swapped in; --force overwrites changed files)."""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zplan import out_dir
from zplan.api import compile_plan, prepare, write_outputs
from zplan.cli import app
from zplan.errors import OutputError
from zplan.schemas.spec import Pins

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.py")
GPT_SMALL = "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000"
runner = CliRunner()


def compile_into(out: Path, *args):
    return runner.invoke(app, ["compile", GPT_SMALL, "--gpus", "8", *[str(a) for a in args], "-o", str(out)])


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` -> its bytes (None for a folder)."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


def no_temporary_folders(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".")]


def test_a_user_file_in_the_way_is_refused_and_nothing_changes(tmp_path):
    out = tmp_path / "plan"
    out.mkdir()
    (out / "launch").write_text("my notes about launching\n")
    (out / "data.txt").write_text("keep\n")
    before = tree(out)
    result = compile_into(out, "--global-batch", 16)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "launch is a file where zplan writes the folder launch/" in text
    assert "nothing in the folder was changed" in text
    assert tree(out) == before and no_temporary_folders(tmp_path)


def test_a_file_changed_since_zplan_wrote_it_is_refused_unless_forced(tmp_path):
    out = tmp_path / "plan"
    assert compile_into(out, "--global-batch", 16).exit_code == 0
    assert set(json.loads((out / ".zplan-manifest.json").read_text())["files"]) == {
        "plan.json", "train.py", "launch/torchrun.sh", "launch/slurm.sbatch", "report.md", "report.html",
        "ds_config.json"}
    assert compile_into(out, "--global-batch", 16).exit_code == 0  # its own files, unchanged: replaced
    (out / "train.py").write_text((out / "train.py").read_text() + "# my change\n")
    before = tree(out)
    result = compile_into(out, "--global-batch", 32)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"{out / 'train.py'} was changed since zplan wrote it" in text and "--force" in text
    assert tree(out) == before and no_temporary_folders(tmp_path)

    forced = compile_into(out, "--global-batch", 32, "--force")
    assert forced.exit_code == 0, forced.output
    assert "# my change" not in (out / "train.py").read_text()
    assert json.loads((out / "plan.json").read_text())["train"]["global_batch"] == 32
    assert no_temporary_folders(tmp_path)


def test_a_file_zplan_did_not_write_counts_as_the_users(tmp_path):
    out = tmp_path / "plan"
    out.mkdir()
    (out / "report.md").write_text("my report\n")
    result = compile_into(out, "--global-batch", 16)
    assert result.exit_code == 2 and "report.md was changed since zplan wrote it" in " ".join(result.output.split())
    assert (out / "report.md").read_text() == "my report\n" and sorted(p.name for p in out.iterdir()) == ["report.md"]


def test_a_failure_while_swapping_puts_everything_back(tmp_path, monkeypatch):
    out = tmp_path / "plan"
    plan = compile_plan(prepare(GPT_SMALL, 8, "dgx-a100-80g", 16, None, None, Pins()))
    write_outputs(plan, out, GPT_SMALL)
    (out / "log.jsonl").write_text("a user's log\n")
    before = tree(out)
    replace, calls = os.replace, []

    def failing_replace(source, target):
        calls.append(target)
        if len(calls) == 10:  # every old file moved aside, a few new ones moved in
            raise OSError(28, "No space left on device")
        replace(source, target)

    monkeypatch.setattr(out_dir.os, "replace", failing_replace)
    other = compile_plan(prepare(GPT_SMALL, 8, "dgx-a100-80g", 32, None, None, Pins()))
    with pytest.raises(OutputError, match="No space left on device; nothing in it was changed"):
        write_outputs(other, out, GPT_SMALL)
    monkeypatch.setattr(out_dir.os, "replace", replace)
    assert tree(out) == before and no_temporary_folders(tmp_path)


def test_switching_to_inference_removes_the_unchanged_training_files_only(tmp_path):
    out = tmp_path / "plan"
    assert runner.invoke(app, ["compile", TINY, "--gpus", "1", "--cluster", "cpu-local", "-o", str(out)]).exit_code == 0
    (out / "launch" / "slurm.sbatch").write_text("#!/bin/bash\n# my own job script\n")
    result = runner.invoke(app, ["compile", TINY, "--mode", "inference", "--gpus", "1", "--cluster", "cpu-local",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {"generate.py", "serve.py", "launch/serve.sh", "launch/slurm.sbatch"} <= names
    assert not {"train.py", "ds_config.json", "launch/torchrun.sh"} & names  # zplan's, unchanged: gone
    assert "my own job script" in (out / "launch" / "slurm.sbatch").read_text()  # changed: the user's now
