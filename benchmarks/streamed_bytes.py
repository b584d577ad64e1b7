"""Memory-bound bytes of one eager decoder block against the cost model's STREAMED_PER_SAVED_BYTE.

    .venv/bin/python benchmarks/streamed_bytes.py

The cost model prices the block's memory-bound operations (norms, activations, residual adds, casts, RoPE) as
STREAMED_PER_SAVED_BYTE bytes of HBM traffic per byte the block saves for backward, in the forward, twice that in the
backward (planner/cost/compute.py: Korthikanti et al. 2022's count for Megatron's fused kernels). zplan's runtime runs
the model's own code, unfused. Here a TorchDispatchMode adds up, over one forward and backward of a block in bf16 on
the CPU, the bytes every op other than a matmul or the attention kernel reads and writes (each once: no fusion, no
cache reuse, a roofline's count), and saved_tensors_hooks the bytes the block saves; both are printed in units of
s*b*h bf16 bytes, beside the cost model's figure for the same saved bytes. Blocks: examples/gpt.py's (nn.LayerNorm,
GELU) and transformers' LlamaDecoderLayer (RMSNorm, RoPE and SwiGLU as eager PyTorch, SDPA attention).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

from zplan.planner.cost.compute import BACKWARD_OVER_FORWARD, STREAMED_PER_SAVED_BYTE  # noqa: E402

# The ops the cost model prices elsewhere (GEMMs on the efficiency curve, the attention core at the flash figure)
# and those that move no bytes (views)
NOT_STREAMED = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_efficient_attention_backward", "view", "_unsafe_view", "t", "transpose",
                "expand", "permute", "unsqueeze", "squeeze", "slice", "select", "detach", "alias", "as_strided",
                "split", "split_with_sizes", "unbind", "reshape"}


class StreamedBytes(TorchDispatchMode):
    """Bytes read and written by every op outside NOT_STREAMED, while active."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] not in NOT_STREAMED:
            self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                              if isinstance(t, torch.Tensor))
        return out


def block_bytes(layer: torch.nn.Module, forward, x: torch.Tensor) -> tuple[float, float, float]:
    """(forward bytes, forward + backward bytes, saved bytes) of layer's forward(x), the input and the parameters
    not counted as saved."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    mode = StreamedBytes()
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    forward_bytes = mode.bytes
    with mode:
        y.backward(torch.ones_like(y))
    ours = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    return forward_bytes, mode.bytes, sum(n for ptr, n in saved.items() if ptr not in ours)


def gpt_block(s: int, h: int):
    import gpt

    layer = gpt.Block(h, h // 64, 4 * h).to(torch.bfloat16)
    x = torch.randn(1, s, h, dtype=torch.bfloat16, requires_grad=True)
    return layer, (lambda: layer(x)), x


def llama_block(s: int, h: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=h, intermediate_size=int(2.6875 * h), num_attention_heads=h // 128,
                         num_key_value_heads=h // 128, max_position_embeddings=s, attn_implementation="sdpa")
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    x = torch.randn(1, s, h, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(s).unsqueeze(0)
    rope = LlamaRotaryEmbedding(config)(x, positions)

    def forward():
        out = layer(x, position_embeddings=rope, attention_mask=None, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out
    return layer, forward, x


def main() -> None:
    s, h = 1024, 1024
    unit = s * h * 2  # s*b*h bf16 bytes, b = 1
    print(f"per s*b*h bf16 bytes (s {s}, h {h}); the cost model streams {STREAMED_PER_SAVED_BYTE} x the saved bytes "
          f"forward, {STREAMED_PER_SAVED_BYTE * (1 + BACKWARD_OVER_FORWARD):g} x forward + backward")
    for name, build in (("examples/gpt.py Block", gpt_block), ("transformers LlamaDecoderLayer", llama_block)):
        layer, forward, x = build(s, h)
        fwd, total, saved = block_bytes(layer, forward, x)
        model = STREAMED_PER_SAVED_BYTE * (1 + BACKWARD_OVER_FORWARD) * saved
        print(f"{name}: saved {saved / unit:.1f}; streamed forward {fwd / unit:.1f}, forward + backward "
              f"{total / unit:.1f} = {total / saved:.1f} x saved; the cost model's {model / unit:.1f} "
              f"(measured / model {total / model:.2f})")


if __name__ == "__main__":
    main()
