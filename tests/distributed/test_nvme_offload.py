"""ZeRO-Infinity's optimizer offload under a memory cap: the moments live in files, not in host memory.

Two gloo ranks step the same parameters with the same gradients through ZeRO-1 ShardedAdamW with NvmeStates (moments on
"NVMe", a temporary folder) and through the in-memory DeviceStates. The NVMe optimizer may keep at most
CAP_BYTES of moments in memory (sub-groups of CAP_BYTES / 3: three in flight), far less than its rank's
moments, so each step swaps ~20 sub-groups through, with parameters split across sub-groups.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Ranks  # noqa: E402
from test_data_parallel import _print_records_and_close  # noqa: E402

SHAPES = [(1024, 1024), (1024,), (2048, 1024), (7, 3)]  # 3.15M parameters: 12.6 MB of moments per rank of 2
CAP_BYTES = 2 * 2**20  # the moments a rank may hold in memory
STEPS = 3


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run_workers(mode: str, tmp_path: Path) -> list[dict]:
    """This file's `mode` worker on 2 ranks, swapping under tmp_path/nvme; every rank's record."""
    output = Ranks([__file__, mode, str(tmp_path / "nvme")], 2, tmp_path / "logs").wait_ok()
    records = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    print(records)
    return records


def _worker(swap_folder: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from zplan.runtime.optim.device_states import DeviceStates
    from zplan.runtime.optim.layouts import RowShards
    from zplan.runtime.optim.nvme_states import NvmeStates
    from zplan.runtime.optim.sharded_adamw import ShardedAdamW

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(STEPS)]

    def train(make_optimizer) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, int]:
        """STEPS steps from `start`; the growth of resident memory from before the optimizer to after."""
        params = [torch.nn.Parameter(t.clone()) for t in start]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        before = _resident_bytes()
        optimizer = make_optimizer(groups)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g  # the same tensors in both runs: no allocation counted
            optimizer.step()
        return params, optimizer, _resident_bytes() - before

    # warm-up, not counted: the CPU Adam extension loaded, the swap engine's threads started, one all-gather
    warm = [torch.nn.Parameter(torch.zeros(4, 4))]
    warm[0].grad = torch.zeros(4, 4)
    warm_optimizer = ShardedAdamW(warm, RowShards(mesh), NvmeStates(swap_folder + "-warm-up"))
    warm_optimizer.step()
    warm_optimizer.close()
    memory_params, memory, memory_growth = train(lambda groups: ShardedAdamW(groups, RowShards(mesh), DeviceStates(),
                                                                             lr=1e-2))
    nvme_params, nvme, nvme_growth = train(lambda groups: ShardedAdamW(
        groups, RowShards(mesh), NvmeStates(swap_folder, sub_group_bytes=CAP_BYTES // 3), lr=1e-2))
    files = list(nvme.states.swap.run_folder.glob("*.swp"))  # this rank's files
    record = {
        "state_bytes": nvme.moments.state_bytes,
        "resident_bytes": nvme.moments.resident_bytes,
        "sub_groups": len(nvme.moments.sub_groups),
        "split_params": sum(len({p.segment for p in g}) > 1 for g in nvme.moments.sub_groups),
        "file_bytes": nvme.moments.file_bytes(),
        "bytes_in_folder": sum(f.stat().st_size for f in files),
        "nvme_growth": nvme_growth,
        "memory_growth": memory_growth,
        "direct_io": nvme.states.swap.direct_io,
    }
    nvme_state = nvme.state_dict()["state"]
    memory_state = memory.state_dict()["state"]
    record.update({
        "max_param_diff": max((p - q).abs().max().item() for p, q in zip(nvme_params, memory_params, strict=True)),
        "max_state_diff": max((nvme_state[i][k].to_local() - memory_state[i][k].to_local()).abs().max().item()
                              for i in memory_state for k in ("exp_avg", "exp_avg_sq")),
        "steps": sorted({s["step"].item() for s in nvme_state.values()}),
        "moment_bytes_after_state_dict": sum(v.numel() for s in nvme.state.values() for k, v in s.items()
                                             if k != "step"),
    })
    nvme.close()
    record["run_folder_exists"] = nvme.states.swap.run_folder.exists()
    _print_records_and_close(record)


def test_optimizer_states_over_a_memory_cap_live_in_files(tmp_path):
    records = _run_workers("worker", tmp_path)
    for r in records:
        assert r["state_bytes"] > 5 * CAP_BYTES and r["resident_bytes"] <= CAP_BYTES, r
        assert r["sub_groups"] >= 15 and r["split_params"] >= 1, r  # parameters cut across sub-groups
        # every moment byte is in a file, and the folder holds them (plus one 4 KiB header per file)
        assert r["file_bytes"] == r["state_bytes"] <= r["bytes_in_folder"], r
        # resident memory: the in-memory optimizer grows by its moments, the NVMe one by far less
        assert r["memory_growth"] >= 0.8 * r["state_bytes"], r
        assert r["nvme_growth"] <= 0.4 * r["state_bytes"], r
        # the same arithmetic (a SIMD kernel against torch's fused one): equal up to rounding
        assert r["max_param_diff"] <= 1e-6 and r["max_state_diff"] <= 1e-6, r
        assert r["steps"] == [float(STEPS)] and r["moment_bytes_after_state_dict"] == 0, r  # only step counts
        assert not r["run_folder_exists"]  # close() removed the swap files


# ---- ZeRO-3: the parameter shards in files too ----------------------------------------------------------------

BLOCKS, WIDTH = 6, 256  # six FSDP units of 2 x 256 x 256 weights, and the root (a head)


def _zero3_worker(swap_folder: str) -> None:
    """FSDP2 ZeRO-3 with CPUOffloadPolicy, parameters and moments in files (NvmeStates with WholeShards with
    swap_parameters_of), against the same model with the shards in memory and torch's fused AdamW (whose
    arithmetic zplan's CPU kernel follows)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from zplan.runtime.optim.layouts import WholeShards
    from zplan.runtime.optim.nvme_states import NvmeStates
    from zplan.runtime.optim.sharded_adamw import ShardedAdamW

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
                                for _ in range(BLOCKS)], nn.Linear(WIDTH, 4))
        for block in model[:BLOCKS]:
            fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        return fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))

    swapped, reference = build(), build()
    optimizer = ShardedAdamW(swapped.parameters(), WholeShards(), NvmeStates(swap_folder, swap_parameters_of=swapped),
                             lr=1e-2)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=1e-2, fused=True)
    swapper = optimizer.param_swapper
    resident_in_forward = []
    for block in swapped[:BLOCKS]:
        block.register_forward_hook(lambda *_: resident_in_forward.append(swapper.resident_bytes()))
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        x = torch.randn(8, WIDTH, generator=generator)
        for model, opt in ((swapped, optimizer), (reference, torch_adamw)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    swapper.reap(wait=True)  # the last units' writes finish behind the next forward otherwise
    after_step = swapper.resident_bytes()
    weights = {k: v.full_tensor() for k, v in swapped.state_dict().items()}  # brings every unit in
    expected = {k: v.full_tensor() for k, v in reference.state_dict().items()}
    record = {
        "file_bytes": swapper.file_bytes,
        "unit_bytes": max(sum(u.nbytes) for u in swapper.units),
        "first_unit_bytes": sum(swapper.units[0].nbytes),
        "max_resident_in_forward": max(resident_in_forward[BLOCKS:]),  # after the first forward's start
        "resident_after_step": after_step,
        "swapped_in": swapper.bytes_swapped_in,
        "max_weight_diff": max((weights[k] - expected[k]).abs().max().item() for k in expected),
    }
    optimizer.close()
    _print_records_and_close(record)


def test_zero3_parameters_live_in_files_between_uses(tmp_path):
    records = _run_workers("zero3", tmp_path)
    for r in records:
        # in a forward: the root, the unit computing and the one read ahead, not all seven units
        assert r["max_resident_in_forward"] <= 4 * r["unit_bytes"] < r["file_bytes"], r
        # the step wrote every unit back and freed it, but the first, which the next forward starts with
        assert r["resident_after_step"] == r["first_unit_bytes"], r
        # per step: each block read for forward, backward and the step (the root once per step)
        assert r["swapped_in"] >= STEPS * 2.5 * (r["file_bytes"] - r["unit_bytes"]), r
        assert r["max_weight_diff"] <= 1e-5, r


if __name__ == "__main__" and sys.argv[1] == "worker":
    _worker(sys.argv[2])
if __name__ == "__main__" and sys.argv[1] == "zero3":
    _zero3_worker(sys.argv[2])
