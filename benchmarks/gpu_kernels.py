"""The CUDA kernels of cuda/ against what they replace, on one GPU, in the same process.

    python3 benchmarks/gpu_kernels.py [--json] [--reps 50]

Each pair is timed with CUDA events over `--reps` calls after 5 warm-ups, the two sides alternating three times; the
fastest of the three counts. ratio = baseline / kernel (> 1: the kernel is faster).
- weight-only linear (weight_only_matmul.cu's GEMV, INT8 and INT4, group 128) at decode sizes (1 and 8 rows of a
  4096 -> 14336 layer) against the bf16 F.linear (cuBLAS) with the unquantized weight: the decode step reads the
  weight once, so the quantized layer should win by its bytes (2x INT8, ~3.5x INT4 at best).
- RMSNorm (fused_norm_rope.cu) against the pure-torch reference (the eager ops transformers runs), 8192 x 4096 bf16.
- RoPE (fused_norm_rope.cu) against the eager reference, (1, 32, 4096, 128) bf16.
- INT8 block quantization of a gradient bucket (comm_quant.cu, 64M fp32 elements, blocks of 256) against its
  reference.
GB/s is the kernel's bytes read and written over its time (the roofline: about 4.3 TB/s on an H200). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch


def time_s(fn: Callable[[], object], reps: int) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def pair(name: str, kernel: Callable[[], object], baseline: Callable[[], object], kernel_bytes: float,
         reps: int) -> dict:
    kernel_s, baseline_s = [], []
    for _ in range(3):
        kernel_s.append(time_s(kernel, reps))
        baseline_s.append(time_s(baseline, reps))
    k, b = min(kernel_s), min(baseline_s)
    return {"name": name, "kernel_us": k * 1e6, "baseline_us": b * 1e6, "ratio": b / k,
            "kernel_GB_s": kernel_bytes / k / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--reps", type=int, default=50, help="calls per timing (default 50)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    from zplan.cuda import comm_quant as cq
    from zplan.cuda import fused_norm_rope as fnr
    from zplan.cuda import weight_only_matmul as wom
    from zplan.cuda import weight_quant as wq

    torch.manual_seed(0)
    rows_out, rows_in = 14336, 4096
    w = torch.randn(rows_out, rows_in, device="cuda", dtype=torch.bfloat16) * 0.02
    results = []
    for bits in (8, 4):
        qw = wq.quantize_groupwise(w, bits, 128)  # on the GPU, as the inference engine quantizes
        for rows in (1, 8):
            x = torch.randn(rows, rows_in, device="cuda", dtype=torch.bfloat16)
            results.append(pair(f"int{bits} linear {rows}x{rows_in}->{rows_out}",
                                lambda x=x, qw=qw: wom.weight_only_linear_cuda(x, qw),
                                lambda x=x: torch.nn.functional.linear(x, w), wq.nbytes(qw), args.reps))
    h = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    gamma = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    results.append(pair("rmsnorm 8192x4096", lambda: fnr.rms_norm_cuda(h, gamma, 1e-5),
                        lambda: fnr.rms_norm_reference(h, gamma, 1e-5), 2 * h.nbytes, args.reps))
    q = torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16)
    angles = torch.randn(1, 1, 4096, 128, device="cuda")
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    results.append(pair("rope 1x32x4096x128", lambda: fnr.apply_rotary_cuda(q, cos, sin),
                        lambda: fnr.apply_rotary_reference(q, cos, sin), 2 * q.nbytes + 2 * cos.nbytes, args.reps))
    bucket = torch.randn(1 << 26, device="cuda")
    results.append(pair("int8 blocks 64M fp32", lambda: cq.quantize_int8_blocks(bucket, 256),
                        lambda: cq.quantize_int8_blocks_reference(bucket, 256), bucket.nbytes * 1.25, args.reps))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for r in results:
        print(f"{r['name']:<32} kernel {r['kernel_us']:9.1f} us ({r['kernel_GB_s']:7.0f} GB/s), baseline "
              f"{r['baseline_us']:9.1f} us, baseline / kernel {r['ratio']:.2f}")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
