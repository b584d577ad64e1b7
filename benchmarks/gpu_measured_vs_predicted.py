"""On one GPU: the planner's step time for a Hugging Face Llama against the emitted train.py's measured step time, and
the attention kernel's achieved rate against the profile's, by sequence length.

    python3 benchmarks/gpu_measured_vs_predicted.py [--json] [--cluster dgx-h200] [--seqs 4096 16384] [--steps 8]

1. A Llama of 0.95B parameters (hidden 2048, 16 layers, 16 heads, SwiGLU 5632, vocabulary 32000), made from its
   LlamaConfig (use_cache=False, attn_implementation="sdpa") and saved with save_pretrained, is compiled for one GPU
   of `--cluster` in bf16 at each of `--seqs` (`zplan compile FOLDER --gpus 1 --cluster C --precision bf16 --seq S
   --global-batch 4`), and its emitted train.py runs `--steps` steps on synthetic tokens. measured is the median of
   the logged step_time_s over the steps after the first 3; predicted is plan.json's prediction with its 80 %
   interval; ratio = measured / predicted (> 1: the planner is optimistic). The issue this answers: the published
   PyTorch FSDP runs are slower than the planner's raw figures, more so at long sequences.
2. torch's scaled_dot_product_attention (causal, bf16, batch 1, 16 heads of 128) forward + backward at each length:
   achieved FLOP/s counted as the cost model counts them (4 s^2 h forward FLOPs halved by the mask, times 1 +
   BACKWARD_OVER_FORWARD = 3; FlashAttention-2's papers count 3.5, the backward's recompute of the scores included)
   against the profile's peak times efficiency.attention, the rate the planner prices the attention core at.

Needs CUDA; prints one table (and with --json one JSON object). Took 153 s on an H200 (torch 2.11).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from zplan.planner.cost.compute import BACKWARD_OVER_FORWARD

SKIP_STEPS = 3  # the first steps warm up the allocator and cuBLAS's heuristics
ATTENTION_HEADS, HEAD_DIM = 16, 128


def save_llama(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=32000, max_position_embeddings=65536, use_cache=False,
                         attn_implementation="sdpa")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def measured_against_predicted(folder: Path, cluster: str, seq: int, steps: int, out: Path) -> dict:
    plan_dir = out / f"seq{seq}"
    subprocess.run([sys.executable, "-m", "zplan", "compile", str(folder), "--gpus", "1", "--cluster", cluster,
                    "--precision", "bf16", "--seq", str(seq), "--global-batch", "4", "-o", str(plan_dir)],
                   check=True, stdout=subprocess.DEVNULL)
    plan = json.loads((plan_dir / "plan.json").read_text())
    log = plan_dir / "log.jsonl"
    subprocess.run([sys.executable, str(plan_dir / "train.py"), "--steps", str(steps), "--log-json", str(log)],
                   check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in log.read_text().splitlines() if line][SKIP_STEPS:]
    measured = statistics.median(record["step_time_s"] for record in records)
    phases = {name: statistics.median(record["phases_s"][name] for record in records)
              for name in records[0].get("phases_s", {})}
    prediction = plan["prediction"]
    low, high = (prediction.get("interval") or {}).get("step_time_s") or (None, None)
    parallel = plan["parallel"]
    return {"seq": seq, "micro_batch": parallel.get("micro_batch"), "recompute": parallel.get("recompute"),
            "zero_stage": parallel.get("zero_stage"), "measured_s": measured,
            "predicted_s": prediction["step_time_s"], "interval_s": [low, high],
            "ratio": measured / prediction["step_time_s"], "measured_phases_s": phases,
            "predicted_parts_s": {name: seconds for name, seconds in prediction["time"].items() if seconds},
            "inside": low is not None and low <= measured <= high}


def attention_rate(seq: int, reps: int = 10) -> float:
    """Achieved FLOP/s of causal SDPA forward + backward at `seq` tokens (CUDA events, after 3 warm-ups)."""
    shape = (1, ATTENTION_HEADS, seq, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def once():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        once()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    forward_flops = 4.0 * seq * seq * ATTENTION_HEADS * HEAD_DIM / 2.0
    return (1.0 + BACKWARD_OVER_FORWARD) * forward_flops / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--cluster", default="dgx-h200", help="built-in profile of this GPU (default dgx-h200)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384], help="sequence lengths of the runs")
    parser.add_argument("--steps", type=int, default=8, help=f"steps per run (the first {SKIP_STEPS} dropped)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    from zplan.planner.clusters import load_cluster

    profile = load_cluster(args.cluster)
    priced = profile.peak_flops("bf16") * (profile.efficiency.attention or 1.0)
    attention = [{"seq": s, "tflops": attention_rate(s) / 1e12, "priced_tflops": priced / 1e12}
                 for s in (2048, 4096, 8192, 16384, 32768, 65536)]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        save_llama(folder)
        for seq in args.seqs:
            runs.append(measured_against_predicted(folder, args.cluster, seq, args.steps, Path(tmp)))
    result = {"device": torch.cuda.get_device_name(), "cluster": args.cluster, "runs": runs, "attention": attention}
    for row in attention:
        print(f"attention seq {row['seq']:>6}: {row['tflops']:7.1f} TFLOP/s achieved, priced at "
              f"{row['priced_tflops']:.1f} (achieved / priced {row['tflops'] / row['priced_tflops']:.2f})")
    for run in runs:
        low, high = run["interval_s"]
        print(f"llama 0.95B seq {run['seq']:>6} (micro-batch {run['micro_batch']}, recompute {run['recompute']}, "
              f"ZeRO {run['zero_stage']}): measured {run['measured_s']:.3f} s, predicted {run['predicted_s']:.3f} s "
              f"(80 %: {low:.3f} - {high:.3f}), measured / predicted {run['ratio']:.2f}, inside: {run['inside']}; "
              f"measured phases {run['measured_phases_s']}, predicted parts {run['predicted_parts_s']}")
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
