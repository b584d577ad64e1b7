"""zplan's inference engine against Hugging Face transformers' generate on the same GPT-2-sized model (124M
parameters, random weights), greedy, in one process.

    .venv/bin/python benchmarks/inference.py [--json] [--reps 3] [--prompt 32] [--new 32]

GPT2LMHeadModel(GPT2Config()) (12 layers, hidden 768, 12 heads, vocab 50257) is built from its config, and its
weights are copied into zplan.examples.gpt.build_model(12, 768, 12, vocab_size=50257, max_seq_len=1024) (HF's
Conv1D weights are (in, out): transposed; c_attn splits into q, k, v). Both models' logits are compared first.
Then each side generates `--new` tokens after `--prompt` random prompt tokens (min_new_tokens for HF, so both
generate all), batch 1 and 8, one warm-up run each, then `--reps` timed runs alternating which side goes first;
the median counts (the best run's ratios are printed too: this machine is shared, and a busy neighbour slows
two-thread runs by up to 10x). A run's time includes the prefill; tokens/s = batch * new / time, per-token
latency = time / new.

Figures (targets from the issue):
    throughput_ratio_b8  zplan tokens/s / HF tokens/s at batch 8          target >= 1.5
    latency_ratio_b1     zplan per-token latency / HF's at batch 1         target <= 0.8
    int8_bytes_ratio     engine.weight_bytes() int8 / fp32                 target <= 0.3
The int8 engine (weight-only, group 128, the head -- here the tied token table -- quantized too) is timed as well.
The load average is printed with the results: this machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zplan.examples import gpt  # noqa: E402
from zplan.model_input import trace_module  # noqa: E402
from zplan.runtime.inference.engine import InferenceEngine  # noqa: E402

LAYERS, HIDDEN, HEADS, VOCAB, POSITIONS = 12, 768, 12, 50257, 1024
BATCHES = (1, 8)


def build_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(HF GPT2LMHeadModel with random weights, zplan's examples/gpt.py model holding the same weights)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config()).eval()
    ours = gpt.build_model(num_layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab_size=VOCAB,
                           max_seq_len=POSITIONS).eval()
    src = hf.transformer
    with torch.no_grad():
        ours.wte.weight.copy_(src.wte.weight)  # also the tied head
        ours.wpe.weight.copy_(src.wpe.weight)
        ours.ln_f.load_state_dict(src.ln_f.state_dict())
        for block, h in zip(ours.blocks, src.h, strict=True):
            block.ln1.load_state_dict(h.ln_1.state_dict())
            block.ln2.load_state_dict(h.ln_2.state_dict())
            qkv_w = h.attn.c_attn.weight.t()  # Conv1D (in, 3h) -> (3h, in)
            for linear, w, b in zip((block.attn.q, block.attn.k, block.attn.v), qkv_w.split(HIDDEN),
                                    h.attn.c_attn.bias.split(HIDDEN), strict=True):
                linear.weight.copy_(w)
                linear.bias.copy_(b)
            for linear, conv in ((block.attn.o, h.attn.c_proj), (block.mlp.up, h.mlp.c_fc),
                                 (block.mlp.down, h.mlp.c_proj)):
                linear.weight.copy_(conv.weight.t())
                linear.bias.copy_(conv.bias)
    return hf, ours


def summary_of_gpt2():
    with torch.device("meta"):
        meta_model = gpt.build_model(num_layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab_size=VOCAB,
                                     max_seq_len=POSITIONS)
    return trace_module(meta_model, torch.zeros(1, 32, dtype=torch.long, device="meta"), 32, "fp32")[1]


def hf_generate(hf, prompts: torch.Tensor, new: int) -> list[list[int]]:
    out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, pad_token_id=0)
    return out[:, prompts.shape[1]:].tolist()


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def compare(sides: dict, reps: int) -> tuple[dict[str, list[float]], dict[str, object]]:
    """Seconds of each side's runs over `reps` rounds after one warm-up, the order rotating per round; and each
    side's output."""
    outputs = {name: fn() for name, fn in sides.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(reps):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            seconds, outputs[name] = timed(sides[name])
            times[name].append(seconds)
    return times, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per side and batch")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument("--new", type=int, default=32, help="generated tokens per sequence")
    args = parser.parse_args()

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count() or 1)
    hf, model = build_pair()
    summary = summary_of_gpt2()
    check = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model_vs_hf = (model(check) - hf(check).logits).abs().max().item()
    max_batch, max_seq_len = max(BATCHES), args.prompt + args.new
    build_s, engine = timed(lambda: InferenceEngine.from_model(model, summary, max_batch=max_batch,
                                                               max_seq_len=max_seq_len))
    engine_vs_hf = (engine.forward_logits(check) - hf(check).logits).abs().max().item()
    int8 = InferenceEngine.from_model(model, summary, max_batch=max_batch, max_seq_len=max_seq_len,
                                      weight_precision="int8", group_size=128)

    load_before = os.getloadavg()
    result: dict = {"threads": torch.get_num_threads(), "prompt_tokens": args.prompt, "new_tokens": args.new,
                    "max_logit_diff_model_vs_hf": model_vs_hf, "max_logit_diff_engine_vs_hf": engine_vs_hf,
                    "engine_build_s": round(build_s, 2)}
    for batch in BATCHES:
        prompts = torch.randint(0, VOCAB, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        as_lists = prompts.tolist()
        times, outputs = compare({
            "hf": lambda p=prompts: hf_generate(hf, p, args.new),
            "zplan": lambda p=as_lists: engine.generate(p, args.new),
            "zplan_int8": lambda p=as_lists: int8.generate(p, args.new),
        }, args.reps)
        agree, agree_int8 = (sum(a == b for ra, rb in zip(outputs[side], outputs["hf"], strict=True)
                                 for a, b in zip(ra, rb, strict=True)) for side in ("zplan", "zplan_int8"))
        for side, runs in times.items():
            result[f"{side}_tokens_per_s_b{batch}"] = round(batch * args.new / statistics.median(runs), 2)
            result[f"{side}_ms_per_token_b{batch}"] = round(statistics.median(runs) / args.new * 1e3, 2)
            result[f"{side}_best_ms_per_token_b{batch}"] = round(min(runs) / args.new * 1e3, 2)
        result[f"greedy_tokens_agree_b{batch}"] = outputs["zplan"] == outputs["hf"]
        result[f"greedy_agreement_fraction_b{batch}"] = round(agree / (batch * args.new), 4)
        result[f"int8_greedy_agreement_fraction_b{batch}"] = round(agree_int8 / (batch * args.new), 4)
    load_after = os.getloadavg()
    result["throughput_ratio_b8"] = round(result["zplan_tokens_per_s_b8"] / result["hf_tokens_per_s_b8"], 3)
    result["latency_ratio_b1"] = round(result["zplan_ms_per_token_b1"] / result["hf_ms_per_token_b1"], 3)
    result["throughput_ratio_b8_best"] = round(result["hf_best_ms_per_token_b8"]
                                               / result["zplan_best_ms_per_token_b8"], 3)
    result["latency_ratio_b1_best"] = round(result["zplan_best_ms_per_token_b1"] / result["hf_best_ms_per_token_b1"], 3)
    result["int8_throughput_ratio_b8"] = round(result["zplan_int8_tokens_per_s_b8"] / result["hf_tokens_per_s_b8"], 3)
    result["weight_bytes_fp32"] = engine.weight_bytes()
    result["weight_bytes_int8"] = int8.weight_bytes()
    result["int8_bytes_ratio"] = round(int8.weight_bytes() / engine.weight_bytes(), 4)
    result["loadavg_before"] = [round(x, 2) for x in load_before]
    result["loadavg_after"] = [round(x, 2) for x in load_after]
    if not args.json:
        print(f"GPT-2 124M (random weights), prompt {args.prompt}, {args.new} new tokens, greedy, "
              f"{result['threads']} threads, load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
        print(f"  logits: max |zplan model - HF| {model_vs_hf:.2e}, max |engine - HF| {engine_vs_hf:.2e}")
        for batch in BATCHES:
            for side in ("hf", "zplan", "zplan_int8"):
                print(f"  batch {batch} {side:<10} {result[f'{side}_tokens_per_s_b{batch}']:>8.1f} tokens/s "
                      f"{result[f'{side}_ms_per_token_b{batch}']:>8.1f} ms/token")
            print(f"  batch {batch} greedy tokens equal to HF's: {result[f'greedy_tokens_agree_b{batch}']} "
                  f"(fraction {result[f'greedy_agreement_fraction_b{batch}']}; int8 "
                  f"{result[f'int8_greedy_agreement_fraction_b{batch}']})")
        print(f"  throughput_ratio_b8 (target >= 1.5) {result['throughput_ratio_b8']:.2f}")
        print(f"  latency_ratio_b1 (target <= 0.8)    {result['latency_ratio_b1']:.2f}")
        print(f"  (best runs instead of medians: throughput {result['throughput_ratio_b8_best']:.2f}, latency "
              f"{result['latency_ratio_b1_best']:.2f})")
        print(f"  int8_bytes_ratio (target <= 0.3)    {result['int8_bytes_ratio']:.3f} "
              f"({result['weight_bytes_int8'] / 1e6:.0f} MB / {result['weight_bytes_fp32'] / 1e6:.0f} MB)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
