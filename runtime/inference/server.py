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
import queue
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from zplan.errors import ZplanError
from zplan.runtime.inference.batching import BatchWorker, Broadcaster, PendingRequest, follow_batches
from zplan.runtime.inference.sampling import SamplingParams
from zplan.runtime.inference.server_requests import (
    ServerLimits,
    allowed_values,
    request_model,
    validation_response,
)

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

    from zplan.runtime.inference.http_limits import limited_protocol  # uvicorn's: loaded to serve (start-up time)

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
