"""ShardedAdamW with host states over whole shards (runtime.optim.host_states: the optimizer alone on the host under
ZeRO 2/3) on plain tensors (one process; FSDP2's shards under torchrun:
tests/distributed/test_data_parallel.py, test_plan_applied.py, test_checkpoint.py) against torch.optim.AdamW."""

import torch

from zplan.runtime.optim.host_states import HostStates
from zplan.runtime.optim.layouts import WholeShards
from zplan.runtime.optim.sharded_adamw import ShardedAdamW

SHAPES = [(13, 7), (5,), (0, 3), (2, 3, 4)]  # an empty shard too: a rank may hold none of a parameter


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _step(optimizer, params, step):
    for p, g in zip(params, _grads(step), strict=True):
        p.grad = g.clone()
    optimizer.step()


def _host_adamw(groups, lr):
    return ShardedAdamW(groups, WholeShards(), HostStates(), lr=lr)


def _groups(params):
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


def test_steps_like_torch_adamw_with_the_states_on_the_host():
    mine, reference = _params(0), _params(0)
    optimizer = _host_adamw(_groups(mine), lr=1e-2)
    torch_adamw = torch.optim.AdamW(_groups(reference), lr=1e-2)
    for step in range(4):
        _step(optimizer, mine, step)
        _step(torch_adamw, reference, step)
    for p, q in zip(mine, reference, strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(optimizer.state[p][key], torch_adamw.state[q][key], rtol=0, atol=1e-6)
        assert optimizer.state[p]["step"].item() == 4.0
    host = [*optimizer.host_buffers(), *(optimizer.state[p][k] for p in mine for k in ("exp_avg", "exp_avg_sq"))]
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in host)
    assert len(optimizer.host_buffers()) == len(SHAPES)  # the masters; no gradient buffers without a GPU


def test_a_state_dict_resumes_and_a_written_parameter_is_read_back():
    first, reference = _params(1), _params(1)
    optimizer = _host_adamw(_groups(first), lr=1e-2)
    torch_adamw = torch.optim.AdamW(_groups(reference), lr=1e-2)
    for step in range(2):
        _step(optimizer, first, step)
        _step(torch_adamw, reference, step)
    # a fresh optimizer over fresh parameters that are then loaded (as a checkpoint does: weights, then states)
    resumed = _params(2)
    again = _host_adamw(_groups(resumed), lr=1e-2)
    _step(again, resumed, 50)  # its masters hold these weights now
    with torch.no_grad():
        for p, q in zip(resumed, first, strict=True):
            p.copy_(q)
    again.load_state_dict(optimizer.state_dict())
    for step in range(2, 4):
        _step(again, resumed, step)
        _step(torch_adamw, reference, step)
    for p, q in zip(resumed, reference, strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)  # stale masters would carry the overwritten weights
