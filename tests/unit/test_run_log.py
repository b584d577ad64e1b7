"""What a run shows of itself (runtime/training/run_log.py): TensorBoard scalars equal to the JSON-lines log, a clear
message when tensorboard is not installed, the progress bar only on a terminal (a line per step elsewhere) with its
steps/s and ETA over the run's steps whatever their duration."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import zplan.examples
from zplan.api import compile_plan, prepare, write_outputs
from zplan.errors import OutputError
from zplan.runtime.launch.distributed import RunContext
from zplan.runtime.training.outputs import check_output_paths
from zplan.runtime.training.run_log import (
    StepProgress,
    TensorBoardMissingError,
    eta,
    open_log,
    step_rate,
    tensorboard_writer_class,
)
from zplan.schemas import Pins

ONE = RunContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
ENV = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}


@pytest.fixture(scope="module")
def tiny_out(tmp_path_factory) -> Path:
    """The tiny example compiled for one CPU process."""
    tiny = Path(zplan.examples.__file__).parent / "tiny.py"
    out = tmp_path_factory.mktemp("tiny") / "out"
    write_outputs(compile_plan(prepare(str(tiny), 1, "cpu-local", 8, 32, "fp32", Pins())), out, str(tiny))
    return out


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every event file in `folder`, read back by TensorBoard's own reader."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_scalars_are_the_json_logs_numbers(tiny_out, tmp_path):
    board, log = tmp_path / "board" / "run1", tmp_path / "log.jsonl"
    run = subprocess.run([sys.executable, str(tiny_out / "train.py"), "--steps", "3", "--log-json", str(log),
                          "--tensorboard", str(board)], capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    scalars = _scalars(board)
    # event files hold float32: each value is the JSON log's, rounded to float32
    for field, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                       ("tokens_per_s", "perf/tokens_per_s"), ("model_state_bytes", "memory/model_state_bytes")):
        assert scalars[tag] == [(r["step"], float(np.float32(r[field]))) for r in records], tag
    assert [step for step, _ in scalars["memory/device_bytes"]] == [1, 2, 3]
    assert not any(tag.startswith("val/") for tag in scalars)  # no validation in this run: no val scalars
    # stdout is a pipe: no bar, one plain line per step, each with the step's loss
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], run.stdout
    assert all(f"loss {r['loss']:.4f}" in line for r, line in zip(records, lines, strict=True))
    assert "━" not in run.stdout and "ETA" in lines[-1]


def test_a_missing_tensorboard_is_one_message_with_exit_status_2(tiny_out, tmp_path):
    """torch.utils.tensorboard cannot be imported: train.py stops before any collective (nothing trained, nothing
    written), naming the install."""
    run_train_py = ("import runpy, sys; sys.modules['torch.utils.tensorboard'] = None; "  # import fails
                    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", run_train_py, str(tiny_out / "train.py"), "--steps", "2",
                          "--tensorboard", str(tmp_path / "board")], capture_output=True, text=True, timeout=300,
                         env=ENV)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-3000:]
    assert "pip install tensorboard" in run.stderr and "Traceback" not in run.stderr
    assert "trained" not in run.stdout and not (tmp_path / "board").exists()


def test_the_missing_package_error_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(TensorBoardMissingError, match=r"--tensorboard needs .*pip install tensorboard"):
        tensorboard_writer_class()


def _record(step: int) -> dict:
    return {"step": step, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "mfu": 0.01}


def test_no_bar_when_stdout_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a pipe or a file: isatty() is False
    with StepProgress(ONE, steps=4, steps_done=0) as progress:
        assert progress.bar.disable and progress.lines
        progress.show(_record(1))
    assert sys.stdout.getvalue().startswith("step 1/4  loss 2.5000")
    other = RunContext(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"), backend="gloo")
    assert StepProgress(other, steps=4, steps_done=0).bar.disable and not StepProgress(other, 4, 0).lines


def test_the_bar_is_on_for_a_terminal_and_its_eta_holds_for_slow_steps(monkeypatch):
    """A terminal: the bar, no plain lines. Steps of 40 s each (longer than rich's default 30 s window, which gave no
    estimate): the rate is 40 s/step and the ETA the steps left times that, the first step's one-off work left out."""
    terminal = io.StringIO()
    terminal.isatty = lambda: True
    monkeypatch.setattr(sys, "stdout", terminal)
    progress = StepProgress(ONE, steps=10, steps_done=2, terminal=None)  # a resumed run: 2 steps done before
    assert not progress.bar.disable and not progress.lines
    now = [0.0]
    progress.bar.get_time = lambda: now[0]
    for step, seconds in ((3, 100.0), (4, 40.0), (5, 40.0)):  # step 3 slow (allocations, lazy init)
        now[0] += seconds
        progress.show(_record(step))
    task = progress.bar.tasks[0]
    assert step_rate(task.speed) == "40.0 s/step" and task.time_remaining == 5 * 40
    assert eta(task.time_remaining) == "0:03:20" and eta(None) == "-:--:--" and eta(90061) == "1d 1:01:01"
    assert step_rate(2.5) == "2.50 steps/s" and step_rate(None) == ""


def test_a_resumed_run_replaces_the_steps_after_its_checkpoint_in_both_logs(tmp_path):
    """The first run logged steps 1-4 and was resumed from its step-2 checkpoint: steps 3 and 4 are the resumed
    run's, once each, in the JSON lines and in what TensorBoard reads (purge_step)."""
    board, log = tmp_path / "board", tmp_path / "log.jsonl"
    for steps_done, losses in ((0, [4.0, 3.0, 2.0, 1.0]), (2, [2.5, 1.5])):
        step_log = open_log(log, ONE, steps_done, board)
        for step, loss in enumerate(losses, start=steps_done + 1):
            validated = {"val_loss": 1.75, "val_ppl": 5.75} if step == 4 else {}  # a validation step's fields
            step_log.write(_record(step) | {"loss": loss} | validated)
        step_log.close()
    assert [(r["step"], r["loss"]) for r in map(json.loads, log.read_text().splitlines())] == \
        [(1, 4.0), (2, 3.0), (3, 2.5), (4, 1.5)]
    scalars = _scalars(board)
    assert scalars["train/loss"] == [(1, 4.0), (2, 3.0), (3, 2.5), (4, 1.5)]
    assert scalars["val/loss"] == [(4, 1.75)] and scalars["val/ppl"] == [(4, 5.75)]
    assert open_log(None, ONE, 0, None) is None  # neither asked for: no log


def test_the_tensorboard_folder_is_checked_with_the_other_outputs(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(OutputError, match=r"--tensorboard .*a-file/board: .*nothing was trained"):
        check_output_paths(ONE, tensorboard=tmp_path / "a-file" / "board")
    with pytest.raises(OutputError, match=r"--tensorboard .*a-file: .*"):  # a file where the folder should be
        check_output_paths(ONE, tensorboard=tmp_path / "a-file")
    check_output_paths(ONE, tensorboard=tmp_path / "board")
    assert (tmp_path / "board").is_dir() and not list((tmp_path / "board").iterdir())


def test_the_summary_says_when_the_profile_is_slower_than_this_machine(capsys):
    """An MFU above 100 % (model FLOPs over the profile's peak) means the profile's peak is not this machine's
    (cpu-local measured bf16 on a CPU without AMX): the summary says so and how to measure one; at or below 100 % it
    does not."""
    from zplan.runtime.training.run_log import PlanFigures, print_summary

    figures = PlanFigures(step_time_s=0.5, mfu=0.5, model_flops_per_step=4e9, peak_flops=1e9)
    print_summary([2.0, 1.5, 1.0], [1.0, 1.0, 1.0], {"gpu": 2**20}, figures, ONE)  # 4e9 / (1 s x 1e9): 400 %
    out = capsys.readouterr().out
    assert "MFU 400.00% vs 50.00%" in out and "zplan probe" in out and "(0.001 TFLOP/s a device)" in out
    print_summary([2.0], [4.0, 4.0], {"gpu": 2**20}, figures, ONE)  # 100 %
    assert "zplan probe" not in capsys.readouterr().out
