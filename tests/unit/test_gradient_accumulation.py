"""Gradient accumulation over micro-batches holds one copy of the gradients under DDP (ZeRO 0/1 at tp 1): they are
views of DDP's bucket from the build on (one storage, rebuilt at most once after the first step), the micro-batches
under no_sync accumulate into it, and train_loop.clear_gradients keeps them there between steps
(planner.cost.memory prices one copy). Checked in one gloo process against the same model without DDP."""

import os
import subprocess
import sys
import textwrap

from tests.distributed.harness import free_port

WORKER = textwrap.dedent("""
    import copy, os
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from zplan.runtime.parallel.data_parallel import apply_data_parallel
    from zplan.runtime.training.step import grad_sync, clear_gradients

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    ddp = apply_data_parallel(model, init_device_mesh("cpu", (1,)), 0, "fp32", "none", "blocks")
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    numel = sum(p.numel() for p in model.parameters())

    def in_one_bucket():  # the tiny model fits one bucket; DDP may rebuild it (in a new storage) after step 1
        storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters()}
        return list(storages.values()) == [4 * numel]

    assert in_one_bucket(), "every gradient is a view of the one bucket from the build on"
    for step in range(2):
        batches = [torch.randn(3, 8) for _ in range(3)]
        for index, batch in enumerate(batches):
            with grad_sync(ddp, last_micro_batch=index == len(batches) - 1):
                ddp(batch).square().mean().backward()
            reference(batch).square().mean().backward()
            assert in_one_bucket(), (step, index)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), "the accumulated gradients are the sums"
        optimizer.step()
        reference_optimizer.step()
        clear_gradients(ddp, optimizer)
        reference_optimizer.zero_grad()
        assert in_one_bucket()
        assert all(not p.grad.any() for p in model.parameters())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    dist.destroy_process_group()
    print("ok")
""")


def test_ddp_accumulates_micro_batches_into_its_bucket():
    done = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PORT": str(free_port())})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]
