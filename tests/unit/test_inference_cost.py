"""The serving cost model (planner.inference.cost) against hand computations on round numbers.

No published inference measurement exists in the project's reference data (it holds training runs only), so
every check here is a hand computation on a made-up model and cluster with round numbers.
"""

import numpy as np
import pytest

from zplan.planner.clusters import DGX_H100
from zplan.planner.family import family_summary
from zplan.planner.inference.cost import (
    BLOCK_FORWARD_OPS,
    EDGE_FORWARD_OPS,
    WEIGHT_PRECISIONS,
    WEIGHT_TIERS,
    InferenceCandidates,
    InferenceModel,
    Workload,
    estimate,
    kv_cache_bytes,
    quant_group_size,
    weight_bytes_per_param,
)
from zplan.schemas.cluster import EfficiencySpec

# A round model: L = 10 blocks, h = 1000, 10 heads of d = 100, W = 12 h^2 = 12e6 Linear weights per block.
MODEL = InferenceModel(layers=10, hidden=1000, heads=10, kv_heads=10, ffn=4000, vocab=1000,
                       block_linear_params=12e6, replicated_params=2e6, decode_read_params=1e6, position_rows=None)
# A round cluster: 1 PFLOP/s bf16 at half efficiency for any GEMM, 1 TB/s HBM at half, 100 GB/s NVLink with
# 10 us per ring step, 10 GB/s PCIe at half, 2 GB/s of NVMe per node, 1 GB reserve, 100 GB HBM.
CLUSTER = DGX_H100.model_copy(update={
    "gpu": DGX_H100.gpu.model_copy(update={"hbm_bytes": 100 * 10**9, "hbm_bandwidth_Bps": 1e12,
                                           "peak_bf16_flops": 1e15}),
    "intra_node_bandwidth_Bps": 1e11, "intra_node_latency_s": 1e-5, "host_to_device_bandwidth_Bps": 1e10,
    "nvme_bandwidth_Bps": 2e9, "framework_reserve_bytes": 10**9,
    "efficiency": EfficiencySpec(gemm_max=0.5, gemm_half_flops=1e-9, memory_bound=0.5, intra_node_link=1.0,
                                 inter_node_link=1.0, host_link=0.5),
})
FLOPS = 1e15 * 0.5  # achieved FLOP/s (eff = 0.5 * x / (x + 1e-9) = 0.5 for every GEMM here)
HBM = 1e12 * 0.5  # achieved bytes/s
BF16 = 2.0


def one(tp=1, precision="bf16", tier="gpu", batch=1):
    return InferenceCandidates(tp=np.array([tp]), precision=np.array([WEIGHT_PRECISIONS.index(precision)]),
                               tier=np.array([WEIGHT_TIERS.index(tier)]), batch=np.array([batch]))


def run(prompt=100, gen=20, gpus=1, **kw):
    return estimate(MODEL, one(**kw), CLUSTER, Workload(prompt_len=prompt, gen_len=gen, compute_dtype="bf16",
                                                        gpus=gpus))


def test_weight_bytes_per_param():
    idx = np.arange(len(WEIGHT_PRECISIONS))  # fp32, bf16, fp16, int8, int4 (one fp32 scale per group), fp8 (scales
    # per output channel: none given here)
    assert weight_bytes_per_param(idx, 128).tolist() == pytest.approx([4, 2, 2, 1 + 4 / 128, 0.5 + 4 / 128, 1])
    assert weight_bytes_per_param(idx, 64)[3] == pytest.approx(1 + 4 / 64)


def test_quant_group_size_divides_every_input_width_per_gpu():
    # h = 1000 = 8 * 125 -> 8; at tp = 2 o's input is 500 = 4 * 125 -> 4
    assert quant_group_size(MODEL, np.array([1, 2])).tolist() == [8, 4]
    gpt = InferenceModel.from_summary(family_summary("gpt:layers=2,hidden=768,heads=12,seq=64,vocab=1000"))
    # h = 768 -> 128; o's input 768 / tp; down's input 3072 / tp: tp = 4 -> 192 -> 64, tp = 8 -> 96 -> 32
    assert quant_group_size(gpt, np.array([1, 2, 4, 8])).tolist() == [128, 128, 64, 32]


def test_kv_cache_bytes_rounds_kv_heads_up_per_gpu():
    # 2 (K, V) * 10 layers * 3 sequences * 50 tokens * ceil(10 / 4) = 3 heads * 100 dims * 2 bytes
    assert kv_cache_bytes(MODEL, np.array([4]), np.array([3]), 50, "bf16")[0] == 2 * 10 * 3 * 50 * 3 * 100 * 2
    assert kv_cache_bytes(MODEL, np.array([1]), np.array([1]), 1, "fp32")[0] == 2 * 10 * 10 * 100 * 4


def test_memory_per_gpu_splits_block_weights_and_replicates_the_rest():
    est = run(tp=2, batch=3, prompt=100, gen=20)
    assert est.weights[0] == pytest.approx(10 * 12e6 / 2 * BF16 + 2e6 * BF16)
    assert est.kv_cache[0] == pytest.approx(2 * 10 * 3 * 120 * 5 * 100 * BF16)
    assert est.total[0] == pytest.approx(est.weights[0] + est.kv_cache[0] + est.activations[0] + 1e9)
    int4 = run(precision="int4")
    int4_bytes = 0.5 + 4 / 8  # group 8 (h = 1000), fp32 scales; the head's V x h = 1e6 weights quantized too
    assert int4.weights[0] == pytest.approx(10 * 12e6 * int4_bytes + 1e6 * BF16 + 1e6 * int4_bytes)
    streamed = run(tier="cpu")  # the computing layer and one prefetched: 2 of 10 blocks
    assert streamed.weights[0] == pytest.approx(2 * 12e6 * BF16 + 2e6 * BF16)
    assert streamed.cpu_bytes_per_node[0] == pytest.approx(10 * 12e6 * BF16) and streamed.nvme_bytes_per_node[0] == 0


def test_short_prefill_is_bound_by_reading_the_weights():
    est = run(batch=2, prompt=100)
    read_s = (10 * 12e6 * BF16 + 1e6 * BF16) / HBM  # 4.84e-4 s
    flops = 2 * 12e6 * 10 * 2 * 100 + 2 * 10 * 2 * 100**2 * 1000 + 2 * 1000 * 1000 * 2  # 4.84e10 FLOPs
    assert flops / FLOPS < read_s
    assert est.prefill_compute_s[0] == pytest.approx(read_s)


def test_long_prefill_is_compute_bound():
    est = run(batch=2, prompt=1000, gen=10)
    # Linear 2*W*L*B*P + causal attention 2*L*B*P^2*h + last-position logits 2*h*V*B
    flops = 2 * 12e6 * 10 * 2 * 1000 + 2 * 10 * 2 * 1000**2 * 1000 + 2 * 1000 * 1000 * 2
    assert est.prefill_compute_s[0] == pytest.approx(flops / FLOPS)
    assert est.ttft_s[0] == pytest.approx(flops / FLOPS)  # tp = 1: no all-reduce; resident: no streaming


def test_small_batch_decode_reads_weights_and_kv_cache():
    est = run(batch=1, prompt=100, gen=20)
    context = 100 + 20 / 2
    assert est.decode_weights_s[0] == pytest.approx((10 * 12e6 * BF16 + 1e6 * BF16) / HBM)
    assert est.decode_kv_s[0] == pytest.approx(2 * 10 * 1 * context * 10 * 100 * BF16 / HBM)
    assert est.decode_compute_s[0] == 0
    assert est.tpot_s[0] == pytest.approx(est.decode_weights_s[0] + est.decode_kv_s[0])


def test_large_batch_decode_is_compute_bound():
    est = run(batch=4096, prompt=1, gen=2)
    context = 1 + 2 / 2
    flops = 2 * 12e6 * 10 * 4096 + 4 * 10 * 4096 * context * 1000 + 2 * 1000 * 1000 * 4096
    memory_s = (10 * 12e6 * BF16 + 1e6 * BF16) / HBM + 2 * 10 * 4096 * context * 10 * 100 * BF16 / HBM
    assert flops / FLOPS > memory_s
    assert (est.decode_weights_s[0], est.decode_kv_s[0]) == (0, 0)
    assert est.decode_compute_s[0] == pytest.approx(flops / FLOPS)


def test_tensor_parallel_all_reduces_two_per_block():
    est = run(tp=2, gpus=2, batch=1, prompt=100)
    # ring all-reduce over 2: 2 * ((n-1)/n * S / B + (n-1) * latency), S = B*h*2 bytes (decode), B*P*h*2 (prefill)
    decode = 2 * (0.5 * 1 * 1000 * BF16 / 1e11 + 1e-5)
    prefill = 2 * (0.5 * 100 * 1000 * BF16 / 1e11 + 1e-5)
    assert est.decode_tp_s[0] == pytest.approx(2 * 10 * decode)
    assert est.prefill_tp_s[0] == pytest.approx(2 * 10 * prefill)


@pytest.mark.parametrize("tier,link_Bps", [("cpu", 1e10 * 0.5), ("nvme", 2e9)])
def test_streamed_weights_wait_for_the_slower_link(tier, link_Bps):
    est = run(tier=tier, batch=1, prompt=100, gen=20)
    layer_s = 12e6 * BF16 / link_Bps  # one block's weights over PCIe (cpu) or from the node's disks (nvme)
    resident = run(batch=1, prompt=100, gen=20)
    assert est.decode_stream_s[0] == pytest.approx(10 * (layer_s - resident.tpot_s[0] / 10))
    assert est.tpot_s[0] == pytest.approx(10 * layer_s)  # a step takes max(transfer, compute) per layer
    assert est.ttft_s[0] == pytest.approx(10 * layer_s)


def test_a_device_without_overlap_waits_for_every_copy_and_dispatches_ops_in_series():
    # CPU-like profile: copies on the computing core (no overlap), 10 us of host time per dispatched op
    cpu_like = CLUSTER.model_copy(update={"overlaps_comm_with_compute": False, "host_overheads":
                                          CLUSTER.host_overheads.model_copy(update={"op_s": 1e-5,
                                                                                    "runs_ahead": False})})
    work = Workload(prompt_len=100, gen_len=20, compute_dtype="bf16", gpus=1)
    est = estimate(MODEL, one(tier="cpu"), cpu_like, work)
    layer_s = 12e6 * BF16 / (1e10 * 0.5)  # one block's weights over PCIe at half its 10 GB/s
    assert est.decode_stream_s[0] == pytest.approx(10 * layer_s)
    assert est.prefill_stream_s[0] == pytest.approx(10 * layer_s)
    host_s = (BLOCK_FORWARD_OPS * 10 + EDGE_FORWARD_OPS) * 1e-5  # ops of one forward pass
    assert est.decode_compute_s[0] == pytest.approx(host_s)  # memory bound: bytes, then the host time beside none
    assert est.decode_weights_s[0] == pytest.approx((10 * 12e6 * BF16 + 1e6 * BF16) / HBM)


def test_tokens_per_s_counts_replicas():
    est = run(tp=2, gpus=4, batch=8, prompt=100, gen=20)
    latency = est.ttft_s[0] + 19 * est.tpot_s[0]
    assert est.request_latency_s[0] == pytest.approx(latency)
    assert est.tokens_per_s[0] == pytest.approx(2 * 8 * 20 / latency)


def test_memory_that_does_not_fit_is_refused():
    assert run(batch=1).fits[0]
    assert not run(batch=100_000, prompt=100, gen=20).fits[0]  # KV cache 4.8e11 bytes > 100 GB


def test_model_numbers_from_family_summaries():
    gpt = InferenceModel.from_summary(family_summary("gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000"))
    h = 256
    assert gpt.block_linear_params == pytest.approx(12 * h * h)  # q, k, v, o 4h^2 + MLP 8h^2
    assert gpt.position_rows == 128
    # replicated: everything but the Linear weights; read per decode step: norms, biases, the tied head V*h
    assert gpt.replicated_params == pytest.approx(1000 * h + 128 * h + 4 * 13 * h + 2 * h)
    assert gpt.decode_read_params == pytest.approx(4 * 13 * h + 2 * h + 1000 * h)
    llama = InferenceModel.from_summary(family_summary("llama:layers=2,hidden=512,heads=8,kv_heads=2,ffn=1024,"
                                                       "seq=64,vocab=1000"))
    h, h_kv, f = 512, 128, 1024
    assert llama.block_linear_params == pytest.approx(2 * h * h + 2 * h * h_kv + 3 * h * f)
    assert llama.position_rows is None  # rotary
    assert llama.decode_read_params == pytest.approx(2 * 2 * h + h + 1000 * h)  # untied head, not the embedding


# ---- continuous batching over the paged KV cache (planner/inference/throughput.py, `continuous`) ----------------

def test_the_planner_prices_the_runtimes_block_and_step_sizes():
    """What is priced is what runs: 16-token KV blocks and at most 512 tokens a step, the runtime's own numbers."""
    from zplan.planner.inference import throughput
    from zplan.runtime.inference import paged_cache, scheduler

    assert throughput.KV_BLOCK_TOKENS == paged_cache.BLOCK_TOKENS == 16
    assert throughput.STEP_TOKENS == scheduler.DEFAULT_STEP_TOKENS


def test_kv_blocks_by_hand():
    from zplan.planner.inference.throughput import (
        blocks_per_request,
        concurrencies,
        continuous_batching,
        kv_block_bytes,
        kv_budget_bytes,
        numerics_for,
        weight_bytes_per_gpu,
    )

    num = numerics_for("bf16", "bf16", MODEL, 1, CLUSTER)
    # a block: 2 (K, V) * 10 layers * 10 KV heads * 16 tokens * 100 head dim * 2 bytes
    assert kv_block_bytes(MODEL, 1, num) == 2 * 10 * 10 * 16 * 100 * 2 == 640_000
    assert kv_block_bytes(MODEL, 2, num) == 320_000  # 5 KV heads a GPU at tp=2
    # weights 10 blocks * 12e6 + 2e6 replicated, bf16: 2.44e8 bytes; budget 95 % of 100e9 - 2.44e8 - 1e9
    weights = weight_bytes_per_gpu(MODEL, 1, num)
    assert weights == pytest.approx(2.44e8)
    budget = kv_budget_bytes(CLUSTER.gpu.hbm_bytes, weights, CLUSTER.framework_reserve_bytes)
    assert budget == pytest.approx(0.95 * (100e9 - 2.44e8 - 1e9))
    assert blocks_per_request(100, 10) == 7  # ceil(110 / 16)
    assert concurrencies(20) == [1, 2, 4, 8, 16, 20] and concurrencies(16) == [1, 2, 4, 8, 16]
    assert concurrencies(0) == []
    curve = continuous_batching(MODEL, CLUSTER, 1, num, 100, 10, budget, max_running=10**6, max_seq_len=110)
    assert curve.kv_blocks == int(0.95 * (100e9 - 2.44e8 - 1e9) // 640_000) == 146_590
    assert curve.max_concurrency == 146_590 // 7 == 20_941
    assert [p.concurrency for p in curve.points] == concurrencies(20_941)
    # at most 8 sequences run: the cache takes the 8 * ceil(128 / 16) = 64 blocks they can fill
    small = continuous_batching(MODEL, CLUSTER, 1, num, 100, 10, budget, max_running=8, max_seq_len=128)
    assert (small.kv_blocks, small.max_concurrency) == (64, 8)


def test_one_concurrency_point_by_hand():
    """N = 4 requests of I = 100, O = 10 on the round model and cluster, tp = 1, bf16, one step by hand."""
    from zplan.planner.inference.throughput import continuous_batching_point, numerics_for

    point = continuous_batching_point(MODEL, CLUSTER, 1, numerics_for("bf16", "bf16", MODEL, 1, CLUSTER), 100, 10, 4)
    # k = max(1, ceil(100 / 512), ceil(4 * 109 / 512 - 9)) = 1: a request lives k + O - 1 = 10 steps
    assert point.prefill_steps == 1
    life, c = 10, 100 + 10 / 2  # mean decode context I + O / 2
    decodes, prompts = 4 * 9 / life, 4 / life  # D = 3.6 tokens, n_p = 0.4 prompts of 100
    tokens = decodes + prompts * 100
    flops = (2 * 12e6 * 10 * tokens  # block GEMMs
             + 2 * 10 * prompts * 100**2 * 1000 + 4 * 10 * decodes * c * 1000  # causal prompt + decode attention
             + 2 * 1000 * 1000 * (decodes + prompts))  # logits
    kv_per_token = 2 * 10 * 10 * 100 * BF16  # 40,000 bytes
    weights_read = 10 * 12e6 * BF16 + 1e6 * BF16  # block Linears, and the replicated params a step reads
    read = weights_read + kv_per_token * decodes * c
    assert flops / FLOPS < read / HBM  # memory bound: the step reads
    step = read / HBM  # tp = 1: no all-reduce; the GPU profile dispatches ops ahead of the device
    assert step == pytest.approx(5.1424e-4)
    assert point.step_s == pytest.approx(step)
    assert point.tokens_per_s == pytest.approx(4 * 10 / (life * step))  # N O / ((k + O - 1) step) = N / step here
    # TTFT: the one step reading this prompt whole, beside the other 3 requests' decodes and prompts
    reading = (weights_read + kv_per_token * (3 * 9 / life) * c) / HBM
    assert point.ttft_s == pytest.approx(reading)


def test_a_lone_request_is_a_prefill_then_decode_steps():
    """At N = 1 the first token is a lone prefill (throughput.ttft_s); the curve keeps growing with N until the step
    budget (512 tokens) stretches each prompt over more steps, where tokens/s saturate and TTFT grows."""
    from zplan.planner.inference.throughput import STEP_TOKENS, continuous_batching_point, numerics_for, ttft_s

    num = numerics_for("bf16", "bf16", MODEL, 1, CLUSTER)
    lone = continuous_batching_point(MODEL, CLUSTER, 1, num, 100, 10, 1)
    assert lone.ttft_s == pytest.approx(ttft_s(MODEL, CLUSTER, 1, num, 100))
    points = [continuous_batching_point(MODEL, CLUSTER, 1, num, 100, 10, n) for n in (1, 2, 4, 8, 16, 32, 64, 256)]
    assert all(a.tokens_per_s <= b.tokens_per_s * (1 + 1e-9) for a, b in zip(points, points[1:], strict=False))
    assert all(a.step_s <= b.step_s for a, b in zip(points, points[1:], strict=False))
    crowded = points[-1]  # 256 * 109 tokens per life: k = ceil(256 * 109 / 512 - 9) = 46 steps per prompt
    assert crowded.prefill_steps == 46 and crowded.ttft_s > 40 * crowded.step_s
    # saturated: at most STEP_TOKENS tokens a step, of which O of every I + O - 1 give an output token
    assert crowded.tokens_per_s <= STEP_TOKENS * 10 / 109 / crowded.step_s * (1 + 1e-9)
    long_prompt = continuous_batching_point(MODEL, CLUSTER, 1, num, 2000, 10, 1)
    assert long_prompt.prefill_steps == 4  # ceil(2000 / 512): a long prompt is read in chunks
