"""ZeRO 2/3 with the optimizer alone offloaded to the CPU: the parameter and gradient shards stay on the
GPU where they fit (runtime.optim.host_states), compiled plans checked against hand computations."""

from dataclasses import replace

import pytest

from zplan.api import compile_plan, prepare
from zplan.runtime.plan.check import runtime_gaps
from zplan.schemas import Pins

SMALL = "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000"
MEDIUM = "gpt:layers=24,hidden=2048,heads=16,seq=1024,vocab=50000"  # 1.3B parameters


def _with(req, **cluster_update):
    return replace(req, cluster=req.cluster.model_copy(update=cluster_update))


def test_zero3_with_the_optimizer_alone_on_the_cpu_is_legal_and_priced_by_hand():
    """--zero 3 --offload cpu on 8 A100s, fp32, 4 micro-batches a step, a measured CPU Adam rate of 2e9 parameters/s
    per node. By hand, with P parameters and this GPU's shard S = P / 8:
      GPU:   fp32 weight shard 4 S, fp32 gradient shard 4 S, no optimizer state;
      host:  the CPU Adam's fp32 master, m and v (12 S) and the gradient buffer (4 S), times 8 GPUs a node;
      PCIe:  gradient shard down and parameter shard up once a step, 4 S + 4 S (not per micro-batch), at
             32 GB/s x 0.8 each way;
      CPU:   S / (2e9 / 8) s."""
    req = prepare(SMALL, 8, "dgx-a100-80g", 32, None, "fp32", Pins(tp=1, pp=1, zero=3, offload="cpu", micro_batch=1))
    plan = compile_plan(_with(req, cpu_adam_params_per_s=2e9))
    placement, memory, shard = plan.placement, plan.prediction.memory, plan.model.params / 8
    assert (placement.parameters, placement.gradients, placement.optimizer) == ("gpu", "gpu", "cpu")
    assert plan.parallel.offload == "cpu" and plan.parallel.num_micro_batches == 4 and runtime_gaps(plan) == []
    assert memory.parameters == memory.gradients == pytest.approx(4 * shard) and memory.optimizer == 0.0
    assert memory.cpu_bytes_per_node == pytest.approx(8 * (12 + 4) * shard)
    assert placement.host_device_bytes_per_step == pytest.approx(8 * shard)
    assert placement.host_device_s == pytest.approx(2 * 4 * shard / (32e9 * 0.8))
    assert placement.cpu_optimizer_s == pytest.approx(shard / (2e9 / 8))
    assert plan.prediction.time.offload == pytest.approx(placement.host_device_s + placement.cpu_optimizer_s)


def test_the_search_offloads_the_optimizer_alone_when_the_gpu_holds_the_shards():
    """ZeRO-3 unpinned on 8 GPUs: with 5 GB each, the 1.3B model's 16 B x P / 8 = 2.6 GB of states and its
    activations do not fit, the weight and gradient shards (1.3 GB) do: the search takes CPU offload and the placement
    keeps the shards on the GPU. With 4 GB they do not fit either and go to the host with the optimizer (FSDP2's
    CPUOffloadPolicy), which costs parameter fetches every forward and backward: a slower step."""
    req = prepare(MEDIUM, 8, "dgx-a100-80g", 8, None, "bf16", Pins(tp=1, pp=1, zero=3, micro_batch=1, recompute="full"))
    plans = {gb: compile_plan(_with(req, gpu=req.cluster.gpu.model_copy(update={"hbm_bytes": gb * 1e9})))
             for gb in (80, 5, 4)}
    tiers = {gb: (p.parallel.offload, p.placement.parameters, p.placement.gradients, p.placement.optimizer)
             for gb, p in plans.items()}
    assert tiers == {80: ("none", "gpu", "gpu", "gpu"), 5: ("cpu", "gpu", "gpu", "cpu"),
                     4: ("cpu", "cpu", "cpu", "cpu")}
    assert plans[5].prediction.feasible and plans[5].prediction.memory.total <= 5e9
    assert plans[80].prediction.step_time_s < plans[5].prediction.step_time_s < plans[4].prediction.step_time_s
