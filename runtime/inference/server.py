"""The HTTP server behind the emitted serve.py: POST /v1/generate and GET /health on FastAPI + uvicorn.

Requests are validated (pydantic, extra fields refused), tokenized and put on a bounded queue (full: 503
with Retry-After). One worker thread takes up to engine.max_batch waiting requests at a time, runs them as
one engine.stream batch and hands each new token to its request's asyncio queue (loop.call_soon_threadsafe),
so the event loop only ever waits. A client that goes away leaves its sequence running to the end of the
batch (the engine has no per-sequence cancel); the others are not disturbed, and the server prints one line. An
engine error fails the requests of that batch (500 with the message) and the worker goes on with the next; a
sequence the engine could not sample (a SamplingFailure: runtime/inference/sampling.py) fails its request alone.

A request's own values cannot fail the others batched with it: each field's type and range is checked by the
request model (request_model: strict types, so no "5", true or [5] for a number; no NaN or infinity), a 422 names
the field and what it accepts, and sampling is numerically safe per sequence (a temperature below 1e-5 is greedy).

Slow and greedy clients: a request's headers must arrive within header_timeout_s and its body within
body_timeout_s (else 408), and at most max_connections connections are open at a time (more get 503):
runtime/inference/http_limits.py. A body that is not JSON, not UTF-8 or holds NaN or an infinite number is 422.

Tensor parallel: every rank of the replica must run the same engine.stream. Rank 0 serves HTTP and, before
each batch, broadcasts it (torch.distributed.broadcast_object_list); the other ranks loop in follow_batches
receiving and running it. While idle, rank 0 broadcasts a heartbeat every HEARTBEAT_S so that no rank waits
past the process group's timeout. SIGTERM or Ctrl-C on rank 0 stops uvicorn gracefully, then the worker,
then broadcasts a shutdown message that ends the other ranks.

API (JSON):
    POST /v1/generate {"prompt": str (1 to max_seq_len characters), "max_new_tokens": int (1 to max_seq_len - 1),
                       "temperature": float (0 to 10; below 1e-5 greedy), "top_p": float (0 < top_p <= 1),
                       "seed": int (0 to 2^63 - 1), "stream": bool}
      stream false: {"text", "tokens", "finish_reason": "stop"|"length", "usage": {"prompt_tokens",
                     "completion_tokens"}}
      stream true:  NDJSON, one line per token {"token": id, "text": the text it completes ("" while a
                     UTF-8 character is incomplete)}, then {"finish_reason", "text", "tokens", "usage"}
                     ({"error": message, "finish_reason": "error"} if the engine fails mid-stream)
    GET /health   {"status": "ok", "max_batch", "max_seq_len", "tp", "queued"}
"""

import asyncio
import errno
import json
import math
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from zplan.errors import ZplanError

HEARTBEAT_S = 30.0  # idle broadcast period under tensor parallel (gloo and NCCL time out after minutes)
POLL_S = 0.1  # how often an idle worker looks for a stop


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may ask; the engine's own limits come from the engine."""

    max_new_tokens: int  # largest max_new_tokens accepted (max_seq_len - 1: a prompt has at least one token)
    default_max_new_tokens: int  # when a request gives none (the plan's gen_len)
    max_prompt_chars: int  # characters of prompt accepted before tokenizing
    max_body_bytes: int = 1 << 20  # request bodies above this get 413
    max_temperature: float = 10.0  # finite; a temperature below sampling.MIN_TEMPERATURE is greedy
    queue_size: int = 64  # requests waiting for the worker; more get 503
    retry_after_s: int = 1  # Retry-After of a 503
    batch_wait_s: float = 0.002  # after the first request of a batch, wait this long for more
    max_connections: int = 256  # open connections; one more is answered 503 and closed
    header_timeout_s: float = 10.0  # a request's headers complete within this (else 408)
    body_timeout_s: float = 30.0  # a request's body read within this after its headers (else 408)

    @classmethod
    def for_engine(cls, max_seq_len: int, max_batch: int, default_max_new_tokens: int, **overrides: Any):
        default = max(1, min(default_max_new_tokens, max_seq_len - 1))
        # a byte tokenizer makes at most 4 tokens of a character and at least 1: chars beyond max_seq_len
        # cannot fit, so refuse them before tokenizing
        return cls(max_new_tokens=max(1, max_seq_len - 1), default_max_new_tokens=default,
                   max_prompt_chars=max_seq_len,
                   **{"queue_size": 8 * max_batch, **overrides})


def request_model(limits: ServerLimits) -> type[BaseModel]:
    """The POST /v1/generate body, bounded by `limits`; strict types (no "5" for 5, no true for 1, no lists),
    no NaN or infinity, unknown fields refused. The one place the request's bounds are written: a 422 describes
    them from here (allowed_values), and every endpoint that samples parses its body with this model."""

    class GenerateRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

        prompt: str = Field(min_length=1, max_length=limits.max_prompt_chars, description="Text to continue.")
        max_new_tokens: int = Field(default=limits.default_max_new_tokens, ge=1, le=limits.max_new_tokens,
                                    description="Most tokens to generate.")
        temperature: float = Field(default=0.0, ge=0.0, le=limits.max_temperature,
                                   description="Softmax temperature; 0 (any value below 1e-5) is greedy.")
        top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
        seed: int = Field(default=0, ge=0, le=2**63 - 1, description="Sampling seed of this request.")
        stream: bool = Field(default=False, description="Answer NDJSON, one line per token.")

    return GenerateRequest


# ---- one request on its way through the worker -------------------------------------------------------------


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
        from zplan.runtime.inference.sampling import SamplingFailure

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


# ---- HTTP ----------------------------------------------------------------------------------------------------


class BodySizeLimit:
    """ASGI middleware: 413 for a body over max_bytes, by its Content-Length or while it is read (chunked)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            response = JSONResponse({"detail": self._message()}, status_code=413)
            return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(status_code=413, detail=self._message())
            return message

        return await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body over {self.max_bytes} bytes"


def json_safe(value: Any) -> Any:
    """`value` as JSON can carry it: NaN and infinities as text, bytes decoded (invalid UTF-8 replaced), other
    objects as their str; so that an error about a bad value can itself be rendered."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _number(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def allowed_values(model: type[BaseModel]) -> dict[str, str]:
    """What each field of `model` accepts, in words, from its type and bounds (so a bound is written once, in the
    model): {"temperature": "temperature must be a finite number, 0 <= temperature <= 10", ...}."""
    import annotated_types as at

    kinds = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}
    allowed = {}
    for name, info in model.model_fields.items():
        low = high = ""
        for bound in info.metadata:
            if isinstance(bound, at.Ge):
                low = f"{_number(bound.ge)} <= "
            elif isinstance(bound, at.Gt):
                low = f"{_number(bound.gt)} < "
            elif isinstance(bound, at.Le):
                high = f" <= {_number(bound.le)}"
            elif isinstance(bound, at.Lt):
                high = f" < {_number(bound.lt)}"
            elif isinstance(bound, at.MinLen):
                low = f"{bound.min_length}"
            elif isinstance(bound, at.MaxLen):
                high = f"{bound.max_length}"
        text = f"{name} must be {kinds.get(info.annotation, str(info.annotation))}"
        if info.annotation is str and (low or high):
            text += f" of {low or 0} to {high} characters" if high else f" of at least {low} characters"
        elif low or high:
            text += f", {low}{name}{high}"
        allowed[name] = text
    return allowed


def validation_response(error: ValidationError, allowed: dict[str, str] | None = None) -> JSONResponse:
    """422 in FastAPI's format ({"detail": [{"type", "loc", "msg", "input", "ctx"}, ...]}), every value JSON. With
    `allowed` (allowed_values of the model), each msg names its field and what the field accepts."""
    errors = []
    for e in error.errors(include_url=False):
        field_name = e["loc"][0] if e["loc"] else None
        if allowed is not None and isinstance(field_name, str):
            accepts = allowed.get(field_name, f"the fields are {', '.join(allowed)}")
            e = {**e, "msg": f"{field_name}: {e['msg']}; {accepts}"}
        errors.append({**e, "loc": ["body", *e["loc"]]})
    return JSONResponse({"detail": json_safe(errors)}, status_code=422)


def _client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "a client"


def _json_line(payload: dict) -> bytes:
    return (json.dumps(payload, ensure_ascii=False) + "\n").encode()


class IncrementalText:
    """The text of a growing token list, released only where it is final: a trailing U+FFFD may be an
    incomplete UTF-8 character that the next byte completes."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.tokens, self.released = decode, [], ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        stable = self.decode(self.tokens).rstrip("\ufffd")
        if not stable.startswith(self.released):
            return ""
        delta, self.released = stable[len(self.released):], stable
        return delta


def create_app(worker: BatchWorker, tokenizer, limits: ServerLimits, *, tp: int = 1) -> FastAPI:
    """The FastAPI app of `worker` (started by the caller)."""
    from zplan.runtime.inference.sampling import SamplingParams

    engine = worker.engine
    GenerateRequest = request_model(limits)  # noqa: N806 (a class)
    allowed = allowed_values(GenerateRequest)
    app = FastAPI(title="zplan inference server", docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    stop_token = worker.stop_token

    def completion(tokens: list[int]) -> str:
        return tokenizer.decode([t for t in tokens if t != stop_token])

    def final(tokens: list[int], prompt_tokens: int, reason: str) -> dict:
        return {"text": completion(tokens), "tokens": tokens, "finish_reason": reason,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens)}}

    @app.get("/health")
    async def health():
        status = 200 if worker.alive else 503
        return JSONResponse({"status": "ok" if worker.alive else "stopping", "max_batch": engine.max_batch,
                             "max_seq_len": engine.max_seq_len, "tp": tp, "queued": worker.waiting.qsize()},
                            status_code=status)

    @app.post("/v1/generate")
    async def generate(http_request: Request):
        # parsed here rather than by FastAPI, so that a body sent without Content-Type: application/json (curl -d)
        # is read as JSON too; errors keep FastAPI's 422 format
        try:
            raw = await asyncio.wait_for(http_request.body(), limits.body_timeout_s)
        except ClientDisconnect:
            print(f"zplan: {_client(http_request)} disconnected before its request body was read", file=sys.stderr,
                  flush=True)
            return Response(status_code=499)  # nobody reads it
        except TimeoutError:
            print(f"zplan: {_client(http_request)} sent no whole request body within {limits.body_timeout_s:g} s",
                  file=sys.stderr, flush=True)
            return JSONResponse({"detail": f"request body not received within {limits.body_timeout_s:g} s"},
                                status_code=408, headers={"Connection": "close"})
        try:
            body = GenerateRequest.model_validate_json(raw)
        except ValidationError as error:
            return validation_response(error, allowed)
        prompt_ids = tokenizer.encode(body.prompt)
        if len(prompt_ids) + body.max_new_tokens > engine.max_seq_len:
            raise HTTPException(400, f"prompt of {len(prompt_ids)} tokens + max_new_tokens {body.max_new_tokens} "
                                     f"exceeds max_seq_len {engine.max_seq_len} (the KV cache's length per "
                                     "sequence): shorten the prompt or ask for fewer tokens")
        sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                  stop_token=stop_token)
        request = PendingRequest(prompt_ids, body.max_new_tokens, sampling, asyncio.get_running_loop())
        try:
            worker.submit(request)
        except (queue.Full, RuntimeError) as error:
            detail = (f"server busy: {limits.queue_size} requests already waiting; retry"
                      if isinstance(error, queue.Full) else str(error))
            return JSONResponse({"detail": detail}, status_code=503,
                                headers={"Retry-After": str(limits.retry_after_s)})

        first = await request.events.get()
        if not body.stream or first[0] == "error":
            tokens, event = [], first
            while event[0] == "token":
                tokens.append(event[1])
                event = await request.events.get()
            if await http_request.is_disconnected():
                print(f"zplan: {_client(http_request)} disconnected before its answer ({len(tokens)} tokens)",
                      file=sys.stderr, flush=True)
                return Response(status_code=499)  # nobody reads it
            if event[0] == "error":
                return JSONResponse({"detail": f"generation failed: {event[1]}"}, status_code=500)
            return final(tokens, len(prompt_ids), event[1])

        async def lines() -> AsyncIterator[bytes]:
            tokens, text, event, finished = [], IncrementalText(completion), first, False
            try:
                while event[0] == "token":
                    tokens.append(event[1])
                    yield _json_line({"token": event[1], "text": text.add(event[1])})
                    await asyncio.sleep(0)  # a lost connection is noticed here, before the next write
                    event = await request.events.get()
                if event[0] == "error":
                    yield _json_line({"error": f"generation failed: {event[1]}", "finish_reason": "error"})
                else:
                    yield _json_line(final(tokens, len(prompt_ids), event[1]))
                finished = True
            finally:
                if not finished:  # the response was cancelled: the client went away
                    print(f"zplan: {_client(http_request)} disconnected after {len(tokens)} streamed tokens; its "
                          "sequence runs to the end of its batch", file=sys.stderr, flush=True)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


# ---- running it ---------------------------------------------------------------------------------------------


class ServeError(ZplanError):
    """The server cannot start (its address cannot be bound)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or ServeError saying why not (uvicorn would only log it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:  # the host, not the port
            raise ServeError(f"cannot listen on --host {host}: {error.strerror}; pass an address of this machine "
                             "(127.0.0.1: this machine only; 0.0.0.0: all interfaces)") from error
        raise ServeError(f"cannot listen on {host}:{port}: {error.strerror}; pass another --port (or PORT=...) "
                         "or stop the process that holds it") from error
    sock.set_inheritable(True)
    return sock


def server_config(app: FastAPI, limits: ServerLimits):
    """uvicorn's configuration of the server: warnings only, no access log, the connection limits of `limits`."""
    import uvicorn

    from zplan.runtime.inference.http_limits import limited_protocol

    return uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, access_log=False,
                          http=limited_protocol(limits.max_connections, limits.header_timeout_s))


def serve(engine, tokenizer, ctx, host: str, port: int, limits: ServerLimits) -> int:
    """Serve until SIGTERM / Ctrl-C on rank 0; the other tensor-parallel ranks follow rank 0's batches.
    Every rank of the replica calls this. Returns the process's exit status."""
    import uvicorn

    if ctx.rank != 0:
        return follow_batches(engine)
    broadcaster = Broadcaster() if ctx.world_size > 1 else None
    worker = BatchWorker(engine, tokenizer.eos_id, limits, broadcaster, device=ctx.device)
    app = create_app(worker, tokenizer, limits, tp=ctx.world_size)
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown) and raises the signal again when done: this handler
    # receives it then, so that the worker is closed and the other ranks told to stop.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    server = uvicorn.Server(server_config(app, limits))
    try:
        sock = bind_socket(host, port)  # in the try: a failure still stops the other ranks
        worker.start()
        print(f"zplan: serving on http://{host}:{port} (POST /v1/generate, GET /health); max batch "
              f"{engine.max_batch}, max_seq_len {engine.max_seq_len}, tp {ctx.world_size}", file=sys.stderr,
              flush=True)
        server.run(sockets=[sock])
    finally:
        stopped_in_step = worker.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"zplan: server stopped ({worker.batches_run} batches run)", file=sys.stderr, flush=True)
    return 0 if server.started and stopped_in_step else 1
