"""NVMe swapping engine against raw sequential I/O on the same path, in the same run.

    .venv/bin/python benchmarks/nvme_swap.py [--json] [--path P] [--size-mib 1024] [--tensor-mib 64]
                                             [--workers 4] [--chunk-mib 64] [--rounds 2]

Raw baselines, the device's sequential rate without the engine: (1) one thread writes a `--size-mib` file
in `--tensor-mib` requests with O_DIRECT and fsyncs it, then reads it back the same way (what
`dd bs=64M oflag=direct` / `iflag=direct` measure); (2) the same with `--workers` threads and
`--chunk-mib` requests, the engine's I/O pattern without its bookkeeping (a virtual or NVMe disk is often
faster with several requests in flight). The baseline "raw" is the faster of the two. The engine
(runtime/offload/nvme.py) then swaps the same bytes out as `--size-mib / --tensor-mib` tensors in aligned
buffers (all in flight at once, as a training step hands it a layer's states) and fsyncs its files, and
swaps them back in into the same buffers. Its times include what the raw loops do not: splitting into
chunks, the XXH3-64 hash of every chunk, the header writes. Each phase runs `--rounds` times, alternating raw
and engine; the best time of each counts.

Page cache. Dropping the machine's whole page cache (`/proc/sys/vm/drop_caches`) needs root and disturbs
every other process on the machine, and a file larger than RAM is impractical; so every read here
bypasses the cache: O_DIRECT where the file system takes it, and otherwise (tmpfs, overlayfs: buffered
I/O) each file's pages are dropped with posix_fadvise(DONTNEED) before it is read (this works for clean
pages, so writes are fsync'ed first). The output says which. Reads served from memory would inflate the
engine's rate; with O_DIRECT that cannot happen. A virtual disk may still cache in its host (reads of
data written a moment ago): compare the raw rates with the hardware's data sheet.

Prints a table, then with --json one JSON object: raw_write_Bps, raw_read_Bps (the better baseline; each
also as raw_1stream_* and raw_parallel_*), engine_write_Bps,
engine_read_Bps, write_fraction_of_raw, read_fraction_of_raw (target >= 0.8 each), io_mode, load_average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zplan.runtime.offload.nvme import SwapEngine, aligned_empty, check_space  # noqa: E402

MiB = 2**20


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write_read_s(folder: Path, size_bytes: int, block_bytes: int, direct: bool,
                     threads: int = 1) -> tuple[float, float]:
    """(write, read) seconds of sequential `block_bytes` requests over one file, the write fsync'ed; with
    `threads` > 1, that many requests in flight (each thread has its own buffer)."""
    path = folder / "raw.bin"
    blocks = [aligned_empty(block_bytes) for _ in range(threads)]
    for block in blocks:
        block.copy_(torch.randint(0, 256, (block_bytes,), dtype=torch.uint8))
    views = [memoryview(block.numpy()) for block in blocks]
    offsets = range(0, size_bytes, block_bytes)
    flags = os.O_DIRECT if direct else 0

    def run(op) -> None:
        if threads == 1:
            for offset in offsets:
                op(views[0], offset)
            return
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda k: [op(views[k], o) for o in offsets[k::threads]], range(threads)))

    def read(view, offset) -> None:
        if os.preadv(fd, [view], offset) != block_bytes:
            raise RuntimeError("short read")

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
    start = time.perf_counter()
    run(lambda view, offset: os.pwrite(fd, view, offset))
    os.fsync(fd)
    write_s = time.perf_counter() - start
    os.close(fd)
    if not direct:
        _drop_cache(path)
    fd = os.open(path, os.O_RDONLY | flags)
    start = time.perf_counter()
    run(read)
    read_s = time.perf_counter() - start
    os.close(fd)
    path.unlink()
    return write_s, read_s


def engine_write_read_s(engine: SwapEngine, buffers: list[torch.Tensor]) -> tuple[float, float]:
    """(write, read) seconds of swapping `buffers` out (then fsync'ed, like the raw write) and back in."""
    names = [f"layer{i}.states" for i in range(len(buffers))]
    start = time.perf_counter()
    engine.wait([engine.swap_out(name, buf) for name, buf in zip(names, buffers, strict=True)])
    for name in names:
        _fsync(engine.path_of(name))
    write_s = time.perf_counter() - start
    if not engine.direct_io:
        for name in names:
            _drop_cache(engine.path_of(name))
    start = time.perf_counter()
    engine.wait([engine.swap_in(name, out=buf) for name, buf in zip(names, buffers, strict=True)])
    read_s = time.perf_counter() - start
    for name in names:
        engine.remove(name)
    return write_s, read_s


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object after the table")
    parser.add_argument("--path", default=tempfile.gettempdir(), help="folder to swap to (the future --nvme-path)")
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes moved each way (lowered to fit)")
    parser.add_argument("--tensor-mib", type=int, default=64, help="size of each swapped tensor")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    folder = Path(args.path)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    size_mib = min(args.size_mib, free // 4 // MiB)  # raw file + swap files, with room to spare
    size_mib -= size_mib % args.tensor_mib
    if size_mib < args.tensor_mib:
        raise SystemExit(f"{folder} has {free} bytes free: too little for one {args.tensor_mib} MiB tensor")
    size_bytes, tensor_bytes = size_mib * MiB, args.tensor_mib * MiB
    check_space(folder, 2 * size_bytes)

    chunk_bytes = args.chunk_mib * MiB
    with SwapEngine(folder, workers=args.workers, chunk_bytes=chunk_bytes) as engine:
        pattern = torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8)
        buffers = []
        for _ in range(size_bytes // tensor_bytes):
            buf = aligned_empty(tensor_bytes)
            buf.copy_(pattern)
            buffers.append(buf)
        raw_w, raw_r, par_w, par_r, eng_w, eng_r = [], [], [], [], [], []
        for _ in range(args.rounds):
            w, r = raw_write_read_s(engine.run_folder, size_bytes, tensor_bytes, engine.direct_io)
            raw_w.append(w)
            raw_r.append(r)
            w, r = raw_write_read_s(engine.run_folder, size_bytes, chunk_bytes, engine.direct_io, args.workers)
            par_w.append(w)
            par_r.append(r)
            w, r = engine_write_read_s(engine, buffers)
            eng_w.append(w)
            eng_r.append(r)
        io_mode = engine.io_note
    result = {
        "path": str(folder), "size_bytes": size_bytes, "tensor_bytes": tensor_bytes, "tensors": len(buffers),
        "workers": args.workers, "chunk_bytes": args.chunk_mib * MiB, "rounds": args.rounds,
        "io_mode": io_mode if io_mode == "O_DIRECT" else io_mode + "; reads after posix_fadvise(DONTNEED)",
        "raw_1stream_write_Bps": size_bytes / min(raw_w), "raw_1stream_read_Bps": size_bytes / min(raw_r),
        "raw_parallel_write_Bps": size_bytes / min(par_w), "raw_parallel_read_Bps": size_bytes / min(par_r),
        # the baseline is the better of the two raw patterns: the device's rate, not a weak straw man
        "raw_write_Bps": size_bytes / min(raw_w + par_w), "raw_read_Bps": size_bytes / min(raw_r + par_r),
        "engine_write_Bps": size_bytes / min(eng_w), "engine_read_Bps": size_bytes / min(eng_r),
        "rounds_s": {"raw_1stream_write": raw_w, "raw_1stream_read": raw_r, "raw_parallel_write": par_w,
                     "raw_parallel_read": par_r, "engine_write": eng_w, "engine_read": eng_r},
        "load_average": list(os.getloadavg()),
    }
    result["write_fraction_of_raw"] = result["engine_write_Bps"] / result["raw_write_Bps"]
    result["read_fraction_of_raw"] = result["engine_read_Bps"] / result["raw_read_Bps"]

    print(f"{size_mib} MiB each way on {folder} ({result['io_mode']}); engine: {len(buffers)} tensors of "
          f"{args.tensor_mib} MiB, {args.workers} workers, {args.chunk_mib} MiB requests; best of {args.rounds}")
    print(f"{'':8}{'raw 1 stream':>14}{f'raw {args.workers} streams':>14}{'engine':>10}{'engine/raw':>12}  (GB/s)")
    for way in ("write", "read"):
        print(f"{way:8}{result[f'raw_1stream_{way}_Bps'] / 1e9:>14.3f}{result[f'raw_parallel_{way}_Bps'] / 1e9:>14.3f}"
              f"{result[f'engine_{way}_Bps'] / 1e9:>10.3f}{result[f'{way}_fraction_of_raw']:>12.2f}")
    print("load average (1, 5, 15 min):", " ".join(f"{x:.2f}" for x in result["load_average"]))
    if args.json:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
