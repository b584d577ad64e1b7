"""The server against hostile sampling values, over real sockets, with a tiny GPT's real engine (max batch 4):

- a request's own sampling values never fail the requests batched with it: a temperature of 1e-300 (and other
  extreme but accepted values) batched with three ordinary requests: all four answer, the ordinary three exactly as
  in the same batch without it, and a temperature below 1e-5 decodes greedily;
- every out-of-range or wrongly typed field is 422 naming the field and what it accepts (never a 500), and the
  server answers a normal request afterwards.

Batches are made deterministic with a gate in front of the engine: a blocker request holds the worker while the
batch under test queues up, so the worker takes it whole.
"""

import json
import threading

import pytest

from tests.unit.test_server_limits import SIZES, tiny_engine, wait_until
from tests.unit.test_server_limits import Server as LimitsServer

MAX_SEQ_LEN = SIZES["max_seq_len"]
MAX_BATCH = 4
ORDINARY = [  # three ordinary requests: greedy, seeded sampling, greedy streamed
    {"prompt": "The plan is", "max_new_tokens": 8},
    {"prompt": "Once upon a time", "max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 7},
    {"prompt": "Hello", "max_new_tokens": 6, "stream": True},
]
HOSTILE_PROMPT = "hi"  # the shortest prompt: the batch's padding is the same with or without it


class GatedEngine:
    """The real engine behind a gate: stream() records the batch size and waits for the gate."""

    def __init__(self, engine):
        self.engine = engine
        self.max_batch, self.max_seq_len, self.vocab_size, self.tp = (engine.max_batch, engine.max_seq_len,
                                                                      engine.vocab_size, engine.tp)
        self.gate = threading.Event()
        self.gate.set()
        self.batch_sizes: list[int] = []

    def stream(self, prompts, max_new_tokens, sampling):
        self.batch_sizes.append(len(prompts))
        assert self.gate.wait(20), "the gate was never opened"
        return self.engine.stream(prompts, max_new_tokens, sampling)


class Server(LimitsServer):
    """test_server_limits's server on the engine behind a gate, with the batch of requests it runs."""

    def __init__(self, engine):
        self.engine = GatedEngine(engine)
        super().__init__(self.engine)

    def generate(self, fields: dict) -> tuple[int, dict]:
        """(status, answer): a streamed answer as its last line, with the tokens of the lines before it."""
        status, data = self.post(json.dumps(fields).encode())
        if status != 200 or not fields.get("stream"):
            return status, json.loads(data)
        lines = [json.loads(line) for line in data.decode().splitlines()]
        return status, {**lines[-1], "streamed": [line.get("token") for line in lines[:-1]]}

    def run_batch(self, requests: list[dict]) -> list[tuple[int, dict]]:
        """`requests` run as one batch of the engine; their (status, answer) in order."""
        self.engine.gate.clear()
        self.engine.batch_sizes.clear()
        blocker = threading.Thread(target=self.generate, args=({"prompt": "blocker", "max_new_tokens": 1},))
        blocker.start()
        wait_until(lambda: len(self.engine.batch_sizes) == 1)  # the worker holds the blocker at the gate
        results: list = [None] * len(requests)

        def run(i):
            results[i] = self.generate(requests[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        wait_until(lambda: self.worker.waiting.qsize() == len(requests))
        self.engine.gate.set()
        for thread in [blocker, *threads]:
            thread.join(60)
            assert not thread.is_alive(), "a request did not end"
        assert self.engine.batch_sizes == [1, len(requests)]
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
    return answers


def assert_answer(status: int, answer: dict, max_new_tokens: int):
    assert status == 200, answer
    assert 1 <= len(answer["tokens"]) <= max_new_tokens
    assert all(0 <= t < SIZES["vocab_size"] for t in answer["tokens"])
    assert answer["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("hostile,greedy", [
    ({"temperature": 1e-300}, True),  # the review's case: was a 500 for all four
    ({"temperature": 5e-324}, True),  # the smallest positive double
    ({"temperature": 9.9e-6}, True),  # just below the greedy floor
    ({"temperature": 10.0, "top_p": 5e-324}, True),  # the hottest, in a nucleus of one token: greedy too
    ({"temperature": 1e-5, "seed": 2**63 - 1}, False),  # the floor itself samples: logits x 1e5 in float32
    ({"temperature": 10.0, "top_p": 1.0, "seed": 3}, False),
])
def test_extreme_sampling_values_fail_nobody_batched_with_them(server, without_hostile, hostile, greedy):
    request = {"prompt": HOSTILE_PROMPT, "max_new_tokens": 8, **hostile}
    answers = server.run_batch([*ORDINARY, request])
    assert [status for status, _ in answers] == [200, 200, 200, 200], answers
    assert answers[:3] == without_hostile  # the ordinary three, token for token
    assert answers[2][1]["streamed"] == answers[2][1]["tokens"]
    assert_answer(*answers[3], max_new_tokens=8)
    if greedy:  # the same as temperature 0 in the same batch
        reference = server.run_batch([*ORDINARY, {"prompt": HOSTILE_PROMPT, "max_new_tokens": 8}])
        assert answers[3] == reference[3]
    assert server.generate({"prompt": "after", "max_new_tokens": 3})[0] == 200


def test_a_batch_of_four_hostile_temperatures_answers_all(server):
    answers = server.run_batch([{"prompt": p, "max_new_tokens": 5, "temperature": t, "stream": s}
                                for p, t, s in [("a", 1e-300, False), ("bb", 5e-324, True), ("ccc", 1e-7, False),
                                                ("dddd", 1e-300, True)]])
    for status, answer in answers:
        assert_answer(status, answer, max_new_tokens=5)


# (body, field, what the message says the field accepts)
TEMPERATURE = "temperature must be a finite number, 0 <= temperature <= 10"
TOP_P = "top_p must be a finite number, 0 < top_p <= 1"
MAX_NEW = f"max_new_tokens must be an integer, 1 <= max_new_tokens <= {MAX_SEQ_LEN - 1}"
SEED = f"seed must be an integer, 0 <= seed <= {2**63 - 1}"
PROMPT = f"prompt must be a string of 1 to {MAX_SEQ_LEN} characters"
STREAM = "stream must be true or false"
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
    (b'"temperature": null', "temperature", TEMPERATURE),
    (b'"top_p": 0', "top_p", TOP_P),
    (b'"top_p": -0.1', "top_p", TOP_P),
    (b'"top_p": 1.0000001', "top_p", TOP_P),
    (b'"top_p": NaN', "top_p", TOP_P),
    (b'"top_p": "1"', "top_p", TOP_P),
    (b'"top_p": false', "top_p", TOP_P),
    (b'"max_new_tokens": 0', "max_new_tokens", MAX_NEW),
    (b'"max_new_tokens": -1', "max_new_tokens", MAX_NEW),
    (b'"max_new_tokens": 64', "max_new_tokens", MAX_NEW),  # max_seq_len: no room for a prompt
    (b'"max_new_tokens": 100000000000000000000000000000', "max_new_tokens", MAX_NEW),
    (b'"max_new_tokens": 5.0', "max_new_tokens", MAX_NEW),
    (b'"max_new_tokens": 5.5', "max_new_tokens", MAX_NEW),
    (b'"max_new_tokens": "5"', "max_new_tokens", MAX_NEW),
    (b'"max_new_tokens": true', "max_new_tokens", MAX_NEW),
    (b'"max_new_tokens": [5]', "max_new_tokens", MAX_NEW),
    (b'"max_new_tokens": Infinity', "max_new_tokens", MAX_NEW),
    (b'"seed": -1', "seed", SEED),
    (b'"seed": 9223372036854775808', "seed", SEED),  # 2^63
    (b'"seed": 1.5', "seed", SEED),
    (b'"seed": "1"', "seed", SEED),
    (b'"seed": true', "seed", SEED),
    (b'"stream": "yes"', "stream", STREAM),
    (b'"stream": 1', "stream", STREAM),
    (b'"stream": null', "stream", STREAM),
    (b'"top_k": 40', "top_k", "the fields are prompt, max_new_tokens, temperature, top_p, seed, stream"),
]


@pytest.mark.parametrize("field_json,field,accepts", BAD_FIELDS,
                         ids=[body.decode() for body, _, _ in BAD_FIELDS])
def test_a_bad_field_is_422_naming_it_and_its_range(server, field_json, field, accepts):
    status, data = server.post(b'{"prompt": "hi", ' + field_json + b"}")
    assert status == 422, data
    errors = json.loads(data)["detail"]
    assert [e["loc"] for e in errors] == [["body", field]]
    assert errors[0]["msg"].startswith(f"{field}: ") and errors[0]["msg"].endswith(f"; {accepts}")
    status, answer = server.generate({"prompt": "hi", "max_new_tokens": 2})
    assert status == 200 and len(answer["tokens"]) == 2


@pytest.mark.parametrize("body", [b'{"prompt": ""}', b'{"prompt": 12}', b'{"prompt": ["hi"]}', b'{"prompt": null}',
                                  b'{"prompt": "' + b"x" * (MAX_SEQ_LEN + 1) + b'"}', b'{"max_new_tokens": 2}'])
def test_a_bad_prompt_is_422_naming_it(server, body):
    status, data = server.post(body)
    assert status == 422, data
    errors = json.loads(data)["detail"]
    assert [e["loc"] for e in errors] == [["body", "prompt"]] and errors[0]["msg"].endswith(f"; {PROMPT}")
    assert server.generate({"prompt": "hi", "max_new_tokens": 2})[0] == 200


def test_every_bad_field_at_once_is_one_422_naming_each(server):
    body = (b'{"prompt": 1, "max_new_tokens": 0, "temperature": NaN, "top_p": 2, "seed": -1, "stream": "no", '
            b'"n": 1}')
    status, data = server.post(body)
    assert status == 422, data
    named = {e["loc"][1]: e["msg"] for e in json.loads(data)["detail"]}
    assert set(named) == {"prompt", "max_new_tokens", "temperature", "top_p", "seed", "stream", "n"}
    for accepts in (PROMPT, MAX_NEW, TEMPERATURE, TOP_P, SEED, STREAM):
        assert accepts in named[accepts.split()[0]]
    assert server.generate({"prompt": "hi", "max_new_tokens": 2})[0] == 200
