"""Report content: what report.md says, the chart data, the pipeline timeline against the bubble formula."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.plan_samples import sample_alternatives, sample_plan
from zplan.codegen.context import (
    MEMORY_PARTS,
    TIME_PARTS,
    GiB,
    format_bytes,
    format_percent,
    format_rate,
    format_seconds,
)
from zplan.codegen.render import markdown_cell, render_reports
from zplan.codegen.report import (
    ParetoChart,
    ParetoPoint,
    _pareto_front,
    alternative_rows,
    pareto_chart,
    pipeline_timeline,
    report_context,
    timeline_as_text,
)
from zplan.codegen.svg_charts import PARETO_BOX, pareto_svg, pareto_view
from zplan.schemas.pipeline_schedule import BACKWARD_UNITS, FORWARD_UNITS
from zplan.schemas.plan import MemoryBreakdown, ParallelConfig, TimeBreakdown


def _parallel(pp: int, interleave: int, micro_batches: int) -> ParallelConfig:
    return ParallelConfig(
        tp=1, pp=pp, dp=1, micro_batch=1, num_micro_batches=micro_batches, zero_stage=0, recompute="none",
        sequence_parallel=False, interleave=interleave, offload="none",
        schedule="none" if pp == 1 else ("interleaved-1f1b" if interleave > 1 else "1f1b"),
    )


@pytest.mark.parametrize("name", ["gpt3-175b", "tiny-dp"])
def test_markdown_states_the_plan_and_every_assumption(name):
    plan, search = sample_plan(name), sample_alternatives(name)
    markdown = render_reports(plan, search)["report.md"]
    parallel = plan.parallel
    assert f"| Tensor parallel (tp) | {parallel.tp} " in markdown
    assert f"| Pipeline parallel (pp) | {parallel.pp}," in markdown
    assert f"| Data parallel (dp) | {parallel.dp} |" in markdown
    assert f"| ZeRO stage | {parallel.zero_stage} |" in markdown
    mesh = f"dp {parallel.dp} x pp {parallel.pp} x tp {parallel.tp} = {plan.fingerprint.world_size} GPUs"
    assert mesh in markdown
    for assumption in search.assumptions:
        assert f"| {assumption.name} | {assumption.value} | {assumption.source} |" in markdown
    for rejected in search.rejected:
        assert rejected.detail in markdown
    assert plan.cluster.gpu.name in markdown
    assert format_seconds(plan.prediction.step_time_s) in markdown


def test_markdown_table_cells_survive_pipes_and_newlines():
    search = sample_alternatives("tiny-dp", assumptions=[{"name": "a|b", "value": "1\n2", "source": "s"}])
    assert "| a\\|b | 1 2 | s |" in render_reports(sample_plan("tiny-dp"), search)["report.md"]
    assert markdown_cell("x | y") == "x \\| y"


def test_display_parts_cover_the_schema():
    """A field added to the breakdowns must show up in the reports."""
    assert {key for key, _ in TIME_PARTS} == set(TimeBreakdown.model_fields)
    memory_fields = set(MemoryBreakdown.model_fields) - {"total", "capacity", "cpu_bytes_per_node",
                                                          "nvme_bytes_per_node", "not_at_peak", "terms"}
    assert {key for key, _ in MEMORY_PARTS} == memory_fields
    templates = Path(__file__).resolve().parents[2] / "codegen" / "templates"
    for name in ("report.md.j2", "report.html.j2"):  # subtracted from the parts, so its own row, not a segment
        assert "memory_not_at_peak" in (templates / name).read_text(), name
        assert "memory_terms" in (templates / name).read_text(), name  # the named terms: a table of their own


def test_the_report_names_every_memory_term_of_the_plan():
    """A compiled plan's report lists each nonzero term of its memory peak (schemas.plan.MEMORY_TERMS) with its
    bytes; the terms add up to the peak."""
    from zplan.api import compile_plan, prepare
    from zplan.schemas.plan import MEMORY_TERMS
    from zplan.schemas.spec import Pins

    plan = compile_plan(prepare("llama:layers=4,hidden=512,heads=8,seq=256,vocab=32000", 8, "dgx-a100-80g", 16,
                                None, "bf16", Pins(tp=2, pp=2)))
    terms = plan.prediction.memory.terms
    assert set(terms) <= set(MEMORY_TERMS) and "weights" in terms and plan.parallel.vocab_parallel
    assert sum(terms.values()) == pytest.approx(plan.prediction.memory.total)
    report = render_reports(plan, None)["report.md"]
    for name, value in terms.items():
        if value:
            assert f"| {name} | {format_bytes(value) if value > 0 else '-' + format_bytes(-value)} |" in report


def test_formatting_by_hand():
    assert format_bytes(80e9) == "74.51 GiB"
    assert format_bytes(3 * 1024**2) == "3.0 MiB"
    assert format_bytes(2 * 1024**4) == "2.00 TiB"
    assert format_seconds(54.05) == "54.05 s"
    assert format_seconds(2.1e-4) == "210.0 us"
    assert format_seconds(0.7) == "700.0 ms"
    assert format_percent(0.5089) == "50.9 %"
    assert format_rate(2039e9, "B") == "2.039 TB/s"
    assert format_rate(312e12, "FLOP") == "312 TFLOP/s"


@pytest.mark.parametrize(("pp", "interleave", "micro_batches"),
                         [(1, 1, 4), (4, 1, 8), (8, 1, 3), (4, 2, 8), (8, 2, 16), (4, 3, 12), (16, 4, 16)])
def test_timeline_length_matches_the_bubble_formula(pp, interleave, micro_batches):
    """Narayanan et al. 2021, section 2.2: a step takes m*v*(f+b) per rank plus a bubble of (p-1)(f+b)/v
    full-stage units, i.e. (p-1)*(f+b) in units of one chunk's forward."""
    timeline = pipeline_timeline(_parallel(pp, interleave, micro_batches))
    per_rank_work = micro_batches * interleave * (FORWARD_UNITS + BACKWARD_UNITS)
    assert timeline.total_units == per_rank_work + (pp - 1) * (FORWARD_UNITS + BACKWARD_UNITS)
    assert len(timeline.slots) == 2 * pp * interleave * micro_batches


@pytest.mark.parametrize(("pp", "interleave", "micro_batches"), [(4, 1, 8), (4, 2, 8), (3, 2, 7), (4, 2, 3)])
def test_timeline_respects_data_dependencies(pp, interleave, micro_batches):
    timeline = pipeline_timeline(_parallel(pp, interleave, micro_batches))
    end = {(s.kind, s.stage, s.chunk, s.micro_batch): s.start + s.duration for s in timeline.slots}
    start = {(s.kind, s.stage, s.chunk, s.micro_batch): s.start for s in timeline.slots}
    virtual_stages = [(chunk, stage) for chunk in range(interleave) for stage in range(pp)]
    for mb in range(timeline.drawn_micro_batches):
        for earlier, later in zip(virtual_stages[:-1], virtual_stages[1:], strict=True):
            assert start[("F", later[1], later[0], mb)] >= end[("F", earlier[1], earlier[0], mb)]
            assert start[("B", earlier[1], earlier[0], mb)] >= end[("B", later[1], later[0], mb)]
        assert start[("B", pp - 1, interleave - 1, mb)] >= end[("F", pp - 1, interleave - 1, mb)]
    for stage in range(pp):  # a rank runs one slot at a time
        slots = sorted((s for s in timeline.slots if s.stage == stage), key=lambda s: s.start)
        assert all(a.start + a.duration <= b.start for a, b in zip(slots[:-1], slots[1:], strict=True))


def test_timeline_is_capped_to_whole_groups_of_stages():
    timeline = pipeline_timeline(_parallel(8, 2, 256))
    assert (timeline.drawn_micro_batches, timeline.total_micro_batches) == (16, 256)
    assert pipeline_timeline(_parallel(8, 2, 12)).drawn_micro_batches == 8
    assert pipeline_timeline(_parallel(4, 1, 6)).drawn_micro_batches == 6
    assert "capped" in render_reports(sample_plan("gpt3-175b"))["report.md"]


def test_timeline_text_of_plain_1f1b():
    lines = timeline_as_text(pipeline_timeline(_parallel(2, 1, 2)))
    # rank 0: F0 F1, then waits for rank 1's backward of each micro-batch (2 units each).
    assert lines == ["rank  0 |FF..BB.BB|", "rank  1 |.FBBFBB..|"]


def test_pareto_front_by_hand():
    # (time, memory): (3, 4) is beaten by (2, 3) on both; the others trade time for memory.
    assert _pareto_front([(1, 5), (2, 3), (3, 4), (4, 1)]) == {0, 1, 3}


def test_pareto_chart_marks_the_chosen_plan_and_never_puts_infeasible_points_on_the_front():
    plan, search = sample_plan("gpt3-175b"), sample_alternatives("gpt3-175b")
    chart = pareto_chart(plan, search)
    chosen = [point for point in chart.points if point.chosen]
    assert len(chosen) == 1 and chosen[0].step_time_s == plan.prediction.step_time_s
    assert chosen[0].on_front
    assert not any(point.on_front and not point.feasible for point in chart.points)
    assert any(not point.feasible for point in chart.points)
    assert len(chart.points) == 1 + len(search.alternatives)


def test_reports_render_without_alternatives_for_a_deep_pipeline_that_does_not_fit():
    plan = sample_plan(
        prediction={"feasible": False}, parallel={"tp": 1, "pp": 64, "interleave": 1, "schedule": "1f1b"},
    )
    reports = render_reports(plan, sample_alternatives(alternatives=[], rejected=[]))
    assert "None recorded." in reports["report.md"]
    assert "| Fits | no |" in reports["report.md"]
    assert reports["report.md"].count("rank ") >= 64
    assert reports["report.html"].count('id="chart-pareto"') == 1


def _point(label: str, seconds: float, gib: float, feasible: bool = True, on_front: bool = False,
           chosen: bool = False) -> ParetoPoint:
    return ParetoPoint(step_time_s=seconds, memory_bytes=gib * GiB, feasible=feasible, on_front=on_front,
                       chosen=chosen, label=label)


def _polygons(svg: str) -> dict[str, list[tuple[float, float]]]:
    """Title text -> corner points of each off-chart triangle."""
    found = re.findall(r'<polygon class="off-chart" points="([^"]+)"[^>]*><title>([^<]+)</title>', svg)
    return {title: [tuple(map(float, xy.split(","))) for xy in points.split()] for points, title in found}


def test_pareto_chart_clips_far_points_to_its_edge_and_counts_them():
    capacity = 80e9  # 74.51 GiB
    points = [
        _point("chosen", 10.0, 40.0, on_front=True, chosen=True),
        _point("small", 20.0, 10.0, on_front=True),
        _point("big", 12.0, 60.0),
        _point("huge", 15.0, 1400.0, feasible=False),  # far right
        _point("slow", 400.0, 50.0, feasible=False),  # far up
        _point("both", 1000.0, 2000.0, feasible=False),  # far up and right
    ]
    chart = ParetoChart(points=points, capacity_bytes=capacity)
    view = pareto_view(chart)
    assert 2 * capacity / GiB <= view.x_max_gib < 1400  # about twice the capacity, not 2000 GiB
    assert 3 * 10.0 <= view.y_max_s < 400  # a few times the chosen plan's time, not 1000 s
    assert [p.label for p in view.off_chart] == ["huge", "slow", "both"]

    svg = str(pareto_svg(chart))
    left, right, top, bottom = PARETO_BOX
    triangles = _polygons(svg)
    assert len(triangles) == 3
    def centre(label):
        corners = next(c for title, c in triangles.items() if title.startswith(f"{label}:"))
        return sum(x for x, _ in corners) / 3, sum(y for _, y in corners) / 3
    huge_x, huge_y = centre("huge")
    assert abs(huge_x - right) < 6 and top < huge_y < bottom  # on the right edge, at its own step time
    slow_x, slow_y = centre("slow")
    assert abs(slow_y - top) < 6 and left < slow_x < right  # on the top edge, at its own memory
    both_x, both_y = centre("both")
    assert abs(both_x - right) < 6 and abs(both_y - top) < 6  # in the corner
    assert all("beyond the chart" in title for title in triangles)
    assert "3 candidates off the chart (up to 1.95 TiB per GPU, 1000.00 s per step)" in svg
    assert "beyond the chart (3)" in svg
    # the points in view stay circles inside the plot (3 here, plus 4 in the legend)
    circles = re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)"', svg)
    assert len(circles) == 3 + 4
    assert all(left <= float(x) <= right and top <= float(y) <= bottom for x, y in circles[:3])
    # the capacity label stays inside the plot
    label = re.search(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="(start|end)"[^>]*>device capacity', svg)
    assert label is not None and left <= float(label.group(1)) <= right


def test_pareto_chart_without_far_points_draws_no_triangles():
    chart = pareto_chart(sample_plan("gpt3-175b"), sample_alternatives("gpt3-175b"))
    assert pareto_view(chart).off_chart == []
    svg = str(pareto_svg(chart))
    assert "<polygon" not in svg and "off the chart" not in svg


def test_candidates_table_shows_the_chosen_plan_the_fastest_feasible_and_the_front():
    points = [_point("chosen", 10.0, 40.0, on_front=True, chosen=True)]
    points += [_point(f"fast{i:02d}", 11.0 + i, 50.0) for i in range(30)]
    points += [_point("front", 90.0, 5.0, on_front=True), _point("no-fit", 5.0, 500.0, feasible=False)]
    rows = alternative_rows(ParetoChart(points=points, capacity_bytes=80e9), best=5)
    assert [row["config"] for row in rows] == ["chosen"] + [f"fast{i:02d}" for i in range(5)] + ["front"]
    assert rows[0]["vs_chosen"] == "" and rows[1]["vs_chosen"] == "+10.0 %"


def test_reports_say_how_many_alternatives_are_left_to_alternatives_json():
    plan, base = sample_plan("gpt3-175b"), sample_alternatives("gpt3-175b")
    template = base.alternatives[0].model_dump()
    extra = [{**template, "parallel": {**template["parallel"], "micro_batch": 1 + i % 4,
                                       "dp": 1, "tp": 8, "pp": 8, "num_micro_batches": 256},
              "step_time_s": 70.0 + i, "memory_per_gpu_bytes": 60e9 + i * 1e8}
             for i in range(40)]
    search = sample_alternatives("gpt3-175b", alternatives=[a.model_dump() for a in base.alternatives] + extra)
    context = report_context(plan, search)
    shown, total = len(context["alternative_rows"]), context["candidate_count"]
    assert shown < total and context["alternatives_not_shown"] == total - shown
    reports = render_reports(plan, search)
    for name in ("report.md", "report.html"):
        assert f"{total - shown} more configurations" in reports[name]
        assert "zplan explain plan.json" in reports[name] and "alternatives.json" in reports[name]


MESH_CARD = re.compile(r'<div class="k">Mesh</div><div class="v">([^<]*)</div>\s*<div class="s">([^<]*)</div>')


def mesh_card(html: str) -> tuple[list[str], list[str]]:
    """The Mesh card's sizes and axis names."""
    sizes, names = MESH_CARD.search(html).groups()
    return sizes.split(" &times; "), names.split(", ")[0].split(" &times; ")


def test_a_context_parallel_plan_shows_cp_in_the_mesh_card_and_the_plan_tables(tmp_path):
    from typer.testing import CliRunner

    from zplan.cli import app

    out = tmp_path / "cp"
    result = CliRunner().invoke(app, ["compile", "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000", "--gpus", "8",
                                      "--cluster", "dgx-h100", "--global-batch", "16", "--cp", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    html, markdown = (out / "report.html").read_text(), (out / "report.md").read_text()
    assert mesh_card(html) == (["4", "1", "2", "1"], ["dp", "pp", "cp", "tp"])  # 4 x 1 x 2 x 1 = 8 GPUs
    assert "<tr><td>Context parallel</td><td>cp = 2 (each sequence split over 2 GPUs)</td></tr>" in html
    assert "| Context parallel (cp) | 2 (each sequence split over 2 GPUs) |" in markdown
    assert "dp 4 x pp 1 x cp 2 x tp 1 = 8 GPUs" in markdown
    for text in (html, markdown):  # the DeepSpeed batch: micro-batch x accumulation x dp, cp counted once
        assert "dp 4; the cp 2 GPUs of a sequence count once, as DeepSpeed's sequence_parallel_size" in " ".join(
            text.split())

    plain = render_reports(sample_plan("tiny-dp"))  # cp 1: no cp anywhere
    assert mesh_card(plain["report.html"]) == (["2", "1", "1"], ["dp", "pp", "tp"])
    assert "Context parallel" not in plain["report.html"] and "Context parallel" not in plain["report.md"]
