"""The paged key/value cache of continuous batching (Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP): the cache is cut into fixed blocks of BLOCK_TOKENS positions,
and each sequence holds a block table (its blocks in order), so memory is taken a block at a time as the sequence
grows and given back the moment it ends.

    cache = PagedKVCache(layers, num_blocks, kv_heads, head_dim, dtype, device)
    k, v: (layers, num_blocks * BLOCK_TOKENS, kv_heads, head_dim): one row ("slot") per cached position;
          position p of a sequence lives in slot table[p // BLOCK_TOKENS] * BLOCK_TOKENS + p % BLOCK_TOKENS
    bytes: 2 * layers * num_blocks * BLOCK_TOKENS * kv_heads * head_dim * element size

BlockPool hands out the blocks, counts their users and keeps a prefix cache: a full block of prompt tokens is
registered under the hash of its tokens and of every token before it (block_hash), so a later prompt that starts
with the same tokens takes those blocks instead of computing them again. A block nobody uses any more keeps its
contents and hash until it is needed for something else (least recently freed first, and only once no block used
before is free: blocks never used are touched last, so on a CPU the cache's memory grows with the peak load, not
with time).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

BLOCK_TOKENS = 16  # positions per block (vLLM's default; the planner sizes the cache in blocks of this many)


def block_hash(previous: bytes, tokens: list[int]) -> bytes:
    """The identity of a full block: the hash of the block before it and of its own tokens (SHA-256)."""
    digest = hashlib.sha256(previous)
    digest.update(b",".join(str(t).encode() for t in tokens))
    return digest.digest()


class PagedKVCache:
    """Slots of keys and values for every layer; writes and reads address slots (int64 tensors)."""

    def __init__(self, layers: int, num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (layers, num_blocks * BLOCK_TOKENS, kv_heads, head_dim)
        # empty: host memory is taken as blocks are first used (BlockPool hands out the used ones first), and each
        # block is zeroed then (clear)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks

    def clear(self, blocks: list[int]) -> None:
        """Zero blocks used for the first time: a batched read pads with, and masks, slots a sequence has not
        written, and a masked NaN would still spread (0 * NaN)."""
        for block in blocks:
            self.k[:, block * BLOCK_TOKENS:(block + 1) * BLOCK_TOKENS] = 0
            self.v[:, block * BLOCK_TOKENS:(block + 1) * BLOCK_TOKENS] = 0

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (N, kv_heads, d) into slots (N,)."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of slots (B, S) as (B, kv_heads, S, d) each (a copy)."""
        k = self.k[layer][slots]  # (B, S, kv_heads, d)
        v = self.v[layer][slots]
        return k.transpose(1, 2), v.transpose(1, 2)


class BlockPool:
    """Allocation of num_blocks blocks with user counts and the prefix cache of full prompt blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: list[int] = []  # used before, now without users and uncached: the last freed first
        self.untouched = num_blocks  # blocks never handed out: num_blocks - untouched .. num_blocks - 1
        self.fresh: list[int] = []  # blocks handed out for the first time since take_fresh() (to be zeroed)
        self.users = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block holding those tokens
        self.hash_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks with no user, least recently freed first
        self.hit_tokens = 0  # prompt tokens found in the prefix cache
        self.query_tokens = 0  # prompt tokens looked up

    @property
    def available(self) -> int:
        """Blocks that can be allocated now (free, cached and idle, or never used)."""
        return len(self.free) + len(self.idle) + self.untouched

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    def allocate(self) -> int | None:
        """A block for one user, or None when none is left: a free block used before, else the least recently freed
        idle cached one (evicted), else one never used (recorded in `fresh`). The blocks in use so far are reused
        before any other is touched, so the cache's resident memory stops growing once the load stops growing."""
        if self.free:
            block = self.free.pop()
        elif self.idle:
            block, _ = self.idle.popitem(last=False)
            del self.cached[self.hash_of.pop(block)]
        elif self.untouched:
            block = self.num_blocks - self.untouched
            self.untouched -= 1
            self.fresh.append(block)
        else:
            return None
        self.users[block] = 1
        return block

    def take_fresh(self) -> list[int]:
        """The blocks handed out for the first time since the last call."""
        fresh, self.fresh = self.fresh, []
        return fresh

    def release(self, blocks: list[int]) -> None:
        """One user fewer on each block; a block left without users becomes free (or idle, when cached)."""
        for block in blocks:
            self.users[block] -= 1
            if self.users[block] == 0:
                if block in self.hash_of:
                    self.idle[block] = None
                else:
                    self.free.append(block)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (a prompt's full blocks in order), each taken for one
        more user."""
        found = []
        for digest in hashes:
            block = self.cached.get(digest)
            if block is None:
                break
            found.append(block)
            self.users[block] += 1
            self.idle.pop(block, None)
        return found

    def register(self, block: int, digest: bytes) -> None:
        """`block` now holds the tokens of `digest` (a full, computed block): later prompts may share it. A second
        block with the same tokens stays private."""
        if digest not in self.cached and block not in self.hash_of:
            self.cached[digest] = block
            self.hash_of[block] = digest
