"""The inference server's batching (runtime/inference/server.py): a bounded queue of tokenized requests and the
worker thread that runs them through engine.stream, max_batch at a time, and the loop of the other tensor-parallel
ranks, which run each batch rank 0 broadcasts."""

import asyncio
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from zplan.runtime.inference.sampling import SamplingFailure
from zplan.runtime.inference.server_requests import ServerLimits

HEARTBEAT_S = 30.0  # idle broadcast period under tensor parallel (gloo and NCCL time out after minutes)
POLL_S = 0.1  # how often an idle worker looks for a stop


@dataclass
class PendingRequest:
    """A tokenized request; the worker thread pushes ("token", id), ("done", reason) or ("error", message)
    events onto `events` through the event loop."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Any  # SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False  # read and written by the worker thread only

    def push(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is gone, nobody is waiting
            pass


class Broadcaster:
    """Rank 0's side of tensor parallel: sends each batch (or a heartbeat, or shutdown) to the other ranks."""

    def __init__(self, group=None):
        self.group = group

    def send(self, message: dict) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.group)


class BatchWorker:
    """The bounded queue and the thread that runs its requests through engine.stream, max_batch at a time."""

    def __init__(self, engine, stop_token: int | None, limits: ServerLimits, broadcaster: Broadcaster | None = None,
                 device=None):
        self.engine, self.stop_token, self.limits = engine, stop_token, limits
        self.broadcaster, self.device = broadcaster, device
        self.waiting: queue.Queue[PendingRequest] = queue.Queue(maxsize=limits.queue_size)
        self.batches_run = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zplan-batch-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, request: PendingRequest) -> None:
        """Queue `request`; queue.Full when the queue is full, RuntimeError when stopping."""
        if not self.alive:
            raise RuntimeError("the server is stopping")
        self.waiting.put_nowait(request)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Finish the batch in flight, fail the queued requests, and end the other ranks' loops. True when every
        rank stopped in step (the process group can then be closed with its final barrier)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._fail_waiting("the server is stopping")
        if self._thread.is_alive():  # a batch still running: a second thread must not start a collective
            print(f"zplan: the batch in flight did not end within {timeout_s:.0f} s; stopping without it",
                  file=sys.stderr, flush=True)
            return False
        if self.broadcaster is not None:
            try:
                self.broadcaster.send({"kind": "shutdown"})
            except Exception as error:  # another rank is already gone: nothing left to stop
                print(f"zplan: could not tell the other ranks to stop: {error}", file=sys.stderr, flush=True)
                return False
            finally:
                self.broadcaster = None
        return True

    def _fail_waiting(self, message: str) -> None:
        while True:
            try:
                self.waiting.get_nowait().push("error", message)
            except queue.Empty:
                return

    def _next_batch(self) -> list[PendingRequest]:
        """Up to max_batch waiting requests; [] after POLL_S with none (to notice a stop)."""
        try:
            first = self.waiting.get(timeout=POLL_S)
        except queue.Empty:
            return []
        batch = [first]
        deadline = time.monotonic() + self.limits.batch_wait_s
        while len(batch) < self.engine.max_batch:
            try:
                batch.append(self.waiting.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)  # the CUDA device is per thread
        last_sent = time.monotonic()
        while not self._stop.is_set():
            batch = self._next_batch()
            if batch:
                self.run_batch(batch)
                last_sent = time.monotonic()
            elif self.broadcaster is not None and time.monotonic() - last_sent > HEARTBEAT_S:
                try:
                    self._broadcast({"kind": "idle"})
                except RuntimeError as error:
                    print(f"zplan: {error}", file=sys.stderr, flush=True)
                last_sent = time.monotonic()
        self._fail_waiting("the server is stopping")

    def _broadcast(self, message: dict) -> None:
        """Send to the other ranks; when one is gone, stop serving (health then answers 503) and raise."""
        try:
            self.broadcaster.send(message)
        except Exception as error:
            self._stop.set()
            self.broadcaster = None  # nobody left to tell about the shutdown
            raise RuntimeError(f"a tensor-parallel rank is gone ({error}): restart the server") from error

    def run_batch(self, batch: list[PendingRequest]) -> None:
        prompts = [r.prompt_ids for r in batch]
        max_new = [r.max_new_tokens for r in batch]
        sampling = [r.sampling for r in batch]
        self.batches_run += 1
        try:
            if self.broadcaster is not None:
                self._broadcast({"kind": "batch", "prompts": prompts, "max_new_tokens": max_new,
                                 "sampling": sampling})
            counts = [0] * len(batch)
            for step in self.engine.stream(prompts, max_new, sampling):
                for i, (request, token) in enumerate(zip(batch, step, strict=True)):
                    if request.finished:
                        continue
                    if token is None:
                        self._finish(request, counts[i], last=None)
                    elif isinstance(token, SamplingFailure):  # this sequence alone failed; the others go on
                        print(f"zplan: a sequence of a batch of {len(batch)} failed after {counts[i]} tokens: "
                              f"{token.message}", file=sys.stderr, flush=True)
                        request.finished = True
                        request.push("error", token.message)
                    else:
                        counts[i] += 1
                        request.push("token", int(token))
                        if counts[i] >= request.max_new_tokens or token == self.stop_token:
                            self._finish(request, counts[i], last=int(token))
            for i, request in enumerate(batch):
                if not request.finished:
                    self._finish(request, counts[i], last=None)
        except Exception as error:  # the engine failed: fail this batch's requests, keep serving
            message = f"{type(error).__name__}: {error}"
            print(f"zplan: batch of {len(batch)} failed: {message}", file=sys.stderr, flush=True)
            for request in batch:
                if not request.finished:
                    request.finished = True
                    request.push("error", message)

    def _finish(self, request: PendingRequest, count: int, last: int | None) -> None:
        request.finished = True
        stopped = last is not None and last == self.stop_token
        request.push("done", "stop" if stopped or count < request.max_new_tokens else "length")


def follow_batches(engine) -> int:
    """The loop of tensor-parallel ranks other than 0: run each batch rank 0 broadcasts, until shutdown.
    SIGTERM / SIGINT are held until rank 0's shutdown message (torchrun sends them to every rank)."""
    import torch.distributed as dist

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    while True:
        message = [None]
        try:
            dist.broadcast_object_list(message, src=0)
        except Exception as error:
            print(f"zplan: rank {dist.get_rank()} lost rank 0 ({error}); stopping", file=sys.stderr, flush=True)
            return 1
        kind = message[0]["kind"]
        if kind == "shutdown":  # close_distributed's barrier then pairs with rank 0's
            return 0
        if kind == "batch":
            try:
                for _ in engine.stream(message[0]["prompts"], message[0]["max_new_tokens"], message[0]["sampling"]):
                    pass
            except Exception as error:  # rank 0 fails the same batch and reports it
                print(f"zplan: rank {dist.get_rank()}: batch failed: {error}", file=sys.stderr, flush=True)
