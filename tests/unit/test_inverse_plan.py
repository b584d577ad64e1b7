"""`zplan plan`: the fewest GPUs that train a token budget by a deadline. The search is checked on hand-made curves,
the chosen count by compiling it and the count one node below it again, the days by hand (tokens / tokens/s /
86400), and the command end to end."""

import json
from xml.etree import ElementTree

import pytest
from typer.testing import CliRunner

from zplan.api import compile_plan, prepare
from zplan.cli import app
from zplan.inverse_api import plan_for_deadline, rate_interval
from zplan.planner.inverse import (
    DeadlineError,
    Point,
    Search,
    as_dict,
    candidate_counts,
    point_from_rate,
    search,
    unreachable_message,
)
from zplan.schemas.spec import Pins

SPEC = "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000"
CLUSTER = "dgx-a100-80g"  # 8 GPUs a node
DAY_S = 86400.0
runner = CliRunner()


def tokens_per_s(gpus: int) -> float:
    """The plan's throughput at `gpus`, compiled as `zplan compile --gpus` would (default global batch)."""
    return compile_plan(prepare(SPEC, gpus, CLUSTER, None, None, None, Pins())).prediction.tokens_per_s


def test_candidate_counts_are_node_divisors_then_whole_nodes():
    assert candidate_counts(8, 40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert candidate_counts(8, 45) == [1, 2, 4, 8, 16, 24, 32, 40]  # not a whole node: left out
    assert candidate_counts(4, 10) == [1, 2, 4, 8]
    assert candidate_counts(8, 3) == [1, 2]


def test_days_and_interval_by_hand():
    # 8.64e9 tokens at 1e5 tokens/s: 86400 s, one day; [5e4, 2e5] tokens/s: [0.5, 2] days
    point = point_from_rate(16, 8.64e9, 1e5, (5e4, 2e5))
    assert point.days == pytest.approx(1.0)
    assert point.days_interval == pytest.approx((0.5, 2.0))
    assert point.gpu_hours() == pytest.approx(16 * 24)
    assert point.meets(1.0) and not point.meets(0.99)
    assert point.slow_end_meets(2.0) and not point.slow_end_meets(1.5)
    result = Search(tokens=8.64e9, deadline_days=1.5, max_gpus=16, points=[point], chosen=point,
                    price_per_gpu_hour=2.0)
    row = as_dict(result, SPEC, CLUSTER)["chosen"]
    assert row["cost"] == pytest.approx(16 * 24 * 2.0)
    assert row["meets"] and row["slow_end_meets"] is False


def test_the_cheapest_count_that_meets_can_be_larger():
    # 16 GPUs x 1 day = 384 GPU-hours; 24 GPUs x 0.5 day = 288 (a better layout); 32 GPUs x 0.45 day = 345.6
    points = [Point(gpus=16, days=1.0), Point(gpus=24, days=0.5), Point(gpus=32, days=0.45)]
    result = Search(tokens=1.0, deadline_days=1.0, max_gpus=32, points=points, chosen=points[0])
    curve = as_dict(result, SPEC, CLUSTER)
    assert curve["chosen"]["gpus"] == 16 and curve["cheapest"]["gpus"] == 24
    assert curve["cheapest"]["gpu_hours"] == pytest.approx(288.0)


def test_search_doubles_then_bisects_to_the_smallest_count():
    # days = 1000 / gpus: 30 days needs 1000 / 30 = 33.3 GPUs, so 40 (five nodes of 8); 32 misses (31.25 days)
    counts = candidate_counts(8, 512)
    seen = []

    def evaluate(gpus):
        seen.append(gpus)
        return Point(gpus=gpus, days=1000 / gpus)

    points, chosen = search(counts, evaluate, 30.0)
    assert chosen.gpus == 40
    assert seen[:7] == [1, 2, 4, 8, 16, 32, 64]  # doubling until 64 meets it
    assert {p.gpus for p in points} == set(seen) and 32 in seen  # the node below the answer was evaluated
    assert [p.gpus for p in points] == sorted(seen)


def test_a_curve_that_looks_monotone_is_bisected_only():
    # 40 GPUs meet 30 days but 48 miss (a worse layout): the bisection between 32 and 64 tries 48, misses, and settles
    # on 56; the counts it saw fall steadily, so 40 is never compiled (the search's documented limit)
    days = {1: 900, 2: 500, 4: 300, 8: 160, 16: 80, 24: 50, 32: 35, 40: 29, 48: 31, 56: 25, 64: 20}
    points, chosen = search(candidate_counts(8, 64), lambda g: Point(gpus=g, days=days[g]), 30.0)
    assert chosen.gpus == 56
    assert [p.gpus for p in points] == [1, 2, 4, 8, 16, 32, 48, 56, 64]
    assert not Search(tokens=1.0, deadline_days=30.0, max_gpus=64, points=points, chosen=chosen).non_monotone()


def test_a_non_monotone_bracket_is_scanned_below_the_bisections_answer():
    # 96 GPUs are slower than 64 (a batch that splits badly): the bisection between 64 and 128 tries 96 (miss), 112
    # and 104 (meet); the bracket is not monotone, so 72, 80, ... are compiled in order until one meets: 80
    days = {g: 2048 / g for g in (1, 2, 4, 8, 16, 32, 64)}
    days.update({72: 31, 80: 29, 88: 28, 96: 40, 104: 27, 112: 26, 120: 25, 128: 20})
    points, chosen = search(candidate_counts(8, 128), lambda g: Point(gpus=g, days=days[g]), 30.0)
    assert chosen.gpus == 80
    assert [p.gpus for p in points] == [1, 2, 4, 8, 16, 32, 64, 72, 80, 96, 104, 112, 128]  # not 88: it stopped
    assert Search(tokens=1.0, deadline_days=30.0, max_gpus=128, points=points, chosen=chosen).non_monotone()


def test_a_count_without_a_plan_is_a_miss():
    def evaluate(gpus):
        return Point(gpus=gpus, error="does not fit") if gpus < 16 else Point(gpus=gpus, days=10.0)

    points, chosen = search(candidate_counts(8, 64), evaluate, 30.0)
    assert chosen.gpus == 16 and [p.gpus for p in points] == [1, 2, 4, 8, 16]


def test_unreachable_names_the_fastest_count_found():
    counts = candidate_counts(8, 24)
    points, chosen = search(counts, lambda g: Point(gpus=g, days=600 / g), 1.0)
    assert chosen is None and points[-1].gpus == 24  # doubling ends on the largest count
    message = unreachable_message(Search(tokens=1e12, deadline_days=1.0, max_gpus=24, points=points, chosen=None))
    assert "fastest found is 24 GPUs, 25.0 days" in message  # 600 / 24


def test_chosen_count_meets_the_deadline_and_one_node_fewer_does_not():
    # a budget 16 GPUs cannot train in a day but some count up to 256 can
    tokens = tokens_per_s(16) * DAY_S * 1.2
    found = plan_for_deadline(SPEC, CLUSTER, tokens, 1.0, max_gpus=256)
    chosen = found.search.chosen
    assert chosen.gpus > 16 and chosen.gpus % 8 == 0
    # the days by hand from a fresh compile of the chosen count
    rate = tokens_per_s(chosen.gpus)
    assert chosen.days == pytest.approx(tokens / rate / DAY_S)
    assert tokens / rate / DAY_S <= 1.0
    assert tokens / tokens_per_s(chosen.gpus - 8) / DAY_S > 1.0
    plan, _ = found.chosen()
    assert plan.fingerprint.world_size == chosen.gpus
    assert found.curve["chosen"]["gpus"] == chosen.gpus
    assert found.curve["chosen"]["gpu_hours"] == pytest.approx(chosen.gpus * tokens / rate / 3600)


def test_intervals_are_the_plans_tokens_per_s_interval_in_days():
    tokens = tokens_per_s(8) * DAY_S * 0.5  # eight GPUs meet a day
    found = plan_for_deadline(SPEC, CLUSTER, tokens, 1.0, max_gpus=8)
    for point in found.search.points:
        interval = rate_interval(found.compiled[point.gpus][0].prediction)
        if interval is None:
            assert point.days_interval is None
        else:
            low, high = interval
            assert point.days_interval == pytest.approx((tokens / high / DAY_S, tokens / low / DAY_S))


def test_unreachable_deadline_is_an_error_with_the_fastest_count():
    tokens = tokens_per_s(16) * DAY_S * 100  # far beyond 16 GPUs in a day
    found = plan_for_deadline(SPEC, CLUSTER, tokens, 1.0, max_gpus=16)
    with pytest.raises(DeadlineError) as err:
        found.chosen()
    fastest = min((p for p in found.search.points if p.days is not None), key=lambda p: p.days)
    hand_days = tokens / tokens_per_s(fastest.gpus) / DAY_S
    assert f"the fastest found is {fastest.gpus} GPUs, {hand_days:.1f} days" in str(err.value)


def test_cli_json_and_outputs(tmp_path):
    tokens = tokens_per_s(8) * DAY_S * 1.5  # eight GPUs miss a day
    out = tmp_path / "out"
    result = runner.invoke(app, ["plan", SPEC, "--tokens", f"{tokens:.6e}", "--days", "1", "--cluster", CLUSTER,
                                 "--max-gpus", "64", "--price-per-gpu-hour", "2", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    chosen = data["chosen"]
    assert chosen["gpus"] > 8 and chosen["meets"] and chosen["days"] <= 1.0
    assert chosen["cost"] == pytest.approx(chosen["gpus"] * chosen["days"] * 24 * 2)
    assert "GPUs:" in result.stderr  # progress, one line per count
    assert json.loads((out / "curve.json").read_text()) == {k: v for k, v in data.items() if k != "out_dir"}
    assert json.loads((out / "plan.json").read_text())["fingerprint"]["world_size"] == chosen["gpus"]
    svg = ElementTree.fromstring((out / "curve.svg").read_text())  # well-formed, one circle per count with a plan
    assert len(svg.findall("{http://www.w3.org/2000/svg}circle")) == sum(r["days"] is not None for r in data["curve"])
    assert (out / "train.py").is_file()
    assert f"Chosen: {chosen['gpus']} GPUs" in (out / "curve.md").read_text()


def test_cli_unreachable_exits_2_naming_the_fastest():
    result = runner.invoke(app, ["plan", SPEC, "--tokens", "1e18", "--days", "1", "--cluster", CLUSTER,
                                 "--max-gpus", "8"])
    assert result.exit_code == 2
    assert "the fastest found is" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("args, words", [
    (["--tokens", "0", "--days", "1"], "--tokens"),
    (["--tokens", "1e9", "--days", "-1"], "--days"),
    (["--tokens", "1e9", "--days", "1", "--max-gpus", "0"], "--max-gpus"),
    (["--tokens", "1e9", "--days", "1", "--global-batch", "8", "--tokens-per-step", "1024"], "pass one"),
    (["--tokens", "1e9", "--days", "1", "--tokens-per-step", "1000"], "whole number"),
])
def test_cli_bad_budget_is_one_message(args, words):
    result = runner.invoke(app, ["plan", SPEC, "--cluster", CLUSTER, *args])
    assert result.exit_code == 2 and words in result.stderr and "Traceback" not in result.output
