"""Continuous batching over the paged KV cache (runtime/inference/scheduler.py, paged_cache.py, batching.py).

The reference for every sequence is the engine's own one-prompt generation (engine.generate, the static path the
engine has always had and that tests/unit/test_inference_engine.py checks against the model): whatever else runs
beside it, however its prompt is cut into chunks, preempted or found in the prefix cache, a sequence's greedy
tokens must be the same.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading

import pytest
import torch

from tests.unit.test_inference_engine import make
from zplan.cuda import paged_attention
from zplan.errors import ZplanError
from zplan.runtime.inference.batching import PendingRequest, ServingWorker
from zplan.runtime.inference.paged_cache import BLOCK_TOKENS, BlockPool, block_hash
from zplan.runtime.inference.sampling import SamplingParams
from zplan.runtime.inference.scheduler import Scheduler, Sequence, blocks_for
from zplan.runtime.inference.server_requests import ServerLimits


@pytest.fixture(scope="module", params=["gpt", "llama"])
def engine(request):
    return make(request.param, max_batch=4)[1]


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Decodes by the C++ paged-attention kernel (where it builds) or by the torch gather, as on a GPU."""
    if request.param == "torch":
        monkeypatch.setattr(paged_attention, "kernel_applies", lambda device, dtype: False)
    return request.param


def requests(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(0, 200) for _ in range(rng.randint(1, 40))], rng.randint(1, 20)) for _ in range(count)]


def run(scheduler: Scheduler, sequences: list[Sequence]) -> list[list[int]]:
    """Every sequence's tokens, stepping until all have finished."""
    out = {id(s): [] for s in sequences}
    for sequence in sequences:
        scheduler.add(sequence)
    for _ in range(10_000):
        if not scheduler.busy:
            break
        for outcome in scheduler.step():
            assert outcome.finish != "error", outcome.message
            out[id(outcome.sequence)].append(outcome.token)
    return [out[id(s)] for s in sequences]


@pytest.mark.parametrize("blocks, step_tokens", [(40, 512), (6, 7), (blocks_for(64), 16)])
def test_greedy_tokens_equal_one_prompt_at_a_time(engine, decode_path, blocks, step_tokens):
    """Plenty of blocks; few blocks and 7-token chunks (preemption and chunked prefill); the fewest blocks that
    hold one sequence."""
    work = requests(9)
    reference = [engine.generate([p], n)[0] for p, n in work]
    scheduler = Scheduler(engine, blocks, max_running=4, max_step_tokens=step_tokens)
    got = run(scheduler, [Sequence(p, n, SamplingParams()) for p, n in work])
    assert got == reference
    assert scheduler.pool.used == 0  # every block given back
    if blocks < 10:
        assert scheduler.preemptions > 0  # the small cache did force preemption


def test_a_shared_prompt_prefix_is_read_from_the_cache(engine):
    prefix = list(range(3, 3 + 2 * BLOCK_TOKENS + 5))  # two full blocks and some
    first, second = prefix + [7, 8], prefix + [9]
    scheduler = Scheduler(engine, 40, max_running=4)
    assert run(scheduler, [Sequence(first, 4, SamplingParams())]) == [engine.generate([first], 4)[0]]
    hits = scheduler.pool.hit_tokens
    assert run(scheduler, [Sequence(second, 4, SamplingParams())]) == [engine.generate([second], 4)[0]]
    assert scheduler.pool.hit_tokens - hits == 2 * BLOCK_TOKENS


def test_sampled_tokens_do_not_depend_on_the_other_sequences(engine):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    prompt = [4, 5, 6, 7]
    alone = run(Scheduler(engine, 40, max_running=4), [Sequence(prompt, 12, params)])[0]
    others = [Sequence(p, n, SamplingParams(temperature=1.0, seed=i)) for i, (p, n) in enumerate(requests(5, 1))]
    together = run(Scheduler(engine, 40, max_running=4), [*others[:2], Sequence(prompt, 12, params), *others[2:]])
    assert together[2] == alone


def test_cancel_frees_the_blocks_at_once(engine):
    scheduler = Scheduler(engine, 40, max_running=4)
    sequence = Sequence(list(range(30)), 20, SamplingParams())
    scheduler.add(sequence)
    scheduler.step()
    assert scheduler.pool.used == blocks_for(31)  # 30 prompt tokens, then room for the first new one
    scheduler.cancel(sequence)
    assert scheduler.pool.used == 0 and not scheduler.busy


def test_requests_the_engine_cannot_serve_are_refused(engine):
    scheduler = Scheduler(engine, 40, max_running=4)
    for prompt, new, words in (([], 4, "empty"), ([1] * 60, 10, "exceeds max_seq_len"), ([1, 10**6], 2, "vocab"),
                               ([1], 0, "at least one")):
        with pytest.raises(ZplanError, match=words):
            scheduler.add(Sequence(prompt, new, SamplingParams()))
    with pytest.raises(ZplanError, match="cannot hold one sequence"):
        Scheduler(engine, blocks_for(64) - 1, max_running=4)


def test_block_pool_counts_by_hand():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b, pool.available) == (0, 1, 1)
    digest = block_hash(b"", list(range(BLOCK_TOKENS)))
    pool.register(a, digest)
    pool.release([a, b])  # a keeps its contents (idle, cached), b is free
    assert pool.available == 3 and pool.used == 0
    assert pool.lookup([digest, block_hash(digest, [0] * BLOCK_TOKENS)]) == [a]  # the first block only
    assert pool.users[a] == 1 and pool.available == 2
    pool.release([a])
    taken = [pool.allocate() for _ in range(3)]  # used and free, then the idle cached one evicted, then unused
    assert taken == [1, 0, 2] and pool.allocate() is None
    assert pool.take_fresh() == [0, 1, 2] and pool.take_fresh() == []  # each block's first use, once
    assert pool.lookup([digest]) == []  # evicted


def test_block_hash_depends_on_the_blocks_before():
    tokens = list(range(BLOCK_TOKENS))
    assert block_hash(b"", tokens) != block_hash(block_hash(b"", tokens), tokens)


# ---- the worker thread -------------------------------------------------------------------------------------


class Events:
    """An event loop in a thread, to receive a worker's events as the server does."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def request(self, prompt: list[int], new: int, **sampling) -> PendingRequest:
        async def make_request():
            return PendingRequest(prompt, new, SamplingParams(**sampling), self.loop, logprobs=True)

        return asyncio.run_coroutine_threadsafe(make_request(), self.loop).result()

    def drain(self, request: PendingRequest, timeout_s: float = 60.0) -> list[tuple]:
        """The request's events up to its end."""
        async def collect():
            events = []
            while True:
                event = await asyncio.wait_for(request.events.get(), timeout_s)
                events.append(event)
                if event[0] in ("done", "error"):
                    return events

        return asyncio.run_coroutine_threadsafe(collect(), self.loop).result()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def events():
    loop = Events()
    yield loop
    loop.close()


def limits(**overrides) -> ServerLimits:
    return ServerLimits.for_engine(64, 4, 8, **overrides)


def test_worker_streams_each_requests_tokens_and_log_probabilities(engine, events):
    worker = ServingWorker(engine, None, limits(), num_blocks=40)
    worker.start()
    try:
        work = requests(6, 2)
        pending = [events.request(p, n) for p, n in work]
        for request in pending:
            worker.submit(request)
        for request, (prompt, new) in zip(pending, work, strict=True):
            got = events.drain(request)
            assert got[-1] == ("done", "length")
            tokens = [value[0] for kind, value in got[:-1]]
            assert tokens == engine.generate([prompt], new)[0]
            assert all(value[1] <= 0.0 for _, value in got[:-1])  # log-probabilities
        assert worker.stats().kv_blocks_used == 0
    finally:
        assert worker.close()


def test_worker_cancel_stops_a_sequence_and_frees_its_blocks(engine, events):
    worker = ServingWorker(engine, None, limits(), num_blocks=40)
    gate = threading.Event()
    step = worker.scheduler.step

    def slow_step():
        gate.wait(10)
        return step()

    worker.scheduler.step = slow_step
    worker.start()
    try:
        long = events.request([1, 2, 3], 50)
        worker.submit(long)
        gate.set()
        first = asyncio.run_coroutine_threadsafe(long.events.get(), events.loop).result(30)
        assert first[0] == "token"
        worker.cancel(long)
        short = events.request([4, 5], 3)
        worker.submit(short)
        assert events.drain(short)[-1] == ("done", "length")
        assert worker.stats().kv_blocks_used == 0 and worker.stats().running == 0
    finally:
        assert worker.close()


def test_a_failed_engine_pass_fails_its_sequences_and_the_worker_goes_on(engine, events, monkeypatch):
    worker = ServingWorker(engine, None, limits(), num_blocks=40)
    forward = engine.forward_paged

    def failing(cache, batch):
        if 66 in batch.tokens:
            raise RuntimeError("boom")
        return forward(cache, batch)

    monkeypatch.setattr(engine, "forward_paged", failing)
    worker.start()
    try:
        bad = events.request([66, 1], 3)
        worker.submit(bad)
        assert events.drain(bad)[-1] == ("error", "RuntimeError: boom")
        good = events.request([5, 6], 3)
        worker.submit(good)
        assert events.drain(good)[-1] == ("done", "length")
        assert worker.stats().kv_blocks_used == 0
    finally:
        assert worker.close()


def test_worker_refuses_beyond_its_queue_and_what_the_engine_cannot_serve(engine, events):
    worker = ServingWorker(engine, None, limits(queue_size=2), num_blocks=40)
    worker._take_mail = lambda: None  # nothing leaves the queue
    worker.start()
    try:
        for _ in range(2):
            worker.submit(events.request([1], 2))
        with pytest.raises(queue.Full):
            worker.submit(events.request([1], 2))
        with pytest.raises(ValueError, match="max_seq_len"):
            worker.submit(events.request([1] * 60, 10))
    finally:
        assert worker.close()


def test_paged_forward_equals_the_uncached_forward(engine):
    """A whole prompt through forward_paged: logits at its last token equal forward_logits'."""
    prompt = list(range(5, 5 + 37))
    scheduler = Scheduler(engine, 40, max_running=4, max_step_tokens=10)  # four chunks
    sequence = Sequence(prompt, 1, SamplingParams())
    scheduler.add(sequence)
    logits = None
    original = engine.forward_paged

    def keep(cache, batch):
        nonlocal logits
        logits = original(cache, batch)
        return logits

    engine.forward_paged = keep
    try:
        while scheduler.busy:
            scheduler.step()
    finally:
        del engine.forward_paged
    expected = engine.forward_logits(torch.tensor([prompt]))[0, -1]
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_engines_serve_their_own_tokens(precision):
    """Weight-only INT8 / INT4 through the paged path: the same greedy tokens as the engine's own static path."""
    quantized = make("llama", max_batch=4, weight_precision=precision, group_size=16)[1]
    work = requests(5, 3)
    scheduler = Scheduler(quantized, 12, max_running=3, max_step_tokens=9)
    got = run(scheduler, [Sequence(p, n, SamplingParams()) for p, n in work])
    assert got == [quantized.generate([p], n)[0] for p, n in work]
