"""The serving worker (runtime/inference/server.py's engine side): a thread that runs the continuous-batching
scheduler (runtime/inference/scheduler.py) step after step, takes new requests and cancellations between steps, and
hands each new token to its request's asyncio queue; and the loop of the other tensor-parallel ranks, which run
each step rank 0 broadcasts.

    worker = ServingWorker(engine, stop_token, limits, num_blocks=..., max_running=...)
    worker.start(); worker.submit(request); ...; worker.cancel(request); worker.close()

A request's events, pushed through its event loop (loop.call_soon_threadsafe):
    ("token", (token_id, logprob or None))   one per generated token (the stop token included)
    ("done", "stop" | "length")              it finished
    ("error", message)                       it failed alone (the engine pass it was in failed, or its logits
                                             could not be sampled); the worker goes on
After cancel() takes effect a request gets no more events.
"""

from __future__ import annotations

import asyncio
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from zplan.runtime.inference.scheduler import Outcome, Scheduler, Sequence, blocks_for
from zplan.runtime.inference.server_requests import ServerLimits

HEARTBEAT_S = 30.0  # idle broadcast period under tensor parallel (gloo and NCCL time out after minutes)
POLL_S = 0.1  # how often an idle worker looks for a stop


@dataclass(eq=False)
class PendingRequest:
    """A tokenized request; the worker thread pushes its events (module docstring) onto `events`."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Any  # SamplingParams
    loop: asyncio.AbstractEventLoop
    logprobs: bool = False
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def push(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is gone, nobody is waiting
            pass


@dataclass(frozen=True)
class ServingStats:
    running: int  # sequences in the engine's batch
    waiting: int  # requests not admitted yet
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_touched: int  # blocks ever handed out: on the CPU, the cache's resident part
    prefix_cache_hit_tokens: int  # prompt tokens found in the prefix cache (counted at admission)
    prefix_cache_query_tokens: int  # prompt tokens looked up
    preemptions: int


class Broadcaster:
    """Rank 0's side of tensor parallel: sends each step (or a heartbeat, or shutdown) to the other ranks."""

    def __init__(self, group=None):
        self.group = group

    def send(self, message: dict) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.group)


def default_blocks(max_running: int, max_seq_len: int) -> int:
    """KV blocks for max_running sequences of max_seq_len tokens (the plan's KV budget in blocks)."""
    return max_running * blocks_for(max_seq_len)


class ServingWorker:
    """The thread that runs the scheduler; submit and cancel are safe from any thread."""

    def __init__(self, engine, stop_token: int | None, limits: ServerLimits, broadcaster: Broadcaster | None = None,
                 device=None, *, num_blocks: int | None = None, max_running: int | None = None,
                 max_step_tokens: int | None = None):
        self.engine, self.stop_token, self.limits = engine, stop_token, limits
        self.broadcaster, self.device = broadcaster, device
        max_running = max_running or engine.max_batch
        extra = {} if max_step_tokens is None else {"max_step_tokens": max_step_tokens}
        self.scheduler = Scheduler(engine, num_blocks or default_blocks(max_running, engine.max_seq_len),
                                   max_running=max_running, runner=self._send_step if broadcaster else None, **extra)
        self.steps_run = 0
        self._lock = threading.Lock()
        self._inbox: list[PendingRequest] = []
        self._cancels: list[PendingRequest] = []
        self._sequences: dict[int, Sequence] = {}  # id(request) -> its sequence, while it runs or waits
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zplan-serving-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, request: PendingRequest) -> None:
        """Queue `request`: queue.Full when limits.queue_size requests wait already, RuntimeError when stopping,
        ValueError (the reason) when the engine cannot serve it."""
        if not self.alive:
            raise RuntimeError("the server is stopping")
        problem = self.scheduler.check(request.prompt_ids, request.max_new_tokens)
        if problem:
            raise ValueError(problem)
        with self._lock:
            if len(self._inbox) + len(self.scheduler.waiting) >= self.limits.queue_size:
                raise queue.Full
            self._inbox.append(request)
        self._wake.set()

    def cancel(self, request: PendingRequest) -> None:
        """Stop `request` before the next step (its blocks are freed then); it gets no more events."""
        with self._lock:
            self._cancels.append(request)
        self._wake.set()

    def stats(self) -> ServingStats:
        pool = self.scheduler.pool
        return ServingStats(running=len(self.scheduler.running),
                            waiting=len(self.scheduler.waiting) + len(self._inbox),
                            kv_blocks_used=pool.used, kv_blocks_total=pool.num_blocks,
                            kv_blocks_touched=pool.num_blocks - pool.untouched,
                            prefix_cache_hit_tokens=pool.hit_tokens, prefix_cache_query_tokens=pool.query_tokens,
                            preemptions=self.scheduler.preemptions)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Finish the step in flight, fail every request still waiting or running, and end the other ranks' loops.
        True when every rank stopped in step (the process group can then be closed with its final barrier)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():  # a step still running: a second thread must not start a collective
            print(f"zplan: the engine step in flight did not end within {timeout_s:.0f} s; stopping without it",
                  file=sys.stderr, flush=True)
            return False
        self._fail_everything("the server is stopping")
        if self.broadcaster is not None:
            try:
                self.broadcaster.send({"kind": "shutdown"})
            except Exception as error:  # another rank is already gone: nothing left to stop
                print(f"zplan: could not tell the other ranks to stop: {error}", file=sys.stderr, flush=True)
                return False
            finally:
                self.broadcaster = None
        return True

    # ---- the worker thread ------------------------------------------------------------------------------------

    def _take_mail(self) -> None:
        """Cancellations first (a request both new and cancelled never runs), then the new requests."""
        with self._lock:
            inbox, cancels = self._inbox, self._cancels
            self._inbox, self._cancels = [], []
        cancelled = {id(r) for r in cancels}
        for request in cancels:
            sequence = self._sequences.pop(id(request), None)
            if sequence is not None:
                self.scheduler.cancel(sequence)
        for request in inbox:
            if id(request) in cancelled:
                continue
            sequence = Sequence(request.prompt_ids, request.max_new_tokens, request.sampling, handle=request,
                                logprobs=request.logprobs)
            self._sequences[id(request)] = sequence
            self.scheduler.add(sequence)

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)  # the CUDA device is per thread
        last_sent = time.monotonic()
        while not self._stop.is_set():
            self._take_mail()
            if self.scheduler.busy:
                for outcome in self.scheduler.step():
                    self._report(outcome)
                self.steps_run += 1
                last_sent = time.monotonic()
                continue
            self._wake.wait(POLL_S)
            self._wake.clear()
            if self.broadcaster is not None and time.monotonic() - last_sent > HEARTBEAT_S:
                try:
                    self._send({"kind": "idle"})
                except RuntimeError as error:
                    print(f"zplan: {error}", file=sys.stderr, flush=True)
                last_sent = time.monotonic()

    def _report(self, outcome: Outcome) -> None:
        request: PendingRequest = outcome.sequence.handle
        if outcome.finish == "error":
            print(f"zplan: a sequence failed after {outcome.sequence.generated} tokens: {outcome.message}",
                  file=sys.stderr, flush=True)
            self._sequences.pop(id(request), None)
            request.push("error", outcome.message)
            return
        request.push("token", (outcome.token, outcome.logprob))
        if outcome.finish:
            self._sequences.pop(id(request), None)
            request.push("done", outcome.finish)

    def _fail_everything(self, message: str) -> None:
        with self._lock:
            pending = self._inbox
            self._inbox = []
        for request in pending:
            request.push("error", message)
        for sequence in list(self._sequences.values()):
            self.scheduler.cancel(sequence)
            sequence.handle.push("error", message)
        self._sequences.clear()

    def _send_step(self, batch, params) -> None:
        self._send({"kind": "step", "batch": batch, "params": params})

    def _send(self, message: dict) -> None:
        """Send to the other ranks; when one is gone, stop serving (health then answers 503) and raise."""
        try:
            self.broadcaster.send(message)
        except Exception as error:
            self._stop.set()
            self.broadcaster = None  # nobody left to tell about the shutdown
            raise RuntimeError(f"a tensor-parallel rank is gone ({error}): restart the server") from error


def follow_steps(engine, num_blocks: int) -> int:
    """The loop of tensor-parallel ranks other than 0: run each step rank 0 broadcasts on a paged cache of the same
    size, until shutdown. SIGTERM / SIGINT are held until rank 0's shutdown message (torchrun sends them to every
    rank)."""
    import torch
    import torch.distributed as dist

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    cache = engine.paged_cache(num_blocks)
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
        if kind == "step":
            params = message[0]["params"]
            try:
                logits = engine.forward_paged(cache, message[0]["batch"])
                if params:  # rank 0 samples; this joins its broadcast of the tokens
                    engine.sample(logits, params, [torch.Generator() for _ in params])
            except Exception as error:  # rank 0 fails the same sequences and reports it
                print(f"zplan: rank {dist.get_rank()}: step failed: {error}", file=sys.stderr, flush=True)
