"""The OpenAI-compatible HTTP server (runtime.inference.server) over a deterministic fake worker: completions and
chat completions (plain and streamed), models, health, metrics, every error in OpenAI's shape with its status, a
full queue (429), the API key, stop strings, a client that disconnects (its sequence is cancelled), and an engine
error that fails its request alone.

FakeWorker has ServingWorker's interface (runtime/inference/batching.py): its thread runs one request at a time and
emits tokens by a formula the test computes on its own (expected_tokens); it records what was submitted and
cancelled. uvicorn runs in a thread on a pre-bound loopback socket.
"""

import http.client
import json
import queue
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn

from zplan.runtime.inference.batching import PendingRequest, ServingStats
from zplan.runtime.inference.openai_api import IncrementalText, StopText
from zplan.runtime.inference.sampling import SamplingParams
from zplan.runtime.inference.server import ServerLimits, create_app
from zplan.runtime.inference.tokenizer import ByteTokenizer

EOS = 256  # ByteTokenizer(257).eos_id
MAX_SEQ_LEN = 64
MODEL = "fake-model"
STATS = dict(running=0, waiting=0, kv_blocks_used=3, kv_blocks_total=8, kv_blocks_touched=5, prefix_cache_hit_tokens=16,
             prefix_cache_query_tokens=40, preemptions=2)


def expected_tokens(prompt: str, max_new_tokens: int) -> tuple[list[int], str]:
    """The fake worker's answer, computed independently: letters a..z from the prompt's byte sum; a prompt
    starting with 'stop' ends with EOS after two letters."""
    data = prompt.encode()
    letters = [97 + (sum(data) + step) % 26 for step in range(max_new_tokens)]
    if prompt.startswith("stop") and max_new_tokens > 2:
        return letters[:2] + [EOS], "stop"
    return letters, "length"


def expected_text(prompt: str, max_new_tokens: int) -> str:
    return bytes(t for t in expected_tokens(prompt, max_new_tokens)[0] if t != EOS).decode()


def logprob(step: int) -> float:
    """The fake log-probability of a request's token `step` (exact in binary: survives JSON)."""
    return -(step + 1) / 8


class FakeWorker:
    """ServingWorker's interface: a thread that runs one request at a time, emitting expected_tokens. A prompt
    starting with 'boom' fails at once, 'fail' after two tokens. `gate` holds the thread before each request."""

    def __init__(self, stop_token: int | None, limits: ServerLimits, step_delay_s: float = 0.0):
        self.engine = SimpleNamespace(max_seq_len=MAX_SEQ_LEN, max_batch=4, vocab_size=257, tp=1)
        self.stop_token, self.limits, self.step_delay_s = stop_token, limits, step_delay_s
        self.waiting: queue.Queue[PendingRequest] = queue.Queue()
        self.submitted: list[PendingRequest] = []
        self.cancelled: list[PendingRequest] = []
        self.gate = threading.Event()
        self.gate.set()
        self.taken = threading.Event()  # set when the thread takes a request
        self.running = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, request: PendingRequest) -> None:
        if not self.alive:
            raise RuntimeError("the server is stopping")
        if self.waiting.qsize() >= self.limits.queue_size:
            raise queue.Full
        self.submitted.append(request)
        self.waiting.put(request)

    def cancel(self, request: PendingRequest) -> None:
        with self._lock:
            self.cancelled.append(request)

    def is_cancelled(self, request: PendingRequest) -> bool:
        with self._lock:
            return any(r is request for r in self.cancelled)

    def stats(self) -> ServingStats:
        return ServingStats(**{**STATS, "running": self.running, "waiting": self.waiting.qsize()})

    def close(self, timeout_s: float = 60.0) -> bool:
        self._stop.set()
        self.gate.set()
        self._thread.join(timeout_s)
        while not self.waiting.empty():
            self.waiting.get().push("error", "the server is stopping")
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                request = self.waiting.get(timeout=0.02)
            except queue.Empty:
                continue
            self.taken.set()
            self.gate.wait(20)
            self.running = 1
            self._generate(request)
            self.running = 0

    def _generate(self, request: PendingRequest) -> None:
        prompt = bytes(request.prompt_ids).decode()
        if prompt.startswith("boom"):
            request.push("error", "the fake engine failed")
            return
        tokens, reason = expected_tokens(prompt, request.max_new_tokens)
        for step, token in enumerate(tokens):
            time.sleep(self.step_delay_s)
            if self.is_cancelled(request):
                return
            if prompt.startswith("fail") and step == 2:
                request.push("error", "the model's logits hold NaN")
                return
            request.push("token", (token, logprob(step) if request.logprobs else None))
        if not self.is_cancelled(request):
            request.push("done", reason)


class Server:
    """uvicorn serving create_app(FakeWorker ...) in a thread on a pre-bound loopback socket."""

    def __init__(self, api_key: str | None = None, step_delay_s: float = 0.0, **limit_overrides):
        self.limits = ServerLimits.for_engine(MAX_SEQ_LEN, 4, 8, **limit_overrides)
        self.worker = FakeWorker(EOS, self.limits, step_delay_s)
        self.api_key = api_key
        app = create_app(self.worker, ByteTokenizer(257), self.limits, model_name=MODEL, api_key=api_key)
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.worker.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, headers with lower-case names, body bytes)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        all_headers = {"Content-Type": "application/json"}
        if self.api_key:
            all_headers["Authorization"] = f"Bearer {self.api_key}"
        connection.request(method, path, body=body, headers={**all_headers, **(headers or {})})
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data

    def post(self, path: str, **fields):
        """(status, headers, answer): JSON, or a stream's list of events (chunks, then "[DONE]")."""
        status, headers, data = self.request("POST", path, json.dumps(fields).encode())
        if status == 200 and fields.get("stream"):
            return status, headers, sse_events(data)
        return status, headers, json.loads(data) if data else None

    def complete(self, **fields):
        return self.post("/v1/completions", **fields)

    def chat(self, **fields):
        return self.post("/v1/chat/completions", **fields)

    def close(self):
        self.server.should_exit = True
        self.worker.gate.set()
        self.thread.join(10)
        self.worker.close()


def sse_events(data: bytes) -> list:
    """The `data: ...` events of a server-sent event stream: JSON objects, and "[DONE]"."""
    events = []
    for block in data.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture
def server():
    servers = []

    def start(**overrides):
        servers.append(Server(**overrides))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def shared():
    """One server for the tests that only send bad requests (each server takes ~0.2 s to stop)."""
    s = Server()
    yield s
    s.close()


def in_threads(calls):
    """Run each zero-argument call in its own thread; (threads, results in order)."""
    results = [None] * len(calls)

    def run(i):
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    return threads, results


def wait_until(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def assert_error(body: dict, status: int, param=None, code=None, says: str = ""):
    """OpenAI's error shape, with the type of `status`."""
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    assert body["error"]["type"] == kind
    assert body["error"]["param"] == param and body["error"]["code"] == code, body
    assert says in body["error"]["message"], body


# ---- answers ----------------------------------------------------------------------------------------------------


def test_completion(server):
    s = server()
    status, _, body = s.complete(model=MODEL, prompt="hello there", max_tokens=5, temperature=0)
    assert status == 200
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": expected_text("hello there", 5), "finish_reason": "length",
                                "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}


def test_prompt_as_a_list_of_one_string_and_the_stop_token(server):
    s = server()
    status, _, body = s.complete(prompt=["stop here"], max_tokens=6)
    tokens, reason = expected_tokens("stop here", 6)
    assert status == 200 and reason == "stop" and tokens[-1] == EOS
    assert body["choices"][0]["text"] == expected_text("stop here", 6)  # the end-of-text id has no text
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3  # the stop token counts


def test_sampling_parameters_reach_the_worker(server):
    s = server()
    assert s.complete(prompt="hello", max_tokens=3, temperature=0.7, top_p=0.9, seed=11, user="u", n=1,
                      presence_penalty=0, frequency_penalty=0.0, echo=False)[0] == 200
    request = s.worker.submitted[-1]
    assert request.prompt_ids == list(b"hello") and request.max_new_tokens == 3 and not request.logprobs
    assert request.sampling == SamplingParams(temperature=0.7, top_p=0.9, seed=11, stop_token=EOS)
    # OpenAI's defaults: temperature 1, top_p 1, a seed of its own; max_tokens: the server's, within max_seq_len
    assert s.complete(prompt="x" * 60)[0] == 200
    request = s.worker.submitted[-1]
    assert (request.sampling.temperature, request.sampling.top_p) == (1.0, 1.0)
    assert request.max_new_tokens == MAX_SEQ_LEN - 60  # the default 8 shortened to what fits


def test_completion_logprobs(server):
    s = server()
    status, _, body = s.complete(prompt="abc", max_tokens=4, logprobs=1)
    text = expected_text("abc", 4)
    assert status == 200 and s.worker.submitted[-1].logprobs
    assert body["choices"][0]["logprobs"] == {
        "tokens": list(text), "token_logprobs": [logprob(i) for i in range(4)],
        "top_logprobs": [{c: logprob(i)} for i, c in enumerate(text)], "text_offset": [0, 1, 2, 3]}


def test_streamed_completion(server):
    s = server()
    status, headers, events = s.complete(prompt="stream me", max_tokens=6, stream=True,
                                         stream_options={"include_usage": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    *chunks, finish, usage_chunk, done = events
    assert done == "[DONE]"
    assert all(c["object"] == "text_completion" and c["id"] == finish["id"] for c in [*chunks, finish])
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text("stream me", 6)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * len(chunks)
    assert finish["choices"][0]["finish_reason"] == "length" and finish["usage"] is None
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {"prompt_tokens": 9, "completion_tokens": 6,
                                                                     "total_tokens": 15}
    _, _, events = s.complete(prompt="stop now", max_tokens=6, stream=True)  # no usage chunk without the option
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and "usage" not in events[-2]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text("stop now", 6)


def test_chat_completion(server):
    s = server()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    prompt = "system: Be brief.\nuser: Hi\nassistant: "  # the byte tokenizer's plain chat template
    status, _, body = s.chat(model=MODEL, messages=messages, max_completion_tokens=4)
    assert status == 200 and s.worker.submitted[-1].prompt_ids == list(prompt.encode())
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": expected_text(prompt, 4)},
                                "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4, "total_tokens": len(prompt) + 4}
    assert s.chat(messages=messages, max_tokens=3)[0] == 200 and s.worker.submitted[-1].max_new_tokens == 3
    _, _, body = s.chat(messages=messages, max_tokens=2, logprobs=True, top_logprobs=2)
    first = body["choices"][0]["logprobs"]["content"][0]
    letter = expected_text(prompt, 1)
    assert first == {"token": letter, "logprob": logprob(0), "bytes": list(letter.encode()),
                     "top_logprobs": [{"token": letter, "logprob": logprob(0), "bytes": list(letter.encode())}]}


def test_streamed_chat_completion(server):
    s = server()
    prompt = "user: Hi\nassistant: "
    status, _, events = s.chat(messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
                               stream_options={"include_usage": True})
    assert status == 200
    role, *chunks, finish, usage_chunk, done = events
    assert done == "[DONE]" and role["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == expected_text(prompt, 5)
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["usage"]["completion_tokens"] == 5 and usage_chunk["choices"] == []


def test_models_and_health(server):
    s = server()
    status, _, data = s.request("GET", "/v1/models")
    models = json.loads(data)
    assert status == 200 and models["object"] == "list"
    [model] = models["data"]
    assert model["id"] == MODEL and model["object"] == "model" and model["owned_by"] == "zplan"
    assert model["max_model_len"] == MAX_SEQ_LEN and isinstance(model["created"], int)
    status, _, data = s.request("GET", "/health")
    assert status == 200 and json.loads(data) == {"status": "ok", "model": MODEL, "max_batch": 4,
                                                  "max_seq_len": MAX_SEQ_LEN, "tp": 1, "running": 0, "waiting": 0}


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{labels}': value} of Prometheus' text format; every metric has # HELP and # TYPE lines."""
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            base = name.split("{")[0]
            assert any(base == t or base.startswith(t + "_") for t in typed), line
            samples[name] = float(value)
    return samples


def check_histogram(samples: dict[str, float], name: str) -> int:
    """The histogram's count, after checking its buckets rise and +Inf equals _count."""
    buckets = [(float(key.split('le="')[1].rstrip('"}')), value) for key, value in samples.items()
               if key.startswith(f"{name}_bucket{{")]
    assert buckets and buckets[-1][0] == float("inf")
    assert [b for b, _ in buckets] == sorted(b for b, _ in buckets)
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False))
    assert buckets[-1][1] == samples[f"{name}_count"]
    assert samples[f"{name}_sum"] >= 0
    return int(samples[f"{name}_count"])


def test_metrics(server):
    s = server()
    assert s.complete(prompt="hello", max_tokens=5)[0] == 200
    assert s.complete(prompt="stop it", max_tokens=5, stream=True)[0] == 200  # 3 tokens, stop
    assert s.complete(prompt="boom", max_tokens=5)[0] == 500
    status, headers, data = s.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = parse_metrics(data.decode())
    assert samples["zplan_prompt_tokens_total"] == 5 + 7 + 4
    assert samples["zplan_generation_tokens_total"] == 5 + 3
    assert samples['zplan_requests_total{finish_reason="length"}'] == 1
    assert samples['zplan_requests_total{finish_reason="stop"}'] == 1
    assert samples['zplan_requests_total{finish_reason="error"}'] == 1
    assert samples['zplan_requests_total{finish_reason="abort"}'] == 0
    assert check_histogram(samples, "zplan_time_to_first_token_seconds") == 2
    assert check_histogram(samples, "zplan_time_per_output_token_seconds") == 4 + 2  # between consecutive tokens
    assert samples["zplan_generation_tokens_per_second"] == pytest.approx(8 / 10)  # all within the last 10 s
    for name, value in STATS.items():  # the worker's gauges and counters, as its stats() says
        metric = {"kv_blocks_used": "zplan_kv_cache_blocks_used", "kv_blocks_total": "zplan_kv_cache_blocks_total",
                  "kv_blocks_touched": "zplan_kv_cache_blocks_touched",
                  "preemptions": "zplan_preemptions_total"}.get(name, f"zplan_{name}")
        if name.startswith("prefix"):
            metric += "_total"
        if name not in ("running", "waiting"):
            assert samples[metric] == value, metric
    assert samples["zplan_requests_running"] == 0 and samples["zplan_requests_waiting"] == 0


# ---- stop strings, disconnects, errors ---------------------------------------------------------------------------


def test_a_stop_string_ends_the_text_before_it_and_cancels_the_sequence(server):
    s = server()
    text = expected_text("abc", 12)
    stop = text[4:6]
    status, _, body = s.complete(prompt="abc", max_tokens=12, stop=["never", stop])
    assert status == 200
    assert body["choices"][0]["text"] == text[:4] and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 6  # the tokens up to the end of the stop string
    assert s.worker.cancelled == [s.worker.submitted[-1]]
    _, _, events = s.complete(prompt="abc", max_tokens=12, stop=stop, stream=True)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[:4]  # nothing of the stop string leaks
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    # a stop string that never completes: the text held back while it might is sent at the end
    _, _, events = s.complete(prompt="abc", max_tokens=12, stop=text[10:] + "!", stream=True)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_a_streaming_client_that_disconnects_cancels_its_sequence(server, capfd):
    s = server(step_delay_s=0.05)
    leaver = http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
    leaver.request("POST", "/v1/completions", body=json.dumps({"prompt": "leaving", "max_tokens": 24,
                                                               "stream": True}).encode(),
                   headers={"Content-Type": "application/json"})
    response = leaver.getresponse()
    assert response.readline().startswith(b"data: ")
    leaver.sock.shutdown(socket.SHUT_RDWR)
    leaver.close()
    wait_until(lambda: s.worker.cancelled == s.worker.submitted[:1])
    assert s.complete(prompt="next", max_tokens=3)[2]["choices"][0]["text"] == expected_text("next", 3)
    assert "disconnected after" in capfd.readouterr().err


def test_a_plain_client_that_disconnects_cancels_its_sequence(server):
    s = server()
    s.worker.gate.clear()  # no token comes: the request waits, polling its connection
    leaver = socket.create_connection(("127.0.0.1", s.port), timeout=20)
    body = b'{"prompt": "leaving", "max_tokens": 4}'
    leaver.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
    wait_until(lambda: len(s.worker.submitted) == 1)
    leaver.close()
    wait_until(lambda: s.worker.cancelled == s.worker.submitted)
    s.worker.gate.set()
    assert s.complete(prompt="next", max_tokens=3)[0] == 200


def test_an_engine_error_fails_its_request_alone(server):
    s = server()
    status, _, body = s.complete(prompt="boom", max_tokens=3)
    assert status == 500
    assert_error(body, 500, says="generation failed: the fake engine failed")
    assert s.complete(prompt="boom", max_tokens=3, stream=True)[0] == 500  # before the stream started
    status, _, events = s.complete(prompt="fail streaming", max_tokens=5, stream=True)
    assert status == 200 and "".join(e["choices"][0]["text"] for e in events[:2]) == expected_text("fail streaming", 2)
    assert_error(events[2], 500, says="the model's logits hold NaN")
    assert events[3:] == ["[DONE]"]
    assert s.request("GET", "/health")[0] == 200
    status, _, body = s.complete(prompt="after", max_tokens=4)
    assert status == 200 and body["choices"][0]["text"] == expected_text("after", 4)


def test_a_full_queue_is_429_with_retry_after(server):
    s = server(queue_size=2)
    s.worker.gate.clear()
    first, first_results = in_threads([lambda: s.complete(prompt="first", max_tokens=2)])
    wait_until(s.worker.taken.is_set)  # the worker holds the first at its gate
    more, results = in_threads([lambda p=p: s.complete(prompt=p, max_tokens=2) for p in ("second", "third")])
    wait_until(lambda: s.worker.waiting.qsize() == 2)
    status, headers, body = s.complete(prompt="fourth", max_tokens=2)
    assert status == 429 and headers["retry-after"] == "1"
    assert_error(body, 429, code="queue_full", says="2 requests already waiting")
    s.worker.gate.set()
    for t in first + more:
        t.join(20)
    assert [r[0] for r in first_results + results] == [200, 200, 200]


def test_a_stopping_server_is_503_with_retry_after(server):
    s = server()
    s.worker.close()
    status, headers, body = s.complete(prompt="late", max_tokens=2)
    assert status == 503 and headers["retry-after"] == "1"
    assert_error(body, 503, code="stopping", says="stopping")
    assert s.request("GET", "/health")[0] == 503


def test_the_api_key(server):
    s = server(api_key="sekrit")
    assert s.request("GET", "/v1/models")[0] == 200
    assert s.complete(prompt="hi", max_tokens=2)[0] == 200
    for headers, says in [({"Authorization": ""}, "invalid API key"), ({"Authorization": "Bearer wrong"},
                                                                         "invalid API key"),
                          ({"Authorization": "Basic sekrit"}, "invalid API key")]:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                             ("GET", "/no/such/path")]:
            status, response_headers, data = s.request(method, path, b'{"prompt": "hi"}', headers)
            assert status == 401 and response_headers["www-authenticate"] == "Bearer"
            assert_error(json.loads(data), 401, code="invalid_api_key", says=says)
    s.api_key = None  # no Authorization header at all
    status, _, data = s.request("GET", "/v1/models")
    assert status == 401 and "no API key" in json.loads(data)["error"]["message"]
    assert s.request("GET", "/health")[0] == 200  # open without a key


def test_oversized_body_is_413(server):
    s = server(max_body_bytes=2048)
    status, _, data = s.request("POST", "/v1/completions", json.dumps({"prompt": "y" * 4000}).encode())
    assert status == 413
    assert_error(json.loads(data), 413, says="2048 bytes")
    # the same without Content-Length: a chunked body is counted while it is read
    connection = http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
    chunks = iter([b'{"prompt": "', b"z" * 3000, b'"}'])
    connection.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                       headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    response = connection.getresponse()
    assert response.status == 413
    assert_error(json.loads(response.read()), 413, says="2048 bytes")
    connection.close()
    assert s.complete(prompt="small", max_tokens=2)[0] == 200


HI = [{"role": "user", "content": "hi"}]
# (path, body, status, param, code, what the message says)
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "unterminated', 400, None, None, "not valid JSON"),
    ("/v1/completions", b'["a list"]', 400, None, None, "must be a JSON object"),
    ("/v1/completions", b'{"prompt": "\xff\xfe hi"}', 400, None, None, "not UTF-8 (invalid start byte at byte 12)"),
    ("/v1/completions", b'{"max_tokens": 4}', 400, "prompt", None, "prompt: Field required; prompt must be"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt", None, "a string of 1 to 64 characters"),
    ("/v1/completions", b'{"prompt": 12}', 400, "prompt", None, "prompt must be a string"),
    ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt", None, "a list of exactly one such string"),
    ("/v1/completions", b'{"prompt": "a", "top_k": 40}', 400, "top_k", None, "top_k: unknown field; the fields are"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": "5"}', 400, "max_tokens", None,
     "max_tokens must be an integer, 1 <= max_tokens <= 63"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 0}', 400, "max_tokens", None, "1 <= max_tokens <= 63"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 64}', 400, "max_tokens", None, "1 <= max_tokens <= 63"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": true}', 400, "max_tokens", None, "an integer"),
    ("/v1/completions", b'{"prompt": "a", "temperature": -0.5}', 400, "temperature", None,
     "temperature must be a finite number, 0 <= temperature <= 10"),
    ("/v1/completions", b'{"prompt": "a", "temperature": 1000}', 400, "temperature", None, "<= 10"),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "temperature", None, "finite"),
    ("/v1/completions", b'{"prompt": "a", "temperature": Infinity}', 400, "temperature", None, "finite"),
    ("/v1/completions", b'{"prompt": "a", "top_p": 0}', 400, "top_p", None, "0 < top_p <= 1"),
    ("/v1/completions", b'{"prompt": "a", "top_p": 1.5}', 400, "top_p", None, "0 < top_p <= 1"),
    ("/v1/completions", b'{"prompt": "a", "seed": -1}', 400, "seed", None, "0 <= seed <= 9223372036854775807"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop", None,
     "a list of 1 to 4 non-empty strings"),
    ("/v1/completions", b'{"prompt": "a", "stop": ""}', 400, "stop", None, "non-empty"),
    ("/v1/completions", b'{"prompt": "a", "n": 2}', 400, "n", None, "n must be 1"),
    ("/v1/completions", b'{"prompt": "a", "echo": true}', 400, "echo", None, "echo must be false"),
    ("/v1/completions", b'{"prompt": "a", "logprobs": 6}', 400, "logprobs", None, "0 <= logprobs <= 5"),
    ("/v1/completions", b'{"prompt": "a", "logprobs": true}', 400, "logprobs", None, "an integer"),
    ("/v1/completions", b'{"prompt": "a", "presence_penalty": 0.5}', 400, "presence_penalty", None, "must be 0"),
    ("/v1/completions", b'{"prompt": "a", "frequency_penalty": -1}', 400, "frequency_penalty", None, "must be 0"),
    ("/v1/completions", b'{"prompt": "a", "stream": "yes"}', 400, "stream", None, "true or false"),
    ("/v1/completions", b'{"prompt": "a", "stream_options": {"include_usage": true}}', 400, "stream_options", None,
     "only with stream true"),
    ("/v1/completions", b'{"prompt": "a", "stream": true, "stream_options": {"usage": 1}}', 400, "stream_options",
     None, "stream_options.usage: Extra inputs"),
    ("/v1/completions", b'{"prompt": "a", "model": "gpt-4"}', 404, "model", "model_not_found", "'gpt-4'"),
    ("/v1/completions", b'{"prompt": "' + b"x" * 60 + b'", "max_tokens": 5}', 400, "prompt",
     "context_length_exceeded", "maximum context length is 64 tokens"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages", None, "messages must be a list"),
    ("/v1/chat/completions", b'{"model": "' + MODEL.encode() + b'"}', 400, "messages", None, "Field required"),
    ("/v1/chat/completions", b'{"messages": [{"role": "bot", "content": "x"}]}', 400, "messages", None,
     "messages[0].role: Input should be 'system', 'user' or 'assistant'"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages", None,
     "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "messages", None, "messages[0].content[0]"),
    ("/v1/chat/completions", json.dumps({"messages": HI, "max_completion_tokens": 0}).encode(), 400,
     "max_completion_tokens", None, "1 <= max_completion_tokens <= 63"),
    ("/v1/chat/completions", json.dumps({"messages": HI, "logprobs": 1}).encode(), 400, "logprobs", None,
     "true or false"),
    ("/v1/chat/completions", json.dumps({"messages": HI, "echo": False}).encode(), 400, "echo", None,
     "unknown field"),
    ("/v1/chat/completions", json.dumps({"messages": HI, "model": "other"}).encode(), 404, "model",
     "model_not_found", "does not exist"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x" * 50}],
                                         "max_tokens": 10}).encode(), 400, "messages", "context_length_exceeded",
     "maximum context length is 64 tokens"),
]


@pytest.mark.parametrize("path,body,status,param,code,says", BAD_REQUESTS,
                         ids=[f"{p.split('/')[-1]}:{b[:60].decode(errors='replace')}" for p, b, *_ in BAD_REQUESTS])
def test_a_bad_request_is_an_openai_error_naming_its_field(shared, path, body, status, param, code, says):
    got, _, data = shared.request("POST", path, body)
    assert got == status, data
    assert_error(json.loads(data), status, param, code, says)
    assert shared.worker.submitted == []


def test_every_bad_field_at_once_is_one_error_naming_each(shared):
    s = shared
    body = b'{"prompt": 1, "max_tokens": 0, "temperature": NaN, "top_p": 2, "seed": -1, "stream": "no", "x": 1}'
    status, _, data = s.request("POST", "/v1/completions", body)
    assert status == 400
    lines = json.loads(data)["error"]["message"].splitlines()
    assert [line.split(":")[0] for line in lines] == ["prompt", "max_tokens", "temperature", "top_p", "seed",
                                                      "stream", "x"]


@pytest.mark.parametrize("method,path,status,says", [
    ("POST", "/v1/generate", 404, "no such endpoint: POST /v1/generate"),  # the retired API
    ("GET", "/nowhere", 404, "no such endpoint"),
    ("GET", "/v1/completions", 405, "GET is not allowed on /v1/completions"),
    ("POST", "/v1/models", 405, "POST is not allowed"),
])
def test_unknown_routes_and_methods_are_openai_errors(shared, method, path, status, says):
    got, _, data = shared.request(method, path, b"{}")
    assert got == status
    assert_error(json.loads(data), status, says=says)


# ---- text -------------------------------------------------------------------------------------------------------


def test_incremental_text_holds_back_an_incomplete_utf8_character():
    text = "é€a"
    pieces = IncrementalText(ByteTokenizer(256).decode)
    deltas = [pieces.add(byte) for byte in text.encode()]
    assert deltas == ["", "é", "", "", "€", "a"]
    pieces.add(0xE2)  # a character cut short stays U+FFFD at the end
    assert pieces.finish() == "\ufffd"


def test_stop_text_holds_back_what_may_begin_a_stop_string():
    stop = StopText(["END", "xy"])
    assert [stop.add(piece) for piece in ["ab", "cE", "N", "d", "x"]] == ["ab", "c", "", "ENd", ""]
    assert stop.finish() == "x" and not stop.stopped
    stop = StopText(["END"])
    assert [stop.add(piece) for piece in ["aE", "NDb", "more"]] == ["a", "", ""]
    assert stop.stopped and stop.text == "a" and stop.finish() == ""


def test_chat_prompt_uses_the_tokenizers_chat_template_when_it_has_one(tmp_path):
    """HfTokenizer.chat_prompt: the folder's chat template with the generation prompt, else the plain template."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from zplan.runtime.inference.tokenizer import HfTokenizer

    letters = ["<unk>", "<eos>", *"abcdefghijklmnopqrstuvwxyz:<>| \n"]
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({c: i for i, c in enumerate(letters)}, "<unk>"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    messages = [{"role": "user", "content": "hi"}]
    for template, text in [(None, "user: hi\nassistant: "),
                           ("{% for m in messages %}<{{ m['role'] }}|{{ m['content'] }}>{% endfor %}"
                            "{% if add_generation_prompt %}<assistant|{% endif %}", "<user|hi><assistant|")]:
        folder = tmp_path / ("plain" if template is None else "template")
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>", unk_token="<unk>")
        if template:
            fast.chat_template = template
        fast.save_pretrained(folder)
        assert HfTokenizer(folder, len(letters)).chat_prompt(messages) == [letters.index(c) for c in text]


def test_serve_options_api_key_and_model_name(monkeypatch, tmp_path):
    from zplan.runtime.inference.cli import _serve_parser, served_model_name

    monkeypatch.setenv("ZPLAN_API_KEY", "from-env")
    args = _serve_parser(8).parse_args([])
    assert args.api_key == "from-env" and args.model_name is None
    assert _serve_parser(8).parse_args(["--api-key", "k"]).api_key == "k"
    monkeypatch.delenv("ZPLAN_API_KEY")
    assert _serve_parser(8).parse_args([]).api_key is None
    (tmp_path / "llama-tiny").mkdir()
    assert served_model_name(args, tmp_path / "llama-tiny") == "llama-tiny"  # a Hugging Face folder
    assert served_model_name(args, tmp_path / "gpt.py") == "gpt"  # a model file
    assert served_model_name(args, None) == "zplan"
    assert served_model_name(_serve_parser(8).parse_args(["--model-name", "mine"]), tmp_path) == "mine"
