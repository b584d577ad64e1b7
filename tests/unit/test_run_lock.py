"""Two writers in one checkpoint folder: the run lock (runtime/checkpoint/run_lock.py) refuses a second run
naming the first one's pid and host, goes with its process however it ends, and workers die with their launcher
(runtime.launch.distributed.die_with_launcher, prctl PR_SET_PDEATHSIG), although torchrun starts them in sessions of
their own."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from zplan.errors import RunLockError
from zplan.runtime.checkpoint.run_lock import LOCK_FILE, lock_checkpoint_dir, try_lock
from zplan.runtime.launch.distributed import RunContext

ONE_PROCESS = RunContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
ROOT = Path(__file__).resolve().parents[2]


def test_a_second_run_on_a_locked_folder_is_refused_naming_the_first(tmp_path):
    first = lock_checkpoint_dir(tmp_path / "ckpt", ONE_PROCESS)
    assert first.held and (tmp_path / "ckpt" / LOCK_FILE).is_file()
    with pytest.raises(RunLockError) as refused:
        lock_checkpoint_dir(tmp_path / "ckpt", ONE_PROCESS)
    message = str(refused.value)
    assert f"--checkpoint-dir {tmp_path / 'ckpt'} is in use" in message
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message and "another --checkpoint-dir" in message
    first.release()
    again = lock_checkpoint_dir(tmp_path / "ckpt", ONE_PROCESS)  # released: the next run takes it
    assert again.held
    again.release()
    assert not lock_checkpoint_dir(None, ONE_PROCESS).held  # no checkpoint folder, no lock


HOLDER = textwrap.dedent("""
    import sys, time
    from zplan.runtime.checkpoint.run_lock import try_lock
    lock, problem = try_lock(sys.argv[1])
    print("held" if lock else problem, flush=True)
    time.sleep(120)
""")


def test_the_lock_goes_with_its_process_even_on_sigkill(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock, problem = try_lock(tmp_path)
        assert lock is None and f"pid {holder.pid} on host" in problem
    finally:
        holder.kill()
        holder.wait()
    lock, problem = try_lock(tmp_path)  # the lock file is still there; the lock is not
    assert problem is None and lock.held
    lock.release()


# A launcher (as torchrun: its worker in a session of its own, with torchrun's variables), and a worker that
# initializes the runtime's process setup (a world of one) and then waits.
WORKER = textwrap.dedent("""
    import time
    from zplan.runtime.launch.distributed import init_distributed
    init_distributed()
    print("ready", flush=True)
    time.sleep(120)
""")
LAUNCHER = textwrap.dedent("""
    import os, socket, subprocess, sys, time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="test", CUDA_VISIBLE_DEVICES="")
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, start_new_session=True)
    print(worker.pid, flush=True)
    time.sleep(120)
""")


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie nobody reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_worker_dies_with_its_launcher(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER], stdout=subprocess.PIPE, text=True,
                                cwd=tmp_path)
    worker_pid = None
    try:
        worker_pid = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "ready"  # the worker's process setup is done
        assert alive(worker_pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 60
        while alive(worker_pid):  # it would sleep on for two minutes without its parent-death signal
            assert time.monotonic() < deadline, "the worker outlived its launcher"
            time.sleep(0.05)
    finally:
        launcher.kill()
        if worker_pid is not None and alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def test_a_link_or_a_fifo_in_place_of_the_lock_file_is_refused_and_nothing_is_written_through_it(tmp_path):
    """A link planted as the lock file would have the lock's pid line written into the file it points to."""
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / LOCK_FILE).symlink_to("../precious.txt")
    with pytest.raises(RunLockError, match="is a symbolic link"):
        lock_checkpoint_dir(tmp_path / "ckpt", ONE_PROCESS)
    assert precious.read_text() == "keep me\n"
    (tmp_path / "ckpt" / LOCK_FILE).unlink()
    os.mkfifo(tmp_path / "ckpt" / LOCK_FILE)  # opened without blocking, refused by kind
    with pytest.raises(RunLockError, match="is a FIFO, not a regular file"):
        lock_checkpoint_dir(tmp_path / "ckpt", ONE_PROCESS)
