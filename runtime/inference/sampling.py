"""Choosing the next token from the logits: greedy (temperature 0) or nucleus (top-p) sampling (Holtzman et al.
2020, "The Curious Case of Neural Text Degeneration", sec. 3.1), with parameters per sequence of a batch.

Each sequence draws from its own torch.Generator seeded from its SamplingParams.seed, so a sequence's tokens do not
depend on what else is in the batch and the same seed reproduces the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zplan.errors import ZplanError


class SamplingError(ZplanError):
    """Sampling parameters out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax); > 0: logits / temperature, then top-p sampling
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p
    seed: int = 0  # seeds this sequence's torch.Generator
    stop_token: int | None = None  # generation of this sequence ends after it produces this token

    def __post_init__(self):
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in [0, 1], got {self.top_p}")


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


def sample_next(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits (B, V) fp32 -> one token id per row, row b with params[b] and generators[b]."""
    greedy = logits.argmax(dim=-1).tolist()  # (B,)
    tokens = []
    for row, p in enumerate(params):
        if p.temperature == 0:
            tokens.append(greedy[row])
            continue
        probs = torch.softmax(logits[row].float().cpu() / p.temperature, dim=-1)  # (V,)
        nucleus = top_p_filter(probs, p.top_p)
        tokens.append(int(torch.multinomial(nucleus, 1, generator=generators[row])))
    return tokens
