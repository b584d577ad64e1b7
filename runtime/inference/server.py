"""The HTTP server behind the emitted serve.py: an OpenAI-compatible API on FastAPI + uvicorn.

    POST /v1/completions        {"prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", ...}
    POST /v1/chat/completions   {"messages", "max_completion_tokens" (or "max_tokens"), the same sampling fields}
    GET  /v1/models             the served model (its name, max_model_len)
    GET  /health                200 {"status": "ok", ...}, 503 while stopping (never needs the API key)
    GET  /metrics               Prometheus text (runtime/inference/metrics.py)

The fields and their bounds: runtime/inference/server_requests.py (strict types, no NaN or infinity, unknown fields
refused; a 400 names each bad field and what it accepts). Answers and errors have OpenAI's shapes
(runtime/inference/openai_api.py); a stream is server-sent events, one `data: {chunk}` per token's text (an
incomplete UTF-8 character, or text that may begin a stop string, is held back until it is known), then the chunk
with finish_reason, the usage chunk when stream_options.include_usage, then `data: [DONE]`. POST /v1/generate, the
server's own API before this one, is retired.

Each request is tokenized (a chat through tokenizer.chat_prompt) and submitted to the worker (ServingWorker of
runtime/inference/batching.py, duck-typed here: submit, cancel, stats, alive), which pushes ("token", (id,
logprob)), ("done", "stop" | "length") or ("error", message) events to the request's asyncio queue from its thread;
the event loop only ever waits. A stop string found in the text ends the request ("stop") and cancels its sequence;
so does a client that goes away (a stream's response is cancelled; a plain request's connection is polled every
DISCONNECT_POLL_S). An engine error fails only its request (500, or an error chunk once streaming). A full queue
is 429 with Retry-After; a stopping server 503 with Retry-After.

With an API key (serve.py --api-key, or ZPLAN_API_KEY), every endpoint but /health needs `Authorization: Bearer
KEY` (401 otherwise). Slow and greedy clients: a request's headers must arrive within header_timeout_s and its body
within body_timeout_s (else 408), a body is at most max_body_bytes (else 413), and at most max_connections
connections are open at a time (more get 503): runtime/inference/http_limits.py.

Tensor parallel: every rank of the replica must run the same engine steps; batching.py owns that (rank 0's worker
broadcasts what it runs, the other ranks follow it). SIGTERM or Ctrl-C on rank 0 stops uvicorn gracefully, then
the worker, which tells the other ranks to stop.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import queue
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from zplan.errors import ZplanError
from zplan.runtime.inference.batching import PendingRequest
from zplan.runtime.inference.metrics import CONTENT_TYPE, Metrics
from zplan.runtime.inference.openai_api import (
    ApiError,
    IncrementalText,
    StopText,
    chat_logprobs,
    completion_logprobs,
    error_body,
    error_response,
    install_error_handlers,
    new_id,
    now_s,
    sse,
    usage,
)
from zplan.runtime.inference.sampling import SamplingParams
from zplan.runtime.inference.server_requests import (
    ServerLimits,
    allowed_values,
    chat_request_model,
    completion_request_model,
    validation_message,
)

__all__ = ["IncrementalText", "ServeError", "ServerLimits", "bind_socket", "create_app", "serve", "server_config"]

DISCONNECT_POLL_S = 0.5  # how often a plain (not streamed) request checks that its client is still there
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
OWNER = "zplan"

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
            return await error_response(413, self._message())(scope, receive, send)
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


class ApiKeyCheck:
    """ASGI middleware: 401 unless the request carries `Authorization: Bearer <api_key>` (/health is open)."""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", [])).get(b"authorization")
        scheme, _, key = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key):
            return await self.app(scope, receive, send)
        message = ("no API key: send the header Authorization: Bearer KEY" if given is None else
                   "invalid API key")
        response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await response(scope, receive, send)


class ClientGone(Exception):
    """The client went away; nobody reads an answer."""


def _client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "a client"


def _log(message: str) -> None:
    print(f"zplan: {message}", file=sys.stderr, flush=True)


class Generation:
    """A submitted request's events turned into the text its client is sent: pieces (text, logprob entries), then
    finish_reason ("stop" | "length") or error (the engine's message)."""

    def __init__(self, request: PendingRequest, worker, tokenizer, metrics: Metrics, prompt_tokens: int,
                 stops: list[str], logprobs: bool):
        self.request, self.worker, self.tokenizer, self.metrics = request, worker, tokenizer, metrics
        self.prompt_tokens, self.logprobs = prompt_tokens, logprobs
        self.stop_token = worker.stop_token
        self.text = IncrementalText(lambda ids: tokenizer.decode([t for t in ids if t != self.stop_token]))
        self.stop = StopText(stops)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.started = metrics.request_started(prompt_tokens)
        self.last_token_at: float | None = None
        self.pending: tuple | None = None  # an event read ahead (first_event)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    async def next_event(self, http_request: Request | None = None) -> tuple:
        """The next event; with `http_request`, ClientGone once its client has disconnected."""
        if self.pending is not None:
            event, self.pending = self.pending, None
            return event
        if http_request is None:
            return await self.request.events.get()
        while True:
            try:
                return await asyncio.wait_for(self.request.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http_request.is_disconnected():
                    raise ClientGone() from None

    async def first_event(self, http_request: Request) -> None:
        """Wait for the first event (kept for pieces()); ApiError 500 when it is an engine error."""
        self.pending = await self.next_event(http_request)
        if self.pending[0] == "error":
            self._fail(self.pending[1])
            raise ApiError(500, f"generation failed: {self.error}")

    async def pieces(self, http_request: Request | None = None) -> AsyncIterator[tuple[str, list]]:
        """(text delta, [(token text, logprob, offset)]) as tokens come; ends with finish_reason or error set."""
        while not self.done:
            kind, value = await self.next_event(http_request)
            if kind == "token":
                token, logprob = value
                self.last_token_at = self.metrics.token(self.started, self.last_token_at)
                self.completion_tokens += 1
                if token == self.stop_token:  # no text; "done" follows
                    continue
                offset = len(self.text.released)
                delta = self.stop.add(self.text.add(token))
                entries = [(self.tokenizer.decode([token]), logprob, offset)] if self.logprobs else []
                if self.stop.stopped:
                    self._finish("stop")
                    self.worker.cancel(self.request)
                if delta or entries:
                    yield delta, entries
            elif kind == "done":
                rest = self.stop.add(self.text.finish())
                self._finish("stop" if self.stop.stopped else value)
                rest += self.stop.finish()
                if rest:
                    yield rest, []
            else:
                self._fail(value)

    async def collect(self, http_request: Request) -> tuple[str, list]:
        """The whole text and logprob entries (a plain answer), watching for the client to go away."""
        text, entries = "", []
        async for delta, more in self.pieces(http_request):
            text += delta
            entries += more
        return text, entries

    def abort(self, http_request: Request, what: str) -> None:
        """The client went away: stop the sequence now."""
        if self.done:
            return
        self.worker.cancel(self.request)
        self.finish_reason = "abort"
        self.metrics.request_finished("abort")
        _log(f"{_client(http_request)} disconnected {what}; its sequence was cancelled")

    def _finish(self, reason: str) -> None:
        if not self.done:
            self.finish_reason = reason
            self.metrics.request_finished(reason)

    def _fail(self, message: str) -> None:
        if not self.done:
            self.error = message
            self.metrics.request_finished("error")


def create_app(worker, tokenizer, limits: ServerLimits, *, model_name: str = "zplan", api_key: str | None = None,
               tp: int = 1) -> FastAPI:
    """The FastAPI app serving `worker` (started by the caller; ServingWorker's interface) as `model_name`;
    with `api_key`, every endpoint but /health requires it."""
    engine = worker.engine
    completion_model, chat_model = completion_request_model(limits), chat_request_model(limits)
    allowed_completion, allowed_chat = allowed_values(completion_model), allowed_values(chat_model)
    metrics = Metrics()
    started_at = now_s()
    app = FastAPI(title="zplan inference server", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)  # added last: runs first, before the body is read

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone):
        return Response(status_code=499)  # nobody reads it

    async def read_body(http_request: Request, model: type[BaseModel], allowed: dict[str, str]):
        # parsed here rather than by FastAPI, so that a body sent without Content-Type: application/json (curl -d)
        # is read as JSON too, and every error names its field
        try:
            raw = await asyncio.wait_for(http_request.body(), limits.body_timeout_s)
        except ClientDisconnect:
            _log(f"{_client(http_request)} disconnected before its request body was read")
            raise ClientGone() from None
        except asyncio.TimeoutError:
            _log(f"{_client(http_request)} sent no whole request body within {limits.body_timeout_s:g} s")
            raise ApiError(408, f"request body not received within {limits.body_timeout_s:g} s",
                           headers={"Connection": "close"}) from None
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ApiError(400, f"the request body is not UTF-8 ({error.reason} at byte {error.start})") from None
        try:
            return model.model_validate_json(raw)
        except ValidationError as error:
            message, param = validation_message(error, allowed)
            raise ApiError(400, message, param=param) from None

    def check_common(body) -> None:
        """The checks both endpoints share that the model cannot write: the model's name, stream_options."""
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist: this server serves {model_name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: allowed only with stream true", param="stream_options")

    def submit(body, prompt_ids: list[int], max_tokens: int | None, max_param: str, prompt_param: str,
               logprobs: bool) -> Generation:
        """Check the lengths, then queue the request; its Generation."""
        room = engine.max_seq_len - len(prompt_ids)
        if max_tokens is None:  # the default, shortened to what the KV cache has room for
            max_tokens = min(limits.default_max_new_tokens, room) if room >= 1 else limits.default_max_new_tokens
        if len(prompt_ids) + max_tokens > engine.max_seq_len:
            raise ApiError(400, f"this model's maximum context length is {engine.max_seq_len} tokens (max_seq_len, "
                                f"the KV cache's length per sequence); you asked for {len(prompt_ids) + max_tokens} "
                                f"tokens ({len(prompt_ids)} in the {prompt_param}, {max_param} {max_tokens}): "
                                f"shorten the {prompt_param} or ask for fewer tokens",
                           param=prompt_param, code="context_length_exceeded")
        stops = [] if body.stop is None else [body.stop] if isinstance(body.stop, str) else list(body.stop)
        sampling = SamplingParams(
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=secrets.randbits(63) if body.seed is None else body.seed, stop_token=worker.stop_token)
        request = PendingRequest(prompt_ids, max_tokens, sampling, asyncio.get_running_loop(), logprobs=logprobs)
        try:
            worker.submit(request)
        except ValueError as error:  # the engine cannot serve it (the worker says why)
            raise ApiError(400, str(error), param=prompt_param) from None
        except queue.Full:
            raise ApiError(429, f"server busy: {limits.queue_size} requests already waiting; retry",
                           code="queue_full", headers={"Retry-After": str(limits.retry_after_s)}) from None
        except RuntimeError as error:
            raise ApiError(503, str(error), code="stopping",
                           headers={"Retry-After": str(limits.retry_after_s)}) from None
        return Generation(request, worker, tokenizer, metrics, len(prompt_ids), stops, logprobs)

    async def plain(generation: Generation, http_request: Request) -> tuple[str, list]:
        """The whole answer; ClientGone (the sequence cancelled) when the client leaves first."""
        try:
            await generation.first_event(http_request)
            text, entries = await generation.collect(http_request)
        except ClientGone:
            generation.abort(http_request, f"before its answer ({generation.completion_tokens} tokens)")
            raise
        if generation.error is not None:
            raise ApiError(500, f"generation failed: {generation.error}")
        return text, entries

    def events(generation: Generation, http_request: Request, chunk, include_usage: bool,
               first: list[bytes]) -> StreamingResponse:
        """The server-sent events of a stream: `first`, a chunk per piece (chunk(text, entries, finish_reason)),
        the finish chunk, the usage chunk, [DONE]."""

        async def stream() -> AsyncIterator[bytes]:
            finished = False
            try:
                for data in first:
                    yield data
                async for delta, entries in generation.pieces():
                    yield sse(chunk(delta, entries, None))
                if generation.error is not None:
                    yield sse(error_body(500, f"generation failed: {generation.error}"))
                else:
                    yield sse(chunk(None, [], generation.finish_reason))
                    if include_usage:
                        yield sse(chunk(None, [], None, final_usage=True))
                yield sse("[DONE]")
                finished = True
            finally:
                if not finished:  # the response was cancelled: the client went away
                    generation.abort(http_request, f"after {generation.completion_tokens} streamed tokens")

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_start(generation: Generation, http_request: Request) -> None:
        """Wait for the first event, so that an engine error is a 500 rather than a broken stream."""
        try:
            await generation.first_event(http_request)
        except ClientGone:
            generation.abort(http_request, "before its first token")
            raise

    @app.get("/health")
    async def health():
        alive, stats = worker.alive, worker.stats()
        return JSONResponse({"status": "ok" if alive else "stopping", "model": model_name,
                             "max_batch": engine.max_batch, "max_seq_len": engine.max_seq_len, "tp": tp,
                             "running": stats.running, "waiting": stats.waiting}, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started_at,
                                            "owned_by": OWNER, "max_model_len": engine.max_seq_len}]}

    @app.get("/metrics")
    async def metrics_page():
        return Response(metrics.render(worker.stats()), media_type=CONTENT_TYPE)

    def stream_chunk(generation: Generation, answer_id: str, kind: str, created: int, choice: dict,
                     include_usage: bool, final_usage: bool) -> dict:
        """One streamed chunk of either endpoint: `choice`, or none in the closing usage chunk; "usage" only when
        stream_options.include_usage (null but in the last)."""
        out = {"id": answer_id, "object": kind, "created": created, "model": model_name,
               "choices": [] if final_usage else [choice]}
        if include_usage:
            out["usage"] = usage(generation.prompt_tokens, generation.completion_tokens) if final_usage else None
        return out

    @app.post("/v1/completions")
    async def completions(http_request: Request):
        body = await read_body(http_request, completion_model, allowed_completion)
        check_common(body)
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        generation = submit(body, tokenizer.encode(prompt), body.max_tokens, "max_tokens", "prompt",
                            body.logprobs is not None)
        answer_id, created = new_id("cmpl"), now_s()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(text, entries, finish_reason, final_usage: bool = False) -> dict:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason,
                      "logprobs": completion_logprobs(entries) if entries else None}
            return stream_chunk(generation, answer_id, "text_completion", created, choice, include_usage,
                                final_usage)

        if body.stream:
            await stream_start(generation, http_request)
            return events(generation, http_request, chunk, include_usage, [])
        text, entries = await plain(generation, http_request)
        return {"id": answer_id, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": generation.finish_reason,
                             "logprobs": completion_logprobs(entries) if generation.logprobs else None}],
                "usage": usage(generation.prompt_tokens, generation.completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request):
        body = await read_body(http_request, chat_model, allowed_chat)
        check_common(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        chars = sum(len(m["content"]) for m in messages)
        if chars > limits.max_prompt_chars:
            raise ApiError(400, f"messages: {chars} characters in all; at most {limits.max_prompt_chars} fit in "
                                f"max_seq_len {engine.max_seq_len} tokens", param="messages",
                           code="context_length_exceeded")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        try:
            prompt_ids = tokenizer.chat_prompt(messages)
        except Exception as error:  # a chat template may refuse a conversation (jinja2's raise_exception)
            raise ApiError(400, f"messages: the model's chat template refused them: {error}",
                           param="messages") from None
        generation = submit(body, prompt_ids, max_tokens, max_param, "messages", bool(body.logprobs))
        answer_id, created = new_id("chatcmpl"), now_s()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(text, entries, finish_reason, final_usage: bool = False, delta: dict | None = None) -> dict:
            if delta is None:
                delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": chat_logprobs(entries) if entries else None}
            return stream_chunk(generation, answer_id, "chat.completion.chunk", created, choice, include_usage,
                                final_usage)

        if body.stream:
            await stream_start(generation, http_request)
            role = sse(chunk(None, [], None, delta={"role": "assistant", "content": ""}))
            return events(generation, http_request, chunk, include_usage, [role])
        text, entries = await plain(generation, http_request)
        return {"id": answer_id, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": generation.finish_reason,
                             "logprobs": chat_logprobs(entries) if generation.logprobs else None}],
                "usage": usage(generation.prompt_tokens, generation.completion_tokens)}

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


ENDPOINTS = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"


def serve(engine, tokenizer, ctx, host: str, port: int, limits: ServerLimits, *, model_name: str,
          num_blocks: int, api_key: str | None = None) -> int:
    """Serve until SIGTERM / Ctrl-C on rank 0; the other tensor-parallel ranks follow rank 0's worker.
    num_blocks: the paged KV cache's blocks (the same on every rank). Every rank of the replica calls this. Returns
    the process's exit status."""
    import uvicorn

    # batching.py owns the worker and the tensor-parallel broadcast
    from zplan.runtime.inference.batching import Broadcaster, ServingWorker, follow_steps

    if ctx.rank != 0:
        return follow_steps(engine, num_blocks)
    broadcaster = Broadcaster() if ctx.world_size > 1 else None
    worker = ServingWorker(engine, tokenizer.eos_id, limits, broadcaster, device=ctx.device, num_blocks=num_blocks)
    app = create_app(worker, tokenizer, limits, model_name=model_name, api_key=api_key, tp=ctx.world_size)
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown) and raises the signal again when done: this handler
    # receives it then, so that the worker is closed and the other ranks told to stop.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    server = uvicorn.Server(server_config(app, limits))
    try:
        sock = bind_socket(host, port)  # in the try: a failure still stops the other ranks
        worker.start()
        _log(f"serving {model_name!r} on http://{host}:{port} ({ENDPOINTS}{'; API key required' if api_key else ''});"
             f" max batch {engine.max_batch}, max_seq_len {engine.max_seq_len}, tp {ctx.world_size}")
        server.run(sockets=[sock])
    finally:
        stopped_in_step = worker.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _log("server stopped")
    return 0 if server.started and stopped_in_step else 1
