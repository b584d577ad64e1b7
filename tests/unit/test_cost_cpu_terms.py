"""The cost model's terms for hosts that compute (cpu-local): per-op host overhead, per-type collective
costs, no overlap of communication with compute, FSDP2 per-unit costs, the ZeRO-1 weight sync; each
against a hand computation for two ranks; and on GPU profiles the host as a floor under the device's time."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.comm import all_gather_s, all_reduce_s, reduce_scatter_s
from zplan.planner.cost.compute import BLOCK_OPS, EMBEDDING_OPS, HEAD_OPS, RECOMPUTE_EXTRA_OPS, block_time_s
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.step import OPTIMIZER_STEP_OPS, estimate_step
from zplan.schemas.cluster import CollectiveCost, CollectiveCosts, HostOverheads

A100 = BUILTIN_CLUSTERS["dgx-a100-80g"]
ROOT = Path(__file__).resolve().parents[2]

# A 2-device host with round numbers: every collective type its own latency and bandwidth.
AR, AG, RS = (CollectiveCost(latency_s=lat, bandwidth_Bps=bw) for lat, bw in ((1e-4, 1e9), (3e-4, 5e8), (2e-4, 4e8)))
HOST = A100.model_copy(update={
    "gpus_per_node": 2,
    "overlaps_comm_with_compute": False,
    "collectives": CollectiveCosts(all_reduce=AR, all_gather=AG, reduce_scatter=RS),
    "host_overheads": HostOverheads(op_s=1e-5, sharded_unit_s=5e-3),
})
TWO, ONE = np.array([2]), np.array([1])


def _tiny_model(blocks=2) -> ModelNumbers:
    s, h = 64, 64
    return ModelNumbers(num_blocks=blocks, hidden=h, heads=4, ffn_hidden=4 * h, vocab=256, seq_len=s,
                        params=blocks * 12.0 * h * h + 256 * h, embed_params=256.0 * h, embed_fwd_flops=0.0,
                        head_params=0.0, head_fwd_flops=2.0 * s * h * 256, block_params=12.0 * h * h,
                        block_fwd_flops=24.0 * s * h * h, block_act_bytes=34.0 * s * h, embed_act_bytes=0.0,
                        head_act_bytes=0.0)


def _cand(**kw) -> Candidates:
    base = dict(tp=1, pp=1, dp=2, micro_batch=1, zero=0, recompute=0, sp=0, interleave=1, offload=0)
    return Candidates.single(**{**base, **kw})


def test_each_collective_uses_its_own_measured_cost_on_two_ranks():
    size = 1e6
    # ring formulas for n = 2: all-reduce S/B + 2 lat; all-gather, reduce-scatter S/(2B) + lat
    assert all_reduce_s(np.array([size]), TWO, ONE, HOST)[0] == pytest.approx(size / 1e9 + 2e-4)
    assert all_gather_s(np.array([size]), TWO, ONE, HOST)[0] == pytest.approx(size / 1e9 + 3e-4)
    assert reduce_scatter_s(np.array([size]), TWO, ONE, HOST)[0] == pytest.approx(size / 8e8 + 2e-4)
    assert all_gather_s(np.array([size]), ONE, ONE, HOST)[0] == 0.0


def test_without_measured_collectives_gather_equals_reduce_scatter():
    size = np.array([1e9])
    assert all_gather_s(size, np.array([8]), ONE, A100)[0] == reduce_scatter_s(size, np.array([8]), ONE, A100)[0]


def test_every_op_of_every_micro_batch_pays_the_host_overhead():
    model, cand = _tiny_model(blocks=2), _cand(dp=1, micro_batch=2)
    quiet = HOST.model_copy(update={"host_overheads": HostOverheads()})
    with_ops, without = (estimate_step(model, cand, c, "fp32", global_batch=8) for c in (HOST, quiet))
    # 4 micro-batches x (2 blocks x 132 + 12 + 30 ops) x 10 us, and 14 optimizer ops x 10 us once
    assert with_ops.compute_s[0] - without.compute_s[0] == pytest.approx(4 * (2 * 132 + 12 + 30) * 1e-5)
    assert with_ops.optimizer_s[0] - without.optimizer_s[0] == pytest.approx(14 * 1e-5)
    assert (BLOCK_OPS, EMBEDDING_OPS, HEAD_OPS, OPTIMIZER_STEP_OPS) == (132, 12, 30, 14)


def test_recompute_reruns_the_block_ops():
    model = _tiny_model(blocks=2)
    quiet = HOST.model_copy(update={"host_overheads": HostOverheads()})

    def host_share(recompute: int) -> float:
        cand = _cand(dp=1, recompute=recompute)
        with_ops, without = (estimate_step(model, cand, c, "fp32", 1) for c in (HOST, quiet))
        return with_ops.compute_s[0] - without.compute_s[0]

    # selective (SAC) re-runs 80 ops per block, full (checkpoint) 79: counted on examples/gpt.py
    assert host_share(1) - host_share(0) == pytest.approx(2 * 80 * 1e-5)
    assert host_share(2) - host_share(0) == pytest.approx(2 * 79 * 1e-5)
    assert RECOMPUTE_EXTRA_OPS == (0, 80, 79)


def test_measured_recompute_overhead_replaces_the_op_count():
    model = _tiny_model(blocks=2)
    measured = HOST.model_copy(update={"host_overheads": HostOverheads(
        op_s=1e-5, selective_recompute_s=7e-3, full_recompute_s=2e-3)})
    none, selective, full = (estimate_step(model, _cand(dp=1, recompute=r), measured, "fp32", 1) for r in (0, 1, 2))
    counted = [estimate_step(model, _cand(dp=1, recompute=r), HOST, "fp32", 1) for r in (1, 2)]
    # per block and micro-batch: 7 ms (selective) and 2 ms (full) instead of 80 and 79 ops at 10 us
    assert selective.compute_s[0] - counted[0].compute_s[0] == pytest.approx(2 * (7e-3 - 80e-5))
    assert full.compute_s[0] - counted[1].compute_s[0] == pytest.approx(2 * (2e-3 - 79e-5))
    assert none.compute_s[0] < full.compute_s[0] < selective.compute_s[0]


def test_ddp_gradient_all_reduce_is_not_hidden_when_comm_does_not_overlap():
    model, cand = _tiny_model(), _cand(zero=0)
    est = estimate_step(model, cand, HOST, "fp32", global_batch=2)
    grads = 4.0 * est.memory.stage_params[0]
    loss = 4 / 1e9 + 2e-4  # the logged loss, all-reduced every step
    assert est.data_parallel_s[0] == pytest.approx(grads / 1e9 + 2e-4 + loss)
    overlapped = estimate_step(model, cand, HOST.model_copy(update={"overlaps_comm_with_compute": True}), "fp32", 2)
    hidden = max(0.0, grads / 1e9 + 2e-4 - overlapped.compute_s[0] * 2 / 3)  # behind the backward (2/3)
    assert overlapped.data_parallel_s[0] == pytest.approx(hidden + loss)


def test_zero1_all_gathers_the_updated_weights_once_per_step():
    model = _tiny_model(blocks=2)
    z0, z1 = (estimate_step(model, _cand(zero=z), HOST, "fp32", 8) for z in (0, 1))  # 4 micro-batches
    weights = 4.0 * z1.memory.stage_params[0]  # < 25 MiB: one bucket, one all-gather
    assert z1.data_parallel_s[0] - z0.data_parallel_s[0] == pytest.approx(weights / 1e9 + 3e-4)


def test_zero3_gathers_twice_and_scatters_once_per_unit_and_micro_batch():
    model = _tiny_model(blocks=2)
    est = estimate_step(model, _cand(zero=3), HOST, "fp32", global_batch=8)  # 4 micro-batches
    unit_bytes = 4.0 * est.memory.stage_params[0] / 3  # 2 blocks + the root
    per_unit = 2 * (unit_bytes / 1e9 + 3e-4) + unit_bytes / 8e8 + 2e-4 + 5e-3
    scalars = 2 * (4 / 1e9 + 2e-4)  # the loss and the gradient norm
    assert est.data_parallel_s[0] == pytest.approx(4 * 3 * per_unit + scalars)
    # ZeRO-2 keeps the gathered weights over the step's micro-batches: one gather per unit, not 2 x 4
    z2 = estimate_step(model, _cand(zero=2), HOST, "fp32", global_batch=8)
    assert est.data_parallel_s[0] - z2.data_parallel_s[0] == pytest.approx((2 * 4 - 1) * 3 * (unit_bytes / 1e9 + 3e-4))


def test_gpu_profiles_overlap_and_their_host_runs_ahead():
    for name in ("dgx-a100-80g", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72", "gb300-nvl72", "l40s-8",
                 "dgx2-v100"):
        cluster = BUILTIN_CLUSTERS[name]
        assert cluster.overlaps_comm_with_compute and cluster.collectives is None
        # examples/tiny.py's forward + backward on one H200: 16 ms over 2 x 132 + 12 + 30 counted ops
        assert cluster.host_overheads == HostOverheads(op_s=16e-3 / 306, sharded_unit_s=0.0, runs_ahead=True)
    assert not BUILTIN_CLUSTERS["cpu-local"].overlaps_comm_with_compute
    assert not BUILTIN_CLUSTERS["cpu-local"].host_overheads.runs_ahead


def _count_ops(fn) -> int:
    from zplan.probe import count_aten_ops

    return count_aten_ops(fn)


def test_block_op_count_is_that_of_the_gpt_example():
    """BLOCK_OPS against a fresh count on examples/gpt.py: (3 blocks - 1 block) / 2, forward + backward."""
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    counts = []
    for layers in (1, 3):
        model = gpt.build_model(num_layers=layers, hidden=16, heads=2, ffn_hidden=64, vocab_size=32, max_seq_len=8)
        x = torch.randint(0, 32, (1, 8))
        model(x).sum().backward()  # gradients exist, as after a step's first micro-batch
        counts.append(_count_ops(lambda model=model, x=x: model(x).sum().backward()))
    assert (counts[1] - counts[0]) / 2 == BLOCK_OPS


def test_on_a_gpu_the_host_is_a_floor_under_each_blocks_device_time():
    """dgx-h200 (host 16 ms / 306 ops, running ahead of the GPU): examples/tiny.py's 2 blocks, embedding and head
    are far shorter on the device than their dispatch, so a micro-batch takes its 306 counted ops' host time, the
    16 ms forward + backward measured on one H200, and the optimizer its 14 ops'; a GPT-3-sized block (h 12288,
    2048 tokens) outlasts its dispatch and is priced as without the host."""
    h200 = BUILTIN_CLUSTERS["dgx-h200"]
    op_s = h200.host_overheads.op_s
    one = _cand(dp=1)
    est = estimate_step(_tiny_model(), one, h200, "bf16", global_batch=1)
    assert est.compute_s[0] == pytest.approx((2 * BLOCK_OPS + EMBEDDING_OPS + HEAD_OPS) * op_s)
    assert est.compute_s[0] == pytest.approx(16e-3)
    assert est.optimizer_s[0] == pytest.approx(OPTIMIZER_STEP_OPS * op_s)
    device_only = estimate_step(_tiny_model(), one, h200.without_host(), "bf16", global_batch=1)
    assert device_only.compute_s[0] < est.compute_s[0] / 100
    s, h = 2048, 12288
    large = ModelNumbers(num_blocks=1, hidden=h, heads=96, ffn_hidden=4 * h, vocab=256, seq_len=s, params=12.0 * h * h,
                         embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0, head_fwd_flops=0.0,
                         block_params=12.0 * h * h, block_fwd_flops=24.0 * s * h * h, block_act_bytes=34.0 * s * h,
                         embed_act_bytes=0.0, head_act_bytes=0.0)
    priced = block_time_s(large, one, h200, "bf16")[0]
    assert priced == block_time_s(large, one, h200.without_host(), "bf16")[0] > BLOCK_OPS * op_s


def test_a_compiled_gpu_plan_keeps_the_hosts_floor_under_its_optimizer_step():
    """The placement that fixes the plan's model states re-prices its optimizer phase the same way as the search:
    examples/tiny.py on one H200 steps in the host's 14 ops, not in its microseconds of GPU work."""
    from zplan.api import compile_plan, prepare
    from zplan.schemas.spec import Pins

    plan = compile_plan(prepare(str(ROOT / "examples" / "tiny.py"), 1, "dgx-h200", None, None, None, Pins()))
    op_s = BUILTIN_CLUSTERS["dgx-h200"].host_overheads.op_s
    assert plan.prediction.time.optimizer == pytest.approx(OPTIMIZER_STEP_OPS * op_s)
    assert plan.prediction.time.compute == pytest.approx((2 * BLOCK_OPS + EMBEDDING_OPS + HEAD_OPS) * op_s)
