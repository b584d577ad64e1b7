"""FSDP2 details the runtime reads, across the torch versions pyproject allows (found on a GPU, torch 2.11): the
parameter groups of a fully_shard module, and which host shards are pinned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]


class _Sharded:
    def __init__(self, state):
        self._state = state

    def _get_fsdp_state(self):
        return self._state


def test_param_groups_are_read_from_either_torch_layout():
    """torch >= 2.12 keeps a list (_fsdp_param_groups); 2.6-2.11 one _fsdp_param_group. Reading only the list left
    no group on 2.11, so the host shards of CPU offload were allocated on the GPU and FSDP2 refused the first step."""
    from zplan.runtime.parallel.data_parallel import fsdp_param_groups

    one, two = object(), object()
    assert fsdp_param_groups(_Sharded(SimpleNamespace(_fsdp_param_groups=[one, two]))) == [one, two]
    assert fsdp_param_groups(_Sharded(SimpleNamespace(_fsdp_param_group=one))) == [one]  # torch 2.11's layout
    assert fsdp_param_groups(_Sharded(SimpleNamespace(_fsdp_param_group=None))) == []


def pinned_by_placement() -> None:
    """In a fake world of one with torch.cuda.is_available() forced True: ZeRO-3 with the parameters on the host pins
    them, unless they are swapped to files (pinned storage cannot be resized to 0, which the swap does)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import tests.unit.test_materialize as materialize_tests
    from zplan.runtime import apply_data_parallel, build_mesh
    from zplan.runtime.parallel.data_parallel import fsdp_param_groups
    from zplan.runtime.training.materialize import build_meta_model

    torch.cuda.is_available = lambda: True
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    pins = {}
    for in_files in (False, True):
        model, _ = build_meta_model(materialize_tests.MODELS["gpt"], materialize_tests.SEED)
        mesh = build_mesh(pp=1, dp=1, tp=1, device_type="cpu")
        model = apply_data_parallel(model, mesh["dp"], 3, "fp32", "nvme", "blocks", parameters_on_host=True,
                                    parameters_in_files=in_files)
        groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in fsdp_param_groups(m)]
        assert groups and all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)
        pins[in_files] = {g.offload_policy.pin_memory for g in groups} | {p.pin_memory for g in groups
                                                                          for p in g.fsdp_params}
    assert pins == {False: {True}, True: {False}}, pins
    print("ok")


def test_host_parameters_are_pinned_unless_swapped_to_files():
    code = "import tests.unit.test_fsdp_offload_policy as t; t.pinned_by_placement()"  # its own world
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]
