"""The HTTP server (runtime.inference.server) over a deterministic fake engine: batching, streaming and plain
answers, validation (400/413/422), a full queue (503), an engine error (500, then the server goes on), a
client that disconnects mid-stream, and the broadcast of batches to other tensor-parallel ranks.

The fake engine has the real engine's stream() API; its tokens follow a formula the test computes on its own
(expected_tokens), and it records each batch it ran. uvicorn runs in a thread on a loopback socket.
"""

import http.client
import json
import socket
import threading
import time

import pytest
import uvicorn

from zplan.runtime.inference.sampling import SamplingFailure, SamplingParams
from zplan.runtime.inference.server import BatchWorker, IncrementalText, ServerLimits, create_app
from zplan.runtime.inference.tokenizer import ByteTokenizer

EOS = 256  # ByteTokenizer(257).eos_id
MAX_SEQ_LEN = 32


def expected_tokens(prompt: str, max_new_tokens: int) -> tuple[list[int], str]:
    """The fake engine's answer, computed independently: letters a..z from the prompt's byte sum; a prompt
    starting with 'stop' ends with EOS after two letters."""
    data = prompt.encode()
    letters = [97 + (sum(data) + step) % 26 for step in range(max_new_tokens)]
    if prompt.startswith("stop") and max_new_tokens > 2:
        return letters[:2] + [EOS], "stop"
    return letters, "length"


class FakeEngine:
    """engine.stream's contract: one list per decode step, a token per sequence, None once it is finished."""

    def __init__(self, max_batch: int = 4, step_delay_s: float = 0.0):
        self.max_batch, self.max_seq_len, self.vocab_size, self.tp = max_batch, MAX_SEQ_LEN, 257, 1
        self.batches: list[list[list[int]]] = []  # the prompts of every stream() call
        self.sampling: list[list[SamplingParams]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()  # set when a stream() begins
        self.step_delay_s = step_delay_s

    def stream(self, prompts, max_new_tokens, sampling):
        assert len(prompts) <= self.max_batch
        self.batches.append([list(p) for p in prompts])
        self.sampling.append(list(sampling))
        self.started.set()
        self.gate.wait(10)
        if any(bytes(p).startswith(b"boom") for p in prompts):
            raise RuntimeError("the fake engine failed")
        answers = [expected_tokens(bytes(p).decode(), n)[0] for p, n in zip(prompts, max_new_tokens, strict=True)]
        for b, prompt in enumerate(prompts):  # a prompt starting with 'fail' cannot be sampled after two tokens
            if bytes(prompt).startswith(b"fail"):
                answers[b] = answers[b][:2] + [SamplingFailure("the model's logits hold NaN")]
        for step in range(max(len(a) for a in answers)):
            time.sleep(self.step_delay_s)
            yield [a[step] if step < len(a) else None for a in answers]


class Server:
    """uvicorn serving create_app(...) in a thread on a pre-bound loopback socket."""

    def __init__(self, engine: FakeEngine, broadcaster=None, **limit_overrides):
        self.engine = engine
        self.limits = ServerLimits.for_engine(MAX_SEQ_LEN, engine.max_batch, 8, **limit_overrides)
        self.worker = BatchWorker(engine, EOS, self.limits, broadcaster)
        app = create_app(self.worker, ByteTokenizer(257), self.limits)
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.worker.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, headers, body bytes)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        connection.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response.status, dict(response.getheaders()), data

    def generate(self, **fields):
        status, headers, data = self.request("POST", "/v1/generate", json.dumps(fields).encode())
        return status, headers, (json.loads(data) if not fields.get("stream") or status != 200 else
                                 [json.loads(line) for line in data.decode().splitlines()])

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.worker.close()


@pytest.fixture
def server():
    servers = []

    def start(engine=None, **overrides):
        servers.append(Server(engine or FakeEngine(), **overrides))
        return servers[-1]

    yield start
    for s in servers:
        s.engine.gate.set()
        s.close()


def in_threads(calls):
    """Run each zero-argument call in its own thread; their results in order."""
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


def test_waiting_requests_run_as_one_batch(server):
    s = server(FakeEngine(max_batch=4))
    s.engine.gate.clear()
    prompts = [f"prompt number {i}" for i in range(6)]
    first_threads, first = in_threads([lambda: s.generate(prompt=prompts[0], max_new_tokens=5)])
    wait_until(s.engine.started.is_set)  # the worker runs the first request alone and waits at the gate
    threads, rest = in_threads([lambda p=p: s.generate(prompt=p, max_new_tokens=5) for p in prompts[1:]])
    wait_until(lambda: s.worker.waiting.qsize() == 5)
    s.engine.gate.set()
    for t in first_threads + threads:
        t.join(20)
    assert [len(b) for b in s.engine.batches] == [1, 4, 1]  # max_batch 4 of the 5 waiting, then the last
    for prompt, (status, _, body) in zip(prompts, first + rest, strict=True):
        tokens, reason = expected_tokens(prompt, 5)
        assert status == 200
        assert body == {"text": bytes(tokens).decode(), "tokens": tokens, "finish_reason": reason,
                        "usage": {"prompt_tokens": len(prompt.encode()), "completion_tokens": 5}}


def test_sampling_parameters_reach_the_engine(server):
    s = server()
    status, _, _ = s.generate(prompt="hello", max_new_tokens=3, temperature=0.7, top_p=0.9, seed=11)
    assert status == 200
    assert s.engine.sampling[-1] == [SamplingParams(temperature=0.7, top_p=0.9, seed=11, stop_token=EOS)]


def test_streaming_answer_has_one_line_per_token_then_the_summary(server):
    s = server()
    status, headers, lines = s.generate(prompt="stream me", max_new_tokens=6, stream=True)
    tokens, _ = expected_tokens("stream me", 6)
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    assert [line["token"] for line in lines[:-1]] == tokens
    assert "".join(line["text"] for line in lines[:-1]) == bytes(tokens).decode()
    assert lines[-1] == {"text": bytes(tokens).decode(), "tokens": tokens, "finish_reason": "length",
                         "usage": {"prompt_tokens": 9, "completion_tokens": 6}}


def test_stop_token_ends_with_finish_reason_stop(server):
    s = server()
    status, _, body = s.generate(prompt="stop here", max_new_tokens=6)
    tokens, reason = expected_tokens("stop here", 6)
    assert status == 200 and reason == "stop" and tokens[-1] == EOS
    assert body["tokens"] == tokens and body["finish_reason"] == "stop"
    assert body["text"] == bytes(tokens[:-1]).decode()  # the end-of-text id has no text
    _, _, lines = s.generate(prompt="stop here", max_new_tokens=6, stream=True)
    assert lines[-1]["finish_reason"] == "stop" and lines[-1]["tokens"] == tokens


def test_prompt_too_long_for_the_kv_cache_is_400(server):
    s = server()
    status, _, body = s.generate(prompt="x" * 30, max_new_tokens=5)
    assert status == 400
    assert "30 tokens" in body["detail"] and "max_new_tokens 5" in body["detail"]
    assert f"max_seq_len {MAX_SEQ_LEN}" in body["detail"]
    assert s.generate(prompt="x" * 27, max_new_tokens=5)[0] == 200  # 27 + 5 = 32 fits exactly


def test_oversized_body_is_413(server):
    s = server(max_body_bytes=2048)
    status, _, body = s.request("POST", "/v1/generate", json.dumps({"prompt": "y" * 4000}).encode())
    assert status == 413 and "2048 bytes" in json.loads(body)["detail"]
    # the same without Content-Length: a chunked body is counted while it is read
    connection = http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
    chunks = iter([b'{"prompt": "', b"z" * 3000, b'"}'])
    connection.request("POST", "/v1/generate", body=chunks, encode_chunked=True,
                       headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    response = connection.getresponse()
    assert response.status == 413
    connection.close()
    assert s.generate(prompt="small")[0] == 200


@pytest.mark.parametrize("body", [
    b'{"prompt": "unterminated',  # malformed JSON
    b'["a list"]',
    b'{"max_new_tokens": 4}',  # no prompt
    b'{"prompt": ""}',
    b'{"prompt": 12}',
    b'{"prompt": "a", "max_new_tokens": "5"}',  # a string for an int
    b'{"prompt": "a", "max_new_tokens": 0}',
    b'{"prompt": "a", "max_new_tokens": 33}',  # over max_seq_len
    b'{"prompt": "a", "max_new_tokens": 32}',  # max_seq_len: no room left for a prompt
    b'{"prompt": "a", "temperature": -0.5}',
    b'{"prompt": "a", "temperature": 1000}',
    b'{"prompt": "a", "top_p": 0}',
    b'{"prompt": "a", "top_p": 1.5}',
    b'{"prompt": "a", "seed": -1}',
    b'{"prompt": "a", "stream": "yes"}',
    b'{"prompt": "a", "n": 2}',  # an unknown field
])
def test_invalid_requests_are_422(server, body):
    s = server()
    status, _, data = s.request("POST", "/v1/generate", body)
    assert status == 422, data
    assert isinstance(json.loads(data)["detail"], list)  # FastAPI's list of validation errors
    assert s.engine.batches == []


def test_full_queue_is_503_with_retry_after(server):
    s = server(FakeEngine(max_batch=1), queue_size=2)
    s.engine.gate.clear()
    threads, results = in_threads([lambda: s.generate(prompt="first", max_new_tokens=2)])
    wait_until(s.engine.started.is_set)
    more, queued = in_threads([lambda p=p: s.generate(prompt=p, max_new_tokens=2) for p in ("second", "third")])
    wait_until(lambda: s.worker.waiting.qsize() == 2)
    status, headers, body = s.generate(prompt="fourth", max_new_tokens=2)
    assert status == 503 and headers["retry-after"] == "1" and "2 requests already waiting" in body["detail"]
    s.engine.gate.set()
    for t in threads + more:
        t.join(20)
    assert [r[0] for r in results + queued] == [200, 200, 200]


def test_engine_error_fails_its_batch_only_and_the_server_goes_on(server):
    s = server()
    s.engine.gate.clear()
    blocker, _ = in_threads([lambda: s.generate(prompt="blocker", max_new_tokens=2)])
    wait_until(s.engine.started.is_set)
    threads, results = in_threads([
        lambda: s.generate(prompt="boom", max_new_tokens=3),
        lambda: s.generate(prompt="same batch", max_new_tokens=3),
        lambda: s.generate(prompt="same batch, streaming", max_new_tokens=3, stream=True),
    ])
    wait_until(lambda: s.worker.waiting.qsize() == 3)
    s.engine.gate.set()
    for t in blocker + threads:
        t.join(20)
    assert [len(b) for b in s.engine.batches] == [1, 3]
    for status, _, body in results:
        assert status == 500 and "the fake engine failed" in body["detail"]
    assert s.request("GET", "/health")[0] == 200
    status, _, body = s.generate(prompt="after", max_new_tokens=4)
    assert status == 200 and body["tokens"] == expected_tokens("after", 4)[0]


def test_a_sequence_that_cannot_be_sampled_fails_its_request_alone(server, capfd):
    s = server()
    s.engine.gate.clear()
    blocker, _ = in_threads([lambda: s.generate(prompt="blocker", max_new_tokens=2)])
    wait_until(s.engine.started.is_set)
    threads, results = in_threads([
        lambda: s.generate(prompt="fail here", max_new_tokens=5),
        lambda: s.generate(prompt="fail streaming", max_new_tokens=5, stream=True),
        lambda: s.generate(prompt="same batch", max_new_tokens=5),
        lambda: s.generate(prompt="same batch, streaming", max_new_tokens=5, stream=True),
    ])
    wait_until(lambda: s.worker.waiting.qsize() == 4)
    s.engine.gate.set()
    for t in blocker + threads:
        t.join(20)
    assert [len(b) for b in s.engine.batches] == [1, 4]
    (failed, _, body), (streamed, _, lines), (ok, _, plain), (ok_streamed, _, ok_lines) = results
    assert failed == 500 and body == {"detail": "generation failed: the model's logits hold NaN"}
    assert streamed == 200 and [line["token"] for line in lines[:2]] == expected_tokens("fail streaming", 5)[0][:2]
    assert lines[2:] == [{"error": "generation failed: the model's logits hold NaN", "finish_reason": "error"}]
    assert ok == 200 and plain["tokens"] == expected_tokens("same batch", 5)[0]
    assert ok_streamed == 200 and ok_lines[-1]["tokens"] == expected_tokens("same batch, streaming", 5)[0]
    assert capfd.readouterr().err.count("a sequence of a batch of 4 failed after 2 tokens") == 2
    assert s.generate(prompt="after", max_new_tokens=3)[2]["tokens"] == expected_tokens("after", 3)[0]


def test_client_disconnecting_mid_stream_leaves_its_batch_running(server):
    s = server(FakeEngine(max_batch=4, step_delay_s=0.01))
    s.engine.gate.clear()
    blocker, _ = in_threads([lambda: s.generate(prompt="blocker", max_new_tokens=2)])
    wait_until(s.engine.started.is_set)
    leaver = http.client.HTTPConnection("127.0.0.1", s.port, timeout=20)
    leaver.request("POST", "/v1/generate", body=json.dumps({"prompt": "leaving", "max_new_tokens": 24,
                                                            "stream": True}).encode(),
                   headers={"Content-Type": "application/json"})
    wait_until(lambda: s.worker.waiting.qsize() == 1)
    threads, results = in_threads([lambda: s.generate(prompt="staying", max_new_tokens=24, stream=True)])
    wait_until(lambda: s.worker.waiting.qsize() == 2)
    s.engine.gate.set()
    response = leaver.getresponse()
    assert json.loads(response.readline())["token"] == expected_tokens("leaving", 24)[0][0]
    leaver.sock.shutdown(socket.SHUT_RDWR)
    leaver.close()
    for t in blocker + threads:
        t.join(20)
    assert [len(b) for b in s.engine.batches] == [1, 2]
    status, _, lines = results[0]
    assert status == 200 and lines[-1]["tokens"] == expected_tokens("staying", 24)[0]
    assert s.generate(prompt="next", max_new_tokens=3)[2]["tokens"] == expected_tokens("next", 3)[0]


def test_health(server):
    s = server(FakeEngine(max_batch=3))
    status, _, body = s.request("GET", "/health")
    assert status == 200
    assert json.loads(body) == {"status": "ok", "max_batch": 3, "max_seq_len": MAX_SEQ_LEN, "tp": 1, "queued": 0}


class RecordingBroadcaster:
    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(message)


def test_batches_are_broadcast_to_the_other_ranks_then_shutdown(server):
    broadcaster = RecordingBroadcaster()
    s = server(broadcaster=broadcaster)
    assert s.generate(prompt="one", max_new_tokens=2, seed=5)[0] == 200
    s.close()
    batch, shutdown = broadcaster.messages
    assert batch == {"kind": "batch", "prompts": [list(b"one")], "max_new_tokens": [2],
                     "sampling": [SamplingParams(seed=5, stop_token=EOS)]}
    assert shutdown == {"kind": "shutdown"}
    assert s.engine.batches == [batch["prompts"]] and s.engine.sampling == [batch["sampling"]]


class BrokenBroadcaster:
    def send(self, message):
        raise RuntimeError("Connection closed by peer")


def test_a_lost_tensor_parallel_rank_fails_the_batch_and_stops_serving(server):
    s = server(broadcaster=BrokenBroadcaster())
    status, _, body = s.generate(prompt="one", max_new_tokens=2)
    assert status == 500 and "a tensor-parallel rank is gone" in body["detail"]
    assert s.engine.batches == []  # rank 0 did not run a batch the others never got
    assert s.request("GET", "/health")[0] == 503
    status, headers, _ = s.generate(prompt="two", max_new_tokens=2)
    assert status == 503 and headers["retry-after"] == "1"


def test_incremental_text_holds_back_an_incomplete_utf8_character():
    text = "é€a"
    pieces = IncrementalText(ByteTokenizer(256).decode)
    deltas = [pieces.add(byte) for byte in text.encode()]
    assert deltas == ["", "é", "", "", "€", "a"]
