"""Outputs are checked before a run trains and written atomically (runtime/training/outputs.py)."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zplan.examples
from zplan.errors import OutputError
from zplan.runtime.launch.distributed import RunContext
from zplan.runtime.training.outputs import check_output_paths, write_atomically

ONE = RunContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")


def test_an_unwritable_path_is_refused_naming_the_option(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match=r"--save-weights .*a-file/w\.pt: .*nothing was trained"):
        check_output_paths(ONE, save_weights=blocker / "w.pt", log_json=tmp_path / "log.jsonl")
    with pytest.raises(OutputError, match=r"--checkpoint-dir .*a-file/ckpt"):
        check_output_paths(ONE, checkpoint_dir=blocker / "ckpt")
    with pytest.raises(OutputError, match="is a folder"):
        check_output_paths(ONE, save_weights=tmp_path)
    check_output_paths(ONE, save_weights=tmp_path / "new" / "w.pt", checkpoint_dir=tmp_path / "ckpt", log_json=None)
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())  # the probe file is gone


def test_a_failed_write_keeps_the_previous_file_and_says_what_was_needed(tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"previous")

    def full_disk(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match=r"disk is full .*2\.0 MiB needed.*unchanged"):
        write_atomically(path, full_disk, size_hint_bytes=2 * 2**20)
    assert path.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["weights.pt"]
    write_atomically(path, lambda tmp: tmp.write_bytes(b"new"))
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["weights.pt"]


def test_torch_save_on_a_full_disk_is_the_same_one_message(tmp_path, monkeypatch):
    """torch.save reports a failed write as a RuntimeError ("unexpected pos ..."), not as ENOSPC: on a disk with
    under FULL_DISK_BYTES free it is the full-disk message, the partial file removed; elsewhere it stays itself."""
    from zplan import safe_files

    path = tmp_path / "weights.pt"
    path.write_bytes(b"previous")

    def torch_save_cut_short(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 220800 vs 220752")

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(safe_files.shutil, "disk_usage", lambda folder: usage._replace(free=4096))
    with pytest.raises(OutputError, match=r"disk is full \(4 KiB free, 3\.0 MiB needed\).*unchanged"):
        write_atomically(path, torch_save_cut_short, size_hint_bytes=3 * 2**20)
    assert path.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["weights.pt"]
    monkeypatch.setattr(safe_files.shutil, "disk_usage", lambda folder: usage._replace(free=1 << 40))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # not a full disk: torch's own error
        write_atomically(path, torch_save_cut_short)
    assert [p.name for p in tmp_path.iterdir()] == ["weights.pt"]


def test_train_py_stops_before_training_when_it_cannot_save_the_weights(tmp_path):
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.schemas import Pins

    tiny = Path(zplan.examples.__file__).parent / "tiny.py"
    out = tmp_path / "out"
    write_outputs(compile_plan(prepare(str(tiny), 1, "cpu-local", 8, 32, "fp32", Pins())), out, str(tiny))
    (tmp_path / "a-file").write_text("x")
    run = subprocess.run([sys.executable, str(out / "train.py"), "--steps", "2", "--save-weights",
                          str(tmp_path / "a-file" / "w.pt")], capture_output=True, text=True, timeout=300,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--save-weights" in run.stderr and "trained" not in run.stdout
