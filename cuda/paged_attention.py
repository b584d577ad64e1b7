"""Decode attention over a paged KV cache (runtime/inference/paged_cache.py): every running sequence's one new query
per head against the keys and values of its positions, which lie in the cache's blocks in the order its block
table gives (Kwon et al. 2023, "PagedAttention", SOSP).

    out = paged_decode_attention(q, k_cache, v_cache, tables, lengths, scale=d ** -0.5)
    q (D, a, d); k_cache, v_cache (slots, a_kv, d); tables (D, B) int64 block ids; lengths (D,) int64 -> (D, a, d)

Sequence b's position p lives in slot tables[b, p // block_tokens] * block_tokens + p % block_tokens; its query
sees positions 0..lengths[b]-1 (those > lengths[b] - 1 - window only, with a sliding window), query head h the
key/value head h // (a // a_kv). Scores are q . k * scale, soft-capped as cap * tanh(s / cap) when cap > 0.

The torch way gathers each sequence's keys and values into a new tensor every step and layer, then attends: a copy
of the whole cache in use per layer, which on a CPU costs as much as the attention itself. The C++ kernel
(paged_attention.cpp, OpenMP, built just in time like weight_only_matmul.cpp) reads the slots in place; fp32 CPU
tensors only. Elsewhere, or without a C++ build, the reference runs (paged_decode_attention_reference: the gather,
then softmax(q k^T) v per sequence). The two sum in another order, so they agree to float rounding (1e-6).
"""

from __future__ import annotations

from pathlib import Path

import torch

from zplan.cuda.jit import JitExtension, SimdLevel

SOURCE = Path(__file__).with_name("paged_attention.cpp")
SIMD_LEVELS = (SimdLevel("avx2", needs={"avx2", "fma"}, cflags=("-mavx2", "-mfma")), SimdLevel("scalar"))
_CPU = JitExtension(SOURCE, cuda=False, cflags=("-O3", "-fopenmp"), ldflags=("-fopenmp",), simd=SIMD_LEVELS,
                    simd_env="ZPLAN_PAGED_SIMD")


def load_cpu(warn: bool = True):
    """The C++ extension, built on first use and cached; None (after one warning) when the build fails."""
    return _CPU.load(warn=warn)


def kernel_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """The C++ kernel runs tensors of this device and dtype: fp32 on the CPU, and the extension builds."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and load_cpu() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, *, scale: float, window: int | None = None,
                           softcap: float | None = None, block_tokens: int = 16) -> torch.Tensor:
    """(D, a, d): the C++ kernel where kernel_applies, else the reference (module docstring)."""
    if not (kernel_applies(q.device, q.dtype) and k_cache.dtype == torch.float32):
        return paged_decode_attention_reference(q, k_cache, v_cache, tables, lengths, scale=scale, window=window,
                                                softcap=softcap, block_tokens=block_tokens)
    return load_cpu().decode(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), tables.contiguous(),
                             lengths.contiguous(), float(scale), int(window or 0), float(softcap or 0.0),
                             block_tokens, torch.get_num_threads())


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     tables: torch.Tensor, lengths: torch.Tensor, *, scale: float,
                                     window: int | None = None, softcap: float | None = None,
                                     block_tokens: int = 16) -> torch.Tensor:
    """Each sequence's keys and values gathered from its slots, then softmax(q k^T * scale) v in fp32."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        length = int(lengths[b])
        positions = torch.arange(max(0, length - window) if window else 0, length, device=q.device)  # (S,)
        slots = tables[b, positions // block_tokens] * block_tokens + positions % block_tokens
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # (S, a, d)
        values = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[b].float(), keys) * scale  # (a, S)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[b] = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out
