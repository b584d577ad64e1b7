"""The key/value cache of incremental decoding, allocated once for the engine's largest batch and sequence.

    k, v: (layers, max_batch, kv_heads / tp, max_seq_len, head_dim) in the compute dtype

Prefill writes a batch's prompts at positions 0..T-1; each decode step writes one position per sequence (its own,
so sequences of different lengths share a step) in place: no torch.cat, no allocation per step.
Bytes: 2 * layers * max_batch * (kv_heads / tp) * max_seq_len * head_dim * element size.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layers: int, max_batch: int, kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (layers, max_batch, kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, kv_heads, T, d) of rows 0..B-1 at positions 0..T-1."""
        batch, _, seq, _ = k.shape
        self.k[layer, :batch, :, :seq] = k
        self.v[layer, :batch, :, :seq] = v

    def write_step(self, layer: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                   positions: torch.Tensor) -> None:
        """k, v (B, kv_heads, 1, d) of rows (B,) = 0..B-1, row b at position positions[b] (both int64)."""
        self.k[layer, rows, :, positions] = k[:, :, 0]  # (B, kv_heads, d)
        self.v[layer, rows, :, positions] = v[:, :, 0]

    def prefix(self, layer: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of rows 0..batch-1, positions 0..length-1: (B, kv_heads, S, d) each."""
        return self.k[layer, :batch, :, :length], self.v[layer, :batch, :, :length]
