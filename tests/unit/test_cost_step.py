"""Time formulas against hand computations: ring collectives, pipeline bubble, MFU."""

import numpy as np
import pytest

from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.comm import all_reduce_s, group_shape, reduce_scatter_s
from zplan.planner.cost.compute import gemm_efficiency
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.step import estimate_step, stage_blocks_equivalent

A100 = BUILTIN_CLUSTERS["dgx-a100-80g"].without_host()  # the device's terms alone
NV = A100.intra_node_bandwidth_Bps * A100.efficiency.intra_node_link
IB = A100.inter_node_bandwidth_Bps * A100.efficiency.inter_node_link


def test_ring_all_reduce_inside_a_node():
    size = 1e9
    got = all_reduce_s(np.array([size]), np.array([8]), np.array([1]), A100)[0]
    assert got == pytest.approx(2 * 7 / 8 * size / NV + 2 * 7 * A100.intra_node_latency_s)


def test_hierarchical_all_reduce_across_nodes():
    # dp=4 with tp=8: one rank per node, 4 nodes, all traffic on one NIC per rank.
    size = 1e9
    got = all_reduce_s(np.array([size]), np.array([4]), np.array([8]), A100)[0]
    assert got == pytest.approx(2 * (3 / 4 * size / IB + 3 * A100.inter_node_latency_s))
    # dp=16 with tp=1: 8 ranks per node on NVLink, then 2 nodes, each NIC carrying 1/8 of the data.
    g, k = group_shape(np.array([16]), np.array([1]), 8)
    assert (g[0], k[0]) == (8, 2)
    got = reduce_scatter_s(np.array([size]), np.array([16]), np.array([1]), A100)[0]
    expected = 7 / 8 * size / NV + 7 * A100.intra_node_latency_s + 1 / 2 * size / 8 / IB + A100.inter_node_latency_s
    assert got == pytest.approx(expected)


def test_single_rank_group_costs_nothing():
    assert all_reduce_s(np.array([1e9]), np.array([1]), np.array([1]), A100)[0] == 0.0


def test_gemm_efficiency_is_half_of_max_at_the_half_point():
    eff = A100.efficiency
    assert gemm_efficiency(np.array([eff.gemm_half_flops]), A100)[0] == pytest.approx(eff.gemm_max / 2)
    # a GEMM at twice the rate (fp8) reaches half its efficiency at twice the FLOPs
    assert gemm_efficiency(np.array([2 * eff.gemm_half_flops]), A100, 2.0)[0] == pytest.approx(eff.gemm_max / 2)


def test_a_gemms_fixed_time_is_the_same_on_every_nvidia_gpu():
    """The half point over the 16-bit peak, a GEMM's fixed time at that rate, is the A100's 2 GFLOP / 312 TFLOP/s on
    every NVIDIA profile: 6.34 GFLOP on an H100 (989 TFLOP/s), 14.4 on a B200 (2250), 16.0 on a GB200 (2500)."""
    for name, peak in (("dgx-a100-80g", 312e12), ("dgx-h100", 989e12), ("dgx-h200", 989e12), ("dgx-b200", 2250e12),
                       ("gb200-nvl72", 2500e12), ("gb300-nvl72", 2500e12), ("l40s-8", 366e12), ("dgx2-v100", 125e12)):
        cluster = BUILTIN_CLUSTERS[name]
        assert max(cluster.gpu.peak_bf16_flops, cluster.gpu.peak_fp16_flops) == peak
        assert cluster.efficiency.gemm_half_flops == pytest.approx(2e9 / 312e12 * peak)


def _uniform_model(blocks=16) -> ModelNumbers:
    s, h = 1024, 2048
    return ModelNumbers(num_blocks=blocks, hidden=h, heads=16, ffn_hidden=4 * h, vocab=32000, seq_len=s,
                        params=blocks * 12.0 * h * h, embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0,
                        head_fwd_flops=0.0, block_params=12.0 * h * h, block_fwd_flops=24.0 * s * h * h,
                        block_act_bytes=34.0 * s * h, embed_act_bytes=0.0, head_act_bytes=0.0)


@pytest.mark.parametrize("pp,v,m", [(4, 1, 8), (4, 2, 8), (8, 1, 32)])
def test_pipeline_bubble_is_p_minus_1_over_v_stage_times(pp, v, m):
    model = _uniform_model()
    cand = Candidates.single(tp=1, pp=pp, dp=1, micro_batch=1, zero=0, recompute=0, sp=0, interleave=v, offload=0)
    est = estimate_step(model, cand, A100, "bf16", global_batch=m)
    stage = est.compute_s[0] / m
    assert est.pipeline_bubble_s[0] == pytest.approx((pp - 1) / v * stage)
    # share of the pipeline's time lost to the bubble: (p-1)/(v*m + p-1)  (Narayanan et al. Sec. 2.2)
    share = est.pipeline_bubble_s[0] / (est.compute_s[0] + est.pipeline_bubble_s[0])
    assert share == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_step_time_is_the_sum_of_its_parts_and_mfu_is_model_flops_over_peak():
    model = _uniform_model()
    cand = Candidates.single(tp=2, pp=2, dp=2, micro_batch=2, zero=1, recompute=2, sp=1, interleave=1, offload=0)
    est = estimate_step(model, cand, A100, "bf16", global_batch=32)
    parts = (est.compute_s + est.tensor_parallel_s + est.pipeline_bubble_s + est.pipeline_p2p_s
             + est.data_parallel_s + est.offload_s + est.optimizer_s)
    assert parts[0] == pytest.approx(est.step_time_s[0])
    flops = 3 * 16 * 24.0 * 1024 * 2048 * 2048 * 32  # 3x forward, 16 blocks, 32 samples
    assert est.mfu[0] == pytest.approx(flops / (est.step_time_s[0] * 8 * 312e12))
    assert est.num_micro_batches[0] == 32 / (2 * 2)


# bf16 ZeRO 1: 16-bit gradients, whole, read once for the norm (the step unscales them); ZeRO 3: the fp32 shard
# (1 / dp), read for the norm, then read and written to scale it
@pytest.mark.parametrize("zero, clip_bytes", [(1, 1 * 2.0), (3, 3 * 4.0 / 4)])
def test_the_optimizer_phase_clips_the_gradients_the_gpu_holds_and_steps_its_shard(zero, clip_bytes):
    """Clipping streams the gradients the GPU holds as runtime.training.step.optimizer_step clips them (bytes per
    parameter: clip_bytes); AdamW streams 30 bytes per parameter of the shard it steps (ZeRO 1 and 3 alike: 1 / dp); on
    A100 host ops cost nothing."""
    model = _uniform_model()
    cand = Candidates.single(tp=1, pp=1, dp=4, micro_batch=1, zero=zero, recompute=0, sp=0, interleave=1, offload=0)
    est = estimate_step(model, cand, A100, "bf16", global_batch=8)
    params = 16 * 12.0 * 2048 * 2048  # the blocks' (no embedding or head)
    bandwidth = A100.gpu.hbm_bandwidth_Bps * A100.efficiency.memory_bound
    assert est.optimizer_s[0] == pytest.approx((clip_bytes * params + 30 * params / 4) / bandwidth)


def test_full_recompute_costs_one_more_forward():
    model = _uniform_model()
    base = dict(tp=1, pp=1, dp=1, micro_batch=1, zero=0, sp=0, interleave=1, offload=0)
    none = estimate_step(model, Candidates.single(recompute=0, **base), A100, "bf16", 4)
    full = estimate_step(model, Candidates.single(recompute=2, **base), A100, "bf16", 4)
    assert full.compute_s[0] / none.compute_s[0] == pytest.approx(4 / 3, rel=0.01)


def test_stage_load_puts_the_head_where_it_fits_best():
    model = _uniform_model(blocks=96)
    cand = Candidates.single(tp=1, pp=8, dp=1, micro_batch=1, zero=0, recompute=0, sp=0, interleave=1, offload=0)
    # a head worth 0.34 blocks: best split is 12 blocks everywhere and the head on top of one stage
    assert stage_blocks_equivalent(model, cand, np.array([0.34]))[0] == pytest.approx(12.34)
    # a head worth 1.5 blocks: 12 everywhere leaves 10.5 + head on one stage (95 < 96 blocks), so the
    # bottleneck is 13: seven stages of 13 and the head stage with 11 blocks + 1.5
    assert stage_blocks_equivalent(model, cand, np.array([1.5]))[0] == pytest.approx(13.0)



def test_zero3_hides_each_phases_collectives_behind_that_phase_only():
    """dp = 8 in one node, ZeRO-3, full recompute, two FSDP units (the block and the root) of 0.5 GB each: a unit's
    gather or reduce-scatter takes g = 7/8 * 0.5e9 / NVLink + 7 latencies. With a micro-batch of 3 * 2 g of compute,
    all collectives together (2 gathers forward, 2 gathers + 2 reduce-scatters backward = 6 g) would just hide;
    phase by phase, the forward (a quarter of the compute with the re-run forward in the backward: 1.5 g) leaves
    2 g - 1.5 g exposed, the backward (4.5 g against 4 g) none. Plus the first gather / m, the logged loss and the
    gradient norm (two 4-byte all-reduces)."""
    from zplan.planner.cost.step import data_parallel_s

    model = ModelNumbers(num_blocks=1, hidden=64, heads=1, ffn_hidden=256, vocab=64, seq_len=64, params=5e8,
                         embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0, head_fwd_flops=0.0,
                         block_params=5e8, block_fwd_flops=0.0, block_act_bytes=0.0, embed_act_bytes=0.0,
                         head_act_bytes=0.0)
    cand = Candidates.single(tp=1, pp=1, dp=8, micro_batch=1, zero=3, recompute=2, sp=0, interleave=1, offload=0)
    g = 7 / 8 * 0.5e9 / NV + 7 * A100.intra_node_latency_s
    m = 4.0
    got = data_parallel_s(model, cand, A100, np.array([5e8]), 2, np.array([6 * g]), np.array([m]))[0]
    scalars = 2 * (2 * 7 / 8 * 4.0 / NV + 2 * 7 * A100.intra_node_latency_s)
    assert got == pytest.approx(m * (2 * g - 1.5 * g + g / m) + scalars)


def test_a_split_vocabulary_costs_two_hidden_all_reduces_and_the_losss_three_small_ones():
    """ParallelConfig.vocab_parallel at tp 8, by hand: one stage all-reduces the embedding's partial lookups and the
    head input's gradient, (b, s, h) bf16 each, and the loss's max, sum and target logit, (b, s) fp32 each; a
    pipeline's last stage only the head's; nothing where the vocabulary is not split."""
    from dataclasses import replace

    from zplan.planner.cost.step import vocab_parallel_s

    s, h, b = 2048, 4096, 2
    model = ModelNumbers(num_blocks=4, hidden=h, heads=32, ffn_hidden=4 * h, vocab=32000, seq_len=s, params=1.0,
                         embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0, head_fwd_flops=0.0, block_params=1.0,
                         block_fwd_flops=1.0, block_act_bytes=1.0, embed_act_bytes=0.0, head_act_bytes=0.0,
                         vocab_splittable=True)
    cand = Candidates.single(tp=8, pp=1, dp=1, micro_batch=b, zero=0, recompute=0, sp=0, interleave=1, offload=0)
    hidden = 2 * 7 / 8 * b * s * h * 2 / NV + 2 * 7 * A100.intra_node_latency_s
    loss = 2 * 7 / 8 * b * s * 4 / NV + 2 * 7 * A100.intra_node_latency_s
    assert vocab_parallel_s(model, cand, A100, 2)[0] == pytest.approx(2 * hidden + 3 * loss)
    staged = Candidates.single(tp=8, pp=2, dp=1, micro_batch=b, zero=0, recompute=0, sp=0, interleave=1, offload=0)
    assert vocab_parallel_s(model, staged, A100, 2)[0] == pytest.approx(hidden + 3 * loss)
    assert vocab_parallel_s(replace(model, vocab_splittable=False), cand, A100, 2)[0] == 0.0
