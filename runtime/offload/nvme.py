"""ZeRO-Infinity's swapping engine (Rajbhandari et al. 2021, "ZeRO-Infinity", section 6.2): tensors
swapped out to files in a run folder and read back, asynchronously, into aligned buffers.

    with SwapEngine("/nvme/swap") as swap:          # owns /nvme/swap/zplan-swap-<host>-<pid>-<k>/
        swap.swap_out("layer0.m", m).result()        # or keep the future and overlap with compute
        swap.prefetch(["layer0.m", "layer0.v"])      # reads start now, into engine-allocated buffers
        m = swap.swap_in("layer0.m").result()         # bit-exact, checksummed; SwapError otherwise

I/O. A thread pool issues positional reads and writes (`os.preadv` into the destination buffer,
`os.pwrite` from the source; both release the GIL, so the workers keep several requests in flight);
every tensor is split into `chunk_bytes` requests spread over the workers. Files are opened with
O_DIRECT where the file system accepts it (probed once at start: tmpfs and some overlay file systems
refuse it with EINVAL, and the engine falls back to buffered I/O with a logged note, `io_note`), so a
swap neither pollutes nor depends on the page cache. O_DIRECT needs 4096-byte aligned addresses,
offsets and lengths: buffers from `aligned_empty`/`aligned_tensor` (carved from an over-allocated
uint8 tensor) are used as they are; any other tensor, and the tail of one whose storage ends before
the next 4096-byte boundary, goes through a per-worker aligned bounce buffer (one extra memory copy).

The choice of a thread pool over Linux AIO is explained in swap_buffers.py.

Integrity (a checksummed header, then the data) is described in swap_format.py; the run folder's lifetime
(removal on close, at exit, on SIGTERM, and of stale folders) in swap_folders.py.

Usage contract: a tensor passed to `swap_out` and a buffer passed to `swap_in(out=...)` must not be
changed or read until their future is done; calls on one name are ordered (a swap-in of a name whose
swap-out is in flight waits for it); the engine is driven from one thread.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
import re
import shutil
import struct
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path

import torch

from zplan.errors import SwapError
from zplan.runtime.offload.swap_buffers import (
    ALIGN_BYTES,
    _byte_view,
    _bytes_of,
    _in_place_ok,
    _pread_all,
    _probe_o_direct,
    _pwrite_all,
    aligned_empty,
    aligned_tensor,
    round_up,
)
from zplan.runtime.offload.swap_folders import (
    _LIVE_ENGINES,
    FOLDER_PREFIX,
    _host_tag,
    _install_sigterm_handler,
    check_space,
    remove_stale_folders,
)
from zplan.runtime.offload.swap_format import (
    SwapRecord,
    _checksum,
    _dtype_name,
    _header_bytes,
    _pack_header,
    _unpack_header,
)

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 * 2**20  # per request; benchmarks/nvme_swap.py: 16 and 64 MiB read alike here
DEFAULT_WORKERS = 4  # requests in flight (and hashing threads); each allocates a chunk-sized bounce buffer if needed
_COUNTER_LOCK = threading.Lock()
_counter = 0


class _Job:
    """One swap in or out: an fd shared by its chunk tasks; the last task to finish completes `future`."""

    def __init__(self, rec: SwapRecord, fd: int, buf: torch.Tensor, in_place: bool, finish, result=None):
        self.rec, self.fd, self.buf, self.in_place, self.finish = rec, fd, buf, in_place, finish
        self.buf_np = _bytes_of(buf)  # (padded or nbytes,) byte view for the os calls
        self.checksums = list(rec.checksums)
        self.remaining = 0
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.future: Future = Future()
        self.result = result


class SwapEngine:
    """Swap tensors to files under `folder` (see the module docstring). `workers` threads issue the I/O in
    requests of `chunk_bytes` (a multiple of 4096); `use_direct_io=False` forces buffered I/O."""

    def __init__(self, folder: str | os.PathLike, *, workers: int = DEFAULT_WORKERS,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, use_direct_io: bool = True):
        global _counter
        if chunk_bytes <= 0 or chunk_bytes % ALIGN_BYTES:
            raise SwapError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {ALIGN_BYTES}")
        if workers < 1:
            raise SwapError(f"workers={workers} must be at least 1")
        self.folder = Path(folder)
        self.chunk_bytes = chunk_bytes
        self.workers = workers
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SwapError(f"cannot create the swap folder {self.folder}: {e}") from e
        self.removed_stale = remove_stale_folders(self.folder)
        with _COUNTER_LOCK:
            _counter += 1
            k = _counter
        self.run_folder = self.folder / f"{FOLDER_PREFIX}{_host_tag()}-{os.getpid()}-{k}"
        shutil.rmtree(self.run_folder, ignore_errors=True)
        self.run_folder.mkdir()
        self._closed = False
        _LIVE_ENGINES.add(self)
        _install_sigterm_handler()
        self.direct_io, self.io_note = self._probe_direct_io(use_direct_io)
        if use_direct_io and not self.direct_io:
            log.warning("%s", self.io_note)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zplan-swap")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._records: dict[str, SwapRecord] = {}
        self._failed: dict[str, BaseException] = {}
        self._last_op: dict[str, Future] = {}
        self._prefetched: dict[str, Future] = {}
        self._inflight: set[Future] = set()

    # -- set-up ---------------------------------------------------------------------------------------------

    def _open_flags(self) -> int:
        return getattr(os, "O_DIRECT", 0) if self.direct_io else 0

    def _probe_direct_io(self, wanted: bool) -> tuple[bool, str]:
        if not wanted:
            return False, "buffered I/O (use_direct_io=False)"
        if not hasattr(os, "O_DIRECT"):
            return False, "O_DIRECT does not exist on this platform: using buffered I/O (page cache)"
        try:
            _probe_o_direct(self.run_folder / ".probe")
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise SwapError(f"cannot write to the swap folder {self.run_folder}: {e}") from e
            return False, (f"O_DIRECT refused by the file system of {self.folder} ({e.strerror}): using buffered "
                           "I/O, so swapped tensors also pass through the page cache")
        return True, "O_DIRECT"

    # -- public API ---------------------------------------------------------------------------------------

    def path_of(self, name: str) -> Path:
        """The file a tensor named `name` is swapped to (a readable, collision-free file name)."""
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]
        return self.run_folder / f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:10]}.swp"

    def records(self) -> dict[str, SwapRecord]:
        """The tensors currently swapped out (complete writes only)."""
        with self._lock:
            return dict(self._records)

    def check_space(self, needed_bytes: int) -> int:
        return check_space(self.folder, needed_bytes)

    def swap_out(self, name: str, tensor: torch.Tensor) -> Future:
        """Start writing `tensor` (any dtype and shape; CPU; copied first if not contiguous or not on the CPU)
        to its file; the future's result is the SwapRecord. Do not modify `tensor` until it is done."""
        self._check_open()
        self._settle(name)
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")  # synchronous; the training integration will pass pinned, aligned host buffers
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        n_chunks = -(-nbytes // self.chunk_bytes)
        path = self.path_of(name)
        header_bytes = round_up(len(_header_bytes(name, t.dtype, tuple(t.shape), n_chunks)))
        rec = SwapRecord(name, path, t.dtype, tuple(t.shape), nbytes, self.chunk_bytes, header_bytes,
                         (0,) * n_chunks)
        in_place = self.direct_io and _in_place_ok(t, nbytes)
        buf = _byte_view(t, round_up(nbytes) if in_place else nbytes)
        with self._lock:
            self._records.pop(name, None)
            self._failed.pop(name, None)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._open_flags(), 0o600)
        except OSError as e:
            raise SwapError(f"cannot create the swap file {path} for tensor {name!r}: {e}") from e
        job = _Job(rec, fd, buf, in_place, self._finish_write, result=t)
        # an empty tensor has no chunk: one task that writes nothing, so that the header gets written
        tasks = [(self._write_chunk, i) for i in range(n_chunks)] or [(_nothing,)]
        return self._start(job, tasks)

    def swap_in(self, name: str, out: torch.Tensor | None = None) -> Future:
        """Start reading tensor `name` back; the future's result is the tensor: `out` (same dtype and shape,
        contiguous, CPU) or a new aligned one. A missing, truncated or corrupted file fails the future
        with SwapError; a name never swapped out raises SwapError at once."""
        self._check_open()
        prefetched = self._prefetched.pop(name, None)
        if prefetched is not None:
            if out is None:
                return prefetched
            done: Future = Future()
            try:
                done.set_result(out.copy_(prefetched.result()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                done.set_exception(e)
            return done
        self._settle(name)
        with self._lock:
            rec = self._records.get(name)
            failed = self._failed.get(name)
        if rec is None:
            why = f": its swap-out failed ({failed})" if failed else " (or it was removed)"
            raise SwapError(f"tensor {name!r} was not swapped out by this engine{why}")
        if out is None:
            out = aligned_tensor(rec.shape, rec.dtype)
        elif out.dtype != rec.dtype or tuple(out.shape) != rec.shape or not out.is_contiguous() \
                or out.device.type != "cpu":
            raise SwapError(f"swap_in({name!r}): out must be a contiguous CPU tensor of dtype {rec.dtype} and shape "
                            f"{rec.shape}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        in_place = self.direct_io and _in_place_ok(out, rec.nbytes)
        buf = _byte_view(out, round_up(rec.nbytes) if in_place else rec.nbytes)
        try:
            fd = os.open(rec.path, os.O_RDONLY | self._open_flags())
        except OSError as e:
            failed_future: Future = Future()
            failed_future.set_exception(SwapError(f"cannot open the swap file {rec.path} of tensor {name!r}: {e}"))
            return failed_future
        job = _Job(rec, fd, buf, in_place, self._finish_read, result=out)
        return self._start(job, [(self._check_header,)] + [(self._read_chunk, i) for i in range(len(rec.checksums))])

    def prefetch(self, names: Iterable[str]) -> list[Future]:
        """Start swapping in `names` now; a later `swap_in(name)` returns the prefetched future."""
        futures = []
        for name in names:
            if name not in self._prefetched:
                self._prefetched[name] = self.swap_in(name)
            futures.append(self._prefetched[name])
        return futures

    def wait(self, futures: Future | Iterable[Future] | None = None) -> list:
        """Wait for `futures` (default: every operation in flight); return their results, raising the first
        error (SwapError) after all have finished."""
        if futures is None:
            with self._lock:
                futures = list(self._inflight)
        elif isinstance(futures, Future):
            futures = [futures]
        futures = list(futures)
        wait_futures(futures)
        return [f.result() for f in futures]

    def remove(self, name: str) -> None:
        """Forget tensor `name` and delete its file (after any operation on it finishes)."""
        self._check_open()
        prefetched = self._prefetched.pop(name, None)
        if prefetched is not None:
            wait_futures([prefetched])
        self._settle(name)
        with self._lock:
            rec = self._records.pop(name, None)
            self._failed.pop(name, None)
        Path(rec.path if rec else self.path_of(name)).unlink(missing_ok=True)

    def close(self) -> None:
        """Finish what is in flight (errors are dropped), stop the workers, delete the run folder."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            inflight = list(self._inflight)
        wait_futures(inflight)
        self._pool.shutdown(wait=True)
        self._remove_folder()
        _LIVE_ENGINES.discard(self)

    def __enter__(self) -> SwapEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- machinery ------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SwapError(f"the swap engine of {self.run_folder} is closed")

    def _remove_folder(self) -> None:
        shutil.rmtree(self.run_folder, ignore_errors=True)

    def _settle(self, name: str) -> None:
        """Wait for the last operation on `name` (calls on one name are ordered)."""
        last = self._last_op.get(name)
        if last is not None:
            wait_futures([last])

    def _start(self, job: _Job, tasks: list[tuple]) -> Future:
        """Run `tasks` ((fn, *args): fn(job, *args)) on the workers; the last one to end calls job.finish."""
        job.remaining = len(tasks)
        with self._lock:
            self._inflight.add(job.future)
            self._last_op[job.rec.name] = job.future
        job.future.add_done_callback(self._forget)
        for fn, *args in tasks:
            self._pool.submit(self._run_task, job, fn, *args)
        return job.future

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._inflight.discard(future)

    def _run_task(self, job: _Job, fn, *args) -> None:
        try:
            fn(job, *args)
        except BaseException as e:  # noqa: BLE001 - collected and raised through the job's future
            with job.lock:  # the header check explains more than a chunk's checksum: it comes first
                job.errors.insert(0 if fn == self._check_header else len(job.errors), e)
        with job.lock:
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            job.finish(job)

    def _bounce(self) -> torch.Tensor:
        """This worker's aligned scratch buffer of chunk_bytes (O_DIRECT for buffers that are not aligned)."""
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            buf = self._local.bounce = aligned_empty(self.chunk_bytes)
        return buf

    def _error(self, job: _Job, what: str, e: BaseException | None = None) -> SwapError:
        return SwapError(f"swap of tensor {job.rec.name!r} ({job.rec.path}): {what}" + (f": {e}" if e else ""))

    def _write_chunk(self, job: _Job, i: int) -> None:
        lo, hi = job.rec.chunk(i)
        job.checksums[i] = _checksum(job.buf_np[lo:hi])
        offset = job.rec.header_bytes + lo
        if not self.direct_io:
            data = job.buf_np[lo:hi]
        elif job.in_place:
            data = job.buf_np[lo : lo + round_up(hi - lo)]  # whole blocks; the last one's tail is padding
        else:
            bounce = self._bounce()
            n, padded = hi - lo, round_up(hi - lo)
            bounce[:n].copy_(job.buf[lo:hi])
            bounce[n:padded].zero_()
            data = bounce.numpy()[:padded]
        try:
            _pwrite_all(job.fd, data, offset)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                free = shutil.disk_usage(self.run_folder).free
                raise self._error(job, f"the disk is full ({free} bytes free; {job.rec.nbytes} needed)", e) from e
            raise self._error(job, f"writing bytes {lo}-{hi} failed", e) from e

    def _finish_write(self, job: _Job) -> None:
        rec = job.rec
        try:
            if not job.errors:
                rec = dataclasses.replace(rec, checksums=tuple(job.checksums))
                header = _pack_header(rec)
                block = aligned_empty(rec.header_bytes)
                block.zero_()
                block[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
                try:
                    _pwrite_all(job.fd, block.numpy(), 0)
                except OSError as e:
                    job.errors.append(self._error(job, "writing the header failed", e))
        finally:
            os.close(job.fd)
        job.buf = job.buf_np = job.result = None  # release the caller's tensor
        with self._lock:
            if job.errors:
                self._failed[rec.name] = job.errors[0]
            else:
                self._records[rec.name] = rec
        if job.errors:
            job.future.set_exception(job.errors[0])
        else:
            job.future.set_result(rec)

    def _check_header(self, job: _Job) -> None:
        rec = job.rec
        size = os.fstat(job.fd).st_size
        if size < rec.header_bytes + rec.nbytes:
            raise self._error(job, f"the file is truncated: {size} bytes, at least {rec.header_bytes + rec.nbytes} "
                                   "expected")
        block = aligned_empty(rec.header_bytes)
        _pread_all(job.fd, block.numpy(), 0, rec.header_bytes)
        try:
            found = _unpack_header(block.numpy().tobytes())
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            raise self._error(job, "the header is corrupted", e) from e
        expected = dict(name=rec.name, dtype=_dtype_name(rec.dtype), shape=rec.shape, nbytes=rec.nbytes,
                        chunk_bytes=rec.chunk_bytes, header_bytes=rec.header_bytes, checksums=rec.checksums)
        if found != expected:
            diff = sorted(k for k in expected if found[k] != expected[k])
            raise self._error(job, f"the header does not match what was written (differs in {', '.join(diff)})")

    def _read_chunk(self, job: _Job, i: int) -> None:
        lo, hi = job.rec.chunk(i)
        offset = job.rec.header_bytes + lo
        try:
            if not self.direct_io:
                _pread_all(job.fd, job.buf_np[lo:hi], offset, hi - lo)
            elif job.in_place:
                _pread_all(job.fd, job.buf_np[lo : lo + round_up(hi - lo)], offset, hi - lo)
            else:
                bounce = self._bounce()
                _pread_all(job.fd, bounce.numpy()[: round_up(hi - lo)], offset, hi - lo)
                job.buf[lo:hi].copy_(bounce[: hi - lo])
        except EOFError as e:
            raise self._error(job, f"the file is truncated (bytes {lo}-{hi} of the data missing)") from e
        except OSError as e:
            raise self._error(job, f"reading bytes {lo}-{hi} failed", e) from e
        found = _checksum(job.buf_np[lo:hi])
        if found != job.rec.checksums[i]:
            raise self._error(job, f"the data is corrupted: checksum of bytes {lo}-{hi} is {found:#018x}, "
                                   f"{job.rec.checksums[i]:#018x} was written")

    def _finish_read(self, job: _Job) -> None:
        os.close(job.fd)
        if job.errors:
            job.future.set_exception(job.errors[0])
        else:
            job.future.set_result(job.result)
        job.buf = job.buf_np = job.result = None


def _nothing(job: _Job) -> None:
    pass
