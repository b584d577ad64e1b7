"""Hostile values on every command line zplan reads (docs/reliability.md): the emitted train.py's flags, generate.py's
and serve.py's, and the zplan command's. A value out of its range is one message naming the option, the value and
what it accepts, exit status 2, no traceback, before any work and with nothing written; a value that was taken with
another meaning than it says (an empty path read as "not given" or as the current folder, a seed that draws another
seed's numbers, a learning rate of NaN) is refused the same way. tests/unit/test_bad_inputs.py has the zplan command's
sizes and files; this file the values it did not cover.

train.py's values are checked when its arguments are parsed: its parser runs here in-process (exit status 2 is
argparse's SystemExit from runtime.launch.torchrun.ArgumentParser), and three cases run the real process, two through
launch/torchrun.sh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

import zplan.examples
from tests.distributed.harness import import_file
from zplan.cli import app
from zplan.runtime.training.main import parse_script_arguments, script_of

TINY = Path(zplan.examples.__file__).parent / "tiny.py"
FAR = "1" + "0" * 30  # 10^30: past every bound, and past int64 (numpy and torch overflow on it)
runner = CliRunner()


def listing(folder: Path) -> list[str]:
    """Every path under `folder`, relative, sorted: what a case may not change."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def one_clean_message(text: str, *needles: str) -> str:
    """The message, whitespace as one space, after asserting it is one line of text, no traceback, with `needles`."""
    assert "Traceback" not in text, text
    assert len(text.strip().splitlines()) == 1, text
    flat = " ".join(text.split())
    for needle in needles:
        assert " ".join(needle.split()) in flat, flat
    return flat


# ---- train.py: its arguments, parsed in this process ----------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """examples/tiny.py compiled for one CPU process (train.py, plan.json, launch/)."""
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.schemas import Pins

    out = tmp_path_factory.mktemp("hostile") / "tiny"
    write_outputs(compile_plan(prepare(str(TINY), 1, "cpu-local", 8, 32, "fp32", Pins())), out, str(TINY))
    return out


@pytest.fixture(scope="module")
def train_py(compiled):
    return import_file(compiled / "train.py", "hostile_values_train")


def parse_train_args(train_py, args, monkeypatch, capsys):
    """train.py's parser on `args` (run as `python train.py ARGS`, no launcher): (exit status or None, stderr)."""
    monkeypatch.delenv("ZPLAN_LAUNCHER", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    capsys.readouterr()
    try:
        parse_script_arguments(script_of(train_py))
    except SystemExit as stop:
        return stop.code, capsys.readouterr().err
    return None, capsys.readouterr().err


RANGE = {"--steps": "from 1 to 1,000,000,000", "--seed": "from 0 to 4,294,967,295", "--keep": "from 1 to 1,000,000,000",
         "--warmup-steps": "from 0 to 1,000,000,000", "--checkpoint-every": "from 0 to 1,000,000,000",
         "--onebit-warmup-steps": "from 1 to 1,000,000,000"}


def whole_number(option: str, value: str) -> tuple[list[str], list[str]]:
    return [option, value], [f"argument {option}: must be a whole number {RANGE[option]} (got {value!r})"]


def learning_rate(value: str) -> tuple[list[str], list[str]]:
    return ["--lr", value], [f"argument --lr: must be a number more than 0 and at most 1 (got {value!r})"]


def empty(option: str) -> tuple[list[str], list[str]]:
    return [option, ""], [f"argument {option}: must be a path, not an empty string (got '')"]


TRAIN_REFUSED = [
    whole_number("--steps", "0"),
    whole_number("--steps", "-1"),
    whole_number("--steps", "1e3"),
    whole_number("--steps", ""),
    whole_number("--steps", str(2**63)),  # was taken: a run without end, past int64
    whole_number("--seed", "-1"),  # torch's generator drew seed 2^32 - 1's numbers
    whole_number("--seed", str(2**32)),  # drew seed 0's weights
    whole_number("--seed", str(2**63)),
    whole_number("--keep", "0"),  # was refused after the model was built
    whole_number("--keep", FAR),
    whole_number("--warmup-steps", "-1"),  # was taken as no warmup
    whole_number("--checkpoint-every", "-1"),  # was refused after the model was built, the folder made
    whole_number("--onebit-warmup-steps", "0"),  # was taken as "the default"
    whole_number("--onebit-warmup-steps", "-5"),
    learning_rate("nan"),  # a traceback from torch's Adam
    learning_rate("inf"),  # trained, then stopped on a NaN loss
    learning_rate("1e999"),
    learning_rate("-1"),
    learning_rate("0"),  # trained 20 steps that changed nothing, exit status 0
    learning_rate("2"),
    learning_rate(""),
    empty("--checkpoint-dir"),  # was taken as no checkpoints: a run that saved nothing
    empty("--log-json"),
    empty("--save-weights"),
    empty("--nvme-path"),
    empty("--model"),  # was taken as MODEL_FILE
    (["--resume", "", "--checkpoint-dir", "ckpt"],  # was taken as no --resume: a fresh start beside the checkpoints
     ["argument --resume: must be a checkpoint path, latest or latest-valid, not an empty string"]),
    (["--steps", "2", "--warmup-steps", "5"],  # the learning rate rose to 2/5 of --lr and stopped
     ["--warmup-steps 5 is more than --steps 2", "give 0 to 2 warm-up steps"]),
    (["--checkpoint-every", "5"], ["--checkpoint-every 5 needs --checkpoint-dir DIR"]),  # saved nothing, exit 0
    (["--keep", "2"], ["--keep 2 needs --checkpoint-dir DIR"]),
    (["--resume"], ["--resume without a checkpoint path needs --checkpoint-dir DIR"]),
    (["--resume", "latest-valid"], ["--resume latest-valid without a checkpoint path needs --checkpoint-dir DIR"]),
]


@pytest.mark.parametrize("args,needles", TRAIN_REFUSED, ids=[" ".join(map(repr, a)) for a, _ in TRAIN_REFUSED])
def test_train_py_refuses_the_value_when_it_parses_its_arguments(train_py, tmp_path, monkeypatch, capsys, args,
                                                                 needles):
    monkeypatch.chdir(tmp_path)  # relative paths land here
    status, err = parse_train_args(train_py, args, monkeypatch, capsys)
    assert status == 2, err
    assert err.startswith("zplan: error: train.py: ") and err.endswith("(see --help)\n"), err
    one_clean_message(err, *needles)
    assert listing(tmp_path) == []


TRAIN_ACCEPTED = [
    ["--steps", "2", "--warmup-steps", "0", "--lr", "1", "--seed", str(2**32 - 1)],
    ["--steps", "2", "--warmup-steps", "2", "--lr", "1e-6", "--seed", "0", "--onebit-warmup-steps", "7"],
    ["--checkpoint-dir", "ckpt", "--checkpoint-every", "1", "--keep", "1", "--resume"],
    ["--checkpoint-dir", "ckpt", "--resume", "latest-valid", "--checkpoint-every", "0"],
    ["--resume", "ckpt/step-000004", "--allow-unverified"],  # a checkpoint path needs no --checkpoint-dir
]


@pytest.mark.parametrize("args", TRAIN_ACCEPTED, ids=[" ".join(a) for a in TRAIN_ACCEPTED])
def test_train_py_takes_the_values_at_the_ends_of_their_ranges(train_py, tmp_path, monkeypatch, capsys, args):
    monkeypatch.chdir(tmp_path)
    status, err = parse_train_args(train_py, args, monkeypatch, capsys)
    assert status is None and err == ""
    assert listing(tmp_path) == []


@pytest.mark.parametrize("option", ["log_json", "save_weights"])
def test_an_output_that_is_a_fifo_is_refused_before_training(tmp_path, option):
    """A FIFO as --log-json blocked the run at its first log line until something read it, for ever; now every rank
    refuses it before the first step, as a folder in its place."""
    from zplan.errors import OutputError
    from zplan.runtime.training.outputs import check_output_paths

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), is_main=True)
    flag = "--" + option.replace("_", "-")
    with pytest.raises(OutputError) as refused:
        check_output_paths(one, **{option: fifo})
    one_clean_message(str(refused.value), f"cannot write {flag} {fifo}: {fifo} is a FIFO, not a regular file",
                      "nothing was trained")
    assert listing(tmp_path) == ["fifo"]


def run_process(argv: list[str], cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`argv` in a session of its own, all of it killed when it runs past `timeout_s` (returncode None then)."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable,
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    if "PYTHONPATH" in os.environ:  # the zplan this test imports
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return subprocess.CompletedProcess(argv, None, out, err)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def test_train_py_run_as_a_process_stops_before_making_the_checkpoint_folder(compiled, tmp_path):
    """--checkpoint-every -1 was refused once the model was built, after the checkpoint folder had been made."""
    run = run_process([sys.executable, str(compiled / "train.py"), "--steps", "2", "--checkpoint-dir", "ckpt",
                       "--checkpoint-every", "-1"], cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    one_clean_message(run.stderr, "argument --checkpoint-every: must be a whole number from 0 to 1,000,000,000 "
                                  "(got '-1')")
    assert "trained" not in run.stdout and listing(tmp_path) == []


@pytest.mark.parametrize("args,needle", [
    (["--steps", "2", "--lr", "inf"], "argument --lr: must be a number more than 0 and at most 1 (got 'inf')"),
    (["--steps", "2", "--log-json", "fifo"], "cannot write --log-json fifo: fifo is a FIFO, not a regular file"),
], ids=["lr-inf", "log-json-fifo"])
def test_through_the_launcher_the_message_is_printed_once(compiled, tmp_path, args, needle):
    """launch/torchrun.sh: --lr inf trained until its loss was NaN; a FIFO as --log-json hung the run."""
    os.mkfifo(tmp_path / "fifo")
    run = run_process(["bash", str(compiled / "launch" / "torchrun.sh"), *args], cwd=tmp_path, timeout_s=45)
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert run.stderr.count("zplan: error:") == 1 and needle in " ".join(run.stderr.split()), run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "trained" not in run.stdout
    assert listing(tmp_path) == ["fifo"]


# ---- generate.py and serve.py ------------------------------------------------------------------------------------


SETTINGS = dict(tp=1, weight_precision="fp32", group_size=128, compute_dtype="fp32", weight_tier="gpu",
                prefetch_layers=0, max_batch=2, max_seq_len=64)
GENERATE_REFUSED = [
    (["--temperature", "nan"], "--temperature nan: must be 0 (greedy) to 10"),
    (["--temperature", "1e300"], "--temperature 1e+300: must be 0 (greedy) to 10"),  # was taken (uniform noise)
    (["--temperature", "-1"], "--temperature -1.0: must be 0 (greedy) to 10"),
    (["--top-p", "0"], "--top-p 0.0: must be 0 < top-p <= 1"),
    (["--top-p", "nan"], "--top-p nan: must be 0 < top-p <= 1"),
    (["--seed", "-1"], "--seed -1: must be 0 to 4,294,967,295"),  # was taken: seed 2^32 - 1's numbers
    (["--seed", FAR], f"--seed {FAR}: must be 0 to 4,294,967,295"),  # a traceback from torch.manual_seed
    (["--weights", ""], "--weights '': give a path, not an empty string"),  # "weights file . does not exist"
    (["--model", ""], "--model '': give a path, not an empty string"),  # was taken as MODEL_FILE
    (["--prompts", ""], "--prompts '': give a path, not an empty string"),
    (["--nvme-path", ""], "--nvme-path '': give a path, not an empty string"),
]


SERVE_REFUSED = [
    (["--host", ""], "--host '': give an address to listen on"),  # listened on every interface
    (["--host", "  "], "--host '  ': give an address to listen on"),
    (["--seed", str(2**32)], "--seed 4294967296: must be 0 to 4,294,967,295"),  # seed 0's weights
    (["--weights", ""], "--weights '': give a path, not an empty string"),
]


PROGRAM_REFUSED = [("generate_main", *case) for case in GENERATE_REFUSED] + \
    [("serve_main", *case) for case in SERVE_REFUSED]


@pytest.mark.parametrize("main,args,needle", PROGRAM_REFUSED,
                         ids=[f"{m[:-5]} " + " ".join(map(repr, a)) for m, a, _ in PROGRAM_REFUSED])
def test_generate_and_serve_py_refuse_the_value_before_any_work(tmp_path, monkeypatch, capsys, main, args, needle):
    from zplan.runtime.inference import cli
    from zplan.runtime.inference.build import EngineSettings

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ZPLAN_LAUNCHER", raising=False)
    monkeypatch.setattr("zplan.runtime.launch.distributed.run_distributed", lambda *a, **k: pytest.fail("ran"))
    # the plan is never read: the arguments are checked first
    status = getattr(cli, main)(Path("no-such-plan.json"), None, EngineSettings(**SETTINGS), 8, args)
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("zplan: error: "), err
    one_clean_message(err, needle)
    assert listing(tmp_path) == []


def test_a_host_that_is_not_an_address_here_is_named_as_the_host():
    """The message told to pass another --port or stop the process that holds it."""
    from zplan.runtime.inference.server import ServeError, bind_socket

    with pytest.raises(ServeError) as refused:
        bind_socket("999.1.1.1", 0)
    message = one_clean_message(str(refused.value), "cannot listen on --host 999.1.1.1", "an address of this machine")
    assert "--port" not in message


@pytest.mark.parametrize("content", [b"x", b"\x80\x02c__builtin__\nprint\n."], ids=["text", "pickle-of-code"])
def test_a_weights_file_torch_cannot_load_is_one_line_without_torch_s_advice(tmp_path, content):
    """torch.load's page ended in "Re-running torch.load with weights_only set to False will likely succeed"."""
    from zplan.errors import ZplanError
    from zplan.runtime.inference.build import read_weights_file

    (tmp_path / "w.pt").write_bytes(content)
    with pytest.raises(ZplanError) as refused:
        read_weights_file(tmp_path / "w.pt")
    message = one_clean_message(str(refused.value), f"{tmp_path / 'w.pt'} cannot be read as a torch.save state dict")
    assert "weights_only" not in message and "False" not in message


# ---- the zplan command --------------------------------------------------------------------------------------------


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_refused(result, *needles):
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    one_clean_message(result.output, *needles)


ZPLAN_REFUSED = [
    (["compile", TINY, "--gpus", 1, "--cluster", "cpu-local", "--micro-batch", FAR],  # OverflowError in numpy
     f"micro_batch = {FAR}: Input should be less than or equal to 16777216"),
    (["estimate", TINY, "--gpus", 1, "--cluster", "cpu-local", "--tp", 1, "--pp", 1, "--micro-batch", 2**63],
     f"micro_batch = {2**63}: Input should be less than or equal to 16777216"),
    (["compile", TINY, "--mode", "inference", "--gpus", 1, "--cluster", "cpu-local", "--batch", FAR],  # numpy too
     "--batch must be at least 1 and at most 16,777,216 (got 1,000,000,000,000,000,000,000,000,000,000)"),
    (["compile", TINY, "--gpus", 1, "--cluster", "cpu-local", "-o", ""],  # wrote the plan into the current folder
     "-o '': give a folder, not an empty string"),
    (["probe", "--nvme-path", "", "-o", "p.yaml", "--seconds", 1],  # measured the current folder's disk
     "--nvme-path '': give a folder, not an empty string"),
    (["reduce", TINY, "-o", "r.py", "--keep-layers", "1_0"], "(got '1_0')"),  # read as layer 10
    (["reduce", TINY, "-o", "r.py", "--keep-layers", "\u0661"], "(got '\u0661')"),  # an Arabic-Indic 1: layer 1
    (["reduce", TINY, "-o", "r.py", "--calibration-batches", -1, "--prune-heads", 1],  # a traceback from islice
     "--calibration-batches must be 1 to 10,000 (got -1)"),
    (["reduce", TINY, "-o", "r.py", "--calibration-batches", 10**11, "--prune-heads", 1],  # held every batch: OOM
     "--calibration-batches must be 1 to 10,000 (got 100,000,000,000)"),
    (["reduce", TINY, "-o", "r.py", "--blocks", ""], "--blocks '': give the module path"),  # taken as not given
]


def case_id(args: list) -> str:
    """The command and its options after the model, without the output file: e.g. reduce --blocks ''."""
    return " ".join(repr(a) if a == "" or not str(a).isascii() else str(a)
                    for a in args if a is not TINY and a not in ("-o", "r.py", "p.yaml", "--cluster", "cpu-local"))


@pytest.mark.parametrize("args,needle", ZPLAN_REFUSED, ids=[case_id(a) for a, _ in ZPLAN_REFUSED])
def test_zplan_refuses_the_value_before_any_work(tmp_path, monkeypatch, args, needle):
    def no_work(*args, **kwargs):
        raise AssertionError("measured or reduced with a bad value")

    monkeypatch.setattr("zplan.probe.probe_this_machine", no_work)
    monkeypatch.setattr("zplan.model_reduction.write_reduced_model_file", no_work)
    monkeypatch.chdir(tmp_path)
    assert_refused(invoke(*args), needle)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("value", ["none", " None "])
def test_compress_none_is_taken_as_the_help_and_the_report_say(tmp_path, monkeypatch, value):
    """`--compress none` was refused ("takes key=value pairs") though the help allows 'none' and the plan's own
    compression reads 'none' when nothing is compressed."""
    monkeypatch.chdir(tmp_path)
    result = invoke("compile", TINY, "--gpus", 1, "--cluster", "cpu-local", "--compress", value, "-o", "out", "--json")
    assert result.exit_code == 0, result.output
    assert listing(tmp_path)[0] == "out" and all(p.startswith("out") for p in listing(tmp_path))
