"""Inverse planning (`zplan plan`): the fewest GPUs that train a token budget by a deadline, and the cost-time curve.

Train time at a count is tokens / tokens_per_s of the plan compiled for that count. The counts searched are the
ones `zplan compile` accepts and that tile a node: the divisors of gpus_per_node below one node, then whole nodes
up to max_gpus. The search doubles from the smallest count until one meets the deadline, then bisects between the
last count that missed and that one, in node steps.

Train time falls roughly, not exactly, monotonically with GPUs (the layout, the micro-batches and the global batch
change with the count; a fixed global batch splits badly over some counts), so the bisection can step over a count
that meets the deadline. Where the counts it evaluated rise in train time somewhere in its bracket, the bracket's
counts below its answer are compiled one by one (at most MAX_SCAN). The answer is the smallest *evaluated* count
that meets the deadline, the count one step below it was evaluated and missed, and the result says when the
evaluated counts were not monotone.

The compile at each count is the caller's (`evaluate`): this module never imports the API.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from zplan.errors import ZplanError

SECONDS_PER_DAY = 86400.0
HOURS_PER_DAY = 24.0
# --max-gpus when not given (cluster profiles record no cluster size): 16384 GPUs, the largest published training
# runs (Llama 3 405B: 16K H100s, Dubey et al. 2024); doubling reaches it in 15 compiles from one GPU.
DEFAULT_MAX_GPUS = 16384
# Counts the search compiles one by one below its answer where the bisection's bracket was not monotone (search)
MAX_SCAN = 32


class DeadlineError(ZplanError):
    """No count up to max_gpus trains the tokens by the deadline (or none has a plan)."""


@dataclass(frozen=True)
class Point:
    """One GPU count of the curve: its plan's throughput and train time, or why it has no plan."""

    gpus: int
    tokens_per_s: float | None = None  # the plan's central prediction, global tokens/s
    days: float | None = None  # tokens / tokens_per_s / 86400; None: no plan at this count
    days_interval: tuple[float, float] | None = None  # [fast, slow] end, days: from the 80 % tokens/s interval
    global_batch: int | None = None  # sequences per step at this count
    layout: str = ""  # e.g. "tp 4 pp 2 dp 8 zero 1"
    error: str = ""  # why there is no plan at this count

    def meets(self, deadline_days: float) -> bool:
        """The central prediction trains the tokens within the deadline."""
        return self.days is not None and self.days <= deadline_days

    def slow_end_meets(self, deadline_days: float) -> bool | None:
        """The interval's slow end (its lowest tokens/s) also meets it; None without an interval."""
        return None if self.days_interval is None else self.days_interval[1] <= deadline_days

    def gpu_hours(self) -> float | None:
        return None if self.days is None else self.gpus * self.days * HOURS_PER_DAY


def train_days(tokens: float, tokens_per_s: float) -> float:
    """Days to process `tokens` at `tokens_per_s` (global tokens per second)."""
    return tokens / tokens_per_s / SECONDS_PER_DAY


def days_interval(tokens: float, interval) -> tuple[float, float] | None:
    """[tokens / high, tokens / low] in days from a [low, high] tokens/s interval; None without a usable one."""
    if interval is None:
        return None
    low, high = (float(v) for v in interval)
    if not 0 < low <= high:
        return None
    return train_days(tokens, high), train_days(tokens, low)


def point_from_rate(gpus: int, tokens: float, tokens_per_s: float, interval=None, global_batch: int | None = None,
                    layout: str = "") -> Point:
    """The curve's point for a plan predicting `tokens_per_s` (and optionally its [low, high] interval)."""
    return Point(gpus=gpus, tokens_per_s=tokens_per_s, days=train_days(tokens, tokens_per_s),
                 days_interval=days_interval(tokens, interval), global_batch=global_batch, layout=layout)


def candidate_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """The counts searched, ascending: divisors of a node below it (what `zplan compile` accepts below a node and
    tiles it), then whole nodes, all at most max_gpus."""
    below = [n for n in range(1, gpus_per_node) if gpus_per_node % n == 0 and n <= max_gpus]
    return below + list(range(gpus_per_node, max_gpus + 1, gpus_per_node))


@dataclass(frozen=True)
class Search:
    """What the search found: every evaluated count, ascending, and the chosen one (None: none met the deadline)."""

    tokens: float
    deadline_days: float
    max_gpus: int
    points: list[Point]
    chosen: Point | None
    price_per_gpu_hour: float | None = None  # currency units per GPU-hour; None: the curve shows GPU-hours

    def cost(self, point: Point) -> float | None:
        hours = point.gpu_hours()
        return None if hours is None or self.price_per_gpu_hour is None else hours * self.price_per_gpu_hour

    def cheapest(self) -> Point | None:
        """The evaluated count that meets the deadline in the fewest GPU-hours (more GPUs can cost less where they
        run a better layout)."""
        met = [p for p in self.points if p.meets(self.deadline_days)]
        return min(met, key=lambda p: (p.gpu_hours(), p.gpus)) if met else None

    def non_monotone(self) -> bool:
        """Train time rose from one evaluated count to the next larger one (or that one had no plan)."""
        return not monotone(self.points)


def monotone(points: list[Point]) -> bool:
    """Days never rise from one point with a plan to the next larger count, which has a plan too (points
    ascending)."""
    return all(b.days is not None and b.days <= a.days for a, b in pairwise(points) if a.days is not None)


def search(counts: list[int], evaluate: Callable[[int], Point], deadline_days: float,
           on_point: Callable[[Point], None] | None = None) -> tuple[list[Point], Point | None]:
    """Double from counts[0] until a count meets the deadline, then bisect (by index: node steps above a node)
    between the last count that missed and it. Where the counts evaluated in that bracket were not monotone, the
    bisection may have stepped over a count that meets the deadline: the bracket's counts below the answer are then
    compiled in order, up to MAX_SCAN of them, stopping at the first that meets it. Returns the evaluated points,
    ascending, and the smallest evaluated count that meets the deadline (None if none up to counts[-1] does)."""
    if not counts:
        raise ValueError("no GPU counts to search")
    evaluated: dict[int, Point] = {}

    def meets(index: int) -> bool:
        gpus = counts[index]
        if gpus not in evaluated:
            evaluated[gpus] = evaluate(gpus)
            if on_point is not None:
                on_point(evaluated[gpus])
        return evaluated[gpus].meets(deadline_days)

    missed, index = None, 0
    while not meets(index):
        missed = index
        if index == len(counts) - 1:
            break
        index = next((i for i in range(index + 1, len(counts)) if counts[i] >= 2 * counts[index]), len(counts) - 1)
    else:
        if missed is not None:
            low, high, bracket = missed, index, (counts[missed], counts[index])
            while high - low > 1:
                middle = (low + high) // 2
                if meets(middle):
                    high = middle
                else:
                    low = middle
            inside = [evaluated[g] for g in sorted(evaluated) if bracket[0] <= g <= bracket[1]]
            if not monotone(inside):
                for i in [i for i in range(missed + 1, high) if counts[i] not in evaluated][:MAX_SCAN]:
                    if meets(i):
                        break
    points = [evaluated[g] for g in sorted(evaluated)]
    chosen = next((p for p in points if p.meets(deadline_days)), None)
    return points, chosen


def unreachable_message(result: Search) -> str:
    """Why no plan was chosen: the fastest count found and its days, or why no count had a plan."""
    budget = f"{result.tokens:.3g} tokens in {result.deadline_days:g} days"
    planned = [p for p in result.points if p.days is not None]
    if not planned:
        first = result.points[0] if result.points else None
        why = f": {first.gpus} GPUs: {first.error}" if first is not None and first.error else ""
        return f"no GPU count up to {result.max_gpus} has a plan for {budget}{why}"
    fastest = min(planned, key=lambda p: (p.days, p.gpus))
    return (f"no GPU count up to {result.max_gpus} trains {budget}: the fastest found is {fastest.gpus} GPUs, "
            f"{fastest.days:.1f} days. Pass a larger --max-gpus, more --days or fewer --tokens.")


def row(result: Search, point: Point) -> dict:
    """One point as curve.json writes it (days, GPU-hours; cost in the price's currency, None without a price)."""
    interval = point.days_interval
    return {"gpus": point.gpus, "global_batch": point.global_batch, "layout": point.layout,
            "tokens_per_s": point.tokens_per_s, "days": point.days,
            "days_interval": list(interval) if interval is not None else None,
            "gpu_hours": point.gpu_hours(), "cost": result.cost(point),
            "meets": point.meets(result.deadline_days), "slow_end_meets": point.slow_end_meets(result.deadline_days),
            "error": point.error or None}


def as_dict(result: Search, model: str, cluster: str) -> dict:
    """The search as curve.json and `zplan plan --json` give it."""
    return {"model": model, "cluster": cluster, "tokens": result.tokens, "deadline_days": result.deadline_days,
            "price_per_gpu_hour": result.price_per_gpu_hour, "max_gpus": result.max_gpus,
            "chosen": row(result, result.chosen) if result.chosen is not None else None,
            "cheapest": row(result, result.cheapest()) if result.cheapest() is not None else None,
            "non_monotone": result.non_monotone(), "curve": [row(result, p) for p in result.points]}
