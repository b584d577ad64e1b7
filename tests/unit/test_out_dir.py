"""`zplan compile -o DIR` into an existing folder is all or nothing, and never overwrites a file the user
changed since zplan wrote it (zplan.out_dir: the outputs built beside DIR, checked against DIR and its manifest of
SHA-256s, then swapped in; --force overwrites changed files)."""

import errno
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
        "plan.json", "alternatives.json", "train.py", "launch/torchrun.sh", "launch/slurm.sbatch", "report.md",
        "report.html", "ds_config.json"}
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


def hashed_tree(root: Path) -> dict[str, str | None]:
    """Every path under `root` (links not followed) -> the SHA-256 of its bytes, its link target, or None."""
    listing = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            listing[rel] = f"-> {os.readlink(path)}"
        else:
            listing[rel] = out_dir.sha256_file(path) if path.is_file() else None
    return listing


@pytest.mark.parametrize("entry", ["../victim.txt", "../../victim.txt", "/etc/hostname", "sub/../../victim.txt",
                                   "link/victim.txt"])
def test_a_manifest_entry_outside_the_folder_is_ignored_and_nothing_outside_changes(tmp_path, entry):
    """The manifest is data anyone sharing the folder could edit: an entry naming a file outside it (its SHA-256
    right, so that it looks like a stale output of the last compile) must not have that file removed or moved."""
    parent = tmp_path / "shared"
    out = parent / "plan"
    assert compile_into(out, "--global-batch", 16).exit_code == 0
    victim = parent / "victim.txt" if entry != "/etc/hostname" else Path(entry)
    if entry != "/etc/hostname":
        victim.write_text("precious\n")
        (parent.parent / "victim.txt").write_text("also precious\n")
    (out / "link").symlink_to(parent)  # a link inside the folder that leads out of it
    manifest = json.loads((out / out_dir.MANIFEST).read_text())
    manifest["files"][entry] = out_dir.sha256_file(victim) if victim.exists() else "0" * 64
    (out / out_dir.MANIFEST).write_text(json.dumps(manifest))
    before = hashed_tree(tmp_path)
    result = compile_into(out, "--global-batch", 16)  # the entry is not written again: stale, if it were inside
    assert result.exit_code == 0, result.output
    after = hashed_tree(tmp_path)
    outside = {rel: digest for rel, digest in before.items() if not rel.startswith("shared/plan/")}
    assert {rel: after.get(rel) for rel in outside} == outside
    assert victim.exists()


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "huge"])
def test_a_manifest_that_is_a_special_file_or_huge_is_read_as_no_manifest(tmp_path, kind):
    """/dev/zero reads without end and stat says 0 bytes; a FIFO would block the reader: the manifest is read
    without blocking, refused by kind or by the bytes read, and then counts as absent (every file the user's)."""
    out = tmp_path / "plan"
    assert compile_into(out, "--global-batch", 16).exit_code == 0
    manifest = out / out_dir.MANIFEST
    manifest.unlink()
    if kind == "dev-zero":
        manifest.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(manifest)
    else:
        manifest.write_text(json.dumps({"files": {"x": "0" * 64}}) + " " * out_dir.MAX_MANIFEST_BYTES)
    assert out_dir.read_manifest(out) == {}
    result = compile_into(out, "--global-batch", 16)
    assert result.exit_code == 0, result.output  # the same outputs again: nothing to refuse


def test_a_linked_output_subfolder_is_refused_so_nothing_is_written_through_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "plan"
    assert compile_into(out, "--global-batch", 16).exit_code == 0
    os.rename(out / "launch", elsewhere / "launch")
    (out / "launch").symlink_to(elsewhere / "launch")
    before = hashed_tree(elsewhere)
    result = compile_into(out, "--global-batch", 32)
    assert result.exit_code == 2 and "launch is a symbolic link where zplan writes the folder" in \
        " ".join(result.output.split()), result.output
    assert hashed_tree(elsewhere) == before


def test_a_full_disk_while_rendering_is_one_message_and_leaves_nothing_behind(tmp_path):
    def render_until_full(folder: Path) -> list[Path]:
        (folder / "plan.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match=r"plan: the disk is full \(.* free, more needed\); nothing was written"):
        out_dir.write_out_dir(tmp_path / "plan", render_until_full)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary sibling
