"""Memory formulas against hand computations from the papers they cite."""

import numpy as np
import pytest

from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.memory import block_activation_bytes, inflight_microbatches, memory_per_gpu

A100 = BUILTIN_CLUSTERS["dgx-a100-80g"]
S, H, A, V, L = 2048, 4096, 32, 51200, 32


def gpt_numbers(act_per_sample=34 * S * H + 5 * A * S * S) -> ModelNumbers:
    block = 12 * H * H
    return ModelNumbers(num_blocks=L, hidden=H, heads=A, ffn_hidden=4 * H, vocab=V, seq_len=S,
                        params=L * block, embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0,
                        head_fwd_flops=0.0, block_params=block, block_fwd_flops=24 * S * H * H,
                        block_act_bytes=act_per_sample, embed_act_bytes=0.0, head_act_bytes=0.0)


def one(**kw):
    base = dict(tp=1, pp=1, dp=8, micro_batch=1, zero=0, recompute=0, sp=0, interleave=1, offload=0)
    base.update(kw)
    return Candidates.single(**base)


@pytest.mark.parametrize("zero,expected_per_param", [
    (0, 16.0),            # 4 + 4 + 8 (the paper's 2 + 2 + 12 totals the same)
    (1, 8.0 + 8 / 8),     # fp32 weights and gradients whole, Adam's 8 bytes sharded (the paper: 4 + 12 / N)
    (2, 16 / 8),          # FSDP2 ZeRO-2 shards weights at rest too (the paper: 2 + 14 / N)
    (3, 16 / 8),          # 16 psi / N
])
def test_model_states_are_the_runtimes(zero, expected_per_param):
    """bf16 on 8 GPUs: the runtime keeps fp32 weights (the master copy) and fp32 gradients whatever the
    compute precision, and Adam's m and v (8 bytes), sharded by ZeRO stage."""
    model = gpt_numbers()
    mem = memory_per_gpu(model, one(zero=zero), A100, "bf16", np.array([1.0]))
    states = mem.parameters + mem.gradients + mem.optimizer
    assert states[0] == pytest.approx(expected_per_param * model.params)


def test_compute_copies_are_held_from_forward_to_backward():
    """By hand for the 6.4B GPT on 8 GPUs in bf16. ZeRO-2 (FSDP2, reshard_after_forward=False): 4/8 + 4/8
    + 8/8 bytes per parameter at rest; in the step every block's gathered bf16 weights (2 bytes each)
    plus two blocks' unsharded gradients (fp32) in the reduce-scatter. ZeRO-3 holds only two gathered
    blocks (current + prefetched) besides the same two gradient blocks. ZeRO-0: autocast's cached bf16
    copies of all weights (2 psi) plus DDP's two 25 MiB fp32 gradient buckets."""
    model = gpt_numbers()
    psi, block = model.params, model.block_params  # 32 * 12 h^2, 12 h^2
    z0 = memory_per_gpu(model, one(zero=0), A100, "bf16", np.array([1.0]))
    z2 = memory_per_gpu(model, one(zero=2), A100, "bf16", np.array([1.0]))
    z3 = memory_per_gpu(model, one(zero=3), A100, "bf16", np.array([1.0]))
    at_rest = (z2.parameters[0], z2.gradients[0], z2.optimizer[0])
    assert at_rest == pytest.approx((4 * psi / 8, 4 * psi / 8, 8 * psi / 8))
    assert z2.comm_buffers[0] == pytest.approx(2 * psi + 2 * 4 * block)
    assert z3.comm_buffers[0] == pytest.approx(2 * 4 * block + 2 * 2 * block)
    assert z0.comm_buffers[0] == pytest.approx(2 * psi + 2 * 25 * 2**20)
    # the peak: ZeRO-2 holds all its gathered weights (2 psi) where ZeRO-3 holds two blocks; the rest is equal
    assert z2.total[0] - z3.total[0] == pytest.approx(2 * psi - 2 * 2 * block)
    fp32 = memory_per_gpu(model, one(zero=0), A100, "fp32", np.array([1.0]))
    assert fp32.comm_buffers[0] == pytest.approx(2 * 25 * 2**20)  # fp32 computes on the weights themselves


def test_fp32_states_are_four_plus_four_plus_eight():
    model = gpt_numbers()
    mem = memory_per_gpu(model, one(zero=0), A100, "fp32", np.array([1.0]))
    assert (mem.parameters + mem.gradients + mem.optimizer)[0] == pytest.approx(16.0 * model.params)


def test_offload_moves_optimizer_off_the_gpu_and_onto_the_host():
    model = gpt_numbers()
    mem = memory_per_gpu(model, one(zero=2, offload=1), A100, "bf16", np.array([1.0]))
    assert mem.optimizer[0] == 0.0 and mem.gradients[0] == 0.0
    # each of the node's 8 GPUs keeps its 12/8 + 2/8 bytes per parameter on the host
    assert mem.cpu_bytes_per_node[0] == pytest.approx(8 * (12 + 2) / 8 * model.params)


@pytest.mark.parametrize("tp,sp,recompute,expected", [
    # Korthikanti et al. Table 2, per layer, s*b*h units (b = 1):
    (1, 0, 0, 34 + 5 * A * S / H),
    (8, 0, 0, 10 + 24 / 8 + 5 * A * S / (H * 8)),
    (8, 1, 0, (34 + 5 * A * S / H) / 8),
    (8, 1, 1, 34 / 8),          # sequence parallel + selective recompute
    (1, 0, 2, 2),               # full recompute keeps the layer input
    (8, 1, 2, 2 / 8),
])
def test_activation_bytes_match_korthikanti_table_2(tp, sp, recompute, expected):
    model = gpt_numbers()
    got = block_activation_bytes(model, one(tp=tp, sp=sp, recompute=recompute), "bf16")
    assert got[0] / (S * H) == pytest.approx(expected)


def test_flash_attention_model_has_nothing_for_selective_recompute_to_drop():
    model = gpt_numbers(act_per_sample=34 * S * H)  # no (s, s) tensors saved
    none = block_activation_bytes(model, one(tp=8, sp=1, recompute=0), "bf16")
    selective = block_activation_bytes(model, one(tp=8, sp=1, recompute=1), "bf16")
    assert none[0] == selective[0] == pytest.approx(34 * S * H / 8)


def test_first_stage_of_1f1b_holds_p_microbatches_and_interleaving_more():
    cand = Candidates(**{k: np.array(v) for k, v in dict(
        tp=[1, 1, 1], pp=[4, 4, 4], dp=[1, 1, 1], micro_batch=[1, 1, 1], zero=[0, 0, 0], recompute=[0, 0, 0],
        sp=[0, 0, 0], interleave=[1, 2, 1], offload=[0, 0, 0]).items()})
    got = inflight_microbatches(cand, np.array([16.0, 16.0, 2.0]))
    assert got.tolist() == pytest.approx([4.0, 4.0 * (1 + 3 / 8), 2.0])
