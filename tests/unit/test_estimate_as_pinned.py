"""`zplan estimate` prices the layout a user pins: a pipeline with fewer micro-batches than stages (priced with its
bubble, never chosen by compile), and a layout over memory (kept as pinned, not moved to an offload tier)."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from zplan.api import compile_plan, prepare
from zplan.cli import app
from zplan.errors import ZplanError
from zplan.estimate_api import estimate_config
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.step import estimate_step
from zplan.planner.enumerate import enumerate_candidates, fills_pipeline
from zplan.planner.search import score
from zplan.schemas.pipeline_schedule import BACKWARD_UNITS, FORWARD_UNITS, idle_units, replay
from zplan.schemas.spec import Pins

SMALL = "gpt:layers=8,hidden=1024,heads=16,seq=512,vocab=8000"
GPT_13B = "gpt:layers=40,hidden=5120,heads=40,seq=2048,vocab=51200"
A100 = BUILTIN_CLUSTERS["dgx-a100-80g"]


def test_one_f_one_b_with_fewer_micro_batches_than_stages_takes_m_plus_p_minus_1_slots():
    # By hand, p = 4 stages, m = 2 micro-batches, forward 1 unit, backward 2: micro-batch 1's forward leaves stage 3
    # at 5 (stage 0 at 1..2, one unit a stage); stage 3 runs F0 3..4, B0 4..6, F1 6..7, B1 7..9; B1 then goes back
    # through stages 2, 1, 0 in 2 units each: 9..11, 11..13, 13..15. Makespan 15 = (m + p - 1) (F + B) = 5 * 3.
    slots = replay(4, 1, 2)
    assert max(s.start + s.duration for s in slots) == 15 == (2 + 4 - 1) * (FORWARD_UNITS + BACKWARD_UNITS)
    # each rank idles (p - 1) (F + B) = 9 units: the cost model's bubble of p - 1 stage times holds for m < p
    assert [idle_units(slots, stage) for stage in range(4)] == [9, 9, 9, 9]


def test_the_cost_models_bubble_for_fewer_micro_batches_than_stages_is_p_minus_1_stage_times():
    s, h, blocks = 1024, 2048, 16
    model = ModelNumbers(num_blocks=blocks, hidden=h, heads=16, ffn_hidden=4 * h, vocab=32000, seq_len=s,
                         params=blocks * 12.0 * h * h, embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0,
                         head_fwd_flops=0.0, block_params=12.0 * h * h, block_fwd_flops=24.0 * s * h * h,
                         block_act_bytes=34.0 * s * h, embed_act_bytes=0.0, head_act_bytes=0.0)
    cand = Candidates.single(tp=1, pp=4, dp=1, micro_batch=1, zero=0, recompute=0, sp=0, interleave=1, offload=0)
    est = estimate_step(model, cand, A100, "bf16", global_batch=2)  # m = 2 micro-batches on p = 4 stages
    stage = est.compute_s[0] / 2  # one micro-batch's forward and backward on a stage (4 blocks of 16)
    assert est.num_micro_batches[0] == 2
    assert est.pipeline_bubble_s[0] == pytest.approx(3 * stage)
    # compute and bubble together: m + p - 1 = 5 stage times, the bubble 3 of them
    assert est.compute_s[0] + est.pipeline_bubble_s[0] == pytest.approx(5 * stage)


def test_estimate_prices_a_pipeline_with_fewer_micro_batches_than_stages_with_a_warning():
    # pp = 4, dp = 2, global batch 4, micro-batch 1: 2 micro-batches a pipeline
    req = prepare(SMALL, 8, "dgx-a100-80g", 4, None, "bf16", Pins(tp=1, pp=4, dp=2, micro_batch=1))
    estimate = estimate_config(req)
    cfg, time = estimate["config"], estimate["time_breakdown"]
    assert (cfg["pp"], cfg["num_micro_batches"]) == (4, 2)
    assert estimate["feasible"] and not estimate["runtime_runs_it"]
    assert [w for w in estimate["warnings"] if "2 micro-batches on 4 pipeline stages" in w]
    # by hand: tp = cp = ep = 1, so a stage time is the compute of one micro-batch; the bubble is p - 1 = 3 of them
    assert time["tensor_parallel"] == time["context_parallel"] == time["expert_parallel"] == 0
    assert time["pipeline_bubble"] == pytest.approx(3 * time["compute"] / 2)


def test_the_cli_prints_the_warnings_and_json_carries_them():
    args = [SMALL, "--gpus", "8", "--cluster", "dgx-a100-80g", "--tp", "1", "--pp", "4", "--dp", "2",
            "--global-batch", "4", "--micro-batch", "1"]
    shown = CliRunner().invoke(app, ["estimate", *args], terminal_width=400)
    assert shown.exit_code == 0, shown.output
    assert "warning" in shown.stdout and "2 micro-batches on 4 pipeline stages" in shown.stdout
    assert "runs on zplan" in shown.stdout
    data = json.loads(CliRunner().invoke(app, ["estimate", *args, "--json"]).stdout)
    assert len(data["warnings"]) == 1 and data["runtime_runs_it"] is False


def test_a_filled_pipeline_has_no_warning_and_runs():
    estimate = estimate_config(prepare(SMALL, 8, "dgx-a100-80g", 8, None, "bf16",
                                       Pins(tp=1, pp=4, dp=2, micro_batch=1)))
    assert estimate["config"]["num_micro_batches"] == 4
    assert estimate["warnings"] == [] and estimate["runtime_runs_it"] and estimate["feasible"]


def test_compile_never_picks_fewer_micro_batches_than_stages():
    req = prepare(SMALL, 8, "dgx-a100-80g", 8, None, "bf16", Pins())
    every = enumerate_candidates(req.summary, req.cluster, 8, 8, req.pins, fill_pipeline=False)
    assert not fills_pipeline(every.pp, 8 // (every.dp * every.micro_batch)).all()  # such layouts exist
    searched = score(req.summary, req.cluster, req.gpus, req.train, req.pins).candidates
    assert fills_pipeline(searched.pp, 8 // (searched.dp * searched.micro_batch)).all()
    plan = compile_plan(req)
    assert plan.parallel.pp == 1 or plan.parallel.num_micro_batches >= plan.parallel.pp
    # pinned to one, compile refuses it, naming the rule; estimate prices it
    pinned = prepare(SMALL, 8, "dgx-a100-80g", 4, None, "bf16", Pins(tp=1, pp=4, dp=2, micro_batch=1))
    with pytest.raises(ZplanError, match="a pipeline gets at least pp micro-batches"):
        compile_plan(pinned)


def test_an_over_memory_layout_is_estimated_as_pinned_without_an_unpinned_offload():
    """GPT 13B on 8 A100s, pinned to ZeRO 1, 4 sequences a micro-batch and no recompute: nothing fits, and the least
    memory would offload the optimizer to the CPU, which the user did not pin."""
    pins = Pins(tp=1, pp=1, dp=8, zero=1, micro_batch=4, recompute="none")
    req = prepare(GPT_13B, 8, "dgx-a100-80g", 32, None, "bf16", pins)
    scored = score(req.summary, req.cluster, req.gpus, req.train, req.pins)
    total, offload = scored.estimate.memory.total, scored.candidates.offload
    assert len(scored.order) == 0 and total[offload > 0].min() < total[offload == 0].min()
    estimate = estimate_config(req)
    cfg = estimate["config"]
    assert (cfg["offload"], cfg["zero_stage"], cfg["micro_batch"], cfg["recompute"]) == ("none", 1, 4, "none")
    assert not estimate["feasible"] and estimate["runtime_runs_it"]
    assert estimate["memory_per_gpu_bytes"] == pytest.approx(total[offload == 0].min(), rel=1e-6)
    over = estimate["over_memory"]
    assert over["over_bytes"] == pytest.approx(estimate["memory_per_gpu_bytes"] - A100.gpu.hbm_bytes)
    assert over["over_bytes"] > 0 and over["fixes"]
    warning = next(w for w in estimate["warnings"] if w.startswith("does not fit in GPU memory"))
    assert over["summary"] in warning


def test_a_pinned_offload_is_kept_when_over_memory():
    pins = Pins(tp=1, pp=1, dp=8, zero=1, micro_batch=4, recompute="none", offload="cpu")
    estimate = estimate_config(prepare(GPT_13B, 8, "dgx-a100-80g", 32, None, "bf16", pins))
    assert estimate["config"]["offload"] == "cpu" and not estimate["feasible"]
    assert np.isfinite(estimate["step_time_s"])
