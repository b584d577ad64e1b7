"""Host overheads for zplan.probe: a reference GPT block at negligible sizes, timed per aten op and per recompute."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zplan.probe_rates import _best_time_s
from zplan.runtime.training.recompute import apply_recompute

REFERENCE_WIDTH, REFERENCE_HEADS, REFERENCE_TOKENS = 8, 2, 4  # negligible sizes: time = host overhead
OVERHEAD_BLOCKS = 4  # reference blocks in the op-overhead stack


# ---- host overhead per op ----------------------------------------------------------------------------


class ReferenceBlock(nn.Module):
    """A pre-LayerNorm GPT block (examples/gpt.py's structure) to time host overheads at negligible sizes."""

    def __init__(self, hidden: int = REFERENCE_WIDTH, heads: int = REFERENCE_HEADS):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        batch, seq, hidden = x.shape
        y = self.ln1(x)
        q, k, v = (proj(y).view(batch, seq, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, a, T, d)
        x = x + self.o(attention.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class ReferenceStack(nn.Module):
    """`blocks` reference blocks in a ModuleList named 'blocks', as zplan's runtime finds a model's blocks."""

    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(ReferenceBlock() for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        return x


def reference_stack(blocks: int) -> ReferenceStack:
    return ReferenceStack(blocks)


def reference_input() -> torch.Tensor:
    return torch.randn(1, REFERENCE_TOKENS, REFERENCE_WIDTH)  # (B, T, h)


def count_aten_ops(fn: Callable[[], object]) -> int:
    """aten ops dispatched by one call of `fn` (the ops the cost model counts per block)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.ops += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.ops


def host_seconds_per_op(seconds: float) -> float:
    """Forward + backward of OVERHEAD_BLOCKS reference blocks at negligible sizes, per aten op dispatched."""
    model, x = reference_stack(OVERHEAD_BLOCKS), reference_input()

    def forward_backward():
        model(x).sum().backward()

    forward_backward()  # gradients exist from here on, as in every micro-batch after a step's first
    return _best_time_s(forward_backward, seconds, clock=time.process_time) / count_aten_ops(forward_backward)


def host_seconds_per_recompute(mode: str, seconds: float) -> float:
    """CPU seconds activation recompute (zplan's runtime: runtime.training.recompute.apply_recompute) adds per block to
    a forward + backward of OVERHEAD_BLOCKS reference blocks at negligible sizes: its machinery and re-run ops."""
    x = reference_input()
    times = []
    for recompute in ("none", mode):
        model = apply_recompute(reference_stack(OVERHEAD_BLOCKS), recompute, "blocks")
        times.append(_best_time_s(lambda model=model: model(x).sum().backward(), seconds / 2, clock=time.process_time))
    return max(0.0, (times[1] - times[0]) / OVERHEAD_BLOCKS)
