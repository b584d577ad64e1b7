"""ds_config.json against DeepSpeed's own parser, at the plan's data-parallel size."""

from __future__ import annotations

import json

import pytest

from tests.plan_samples import sample_plan
from zplan.codegen.ds_config import DEFAULT_NVME_PATH, deepspeed_config, deepspeed_config_notes
from zplan.codegen.render import render_outputs

deepspeed_runtime_config = pytest.importorskip("deepspeed.runtime.config")

GPT_DP4 = {"pp": 2, "dp": 4, "micro_batch": 2, "num_micro_batches": 32, "interleave": 1, "schedule": "1f1b"}
PLANS = {
    "gpt3-175b tp8 pp8 dp1": lambda: sample_plan("gpt3-175b"),
    "gpt3-175b tp8 pp2 dp4 fp16": lambda: sample_plan(
        "gpt3-175b", parallel=GPT_DP4, train={"precision": "fp16"}),
    "tiny dp2": lambda: sample_plan("tiny-dp"),
    "tiny dp2 zero2 cpu offload": lambda: sample_plan(
        "tiny-dp", parallel={"zero_stage": 2, "offload": "cpu"},
        placement={"optimizer": "cpu", "gradients": "cpu"}),
    "tiny dp2 zero3 nvme offload": lambda: sample_plan(
        "tiny-dp", parallel={"zero_stage": 3, "offload": "nvme", "recompute": "full"},
        placement={"parameters": "nvme", "gradients": "cpu", "optimizer": "nvme"},
        train={"precision": "bf16"}),
}


def context_parallel_plan():
    """A cp 2 plan compiled as `zplan compile GPT --gpus 8 --cluster dgx-h100 --global-batch 16 --cp 2`: dp 4 x cp 2."""
    from zplan.api import compile_plan, prepare
    from zplan.schemas.spec import Pins

    plan = compile_plan(prepare("gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000", 8, "dgx-h100", 16, None, None,
                                Pins(cp=2)))
    assert (plan.parallel.cp, plan.parallel.dp, plan.parallel.tp, plan.parallel.pp) == (2, 4, 1, 1)
    return plan


class DataParallelOnly:
    """The part of Megatron's mpu interface DeepSpeedConfig reads: the data-parallel world size."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.fixture
def single_process(monkeypatch):
    """DeepSpeedConfig asks deepspeed.comm for the rank first and, without a process group, falls back to a
    world size of 1 whatever the mpu says; pretend to be rank 0 so the mpu's size is used."""
    monkeypatch.setattr(deepspeed_runtime_config.dist, "get_rank", lambda *args, **kwargs: 0)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_deepspeed_parser_accepts_config_at_plan_dp(name, single_process):
    plan = PLANS[name]()
    mpu = DataParallelOnly(plan.parallel.dp)
    parsed = deepspeed_runtime_config.DeepSpeedConfig(deepspeed_config(plan), mpu=mpu)

    assert parsed.world_size == plan.parallel.dp
    assert parsed.train_batch_size == plan.train.global_batch
    assert parsed.train_micro_batch_size_per_gpu == plan.parallel.micro_batch
    assert parsed.gradient_accumulation_steps == plan.parallel.num_micro_batches
    assert parsed.zero_optimization_stage == plan.parallel.zero_stage
    assert parsed.bfloat16_config.enabled == (plan.train.precision == "bf16")
    assert parsed.float16_config.enabled == (plan.train.precision == "fp16")
    assert parsed.optimizer_name == "adamw"
    assert parsed.gradient_clipping == 1.0


def test_offload_devices_reach_deepspeed(single_process):
    plan = PLANS["tiny dp2 zero3 nvme offload"]()
    parsed = deepspeed_runtime_config.DeepSpeedConfig(deepspeed_config(plan), mpu=DataParallelOnly(2))
    zero = parsed.zero_config
    assert zero.offload_optimizer.device == "nvme"
    assert zero.offload_param.device == "nvme"
    assert str(zero.offload_param.nvme_path) == DEFAULT_NVME_PATH

    cpu = deepspeed_config(PLANS["tiny dp2 zero2 cpu offload"]())["zero_optimization"]
    assert cpu["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in cpu  # parameters offload only exists for ZeRO-3


def test_parser_rejects_config_at_another_dp(single_process):
    """The check the test above relies on: the batch fields must match the data-parallel size."""
    plan = sample_plan("tiny-dp")
    with pytest.raises(AssertionError, match="train_batch_size"):
        deepspeed_runtime_config.DeepSpeedConfig(
            deepspeed_config(plan), mpu=DataParallelOnly(plan.parallel.dp + 1))


def test_written_file_is_the_config_with_sorted_keys(tmp_path):
    plan = sample_plan("gpt3-175b")
    render_outputs(plan, tmp_path, None)
    text = (tmp_path / "ds_config.json").read_text()
    assert json.loads(text) == deepspeed_config(plan)
    assert text == json.dumps(deepspeed_config(plan), indent=2, sort_keys=True) + "\n"


def test_notes_name_what_deepspeed_cannot_express():
    notes = " ".join(deepspeed_config_notes(sample_plan("gpt3-175b")))
    assert "PipelineModule(num_stages=8)" in notes
    assert "interleaved" in notes
    assert "AutoTP" in notes
    assert not any("Pipeline" in note for note in deepspeed_config_notes(sample_plan("tiny-dp")))


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_the_optimizer_and_clipping_are_what_train_py_runs(tmp_path, zero_stage):
    """ds_config.json's AdamW and clipping against train.py's constants and the optimizer build_optimizer makes with
    them, read back from its param groups (one process)."""
    import torch

    from tests.distributed.harness import import_file
    from zplan.codegen.script import render_script_files
    from zplan.runtime.launch.distributed import close_distributed, init_distributed
    from zplan.runtime.optim.build import build_optimizer
    from zplan.runtime.parallel.mesh import build_mesh

    plan = sample_plan("tiny-dp")
    config = deepspeed_config(plan)
    render_script_files(plan, tmp_path, None)
    train = import_file(tmp_path / "train.py", "emitted_train")
    assert config["gradient_clipping"] == train.GRAD_CLIP
    assert config["optimizer"]["params"]["lr"] == train.LR
    ctx = init_distributed()
    try:
        mesh = build_mesh(pp=1, dp=1, tp=1, device_type=ctx.device.type)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        optimizer = build_optimizer(model, mesh["dp"], zero_stage, lr=train.LR, weight_decay=train.WEIGHT_DECAY,
                                    offload="none")
    finally:
        close_distributed(clean=True)
    decayed = next(g for g in optimizer.param_groups if g["weight_decay"] > 0)
    params = config["optimizer"]["params"]
    assert (decayed["lr"], list(decayed["betas"]), decayed["eps"], decayed["weight_decay"]) == (
        params["lr"], params["betas"], params["eps"], params["weight_decay"])


def test_a_context_parallel_config_counts_the_gpus_of_a_sequence_once(single_process, monkeypatch):
    """Under cp the cp GPUs of a sequence are one data-parallel rank to the batch: ds_config.json names cp as
    DeepSpeed's sequence_parallel_size, which DeepSpeed divides its world (8 = dp 4 x cp 2) by without an mpu, and
    its batch check passes; without the field the same batch numbers fail it at a data-parallel size of 8."""
    plan = context_parallel_plan()
    config = deepspeed_config(plan)
    assert config["sequence_parallel_size"] == 2
    assert "sequence_parallel_size" not in deepspeed_config(sample_plan("tiny-dp"))  # cp 1
    monkeypatch.setattr(deepspeed_runtime_config.dist, "get_world_size",
                        lambda *args, **kwargs: plan.fingerprint.world_size)
    parsed = deepspeed_runtime_config.DeepSpeedConfig(config)
    assert parsed.world_size == plan.parallel.dp == 4
    assert parsed.train_batch_size == plan.train.global_batch == 16
    assert parsed.train_micro_batch_size_per_gpu * parsed.gradient_accumulation_steps * 4 == 16
    without_cp = {key: value for key, value in config.items() if key != "sequence_parallel_size"}
    with pytest.raises(AssertionError, match="train_batch_size"):
        deepspeed_runtime_config.DeepSpeedConfig(without_cp)
    parsed = deepspeed_runtime_config.DeepSpeedConfig(config, mpu=DataParallelOnly(plan.parallel.dp))  # Megatron's
    assert parsed.train_batch_size == plan.train.global_batch
    notes = " ".join(deepspeed_config_notes(plan))
    assert "Context parallelism (cp=2) is DeepSpeed's sequence_parallel_size" in notes


def test_an_expert_parallel_plan_is_deepspeeds_autoep(single_process):
    """ep 4 of a mixture of experts on 8 GPUs (dp 8, ZeRO 1): ds_config.json's expert_parallel block parses as
    DeepSpeed's AutoEP config with autoep_size 4, which DeepSpeed's own validation accepts at that world size; the
    batch fields still count all 8 data-parallel ranks."""
    from deepspeed.module_inject.auto_ep_config import validate_autoep_config

    from tests.unit.test_moe_cost import EXAMPLES, H100
    from zplan.api import Request, compile_plan
    from zplan.model_input import trace_model_file
    from zplan.schemas.spec import Pins, TrainSpec

    summary = trace_model_file(EXAMPLES / "moe.py", 64, "bf16", build_overrides=dict(
        num_layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, num_experts=4, top_k=2, vocab_size=128))[1]
    plan = compile_plan(Request("moe.py", summary, H100, 8, TrainSpec(global_batch=16, seq_len=64, precision="bf16"),
                                Pins(ep=4, tp=1, pp=1, zero=1), "auto"))
    config = deepspeed_config(plan)
    assert config["expert_parallel"] == {"enabled": True, "autoep_size": 4}
    assert "expert_parallel" not in deepspeed_config(sample_plan("tiny-dp"))
    parsed = deepspeed_runtime_config.DeepSpeedConfig(config, mpu=DataParallelOnly(8))
    autoep = parsed.expert_parallel_config
    assert (autoep.enabled, autoep.autoep_size, parsed.train_batch_size) == (True, 4, 16)
    validate_autoep_config(autoep, world_size=8, pp_size=1, tp_size=1, sp_size=1, zero_stage=1)
    with pytest.raises(ValueError):  # the check can fail: 3 does not divide 8 ranks
        validate_autoep_config(type(autoep)(enabled=True, autoep_size=3), world_size=8, pp_size=1, tp_size=1,
                               sp_size=1, zero_stage=1)
    assert any("AutoEP" in note for note in deepspeed_config_notes(plan))
