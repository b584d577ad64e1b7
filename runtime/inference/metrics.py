"""The inference server's GET /metrics: counters, histograms and a recent token rate, written in Prometheus' text
exposition format (version 0.0.4) without a client library.

The server (runtime/inference/server.py) records each request's events on its event loop (one thread: no locks);
the worker's gauges (running and waiting requests, KV-cache blocks, prefix-cache and preemption counts) are read
from worker.stats() when the page is rendered.

    zplan_requests_running / zplan_requests_waiting                 gauges (worker.stats())
    zplan_kv_cache_blocks_used / _total / _touched                  gauges (worker.stats())
    zplan_prefix_cache_hit_tokens_total / _query_tokens_total       counters (worker.stats())
    zplan_preemptions_total                                         counter (worker.stats())
    zplan_prompt_tokens_total / zplan_generation_tokens_total       counters
    zplan_requests_total{finish_reason="stop"|"length"|"error"|"abort"}  counter
    zplan_time_to_first_token_seconds                               histogram (submit to first token)
    zplan_time_per_output_token_seconds                             histogram (between consecutive tokens)
    zplan_generation_tokens_per_second                              gauge (tokens of the last RATE_WINDOW_S)
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RATE_WINDOW_S = 10  # seconds of tokens behind zplan_generation_tokens_per_second
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
TPOT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0)
FINISH_REASONS = ("stop", "length", "error", "abort")  # abort: the client went away


def _value(value: float) -> str:
    """A sample value as Prometheus writes it (integers without a fraction, +Inf, NaN)."""
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) < 1e15):
        return str(int(value))
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "NaN" if math.isnan(value) else repr(float(value))


class Histogram:
    """Observations counted in cumulative `le` buckets, with their sum and count."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{_value(bound)}"}} {cumulative}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {_value(self.sum)}",
                  f"{name}_count {self.count}"]
        return lines


class TokenRate:
    """Tokens per second over the last `window_s` seconds, counted in one-second bins."""

    def __init__(self, window_s: int = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.bins: deque[list[int]] = deque()  # [second, tokens], oldest first

    def add(self, tokens: int = 1) -> None:
        second = int(self.clock())
        if self.bins and self.bins[-1][0] == second:
            self.bins[-1][1] += tokens
        else:
            self.bins.append([second, tokens])
        self._forget(second)

    def per_second(self) -> float:
        self._forget(int(self.clock()))
        return sum(count for _, count in self.bins) / self.window_s

    def _forget(self, now: int) -> None:
        while self.bins and self.bins[0][0] <= now - self.window_s:
            self.bins.popleft()


class Metrics:
    """The server's counters and histograms; render() writes them, with the worker's gauges, as /metrics."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.tpot = Histogram(TPOT_BUCKETS_S)
        self.rate = TokenRate(clock=clock)

    def request_started(self, prompt_tokens: int) -> float:
        """Count a request's prompt; its start time (seconds, the clock's) for token()."""
        self.prompt_tokens += prompt_tokens
        return self.clock()

    def token(self, started: float, previous: float | None) -> float:
        """Count a generated token of a request started at `started` whose previous token came at `previous`
        (None: this is its first); the token's time, for the next call."""
        now = self.clock()
        if previous is None:
            self.ttft.observe(now - started)
        else:
            self.tpot.observe(now - previous)
        self.generation_tokens += 1
        self.rate.add()
        return now

    def request_finished(self, reason: str) -> None:
        """Count a finished request by its finish reason (stop, length, error or abort)."""
        self.requests[reason] = self.requests.get(reason, 0) + 1

    def render(self, stats) -> str:
        """The exposition text: the worker's gauges from `stats` (ServingStats), then this server's metrics."""
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

        def single(name: str, kind: str, help_text: str, value: float) -> None:
            metric(name, kind, help_text, [f"{name} {_value(value)}"])

        single("zplan_requests_running", "gauge", "Requests whose sequences are in the running batch.", stats.running)
        single("zplan_requests_waiting", "gauge", "Requests waiting to be scheduled.", stats.waiting)
        single("zplan_kv_cache_blocks_used", "gauge", "KV-cache blocks in use.", stats.kv_blocks_used)
        single("zplan_kv_cache_blocks_total", "gauge", "KV-cache blocks in all.", stats.kv_blocks_total)
        single("zplan_kv_cache_blocks_touched", "gauge", "KV-cache blocks ever used (their host memory is taken).",
               stats.kv_blocks_touched)
        single("zplan_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.",
               stats.prefix_cache_hit_tokens)
        single("zplan_prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
               stats.prefix_cache_query_tokens)
        single("zplan_preemptions_total", "counter", "Sequences preempted to free KV-cache blocks.", stats.preemptions)
        single("zplan_prompt_tokens_total", "counter", "Prompt tokens of the requests accepted.", self.prompt_tokens)
        single("zplan_generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
        metric("zplan_requests_total", "counter", "Finished requests by finish reason (abort: the client left).",
               [f'zplan_requests_total{{finish_reason="{reason}"}} {count}' for reason, count in self.requests.items()])
        metric("zplan_time_to_first_token_seconds", "histogram", "Seconds from a request's submission to its first "
               "token.", self.ttft.lines("zplan_time_to_first_token_seconds"))
        metric("zplan_time_per_output_token_seconds", "histogram", "Seconds between consecutive tokens of a request.",
               self.tpot.lines("zplan_time_per_output_token_seconds"))
        single("zplan_generation_tokens_per_second", "gauge", f"Tokens generated per second over the last "
               f"{RATE_WINDOW_S} s.", self.rate.per_second())
        return "\n".join(out) + "\n"
