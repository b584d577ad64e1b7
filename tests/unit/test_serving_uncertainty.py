"""Serving prediction intervals (planner/serving_uncertainty.py): by hand from a few residuals, on a compiled plan, in
plan.json, the report and the terminal table, and the residual table against the validation that writes it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jsonschema
import pytest
from rich.console import Console

from zplan.cli_render import print_inference_summary
from zplan.codegen.context import format_seconds
from zplan.codegen.inference_report import alternative_rows
from zplan.codegen.render import render_inference_reports
from zplan.inference_api import compile_inference_with_alternatives, prepare
from zplan.planner.serving_uncertainty import FIRST_TOKEN, THROUGHPUT, serving_interval
from zplan.planner.uncertainty import MIN_RUNS
from zplan.schemas.export import JSON_DIR
from zplan.schemas.inference import InferencePlan

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO.parent / "shared" / "reference"
LLAMA_SMALL = "llama:layers=4,hidden=512,heads=8,kv_heads=2,ffn=1024,seq=256,vocab=1000"
# 21 throughput residuals -0.10 .. 0.10: the 10th / 90th percentiles at positions 2 and 18, -0.08 and 0.08;
# 11 first-token residuals -0.5 .. 0.5: positions 1 and 9, -0.4 and 0.4
TABLE = {THROUGHPUT: tuple(i / 100 for i in range(-10, 11)), FIRST_TOKEN: tuple(i / 10 for i in range(-5, 6))}


def figures(pred) -> tuple[float, float, float, float]:
    return pred.ttft_s, pred.tpot_s, pred.request_latency_s, pred.tokens_per_s


@pytest.fixture(scope="module")
def compiled():
    return compile_inference_with_alternatives(prepare(LLAMA_SMALL, 2, "dgx-h100", target="throughput",
                                                       prompt_len=100, gen_len=50))


def test_the_interval_by_hand(compiled):
    pred = compiled[0].prediction
    got = serving_interval(*figures(pred), TABLE)
    assert (got.level, got.basis, got.runs) == (0.8, "validation", 32)
    assert got.ttft_s == pytest.approx((pred.ttft_s * math.exp(-0.4), pred.ttft_s * math.exp(0.4)))
    assert got.tpot_s == pytest.approx((pred.tpot_s * math.exp(-0.08), pred.tpot_s * math.exp(0.08)))
    assert got.tokens_per_s == pytest.approx((pred.tokens_per_s / math.exp(0.08), pred.tokens_per_s / math.exp(-0.08)))
    # request latency = TTFT + 49 TPOT: each part by its own bounds
    assert got.request_latency_s == pytest.approx((pred.ttft_s * math.exp(-0.4) + 49 * pred.tpot_s * math.exp(-0.08),
                                                   pred.ttft_s * math.exp(0.4) + 49 * pred.tpot_s * math.exp(0.08)))


def test_too_few_first_token_runs_make_the_interval_thin_and_say_so(compiled):
    pred = compiled[0].prediction
    few = {**TABLE, FIRST_TOKEN: (-0.3, 0.0, 0.6)}
    got = serving_interval(*figures(pred), few)
    assert (got.basis, got.runs) == ("thin", 24) and f"fewer than {MIN_RUNS}" in got.note
    assert got.ttft_s[1] == pytest.approx(pred.ttft_s * math.exp(0.6))  # widened to its own largest
    assert got.tpot_s == serving_interval(*figures(pred), TABLE).tpot_s  # the throughput bounds stay
    assert serving_interval(*figures(pred), {THROUGHPUT: TABLE[THROUGHPUT]}).basis == "unseen"


def test_a_compiled_plan_carries_an_interval_around_its_prediction(compiled):
    pred = compiled[0].prediction
    interval = pred.interval
    assert interval is not None and interval == serving_interval(*figures(pred))  # the published table's
    for name in ("ttft_s", "tpot_s", "request_latency_s", "tokens_per_s"):
        low, high = getattr(interval, name)
        assert low < getattr(pred, name) < high, name
    assert "TensorRT-LLM" in interval.note


def test_every_alternative_carries_the_interval_of_its_own_figures(compiled):
    plan, alternatives = compiled
    interval = plan.prediction.interval
    chosen = [c for c in alternatives.alternatives if (c.tp, c.weight_precision, c.weight_tier) == (
        plan.parallel.tp, plan.parallel.weight_precision, plan.parallel.weight_tier)]
    assert len(chosen) == 1 and chosen[0].interval == interval
    for c in alternatives.alternatives:  # the same relative bounds around each configuration's own prediction
        assert c.interval is not None and c.interval.basis == interval.basis
        for name in ("ttft_s", "tpot_s", "tokens_per_s"):
            assert [bound / getattr(c, name) for bound in getattr(c.interval, name)] == pytest.approx(
                [bound / getattr(plan.prediction, name) for bound in getattr(interval, name)]), name


def test_an_alternative_whose_interval_overlaps_the_chosen_ones_is_a_near_tie(compiled):
    """The plan targets throughput: an alternative is a near-tie where its tokens/s interval overlaps the plan's."""
    plan, alternatives = compiled
    low, high = plan.prediction.interval.tokens_per_s
    others = [c for c in alternatives.alternatives if c.feasible and c.note]  # the chosen one has no note
    assert others, "the small model has feasible alternatives"

    def at(c, bounds):  # c with its tokens/s interval moved to `bounds`
        return c.model_copy(update={"interval": c.interval.model_copy(update={"tokens_per_s": bounds})})

    overlapping, apart = at(others[0], (high * 0.99, high * 1.5)), at(others[0], (high * 1.01, high * 1.5))
    rows = alternative_rows(plan, alternatives.model_copy(update={"alternatives": [overlapping, apart]}))
    assert [row["vs_chosen"].endswith("(near-tie)") for row in rows] == [True, False]
    assert rows[0]["interval"] == f"{high * 0.99:,.1f} - {high * 1.5:,.1f}" and low < high


def test_plan_json_round_trips_with_and_without_the_interval(compiled):
    plan = compiled[0]
    schema = json.loads((JSON_DIR / "inference_plan.schema.json").read_text())
    for case in (plan, plan.model_copy(update={"prediction": plan.prediction.model_copy(update={"interval": None})})):
        data = json.loads(case.model_dump_json())
        jsonschema.validate(data, schema)
        assert InferencePlan.model_validate_json(case.model_dump_json()) == case
    old = json.loads(plan.model_dump_json())
    del old["prediction"]["interval"]  # a plan written before the interval
    assert InferencePlan.model_validate(old).prediction.interval is None


def test_the_report_and_the_terminal_table_show_the_interval(compiled):
    plan, alternatives = compiled
    interval = plan.prediction.interval
    reports = render_inference_reports(plan, alternatives)
    low, high = interval.ttft_s
    for text in reports.values():
        assert f"(80 %: {format_seconds(low)} - {format_seconds(high)})" in text
        assert f"(80 %: {interval.tokens_per_s[0]:,.1f} - {interval.tokens_per_s[1]:,.1f})" in text
        assert "zplan's own engine is not among them" in text.replace("&#39;", "'")
    bare = plan.model_copy(update={"prediction": plan.prediction.model_copy(update={"interval": None})})
    bare_alternatives = alternatives.model_copy(update={"alternatives": [
        c.model_copy(update={"interval": None}) for c in alternatives.alternatives]})  # files from before intervals
    assert all("80 %" not in text for text in render_inference_reports(bare, bare_alternatives).values())
    assert all("80 % interval" in text for text in reports.values())  # the alternatives' column
    pred = plan.prediction
    assert pred.continuous_batching is not None and pred.continuous_batching.points
    band = (f"tokens/s x{interval.tokens_per_s[0] / pred.tokens_per_s:.2f}-"
            f"x{interval.tokens_per_s[1] / pred.tokens_per_s:.2f}")  # the curve's points: the same factors
    assert all(f"as factors on its own figures: {band}, TPOT x" in " ".join(text.split()) for text in reports.values())
    console = Console(record=True, width=400)
    print_inference_summary(console, plan, alternatives, Path("out"), [])
    table = console.export_text()
    assert "80% interval" in table and f"{interval.tokens_per_s[0]:,.1f} - {interval.tokens_per_s[1]:,.1f}" in table
    assert f"TTFT {format_seconds(plan.prediction.ttft_s)}, TPOT {format_seconds(plan.prediction.tpot_s)}" in table
    console = Console(record=True, width=400)
    print_inference_summary(console, bare, alternatives, Path("out"), [])
    assert "interval" not in console.export_text()


@pytest.mark.skipif(not (REFERENCE / "serving_runs.csv").is_file(), reason="../shared/reference is not beside")
def test_the_residual_table_is_the_validations_and_its_intervals_hold_left_one_source_out():
    """planner/serving_prediction_error.py holds what `validate_serving.py --write-intervals` writes, and its
    intervals, each source checked with the other's residuals, hold 70-90 % of the published rows with a median
    half-width under 25 % (77.0 % and 21.5 % on 2026-12-04)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from validate_serving import residuals_by_kind, validate

    from zplan.planner.serving_prediction_error import SERVING_LOG_RESIDUALS

    result = validate(REFERENCE)
    fresh = residuals_by_kind(result["rows"])
    assert set(fresh) == set(SERVING_LOG_RESIDUALS) == {THROUGHPUT, FIRST_TOKEN}
    for kind, values in fresh.items():
        assert SERVING_LOG_RESIDUALS[kind] == pytest.approx(values, abs=1e-4), kind
    for row in result["rows"]:  # a tokens/s row's time residual is log(predicted / measured)
        sign = 1.0 if row["kind"] == FIRST_TOKEN else -1.0
        assert row["residual"] == pytest.approx(sign * math.log(row["measured"] / row["predicted_loso"]))
    assert 0.7 <= result["serving_interval_coverage"] <= 0.9
    assert result["serving_interval_half_width"] < 0.25
    assert sum(f["rows"] for f in result["serving_interval_by_kind"].values()) == len(result["rows"])
