"""Prediction intervals (planner/uncertainty.py), the near-ties the report names (codegen/near_ties.py), and the
residual table the intervals are built from, against the validation that writes it."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tests.plan_samples import sample_alternatives, sample_plan
from zplan.codegen.context import format_bytes
from zplan.codegen.near_ties import near_tie_rows
from zplan.codegen.render import render_reports
from zplan.planner.uncertainty import (
    DRY_RUN_MEMORY_AGREEMENT,
    MIN_RUNS,
    log_bounds,
    prediction_interval,
    quantile_bounds,
    regime_of,
)

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO.parent / "shared" / "reference"


def test_percentiles_by_hand():
    """0.0, 0.1, ..., 1.0: the 10th percentile is the 2nd value and the 90th the 10th (linear interpolation at
    position (n - 1) q = 1 and 9); 0, 1, 2, 3 at 80 %: positions 0.3 and 2.7."""
    assert quantile_bounds([i / 10 for i in range(11)], 0.8) == pytest.approx((0.1, 0.9))
    assert quantile_bounds([3.0, 0.0, 2.0, 1.0], 0.8) == pytest.approx((0.3, 2.7))


@pytest.mark.parametrize("layout, regime", [
    (dict(offload="cpu", pp=8), "offload"),  # the first that applies
    (dict(moe=True, precision="fp8"), "MoE"),
    (dict(precision="fp8", seq_len=32768), "fp8/fp4"),
    (dict(cp=2), "long context"), (dict(seq_len=16384), "long context"),
    (dict(pp=8, num_micro_batches=64), "pipeline-heavy"), (dict(pp=2, num_micro_batches=7), "pipeline-heavy"),
    (dict(pp=2, num_micro_batches=8), "3D"), (dict(tp=8), "3D"),
    (dict(), "dense FSDP"),
])
def test_regimes(layout, regime):
    args = dict(tp=1, pp=1, cp=1, num_micro_batches=1, offload="none", precision="bf16", seq_len=4096, moe=False)
    assert regime_of(**{**args, **layout}) == regime


def test_a_thinly_covered_regime_gets_a_wider_interval_and_an_unseen_one_wider_still():
    table = {"dense FSDP": tuple(i / 100 for i in range(-10, 11)), "3D": (-0.5, 0.02, 0.03)}
    bounds, basis, runs, _ = log_bounds("dense FSDP", table)
    assert (basis, runs) == ("validation", 21) and bounds == pytest.approx((-0.08, 0.08))
    thin, basis, runs, note = log_bounds("3D", table)
    pooled = sorted(table["dense FSDP"] + table["3D"])
    assert (basis, runs) == ("thin", 3) and f"fewer than {MIN_RUNS}" in note
    assert thin == pytest.approx((-0.5, quantile_bounds(pooled, 0.9)[1]))  # widened to its own -0.5
    unseen, basis, runs, note = log_bounds("offload", table)
    assert (basis, runs) == ("unseen", 0) and "zplan calibrate" in note
    assert unseen == pytest.approx(quantile_bounds(pooled, 0.95))
    assert unseen[1] - unseen[0] > bounds[1] - bounds[0]


def test_the_interval_scales_the_step_and_inverts_into_throughput_and_mfu():
    pred = sample_plan().prediction
    table = {"3D": tuple([-0.2] + [0.0] * 9 + [0.1]), "pipeline-heavy": tuple([-0.2] + [0.0] * 9 + [0.1])}
    got = prediction_interval(pred, "pipeline-heavy", table)
    low, high = quantile_bounds(table["pipeline-heavy"], 0.8)  # (-0.02, 0.01)
    assert got.step_time_s == pytest.approx((pred.step_time_s * math.exp(low), pred.step_time_s * math.exp(high)))
    assert got.tokens_per_s == pytest.approx((pred.tokens_per_s / math.exp(high), pred.tokens_per_s / math.exp(low)))
    assert got.mfu == pytest.approx((pred.mfu / math.exp(high), pred.mfu / math.exp(low)))
    # memory: the allocated bytes scaled by the dry run's range of measured / planned, the framework reserve as planned
    allocated, reserve = pred.memory.total - pred.memory.reserve, pred.memory.reserve
    assert reserve > 0
    assert got.memory_bytes == pytest.approx((allocated / 1.054 + reserve, allocated * 1.058 + reserve))
    moe = prediction_interval(pred, "pipeline-heavy", table, moe=True)
    assert moe.memory_bytes == pytest.approx((allocated / 1.189 + reserve, allocated * 1.058 + reserve))
    assert DRY_RUN_MEMORY_AGREEMENT["MoE"][0] < DRY_RUN_MEMORY_AGREEMENT["dense"][0]


def test_nine_calibrated_runs_make_the_interval_and_fewer_leave_the_published_one():
    plan = sample_plan()
    table = {"3D": tuple(i / 100 for i in range(-10, 11))}
    errors = [0.01 * i for i in range(10)]  # 0.00 .. 0.09: the 10th / 90th percentiles 0.009 and 0.081
    calibrated = plan.cluster.model_copy(update={"calibration_errors": errors, "calibration_errors_held_out": True})
    got = prediction_interval(plan.prediction, "3D", table, calibrated)
    assert (got.basis, got.runs) == ("calibration", 10) and "left out of the fit" in got.note
    step = plan.prediction.step_time_s
    assert got.step_time_s == pytest.approx((step * math.exp(0.009), step * math.exp(0.081)))
    few = calibrated.model_copy(update={"calibration_errors": errors[:MIN_RUNS - 1]})
    assert prediction_interval(plan.prediction, "3D", table, few).basis == "validation"


def _with_interval(plan, low: float, high: float):
    interval = prediction_interval(plan.prediction, "3D", {"3D": (0.0,) * 10})
    interval = interval.model_copy(update={"step_time_s": (low, high)})
    return plan.model_copy(update={"prediction": plan.prediction.model_copy(update={"interval": interval})})


def test_the_report_names_the_alternatives_whose_intervals_overlap_and_how_to_tell_them_apart():
    plan, search = sample_plan(), sample_alternatives()
    step = plan.prediction.step_time_s
    feasible = [alt for alt in search.alternatives if alt.feasible and alt.parallel != plan.parallel]
    near, far = feasible[0], feasible[1]
    alternatives = [near.model_copy(update={"step_time_s_interval": (step * 1.05, step * 1.3)}),
                    far.model_copy(update={"step_time_s_interval": (step * 1.25, step * 1.5)})]
    search = search.model_copy(update={"alternatives": alternatives})
    plan = _with_interval(plan, step * 0.9, step * 1.1)
    rows = near_tie_rows(plan, search)
    assert len(rows) == 1  # the second starts above the chosen plan's high end
    assert near.parallel.pin_flags() in rows[0]["commands"] and "--steps 10 --log-json" in rows[0]["commands"]
    reports = render_reports(plan, search)
    assert "Near-ties" in reports["report.md"] and near.parallel.pin_flags() in reports["report.md"]
    assert "overlaps the chosen plan's (" in reports["report.md"] and "1, the fastest 1 below" in reports["report.md"]
    assert "Near-ties" in reports["report.html"]
    assert not near_tie_rows(_with_interval(plan, step * 0.9, step), search)  # no overlap, no near-tie
    # the memory peak's interval, the dry run's agreement, beside the step's
    low, high = (format_bytes(b) for b in plan.prediction.interval.memory_bytes)
    for name in ("report.md", "report.html"):
        assert f"(80 %: {low} - {high}, the dry run" in reports[name]  # html escapes the apostrophe


def test_pin_flags_name_every_choice_of_the_layout():
    parallel = sample_plan().parallel.model_copy(update={"cp": 2, "sequence_parallel": True})
    words = parallel.pin_flags().split()
    assert "--sequence-parallel" in words and "--no-sequence-parallel" not in words
    words.remove("--sequence-parallel")
    flags = dict(zip(words[::2], words[1::2], strict=True))
    assert flags == {"--tp": str(parallel.tp), "--pp": str(parallel.pp), "--dp": str(parallel.dp), "--cp": "2",
                     "--zero": str(parallel.zero_stage), "--offload": parallel.offload,
                     "--micro-batch": str(parallel.micro_batch), "--recompute": parallel.recompute,
                     "--interleave": str(parallel.interleave)}


@pytest.mark.skipif(not (REFERENCE / "training_runs.csv").is_file(), reason="../shared/reference is not beside")
def test_the_residual_table_is_the_validations_and_its_intervals_hold_left_one_source_out():
    """planner/prediction_error.py holds what `validate_cost_model.py --write-intervals` writes (the dense regimes;
    the MoE rows: tests/unit/test_moe_reference_runs.py's validation), and its intervals, checked on each source
    with the others' residuals, hold 70-90 % of the published runs with a median half-width under 25 %."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from validate_cost_model import residuals_by_regime, validate

    from zplan.planner.prediction_error import LOG_RESIDUALS

    result = validate(REFERENCE, moe=False)
    fresh = residuals_by_regime(result["rows"])
    for regime, values in fresh.items():
        assert LOG_RESIDUALS[regime] == pytest.approx(values, abs=1e-4), regime
    assert 0.7 <= result["interval_coverage"] <= 0.9
    assert result["interval_half_width"] < 0.25
