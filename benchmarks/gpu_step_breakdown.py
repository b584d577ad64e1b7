"""Where one decoder block's time goes on a GPU, part by part, against the cost model's price of each part.

    python3 benchmarks/gpu_step_breakdown.py [--json] [--cluster dgx-h200] [--seq 4096] [--micro-batch 4]
    .venv/bin/python benchmarks/gpu_step_breakdown.py --device cpu --cluster cpu-local --seq 64 --hidden 64 --ffn 128
        --heads 4   # a smoke run of the script itself; its figures mean nothing

benchmarks/gpu_measured_vs_predicted.py found a transformers Llama's training step on one H200 slower than its plan
outside the attention kernel. This splits one LlamaDecoderLayer (default: hidden 2048, 16 heads, SwiGLU 5632, the
0.95B model of that benchmark) in bf16, forward + backward on (micro-batch, seq, hidden), into what the cost model
prices apart (planner/cost/compute.py block_time_s):
- gemms: the block's Linears as three matmuls each (Y = X W^T, dX = G W, dW = G^T X) at the block's shapes;
- attention: torch's causal scaled_dot_product_attention, forward + backward, at (b, heads, s, head_dim);
- rest: the whole block less those two: the eager elementwise ops (RMSNorm, RoPE, SiLU, products, residual adds,
  casts), their launches, and what autograd adds.
Each is the median of `--reps` timed calls after 3 warm-ups (CUDA events; wall time on the CPU). The prices: each term
of block_time_s for the same model (traced from the saved config by zplan) and micro-batch, found by making that
term alone free in a copy of the profile (the GEMM efficiency, the attention efficiency or the activation ops'
bandwidth a million times higher) and taking the difference, so no formula is written twice; rest is priced as the
memory-bound traffic plus the host time per op (zero on GPU profiles). A profile with no flash-attention figure
(cpu-local) prices the attention core on the GEMM curve, inside gemms, and attention at 0. ratio = measured / priced.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

FREE = 1e6  # the factor that makes one term of the price vanish


def timer(device: str, reps: int):
    def median_s(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                fn()
                times.append(time.perf_counter() - began)
        return statistics.median(times)
    return median_s


def llama_config(hidden: int, ffn: int, heads: int, seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=heads, vocab_size=32000, max_position_embeddings=seq, use_cache=False,
                       attn_implementation="sdpa")


def measured(config, b: int, s: int, device: str, reps: int) -> dict[str, float]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    median_s = timer(device, reps)
    dtype = torch.bfloat16
    h, heads = config.hidden_size, config.num_attention_heads
    layer = LlamaDecoderLayer(config, 0).to(device=device, dtype=dtype)
    x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(s, device=device).unsqueeze(0)
    rope = LlamaRotaryEmbedding(config).to(device)(x, positions)
    grad = torch.randn(b, s, h, device=device, dtype=dtype)

    def block():
        out = layer(x, position_embeddings=rope, attention_mask=None, position_ids=positions)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    q, k, v = (torch.randn(b, heads, s, h // heads, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    attention_grad = torch.randn(b, heads, s, h // heads, device=device, dtype=dtype)

    def attention():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(attention_grad)

    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    operands = [(torch.randn(b * s, m.in_features, device=device, dtype=dtype), m.weight.detach(),
                 torch.randn(b * s, m.out_features, device=device, dtype=dtype)) for m in linears]

    def gemms():
        for inputs, weight, out_grad in operands:
            inputs @ weight.t()
            out_grad @ weight
            out_grad.t() @ inputs

    whole, core, matmuls = median_s(block), median_s(attention), median_s(gemms)
    return {"block": whole, "gemms": matmuls, "attention": core, "rest": whole - matmuls - core}


def priced(folder: Path, cluster_name: str, b: int, s: int) -> dict[str, float]:
    from zplan.api import prepare
    from zplan.planner.cost.compute import block_host_s, block_time_s
    from zplan.planner.cost.inputs import Candidates, ModelNumbers
    from zplan.schemas.spec import Pins

    req = prepare(str(folder), 1, cluster_name, b, s, "bf16", Pins(tp=1, pp=1))
    model, cluster = ModelNumbers.from_summary(req.summary), req.cluster
    cand = Candidates.single(tp=1, pp=1, dp=1, micro_batch=b, zero=3, recompute=0, sp=0, interleave=1, offload=0)
    eff = cluster.efficiency

    def block_s(**efficiency) -> float:
        changed = cluster.model_copy(update={"efficiency": eff.model_copy(update=efficiency)})
        return float(block_time_s(model, cand, changed, "bf16")[0])

    whole = block_s()
    gemms = whole - block_s(gemm_max=eff.gemm_max * FREE)
    attention = whole - block_s(attention=(eff.attention or 1.0) * FREE) if eff.attention is not None else 0.0
    activation = "activation_ops" if eff.activation_ops is not None else "memory_bound"
    streamed = whole - block_s(**{activation: getattr(eff, activation) * FREE})
    host = float(block_host_s(cand.recompute, cluster)[0])
    return {"block": whole, "gemms": gemms, "attention": attention, "rest": streamed + host}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--cluster", default="dgx-h200", help="built-in profile of this GPU (default dgx-h200)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run only")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10, help="timed calls per part (default 10)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --device cpu for a smoke run)")
    config = llama_config(args.hidden, args.ffn, args.heads, args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        config.save_pretrained(folder)  # a config alone: zplan traces the model from it
        price = priced(folder, args.cluster, args.micro_batch, args.seq)
    measure = measured(config, args.micro_batch, args.seq, args.device, args.reps)
    rows = {part: {"measured_ms": measure[part] * 1e3, "priced_ms": price[part] * 1e3,
                   "ratio": measure[part] / price[part] if price[part] > 0 else None} for part in measure}
    print(f"one LlamaDecoderLayer, bf16, micro-batch {args.micro_batch} x {args.seq} tokens, hidden {args.hidden}, "
          f"ffn {args.ffn}, {args.heads} heads, on {args.device} against the {args.cluster} profile")
    for part, row in rows.items():
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        print(f"{part:>9}: measured {row['measured_ms']:8.3f} ms, priced {row['priced_ms']:8.3f} ms, "
              f"measured / priced {ratio}")
    if args.json:
        print(json.dumps({"cluster": args.cluster, "device": args.device, "seq": args.seq,
                          "micro_batch": args.micro_batch, "parts": rows}, indent=2))


if __name__ == "__main__":
    main()
