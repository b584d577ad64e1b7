"""Offload priced with measured numbers (CPU Adam throughput, a separate device-to-host rate) and the
planner's decision on ZeRO-Offload's one-step delayed parameter update (DPU, Ren et al. ATC'21 Sec. 5.2),
each against a hand computation: saved = min(CPU step, forward + backward), on in auto when it saves at
least DELAYED_UPDATE_MIN_SAVING of the step."""

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from zplan.api import compile_plan, compile_with_alternatives, prepare
from zplan.cli import app
from zplan.codegen.render import render_reports
from zplan.codegen.report import pareto_chart
from zplan.codegen.script import script_context
from zplan.errors import SpecError
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.inputs import Candidates
from zplan.planner.cost.offload import offload_time_s
from zplan.planner.placement import transfer_times
from zplan.planner.placement_choice import DELAYED_UPDATE_MIN_SAVING
from zplan.schemas.spec import Pins

A100 = BUILTIN_CLUSTERS["dgx-a100-80g"]
# 6.7B GPT in bf16 on 2 A100s, ZeRO-1: fp32 weights and gradients (8 B/param) plus half the Adam moments
# (4 B/param) do not fit in 80 GB, so the optimizer goes to the host.
GPT_7B = "gpt:layers=32,hidden=4096,heads=32,seq=2048,vocab=51200"
OFFLOAD_PINS = Pins(tp=1, pp=1, zero=1, offload="cpu", micro_batch=1, recompute="full")


def _plan(global_batch, delayed_update="auto", cluster="dgx-a100-80g", pins=OFFLOAD_PINS, model=GPT_7B, gpus=2):
    return compile_plan(prepare(model, gpus, cluster, global_batch, None, "bf16", pins, delayed_update))


def _cluster_file(tmp_path, **update) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(A100.model_copy(update={"name": "a100-measured", **update}).model_dump()))
    return str(path)


# ---- the cost model with measured numbers ------------------------------------------------------------------


def test_offload_time_uses_the_measured_cpu_adam_rate_and_the_downward_link():
    """ZeRO-1, dp 2, bf16, 1e9 parameters on the GPU: this rank's shard is 5e8 parameters. By hand:
    gradients down once, 2 B x 5e8 = 1e9 B at 16 GB/s x 0.8; weights up, 1e9 B at 32 GB/s x 0.8;
    CPU Adam 5e8 / (4e9 / 8 GPUs per node) = 1.0 s."""
    cluster = A100.model_copy(update={"cpu_adam_params_per_s": 4e9, "device_to_host_bandwidth_Bps": 16e9})
    cand = Candidates.single(tp=1, pp=1, dp=2, micro_batch=1, zero=1, recompute=0, sp=0, interleave=1, offload=1)
    got = offload_time_s(cand, np.array([1e9]), np.array([4.0]), cluster, "bf16")[0]
    assert got == pytest.approx(1e9 / (16e9 * 0.8) + 1e9 / (32e9 * 0.8) + 1.0)
    # without the measurement: the bandwidth formula, 2 x 12 B of Adam states + 2 B gradient + 2 B weight
    # per parameter at the GPU's share of 409.6 GB/s x 0.8
    plain = offload_time_s(cand, np.array([1e9]), np.array([4.0]), A100, "bf16")[0]
    assert plain == pytest.approx(2e9 / (32e9 * 0.8) + 5e8 * 28 / (409.6e9 * 0.8 / 8))


def test_placement_prices_the_cpu_step_by_the_measured_rate():
    times = transfer_times("gpu", "gpu", "cpu", param_bytes=4e9, grad_bytes=4e9, optimizer_bytes=12e9,
                           host_device_bytes_per_s=2e10, nvme_bytes_per_s=1e9, cpu_memory_bytes_per_s=1e10,
                           param_update_bytes=1e9, grad_update_bytes=1e9, device_to_host_bytes_per_s=1e10,
                           optimizer_params=5e8, cpu_adam_params_per_s=2.5e8)
    assert times.cpu_optimizer_s == pytest.approx(2.0)  # 5e8 / 2.5e8
    assert times.host_device_s == pytest.approx(1e9 / 1e10 + 1e9 / 2e10)  # gradients down, weights up


def test_the_chosen_plan_prices_its_cpu_step_at_its_share_of_the_measured_rate(tmp_path):
    plan = _plan(2, cluster=_cluster_file(tmp_path, cpu_adam_params_per_s=4e9))
    assert plan.placement.optimizer == "cpu"
    # this rank updates half the parameters at 1/8 of the node's 4e9 parameters/s
    assert plan.placement.cpu_optimizer_s == pytest.approx(plan.model.params / 2 / (4e9 / 8))


# ---- the decision ------------------------------------------------------------------------------------------


def test_auto_turns_it_on_where_the_cpu_step_is_a_large_share_and_the_prediction_overlaps_it():
    off, auto = _plan(2, "off"), _plan(2, "auto")
    assert (off.parallel.delayed_update, auto.parallel.delayed_update) == (False, True)
    forward_backward = sum(getattr(off.prediction.time, part)
                           for part in ("compute", "tensor_parallel", "pipeline_bubble", "pipeline_p2p"))
    saved = min(off.placement.cpu_optimizer_s, forward_backward)
    decision = auto.delayed_update
    assert decision.saved_s == pytest.approx(saved) and decision.window_s == pytest.approx(forward_backward)
    assert saved >= DELAYED_UPDATE_MIN_SAVING * off.prediction.step_time_s
    # step = max(forward + backward, CPU step) + the rest, instead of their sum
    assert auto.prediction.step_time_s == pytest.approx(off.prediction.step_time_s - saved)
    assert auto.prediction.time.offload == pytest.approx(off.prediction.time.offload - saved)
    assert auto.prediction.step_time_s == pytest.approx(sum(auto.prediction.time.model_dump().values()))
    assert decision.reason.startswith("on: ") and "saving" in decision.reason
    assert off.delayed_update.reason.startswith("off (--delayed-update off)")


def test_auto_leaves_it_off_where_the_saving_is_small():
    """128 sequences a step: forward and backward take far longer than the CPU step it could hide."""
    plan = _plan(128)
    decision = plan.delayed_update
    assert plan.parallel.offload == "cpu" and not plan.parallel.delayed_update
    assert 0 < decision.saved_s < DELAYED_UPDATE_MIN_SAVING * plan.prediction.step_time_s
    assert decision.saved_s == pytest.approx(plan.placement.cpu_optimizer_s)  # all of it would hide
    assert decision.reason.startswith("off: delayed, ") and "under the 10%" in decision.reason


def test_auto_leaves_it_off_where_nothing_is_offloaded():
    plan = _plan(8, model="gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000", pins=Pins(zero=1))
    assert plan.parallel.offload == "none" and not plan.parallel.delayed_update
    assert "no CPU step to delay" in plan.delayed_update.reason


def test_where_the_devices_are_the_hosts_cores_it_saves_nothing(tmp_path):
    cluster = _cluster_file(tmp_path, overlaps_comm_with_compute=False)
    auto, on = _plan(2, cluster=cluster), _plan(2, "on", cluster=cluster)
    assert not auto.parallel.delayed_update and auto.delayed_update.saved_s == 0
    assert on.parallel.delayed_update and on.prediction.step_time_s == pytest.approx(auto.prediction.step_time_s)
    assert "no core is idle" in auto.delayed_update.reason


@pytest.mark.parametrize("pins", [Pins(zero=3), Pins(zero=1, offload="nvme")])
def test_on_with_pins_that_rule_it_out_is_an_error_naming_the_pins(pins):
    with pytest.raises(SpecError, match="pin --zero 1 --offload cpu"):
        _plan(2, "on", pins=pins)


def test_on_where_the_chosen_plan_offloads_nothing_is_an_error():
    with pytest.raises(SpecError, match="drop --delayed-update on"):
        _plan(8, "on", model="gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000", pins=Pins(zero=1))


# ---- what the outputs say ----------------------------------------------------------------------------------


def test_the_reports_and_the_script_context_carry_the_decision():
    (on, on_search), small = compile_with_alternatives(prepare(GPT_7B, 2, "dgx-a100-80g", 2, None, "bf16",
                                                               OFFLOAD_PINS, "auto")), _plan(128)
    reports = render_reports(on, on_search)
    row = next(line for line in reports["report.md"].splitlines() if line.startswith("| Delayed parameter update |"))
    assert "on: the " in row and "saving" in row and "lag one step" in row and "warm-up steps" in row
    assert "<td>Delayed parameter update</td><td>on: the " in reports["report.html"]
    off_row = next(line for line in render_reports(small)["report.md"].splitlines()
                   if line.startswith("| Delayed parameter update |"))
    assert "off: delayed, " in off_row and "lag one step" not in off_row
    labels = [point.label for point in pareto_chart(on, on_search).points]
    assert labels[0].endswith(" delayed update")  # the chosen plan, not listed again without the delay
    assert labels[0].removesuffix(" delayed update") not in labels[1:]
    assert "delayed update on" in script_context(on, None)["plan_review"]  # train.py's review table
    assert "delayed update off" in script_context(small, None)["plan_review"]


def test_compile_option_and_json_output(tmp_path):
    runner = CliRunner()
    args = ["compile", GPT_7B, "--gpus", "2", "--global-batch", "2", "--tp", "1", "--pp", "1", "--zero", "1",
            "--offload", "cpu", "--micro-batch", "1", "--recompute", "full", "--json"]
    result = runner.invoke(app, [*args, "-o", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["parallel"]["delayed_update"] is True and data["delayed_update"]["reason"].startswith("on: ")
    result = runner.invoke(app, [*args, "--delayed-update", "off", "-o", str(tmp_path / "b")])
    assert json.loads(result.stdout)["parallel"]["delayed_update"] is False
    bad = runner.invoke(app, ["compile", GPT_7B, "--gpus", "2", "--global-batch", "2", "--zero", "3",
                              "--delayed-update", "on", "-o", str(tmp_path / "c")])
    assert bad.exit_code == 2 and "pin --zero 1 --offload cpu" in bad.output and not (tmp_path / "c").exists()
