"""Host seconds per aten op of a forward + backward on this machine's GPU, against the GPU profiles' figure.

    python3 benchmarks/gpu_host_overhead.py [--device cuda|cpu] [--json]

The GPU profiles (planner/clusters.py GPU_HOST) price zplan's runtime's host time at one figure per counted aten op,
measured once as a whole step of examples/tiny.py on an H200, what else that step dispatched included. This measures
the per-op part apart: zplan.probe's reference GPT blocks (examples/gpt.py's structure) at negligible sizes (width 8,
4 tokens: the device's work per op is a few microseconds, so the wall time is the host's), bf16 on a GPU, forward +
backward of 2 and of 8 blocks, the device synchronised at the end, fastest of REPEATS; per op = the slope over the
blocks / the slope of the aten ops they dispatch (counted with zplan.probe_overheads.count_aten_ops). Run on a CPU it
times the same (fp32): the cpu-local profile's op_s measures it in CPU time.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from zplan.planner.clusters import GPU_HOST
from zplan.probe_overheads import count_aten_ops, reference_input, reference_stack

BLOCKS = (2, 8)
REPEATS = 50


def forward_backward_s(blocks: int, device: torch.device) -> tuple[float, int]:
    """(fastest seconds of one forward + backward of `blocks` reference blocks, the aten ops it dispatches)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = reference_stack(blocks).to(device=device, dtype=dtype)
    x = reference_input().to(device=device, dtype=dtype)

    def run():
        model(x).sum().backward()

    run()  # gradients exist from here on, as in every micro-batch after a step's first
    best = float("inf")
    for _ in range(REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best, count_aten_ops(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    (few_s, few_ops), (many_s, many_ops) = (forward_backward_s(n, device) for n in BLOCKS)
    per_op = (many_s - few_s) / (many_ops - few_ops)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "ops_per_block": (many_ops - few_ops) / (BLOCKS[1] - BLOCKS[0]),
              "measured_op_s": per_op, "profile_op_s": GPU_HOST.op_s,
              "measured_over_profile": per_op / GPU_HOST.op_s}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['device']}: {per_op * 1e6:.1f} us per aten op ({result['ops_per_block']:.0f} ops a block), the GPU "
          f"profiles price {GPU_HOST.op_s * 1e6:.1f} us (a whole tiny.py step): {result['measured_over_profile']:.2f}x")


if __name__ == "__main__":
    main()
