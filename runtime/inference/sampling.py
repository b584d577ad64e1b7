"""Choosing the next token from the logits: greedy (temperature 0) or nucleus (top-p) sampling (Holtzman et al.
2020, "The Curious Case of Neural Text Degeneration", sec. 3.1), with parameters per sequence of a batch.

Each sequence draws from its own torch.Generator seeded from its SamplingParams.seed, so a sequence's tokens do not
depend on what else is in the batch and the same seed reproduces the same text.

One sequence's parameters never fail the others of its batch: a temperature below MIN_TEMPERATURE is greedy (as
vLLM treats temperatures below 1e-5: logits / 1e-300 overflow to infinity, and softmax of that is NaN), the logits
are shifted so that the most likely token's is 0 before they are divided in float32 (exp cannot overflow and the
softmax's sum is at least 1, so no NaN), and a row that still cannot be sampled (the model's logits hold NaN or
+inf, or torch refuses the draw) becomes a SamplingFailure in place of its token: that sequence alone ends with an
error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zplan.errors import ZplanError

MIN_TEMPERATURE = 1e-5  # below it a sequence is decoded greedily (vLLM's _SAMPLING_EPS)
FAILED = -1  # a SamplingFailure's token id where tokens travel as a tensor (the tensor-parallel broadcast)


class SamplingError(ZplanError):
    """Sampling parameters out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # < MIN_TEMPERATURE (0): greedy (argmax); else logits / temperature, then top-p sampling
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p
    seed: int = 0  # seeds this sequence's torch.Generator
    stop_token: int | None = None  # generation of this sequence ends after it produces this token

    def __post_init__(self):
        if not _finite_at_least(self.temperature, 0.0):
            raise SamplingError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        if not _finite_at_least(self.top_p, 0.0) or self.top_p > 1.0:
            raise SamplingError(f"top_p must be in [0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


@dataclass(frozen=True)
class SamplingFailure:
    """In place of a token: this sequence could not be sampled (why: `message`). It has finished; the other
    sequences of its batch go on."""

    message: str


def _finite_at_least(value, low: float) -> bool:
    """value is a real number (not a bool), finite and >= low."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value)) and value >= low
    except OverflowError:  # an int beyond float's range
        return False


def make_generators(params: list[SamplingParams]) -> list[torch.Generator]:
    """One CPU generator per sequence, seeded from its params (sampling runs on the CPU: reproducible on any
    device)."""
    return [torch.Generator().manual_seed(p.seed) for p in params]


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs (V,) -> (V,) with everything outside the nucleus zeroed (not renormalised). The nucleus is the
    smallest prefix of tokens sorted by probability whose sum reaches top_p; it always holds the most likely
    token, so top_p -> 0 is greedy."""
    sorted_probs, order = probs.sort(descending=True)  # (V,)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
    keep_sorted = before < top_p
    keep_sorted[0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
    return probs * keep


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from logits (V,) (finite or -inf, at least one finite) with params.temperature >= MIN_TEMPERATURE:
    softmax((logits - max) / temperature) in float32 (every exponent <= 0, the largest 0: no overflow, no NaN),
    then the top-p nucleus, then a draw from `generator`."""
    row = logits.float().cpu()
    probs = torch.softmax((row - row.max()) / params.temperature, dim=-1)  # (V,)
    return int(torch.multinomial(top_p_filter(probs, params.top_p), 1, generator=generator))


def sample_next(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator]) -> list[int | SamplingFailure]:
    """logits (B, V) fp32 -> for each row b, with params[b] and generators[b]: a token id, or a SamplingFailure
    when that row cannot be sampled (its logits hold NaN or +inf or no finite value, or the draw fails). A row's
    failure never fails the other rows."""
    greedy = logits.argmax(dim=-1)  # (B,)
    broken = (logits.isnan() | logits.isposinf()).any(dim=-1) | ~logits.isfinite().any(dim=-1)  # (B,)
    greedy, broken = torch.stack([greedy, broken.long()]).tolist()  # one device sync
    tokens: list[int | SamplingFailure] = []
    for row, p in enumerate(params):
        if broken[row]:
            tokens.append(SamplingFailure("the model's logits for this sequence hold NaN or infinity"))
        elif p.greedy:
            tokens.append(greedy[row])
        else:
            try:
                tokens.append(sample_row(logits[row], p, generators[row]))
            except Exception as error:  # this row's draw failed: only its sequence ends
                tokens.append(SamplingFailure(f"sampling failed: {type(error).__name__}: {error}"))
    return tokens
