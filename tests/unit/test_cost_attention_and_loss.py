"""The attention core's and the loss's time terms against hand computations (planner/cost/compute.py)."""

import numpy as np
import pytest

from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.compute import (
    LOSS_STREAMED_BYTES_PER_LOGIT,
    activation_ops_Bps,
    block_time_s,
    edge_time_s,
    gemm_efficiency,
)
from zplan.planner.cost.inputs import Candidates, ModelNumbers

A100 = BUILTIN_CLUSTERS["dgx-a100-80g"]
NO_FLASH_FIGURE = A100.model_copy(update={"efficiency": A100.efficiency.model_copy(update={"attention": None})})
S, H, A, V = 4096, 2048, 16, 50000


def model(core_bytes: float = 0.0) -> ModelNumbers:
    block_flops = 24.0 * S * H * H + 2.0 * S * S * H  # projections + causal QK^T and AV
    return ModelNumbers(num_blocks=4, hidden=H, heads=A, ffn_hidden=4 * H, vocab=V, seq_len=S, params=0.0,
                        embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0, head_fwd_flops=2.0 * S * H * V,
                        block_params=12.0 * H * H, block_fwd_flops=block_flops, block_act_bytes=30.0 * S * H,
                        embed_act_bytes=0.0, head_act_bytes=0.0, block_attention_core_bytes=core_bytes)


def one(recompute=0, micro_batch=2):
    return Candidates.single(tp=1, pp=1, dp=1, micro_batch=micro_batch, zero=0, recompute=recompute, sp=0,
                             interleave=1, offload=0)


@pytest.mark.parametrize("recompute, core_passes", [(0, 3), (1, 4), (2, 4)])
def test_the_attention_core_runs_at_the_flash_kernels_efficiency(recompute, core_passes):
    """Moving the core's FLOPs (2*s^2*h a sample forward, causal; backward twice; recompute once more) from the GEMM
    curve to the profile's flash figure changes the block's time by exactly their difference."""
    b, peak = 2, A100.peak_flops("bf16")
    eff = gemm_efficiency(np.array([2.0 * b * S * H * 4 * H]), A100)[0]
    core = b * core_passes * 2.0 * S * S * H
    flash = block_time_s(model(), one(recompute), A100, "bf16")[0]
    curve = block_time_s(model(), one(recompute), NO_FLASH_FIGURE, "bf16")[0]
    assert A100.efficiency.attention == pytest.approx(190 * 3 / 3.5 / 312)
    assert flash - curve == pytest.approx(core / (peak * A100.efficiency.attention) - core / (peak * eff))


def test_an_unfused_core_stays_on_the_gemm_curve_and_streams_its_bytes():
    """A block that saves the (s, s) scores (Megatron 2021's unfused core) runs them as batched GEMMs: the flash
    figure does not apply, and its saved bytes are streamed 2.5x per pass like every saved byte."""
    unfused = model(core_bytes=5.0 * A * S * S)
    assert block_time_s(unfused, one(), A100, "bf16")[0] == block_time_s(unfused, one(), NO_FLASH_FIGURE, "bf16")[0]


def test_the_head_streams_the_loss_bytes_per_logit():
    b = 3
    cand = one(micro_batch=b)
    with_loss = edge_time_s(2.0 * S * H * V, model(), cand, A100, "bf16", loss=True)[0]
    without = edge_time_s(2.0 * S * H * V, model(), cand, A100, "bf16")[0]
    per_logit = LOSS_STREAMED_BYTES_PER_LOGIT["bf16"]
    assert with_loss - without == pytest.approx(b * S * V * per_logit / activation_ops_Bps(A100))
