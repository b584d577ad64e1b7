"""The NVMe swapping engine (runtime/offload/nvme.py): bit-exact round trips, integrity errors that name the tensor
and the file, cleanup of run folders (close, exit, SIGTERM, stale folders of dead processes), disk space."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from zplan.errors import SwapError, ZplanError
from zplan.runtime.offload import nvme
from zplan.runtime.offload.nvme import ALIGN_BYTES, SwapEngine, aligned_tensor, check_space, remove_stale_folders

ROOT = Path(__file__).resolve().parents[2]
SMALL_CHUNK = 2 * ALIGN_BYTES  # many chunks per tensor, odd tails


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN-safe, dtype-independent comparison)."""
    return t.contiguous().reshape(-1).view(torch.uint8).clone()


def _samples() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(5000, 3, generator=g),  # 60000 bytes: not a multiple of 4096
        "bf16": torch.randn(7, 129, generator=g).to(torch.bfloat16),
        "fp16.odd": torch.randn(4097, generator=g).to(torch.float16),
        "fp64": torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
        "int64": torch.randint(-(2**62), 2**62, (1001,), generator=g),
        "uint8.block+1": torch.randint(0, 256, (ALIGN_BYTES + 1,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(333, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0),
        "empty.2d": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "exact.blocks": torch.randn(4 * ALIGN_BYTES // 4, generator=g),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        "non.contiguous": torch.randn(64, 33, generator=g).t(),
        "weird/name with spaces:é": torch.arange(10),
    }


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("chunk_bytes", [SMALL_CHUNK, nvme.DEFAULT_CHUNK_BYTES])
def test_round_trip_bit_exact(tmp_path, direct, chunk_bytes):
    tensors = _samples()
    with SwapEngine(tmp_path, workers=3, chunk_bytes=chunk_bytes, use_direct_io=direct) as swap:
        futures = [swap.swap_out(name, t) for name, t in tensors.items()]
        records = swap.wait(futures)
        assert [r.name for r in records] == list(tensors)
        for name, t in tensors.items():
            back = swap.swap_in(name).result()
            assert back.dtype == t.dtype and back.shape == t.shape, name
            assert torch.equal(_bits(back), _bits(t)), name
            if back.numel():
                assert back.data_ptr() % ALIGN_BYTES == 0  # engine-allocated buffers are aligned
            # into a caller's buffer: aligned, and deliberately misaligned (one element into a larger storage)
            aligned = aligned_tensor(t.shape, t.dtype)
            assert swap.swap_in(name, out=aligned).result() is aligned
            assert torch.equal(_bits(aligned), _bits(t)), name
            storage = torch.empty(t.numel() + 1, dtype=t.dtype)
            shifted = storage[1:].view(t.shape)
            swap.swap_in(name, out=shifted).result()
            assert torch.equal(_bits(shifted), _bits(t)), name


def test_many_concurrent_swaps_and_prefetch(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {f"layer{i}.w": torch.randn(int(torch.randint(1, 20_000, (1,), generator=g)), generator=g)
               for i in range(120)}
    with SwapEngine(tmp_path, workers=6, chunk_bytes=SMALL_CHUNK) as swap:
        for name, t in tensors.items():  # all in flight at once
            swap.swap_out(name, t)
        swap.wait()
        assert set(swap.records()) == set(tensors)
        names = list(tensors)
        prefetched = swap.prefetch(names[:60])
        assert len(prefetched) == 60
        outs = {name: swap.swap_in(name) for name in names}  # the first 60 are the prefetched futures
        assert all(outs[n] is f for n, f in zip(names, prefetched, strict=False))
        for name, fut in outs.items():
            assert torch.equal(fut.result(), tensors[name]), name


def test_same_name_is_ordered_overwritten_and_removed(tmp_path):
    with SwapEngine(tmp_path, chunk_bytes=SMALL_CHUNK) as swap:
        first, second = torch.arange(50_000), torch.arange(50_000) * 2
        swap.swap_out("x", first)
        back = swap.swap_in("x")  # waits for the write in flight
        assert torch.equal(back.result(), first)
        swap.swap_out("x", second)
        assert torch.equal(swap.swap_in("x").result(), second)
        path = swap.path_of("x")
        assert path.exists()
        swap.remove("x")
        assert not path.exists()
        with pytest.raises(SwapError, match="'x' was not swapped out"):
            swap.swap_in("x")


def _swapped(tmp_path, name="model.layers.3.mlp.weight", **kw):
    swap = SwapEngine(tmp_path, chunk_bytes=SMALL_CHUNK, **kw)
    rec = swap.swap_out(name, torch.randn(10_000)).result()
    return swap, rec


def test_corrupted_data_byte_is_an_error_naming_tensor_and_file(tmp_path):
    swap, rec = _swapped(tmp_path)
    with open(rec.path, "r+b") as f:
        f.seek(rec.header_bytes + 12345)
        byte = f.read(1)
        f.seek(rec.header_bytes + 12345)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(SwapError, match="corrupted") as info:
        swap.swap_in(rec.name).result()
    assert rec.name in str(info.value) and str(rec.path) in str(info.value)
    assert isinstance(info.value, ZplanError)
    swap.close()


def test_corrupted_header_is_an_error(tmp_path):
    swap, rec = _swapped(tmp_path)
    with open(rec.path, "r+b") as f:
        f.seek(30)
        byte = f.read(1)
        f.seek(30)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SwapError, match="header") as info:
        swap.swap_in(rec.name).result()
    assert rec.name in str(info.value) and str(rec.path) in str(info.value)
    swap.close()


@pytest.mark.parametrize("direct", [True, False])
def test_truncated_file_is_an_error(tmp_path, direct):
    swap, rec = _swapped(tmp_path, use_direct_io=direct)
    os.truncate(rec.path, rec.header_bytes + rec.nbytes // 2)
    with pytest.raises(SwapError, match="truncated") as info:
        swap.swap_in(rec.name).result()
    assert rec.name in str(info.value) and str(rec.path) in str(info.value)
    swap.close()


def test_missing_file_is_an_error(tmp_path):
    swap, rec = _swapped(tmp_path)
    rec.path.unlink()
    with pytest.raises(SwapError) as info:
        swap.wait(swap.swap_in(rec.name))
    assert rec.name in str(info.value) and str(rec.path) in str(info.value)
    swap.close()


def test_wrong_out_buffer_is_refused(tmp_path):
    swap, rec = _swapped(tmp_path)
    with pytest.raises(SwapError, match="out must be"):
        swap.swap_in(rec.name, out=torch.empty(10_000, dtype=torch.float64))
    swap.close()


def test_disk_full_during_a_write_is_a_clear_error(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with SwapEngine(tmp_path) as swap:
        monkeypatch.setattr(nvme, "_pwrite_all", full)
        with pytest.raises(SwapError, match="disk is full") as info:
            swap.swap_out("opt.state", torch.ones(100)).result()
        assert "'opt.state'" in str(info.value)
        with pytest.raises(SwapError, match="swap-out failed"):
            swap.swap_in("opt.state")


def test_close_removes_the_run_folder_and_refuses_more_work(tmp_path):
    swap, rec = _swapped(tmp_path)
    assert rec.path.exists() and swap.run_folder.parent == tmp_path
    swap.close()
    assert not swap.run_folder.exists()
    swap.close()  # idempotent
    with pytest.raises(SwapError, match="closed"):
        swap.swap_out("y", torch.ones(1))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_folders_of_dead_processes_are_removed_at_start(tmp_path):
    host = nvme._host_tag()
    dead = tmp_path / f"zplan-swap-{host}-{_dead_pid()}-1"
    live = tmp_path / f"zplan-swap-{host}-{os.getppid()}-1"  # our parent is alive
    other_host = tmp_path / f"zplan-swap-{host}x-{_dead_pid()}-1"  # a pid of another machine means nothing here
    ours_orphan = tmp_path / f"zplan-swap-{host}-{os.getpid()}-999"  # our pid, no engine of ours: a reused pid
    unrelated = tmp_path / "checkpoints"
    for folder in (dead, live, other_host, ours_orphan, unrelated):
        folder.mkdir()
        (folder / "t.swp").write_bytes(b"x" * 100)
    swap = SwapEngine(tmp_path)
    assert sorted(swap.removed_stale) == sorted([dead, ours_orphan])
    assert not dead.exists() and not ours_orphan.exists()
    assert live.exists() and other_host.exists() and unrelated.exists()
    assert remove_stale_folders(tmp_path) == []  # the engine's own folder is kept while it lives
    assert swap.run_folder.exists()
    swap.close()


CHILD = textwrap.dedent("""
    import signal, sys, time, types
    # Import only the engine: zplan.runtime's __init__ imports the whole runtime (seconds on this machine).
    runtime = types.ModuleType("zplan.runtime")
    runtime.__path__ = [sys.argv[3] + "/runtime"]
    sys.modules["zplan.runtime"] = runtime
    import torch
    from zplan.runtime.offload import SwapEngine
    mode = sys.argv[2]
    if mode == "chained":
        def handler(signum, frame):
            open(sys.argv[1] + "/handler-ran", "w").close()
            sys.exit(3)
        signal.signal(signal.SIGTERM, handler)
    swap = SwapEngine(sys.argv[1])
    swap.swap_out("w", torch.randn(100_000)).result()
    print(swap.run_folder, flush=True)
    if mode == "exit":
        sys.exit(0)  # no close(): atexit cleans up
    time.sleep(60)
""")


@pytest.mark.slow
def test_sigterm_and_exit_remove_the_swap_folder(tmp_path):
    """Three child processes at once: SIGTERM with the default handler (the process dies of it), SIGTERM with a
    handler of the program's own (it still runs), and a normal exit without close() (atexit)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    modes = {"default": -signal.SIGTERM, "chained": 3, "exit": 0}
    children = {mode: subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / mode), mode, str(ROOT)],
                                       stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT) for mode in modes}
    try:
        for mode, child in children.items():
            run_folder = Path(child.stdout.readline().strip())
            assert run_folder.parent == tmp_path / mode
            if mode != "exit":
                assert any(run_folder.glob("*.swp"))
                child.send_signal(signal.SIGTERM)
            assert child.wait(timeout=60) == modes[mode], mode
            assert not run_folder.exists(), mode
    finally:
        for child in children.values():
            child.kill()
            child.stdout.close()
    assert (tmp_path / "chained" / "handler-ran").exists()  # the program's own handler still ran


def test_check_space_names_both_numbers(tmp_path):
    free = check_space(tmp_path, 1)
    assert free > 0
    needed = 10 * 2**60
    with pytest.raises(SwapError) as info:
        check_space(tmp_path / "not" / "yet", needed)
    message = str(info.value)
    assert str(needed) in message and "bytes" in message and "free" in message and "--nvme-path" in message
    free_in_message = int(message.split(" has ")[1].split(" bytes")[0])
    assert abs(free_in_message - free) < 2**30


def _fs_takes_o_direct(folder: Path) -> bool:
    try:
        nvme._probe_o_direct(folder / "probe")
    except OSError:
        return False
    return True


def test_direct_io_on_and_forced_off(tmp_path):
    with SwapEngine(tmp_path, use_direct_io=False) as off:
        assert not off.direct_io and "use_direct_io=False" in off.io_note
    if not _fs_takes_o_direct(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    with SwapEngine(tmp_path) as on:
        assert on.direct_io and on.io_note == "O_DIRECT"
        t = torch.randn(3000)
        on.swap_out("t", t).result()
        # O_DIRECT writes whole blocks: the data region is padded to a multiple of 4096
        rec = on.records()["t"]
        assert os.path.getsize(rec.path) == rec.header_bytes + nvme.round_up(rec.nbytes)
        assert torch.equal(on.swap_in("t").result(), t)


def test_einval_from_o_direct_falls_back_to_buffered_io(tmp_path, monkeypatch, caplog):
    def refuse(path):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(nvme, "_probe_o_direct", refuse)
    with caplog.at_level("WARNING", logger=nvme.__name__), SwapEngine(tmp_path) as swap:
        assert not swap.direct_io
        assert "O_DIRECT refused" in swap.io_note and "buffered" in swap.io_note
        t = torch.randn(3000, dtype=torch.float64)
        rec = swap.swap_out("t", t).result()
        assert os.path.getsize(rec.path) == rec.header_bytes + rec.nbytes  # buffered: no block padding
        assert torch.equal(swap.swap_in("t").result(), t)
    assert "O_DIRECT refused" in caplog.text


def test_other_probe_errors_are_a_clear_error(tmp_path, monkeypatch):
    def denied(path):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(nvme, "_probe_o_direct", denied)
    with pytest.raises(SwapError, match="cannot write to the swap folder"):
        SwapEngine(tmp_path)
