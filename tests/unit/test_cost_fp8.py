"""fp8 training's time terms against hand computations (planner/cost/compute.py), and its profiles and refusals."""

import numpy as np
import pytest

from zplan.api import prepare
from zplan.errors import SpecError
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.compute import (
    FP8_CAST_BYTES_PER_ELEMENT,
    activation_ops_Bps,
    block_time_s,
    edge_time_s,
    gemm_efficiency,
)
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.memory import FP8_CAST_TEMPORARY_BYTES_PER_ELEMENT, memory_per_gpu
from zplan.schemas.spec import Pins

H100 = BUILTIN_CLUSTERS["dgx-h100"].without_host()  # the device's terms alone
S, H, V, B, TP = 2048, 1024, 32000, 2, 2


def model() -> ModelNumbers:
    block_flops = 24.0 * S * H * H + 2.0 * S * S * H  # projections + causal QK^T and AV, one sample
    return ModelNumbers(num_blocks=4, hidden=H, heads=8, ffn_hidden=4 * H, vocab=V, seq_len=S, params=0.0,
                        embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0, head_fwd_flops=2.0 * S * H * V,
                        block_params=12.0 * H * H, block_fwd_flops=block_flops, block_act_bytes=30.0 * S * H,
                        embed_act_bytes=0.0, head_act_bytes=0.0)


def one(recompute=0):
    return Candidates.single(tp=TP, pp=1, dp=1, micro_batch=B, zero=0, recompute=recompute, sp=0, interleave=1,
                             offload=0)


@pytest.mark.parametrize("recompute", [0, 2])
def test_fp8_runs_the_block_gemms_at_the_fp8_peak_and_streams_the_casts(recompute):
    """By hand: the block's non-attention FLOPs (3 passes, 4 with full recompute; 24 s h^2 a sample forward) move from
    the bf16 to the fp8 peak, on the curve with the half point 1979 / 989 as large (the same fixed time a GEMM, at
    that rate), and the casts stream 10 B an element of X and G (16 h a token: 4 / (3 h) of the 12 h^2 parameters)
    and of the weights, all over tp."""
    passes = 3 + (recompute == 2)
    gemm = B * passes * 24.0 * S * H * H / TP
    x = 2.0 * B * S * H * 4 * H / TP
    eff = H100.efficiency.gemm_max * x / (x + H100.efficiency.gemm_half_flops)
    eff_fp8 = H100.efficiency.gemm_max * x / (x + 1979 / 989 * H100.efficiency.gemm_half_flops)
    assert gemm_efficiency(np.array([x]), H100, 1979 / 989)[0] == pytest.approx(eff_fp8)
    casts = FP8_CAST_BYTES_PER_ELEMENT * (B * S * 16 * H + 12.0 * H * H) / TP
    fp8 = block_time_s(model(), one(recompute), H100, "fp8")[0]
    bf16 = block_time_s(model(), one(recompute), H100, "bf16")[0]
    assert H100.gemm_peak_flops("fp8") == 1979e12 and H100.peak_flops("fp8") == 989e12
    expected = gemm / (1979e12 * eff_fp8) - gemm / (989e12 * eff) + casts / activation_ops_Bps(H100)
    assert fp8 - bf16 == pytest.approx(expected)


def test_fp8_keeps_the_head_and_the_model_states_of_bf16():
    """The head's GEMM stays bf16 (the runtime converts the blocks' Linears only) and the memory is bf16's."""
    cand = one()
    assert edge_time_s(2.0 * S * H * V, model(), cand, H100, "fp8", loss=True)[0] == pytest.approx(
        edge_time_s(2.0 * S * H * V, model(), cand, H100, "bf16", loss=True)[0])
    m = np.array([4.0])
    assert memory_per_gpu(model(), cand, H100, "fp8", m).total == pytest.approx(
        memory_per_gpu(model(), cand, H100, "bf16", m).total)


@pytest.mark.parametrize("cluster", ["dgx-a100-80g", "dgx2-v100", "cpu-local"])
def test_compile_refuses_fp8_where_the_gpu_has_no_fp8_tensor_cores(cluster):
    with pytest.raises(SpecError, match="no fp8 tensor cores"):
        prepare("examples/tiny.py", 2 if cluster == "cpu-local" else 8, cluster, None, None, "fp8", Pins())


def test_nvl72_racks_are_one_nvlink_domain_of_four_gpu_nodes():
    """A 64-GPU data-parallel all-reduce inside an NVL72 rack runs at NVLink speed (no network term); on 8-GPU DGX
    H100 nodes the same group crosses the network."""
    from zplan.planner.cost.comm import all_reduce_s

    gb200 = BUILTIN_CLUSTERS["gb200-nvl72"]
    assert (gb200.gpus_per_node, gb200.link_domain()) == (4, 72)
    size, stride, nbytes = np.array([64]), np.array([1]), np.array([1e9])
    intra = gb200.intra_node_bandwidth_Bps * gb200.efficiency.intra_node_link
    by_hand = 2 * (63 / 64 * 1e9 / intra + 63 * gb200.intra_node_latency_s)
    assert all_reduce_s(nbytes, size, stride, gb200)[0] == pytest.approx(by_hand)
    assert all_reduce_s(nbytes, size, stride, H100)[0] > 2 * 63 / 64 * 1e9 / (H100.intra_node_bandwidth_Bps * 0.8)


def test_an_fp8_plan_prices_faster_than_bf16_and_says_what_it_assumes():
    from zplan.api import compile_plan, compile_with_alternatives

    spec = "llama:layers=8,hidden=2048,heads=16,kv_heads=16,ffn=8192,seq=2048,vocab=32000"
    pins = Pins(tp=1, pp=1, zero=3, micro_batch=4, recompute="none")
    fp8, fp8_search = compile_with_alternatives(prepare(spec, 8, "dgx-h100", 64, None, "fp8", pins))
    bf16 = compile_plan(prepare(spec, 8, "dgx-h100", 64, None, "bf16", pins))
    assert fp8.prediction.step_time_s < bf16.prediction.step_time_s
    # the same peak but for the casts' fp32 temporaries in a block's backward, where it peaks (the runtime's in-place
    # loss holds less than that backward): 7.5 B per (b, s, ffn) element
    casts = FP8_CAST_TEMPORARY_BYTES_PER_ELEMENT * 4 * 2048 * 8192
    assert fp8.prediction.memory.total == pytest.approx(bf16.prediction.memory.total + casts)
    rows = {a.name: a.value for a in fp8_search.assumptions}
    assert "1979 TFLOP/s" in rows["fp8 training"] and "peak bf16 FLOP/s" in rows


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("name", sorted(BUILTIN_CLUSTERS))
def test_every_built_in_profile_is_a_valid_profile_file(name):
    """What `zplan clusters --json` prints for a profile reads back as the same profile (a model_copy skips
    validation: a float where the schema says int would write a file that does not)."""
    from zplan.schemas.cluster import ClusterSpec

    cluster = BUILTIN_CLUSTERS[name]
    assert ClusterSpec.model_validate_json(cluster.model_dump_json()) == cluster


def test_fp8_tensor_parallel_adds_an_amax_all_reduce_per_cast_of_a_split_tensor():
    """A Llama block (q, k, v, gate, up column-split; o, down row-split) at tp 2: forward 7 weights + 2 row inputs,
    backward 7 weights + 5 column output gradients = 21 eight-byte all-reduces per block and micro-batch (+9 with full
    recompute), on 4 blocks and 8 micro-batches (a 16-token vocabulary keeps the head under one block's time)."""
    from dataclasses import replace

    from zplan.planner.cost.comm import all_reduce_s
    from zplan.planner.cost.step import estimate_step

    llama = replace(model(), vocab=16, head_fwd_flops=2.0 * S * H * 16, block_colwise_linears=5,
                    block_rowwise_linears=2)
    one_reduce = all_reduce_s(np.array([8.0]), np.array([2]), np.array([1]), H100)[0]
    for recompute, casts in ((0, 21), (2, 30)):
        cand = one(recompute)
        fp8 = estimate_step(llama, cand, H100, "fp8", global_batch=8 * B)
        bf16 = estimate_step(llama, cand, H100, "bf16", global_batch=8 * B)
        assert fp8.tensor_parallel_s[0] - bf16.tensor_parallel_s[0] == pytest.approx(8 * 4 * casts * one_reduce)
