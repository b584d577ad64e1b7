"""Model-state placement (GPU / CPU / NVMe) checked against brute force and hand computations."""

import itertools

import numpy as np
import pytest

from zplan.planner.placement import (
    _solve,
    enumerate_legal_placements,
    place_model_states,
    transfer_times,
)

GB = 1e9
BANDWIDTHS = dict(host_device_bytes_per_s=25 * GB, nvme_bytes_per_s=3 * GB, cpu_memory_bytes_per_s=40 * GB)
TIERS = ("gpu", "cpu", "nvme")


def legal_by_hand(params, grads, optimizer, zero_stage, offload, pinned=False):
    """The rules, written out independently of the module (DeepSpeed's ZeRO-Offload / ZeRO-Infinity, as zplan's
    runtime runs them: NVMe optimizer states with ZeRO 1, 2 and 3, parameters on NVMe with ZeRO 3 only; under
    ZeRO 2/3 the optimizer may leave alone, but parameters and gradients leave together and take it with them).
    `pinned`: the offload tier is the user's --offload pin, where the optimizer states must then live."""
    allowed = {"none": {"gpu"}, "cpu": {"gpu", "cpu"}, "nvme": {"gpu", "cpu", "nvme"}}[offload]
    if not {params, grads, optimizer} <= allowed:
        return False
    if pinned and optimizer != {"none": "gpu", "cpu": "cpu", "nvme": "nvme"}[offload]:
        return False
    if params != "gpu" and (zero_stage < 2 or (params == "nvme" and zero_stage < 3)):
        return False
    if grads != "gpu" and (zero_stage < 2 or grads == "nvme" or optimizer == "gpu"):
        return False
    if zero_stage >= 2 and (params == "gpu") != (grads == "gpu"):
        return False  # FSDP2's CPUOffloadPolicy takes the parameter and gradient shards off the GPU together
    if params != "gpu" and optimizer == "gpu":
        return False  # ... and the optimizer step with them
    return not (optimizer != "gpu" and zero_stage < 1)


def brute_force(sizes, capacity, zero_stage, offload, micro_batches, bandwidths=BANDWIDTHS, pinned=False,
                host_extra=0.0):
    """(least time, its tiers) over legal placements that fit, or (None, least total overflow). `host_extra`: host
    bytes the optimizer adds on the CPU beside parameters on the GPU."""
    best_time, best_tiers, least_overflow = np.inf, None, np.inf
    for tiers in itertools.product(TIERS, repeat=3):
        if not legal_by_hand(*tiers, zero_stage, offload, pinned):
            continue
        used = {t: sum(b for b, tier in zip(sizes, tiers, strict=True) if tier == t) for t in TIERS}
        used["cpu"] += host_extra if tiers[2] == "cpu" and tiers[0] == "gpu" else 0.0
        overflow = sum(max(0.0, used[t] - capacity[t]) for t in TIERS)
        least_overflow = min(least_overflow, overflow)
        if overflow == 0:
            time_s = transfer_times(*tiers, param_bytes=sizes[0], grad_bytes=sizes[1],
                                    optimizer_bytes=sizes[2], micro_batches_per_step=micro_batches,
                                    **bandwidths).total_s
            if time_s < best_time:
                best_time, best_tiers = time_s, tiers
    return (best_time, best_tiers) if best_tiers else (None, least_overflow)


def place(sizes, capacity, zero_stage, offload, micro_batches=1, bandwidths=BANDWIDTHS, pinned=False, fetches=None,
          host_extra=0.0):
    return place_model_states(
        param_bytes=sizes[0], grad_bytes=sizes[1], optimizer_bytes=sizes[2],
        gpu_free_bytes=capacity["gpu"], cpu_free_bytes=capacity["cpu"], nvme_free_bytes=capacity["nvme"],
        zero_stage=zero_stage, offload=offload, micro_batches_per_step=micro_batches, **bandwidths,
        offload_pinned=pinned, param_fetches_per_step=fetches, optimizer_host_extra_bytes=host_extra)


def test_cp_sat_agrees_with_brute_force_on_random_instances():
    rng = np.random.default_rng(0)
    pin_rng = np.random.default_rng(10)  # apart, so that the instances stay those of rng
    checked = infeasible = 0
    distinct_choices = set()
    for _ in range(150):
        params = rng.uniform(1, 10) * GB
        sizes = (params, params * rng.uniform(0.5, 2), params * rng.uniform(3, 8))
        capacity = {t: rng.uniform(0, 1.2) * sum(sizes) for t in TIERS}
        zero_stage, offload = int(rng.integers(0, 4)), str(rng.choice(["none", "cpu", "nvme"]))
        micro_batches = int(rng.integers(1, 5))
        # Bandwidths over two orders of magnitude, so that every term of the objective can decide.
        bandwidths = {name: 10 ** rng.uniform(9, 11) for name in BANDWIDTHS}
        pinned = bool(pin_rng.integers(0, 2)) and (zero_stage >= 1 or offload == "none")
        host_extra = float(pin_rng.choice([0.0, 0.5])) * sizes[2]  # the CPU Adam's master and gradient buffer
        expected_time, detail = brute_force(sizes, capacity, zero_stage, offload, micro_batches, bandwidths, pinned,
                                            host_extra)
        result = place(sizes, capacity, zero_stage, offload, micro_batches, bandwidths, pinned, host_extra=host_extra)
        tiers = (result.param_tier, result.grad_tier, result.optimizer_tier)
        assert legal_by_hand(*tiers, zero_stage, offload, pinned)
        assert result.optimal
        if expected_time is None:
            infeasible += 1
            assert not result.feasible
            # The overflow diagnostic works at 1e-6 of all state bytes.
            assert sum(result.overflow_bytes.values()) == pytest.approx(detail, rel=1e-6,
                                                                        abs=1e-5 * (sum(sizes) + host_extra))
        else:
            checked += 1
            distinct_choices.add(tiers)
            assert result.feasible
            assert result.total_transfer_s == pytest.approx(expected_time, rel=1e-6, abs=1e-12)
            assert result.gpu_bytes <= capacity["gpu"] and result.cpu_bytes <= capacity["cpu"]
            assert result.nvme_bytes <= capacity["nvme"]
    # all branches exercised: on the GPU, the optimizer alone off, ZeRO 2/3's three states off (CPU or NVMe optimizer)
    assert checked > 30 and infeasible > 10 and len(distinct_choices) >= 5


def test_cp_sat_agrees_with_brute_force_where_the_objective_decides():
    # A GPU that holds some of the states, CPU memory that may or may not take the rest, ample NVMe:
    # several placements fit and the transfer time decides between them.
    rng = np.random.default_rng(1)
    choices = set()
    for _ in range(300):
        params = rng.uniform(1, 10) * GB
        sizes = (params, params * rng.uniform(0.5, 2), params * rng.uniform(1, 8))
        capacity = {"gpu": rng.uniform(0.2, 1) * sum(sizes), "cpu": rng.uniform(0.1, 1.5) * sum(sizes),
                    "nvme": 1e15}
        zero_stage, micro_batches = int(rng.choice([1, 2, 3, 3, 3])), int(rng.integers(1, 9))
        bandwidths = {name: 10 ** rng.uniform(9, 11) for name in BANDWIDTHS}
        expected_time, expected_tiers = brute_force(sizes, capacity, zero_stage, "nvme", micro_batches,
                                                    bandwidths)
        if expected_time is None:
            continue
        result = place(sizes, capacity, zero_stage, "nvme", micro_batches, bandwidths)
        assert result.total_transfer_s == pytest.approx(expected_time, rel=1e-6)
        choices.add(expected_tiers)
    assert len(choices) >= 6  # every legal kind of placement but the all-GPU one


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_cp_sat_objective_prices_every_placement_like_transfer_times(micro_batches):
    # Force each legal placement in turn (one allowed tier per state): the CP-SAT objective's seconds
    # must equal the float model's, term by term, or the solver optimises something else.
    rng = np.random.default_rng(micro_batches)
    sizes = {"params": 3 * GB, "grads": 5 * GB, "optimizer": 17 * GB}
    bandwidths = {name: 10 ** rng.uniform(9, 11) for name in BANDWIDTHS}
    plenty = {t: 1e15 for t in TIERS}
    # the rank's update share of replicated states (e.g. 1/dp of them) differs from their size
    updates = {"param_update_bytes": 1.5 * GB, "grad_update_bytes": 2 * GB}
    legal = [(zero, tiers) for zero in (1, 3) for tiers in enumerate_legal_placements(zero, "nvme")]
    for _, tiers in legal:
        found, proven, model_time_s = _solve(sizes, updates, plenty, [tiers], bandwidths, micro_batches, 5.0,
                                             allow_overflow=False)
        assert found == tiers and proven
        expected = transfer_times(tiers["params"], tiers["grads"], tiers["optimizer"],
                                  param_bytes=3 * GB, grad_bytes=5 * GB, optimizer_bytes=17 * GB,
                                  micro_batches_per_step=micro_batches, **bandwidths, **updates)
        assert model_time_s == pytest.approx(expected.total_s, rel=1e-6, abs=1e-9)


def test_zero3_offload_moves_the_three_states_together_when_the_gpu_cannot_hold_parameters_and_gradients():
    # ZeRO-3, 4 micro-batches, the optimizer (12 GB) cannot stay on the GPU, nor can parameters + gradients (5 GB):
    # under FSDP2's CPUOffloadPolicy the parameter and gradient shards go to the host with it, although the GPU
    # would hold either alone. Traffic: 8 fetches of 1 GB of parameters (forward and backward of each micro-batch)
    # + 4 x 4 GB of gradients = 24 GB.
    result = place((1 * GB, 4 * GB, 12 * GB), {"gpu": 4.5 * GB, "cpu": 100 * GB, "nvme": 0.0}, 3, "cpu",
                   micro_batches=4)
    assert (result.param_tier, result.grad_tier, result.optimizer_tier) == ("cpu", "cpu", "cpu")
    assert result.transfer.host_device_bytes == 24 * GB
    # ZeRO-2 keeps the parameters gathered through the step: one fetch (planner.placement_choice passes it)
    zero2 = place((1 * GB, 4 * GB, 12 * GB), {"gpu": 4.5 * GB, "cpu": 100 * GB, "nvme": 0.0}, 2, "cpu",
                  micro_batches=4, fetches=1)
    assert (zero2.param_tier, zero2.grad_tier, zero2.optimizer_tier) == ("cpu", "cpu", "cpu")
    assert zero2.transfer.host_device_bytes == 17 * GB


def test_everything_fits_on_the_gpu_means_no_transfers():
    result = place((2 * GB, 2 * GB, 12 * GB), {"gpu": 80 * GB, "cpu": 1e12, "nvme": 1e13}, 3, "nvme")
    assert (result.param_tier, result.grad_tier, result.optimizer_tier) == ("gpu", "gpu", "gpu")
    assert result.total_transfer_s == 0.0 and result.feasible


def test_zero_offload_traffic_by_hand():
    # ZeRO-Offload (Ren et al. 2021) with ZeRO-1: 1B parameters on one GPU, the optimizer on the CPU.
    # Per step: 2 GB of fp16 gradients down, 2 GB of fp16 parameters up over PCIe; CPU Adam reads and
    # writes 12 GB of fp32 states, reads 2 GB of gradients and writes 2 GB of parameters.
    result = place((2 * GB, 2 * GB, 12 * GB), {"gpu": 4 * GB, "cpu": 100 * GB, "nvme": 0.0}, 1, "cpu")
    assert (result.param_tier, result.grad_tier, result.optimizer_tier) == ("gpu", "gpu", "cpu")
    assert result.transfer.host_device_bytes == 4 * GB
    assert result.transfer.host_device_s == pytest.approx(4 / 25)
    assert result.transfer.cpu_optimizer_s == pytest.approx(28 / 40)
    assert result.transfer.nvme_s == 0.0
    assert (result.gpu_bytes, result.cpu_bytes) == (4 * GB, 12 * GB)


def test_zero_infinity_nvme_traffic_by_hand():
    # Everything on NVMe, 2 micro-batches: parameters read 4 times (2 forward + 2 backward) and written
    # once; optimizer states read and written; PCIe carries the 4 fetches and the gradients twice.
    tiny_gpu = {"gpu": 0.0, "cpu": 1.5 * GB, "nvme": 1e13}  # room on the CPU for the gradients only
    result = place((1 * GB, 1 * GB, 6 * GB), tiny_gpu, 3, "nvme", micro_batches=2)
    assert (result.param_tier, result.grad_tier, result.optimizer_tier) == ("nvme", "cpu", "nvme")
    assert result.transfer.nvme_bytes == (4 + 1) * GB + 2 * 6 * GB
    assert result.transfer.host_device_bytes == 4 * GB + 2 * GB


def test_capacity_forces_offload_of_the_optimizer_first():
    sizes = (2 * GB, 2 * GB, 12 * GB)
    result = place(sizes, {"gpu": 10 * GB, "cpu": 100 * GB, "nvme": 0.0}, 1, "cpu")
    assert result.feasible and result.optimizer_tier == "cpu" and result.param_tier == "gpu"
    assert result.gpu_bytes <= 10 * GB
    # Without CPU room the optimizer goes to NVMe: ZeRO-Infinity's swapper, which zplan's runtime runs with
    # ZeRO 1 (NvmeStates with RowShards) and ZeRO 2/3 (NvmeStates with WholeShards, over FSDP2's shards where they are:
    # here on the GPU, which holds them); ZeRO 0 has no shard.
    for zero_stage in (1, 2, 3):
        nvme = place(sizes, {"gpu": 10 * GB, "cpu": 1 * GB, "nvme": 1e13}, zero_stage, "nvme")
        assert nvme.feasible and (nvme.param_tier, nvme.grad_tier, nvme.optimizer_tier) == ("gpu", "gpu", "nvme")
    for zero_stage in (2, 3):  # a GPU that cannot hold the shards: they go to the host (CPUOffloadPolicy)
        nvme = place(sizes, {"gpu": 3 * GB, "cpu": 4 * GB, "nvme": 1e13}, zero_stage, "nvme")
        assert nvme.feasible and nvme.optimizer_tier == "nvme" and "gpu" not in (nvme.param_tier, nvme.grad_tier)
    assert not place(sizes, {"gpu": 10 * GB, "cpu": 1 * GB, "nvme": 1e13}, 0, "nvme").feasible


def test_offload_none_never_leaves_the_gpu():
    sizes = (2 * GB, 2 * GB, 12 * GB)
    for zero_stage in range(4):
        result = place(sizes, {"gpu": 1 * GB, "cpu": 1e12, "nvme": 1e13}, zero_stage, "none")
        assert (result.param_tier, result.grad_tier, result.optimizer_tier) == ("gpu", "gpu", "gpu")
        assert not result.feasible
        assert result.overflow_bytes["gpu"] == pytest.approx(15 * GB)


def test_below_zero_2_parameters_stay_on_the_gpu():
    sizes = (2 * GB, 2 * GB, 12 * GB)
    for zero_stage in range(3):
        for gpu_free in (0.0, 3 * GB, 5 * GB, 16 * GB):
            result = place(sizes, {"gpu": gpu_free, "cpu": 1e12, "nvme": 1e13}, zero_stage, "nvme")
            # What must stay on the GPU: everything (ZeRO-0), params + grads (ZeRO-1), nothing (ZeRO-2: FSDP2
            # offloads the parameter shards, never to NVMe, when the GPU cannot hold them with the gradients).
            assert result.feasible == (gpu_free >= {0: 16, 1: 4, 2: 0}[zero_stage] * GB)
            assert result.param_tier == ("gpu" if zero_stage < 2 or gpu_free >= 4 * GB else "cpu")
            if zero_stage < 2:
                assert result.grad_tier == "gpu"
            if zero_stage == 0:
                assert result.optimizer_tier == "gpu"


def test_enumerated_legal_placements_match_the_rules():
    for zero_stage, offload, pinned in itertools.product(range(4), ("none", "cpu", "nvme"), (False, True)):
        by_hand = {t for t in itertools.product(TIERS, repeat=3)
                   if legal_by_hand(*t, zero_stage, offload, pinned)}
        listed = {(p["params"], p["grads"], p["optimizer"])
                  for p in enumerate_legal_placements(zero_stage, offload, pinned)}
        assert listed == by_hand


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_an_offload_pin_puts_the_optimizer_on_its_tier_even_when_it_fits_on_the_gpu(zero_stage, offload):
    """--offload is a requirement for the optimizer. Parameters and gradients stay on the GPU where they fit,
    under ZeRO 2/3 too (the optimizer alone offloaded); under ZeRO 2/3 they leave with it when they do not fit
    (FSDP2's CPUOffloadPolicy keeps their shards on the host)."""
    sizes, plenty = (2 * GB, 2 * GB, 12 * GB), {"gpu": 80 * GB, "cpu": 1e12, "nvme": 1e13}
    allowed = place(sizes, plenty, zero_stage, offload)
    assert (allowed.param_tier, allowed.grad_tier, allowed.optimizer_tier) == ("gpu", "gpu", "gpu")
    pinned = place(sizes, plenty, zero_stage, offload, pinned=True)
    assert (pinned.param_tier, pinned.grad_tier, pinned.optimizer_tier) == ("gpu", "gpu", offload)
    assert pinned.feasible and pinned.total_transfer_s > 0
    tight = place(sizes, {"gpu": 3 * GB, "cpu": 1e12, "nvme": 1e13}, zero_stage, offload, pinned=True)
    assert tight.optimizer_tier == offload and tight.feasible == (zero_stage >= 2)
    if zero_stage >= 2:
        assert (tight.param_tier, tight.grad_tier) == ("cpu", "cpu")


def test_an_offload_pin_none_keeps_everything_on_the_gpu_and_a_pin_needs_zero_1():
    sizes = (2 * GB, 2 * GB, 12 * GB)
    result = place(sizes, {"gpu": 1 * GB, "cpu": 1e12, "nvme": 1e13}, 3, "none", pinned=True)
    assert (result.param_tier, result.grad_tier, result.optimizer_tier) == ("gpu", "gpu", "gpu")
    assert not result.feasible
    with pytest.raises(ValueError, match="needs ZeRO >= 1"):
        place(sizes, {"gpu": 80 * GB, "cpu": 1e12, "nvme": 1e13}, 0, "nvme", pinned=True)


def test_an_nvme_pin_fails_over_capacity_rather_than_moving_the_optimizer():
    # no NVMe room: the pinned tier overflows (feasible False) instead of the optimizer going to the CPU
    result = place((2 * GB, 2 * GB, 12 * GB), {"gpu": 80 * GB, "cpu": 1e12, "nvme": 1 * GB}, 1, "nvme", pinned=True)
    assert result.optimizer_tier == "nvme" and not result.feasible
    assert result.overflow_bytes["nvme"] == pytest.approx(11 * GB)


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        place((1.0, 1.0, 1.0), {"gpu": 1.0, "cpu": 1.0, "nvme": 1.0}, 4, "cpu")
    with pytest.raises(ValueError):
        place((1.0, 1.0, 1.0), {"gpu": 1.0, "cpu": 1.0, "nvme": 1.0}, 2, "disk")


def test_zero3_optimizer_alone_on_the_cpu_by_hand():
    # ZeRO-3, 4 micro-batches, fp32 shards: parameters 1 GB, gradients 1 GB, Adam's moments 2 GB; the GPU holds the
    # shards (3 GB free) but not the moments. The optimizer leaves alone (runtime.optim.host_states): per
    # step the gradient shard goes down once and the updated parameter shard up once (not per micro-batch):
    # 2 GB over PCIe; on the host the moments (2 GB) and the CPU Adam's fp32 master and gradient buffer (1 GB + 1 GB).
    sizes, capacity = (1 * GB, 1 * GB, 2 * GB), {"gpu": 3 * GB, "cpu": 100 * GB, "nvme": 0.0}
    result = place(sizes, capacity, 3, "cpu", micro_batches=4, host_extra=2 * GB)
    assert (result.param_tier, result.grad_tier, result.optimizer_tier) == ("gpu", "gpu", "cpu") and result.feasible
    assert result.transfer.host_device_bytes == 2 * GB
    assert result.transfer.host_device_s == pytest.approx(2 / 25)
    # CPU Adam at memory bandwidth: 2 x 2 GB of moments + 1 GB gradients + 1 GB parameters over 40 GB/s
    assert result.transfer.cpu_optimizer_s == pytest.approx(6 / 40)
    assert (result.gpu_bytes, result.cpu_bytes) == (2 * GB, 4 * GB)
    # the extra host bytes count only beside device parameters: with more of them (3 GB) than a 4 GB host holds
    # beside the moments, the shards go to the host with the optimizer (CPUOffloadPolicy needs no master)
    heavy = place(sizes, {"gpu": 3 * GB, "cpu": 4 * GB, "nvme": 0.0}, 3, "cpu", micro_batches=4, host_extra=3 * GB)
    assert (heavy.param_tier, heavy.grad_tier, heavy.optimizer_tier) == ("cpu", "cpu", "cpu") and heavy.feasible
    assert heavy.cpu_bytes == 4 * GB and heavy.transfer.host_device_bytes == (8 * 1 + 4 * 1) * GB
