"""Assign pipeline units of unequal cost (embedding, blocks, head) to contiguous pipeline stages.

Problem (docs/design.md decision 3). Units 0..n-1 in model order have a cost ``c_i`` (seconds of forward
+ backward per micro-batch), static bytes ``b_i`` (model states kept on the GPU) and activation bytes
``a_i`` (saved for backward, per in-flight micro-batch). Stage ``s`` (0..p-1) holds ``k_s`` micro-batches
in flight (1F1B: ``k_s = p - s``, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters", Sec. 2.2). Choose stage boundaries so that

    minimise    max_s  sum_{i in stage s} c_i                       (the pipeline's bottleneck stage)
    subject to  stages are contiguous, in order, each non-empty, together cover all units
                sum_{i in s} b_i + k_s * sum_{i in s} a_i <= capacity     for every stage s.

Two exact methods, both exposed:

* ``bottleneck DP`` (``method="dp"``): dp[s][j] = min over i of max(dp[s-1][i], cost(i..j-1)), with
  infeasible (over-memory) stages priced at +inf; O(p * n^2) vectorised with numpy (130 units x 64
  stages: 15-50 ms on this machine). Exact on the floating-point numbers.
* ``CP-SAT`` (``method="cp-sat"``): one boolean per (stage, interval of units) the stage could hold;
  exactly one interval per stage, consecutive stages meet at the same cut (flow conservation through a
  layered graph), stage cost <= bottleneck as a linear constraint, minimise the bottleneck; stage bytes
  <= capacity by admitting only the intervals that fit their stage (equivalent, as each stage holds
  exactly one interval; decided in floating point like the DP). Costs are integers at 1e-8 of the
  total (rounded to nearest). The flow
  constraints make the LP relaxation tight for a fixed bottleneck, so proofs need little search;
  without a good upper bound the model has O(p * n^2) booleans (slow beyond ~50 units).

``method="auto"`` (the default, and what planner.search uses): the DP decides the split. When memory
does not bind (the memory-aware optimum equals the unconstrained optimum) that is all. When memory binds,
CP-SAT re-solves the constrained model as an independent check, seeded with the DP's split as hint and the
unconstrained optimum as lower bound; its split would replace the DP's only if strictly cheaper, which the
exact DP leaves no room for (it would take float error in the DP), so the DP's split is returned and
``solver`` records whether CP-SAT proved its optimum on the integer costs ("dp+cp-sat") or stopped at its time
limit ("dp+cp-sat-unproven"). CP-SAT chooses the split itself only with ``method="cp-sat"`` (solver "cp-sat").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from ortools.sat.python import cp_model

COST_RESOLUTION = 10**8  # integer cost units in the model's total cost
# Prefix-sum differences carry ~1e-16 relative float error; tolerate that much when comparing to capacity.
_CAPACITY_RELATIVE_TOLERANCE = 1e-12


@dataclass(frozen=True)
class PartitionResult:
    """A stage assignment. Stage s holds units ``boundaries[s][0] .. boundaries[s][1]`` (inclusive).

    When ``feasible`` is False the boundaries are those of the partition with the smallest maximum stage
    memory, and ``min_feasible_capacity_bytes`` is that memory: the smallest capacity that would fit.
    """

    boundaries: list[tuple[int, int]]
    stage_cost_s: list[float]
    stage_bytes: list[float]
    max_cost_s: float
    optimal: bool  # proven optimal (by the exact DP or by CP-SAT's OPTIMAL status)
    feasible: bool
    min_feasible_capacity_bytes: float | None = None  # set only when infeasible
    # Which solver produced ``boundaries``: "trivial" (one possible split), "dp" (the exact DP; memory did not
    # raise the optimum, or method="dp"; also the min-memory split of an infeasible request), "dp+cp-sat" (the
    # DP's split; memory binds, and CP-SAT, run as a check, proved optimal a split no cheaper), "dp+cp-sat-unproven"
    # (the DP's split; CP-SAT stopped at its time limit without a proof), "cp-sat" (CP-SAT's own split: method="cp-sat",
    # or auto where CP-SAT beat the DP), "given" (evaluate_partition).
    solver: str = ""


def uniform_partition(n_units: int, num_stages: int) -> list[tuple[int, int]]:
    """Equal unit counts per stage; the remainder goes to the last stages (1F1B's first stages hold the
    most activations). Returns inclusive (first_unit, last_unit) pairs."""
    if not 1 <= num_stages <= n_units:
        raise ValueError(f"need 1 <= num_stages ({num_stages}) <= n_units ({n_units})")
    base, extra = divmod(n_units, num_stages)
    sizes = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [(int(starts[s]), int(starts[s + 1]) - 1) for s in range(num_stages)]


def one_f_one_b_inflight(num_stages: int) -> np.ndarray:
    """Micro-batches whose activations stage s holds at its peak under 1F1B: p - s."""
    return np.arange(num_stages, 0, -1, dtype=np.float64)


class _Problem:
    """Validated inputs and their prefix sums; prefix[j] - prefix[i] is the sum over units i..j-1."""

    def __init__(self, unit_cost_s, unit_static_bytes, unit_act_bytes, num_stages, capacity_bytes, inflight):
        self.cost = np.asarray(unit_cost_s, dtype=np.float64)
        self.static = np.asarray(unit_static_bytes, dtype=np.float64)
        self.act = np.asarray(unit_act_bytes, dtype=np.float64)
        self.n = int(self.cost.shape[0])
        self.p = int(num_stages)
        if self.cost.ndim != 1 or self.static.shape != self.cost.shape or self.act.shape != self.cost.shape:
            raise ValueError("unit_cost_s, unit_static_bytes and unit_act_bytes must be 1-D of equal length")
        if not 1 <= self.p <= self.n:
            raise ValueError(f"need 1 <= num_stages ({self.p}) <= number of units ({self.n})")
        self.inflight = one_f_one_b_inflight(self.p) if inflight is None else np.asarray(inflight, np.float64)
        if self.inflight.shape != (self.p,):
            raise ValueError(f"inflight_microbatches must have num_stages={self.p} entries")
        for name, arr in (("cost", self.cost), ("static", self.static), ("act", self.act),
                          ("inflight", self.inflight)):
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise ValueError(f"{name} values must be finite and >= 0")
        self.capacity = float(capacity_bytes)
        zero = np.zeros(1)
        self.cost_prefix = np.concatenate([zero, np.cumsum(self.cost)])
        self.static_prefix = np.concatenate([zero, np.cumsum(self.static)])
        self.act_prefix = np.concatenate([zero, np.cumsum(self.act)])

    def interval_matrix(self, prefix: np.ndarray) -> np.ndarray:
        """(n+1, n+1): [i, j] = sum of units i..j-1 for i < j, +inf elsewhere (empty or reversed)."""
        sums = prefix[None, :] - prefix[:, None]
        return np.where(np.triu(np.ones_like(sums, dtype=bool), k=1), sums, np.inf)

    def fits(self, stage_bytes: np.ndarray) -> np.ndarray:
        return stage_bytes <= self.capacity * (1 + _CAPACITY_RELATIVE_TOLERANCE)

    def evaluate(self, starts: list[int]) -> tuple[list[tuple[int, int]], list[float], list[float]]:
        """Boundaries, cost and bytes of each stage for stage starts (len p, starts[0] == 0)."""
        ends = list(starts[1:]) + [self.n]
        bounds = [(int(i), int(j) - 1) for i, j in zip(starts, ends, strict=True)]
        costs = [float(self.cost_prefix[j] - self.cost_prefix[i]) for i, j in zip(starts, ends, strict=True)]
        stage_bytes = [
            float(self.static_prefix[j] - self.static_prefix[i]
                  + self.inflight[s] * (self.act_prefix[j] - self.act_prefix[i]))
            for s, (i, j) in enumerate(zip(starts, ends, strict=True))
        ]
        return bounds, costs, stage_bytes


def _bottleneck_dp(stage_values: list[np.ndarray] | np.ndarray, n: int, p: int) -> tuple[float, list[int]]:
    """Exact min over contiguous partitions of max over stages of value[s][i, j] (stage s = units i..j-1).

    ``stage_values`` is one (n+1, n+1) matrix per stage, or one matrix shared by all stages; +inf marks a
    forbidden stage. Returns (optimum, stage starts); optimum is +inf when no partition is allowed.
    Ties go to the earliest cut, so the answer is deterministic.
    """
    def value(s: int) -> np.ndarray:
        return stage_values if isinstance(stage_values, np.ndarray) else stage_values[s]

    best = value(0)[0].copy()  # best[j]: optimum for units 0..j-1 in stages 0..s
    choices = []
    for s in range(1, p):
        candidates = np.maximum(best[:, None], value(s))  # [i, j]: stages 0..s-1 end at i, stage s = i..j-1
        choices.append(np.argmin(candidates, axis=0))
        best = candidates[choices[-1], np.arange(n + 1)]
    starts = [0] * p
    j = n
    for s in range(p - 1, 0, -1):
        j = int(choices[s - 1][j])
        starts[s] = j
    return float(best[n]), starts


def _memory_matrices(problem: _Problem) -> list[np.ndarray]:
    """Bytes of stage s holding units i..j-1, as (n+1, n+1) matrices (+inf for empty or reversed)."""
    static = problem.static_prefix[None, :] - problem.static_prefix[:, None]
    act = problem.act_prefix[None, :] - problem.act_prefix[:, None]
    legal = np.triu(np.ones_like(static, dtype=bool), k=1)
    return [np.where(legal, static + problem.inflight[s] * act, np.inf) for s in range(problem.p)]


def _integer_cost_prefix(problem: _Problem) -> np.ndarray:
    """Cost prefix sums in integer units of 1/COST_RESOLUTION of the total cost (rounded to nearest)."""
    total_cost = float(problem.cost_prefix[-1])
    cost_unit = total_cost / COST_RESOLUTION if total_cost > 0 else 1.0
    return np.rint(problem.cost_prefix / cost_unit).astype(np.int64)


def _solve_cp_sat(
    problem: _Problem,
    time_limit_s: float,
    hint_starts: list[int] | None = None,
    cost_lower_bound_units: int = 0,
) -> tuple[list[int] | None, bool]:
    """CP-SAT on the integer-scaled model. Returns (stage starts, or None when none was found; proven).

    Model: one boolean per (stage s, interval of units i..j-1) that stage s could hold; exactly one
    interval per stage, and stage s ends at cut j exactly when stage s+1 starts there (flow conservation),
    so the booleans describe a contiguous partition into non-empty stages. Stage cost is linear in the
    stage's booleans: stage_cost(s) <= bottleneck; minimise the bottleneck. Memory: with exactly one
    interval per stage, stage_bytes(s) <= capacity is the same as forbidding each interval that does not
    fit stage s, so those intervals get no boolean (decided in floating point, exactly as the DP does:
    no rounding, and no byte-sized coefficients in the model). With a hint, intervals costing more than
    the hint's bottleneck are left out too (no solution at least as good uses them): a small model.
    """
    n, p = problem.n, problem.p
    cost_prefix = _integer_cost_prefix(problem)
    stage_memory = _memory_matrices(problem)
    interval_cost = cost_prefix[None, :] - cost_prefix[:, None]  # [i, j]: units i..j-1
    max_interval_cost = int(cost_prefix[n])
    if hint_starts is not None:
        hint_ends = list(hint_starts[1:]) + [n]
        max_interval_cost = max(int(interval_cost[i, j]) for i, j in zip(hint_starts, hint_ends, strict=True))
    cut = np.arange(n + 1)

    model = cp_model.CpModel()
    bottleneck = model.new_int_var(min(max(0, cost_lower_bound_units), max_interval_cost),
                                   max_interval_cost, "bottleneck")
    stage_intervals: list[tuple[np.ndarray, np.ndarray, list]] = []  # per stage: starts, ends, booleans
    for s in range(p):
        # Stage s starts at a cut in s .. n-(p-s) and ends at a cut in s+1 .. n-(p-s-1) (others non-empty).
        allowed = ((cut[:, None] >= s) & (cut[:, None] <= n - (p - s)) & (cut[None, :] > cut[:, None])
                   & (cut[None, :] <= n - (p - s - 1)) & (interval_cost <= max_interval_cost)
                   & problem.fits(stage_memory[s]))
        if s == 0:
            allowed &= cut[:, None] == 0
        if s == p - 1:
            allowed &= cut[None, :] == n
        starts, ends = np.nonzero(allowed)
        if starts.size == 0:
            return None, True  # no interval can serve as stage s
        booleans = [model.new_bool_var(f"s{s}_{i}_{j}") for i, j in zip(starts, ends, strict=True)]
        model.add_exactly_one(booleans)
        costs = interval_cost[starts, ends].tolist()
        model.add(cp_model.LinearExpr.weighted_sum(booleans, costs) <= bottleneck)
        stage_intervals.append((starts, ends, booleans))
    for s in range(p - 1):  # stage s ends at cut j exactly when stage s+1 starts at cut j
        ending_at: dict[int, list] = {}
        starting_at: dict[int, list] = {}
        for j, var in zip(stage_intervals[s][1].tolist(), stage_intervals[s][2], strict=True):
            ending_at.setdefault(j, []).append(var)
        for i, var in zip(stage_intervals[s + 1][0].tolist(), stage_intervals[s + 1][2], strict=True):
            starting_at.setdefault(i, []).append(var)
        for j in sorted(ending_at.keys() | starting_at.keys()):
            model.add(cp_model.LinearExpr.sum(ending_at.get(j, []))
                      == cp_model.LinearExpr.sum(starting_at.get(j, [])))
    model.minimize(bottleneck)
    if hint_starts is not None:
        for s, (i, j) in enumerate(zip(hint_starts, hint_ends, strict=True)):
            starts, ends, booleans = stage_intervals[s]
            for k in np.flatnonzero((starts == i) & (ends == j)):
                model.add_hint(booleans[k], True)

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 2  # the former num_search_workers
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.random_seed = 0
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, status == cp_model.INFEASIBLE
    chosen_starts = []
    for starts, _, booleans in stage_intervals:
        chosen_starts.append(int(next(i for i, b in zip(starts, booleans, strict=True)
                                      if solver.boolean_value(b))))
    return chosen_starts, status == cp_model.OPTIMAL


def _result(problem: _Problem, starts: list[int], *, optimal: bool, feasible: bool, solver: str,
            min_capacity: float | None = None) -> PartitionResult:
    bounds, costs, stage_bytes = problem.evaluate(starts)
    return PartitionResult(bounds, costs, stage_bytes, max(costs), optimal, feasible, min_capacity, solver)


def _infeasible_result(problem: _Problem) -> PartitionResult:
    """The min-max-memory partition: its largest stage is the smallest capacity that would fit."""
    min_capacity, starts = _bottleneck_dp(_memory_matrices(problem), problem.n, problem.p)
    return _result(problem, starts, optimal=False, feasible=False, solver="dp", min_capacity=min_capacity)


def partition_layers(
    unit_cost_s: np.ndarray,
    unit_static_bytes: np.ndarray,
    unit_act_bytes: np.ndarray,
    num_stages: int,
    stage_capacity_bytes: float,
    inflight_microbatches: np.ndarray | None = None,
    time_limit_s: float = 5.0,
    method: Literal["auto", "dp", "cp-sat"] = "auto",
) -> PartitionResult:
    """Split units into ``num_stages`` contiguous non-empty stages, minimising the largest stage cost.

    Objective: minimise max_s sum_{i in s} unit_cost_s[i].
    Constraints: stages contiguous, in order, non-empty, covering every unit; for each stage s,
    sum static bytes + inflight_microbatches[s] * sum act bytes <= stage_capacity_bytes
    (inflight default: 1F1B, stage s holds num_stages - s micro-batches).

    Never raises for lack of memory: an infeasible request returns ``feasible=False`` with the smallest
    capacity that would fit. ``method`` picks the solver (module docstring); ``time_limit_s`` bounds
    CP-SAT, whose best solution so far is returned (``optimal=False`` if not proven, unless the exact DP
    already proved it). Bad shapes or ``num_stages`` outside 1..n raise ValueError.
    """
    problem = _Problem(unit_cost_s, unit_static_bytes, unit_act_bytes, num_stages, stage_capacity_bytes,
                       inflight_microbatches)
    n, p = problem.n, problem.p
    if p == 1 or p == n:  # a single possible partition
        starts = [0] if p == 1 else list(range(n))
        _, _, stage_bytes = problem.evaluate(starts)
        feasible = bool(np.all(problem.fits(np.asarray(stage_bytes))))
        return _result(problem, starts, optimal=True, feasible=feasible, solver="trivial",
                       min_capacity=None if feasible else max(stage_bytes))

    if method == "cp-sat":  # CP-SAT alone, seeded only with the uniform split when that fits
        uniform_starts = [first for first, _ in uniform_partition(n, p)]
        fits = np.all(problem.fits(np.asarray(problem.evaluate(uniform_starts)[2])))
        starts, proven = _solve_cp_sat(problem, time_limit_s, uniform_starts if fits else None)
        if starts is None:
            return _infeasible_result(problem)
        return _result(problem, starts, optimal=proven, feasible=True, solver="cp-sat")

    cost_matrix = problem.interval_matrix(problem.cost_prefix)
    memory = _memory_matrices(problem)
    constrained = [np.where(problem.fits(memory[s]), cost_matrix, np.inf) for s in range(p)]
    best_cost, best_starts = _bottleneck_dp(constrained, n, p)
    if not np.isfinite(best_cost):
        return _infeasible_result(problem)
    free_cost, _ = _bottleneck_dp(cost_matrix, n, p)
    if method == "dp" or best_cost <= free_cost:  # memory does not bind: the DP's answer is the optimum
        return _result(problem, best_starts, optimal=True, feasible=True, solver="dp")

    # Memory binds: CP-SAT decides, seeded with the DP partition; the unconstrained optimum, computed on
    # the same integer costs CP-SAT sees, is a valid lower bound.
    lower_bound, _ = _bottleneck_dp(problem.interval_matrix(_integer_cost_prefix(problem)), n, p)
    starts, proven = _solve_cp_sat(problem, time_limit_s, best_starts, int(lower_bound))
    if starts is None:  # out of time (CP-SAT cannot call the DP's own split infeasible)
        return _result(problem, best_starts, optimal=True, feasible=True, solver="dp+cp-sat-unproven")
    if max(problem.evaluate(starts)[1]) < best_cost * (1 - 1e-9):  # cross-check: not while the DP is exact
        return _result(problem, starts, optimal=proven, feasible=True, solver="cp-sat")
    # Equal bottleneck: return the DP's partition, so that the output does not depend on CP-SAT's workers.
    return _result(problem, best_starts, optimal=True, feasible=True,
                   solver="dp+cp-sat" if proven else "dp+cp-sat-unproven")


def evaluate_partition(
    boundaries: list[tuple[int, int]],
    unit_cost_s: np.ndarray,
    unit_static_bytes: np.ndarray,
    unit_act_bytes: np.ndarray,
    stage_capacity_bytes: float,
    inflight_microbatches: np.ndarray | None = None,
) -> PartitionResult:
    """Costs and bytes of a given partition (e.g. ``uniform_partition``), for comparison; optimal=False."""
    problem = _Problem(unit_cost_s, unit_static_bytes, unit_act_bytes, len(boundaries), stage_capacity_bytes,
                       inflight_microbatches)
    starts = [first for first, _ in boundaries]
    expected_ends = [first - 1 for first in starts[1:]] + [problem.n - 1]
    if starts[0] != 0 or [last for _, last in boundaries] != expected_ends or np.any(np.diff(starts) < 1):
        raise ValueError(f"boundaries {boundaries} are not a contiguous cover of {problem.n} units")
    _, _, stage_bytes = problem.evaluate(starts)
    feasible = bool(np.all(problem.fits(np.asarray(stage_bytes))))
    return _result(problem, starts, optimal=False, feasible=feasible, solver="given",
                   min_capacity=None if feasible else max(stage_bytes))
