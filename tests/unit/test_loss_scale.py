"""fp16 loss scaling under pipeline parallelism (runtime.precision.loss_scale) against GradScaler's policy, by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zplan.runtime.precision.loss_scale import LossScaler


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:  # a later test in this process (a dry run's fake world) needs it gone
        dist.destroy_process_group()


def _optimizer(grad: torch.Tensor) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = grad.clone()
    return param, torch.optim.SGD([param], lr=1.0)


def test_gradients_are_unscaled_and_the_step_taken():
    scaler = LossScaler(torch.device("cpu"), init_scale=8.0, growth_interval=2)
    param, optimizer = _optimizer(torch.tensor([8.0, 16.0, -8.0]))  # the gradient of 8 x the loss
    scaler.unscale_(optimizer)
    assert torch.equal(param.grad, torch.tensor([1.0, 2.0, -1.0])) and not scaler.found_overflow
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.detach(), torch.tensor([0.0, -1.0, 2.0]))  # 1 - lr * grad
    assert scaler.factor == 8.0
    scaler.unscale_(optimizer)  # a second step without overflow: growth_interval 2 reached, the scale doubles
    scaler.update()
    assert scaler.factor == 16.0 and scaler.steps_since_overflow == 0


def test_an_overflow_skips_the_step_and_halves_the_scale():
    scaler = LossScaler(torch.device("cpu"), init_scale=8.0)
    param, optimizer = _optimizer(torch.tensor([1.0, float("inf"), 0.0]))
    scaler.unscale_(optimizer)
    assert scaler.found_overflow
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.detach(), torch.ones(3))  # not stepped
    assert scaler.factor == 4.0
    state = scaler.state_dict()
    restored = LossScaler(torch.device("cpu"))
    restored.load_state_dict(state)
    assert restored.state_dict() == {"scale": 4.0, "steps_since_overflow": 0}
