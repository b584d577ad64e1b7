"""The inference engine under tensor parallelism (tp=2, gloo, one launch of 2 processes) against the same engine
in one process (tp=1) and the model itself: greedy tokens identical, logits within float rounding, for a
gpt-style model and a llama-style one with grouped-query attention (4 query heads, 2 key/value heads: one per
rank), fp32 and int8; sampled tokens identical on both ranks.

This file is also the worker script: `python test_inference_tp.py worker` on each rank.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.distributed.harness import Ranks

VOCAB = 300
MODELS = {  # name: (example module name, build_model keywords)
    "gpt": ("gpt", dict(num_layers=2, hidden=64, heads=4, vocab_size=VOCAB, max_seq_len=64)),
    "llama": ("llama", dict(num_layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab_size=VOCAB,
                            rope_theta=10000.0)),
}
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [42]]
NEW_TOKENS = 8


def _worker() -> None:
    """Per model and precision: the tp=2 engine's greedy tokens, sampled tokens and logits against a tp=1 engine
    built in this process from the same model. Every rank prints one JSON line per case."""
    import importlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from zplan.model_input import trace_module
    from zplan.runtime.inference.engine import InferenceEngine
    from zplan.runtime.inference.sampling import SamplingParams

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))  # (B, T)
    hot = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in range(len(PROMPTS))]
    for name, (example, kwargs) in MODELS.items():
        build = importlib.import_module(f"zplan.examples.{example}").build_model
        with torch.device("meta"):
            summary = trace_module(build(**kwargs), torch.zeros(1, 8, dtype=torch.long, device="meta"), 8,
                                   "fp32")[1]
        torch.manual_seed(0)
        model = build(**kwargs).eval()
        for precision in ("fp32", "int8"):
            common = dict(max_seq_len=64, weight_precision=precision, group_size=16)
            single = InferenceEngine.from_model(model, summary, **common)
            split = InferenceEngine.from_model(model, summary, tp_mesh=mesh, **common)
            record = {
                "model": name, "precision": precision, "rank": dist.get_rank(), "tp": split.tp,
                "kv_cache_heads": split.cache.k.shape[2],
                "qkv_rows": split.store.layer(0)["qkv.weight" if precision == "fp32" else "qkv.qweight"].shape[0],
                "greedy_tp1": single.generate(PROMPTS, NEW_TOKENS),
                "greedy_tp2": split.generate(PROMPTS, NEW_TOKENS),
                "sampled_tp2": split.generate(PROMPTS, NEW_TOKENS, hot),
                "max_logit_diff": (split.forward_logits(tokens) - single.forward_logits(tokens)).abs().max().item(),
            }
            if precision == "fp32":
                with torch.no_grad():
                    reference = model(tokens)
                record["max_logit_diff_vs_model"] = (split.forward_logits(tokens) - reference).abs().max().item()
                record["continuous_tp2"] = _continuous_batching(split)
            print("RESULT " + json.dumps(record), flush=True)
    dist.destroy_process_group()


def _continuous_batching(engine) -> list[list[int]] | None:
    """The serving path under tp: rank 0 schedules and broadcasts each step, rank 1 follows (its tokens: None)."""
    import torch.distributed as dist

    from tests.unit.test_continuous_batching import run
    from zplan.runtime.inference.batching import Broadcaster, follow_steps
    from zplan.runtime.inference.sampling import SamplingParams
    from zplan.runtime.inference.scheduler import Scheduler, Sequence

    blocks = 4  # the fewest that hold one sequence of max_seq_len 64; prompts read 4 tokens a step
    if dist.get_rank() != 0:
        assert follow_steps(engine, blocks) == 0
        return None
    broadcaster = Broadcaster()
    scheduler = Scheduler(engine, blocks, max_running=3, max_step_tokens=4,
                          runner=lambda batch, params: broadcaster.send({"kind": "step", "batch": batch,
                                                                         "params": params}))
    tokens = run(scheduler, [Sequence(p, NEW_TOKENS, SamplingParams()) for p in PROMPTS])
    broadcaster.send({"kind": "shutdown"})
    return tokens


@pytest.mark.slow
def test_tensor_parallel_engine_matches_one_process(tmp_path):
    output = Ranks([__file__, "worker"], 2, tmp_path).wait_ok()
    records = [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(records) == 2 * 2 * len(MODELS), output[-4000:]
    by_case: dict[tuple, dict[int, dict]] = {}
    for r in records:
        by_case.setdefault((r["model"], r["precision"]), {})[r["rank"]] = r
    for (name, precision), ranks in by_case.items():
        kwargs = MODELS[name][1]
        heads, kv_heads = kwargs["heads"], kwargs.get("kv_heads", kwargs["heads"])
        head_dim = kwargs["hidden"] // heads
        for r in ranks.values():
            print(f"{name} {precision} rank {r['rank']}: greedy tp2 == tp1: {r['greedy_tp2'] == r['greedy_tp1']}, "
                  f"max |logits tp2 - tp1| {r['max_logit_diff']:.2e}"
                  + (f", vs model {r['max_logit_diff_vs_model']:.2e}" if "max_logit_diff_vs_model" in r else ""))
            assert r["tp"] == 2
            assert r["kv_cache_heads"] == kv_heads // 2  # each rank caches its own key/value heads
            assert r["qkv_rows"] == (heads + 2 * kv_heads) * head_dim // 2  # and holds their weights only
            assert r["greedy_tp2"] == r["greedy_tp1"]
            assert r["max_logit_diff"] <= 1e-5
            if precision == "fp32":
                assert r["max_logit_diff_vs_model"] <= 1e-5
                if r["rank"] == 0:  # the serving path: continuous batching, rank 1 following rank 0's steps
                    assert r["continuous_tp2"] == r["greedy_tp1"]
        assert ranks[0]["sampled_tp2"] == ranks[1]["sampled_tp2"]  # rank 0 samples, both continue alike
        assert ranks[0]["greedy_tp2"] == ranks[1]["greedy_tp2"]


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
