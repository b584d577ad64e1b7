"""benchmarks/serving_runs.py, planner/inference/throughput.py and benchmarks/validate_serving.py: a serving row by
hand becomes the request it prints, the batching formulas against a hand computation on a tiny model, and the
leave-one-source-out error of the whole validation."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from serving_runs import TRTLLM_FP8_KV, serving_run  # noqa: E402

from zplan.planner.clusters import load_cluster  # noqa: E402
from zplan.planner.family import parse_family_spec  # noqa: E402
from zplan.planner.inference.cost import InferenceModel  # noqa: E402
from zplan.planner.inference.throughput import (  # noqa: E402
    EngineEfficiency,
    Numerics,
    max_load,
    max_load_concurrency,
    max_load_waves,
    static_batch,
    ttft_s,
)

CURRENT = "TensorRT-LLM perf-overview (current)"
OLD = "TensorRT-LLM perf-overview (v0.9.0)"
ROW = dict(source=CURRENT, citation="", model="Llama 3.1 8B Instruct", params_b="8.03", gpu_type="H100 SXM 80GB",
           gpus="1", tp="1", precision="FP8 (nvidia/Llama-3.1-8B-Instruct-FP8)",
           batch_or_concurrency="max load (infinite request rate; CUDA-graph batch up to 8192)", input_len="1000",
           output_len="1000", ttft_ms="", tpot_ms="", tokens_per_s_total="15220", tokens_per_s_per_gpu="15220.0",
           engine="TensorRT-LLM (PyTorch backend)",
           notes="printed metric = Total Output Throughput (tokens/sec); 3000 requests, fixed ISL/OSL (stdev 0)")


def test_a_max_load_row_becomes_the_request_it_prints():
    run = serving_run(ROW, "row")
    assert (run.cluster, run.tp, run.precision, run.condition, run.batch, run.requests) == (
        "dgx-h100", 1, "fp8", "max load", 8192, 3000)
    assert (run.input_len, run.output_len, run.metric, run.measured) == (1000, 1000, "tokens_per_s", 15220.0)
    assert run.engine == "trtllm-1.0"
    spec = parse_family_spec(run.spec)  # Llama 3.1 8B (Dubey et al. 2024, Table 3)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab) == (
        32, 4096, 32, 8, 14336, 128256)
    num = run.numerics()  # zplan's fp8 W8A8, with TensorRT-LLM's fp8 KV cache and attention as that engine's condition
    h100 = load_cluster("dgx-h100")
    assert num.name.startswith("zplan fp8") and num.name.endswith(TRTLLM_FP8_KV)
    # 1 byte a weight + one fp32 scale per output row: W = 4096 * (4096 + 2 * 1024) (q, k, v) + 4096^2 (o) +
    # 3 * 4096 * 14336 (gate, up, down); rows 6144 (q, k, v) + 4096 (o) + 2 * 14336 (gate, up) + 4096 (down)
    weights = 4096 * 6144 + 4096**2 + 3 * 4096 * 14336
    assert num.block_weight_bytes == pytest.approx(1.0 + 4.0 * (6144 + 4096 + 2 * 14336 + 4096) / weights)
    assert (num.head_weight_bytes, num.kv_bytes, num.activation_bytes) == (2.0, 1.0, 2.0)
    assert (num.gemm_peak_flops, num.other_peak_flops) == (h100.gpu.peak_fp8_flops, h100.gpu.peak_bf16_flops)
    assert num.attention_peak_flops == h100.gpu.peak_fp8_flops  # the fp8 attention kernels on the fp8 KV cache


def test_static_and_first_token_rows_of_v090():
    old = {**ROW, "source": OLD, "model": "Llama 2 70B (listed as 'LLaMA 70B')", "gpu_type": "A100 (memory not stated)",
           "gpus": "4", "tp": "4", "precision": "FP16", "batch_or_concurrency": "96", "input_len": "2048",
           "output_len": "128", "tokens_per_s_total": "320", "notes": "batch = static batch size"}
    run = serving_run(old, "row")
    assert (run.cluster, run.tp, run.precision, run.condition, run.batch, run.measured) == (
        "dgx-a100-80g", 4, "fp16", "static", 96, 320.0)
    assert run.numerics().name.startswith("zplan fp16")  # what zplan's own engine runs
    assert parse_family_spec(run.spec).kv_heads == 8
    ttft = serving_run({**old, "batch_or_concurrency": "1", "output_len": "1", "ttft_ms": "249.2",
                        "tokens_per_s_total": "", "tokens_per_s_per_gpu": ""}, "row")
    assert (ttft.condition, ttft.metric, ttft.measured) == ("ttft", "ttft_s", pytest.approx(0.2492))


@pytest.mark.parametrize("update, reason", [
    (dict(gpu_type="MI300X"), "no built-in profile"),
    (dict(gpu_type="A100 80GB"), "no fp8 peak"),
    (dict(model="Mistral 7B"), "no published shape"),
    (dict(precision="INT4 AWQ"), "precision"),
    (dict(gpus="2"), "replicas"),
    (dict(notes="no count"), "number of requests"),
])
def test_rows_zplan_cannot_express_say_why(update, reason):
    assert reason in serving_run({**ROW, **update}, "row")


# A tiny model and a round profile for hand computation: 1 block of W = 100 Linear weights, h = 4, one head of
# d = 4, f = 8, V = 10 (token table and head: 40 weights each, nothing else); 2 bytes a weight and a KV element;
# 1000 FLOP/s at efficiency 1 (gemm_half_flops tiny), 500 B/s, 1 GPU (no all-reduce).
TINY = InferenceModel(layers=1, hidden=4, heads=1, kv_heads=1, ffn=8, vocab=10, block_linear_params=100.0,
                      replicated_params=80.0, decode_read_params=40.0, position_rows=None)
NUM = Numerics(name="test", block_weight_bytes=2.0, head_weight_bytes=2.0, other_bytes=2.0, kv_bytes=2.0,
               activation_bytes=2.0, gemm_peak_flops=1000.0)
_BASE = load_cluster("dgx-a100-80g")
ROUND = _BASE.model_copy(update={
    "gpu": _BASE.gpu.model_copy(update={"hbm_bytes": 1000, "hbm_bandwidth_Bps": 500.0}),
    "efficiency": _BASE.efficiency.model_copy(update={"gemm_max": 1.0, "gemm_half_flops": 1e-12, "memory_bound": 1.0}),
    "framework_reserve_bytes": 0})


def test_static_batch_by_hand():
    """B = 2, I = 3, O = 3. Prefill: 2*100*6 + causal attention 2*2*3^2*4 + logits 2*4*10*2 = 1504 FLOPs = 1.504 s
    (weights 280 B = 0.56 s: compute bound). Decode at c: FLOPs 2*100*2 + 4*2*c*4 + 160 = 560 + 32c (0.56 + 0.032c
    s); bytes 280 + KV 2*1*4*2 B * 2 seqs * c = 280 + 32c (0.56 + 0.064c s): memory bound; c = 4, 5: 0.816 + 0.88.
    tokens/s = 2 * 3 / (1.504 + 1.696)."""
    result = static_batch(TINY, ROUND, 1, NUM, batch=2, input_len=3, output_len=3)
    assert result.prefill_s == pytest.approx(1.504)
    assert result.decode_s == pytest.approx(0.816 + 0.88)
    assert result.tokens_per_s == pytest.approx(6 / 3.2)
    assert ttft_s(TINY, ROUND, 1, NUM, 3) == pytest.approx((2 * 100 * 3 + 2 * 9 * 4 + 80) / 1000)
    # an engine at half the memory efficiency: the decode steps' bytes take twice as long, the prefill stays
    slow = static_batch(TINY, ROUND, 1, NUM, 2, 3, 3, eff=EngineEfficiency(compute=1.0, memory=0.5))
    assert slow.decode_s == pytest.approx(2 * (0.816 + 0.88)) and slow.prefill_s == pytest.approx(1.504)
    # a fixed 0.1 s a forward pass: the prefill pays it once, the two decode steps twice
    late = static_batch(TINY, ROUND, 1, NUM, 2, 3, 3, eff=EngineEfficiency(pass_overhead_s=0.1))
    assert (late.prefill_s, late.decode_s) == (pytest.approx(1.604), pytest.approx(0.816 + 0.88 + 0.2))
    # attention alone at twice the peak (an engine's fp8 attention): its 144 prefill FLOPs take half as long
    fast_attention = replace(NUM, attention_peak_flops=2000.0)
    assert static_batch(TINY, ROUND, 1, fast_attention, 2, 3, 3).prefill_s == pytest.approx(1.504 - 0.072)


def test_max_load_waves_by_hand():
    """KV cache: (1000 B - 360 B of weights) / 16 B a token = 40 tokens = 6 requests of 3 + 3 (kv_fraction 1); the
    engine's max batch 4 caps it. R = 10 requests run as waves 4, 4, 2. static(4): prefill 2*100*12 + 2*4*9*4 +
    2*4*10*4 = 3008 FLOPs = 3.008 s; decode at c: FLOPs 1120 + 64c, bytes 280 + 64c (0.56 + 0.128c s): compute
    bound, 1.376 + 1.44. static(2) = 3.2 s (test above). tokens/s = 10 * 3 / (2 * 5.824 + 3.2)."""
    conc = max_load_concurrency(TINY, ROUND, 1, NUM, 3, 3, max_batch=4, kv_fraction=1.0)
    assert (conc.requests, conc.limited_by, conc.kv_capacity_tokens) == (4, "max batch", pytest.approx(40.0))
    assert max_load_concurrency(TINY, ROUND, 1, NUM, 3, 3, max_batch=100, kv_fraction=1.0).requests == 6
    conc, tokens_per_s = max_load_waves(TINY, ROUND, 1, NUM, 3, 3, max_batch=4, requests=10, kv_fraction=1.0)
    assert tokens_per_s == pytest.approx(30 / (2 * (3.008 + 1.376 + 1.44) + 3.2))


def test_max_load_steady_state_by_hand():
    """Requests of varied lengths: each step decodes N = 4 at the mean context 4.5 and prefills the 4 / 3 arriving
    prompts of 3 tokens: FLOPs 2*100*8 + 2*(4/3)*9*4 + 4*4*4.5*4 + 2*4*10*(4 + 4/3) = 2410.67 (2.41 s) against
    bytes 280 + 16*4*4.5 = 568 (1.136 s): compute bound; tokens/s = 4 / 2.41067."""
    result = max_load(TINY, ROUND, 1, NUM, 3, 3, max_batch=4, kv_fraction=1.0)
    assert result.step_s == pytest.approx((1600 + 96 + 288 + 80 * 16 / 3) / 1000)
    assert result.tokens_per_s == pytest.approx(4 / result.step_s)


REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"


@pytest.mark.skipif(not (REFERENCE / "serving_runs.csv").is_file(), reason="../shared/reference is not beside")
def test_serving_runs_are_predicted_out_of_sample_within_the_bound():
    """The whole validation (under a second): every row is expressed, and leaving each source out of the fit of the
    three TensorRT-LLM constants the mean error stays under 13 % (10.8 % on 2026-12-02; 14.7 % without the per-pass
    overhead; the issue's target is 15 %), well under the raw profiles' (29.3 %)."""
    from validate_serving import validate

    result = validate(REFERENCE)
    assert result["coverage"] == 1.0 and result["all_rows"] == 87
    assert result["serving_loso_mean_abs_error"] < 0.13
    assert result["serving_loso_mean_abs_error"] < result["serving_raw_mean_abs_error"] - 0.1
    constants = result["engine_efficiencies"]
    assert 0.3 < constants["tensorrt-llm compute"] <= 1.2 and 0.3 < constants["tensorrt-llm memory"] <= 1.2
    assert 0.0 <= constants["tensorrt-llm pass overhead s"] < 0.02  # inside the grid, not at its 20 ms edge
