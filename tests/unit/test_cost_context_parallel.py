"""Context parallel in the cost model against hand computations: a GPU's share of the tokens, the K/V all-gathers,
the attention mask, the gradient group of dp * cp, and the search's cp axis."""

import numpy as np
import pytest

from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.compute import BACKWARD_OVER_FORWARD, STREAMED_PER_SAVED_BYTE, activation_ops_Bps
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.memory import memory_per_gpu
from zplan.planner.cost.step import context_parallel_block_s, data_parallel_s, estimate_step

H100 = BUILTIN_CLUSTERS["dgx-h100"]
NV = H100.intra_node_bandwidth_Bps * H100.efficiency.intra_node_link
S, H, HEADS, KV_HEADS = 8192, 4096, 32, 8


def _model(blocks: int = 8) -> ModelNumbers:
    return ModelNumbers(num_blocks=blocks, hidden=H, heads=HEADS, ffn_hidden=4 * H, vocab=32000, seq_len=S,
                        params=blocks * 12.0 * H * H, embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0,
                        head_fwd_flops=0.0, block_params=12.0 * H * H, block_fwd_flops=24.0 * S * H * H,
                        block_act_bytes=34.0 * S * H, embed_act_bytes=0.0, head_act_bytes=0.0, kv_heads=KV_HEADS)


def _cand(cp: int, micro_batch: int, dp: int = 1, tp: int = 1, recompute: int = 0, zero: int = 0) -> Candidates:
    return Candidates.single(tp=tp, pp=1, dp=dp, micro_batch=micro_batch, zero=zero, recompute=recompute, sp=0,
                             interleave=1, offload=0, cp=cp)


def test_a_gpu_computes_b_over_cp_sequences():
    """cp 2 with 2 sequences a micro-batch puts one sequence's worth of tokens (and causal attention, balanced) on
    each GPU: the same compute and saved activations per micro-batch as cp 1 with one sequence, apart from the
    gathered K/V the attention keeps (2 (cp - 1) b/cp s kv_features bytes at 16-bit), which its forward and backward
    also stream (planner.cost.compute: STREAMED_PER_SAVED_BYTE per saved byte, the backward twice), and the one
    (s/cp, s) attention mask all blocks share."""
    model = _model()
    split = estimate_step(model, _cand(cp=2, micro_batch=2), H100, "bf16", global_batch=2)
    whole = estimate_step(model, _cand(cp=1, micro_batch=1), H100, "bf16", global_batch=1)
    kv_features = H * KV_HEADS / HEADS
    gathered_kv = 2 * 1 * S * kv_features * 2  # K and V of the other rank's tokens, per block
    mask = S / 2 * S * 2  # 4096 queries x 8192 keys, bf16
    streamed_s = STREAMED_PER_SAVED_BYTE * (1 + BACKWARD_OVER_FORWARD) * gathered_kv / activation_ops_Bps(H100)
    assert split.compute_s[0] - whole.compute_s[0] == pytest.approx(model.num_blocks * streamed_s)
    assert (split.memory.activations[0] - whole.memory.activations[0]
            == pytest.approx(model.num_blocks * gathered_kv + mask))
    assert split.tokens_per_s[0] == pytest.approx(2 * S / split.step_time_s[0])


def _extra_activations(blocks=8, cp=2, b=1, tp=1, recompute=0, precision="bf16") -> float:
    """Activation bytes per GPU that splitting each of cp * b sequences over cp GPUs adds to one GPU holding b whole
    sequences (the same tokens per GPU)."""
    model = _model(blocks)
    split = memory_per_gpu(model, _cand(cp=cp, micro_batch=cp * b, tp=tp, recompute=recompute), H100, precision,
                           np.ones(1))
    whole = memory_per_gpu(model, _cand(cp=1, micro_batch=b, tp=tp, recompute=recompute), H100, precision, np.ones(1))
    return split.activations[0] - whole.activations[0]


def test_one_attention_mask_serves_every_block():
    """The runtime makes context parallel's additive causal mask, (s/cp) queries x s keys in the compute dtype, once
    per micro-batch (runtime/parallel/context_parallel.py: causal_bias) and every block's attention saves that one
    tensor: a GPU holds it once, whatever the number of blocks, the micro-batch (broadcast over the sequences), tp
    (every tp rank holds it whole) or recompute; the gathered K/V are per block, per sequence and split by tp. By hand,
    s 8192, 1024 K/V features: the mask at cp 2 in bf16 is 4096 x 8192 x 2 B = 64 MiB, at cp 4 2048 x 8192 x 2 B = 32
    MiB, in fp32 twice that; a block's K and V of the other ranks' tokens, a GPU holding b sequences' worth of tokens,
    are (cp - 1) x b x 2 x 8192 x 1024 x 2 B = (cp - 1) x b x 32 MiB in bf16."""
    mib = 2**20
    assert _extra_activations(blocks=8) == pytest.approx((8 * 32 + 64) * mib)
    assert _extra_activations(blocks=16) == pytest.approx((16 * 32 + 64) * mib)  # not per block
    assert _extra_activations(b=4) == pytest.approx((8 * 4 * 32 + 64) * mib)  # not per sequence
    assert _extra_activations(tp=2) == pytest.approx((8 * 16 + 64) * mib)  # not split by tp
    assert _extra_activations(cp=4) == pytest.approx((8 * 3 * 32 + 32) * mib)
    assert _extra_activations(precision="fp32") == pytest.approx((8 * 64 + 128) * mib)
    assert _extra_activations(recompute=2) == pytest.approx(64 * mib)  # full recompute keeps no K/V, still the mask


@pytest.mark.parametrize("recompute, gathers", [(0, 1), (1, 2), (2, 2)])
def test_each_block_gathers_k_and_v_and_reduce_scatters_their_gradients(recompute, gathers):
    """Within a node (ring, Thakur et al.): an all-gather or reduce-scatter of S bytes over n ranks costs
    (n-1)/n S / B + (n-1) latency; the gathered K and V are (b, s, kv features) each; recompute gathers again."""
    model, cp, b = _model(), 4, 4
    gathered = 2 * b * S * (H * KV_HEADS / HEADS) * 2  # bytes, bf16
    one = (cp - 1) / cp * gathered / NV + (cp - 1) * H100.intra_node_latency_s
    got = context_parallel_block_s(model, _cand(cp=cp, micro_batch=b, recompute=recompute), H100, 2)[0]
    assert got == pytest.approx((gathers + 1) * one)
    est = estimate_step(model, _cand(cp=cp, micro_batch=b, recompute=recompute), H100, "bf16", global_batch=b * 3)
    assert est.context_parallel_s[0] == pytest.approx(3 * model.num_blocks * got)  # 3 micro-batches
    assert context_parallel_block_s(model, _cand(cp=1, micro_batch=b), H100, 2)[0] == 0.0


def test_gradients_are_reduced_and_zero_shards_over_dp_times_cp():
    """dp 2 x cp 2 holds the same parameters on 4 ranks: the same gradient all-reduce and the same ZeRO-1 shard as
    dp 4 (both one node)."""
    model = _model()
    params = np.array([1e9])
    split = data_parallel_s(model, _cand(cp=2, micro_batch=2, dp=2, zero=1), H100, params, 2, np.zeros(1), 1.0)
    wide = data_parallel_s(model, _cand(cp=1, micro_batch=2, dp=4, zero=1), H100, params, 2, np.zeros(1), 1.0)
    assert split[0] == pytest.approx(wide[0])
    mem_split = memory_per_gpu(model, _cand(cp=2, micro_batch=2, dp=2, zero=1), H100, "bf16", np.ones(1))
    mem_wide = memory_per_gpu(model, _cand(cp=1, micro_batch=2, dp=4, zero=1), H100, "bf16", np.ones(1))
    assert mem_split.optimizer[0] == pytest.approx(mem_wide.optimizer[0])


def test_the_search_splits_sequences_only_where_a_gpu_keeps_4096_tokens():
    from zplan.planner.enumerate import enumerate_candidates
    from zplan.planner.family import family_summary
    from zplan.schemas.spec import Pins

    def cps(seq: int, pins: Pins = Pins()) -> set[int]:
        summary = family_summary(f"llama:layers=4,hidden=256,heads=8,seq={seq},vocab=512,ffn=512,kv_heads=2")
        return set(enumerate_candidates(summary, H100, 8, 8, pins).cp.tolist())

    assert cps(4096) == {1}
    assert cps(16384) == {1, 2, 4}
    assert cps(4096, Pins(cp=8)) == {8}  # a pin overrides the threshold
    model = family_summary("llama:layers=4,hidden=256,heads=8,seq=4096,vocab=512,ffn=512,kv_heads=2")
    assert len(enumerate_candidates(model, H100, 8, 8, Pins(cp=2, pp=2))) > 0  # with a pipeline
    assert len(enumerate_candidates(model, H100, 8, 8, Pins(cp=2, offload="cpu"))) == 0  # not with offload
