"""The load side of benchmarks/serving.py: a workload of timed requests, a streaming client for OpenAI
`POST /v1/completions` (server-sent events over HTTP/1.1, on the standard library's asyncio streams: no
client package), the metrics of a run, and the soak (many clients back to back for a while).

    requests = make_workload(tokenizer, words, n=64, rate=4.0, seed=0)
    outcomes, _ = asyncio.run(run_workload("127.0.0.1", port, model, requests))
    metrics(outcomes)   # throughput, time to first token p50/p99, time per output token p50, failures

Times are time.perf_counter() seconds. An Outcome is what one request got, whether a server answered it or an
in-process baseline simulated it in virtual time (serving.py): the metrics read Outcomes only.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

REJECTED = (429, 503)  # a server too busy to take the request: counted apart from the lost ones
CONNECT_TIMEOUT_S = 30.0


# ---- workload -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    index: int
    arrival_s: float  # seconds after the workload's start
    prompt: str  # text sent
    prompt_ids: tuple[int, ...]  # the prompt as the tokenizer encodes it (what a server sees)
    max_tokens: int  # completion tokens asked for


def prompt_of_length(tokenizer, words: list[str], length: int, rng: random.Random) -> tuple[str, list[int]]:
    """Random words trimmed to `length` tokens, decoded to text; (text, its ids re-encoded). Re-encoding a trimmed
    text may differ from `length` by a token or so (the last word may merge differently)."""
    text = " ".join(rng.choice(words) for _ in range(length))  # every word is at least one token
    ids = tokenizer(text)["input_ids"][:length]
    text = tokenizer.decode(ids, skip_special_tokens=True).strip()
    return text, tokenizer(text)["input_ids"]


def make_workload(tokenizer, words: list[str], *, n: int, rate: float, seed: int,
                  prompt_tokens: tuple[int, int] = (16, 256), output_tokens: tuple[int, int] = (16, 128)
                  ) -> list[Request]:
    """n requests arriving as a Poisson process of `rate` requests/s (the first at 0 s), prompt and output lengths
    uniform over the inclusive ranges (tokens); all seeded."""
    rng = random.Random(seed)
    requests, arrival_s = [], 0.0
    for index in range(n):
        prompt, ids = prompt_of_length(tokenizer, words, rng.randint(*prompt_tokens), rng)
        requests.append(Request(index, arrival_s, prompt, tuple(ids), rng.randint(*output_tokens)))
        arrival_s += rng.expovariate(rate)
    return requests


# ---- one streamed request -----------------------------------------------------------------------------------


@dataclass
class StreamResult:
    """What the client saw of one streamed completion."""

    send_s: float = 0.0  # when the request was written
    end_s: float = 0.0  # when the response ended (or failed)
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None  # transport error, an error event, or the body of a non-200 answer
    text: str = ""  # the completion's text, chunks joined
    token_times_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    finish_chunks: int = 0  # chunks with a finish_reason (1 when all is well)
    finish_reason: str | None = None
    usage_tokens: int | None = None  # usage.completion_tokens when the server sent usage
    done_markers: int = 0  # "data: [DONE]" events
    after_done: int = 0  # events after the first [DONE] (a second [DONE] included)

    @property
    def completion_tokens(self) -> int:
        """usage.completion_tokens, else the number of text chunks (one token each with a byte-level tokenizer
        on ASCII text)."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times_s)

    def finished(self, require_done: bool) -> bool:
        """A final chunk came (and [DONE], when required), with no error."""
        return (self.status == 200 and self.error is None and self.finish_chunks >= 1
                and (self.done_markers >= 1 or not require_done))


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection before answering")
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The body's bytes as they arrive: chunked transfer encoding, Content-Length, or up to the close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # CRLF after the chunk
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece


def _take_event(result: StreamResult, payload: str, now_s: float) -> None:
    """Apply one SSE event's data to result."""
    if result.done_markers:
        result.after_done += 1
    if payload.strip() == "[DONE]":
        result.done_markers += 1
        return
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        result.error = result.error or f"an event is not JSON: {payload[:200]!r}"
        return
    if "error" in event:
        result.error = result.error or f"error event: {str(event['error'])[:300]}"
    for choice in event.get("choices") or []:
        if choice.get("text"):
            result.text += choice["text"]
            result.token_times_s.append(now_s)
        if choice.get("finish_reason"):
            result.finish_chunks += 1
            result.finish_reason = choice["finish_reason"]
    if event.get("usage"):
        result.usage_tokens = event["usage"].get("completion_tokens")


def _parse_events(buffer: bytes, result: StreamResult, now_s: float) -> bytes:
    """Apply every complete event in buffer (events end with a blank line); return the incomplete rest."""
    buffer = buffer.replace(b"\r\n", b"\n")
    *events, rest = buffer.split(b"\n\n")
    for event in events:
        data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            _take_event(result, b"\n".join(data).decode("utf-8", errors="replace"), now_s)
    return rest


async def stream_completion(host: str, port: int, body: dict, *, timeout_s: float) -> StreamResult:
    """POST body to /v1/completions (one connection, closed after) and read the event stream to its end."""
    result = StreamResult()
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
        data = json.dumps(body).encode()
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                     .encode() + data)
        await writer.drain()
        result.send_s = time.perf_counter()
        await asyncio.wait_for(_read_response(reader, result), timeout_s)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError) as error:
        result.error = result.error or f"{type(error).__name__}: {error}"
    finally:
        result.end_s = time.perf_counter()
        if not result.send_s:
            result.send_s = result.end_s
        if writer is not None:
            writer.close()
    return result


async def _read_response(reader: asyncio.StreamReader, result: StreamResult) -> None:
    result.status, headers = await _read_head(reader)
    if result.status != 200:
        body = b"".join([piece async for piece in _body_pieces(reader, headers)])
        result.error = f"HTTP {result.status}: {body[:300].decode('utf-8', errors='replace')}"
        return
    buffer = b""
    async for piece in _body_pieces(reader, headers):
        buffer = _parse_events(buffer + piece, result, time.perf_counter())
    if buffer.strip():
        _parse_events(buffer + b"\n\n", result, time.perf_counter())


def completion_body(model: str, prompt: str, max_tokens: int) -> dict:
    """A greedy streamed completion asking for the usage chunk at the end."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


# ---- a workload against a server ----------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request's timeline (perf_counter seconds, or virtual seconds for the in-process baselines)."""

    arrival_s: float
    token_times_s: list[float]  # when each token (or text chunk) arrived
    completion_tokens: int
    ok: bool
    end_s: float
    text: str = ""
    tokens: list[int] | None = None  # the token ids, where the baseline has them
    error: str | None = None


def outcome_of(result: StreamResult) -> Outcome:
    return Outcome(result.send_s, result.token_times_s, result.completion_tokens, result.finished(False),
                   result.end_s, result.text, error=result.error)


async def run_workload(host: str, port: int, model: str, requests: list[Request], *,
                       timeout_s: float) -> tuple[list[Outcome], list[StreamResult]]:
    """Send each request at its arrival time (seconds after now), all streaming; one Outcome per request."""
    start_s = time.perf_counter()

    async def one(request: Request) -> StreamResult:
        await asyncio.sleep(max(0.0, start_s + request.arrival_s - time.perf_counter()))
        return await stream_completion(host, port, completion_body(model, request.prompt, request.max_tokens),
                                       timeout_s=timeout_s)

    results = await asyncio.gather(*(one(r) for r in requests))
    return [outcome_of(r) for r in results], list(results)


# ---- metrics ------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the nearest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def metrics(outcomes: list[Outcome]) -> dict:
    """throughput: completion tokens of the finished requests / seconds from the first arrival to the last end;
    TTFT: first token - arrival (s); TPOT: (last token - first token) / (tokens - 1) of each request with 2+ tokens
    (s); failed: requests that did not finish."""
    done = [o for o in outcomes if o.ok]
    tokens = sum(o.completion_tokens for o in done)
    wall_s = max(o.end_s for o in outcomes) - min(o.arrival_s for o in outcomes)
    ttft = [o.token_times_s[0] - o.arrival_s for o in done if o.token_times_s]  # none: only an end-of-text token
    tpot = [(o.token_times_s[-1] - o.token_times_s[0]) / (o.completion_tokens - 1)
            for o in done if o.token_times_s and o.completion_tokens > 1]
    errors = Counter((o.error or "no final chunk")[:120] for o in outcomes if not o.ok)
    return {"throughput_tokens_per_s": _rounded(tokens / wall_s if wall_s > 0 else None, 2),
            "completion_tokens": tokens, "wall_s": _rounded(wall_s, 2),
            "ttft_p50_s": _rounded(percentile(ttft, 50)), "ttft_p99_s": _rounded(percentile(ttft, 99)),
            "tpot_p50_s": _rounded(percentile(tpot, 50)), "requests": len(outcomes),
            "requests_failed": len(outcomes) - len(done), "failures": dict(errors.most_common(5))}


# ---- soak ---------------------------------------------------------------------------------------------------


@dataclass
class SoakTally:
    completed: int = 0
    rejected: int = 0  # 429/503 answers
    lost: int = 0  # sent, never finished (final chunk + [DONE]), not rejected
    duplicated: int = 0  # events after the first [DONE], and finish chunks after the first
    completion_tokens: int = 0
    lost_reasons: Counter = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)

    def add(self, result: StreamResult, require_done: bool) -> None:
        self.duplicated += result.after_done + max(0, result.finish_chunks - 1)
        if result.status in REJECTED:
            self.rejected += 1
        elif result.finished(require_done):
            self.completed += 1
            self.completion_tokens += result.completion_tokens
            if result.token_times_s:
                self.ttft_s.append(result.token_times_s[0] - result.send_s)
        else:
            self.lost += 1
            reason = result.error or ("no [DONE]" if result.finish_chunks else "no final chunk")
            self.lost_reasons[reason[:120]] += 1


async def soak(host: str, port: int, model: str, prompts: list[tuple[str, int]], *, clients: int, seconds: float,
               warmup_s: float, rss_bytes: Callable[[], int], require_done: bool, timeout_s: float) -> dict:
    """`clients` streaming clients, each sending (prompt, max_tokens) from `prompts` back to back until `seconds`
    have passed (a request under way then runs to its end); after a 429/503 a client waits 0.2 s. The server's
    resident memory (rss_bytes(), bytes) is read after warmup_s and at the end."""
    tally = SoakTally()
    start_s = time.perf_counter()
    deadline_s = start_s + seconds
    rss: dict[str, int] = {}

    async def client(k: int) -> None:
        sent = 0
        while time.perf_counter() < deadline_s:
            prompt, max_tokens = prompts[(k * 7919 + sent) % len(prompts)]
            sent += 1
            result = await stream_completion(host, port, completion_body(model, prompt, max_tokens),
                                             timeout_s=timeout_s)
            tally.add(result, require_done)
            if result.status in REJECTED:
                await asyncio.sleep(0.2)

    async def read_warm_rss() -> None:
        await asyncio.sleep(warmup_s)
        rss["warm"] = rss_bytes()

    warm = asyncio.create_task(read_warm_rss())
    await asyncio.gather(*(client(k) for k in range(clients)))
    elapsed_s = time.perf_counter() - start_s
    if not warm.done():  # a run shorter than the warm-up
        warm.cancel()
        rss["warm"] = rss_bytes()
    rss["end"] = rss_bytes()
    return {"clients": clients, "seconds": round(elapsed_s, 1), "completed": tally.completed,
            "rejected": tally.rejected, "lost": tally.lost, "duplicated": tally.duplicated,
            "lost_reasons": dict(tally.lost_reasons.most_common(5)),
            "completion_tokens_per_s": round(tally.completion_tokens / elapsed_s, 2),
            "ttft_p99_s": _rounded(percentile(tally.ttft_s, 99)),
            "rss_after_warmup_bytes": rss["warm"], "rss_end_bytes": rss["end"],
            "rss_growth_bytes": rss["end"] - rss["warm"]}
