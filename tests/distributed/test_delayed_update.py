"""ZeRO-Offload's one-step delayed parameter update (runtime.optim.host_states, delayed_update=True) on
2 processes (gloo): the tiny GPT of test_data_parallel trained under DDP with ZeRO-1 CPU offload, exact and
delayed, against each other and against a one-process emulation of the delay with torch's AdamW.

One launch trains both runs and runs the small checks (state_dict flushes, load_state_dict drops the pending
update, a failing background update raises at the next step); the tests read its records. Measured: final loss
3.750 delayed against 3.697 exact (+1.4%; from 4.163 at the start), both runs within 9e-6 of their emulation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import GRAD_CLIP, WEIGHT_DECAY, Ranks, import_file, max_weight_diff
from tests.distributed.test_data_parallel import SEQ_LEN, TINY_GPT, VOCAB
from zplan.runtime.training.data import synthetic_token_batch
from zplan.runtime.training.loop import WarmupCosine

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 60
DELAY_AFTER = 10  # exact warm-up steps: losses 0..DELAY_AFTER are the exact run's, later ones lag one update
SEED = 5
LR = 1e-3  # peak; at 3e-3 the loss falls faster and the delay costs more: +3.3% at 40 steps, +9.6% at 60
PER_RANK = 4  # sequences per rank and step
GLOBAL_BATCH = WORLD * PER_RANK


def _schedule() -> WarmupCosine:
    return WarmupCosine(max_lr=LR, warmup_steps=max(1, STEPS // 10), total_steps=STEPS)


def _groups(model: torch.nn.Module) -> list[dict]:
    from zplan.runtime.optim.build import adamw_param_groups

    return adamw_param_groups(model, WEIGHT_DECAY)


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)  # (B, T, V)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the ranks ---------------------------------------------------------------------------------------------


def _train(build_model, mesh, *, delayed: bool) -> tuple[list[float], dict, dict]:
    """STEPS steps under DDP with ZeRO-1's host-state AdamW; (rank-averaged losses, weights before the final
    flush(), weights after it)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from zplan.runtime.optim.host_states import HostStates
    from zplan.runtime.optim.layouts import RowShards
    from zplan.runtime.optim.sharded_adamw import ShardedAdamW

    rank = dist.get_rank()
    torch.manual_seed(SEED)
    model = build_model()
    ddp = DistributedDataParallel(model)
    optimizer = ShardedAdamW(_groups(model), RowShards(mesh), HostStates(delayed_update=delayed,
                                                                         delay_after_steps=DELAY_AFTER), lr=LR)
    schedule, losses = _schedule(), []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = schedule(step)
        tokens = synthetic_token_batch(VOCAB, SEQ_LEN, GLOBAL_BATCH, SEED, step)[rank * PER_RANK:(rank + 1) * PER_RANK]
        loss = _loss(ddp, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    before = _weights(model)
    optimizer.flush()
    return losses, before, _weights(model)


def _small_checks(mesh) -> dict:
    """On two plain parameters: state_dict() flushes, load_state_dict() drops the pending update, and an error
    of the background update is raised by the next step()."""
    import copy

    from zplan.cuda import cpu_adam
    from zplan.runtime.optim.host_states import HostStates
    from zplan.runtime.optim.layouts import RowShards
    from zplan.runtime.optim.sharded_adamw import ShardedAdamW

    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4, generator=generator)),
              torch.nn.Parameter(torch.randn(5, generator=generator))]
    optimizer = ShardedAdamW(params, RowShards(mesh), HostStates(delayed_update=True, delay_after_steps=1), lr=1e-2)

    def step(seed: int) -> None:
        grads = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads)
        optimizer.step()

    def snapshot() -> list[torch.Tensor]:
        return [p.detach().clone() for p in params]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    record = {}
    step(1)  # exact (warm-up)
    after_first = snapshot()
    step(2)  # delayed: update 2 pending
    record["delayed_step_left_weights"] = same(snapshot(), after_first)
    saved = copy.deepcopy(optimizer.state_dict())  # flushes
    record["state_dict_published"] = not same(snapshot(), after_first)
    record["saved_steps"] = sorted({float(s["step"]) for s in saved["state"].values()})

    step(3)  # update 3 pending
    before_load = snapshot()
    optimizer.load_state_dict(saved)
    optimizer.flush()  # nothing pending any more: publishes nothing
    record["load_dropped_pending"] = same(snapshot(), before_load)

    original = cpu_adam.adamw_step_

    def failing(*args, **kwargs):
        raise ValueError("injected kernel failure")

    cpu_adam.adamw_step_ = failing
    try:
        step(4)  # starts the failing update in the background
        record["step_with_failing_update_returned"] = True
        try:
            step(5)
            record["next_step_raised"] = None
        except RuntimeError as exc:
            record["next_step_raised"] = str(exc)
            record["cause"] = repr(exc.__cause__)
    finally:
        cpu_adam.adamw_step_ = original
    optimizer.flush()  # the failed update is gone: nothing to raise again
    return record


def _worker(model_path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    build_model = import_file(Path(model_path), "tiny_gpt_delayed").build_model
    record, weights = {}, {}
    for mode in ("exact", "delayed"):
        losses, before, after = _train(build_model, mesh, delayed=mode == "delayed")
        record[mode] = losses
        weights[mode] = {"before_flush": before, "final": after}
    torch.save(weights, Path(out_dir) / f"weights_rank{rank}.pt")
    record["small"] = _small_checks(mesh)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, record)
    if rank == 0:
        print("RESULT " + json.dumps(every), flush=True)
    dist.destroy_process_group()


# ---- the one-process emulation ---------------------------------------------------------------------------------


def train_delayed_reference(build_model, delay_after: int) -> tuple[list[float], dict, dict]:
    """What a run must equal: one process, the whole global batch, torch's AdamW (fused); after `delay_after`
    exact steps the gradient of step i is applied (at step i's learning rate) only after the gradient of step
    i+1 was computed (delay_after >= STEPS: the exact run). (losses, weights before the last update, after)."""
    torch.manual_seed(SEED)
    model = build_model()
    optimizer = torch.optim.AdamW(_groups(model), lr=LR, fused=True)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    schedule, losses = _schedule(), []
    pending: tuple[list[torch.Tensor], float] | None = None  # (gradients, lr) of the update not applied yet

    def apply(grads: list[torch.Tensor], lr: float) -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad()

    for step in range(STEPS):
        loss = _loss(model, synthetic_token_batch(VOCAB, SEQ_LEN, GLOBAL_BATCH, SEED, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        losses.append(loss.item())
        grads = [p.grad.clone() for p in params]
        optimizer.zero_grad()
        if step < delay_after:
            apply(grads, schedule(step))
            continue
        if pending is not None:
            apply(*pending)
        pending = (grads, schedule(step))
    before = _weights(model)
    if pending is not None:
        apply(*pending)
    return losses, before, _weights(model)


# ---- the tests --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(every rank's record, every rank's weights, {mode: the emulation's (losses, before, after)})."""
    tmp = tmp_path_factory.mktemp("delayed")
    model_path = tmp / "tiny_gpt.py"
    model_path.write_text(TINY_GPT)
    output = Ranks([__file__, "worker", str(model_path), str(tmp)], WORLD, tmp / "logs").wait_ok()
    records = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    weights = [torch.load(tmp / f"weights_rank{rank}.pt") for rank in range(WORLD)]
    build_model = import_file(model_path, "tiny_gpt_emulation").build_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks; and 2 threads on a busy 2-core machine take ~15x longer here
    try:
        emulation = {mode: train_delayed_reference(build_model, delay) for mode, delay in (("exact", STEPS),
                                                                                          ("delayed", DELAY_AFTER))}
    finally:
        torch.set_num_threads(threads)
    return records, weights, emulation


def test_warmup_steps_equal_the_exact_run_then_the_weights_lag(runs):
    records, weights, _ = runs
    exact, delayed = records[0]["exact"], records[0]["delayed"]
    warm = max(abs(a - b) for a, b in zip(exact[:DELAY_AFTER + 1], delayed[:DELAY_AFTER + 1], strict=True))
    after = max(abs(a - b) for a, b in zip(exact[DELAY_AFTER + 1:], delayed[DELAY_AFTER + 1:], strict=True))
    weight_diff = max_weight_diff(weights[0]["delayed"]["final"], weights[0]["exact"]["final"])
    print(f"max |loss delayed - exact|: warm-up {warm:.2e}, after {after:.2e}; final weights {weight_diff:.2e}")
    assert warm <= 1e-6
    # the delay is real: from the first step on weights one update behind, losses and weights move apart
    assert abs(exact[DELAY_AFTER + 1] - delayed[DELAY_AFTER + 1]) > 1e-5
    assert after > 1e-4 and weight_diff > 1e-3


def test_final_loss_within_two_percent_of_the_exact_run(runs):
    records, _, _ = runs
    exact, delayed = records[0]["exact"], records[0]["delayed"]
    print(f"losses: first {exact[0]:.4f}; final exact {exact[-1]:.4f}, delayed {delayed[-1]:.4f} "
          f"({(delayed[-1] / exact[-1] - 1) * 100:+.2f}%)")
    assert delayed[-1] < 0.95 * delayed[0]  # it trains
    assert abs(delayed[-1] - exact[-1]) <= 0.02 * exact[-1]


@pytest.mark.parametrize("mode", ["exact", "delayed"])
def test_run_equals_the_one_process_emulation(runs, mode):
    records, weights, emulation = runs
    losses, before, after = emulation[mode]
    loss_diff = max(abs(a - b) for a, b in zip(records[0][mode], losses, strict=True))
    before_diff = max_weight_diff(weights[0][mode]["before_flush"], before)
    after_diff = max_weight_diff(weights[0][mode]["final"], after)
    print(f"{mode} vs emulation: losses {loss_diff:.2e}, weights before flush {before_diff:.2e}, "
          f"after {after_diff:.2e}")
    # DDP's average of two half-batch gradients rounds unlike the whole batch: over 60 steps the exact run drifts
    # ~1e-5 from one process (8.9e-6 measured), the delayed one as much (8.2e-6); the delay itself moves the
    # weights ~1e-2 (test above), so a wrong delay (none, two steps, a lost update) cannot pass
    assert loss_diff <= 1e-5 and before_diff <= 5e-5 and after_diff <= 5e-5


def test_flush_publishes_the_last_update_on_every_rank(runs):
    _, weights, _ = runs
    for rank_weights in weights:
        assert max_weight_diff(rank_weights["delayed"]["before_flush"], rank_weights["delayed"]["final"]) > 1e-5
        assert max_weight_diff(rank_weights["exact"]["before_flush"], rank_weights["exact"]["final"]) == 0.0
        for mode in ("exact", "delayed"):  # every rank holds the same model after the flush
            assert max_weight_diff(rank_weights[mode]["final"], weights[0][mode]["final"]) == 0.0


def test_state_dict_flushes_and_load_state_dict_drops_the_pending_update(runs):
    records, _, _ = runs
    for record in records:
        small = record["small"]
        assert small["delayed_step_left_weights"] and small["state_dict_published"], small
        assert small["saved_steps"] == [2.0], small
        assert small["load_dropped_pending"], small


def test_background_error_surfaces_at_the_next_step(runs):
    records, _, _ = runs
    for record in records:
        small = record["small"]
        assert small["step_with_failing_update_returned"], small
        assert small["next_step_raised"] and "step 3" in small["next_step_raised"], small  # the loaded state counts 2
        assert "injected kernel failure" in small["next_step_raised"] and "ValueError" in small["cause"], small


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2], sys.argv[3])
