"""Weight-only INT8 / INT4 linear layer on the CPU (cuda/weight_only_matmul.cpp, dequantization fused into the GEMV)
against the fp32 layer it replaces, for decode-sized inputs (few rows of x).

    .venv/bin/python benchmarks/weight_only_matmul.py [--json] [--out 4096] [--in 4096] [--rows 1 4 8] [--reps 9]

For each bit width and row count, the median over `--reps` rounds (after `--warmup`), the sides of each comparison
alternating which runs first, all in the same process (the two slow paths, buffer and reference, in reps / 3 rounds
of their own):
- kernel: zplan.cuda.weight_only_matmul.weight_only_linear_cpu(path="gemv") (the fused C++ GEMV);
- buffer: weight_only_linear_cpu(path="buffer") (C++ dequantization into an fp32 buffer, then F.linear), the path
  for more than CPU_MAX_ROWS rows; gemv_vs_buffer = buffer / kernel (> 1: the GEMV is faster at that row count);
- fp32: F.linear(x, w) with the unquantized fp32 weight (MKL), and, where oneDNN is available, the oneDNN-packed
  fp32 linear the inference engine uses on the CPU (torch.ops.mkldnn._linear_pointwise);
- reference: weight_only_linear_reference (dequantize the whole weight, then F.linear).
speedup_vs_fp32 = fp32 / kernel (> 1: the quantized layer decodes faster than fp32), likewise speedup_vs_onednn and
speedup_vs_reference. weight_gb_s is the kernel's bytes of quantized weight (and scales) read per second. The
weights (64 MiB in fp32 at the default size) are far larger than the caches, so every call streams them from
memory, as a decode step does. The load average is printed: this machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import interleaved_times  # noqa: E402

from zplan.cuda import weight_only_matmul as wom  # noqa: E402
from zplan.cuda import weight_quant as wq  # noqa: E402


def bench(out_f: int, in_f: int, bits: int, rows: int, group_size: int, reps: int, warmup: int) -> dict:
    gen = torch.Generator().manual_seed(bits * 100 + rows)
    w = torch.randn(out_f, in_f, generator=gen)
    x = torch.randn(rows, in_f, generator=gen)
    qw = wq.quantize_groupwise(w, bits, group_size)
    fast = {"kernel": lambda: wom.weight_only_linear_cpu(x, qw, None, path="gemv"), "fp32": lambda: F.linear(x, w)}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        fast["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    # the slow paths are timed in rounds of their own, so that their long bursts on all cores do not land between
    # the short calls being compared
    slow = {"buffer": lambda: wom.weight_only_linear_cpu(x, qw, None, path="buffer"),
            "reference": lambda: wom.weight_only_linear_reference(x, qw, None)}
    error = (wom.weight_only_linear_cpu(x, qw, None, path="gemv")
             - wom.weight_only_linear_reference(x, qw, None)).abs().max()
    times = dict(zip(fast, interleaved_times(list(fast.values()), reps, warmup), strict=True))
    times.update(zip(slow, interleaved_times(list(slow.values()), max(3, reps // 3), 1), strict=True))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"bits": bits, "rows": rows, **{f"{k}_ms": round(v * 1e3, 3) for k, v in med.items()},
              "speedup_vs_fp32": round(med["fp32"] / med["kernel"], 2),
              "gemv_vs_buffer": round(med["buffer"] / med["kernel"], 2),
              "speedup_vs_reference": round(med["reference"] / med["kernel"], 2),
              "weight_gb_s": round(wq.nbytes(qw) / med["kernel"] / 1e9, 2),
              "max_abs_diff_vs_reference": float(error)}
    if "onednn" in med:
        result["speedup_vs_onednn"] = round(med["onednn"] / med["kernel"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--out", type=int, default=4096, help="output features")
    parser.add_argument("--in", dest="in_f", type=int, default=4096, help="input features")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="rows of x (tokens in the batch)")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    threads = torch.get_num_threads()
    if wom.load_cpu(warn=False) is None:
        sys.exit("benchmarks/weight_only_matmul.py: the C++ extension did not build; nothing to measure")
    load_before = os.getloadavg()
    results = [bench(args.out, args.in_f, bits, rows, args.group_size, args.reps, args.warmup)
               for bits in args.bits for rows in args.rows]
    load_after = os.getloadavg()
    summary = {"out": args.out, "in": args.in_f, "group_size": args.group_size, "threads": threads,
               "backend": wom.cpu_backend(), "results": results,
               "loadavg_before": [round(v, 2) for v in load_before], "loadavg_after": [round(v, 2) for v in load_after]}
    if not args.json:
        print(f"weight-only linear {args.out}x{args.in_f}, group {args.group_size}, {threads} threads, "
              f"backend {summary['backend']}, load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
        for r in results:
            onednn = f"  oneDNN fp32 {r['onednn_ms']:7.2f} ms ({r['speedup_vs_onednn']:.2f}x)" if "onednn_ms" in r \
                else ""
            print(f"  int{r['bits']} rows={r['rows']}: kernel {r['kernel_ms']:7.2f} ms ({r['weight_gb_s']:.1f} GB/s)"
                  f"  fp32 F.linear {r['fp32_ms']:7.2f} ms ({r['speedup_vs_fp32']:.2f}x){onednn}"
                  f"  reference {r['reference_ms']:7.1f} ms ({r['speedup_vs_reference']:.1f}x)"
                  f"  buffer {r['buffer_ms']:7.2f} ms ({r['gemv_vs_buffer']:.2f}x)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
