"""The search against exhaustive references: its pick is the fastest feasible configuration after exact
stage partitioning, its infeasibility advice really fits, and it never loses to a published layout."""

import re
from dataclasses import replace

import numpy as np
import pytest

from zplan.api import compile_plan, prepare
from zplan.errors import InfeasibleError
from zplan.estimate_api import estimate_config
from zplan.planner.search import refine, score
from zplan.schemas.spec import Pins

SMALL = "gpt:layers=8,hidden=1024,heads=16,seq=512,vocab=8000"


def test_pick_is_the_fastest_feasible_configuration_of_all():
    req = prepare(SMALL, 8, "dgx-a100-80g", 8, None, "bf16", Pins())
    plan = compile_plan(req)
    scored = score(req.summary, req.cluster, req.gpus, req.train, req.pins)
    assert len(scored.order) > 100
    times = []
    for i in scored.order:  # every feasible candidate, refined with its exact partition
        choice = refine(req.summary, scored.candidates.take(np.array([i])), req.cluster, req.train)
        if choice is not None:
            times.append(float(choice.estimate.step_time_s[0]))
    # the plan's time includes the placement solver, which can only remove transfers
    assert plan.prediction.step_time_s <= min(times) * (1 + 1e-9)


def test_nothing_fits_advice_is_checked_by_compiling_it():
    spec = "gpt:layers=32,hidden=8192,heads=64,seq=2048,vocab=51200"  # ~26B parameters
    with pytest.raises(InfeasibleError) as err:
        compile_plan(prepare(spec, 2, "dgx-a100-80g", 8, None, "bf16", Pins(offload="none", tp=1)))
    message = str(err.value)
    assert "Closest" in message and "GiB" in message
    gpus = int(re.search(r"--gpus (\d+)", message).group(1))
    plan = compile_plan(prepare(spec, gpus, "dgx-a100-80g", 8, None, "bf16", Pins(offload="none", tp=1)))
    assert plan.prediction.feasible
    # and it is the fewest: one node-step fewer (or half, below a node) does not fit
    fewer = gpus - 8 if gpus > 8 else gpus // 2
    if fewer > 2:
        with pytest.raises(InfeasibleError):
            compile_plan(prepare(spec, fewer, "dgx-a100-80g", 8, None, "bf16", Pins(offload="none", tp=1)))


def test_offload_suggestion_fits_when_it_is_offered():
    spec = "gpt:layers=80,hidden=8192,heads=64,seq=2048,vocab=51200"
    with pytest.raises(InfeasibleError) as err:
        compile_plan(prepare(spec, 8, "dgx-a100-80g", 8, None, "bf16", Pins(offload="none", tp=1, pp=1)))
    assert "--offload cpu" in str(err.value)
    plan = compile_plan(prepare(spec, 8, "dgx-a100-80g", 8, None, "bf16", Pins(offload="cpu", tp=1, pp=1)))
    assert plan.prediction.feasible and plan.placement.optimizer == "cpu"


def test_plan_is_no_slower_than_the_published_megatron_layout():
    # Korthikanti et al. 2022, GPT-3 175B on 64 A100s: tp=8, pp=8, micro-batch 1, interleave 3, SP+selective.
    spec = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"
    published = Pins(tp=8, pp=8, dp=1, zero=0, micro_batch=1, interleave=3, recompute="selective",
                     sequence_parallel=True, offload="none")
    theirs = estimate_config(prepare(spec, 64, "dgx-a100-80g", 64, None, "bf16", published))
    ours = compile_plan(prepare(spec, 64, "dgx-a100-80g", 64, None, "bf16", Pins()))
    assert ours.prediction.step_time_s <= theirs["step_time_s"]
    # Megatron ran this layout in 80 GB, and so does zplan's runtime, whose pipeline stages hold receive buffers for
    # the micro-batches in flight only (runtime/parallel/pipeline_buffers.py). torch's PipelineStage allocated one for
    # every micro-batch of the step, (2v - 1) x m hidden states, which did not fit.
    memory = theirs["memory_breakdown"]
    torch_receive_buffers = (2 * 3 - 1) * 64 * 2048 * 12288 * 2  # v = 3, m = 64 micro-batches of (1, 2048, 12288) bf16
    assert memory["total"] <= memory["capacity"] < memory["total"] + torch_receive_buffers


def test_stage_partition_covers_every_unit_once_in_order():
    plan = compile_plan(prepare(SMALL, 8, "dgx-a100-80g", 32, None, "bf16", Pins(pp=4, tp=1)))
    names = [n for stage in plan.stages for n in stage.layer_names]
    assert names == [u.name for u in plan.model.layers]
    assert len(plan.stages) == 4 * plan.parallel.interleave
    copies = sum(u.shared_params for u in plan.model.layers[plan.stages[0].last_layer + 1:])  # the tied head's table
    assert copies == plan.model.vocab * plan.model.hidden  # the GPT family's head is tied
    assert sum(s.params for s in plan.stages) == sum(u.params for u in plan.model.layers) + copies


def test_a_pinned_layout_over_memory_names_its_largest_term_and_the_fastest_change_that_fits():
    """GPT 13B on 8 A100s pinned to ZeRO 0 without recompute: over memory, the optimizer states (12 bytes a parameter
    on every rank) its largest term; the single changes that fit come with their step times, fastest first, and
    the first one applied fits."""
    import re

    spec = "gpt:layers=40,hidden=5120,heads=40,seq=2048,vocab=51200"
    pins = Pins(tp=1, pp=1, dp=8, zero=0, recompute="none", micro_batch=1, offload="none")
    estimate = estimate_config(prepare(spec, 8, "dgx-a100-80g", 8, None, "bf16", pins))
    over = estimate["over_memory"]
    assert not estimate["feasible"] and over["over_bytes"] == pytest.approx(
        estimate["memory_per_gpu_bytes"] - 80e9)
    largest = next(iter(over["terms"]))
    assert largest == "optimizer states" and over["summary"].split("terms: ")[1].startswith(largest)
    assert over["terms"][largest] == pytest.approx(12 * estimate["config"]["dp"] / 8 * 13e9, rel=0.05)
    timed = [re.fullmatch(r"((?:--[a-z-]+ \w+ ?)+) \(([\d.e+-]+) s a step, [+-][\d.e+-]+ s\)", fix)
             for fix in over["fixes"]]
    timed = [(m.group(1).split(), float(m.group(2))) for m in timed if m]
    assert len(timed) >= 2 and [s for _, s in timed] == sorted(s for _, s in timed)
    names = {"--zero": ("zero", int), "--recompute": ("recompute", str), "--offload": ("offload", str),
             "--tp": ("tp", int), "--micro-batch": ("micro_batch", int)}
    words = timed[0][0]
    change = {names[flag][0]: names[flag][1](value) for flag, value in zip(words[::2], words[1::2], strict=True)}
    fixed = pins.model_copy(update={**change, **({"dp": 8 // change["tp"]} if "tp" in change else {})})
    assert estimate_config(prepare(spec, 8, "dgx-a100-80g", 8, None, "bf16", fixed))["feasible"]


def test_uniform_stages_price_megatrons_split_with_the_head_on_the_last_stage():
    """estimate_config(uniform_stages=True) prices Megatron-Core's split without a layout: 8 blocks over pp 4 are 2
    a stage, the embedding with the first and the head (a 64k vocabulary: several blocks' work) with the last,
    whose cost is its 2 blocks plus the head, unit by unit; zplan's balanced split gives the head's stage fewer
    blocks, so its step is shorter."""
    from zplan.planner.cost.units import unit_costs

    spec = "gpt:layers=8,hidden=1024,heads=16,seq=512,vocab=64000"
    pins = Pins(tp=1, pp=4, dp=1, micro_batch=1, zero=0, interleave=1)
    req = prepare(spec, 4, "dgx-a100-80g", 16, None, "bf16", pins)
    req = replace(req, cluster=req.cluster.without_host())  # the device's costs alone: blocks this small are host-bound
    scored = score(req.summary, req.cluster, req.gpus, req.train, req.pins)
    one = scored.candidates.take(np.array([int(scored.order[0])]))
    uniform = refine(req.summary, one, req.cluster, req.train, uniform_stages=True)
    balanced = refine(req.summary, one, req.cluster, req.train)
    kinds = [unit.kind for unit in req.summary.layers]
    assert [kinds[a:b + 1].count("block") for a, b in uniform.partition.boundaries] == [2, 2, 2, 2]
    assert uniform.partition.boundaries[-1][1] == len(kinds) - 1
    time_s = unit_costs(req.summary, one, req.cluster, req.train.precision).time_s
    first, last = uniform.partition.boundaries[-1]
    assert uniform.partition.stage_cost_s[-1] == pytest.approx(float(time_s[first:last + 1].sum()))
    assert [kinds[a:b + 1].count("block") for a, b in balanced.partition.boundaries][-1] < 2
    assert uniform.estimate.step_time_s[0] > balanced.estimate.step_time_s[0]
    as_pinned = estimate_config(req, uniform_stages=True)
    assert as_pinned["step_time_s"] == pytest.approx(float(uniform.estimate.step_time_s[0]))
