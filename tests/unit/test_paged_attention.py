"""zplan.cuda.paged_attention: the C++ decode kernel against its pure-torch reference, and the reference against
attention computed by hand on a contiguous copy of each sequence's keys and values."""

from __future__ import annotations

import pytest
import torch

from zplan.cuda import paged_attention as pa

BLOCK = 16


def case(seed: int = 0, heads: int = 4, kv_heads: int = 2, d: int = 8, sequences: int = 5):
    generator = torch.Generator().manual_seed(seed)
    blocks = 12
    k_cache = torch.randn(blocks * BLOCK, kv_heads, d, generator=generator)
    v_cache = torch.randn(blocks * BLOCK, kv_heads, d, generator=generator)
    lengths = torch.tensor([1, 16, 17, 40, 33][:sequences])
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:3] for _ in range(sequences)])  # (D, 3)
    q = torch.randn(sequences, heads, d, generator=generator)
    return q, k_cache, v_cache, tables, lengths


def by_hand(q, k_cache, v_cache, tables, lengths, scale, window=None, softcap=None):
    """Per sequence and head, from a contiguous copy of its positions."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(lengths[b])
        slots = [int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
        for h in range(q.shape[1]):
            keys, values = k_cache[slots, h // group], v_cache[slots, h // group]  # (n, d)
            scores = keys @ q[b, h] * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if window:
                scores[: max(0, n - window)] = float("-inf")
            out[b, h] = torch.softmax(scores, dim=0) @ values
    return out


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 2.0), (20, 3.0)])
def test_reference_equals_attention_by_hand(window, softcap):
    args = case()
    expected = by_hand(*args, scale=0.3, window=window, softcap=softcap)
    got = pa.paged_decode_attention_reference(*args, scale=0.3, window=window, softcap=softcap, block_tokens=BLOCK)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 2.0)])
@pytest.mark.parametrize("heads, kv_heads, d", [(4, 2, 8), (3, 3, 13), (8, 1, 64)])
def test_kernel_equals_the_reference(window, softcap, heads, kv_heads, d):
    if pa.load_cpu(warn=False) is None:
        pytest.skip("the C++ extension does not build here")
    args = case(heads=heads, kv_heads=kv_heads, d=d)
    expected = pa.paged_decode_attention_reference(*args, scale=d ** -0.5, window=window, softcap=softcap)
    got = pa.paged_decode_attention(*args, scale=d ** -0.5, window=window, softcap=softcap)
    assert pa.kernel_applies(torch.device("cpu"), torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_other_dtypes_take_the_reference():
    q, k_cache, v_cache, tables, lengths = case()
    assert not pa.kernel_applies(torch.device("cpu"), torch.bfloat16)
    got = pa.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, lengths, scale=0.3)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, by_hand(q.double(), k_cache.double(), v_cache.double(), tables, lengths, 0.3))
