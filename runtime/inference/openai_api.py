"""The OpenAI-compatible shapes of the inference server (runtime/inference/server.py): errors, the answers and
stream chunks of /v1/completions and /v1/chat/completions, and the text a stream releases (incomplete UTF-8 and
a possible stop string held back).

Every error is {"error": {"message", "type", "param", "code"}} with its HTTP status, FastAPI's own 404, 405 and
validation errors included (install_error_handlers).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error"}  # any other status: server_error


class ApiError(Exception):
    """An OpenAI-shaped error answer: status, message, param (the field at fault), code, extra headers."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, code=self.code, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """ApiError, and FastAPI's HTTP and validation errors (unknown route 404, wrong method 405, a 413 from the
    body limit), answered in OpenAI's error shape."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        if error.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        return error_response(error.status_code, message, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):  # a bug: Starlette logs its traceback too
        return error_response(500, f"internal server error: {type(error).__name__}: {error}")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        return error_response(400, f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid')}",
                              param=loc[0] if loc else None)


# ---- text --------------------------------------------------------------------------------------------------


class IncrementalText:
    """The text of a growing token list, released only where it is final: text ending in U+FFFD may end in an
    incomplete UTF-8 character that the next token completes. Each step decodes only the tokens since the one
    before the last release (as vLLM's detokenizer does), not the whole list."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.tokens, self.released = decode, [], ""
        self._prefix = self._read = 0  # tokens[_prefix:_read]: the context of the last release

    def add(self, token: int) -> str:
        """Add a token; the text it makes final ("" while a character is incomplete)."""
        self.tokens.append(token)
        before, text = self._window()
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""
        delta = text[len(before):]
        self._prefix, self._read = self._read, len(self.tokens)
        self.released += delta
        return delta

    def finish(self) -> str:
        """The text not released yet, at the end (a character left incomplete stays U+FFFD)."""
        before, text = self._window()
        rest = text[len(before):] if text.startswith(before) else ""
        self._prefix = self._read = len(self.tokens)
        self.released += rest
        return rest

    def _window(self) -> tuple[str, str]:
        return self.decode(self.tokens[self._prefix:self._read]), self.decode(self.tokens[self._prefix:])


class StopText:
    """Text sent to a client that asked for stop strings: the text ends before the first stop string found, and
    text that may be the start of one is held back until it is known not to be."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.sent = stops, "", 0
        self.longest = max((len(s) for s in stops), default=0)
        self.stopped = False

    def add(self, delta: str) -> str:
        """Add text; the part of it that can be sent now. Sets `stopped` when a stop string was found."""
        if self.stopped:
            return ""
        self.text += delta
        # a match cannot start in text already sent: such a start was held back
        found = [at for at in (self.text.find(s, self.sent) for s in self.stops) if at >= 0]
        if found:
            end, self.stopped = min(found), True
            self.text = self.text[:end]
        else:
            end = len(self.text)
            for start in range(max(self.sent, len(self.text) - self.longest + 1), len(self.text)):
                tail = self.text[start:]
                if any(s.startswith(tail) for s in self.stops):
                    end = start
                    break
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> str:
        """The text held back, at the end of the generation."""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


# ---- answers -----------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[tuple[str, float | None, int]]) -> dict:
    """/v1/completions' logprobs of tokens [(text, logprob, offset in the completion's text), ...]; top_logprobs
    holds the chosen token only."""
    return {"tokens": [text for text, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text: lp} for text, lp, _ in entries], "text_offset": [at for _, _, at in entries]}


def chat_logprobs(entries: list[tuple[str, float | None, int]]) -> dict:
    """/v1/chat/completions' logprobs of tokens [(text, logprob, offset), ...]; top_logprobs holds the chosen token
    only."""
    content = []
    for text, lp, _ in entries:
        token = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        content.append({**token, "top_logprobs": [token]})
    return {"content": content}


def sse(payload: dict | str) -> bytes:
    """One server-sent event: `data: JSON\\n\\n` (or `data: [DONE]\\n\\n`)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
