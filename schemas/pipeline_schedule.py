"""One model of the 1F1B pipeline schedule, shared by the cost model and the report (torch- and numpy-free).

Megatron-LM's 1F1B and interleaved 1F1B (Narayanan et al., SC'21, Sec. 2.2): each of p pipeline ranks holds v model
chunks; a micro-batch goes forward through chunk 0 on ranks 0..p-1, then chunk 1, ..., and backward in reverse.

- `slot_order`: the order one rank runs its forward and backward slots in.
- `replay`: every slot started as early as its rank and its input allow, forward = FORWARD_UNITS and backward =
  BACKWARD_UNITS time units per chunk (the report's schedule chart).
- `bubble_stage_times`: the idle time per rank this implies, in units of t_stage (one micro-batch's forward and
  backward through all v chunks of a rank): (p - 1) / v. The replay's makespan is m * v * (F + B) + (p - 1) * (F + B)
  chunk units per rank, i.e. m * t_stage + (p - 1) / v * t_stage with t_stage = v * (F + B): planner.cost.step prices
  the bubble with it (tests/unit/test_pipeline_schedule.py checks the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

FORWARD_UNITS = 1  # schematic time units of one chunk's forward of one micro-batch
BACKWARD_UNITS = 2  # and of its backward (about twice the forward's FLOPs)

Number = TypeVar("Number")  # a float, or a numpy array of candidates (planner.cost): only arithmetic is used


@dataclass(frozen=True)
class Slot:
    stage: int  # pipeline rank
    start: int  # schematic time units
    duration: int
    kind: str  # "F" (forward) or "B" (backward)
    micro_batch: int
    chunk: int  # model chunk on this rank (interleaved schedules)


def bubble_stage_times(stages: Number, chunks: Number) -> Number:
    """Idle time of one rank per step, in stage times t_stage: (p - 1) / v (1F1B; interleaving divides the bubble
    by v). Works on numbers and on numpy arrays alike."""
    return (stages - 1) / chunks


def slot_order(stage: int, stages: int, chunks: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """(kind, chunk, micro_batch) in the order one pipeline rank runs them: warm-up forwards, then one forward and
    one backward in turn, then the remaining backwards. Micro-batches go through the chunks in groups of `stages`;
    backwards visit the chunks in reverse."""
    forwards, backwards = [], []
    for group_start in range(0, micro_batches, stages):
        group = range(group_start, min(group_start + stages, micro_batches))
        for chunk in range(chunks):
            forwards += [(chunk, mb) for mb in group]
            backwards += [(chunks - 1 - chunk, mb) for mb in group]
    total = len(forwards)
    if chunks == 1:
        warmup = min(stages - stage - 1, total)
    else:
        warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    order = [("F", *forwards[i]) for i in range(warmup)]
    for i in range(total - warmup):
        order += [("F", *forwards[warmup + i]), ("B", *backwards[i])]
    order += [("B", *backwards[i]) for i in range(total - warmup, total)]
    return order


def _dependency(kind: str, stage: int, chunk: int, mb: int, stages: int, chunks: int) -> tuple | None:
    """The slot whose output this slot needs: the previous stage (forward) or the next (backward)."""
    if kind == "F":
        if stage > 0:
            return ("F", stage - 1, chunk, mb)
        return ("F", stages - 1, chunk - 1, mb) if chunk > 0 else None
    if stage < stages - 1:
        return ("B", stage + 1, chunk, mb)
    return ("B", 0, chunk + 1, mb) if chunk < chunks - 1 else ("F", stage, chunk, mb)


def replay(stages: int, chunks: int, micro_batches: int) -> list[Slot] | None:
    """Start every slot as early as its rank and its dependency allow; None if the order deadlocks."""
    orders = [slot_order(stage, stages, chunks, micro_batches) for stage in range(stages)]
    next_index, free_at = [0] * stages, [0] * stages
    end_of: dict[tuple, int] = {}
    slots: list[Slot] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for stage in range(stages):
            while next_index[stage] < len(orders[stage]):
                kind, chunk, mb = orders[stage][next_index[stage]]
                dependency = _dependency(kind, stage, chunk, mb, stages, chunks)
                if dependency is not None and dependency not in end_of:
                    break
                start = max(free_at[stage], end_of.get(dependency, 0))
                duration = FORWARD_UNITS if kind == "F" else BACKWARD_UNITS
                slots.append(Slot(stage, start, duration, kind, mb, chunk))
                end_of[(kind, stage, chunk, mb)] = free_at[stage] = start + duration
                next_index[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            return None
    return sorted(slots, key=lambda slot: (slot.stage, slot.start))


def idle_units(slots: list[Slot], stage: int) -> int:
    """Time units rank `stage` waits between the step's start and the last slot's end (its bubble)."""
    makespan = max((slot.start + slot.duration for slot in slots), default=0)
    return makespan - sum(slot.duration for slot in slots if slot.stage == stage)
