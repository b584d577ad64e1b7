"""The emitted train.py is short enough to review: at most 100 lines for every kind of plan (family specs, pipelines of
many stages, every precision, offload, compression), its plumbing in the runtime (runtime/training/main.py). Each one
compiles, pins its plan.json with literals the dry run can read (zplan.dryrun.train_script_constants), and hands
them to train_main; tests/e2e run the scripts themselves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zplan.examples
from tests.plan_samples import gpt_unit_names, runnable_plan, sample_plan
from zplan.codegen.script import STAGES_SHOWN, plan_review, render_script_files
from zplan.dryrun import TRAIN_SCRIPT_CONSTANTS, train_script_constants
from zplan.schemas.digest import plan_digest

MAX_LINES = 100
TINY = Path(zplan.examples.__file__).parent / "tiny.py"


def split_stages(plan, count: int) -> list[dict]:
    """The plan's units split into `count` pipeline stages of consecutive units (the last takes the rest)."""
    units = plan.model.layers
    per = len(units) // count
    stages = []
    for index in range(count):
        first = index * per
        last = len(units) - 1 if index == count - 1 else first + per - 1
        stages.append({"index": index, "first_layer": first, "last_layer": last,
                       "layer_names": [unit.name for unit in units[first:last + 1]],
                       "fwd_flops_per_sample": 0.0, "params": 0})
    return stages


def long_pipeline():
    """GPT-3 175B on 64 GPUs as pp 32 x interleave 2 x tp 2: 64 stages of one or two units."""
    plan = sample_plan("gpt3-175b", parallel={"tp": 2, "pp": 32, "interleave": 2})
    return sample_plan("gpt3-175b", parallel={"tp": 2, "pp": 32, "interleave": 2}, stages=split_stages(plan, 64))


PLANS = {
    "gpt3-175b family, 16 stages": lambda: sample_plan("gpt3-175b"),
    "64 stages": long_pipeline,
    "tiny-dp": lambda: sample_plan("tiny-dp"),
    **{f"precision {precision}": (lambda precision=precision: sample_plan("gpt3-175b", train={"precision": precision}))
       for precision in ("fp32", "fp16", "bf16", "fp8", "nvfp4")},
    "offload cpu, delayed update": lambda: sample_plan(
        "tiny-dp", parallel={"zero_stage": 1, "offload": "cpu", "delayed_update": True},
        placement={"optimizer": "cpu"}),
    "offload nvme, ZeRO-3": lambda: sample_plan(
        "tiny-dp", parallel={"zero_stage": 3, "offload": "nvme"},
        placement={"parameters": "nvme", "gradients": "cpu", "optimizer": "nvme"}),
    "compression everywhere": lambda: sample_plan(
        "gpt3-175b", train={"precision": "fp16"},
        parallel={"zero_stage": 3, "compression": {"grad": "1bit", "weights": "int8", "activations": "int8"}}),
    "a model file, tp 2": lambda: runnable_plan(
        TINY, units=gpt_unit_names(2), hidden=32, heads=4, vocab=64, seq_len=16, micro_batch=2, num_micro_batches=2,
        tp=2, dp=2, zero_stage=2, precision="bf16", tp_rules={"attn.qkv": "colwise", "attn.proj": "rowwise"}),
}


@pytest.mark.parametrize("name", PLANS)
def test_train_py_is_at_most_100_lines_and_pins_its_plan(name, tmp_path):
    plan = PLANS[name]()
    render_script_files(plan, tmp_path, None if plan.model.source == "family" else "tiny.py")
    code = (tmp_path / "train.py").read_text()
    assert len(code.splitlines()) <= MAX_LINES, code
    compile(code, "train.py", "exec")
    constants = train_script_constants(tmp_path / "train.py")
    assert set(constants) == set(TRAIN_SCRIPT_CONSTANTS)
    assert constants["PLANNED_FOR"] == plan.fingerprint.model_dump()
    assert constants["PLAN_DIGEST"] == plan_digest(plan)
    # the whole of what it runs: one call of the runtime's train_main with those constants
    main = ast.parse(code).body[-1]
    assert isinstance(main, ast.If) and "train_main(" in ast.unparse(main)
    assert all(name in ast.unparse(main) for name in TRAIN_SCRIPT_CONSTANTS)


def test_a_pipeline_of_many_stages_is_shown_as_ranges_of_units():
    """The review table names each stage by its first and last unit, and past STAGES_SHOWN stages counts the middle
    ones, so that its pipeline row stays a few lines for any model."""
    lines = plan_review(long_pipeline()).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#   pipeline"))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("#    "))
    row = " ".join(" ".join(line[1:].split()) for line in lines[start:end])
    assert row.startswith("pipeline 64 stage(s), schedule interleaved-1f1b, interleave 2: wte | blocks.0 |"), row
    assert row.endswith(" | (57 more stages) | blocks.62..head"), row
    assert row.count(" | ") == STAGES_SHOWN - 1
    assert end - start <= 3
