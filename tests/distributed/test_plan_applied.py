"""What plan.json says is what the run applied, read back from the live objects.

Plans for examples/tiny.py on 2 cpu-local processes, each with other pins (PLANS), are compiled in this process;
one launch of plan_applied_worker.py runs each emitted train.py for one step and reads back, from torch's own
objects and from what a block sees, what the run did. Each field of plan.json is then compared with that:
  tp, pp                 the mesh sizes the parameters are sharded over / the pipeline group's size;
  zero_stage             FSDP2 shards the parameters over dp (2, 3), with reshard_after_forward for 3; else Adam's
                         moments this rank holds: all of its parameters' elements (0) or their dp-th part (1);
  placement              FSDP2's CPUOffloadPolicy (ZeRO 2/3: parameter and gradient shards on the host) exactly
                         when the parameters and gradients are placed off the GPU, else the parameters and the
                         gradients the step sees on the run's device; the ZeRO-1 CPU optimizer, the ZeRO 2/3
                         one over device shards (runtime.optim.host_states, its moments on the host) or
                         FSDP2's host step (optimizer on the CPU), swap files in --nvme-path (optimizer on NVMe);
                         none of these without offload;
  precision              the dtype of the first Linear's output in block 0;
  micro_batch            the batch size of block 0's input; num_micro_batches: block 0's calls in the step;
  sequence_parallel      block 0's input holds T / tp tokens;
  compression.grad       a DDP communication hook (int8) or none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import zplan.examples
from tests.distributed.harness import Ranks
from zplan.schemas import Pins
from zplan.schemas.spec import CompressionConfig

pytestmark = pytest.mark.slow

WORLD, GLOBAL_BATCH, SEQ_LEN = 2, 8, 32
TINY = Path(zplan.examples.__file__).parent / "tiny.py"
PLANS = {  # name -> (precision, pins)
    "zero0": ("fp32", Pins(zero=0, dp=2)),
    "zero1-micro1": ("fp32", Pins(zero=1, dp=2, micro_batch=1)),
    "zero2-bf16": ("bf16", Pins(zero=2, dp=2)),
    "zero3": ("fp32", Pins(zero=3, dp=2)),
    "tp2-sp": ("fp32", Pins(tp=2, sequence_parallel=True)),
    "pp2": ("fp32", Pins(pp=2)),
    "zero1-cpu": ("fp32", Pins(zero=1, dp=2, offload="cpu")),
    "zero2-cpu": ("fp32", Pins(zero=2, dp=2, offload="cpu")),  # the tiny model fits: the optimizer alone off
    "zero3-cpu-bf16": ("bf16", Pins(zero=3, dp=2, offload="cpu")),
    "zero3-nvme": ("fp32", Pins(zero=3, dp=2, offload="nvme")),
    "zero0-int8-grads": ("fp32", Pins(zero=0, dp=2, compress=CompressionConfig(grad="int8"))),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@pytest.fixture(scope="module")
def applied(tmp_path_factory) -> dict[str, tuple[dict, list[dict]]]:
    """name -> (plan.json, each rank's read-back)."""
    from zplan.api import compile_plan, prepare, write_outputs

    root = tmp_path_factory.mktemp("applied")
    outs = {}
    for name, (precision, pins) in PLANS.items():
        outs[name] = root / name
        write_outputs(compile_plan(prepare(str(TINY), WORLD, "cpu-local", GLOBAL_BATCH, SEQ_LEN, precision, pins)),
                      outs[name], str(TINY))
    worker = Path(__file__).with_name("plan_applied_worker.py")
    Ranks([str(worker), *map(str, outs.values())], WORLD, root / "logs").wait_ok()
    return {name: (json.loads((out / "plan.json").read_text()),
                   [json.loads((out / f"applied.rank{rank}.json").read_text()) for rank in range(WORLD)])
            for name, out in outs.items()}


@pytest.mark.parametrize("name", list(PLANS))
def test_each_plan_field_is_what_the_run_applied(applied, name):
    plan, ranks = applied[name]
    p = plan["parallel"]
    for seen in ranks:
        assert (seen["tp"], seen["pp"]) == (p["tp"], p["pp"]), seen
        if p["zero_stage"] >= 2:
            assert seen["dp_sharded"] == p["dp"] and seen["reshard_after_forward"] == (p["zero_stage"] == 3), seen
        else:
            assert seen["dp_sharded"] == 1 and seen["reshard_after_forward"] is None, seen
            if p["offload"] != "nvme":  # NVMe keeps the moments in files
                share = seen["moment_elements"] / seen["param_elements"]
                expected = 1.0 if p["zero_stage"] == 0 or p["dp"] == 1 else 1.0 / p["dp"]
                assert share == pytest.approx(expected, rel=0.05), seen  # rows split evenly up to rounding
        placement, fsdp_host = plan["placement"], bool(seen["fsdp_offload_cpu"])
        # ZeRO 2/3: FSDP2's CPUOffloadPolicy holds the parameter and gradient shards on the host
        assert fsdp_host == (placement["parameters"] != "gpu") == (placement["gradients"] != "gpu"), seen
        host_optimizer = seen["optimizer_parts"][1] == "HostStates"  # zplan's CPU Adam: ZeRO 1 rows or device shards
        host_step = host_optimizer or (fsdp_host and not seen["nvme_files"])
        assert (placement["optimizer"] == "cpu") == host_step, seen
        if placement["parameters"] == "gpu":  # parameters and the gradients the step reads on the run's device
            assert seen["param_devices"] == seen["grad_devices"] == [seen["device"]], seen
        if host_optimizer:  # and Adam's moments on the host
            assert seen["moment_devices"] == ["cpu"], seen
        assert (placement["optimizer"] == "nvme") == (seen["nvme_files"] > 0), seen
        assert p["offload"] == {"gpu": "none"}.get(placement["optimizer"], placement["optimizer"])
        if seen["ddp_world"] is not None:
            assert seen["ddp_world"] == p["dp"] and seen["ddp_comm_hooks"] == (p["compression"]["grad"] == "int8")
        if "block_input_shape" in seen:  # the rank that runs block 0
            batch, tokens = seen["block_input_shape"][:2]
            assert batch == p["micro_batch"] and seen["calls"] == p["num_micro_batches"], seen
            assert tokens == SEQ_LEN // (p["tp"] if p["sequence_parallel"] else 1), seen
            assert seen["compute_dtype"] == DTYPES[plan["train"]["precision"]], seen
            if seen["fsdp_param_dtype"] is not None:
                assert seen["fsdp_param_dtype"] == seen["compute_dtype"], seen
    assert any("block_input_shape" in seen for seen in ranks)


@pytest.mark.parametrize("name", ["zero2-cpu", "zero3-cpu-bf16"])
def test_zero2_and_zero3_offload_the_optimizer_alone_where_the_shards_fit(applied, name):
    """--offload cpu with ZeRO 2/3 on a model that fits: the plan keeps the parameter and gradient shards on the GPU,
    and the run does too: FSDP2 without CPUOffloadPolicy, zplan's CPU Adam over the device shards."""
    plan, ranks = applied[name]
    assert [plan["placement"][s] for s in ("parameters", "gradients", "optimizer")] == ["gpu", "gpu", "cpu"]
    for seen in ranks:
        assert seen["fsdp_offload_cpu"] is False and seen["optimizer_parts"] == ["WholeShards", "HostStates"], seen
