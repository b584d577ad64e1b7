"""What one iteration of continuous batching computes (the scheduler builds it, engine.forward_paged runs it, and
under tensor parallel rank 0 broadcasts it to the other ranks): plain lists, so that it pickles small.

The batch is a run of segments, one per scheduled sequence, their tokens laid end to end: first `decodes`
segments of one token each (a running sequence's newest token), then prompt chunks. A segment's tokens are the
positions context - count .. context - 1 of its sequence, whose block table maps position p to the slot
table[p // BLOCK_TOKENS] * BLOCK_TOKENS + p % BLOCK_TOKENS of the paged cache (runtime/inference/paged_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zplan.runtime.inference.paged_cache import BLOCK_TOKENS


def paged_slots(tables: list[list[int]], length: int, device: torch.device) -> torch.Tensor:
    """(B, length) int64: the slots of positions 0..length-1 of B sequences with these block tables; positions past
    a table read slot 0 (padding of a batched read, masked out by causality)."""
    blocks = -(-length // BLOCK_TOKENS)
    padded = torch.tensor([table[:blocks] + [0] * (blocks - len(table[:blocks])) for table in tables],
                          dtype=torch.long)  # (B, blocks)
    slots = padded[:, :, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)  # (B, blocks, BLOCK_TOKENS)
    return slots.reshape(len(tables), -1)[:, :length].to(device)


@dataclass
class StepBatch:
    tokens: list[int] = field(default_factory=list)  # (N,) token ids, segments end to end
    positions: list[int] = field(default_factory=list)  # (N,) each token's position in its sequence
    slots: list[int] = field(default_factory=list)  # (N,) the cache slot each token's keys and values go to
    segments: list[tuple[int, int]] = field(default_factory=list)  # per segment (count, context): its tokens, and
    # the positions it attends to (0..context-1, its own included)
    tables: list[list[int]] = field(default_factory=list)  # per segment: its sequence's block table
    decodes: int = 0  # the first `decodes` segments are single decode tokens
    sample: list[int] = field(default_factory=list)  # segments whose last token's logits are wanted, in order
    fresh: list[int] = field(default_factory=list)  # blocks used for the first time, zeroed before the pass

    def add(self, tokens: list[int], start: int, table: list[int]) -> None:
        """A segment: `tokens` at positions start.. of the sequence with block table `table`."""
        positions = range(start, start + len(tokens))
        self.tokens += tokens
        self.positions += positions
        self.slots += [table[p // BLOCK_TOKENS] * BLOCK_TOKENS + p % BLOCK_TOKENS for p in positions]
        self.segments.append((len(tokens), start + len(tokens)))
        self.tables.append(list(table))

    def sample_rows(self) -> list[int]:
        """Row in tokens of the last token of each segment in `sample`."""
        ends, total = [], 0
        for count, _ in self.segments:
            total += count
            ends.append(total - 1)
        return [ends[s] for s in self.sample]
