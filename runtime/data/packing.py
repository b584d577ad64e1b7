"""Packing token ids into training sequences, and the order they are visited in.

Documents are joined with the separator after each one (tokenizer.py: encode_joined). The model sees sequences of
seq_len tokens (token ids (B, T), T = the plan's seq_len) and its next-token loss predicts tokens 1..T-1 of each from
those before
(model.model_file.next_token_loss), so consecutive sequences share one token: sequence i is tokens
[i * (T - 1), i * (T - 1) + T), and every next-token target of the stream is in exactly one sequence (nanoGPT's
x / y of T + 1 tokens, for a loss that shifts inside the batch). A partial sequence at the end is dropped.

The order is a permutation of the sequences per epoch, a function of (seed, epoch) alone (numpy's PCG64):
position k of the stream is sequence permutation(seed, k // N)[k % N] of N sequences.
"""

from __future__ import annotations

import numpy as np

from zplan.runtime.data.errors import DataError


def num_sequences(num_tokens: int, seq_len: int) -> int:
    """Whole sequences of `seq_len` tokens in a stream of `num_tokens` (consecutive ones sharing one token)."""
    if seq_len < 2:
        raise DataError(f"sequences of {seq_len} token cannot be trained on (the loss predicts token t+1 from token "
                        "t): compile with --seq 2 or more")
    return 0 if num_tokens < seq_len else (num_tokens - 1) // (seq_len - 1)


def windows(tokens: np.ndarray, ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Sequences `ids` of `tokens` (a memmap is read only where they lie): (len(ids), seq_len) int64."""
    index = np.asarray(ids, dtype=np.int64)[:, None] * (seq_len - 1) + np.arange(seq_len)  # (n, T)
    return np.asarray(tokens[index], dtype=np.int64)


class SequenceOrder:
    """Which sequence each position of the stream holds: a permutation per epoch of `count` sequences (in file
    order when not shuffled)."""

    def __init__(self, count: int, seed: int, shuffle: bool = True):
        self.count, self.seed, self.shuffle = count, seed, shuffle
        self._epochs: dict[int, np.ndarray] = {}  # the last two epochs' permutations (a batch may straddle two)

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._epochs[epoch] = rng.permutation(self.count) if self.shuffle else np.arange(self.count)
        return self._epochs[epoch]

    def ids(self, start: int, length: int) -> np.ndarray:
        """The sequences at positions [start, start + length) of the stream, (length,) int64."""
        positions = np.arange(start, start + length, dtype=np.int64)
        epochs, within = np.divmod(positions, self.count)
        out = np.empty(length, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.permutation(int(epoch))[within[mask]]
        return out
