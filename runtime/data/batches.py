"""This data-parallel rank's micro-batches of packed sequences (packing.py), step after step.

Step s's global batch is positions [p0 + (s - s0) * G, p0 + (s - s0 + 1) * G) of the seeded order, G = dp_size *
num_micro_batches * micro_batch (the plan's global batch, in sequences), where the run started at step s0 with p0
sequences consumed (0 and 0, or what a checkpoint recorded: seek). Data-parallel rank r takes its contiguous slice of
num_micro_batches * micro_batch of them, as the synthetic batches do (runtime/training/data.py), so a run on N ranks
sees the global batch one process sees. Each micro-batch is token ids (micro_batch, seq_len), int64, on the CPU.

From a memory-mapped token file, the pages read are handed back (token_file.release_pages) once about RELEASE_BYTES
may have been mapped since the last time, so the file's pages do not pile up in the resident set over an epoch.
"""

from __future__ import annotations

import numpy as np
import torch

from zplan.runtime.data.packing import SequenceOrder, num_sequences, windows
from zplan.runtime.data.token_file import MAP_AROUND_BYTES, RELEASE_BYTES, is_mapped, release_pages


class TokenBatches:
    """An endless iterator of this rank's micro-batches; `identity` says what data and order they come from."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, micro_batch: int, num_micro_batches: int, dp_rank: int,
                 dp_size: int, seed: int, shuffle: bool = True, identity: dict | None = None):
        self.tokens, self.seq_len = tokens, seq_len
        self.micro_batch, self.num_micro_batches, self.dp_rank = micro_batch, num_micro_batches, dp_rank
        self.global_batch = dp_size * num_micro_batches * micro_batch  # G, sequences per optimizer step
        self.num_sequences = num_sequences(len(tokens), seq_len)
        self.order = SequenceOrder(self.num_sequences, seed, shuffle)
        self.identity = identity or {}
        self.start_sequence, self.start_step, self._yielded = 0, 0, 0  # p0, s0, micro-batches since then
        self.last_ids: np.ndarray | None = None  # the sequences of the last micro-batch (tests read them)
        # bytes a sequence may map: the folios it spans, one more at its ends; None for ids in memory, or a map too
        # small to ever exceed RELEASE_BYTES
        span = -(-seq_len * tokens.itemsize // MAP_AROUND_BYTES) + 1  # folios a sequence may touch
        mapped = is_mapped(tokens) and len(tokens) * tokens.itemsize > RELEASE_BYTES
        self._mapped_per_sequence = span * MAP_AROUND_BYTES if mapped else None
        self._mapped = 0  # bytes mapped (an upper bound) since the pages were last handed back

    def seek(self, step: int, sequences_consumed: int) -> None:
        """Go on from optimizer step `step`, `sequences_consumed` positions of the order behind it (a resume)."""
        self.start_sequence, self.start_step, self._yielded = sequences_consumed, step, 0

    def sequences_at(self, step: int) -> int:
        """Positions of the order consumed once optimizer step `step` (0-based count of steps done) is done."""
        return self.start_sequence + (step - self.start_step) * self.global_batch

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        steps, micro = divmod(self._yielded, self.num_micro_batches)
        first = (self.start_sequence + steps * self.global_batch
                 + (self.dp_rank * self.num_micro_batches + micro) * self.micro_batch)
        self.last_ids = self.order.ids(first, self.micro_batch)
        self._yielded += 1
        if self._mapped_per_sequence is not None:  # hand back the pages read before this batch would pass the bound
            cost = self.micro_batch * self._mapped_per_sequence
            if self._mapped and self._mapped + cost > RELEASE_BYTES:
                release_pages(self.tokens)
                self._mapped = 0
            self._mapped += cost
        return torch.from_numpy(windows(self.tokens, self.last_ids, self.seq_len))  # (micro_batch, T), a copy
