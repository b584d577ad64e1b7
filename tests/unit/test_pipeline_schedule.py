"""The one schedule model (schemas.pipeline_schedule): the replay's idle time against the closed-form bubble the cost
model prices, and a small case by hand."""

from __future__ import annotations

import numpy as np
import pytest

from zplan.schemas.pipeline_schedule import (
    BACKWARD_UNITS,
    FORWARD_UNITS,
    bubble_stage_times,
    idle_units,
    replay,
    slot_order,
)

UNIT = FORWARD_UNITS + BACKWARD_UNITS  # one chunk's forward and backward of one micro-batch


@pytest.mark.parametrize(("pp", "interleave", "micro_batches"),
                         [(1, 1, 4), (2, 1, 2), (4, 1, 8), (8, 1, 3), (4, 2, 8), (8, 2, 16), (4, 3, 12), (16, 4, 16)])
def test_replay_idle_time_is_the_closed_form_bubble(pp, interleave, micro_batches):
    """Every rank idles (p - 1) / v stage times, t_stage = v * (F + B) chunk units (Narayanan et al. 2021, Sec. 2.2)."""
    slots = replay(pp, interleave, micro_batches)
    t_stage = interleave * UNIT
    for stage in range(pp):
        assert idle_units(slots, stage) == pytest.approx(bubble_stage_times(pp, interleave) * t_stage)


def test_two_stage_1f1b_by_hand():
    """p=2, v=1, m=2, F=1, B=2. Rank 0: F0 at 0, F1 at 1, then B0 after rank 1's B0 (rank 1: F0 at 1, B0 at 2-4),
    so 4-6, and B1 at 7-9 after rank 1's B1 (5-7). Rank 0 idles 2..4 and 6..7: 3 units = (p - 1) * (F + B)."""
    slots = replay(2, 1, 2)
    rank0 = [(s.kind, s.micro_batch, s.start) for s in slots if s.stage == 0]
    rank1 = [(s.kind, s.micro_batch, s.start) for s in slots if s.stage == 1]
    assert rank0 == [("F", 0, 0), ("F", 1, 1), ("B", 0, 4), ("B", 1, 7)]
    assert rank1 == [("F", 0, 1), ("B", 0, 2), ("F", 1, 4), ("B", 1, 5)]
    assert idle_units(slots, 0) == idle_units(slots, 1) == 3
    assert bubble_stage_times(2, 1) == 1.0  # one stage time of 3 units


def test_slot_order_warms_up_then_alternates():
    assert slot_order(0, 2, 1, 3) == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2)]
    assert slot_order(1, 2, 1, 3) == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1), ("F", 0, 2), ("B", 0, 2)]


def test_bubble_is_vectorised_for_the_cost_model():
    pp, v = np.array([1, 2, 8]), np.array([1.0, 1.0, 4.0])
    np.testing.assert_array_equal(bubble_stage_times(pp, v), [0.0, 1.0, 7 / 4])
