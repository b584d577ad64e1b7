"""The server against hostile and careless clients, over real sockets, with a tiny GPT's real engine behind the
serving worker (runtime.inference.server started in-process as serve() configures uvicorn: server_config):
a NaN or infinite temperature and a body that is not UTF-8 are 400 in OpenAI's error shape (were 500: the error
renderer failed); request headers and bodies that do not arrive in time are 408; connections beyond the cap are
503; a client that goes away is one line on stderr, no traceback; serve.py's bad numbers are one message and exit
status 2."""

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn

from zplan.examples import gpt
from zplan.model_input import trace_module
from zplan.runtime.inference.batching import ServingWorker
from zplan.runtime.inference.build import EngineSettings
from zplan.runtime.inference.cli import serve_main
from zplan.runtime.inference.engine import InferenceEngine
from zplan.runtime.inference.server import ServerLimits, create_app, server_config
from zplan.runtime.inference.tokenizer import ByteTokenizer

SIZES = dict(num_layers=1, hidden=32, heads=2, vocab_size=300, max_seq_len=64)


def tiny_engine(max_batch: int) -> InferenceEngine:
    """The engine of a 1-layer GPT (SIZES, seed 0), fp32, 64 tokens a sequence."""
    torch.manual_seed(0)
    model = gpt.build_model(**SIZES).eval()
    with torch.device("meta"):
        meta = gpt.build_model(**SIZES)
    summary = trace_module(meta, torch.zeros(1, 8, dtype=torch.long, device="meta"), 8, "fp32")[1]
    return InferenceEngine.from_model(model, summary, max_seq_len=SIZES["max_seq_len"], max_batch=max_batch)


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine(max_batch=2)
    yield engine
    engine.close()


class Server:
    def __init__(self, engine, **limits):
        tokenizer = ByteTokenizer(SIZES["vocab_size"])
        self.limits = ServerLimits.for_engine(64, engine.max_batch, 8, **limits)
        self.worker = ServingWorker(engine, tokenizer.eos_id, self.limits)
        self.worker.start()
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(server_config(create_app(self.worker, tokenizer, self.limits), self.limits))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started)

    def post(self, body: bytes, path: str = "/v1/completions"):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        status, data = response.status, response.read()
        connection.close()
        return status, data

    def raw(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=20)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.worker.close()


@pytest.fixture
def server(engine):
    started = []

    def start(**limits):
        started.append(Server(engine, **limits))
        return started[-1]

    yield start
    for s in started:
        s.close()


def wait_until(condition, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


@pytest.mark.parametrize("body,field", [
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "hi", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "\xff\xfe hi"}', None),  # not UTF-8
])
def test_nan_infinite_and_non_utf8_bodies_are_400(server, body, field):
    s = server()
    status, data = s.post(body)
    assert status == 400, data
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field
    if field:
        assert error["message"].startswith(f"{field}: ") and "finite" in error["message"]
    assert s.post(b'{"prompt": "hi", "max_tokens": 3}')[0] == 200


def test_headers_that_do_not_arrive_in_time_are_408(server, capfd):
    s = server(header_timeout_s=0.2)
    silent, slow = s.raw(), s.raw()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
    for sock in (silent, slow):
        assert read_all(sock).startswith(b"HTTP/1.1 408 Request Timeout\r\n")  # then closed
        sock.close()
    assert capfd.readouterr().err.count("no complete request headers within 0.2 s") == 2
    assert s.post(b'{"prompt": "hi", "max_tokens": 2}')[0] == 200


def test_a_body_that_does_not_arrive_in_time_is_408(server):
    s = server(body_timeout_s=0.2)
    sock = s.raw()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    answer = read_all(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request body not received within 0.2 s" in answer


def test_connections_beyond_the_cap_are_refused_with_503(server, capfd):
    s = server(max_connections=2)
    held = [s.raw(), s.raw()]
    wait_until(lambda: len(s.server.server_state.connections) == 2)
    extra = s.raw()
    assert read_all(extra).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    extra.close()
    assert "refused a connection" in capfd.readouterr().err
    for sock in held:
        sock.close()
    wait_until(lambda: not s.server.server_state.connections)
    assert s.post(b'{"prompt": "hi", "max_tokens": 2}')[0] == 200


def test_each_client_disconnect_is_one_line_without_a_traceback(server, capfd):
    s = server()
    body = b'{"prompt": "hi", "max_tokens": 60, "stream": true}'
    streaming = s.raw()
    streaming.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert streaming.recv(64).startswith(b"HTTP/1.1 200")
    streaming.close()
    half = s.raw()
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
    wait_until(lambda: len(s.server.server_state.tasks) >= 1)
    half.close()
    err = ""

    def both_logged() -> bool:
        nonlocal err
        err += capfd.readouterr().err
        return "streamed tokens" in err and "before its request body was read" in err

    wait_until(both_logged)
    wait_until(lambda: s.worker.stats().running == 0 and s.worker.stats().waiting == 0)
    assert s.post(b'{"prompt": "after", "max_tokens": 2}')[0] == 200
    err += capfd.readouterr().err
    assert err.count("disconnected") == 2, err
    assert "Traceback" not in err and "socket.send() raised exception" not in err and "ERROR" not in err


@pytest.mark.parametrize("args,needle", [
    (["--port", "99999"], "--port 99999: must be 1 to 65535"),
    (["--queue-size", "0"], "--queue-size 0: must be 1 to"),
    (["--max-body-bytes", "-1"], "--max-body-bytes -1: must be 1 to"),
    (["--max-connections", "0"], "--max-connections 0: must be 1 to"),
    (["--header-timeout", "nan"], "--header-timeout nan: must be"),
])
def test_serve_refuses_bad_numbers_before_starting(args, needle, capsys):
    settings = EngineSettings(tp=1, weight_precision="fp32", group_size=128, compute_dtype="fp32", weight_tier="gpu",
                              prefetch_layers=0, max_batch=2, max_seq_len=64)
    # the plan file is never read: the arguments are checked first
    assert serve_main(Path("no-such-plan.json"), None, settings, 8, args) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
