"""The probe's arithmetic (curve fit, reading collectives through the ring formulas) and its op counter,
against hand computations; no timings are asserted."""

import pytest
import torch

from zplan.probe import (
    COLLECTIVE_LARGE_BYTES,
    COLLECTIVE_SMALL_BYTES,
    collective_costs,
    count_aten_ops,
    disk_bandwidths_Bps,
    fit_saturating_curve,
    reference_input,
    reference_stack,
)


def test_fit_recovers_a_saturating_curve():
    rate, half = 30e9, 2e5  # r(x) = R x / (x + x_half)
    sizes = [1e4, 1e5, 1e6, 1e7, 1e8]
    got_rate, got_half = fit_saturating_curve(sizes, [rate * x / (x + half) for x in sizes])
    assert got_rate == pytest.approx(rate, rel=1e-9)
    assert got_half == pytest.approx(half, rel=1e-9)


def test_collective_costs_invert_the_two_rank_ring_formulas():
    small, large = COLLECTIVE_SMALL_BYTES, COLLECTIVE_LARGE_BYTES
    # times built by hand from latency 100 us and bandwidth 1 GB/s for every type
    times = {
        "all_reduce": (small / 1e9 + 2e-4, large / 1e9 + 2e-4),  # S / B + 2 lat
        "all_gather": (small / 2e9 + 1e-4, large / 2e9 + 1e-4),  # S / (2B) + lat
        "reduce_scatter": (small / 2e9 + 1e-4, large / 2e9 + 1e-4),
    }
    costs = collective_costs(times)
    for kind in times:
        cost = getattr(costs, kind)
        assert cost.bandwidth_Bps == pytest.approx(1e9, rel=1e-6), kind
        # the 8-byte time is taken as the latency: off by S / B = 8 ns at most
        assert cost.latency_s == pytest.approx(1e-4, abs=1e-8), kind


def test_op_counter_counts_each_dispatched_aten_op():
    a, b = torch.ones(3), torch.ones(3)
    assert count_aten_ops(lambda: torch.add(a, b).mul(2.0).sum()) == 3


def test_reference_block_dispatches_as_many_ops_as_the_cost_model_counts_per_block():
    from zplan.planner.cost.compute import BLOCK_OPS

    counts = []
    for blocks in (1, 2):
        model, x = reference_stack(blocks), reference_input()
        model(x).sum().backward()
        counts.append(count_aten_ops(lambda model=model, x=x: model(x).sum().backward()))
    assert counts[1] - counts[0] == BLOCK_OPS


def test_disk_rates_are_measured_in_the_given_folder_and_leave_nothing(tmp_path):
    write_Bps, read_Bps = disk_bandwidths_Bps(str(tmp_path), num_bytes=4 * 2**20)
    assert write_Bps > 0 and read_Bps > 0
    assert list(tmp_path.iterdir()) == []  # the measurement file is gone


def test_probe_refuses_an_nvme_path_that_is_not_a_folder(tmp_path):
    from typer.testing import CliRunner

    from zplan.cli import app

    out = tmp_path / "c.yaml"
    result = CliRunner().invoke(app, ["probe", "--nvme-path", str(tmp_path / "missing"), "-o", str(out)])
    assert result.exit_code == 2 and "is not a folder" in result.output
    assert not out.exists()
