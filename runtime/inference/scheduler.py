"""Continuous batching (Yu et al. 2022, "Orca", OSDI: iteration-level scheduling) over the paged KV cache
(runtime/inference/paged_cache.py): the serving worker calls step() again and again, and each step runs one pass of
the engine over

  1. every running sequence's newest token (decoding: one token each);
  2. the next chunk of each sequence still reading its prompt, then of waiting sequences admitted in arrival order
     while KV blocks and running places are free: at most max_step_tokens tokens in all, so a long prompt is read
     in chunks between decode steps instead of stalling them (chunked prefill, Agrawal et al. 2024, "Sarathi").

A sequence that has read all its tokens is sampled; it leaves the moment it produces its stop token or its last
allowed token, or is cancelled, and its blocks are free for the next step. Full blocks of a prompt are kept in the
prefix cache, so a prompt that starts like an earlier one skips those tokens. When a running sequence needs a block
and none is free, the most recently admitted other sequence is preempted: its blocks are given back and it waits at
the front of the queue to be read again (recompute; its tokens so far are kept and the prefix cache usually still
holds them). Nothing runs out of memory and no request is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from zplan.errors import ZplanError
from zplan.runtime.inference.paged_cache import BLOCK_TOKENS, BlockPool, block_hash
from zplan.runtime.inference.sampling import SamplingFailure, SamplingParams
from zplan.runtime.inference.step_batch import StepBatch

DEFAULT_STEP_TOKENS = 512  # tokens per engine pass at most (decodes + prompt chunks)


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


@dataclass(eq=False)
class Sequence:
    """One request's tokens and place in the cache. tokens: prompt then generated; computed: how many of them have
    their keys and values in the cache (the rest are fed at the next step)."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    handle: Any = None  # the caller's request
    logprobs: bool = False
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # of tokens' full blocks, in order
    registered: int = 0  # blocks offered to the prefix cache
    generator: torch.Generator | None = None

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.generator = torch.Generator().manual_seed(self.sampling.seed)

    def full_block_hashes(self, count: int) -> list[bytes]:
        """Hashes of the first `count` full blocks of tokens (extended as needed)."""
        while len(self.hashes) < count:
            j = len(self.hashes)
            self.hashes.append(block_hash(self.hashes[-1] if self.hashes else b"",
                                          self.tokens[j * BLOCK_TOKENS:(j + 1) * BLOCK_TOKENS]))
        return self.hashes[:count]


@dataclass(frozen=True)
class Outcome:
    """What a step did for a sequence: its new token (and log-probability when asked), and whether it finished:
    "stop" (its stop token), "length" (max_new_tokens or the context), "error" (message; no token)."""

    sequence: Sequence
    token: int | None
    logprob: float | None = None
    finish: str | None = None
    message: str = ""


class Scheduler:
    """Waiting and running sequences of one engine over one paged cache (num_blocks blocks)."""

    def __init__(self, engine, num_blocks: int, *, max_running: int, max_step_tokens: int = DEFAULT_STEP_TOKENS,
                 runner=None):
        if num_blocks < blocks_for(engine.max_seq_len):
            raise ZplanError(f"{num_blocks} KV blocks of {BLOCK_TOKENS} tokens cannot hold one sequence of "
                             f"max_seq_len {engine.max_seq_len}: give the cache at least "
                             f"{blocks_for(engine.max_seq_len)} blocks")
        self.engine, self.max_running, self.max_step_tokens = engine, max_running, max(1, max_step_tokens)
        self.cache = engine.paged_cache(num_blocks)
        self.pool = BlockPool(num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.preemptions = 0
        self.runner = runner  # called with each StepBatch before the pass (the tensor-parallel broadcast), or None

    def check(self, prompt: list[int], max_new_tokens: int) -> str | None:
        """Why a request cannot be served (None: it can)."""
        if not prompt:
            return "the prompt is empty: send at least one token"
        if max_new_tokens < 1:
            return f"max_new_tokens is {max_new_tokens}: ask for at least one token"
        if len(prompt) + max_new_tokens > self.engine.max_seq_len:
            return (f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens exceeds max_seq_len "
                    f"{self.engine.max_seq_len}: shorten the prompt or ask for fewer tokens")
        bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
        if bad:
            return f"the prompt holds token ids outside the vocabulary [0, {self.engine.vocab_size}): {bad[:5]}"
        return None

    def add(self, sequence: Sequence) -> None:
        problem = self.check(sequence.prompt, sequence.max_new_tokens)
        if problem:
            raise ZplanError(problem)
        self.waiting.append(sequence)

    def cancel(self, sequence: Sequence) -> None:
        """Remove `sequence` wherever it is and give its blocks back."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self._release(sequence)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def _release(self, sequence: Sequence) -> None:
        self.pool.release(sequence.blocks)
        sequence.blocks, sequence.computed, sequence.registered = [], 0, 0

    def _grow(self, sequence: Sequence, end: int) -> bool:
        """Blocks for positions up to end - 1; False (nothing taken) when too few are free."""
        need = blocks_for(end) - len(sequence.blocks)
        if need > self.pool.available:
            return False
        sequence.blocks += [self.pool.allocate() for _ in range(need)]
        return True

    def _make_room(self, sequence: Sequence, count: int, plan: list[tuple[Sequence, int]]) -> bool:
        """Blocks for the running `sequence`'s next `count` tokens, preempting the most recently admitted others
        not yet in this step's plan while too few are free; when none is left, `sequence` itself waits (False)."""
        while sequence in self.running and not self._grow(sequence, sequence.computed + count):
            planned = [s for s, _ in plan]
            if not self._preempt(keep=[*planned, sequence]):
                self._preempt(keep=planned)  # none other left: this one waits
        return sequence in self.running

    def _preempt(self, keep: list[Sequence]) -> bool:
        """Give back the blocks of the most recently admitted running sequence not in `keep`; False if none."""
        for victim in reversed(self.running):
            if victim not in keep:
                self.running.remove(victim)
                self._release(victim)
                self.waiting.appendleft(victim)
                self.preemptions += 1
                return True
        return False

    def _take_cached_prefix(self, sequence: Sequence) -> int:
        """Give a waiting sequence the cached blocks its tokens start with (at least its last token is left to
        compute); the prompt tokens it looked up."""
        full = (len(sequence.tokens) - 1) // BLOCK_TOKENS
        found = self.pool.lookup(sequence.full_block_hashes(full))
        sequence.blocks, sequence.computed, sequence.registered = found, len(found) * BLOCK_TOKENS, len(found)
        return full * BLOCK_TOKENS

    def _schedule(self) -> tuple[StepBatch, list[tuple[Sequence, int]]]:
        batch, plan, budget = StepBatch(), [], self.max_step_tokens
        decoding = sorted((s for s in self.running if len(s.tokens) - s.computed == 1),
                          key=lambda s: -len(s.tokens))  # longest first: the engine reads them in runs of like length
        reading = [s for s in self.running if len(s.tokens) - s.computed > 1]
        for sequence in decoding:  # every decode first: one token each
            if self._make_room(sequence, 1, plan):
                plan.append((sequence, 1))
                budget -= 1
        batch.decodes = len(plan)
        for sequence in reading:
            count = min(len(sequence.tokens) - sequence.computed, budget)
            if count > 0 and self._make_room(sequence, count, plan):
                plan.append((sequence, count))
                budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            sequence = self.waiting[0]
            looked_up = self._take_cached_prefix(sequence)
            count = min(len(sequence.tokens) - sequence.computed, budget)
            if not self._grow(sequence, sequence.computed + count):
                self._release(sequence)  # the blocks it found go back; it waits for blocks to free up
                break
            self.pool.query_tokens += looked_up
            self.pool.hit_tokens += sequence.computed
            self.waiting.popleft()
            self.running.append(sequence)
            plan.append((sequence, count))
            budget -= count
        batch.fresh = self.pool.take_fresh()
        for index, (sequence, count) in enumerate(plan):
            start = sequence.computed
            batch.add(sequence.tokens[start:start + count], start, sequence.blocks)
            if start + count == len(sequence.tokens):
                batch.sample.append(index)
        return batch, plan

    @torch.no_grad()
    def step(self) -> list[Outcome]:
        """One engine pass over what is scheduled now; the outcome of every sequence that was sampled or failed."""
        batch, plan = self._schedule()
        if not plan:
            return []
        params = [plan[i][0].sampling for i in batch.sample]
        sampled = [plan[i][0] for i in batch.sample]
        try:
            if self.runner is not None:
                self.runner(batch, params)
            logits = self.engine.forward_paged(self.cache, batch)  # (len(batch.sample), V)
            chosen = self.engine.sample(logits, params, [s.generator for s in sampled]) if sampled else []
        except Exception as error:  # the pass failed: its sequences end with the error; the others go on
            message = f"{type(error).__name__}: {error}"
            for sequence, _ in plan:
                self.cancel(sequence)
            return [Outcome(sequence, None, finish="error", message=message) for sequence, _ in plan]
        for sequence, count in plan:
            sequence.computed += count
            self._register(sequence)
        outcomes = []
        for row, (sequence, token) in enumerate(zip(sampled, chosen, strict=True)):
            outcomes.append(self._advance(sequence, token, logits[row]))
        return outcomes

    def _register(self, sequence: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        full = sequence.computed // BLOCK_TOKENS
        for j, digest in enumerate(sequence.full_block_hashes(full)[sequence.registered:], start=sequence.registered):
            self.pool.register(sequence.blocks[j], digest)
        sequence.registered = max(sequence.registered, full)

    def _advance(self, sequence: Sequence, token, logits_row: torch.Tensor) -> Outcome:
        if isinstance(token, SamplingFailure):
            self._finish(sequence)
            return Outcome(sequence, None, finish="error", message=token.message)
        logprob = float(torch.log_softmax(logits_row, dim=-1)[token]) if sequence.logprobs else None
        sequence.tokens.append(token)
        sequence.generated += 1
        finish = None
        if token == sequence.sampling.stop_token:
            finish = "stop"
        elif sequence.generated >= sequence.max_new_tokens or len(sequence.tokens) >= self.engine.max_seq_len:
            finish = "length"
        if finish:
            self._finish(sequence)
        return Outcome(sequence, token, logprob, finish)

    def _finish(self, sequence: Sequence) -> None:
        if sequence in self.running:
            self.running.remove(sequence)
        self._release(sequence)
