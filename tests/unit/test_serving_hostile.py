"""The server against hostile sampling values, over real sockets, with a tiny GPT's real engine behind the
continuous-batching worker (4 running sequences at most), POST /v1/completions:

- a request's own sampling values never fail the requests batched with it: a temperature of 1e-300 (and other
  extreme but accepted values) admitted in the same engine pass as three ordinary requests and sampled in the
  same sample() calls: all four answer, every token sampled is a token id (no sampling failure), the ordinary
  three exactly as in a batch without it (text, token for token through `logprobs`, and the log-probabilities
  themselves), the streamed one exactly as the same request unstreamed, and a temperature below 1e-5 decodes
  greedily (the same answer as temperature 0);
- every out-of-range or wrongly typed field is 400 in OpenAI's error shape naming the field (param) and what it
  accepts (never a 500), and the server answers a normal request afterwards.

Batches are made deterministic with a gate in front of the engine's forward_paged: a blocker request holds the
worker inside its engine pass while the batch under test queues up, so the scheduler admits it whole at the next
step.
"""

import http.client
import json
import threading

import pytest

from tests.unit.test_server_limits import SIZES, tiny_engine, wait_until
from tests.unit.test_server_limits import Server as LimitsServer

MAX_SEQ_LEN = SIZES["max_seq_len"]
MAX_BATCH = 4
ORDINARY = [  # three ordinary requests: greedy, seeded sampling, greedy streamed (temperature defaults to 1)
    {"prompt": "The plan is", "max_tokens": 8, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 7},
    {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
]
HOSTILE_PROMPT = "hi"  # the shortest prompt: the other decodes are read in the same runs with or without it


class GatedEngine:
    """The real engine behind a gate: forward_paged() records the pass's segments and waits for the gate; sample()
    records every token chosen. Everything else is the engine's."""

    def __init__(self, engine):
        self.engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.passes: list[int] = []  # segments (sequences) of each engine pass
        self.sampled: list = []  # what sample() returned, row by row

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def forward_paged(self, cache, batch):
        self.passes.append(len(batch.segments))
        assert self.gate.wait(20), "the gate was never opened"
        return self.engine.forward_paged(cache, batch)

    def sample(self, logits, params, generators):
        chosen = self.engine.sample(logits, params, generators)
        self.sampled += chosen
        return chosen


def answer_of(body: dict) -> dict:
    """A plain /v1/completions answer as {text, finish_reason, tokens, token_logprobs, usage}."""
    choice = body["choices"][0]
    logprobs = choice["logprobs"] or {"tokens": None, "token_logprobs": None}
    return {"text": choice["text"], "finish_reason": choice["finish_reason"], "tokens": logprobs["tokens"],
            "token_logprobs": logprobs["token_logprobs"], "usage": body["usage"]}


def streamed_answer(data: bytes) -> dict:
    """A streamed answer's events put together as answer_of's dict (its usage from the include_usage chunk, None
    without one)."""
    blocks = [block for block in data.decode().split("\n\n") if block]
    assert all(block.startswith("data: ") for block in blocks), blocks
    assert blocks[-1] == "data: [DONE]", blocks[-3:]
    chunks = [json.loads(block[len("data: "):]) for block in blocks[:-1]]
    usage_chunk = chunks.pop() if chunks[-1]["choices"] == [] else {"usage": None}  # with include_usage only
    *pieces, finish = chunks
    assert all(c.get("usage") is None for c in chunks)
    assert all(c["choices"][0]["finish_reason"] is None for c in pieces) and finish["choices"][0]["text"] == ""
    tokens, token_logprobs = [], []
    for chunk in pieces:
        logprobs = chunk["choices"][0]["logprobs"]
        if logprobs:
            tokens += logprobs["tokens"]
            token_logprobs += logprobs["token_logprobs"]
    return {"text": "".join(c["choices"][0]["text"] for c in pieces),
            "finish_reason": finish["choices"][0]["finish_reason"], "tokens": tokens,
            "token_logprobs": token_logprobs, "usage": usage_chunk["usage"]}


class Server(LimitsServer):
    """test_server_limits's server on the engine behind a gate, with the batch of requests it runs."""

    def __init__(self, engine):
        self.engine = GatedEngine(engine)
        super().__init__(self.engine)

    def generate(self, fields: dict) -> tuple[int, dict]:
        """(status, answer): answer_of (streamed: put together) of a 200, else the error body."""
        status, data = self.post(json.dumps(fields).encode())
        if status != 200:
            return status, json.loads(data)
        return status, streamed_answer(data) if fields.get("stream") else answer_of(json.loads(data))

    def run_batch(self, requests: list[dict]) -> list[tuple[int, dict]]:
        """`requests` (with logprobs, so that their tokens show) admitted together in one engine pass; their
        (status, answer) in order."""
        self.engine.gate.clear()
        self.engine.passes.clear()
        self.engine.sampled.clear()
        blocker = threading.Thread(target=self.generate,
                                   args=({"prompt": "blocker", "max_tokens": 1, "temperature": 0},))
        blocker.start()
        wait_until(lambda: len(self.engine.passes) == 1)  # the worker holds the blocker's pass at the gate
        results: list = [None] * len(requests)

        def run(i):
            results[i] = self.generate({**requests[i], "logprobs": 1})

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        wait_until(lambda: self.worker.stats().waiting == len(requests))
        self.engine.gate.set()
        for thread in [blocker, *threads]:
            thread.join(60)
            assert not thread.is_alive(), "a request did not end"
        # the blocker alone, then every request of the batch read in the same pass
        assert self.engine.passes[:2] == [1, len(requests)], self.engine.passes
        assert all(n <= len(requests) for n in self.engine.passes[2:])
        # no row of any pass failed to sample: every one a token id of the vocabulary
        assert all(isinstance(t, int) and 0 <= t < SIZES["vocab_size"] for t in self.engine.sampled), \
            self.engine.sampled
        return results

    def close(self):
        self.engine.gate.set()
        super().close()


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine(max_batch=MAX_BATCH)
    s = Server(engine)
    yield s
    s.close()
    engine.close()


@pytest.fixture(scope="module")
def without_hostile(server):
    """The ordinary three's answers in a batch of their own."""
    answers = server.run_batch(ORDINARY)
    assert [status for status, _ in answers] == [200, 200, 200], answers
    # the streamed one: the same text and tokens as the same request unstreamed
    unstreamed = {k: v for k, v in ORDINARY[2].items() if k not in ("stream", "stream_options")}
    assert server.run_batch([unstreamed])[0] == answers[2]
    return answers


def assert_answer(status: int, answer: dict, max_tokens: int):
    assert status == 200, answer
    completion_tokens = answer["usage"]["completion_tokens"]
    assert 1 <= completion_tokens <= max_tokens
    assert answer["finish_reason"] in ("stop", "length")
    # one logprobs entry per token but the stop token (which has no text)
    assert len(answer["tokens"]) == completion_tokens - (answer["finish_reason"] == "stop")
    assert len(answer["token_logprobs"]) == len(answer["tokens"])
    assert all(lp <= 0.0 for lp in answer["token_logprobs"])


@pytest.mark.parametrize("hostile,greedy", [
    ({"temperature": 1e-300}, True),  # the review's case: was a 500 for all four
    ({"temperature": 5e-324}, True),  # the smallest positive double
    ({"temperature": 9.9e-6}, True),  # just below the greedy floor
    ({"temperature": 10.0, "top_p": 5e-324}, True),  # the hottest, in a nucleus of one token: greedy too
    ({"temperature": 1e-5, "seed": 2**63 - 1}, False),  # the floor itself samples: logits x 1e5 in float32
    ({"temperature": 10.0, "top_p": 1.0, "seed": 3}, False),
])
def test_extreme_sampling_values_fail_nobody_batched_with_them(server, without_hostile, hostile, greedy):
    request = {"prompt": HOSTILE_PROMPT, "max_tokens": 8, **hostile}
    answers = server.run_batch([*ORDINARY, request])
    assert [status for status, _ in answers] == [200, 200, 200, 200], answers
    assert answers[:3] == without_hostile  # the ordinary three, token for token
    assert_answer(*answers[3], max_tokens=8)
    if greedy:  # the same as temperature 0 in the same batch
        reference = server.run_batch([*ORDINARY, {"prompt": HOSTILE_PROMPT, "max_tokens": 8, "temperature": 0}])
        assert answers[3] == reference[3]
    assert server.generate({"prompt": "after", "max_tokens": 3})[0] == 200


def test_a_batch_of_four_hostile_temperatures_answers_all(server):
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    answers = server.run_batch([{"prompt": p, "max_tokens": 5, "temperature": t, **(streamed if s else {})}
                                for p, t, s in [("a", 1e-300, False), ("bb", 5e-324, True), ("ccc", 1e-7, False),
                                                ("dddd", 1e-300, True)]])
    for status, answer in answers:
        assert_answer(status, answer, max_tokens=5)


# (body, field, what the message says the field accepts)
TEMPERATURE = "temperature must be a finite number, 0 <= temperature <= 10, or null"
TOP_P = "top_p must be a finite number, 0 < top_p <= 1, or null"
MAX_TOKENS = f"max_tokens must be an integer, 1 <= max_tokens <= {MAX_SEQ_LEN - 1}, or null"
SEED = f"seed must be an integer, 0 <= seed <= {2**63 - 1}, or null"
PROMPT = f"prompt must be a string of 1 to {MAX_SEQ_LEN} characters, or a list of exactly one such string"
STREAM = "stream must be true or false, or null"
STOP = "stop must be a non-empty string, a list of 1 to 4 non-empty strings, or null"
LOGPROBS = "logprobs must be an integer, 0 <= logprobs <= 5, or null"
N = "n must be 1 (one choice per request) or null"
FIELDS = ("the fields are model, prompt, max_tokens, temperature, top_p, stop, seed, n, stream, stream_options, "
          "user, presence_penalty, frequency_penalty, logprobs, echo")
BAD_FIELDS = [
    (b'"temperature": -0.5', "temperature", TEMPERATURE),
    (b'"temperature": -1e-300', "temperature", TEMPERATURE),
    (b'"temperature": 10.000001', "temperature", TEMPERATURE),
    (b'"temperature": 1e308', "temperature", TEMPERATURE),
    (b'"temperature": 1e999', "temperature", TEMPERATURE),  # infinity once parsed
    (b'"temperature": NaN', "temperature", TEMPERATURE),
    (b'"temperature": Infinity', "temperature", TEMPERATURE),
    (b'"temperature": -Infinity', "temperature", TEMPERATURE),
    (b'"temperature": "0.5"', "temperature", TEMPERATURE),
    (b'"temperature": true', "temperature", TEMPERATURE),
    (b'"temperature": [0.5]', "temperature", TEMPERATURE),
    (b'"temperature": {"value": 0.5}', "temperature", TEMPERATURE),
    (b'"top_p": 0', "top_p", TOP_P),
    (b'"top_p": -0.1', "top_p", TOP_P),
    (b'"top_p": 1.0000001', "top_p", TOP_P),
    (b'"top_p": NaN', "top_p", TOP_P),
    (b'"top_p": "1"', "top_p", TOP_P),
    (b'"top_p": false', "top_p", TOP_P),
    (b'"max_tokens": 0', "max_tokens", MAX_TOKENS),
    (b'"max_tokens": -1', "max_tokens", MAX_TOKENS),
    (b'"max_tokens": 64', "max_tokens", MAX_TOKENS),  # max_seq_len: no room for a prompt
    (b'"max_tokens": 100000000000000000000000000000', "max_tokens", MAX_TOKENS),
    (b'"max_tokens": 5.0', "max_tokens", MAX_TOKENS),
    (b'"max_tokens": 5.5', "max_tokens", MAX_TOKENS),
    (b'"max_tokens": "5"', "max_tokens", MAX_TOKENS),
    (b'"max_tokens": true', "max_tokens", MAX_TOKENS),
    (b'"max_tokens": [5]', "max_tokens", MAX_TOKENS),
    (b'"max_tokens": Infinity', "max_tokens", MAX_TOKENS),
    (b'"seed": -1', "seed", SEED),
    (b'"seed": 9223372036854775808', "seed", SEED),  # 2^63
    (b'"seed": 1.5', "seed", SEED),
    (b'"seed": "1"', "seed", SEED),
    (b'"seed": true', "seed", SEED),
    (b'"stream": "yes"', "stream", STREAM),
    (b'"stream": 1', "stream", STREAM),
    (b'"stop": ""', "stop", STOP),
    (b'"stop": ["a", "b", "c", "d", "e"]', "stop", STOP),
    (b'"stop": 5', "stop", STOP),
    (b'"logprobs": 6', "logprobs", LOGPROBS),
    (b'"logprobs": true', "logprobs", LOGPROBS),
    (b'"n": 2', "n", N),
    (b'"top_k": 40', "top_k", FIELDS),  # unknown fields are refused, not ignored
    (b'"max_new_tokens": 8', "max_new_tokens", FIELDS),  # the retired /v1/generate's name
]


def assert_400(status: int, data: bytes, param: str) -> str:
    """OpenAI's error shape of a 400 naming `param`; its message."""
    assert status == 400, data
    body = json.loads(data)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] is None, body
    assert body["error"]["param"] == param, body
    return body["error"]["message"]


def assert_still_answers(server):
    status, answer = server.generate({"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer


@pytest.mark.parametrize("field_json,field,accepts", BAD_FIELDS,
                         ids=[body.decode() for body, _, _ in BAD_FIELDS])
def test_a_bad_field_is_400_naming_it_and_its_range(server, field_json, field, accepts):
    message = assert_400(*server.post(b'{"prompt": "hi", ' + field_json + b"}"), param=field)
    assert "\n" not in message and message.startswith(f"{field}: ") and message.endswith(f"; {accepts}"), message
    assert_still_answers(server)


@pytest.mark.parametrize("body", [b'{"prompt": ""}', b'{"prompt": 12}', b'{"prompt": []}', b'{"prompt": [12]}',
                                  b'{"prompt": ["hi", "there"]}', b'{"prompt": null}',
                                  b'{"prompt": "' + b"x" * (MAX_SEQ_LEN + 1) + b'"}', b'{"max_tokens": 2}'])
def test_a_bad_prompt_is_400_naming_it(server, body):
    message = assert_400(*server.post(body), param="prompt")
    assert message.startswith("prompt: ") and message.endswith(f"; {PROMPT}"), message
    assert_still_answers(server)


def test_every_bad_field_at_once_is_one_400_naming_each(server):
    body = (b'{"prompt": 1, "max_tokens": 0, "temperature": NaN, "top_p": 2, "seed": -1, "stream": "no", '
            b'"n": 2}')
    message = assert_400(*server.post(body), param="prompt")  # param: the first bad field
    named = {line.split(": ", 1)[0]: line for line in message.splitlines()}
    assert set(named) == {"prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "n"}, message
    for accepts in (PROMPT, MAX_TOKENS, TEMPERATURE, TOP_P, SEED, STREAM, N):
        assert named[accepts.split()[0]].endswith(f"; {accepts}")
    assert_still_answers(server)


def test_the_retired_endpoint_is_404_in_openai_shape(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    connection.request("POST", "/v1/generate", body=b'{"prompt": "hi", "max_new_tokens": 2}',
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    status, body = response.status, json.loads(response.read())
    connection.close()
    assert status == 404 and body["error"]["type"] == "invalid_request_error", body
    assert "/v1/generate" in body["error"]["message"]
    assert_still_answers(server)
