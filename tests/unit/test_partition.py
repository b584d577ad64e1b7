"""Pipeline-stage partitioning checked against brute-force enumeration of every contiguous partition."""

import itertools

import numpy as np
import pytest

from zplan.planner import partition
from zplan.planner.partition import (
    evaluate_partition,
    partition_layers,
    uniform_partition,
)


def brute_force(cost, static, act, num_stages, capacity, inflight=None):
    """(best max cost, best cuts) over all feasible partitions and min over all of max stage bytes."""
    n = len(cost)
    inflight = np.arange(num_stages, 0, -1) if inflight is None else inflight
    best_cost, best_cuts, min_capacity = np.inf, None, np.inf
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        edges = (0, *cuts, n)
        stage_costs = [sum(cost[a:b]) for a, b in itertools.pairwise(edges)]
        stage_bytes = [sum(static[a:b]) + inflight[s] * sum(act[a:b])
                       for s, (a, b) in enumerate(itertools.pairwise(edges))]
        min_capacity = min(min_capacity, max(stage_bytes))
        if max(stage_bytes) <= capacity and max(stage_costs) < best_cost:
            best_cost, best_cuts = max(stage_costs), edges
    return best_cost, best_cuts, min_capacity


def check_partition_shape(result, n, num_stages):
    assert len(result.boundaries) == num_stages
    assert result.boundaries[0][0] == 0 and result.boundaries[-1][1] == n - 1
    for (_, last), (first, _) in itertools.pairwise(result.boundaries):
        assert first == last + 1
    assert all(first <= last for first, last in result.boundaries)


def random_units(seed, n):
    rng = np.random.default_rng(seed)
    return rng.uniform(0.1, 1.0, n), rng.uniform(1e9, 4e9, n), rng.uniform(0.1e9, 1e9, n)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("method", ["auto", "dp", "cp-sat"])
def test_matches_brute_force_with_and_without_binding_memory(seed, method):
    n, num_stages = 8, 3
    cost, static, act = random_units(seed, n)
    free_cost, _, min_capacity = brute_force(cost, static, act, num_stages, np.inf)
    # Capacities from loose (memory irrelevant) to just above the smallest that fits (memory decides).
    for capacity in (np.inf, 1.3 * min_capacity, 1.05 * min_capacity, 1.0001 * min_capacity):
        expected, _, _ = brute_force(cost, static, act, num_stages, capacity)
        result = partition_layers(cost, static, act, num_stages, capacity, method=method)
        assert result.feasible and result.optimal
        check_partition_shape(result, n, num_stages)
        assert result.max_cost_s == pytest.approx(expected, rel=1e-6)
        assert max(result.stage_bytes) <= capacity
        # Reported per-stage numbers agree with an independent evaluation of the same boundaries.
        again = evaluate_partition(result.boundaries, cost, static, act, capacity)
        assert again.stage_cost_s == pytest.approx(result.stage_cost_s)
        assert again.stage_bytes == pytest.approx(result.stage_bytes)
        assert result.max_cost_s >= free_cost - 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_custom_inflight_and_more_stages_match_brute_force(seed):
    n, num_stages = 9, 4
    cost, static, act = random_units(100 + seed, n)
    inflight = np.array([1.0, 3.0, 2.0, 5.0])  # any schedule's in-flight counts, not only 1F1B's
    _, _, min_capacity = brute_force(cost, static, act, num_stages, np.inf, inflight)
    capacity = 1.1 * min_capacity
    expected, _, _ = brute_force(cost, static, act, num_stages, capacity, inflight)
    for method in ("auto", "cp-sat"):
        result = partition_layers(cost, static, act, num_stages, capacity, inflight, method=method)
        assert result.max_cost_s == pytest.approx(expected, rel=1e-6)
        assert max(result.stage_bytes) <= capacity


# The ten splits of six units into three non-empty contiguous stages, written out as stage sizes.
SIX_UNITS_THREE_STAGES = [(1, 1, 4), (1, 2, 3), (1, 3, 2), (1, 4, 1), (2, 1, 3), (2, 2, 2), (2, 3, 1), (3, 1, 2),
                          (3, 2, 1), (4, 1, 1)]


@pytest.fixture
def cp_sat_calls(monkeypatch):
    """Every call of the CP-SAT solver (partition._solve_cp_sat) and the stage starts it returned."""
    calls = []
    real = partition._solve_cp_sat

    def spy(problem, *args, **kwargs):
        starts, proven = real(problem, *args, **kwargs)
        calls.append((starts, proven))
        return starts, proven

    monkeypatch.setattr(partition, "_solve_cp_sat", spy)
    return calls


def starts_of(boundaries):
    return [first for first, _ in boundaries]


def test_binding_memory_changes_the_answer_and_the_label_names_the_dp(cp_sat_calls):
    # Six equal blocks on three stages: the balanced split (2, 2, 2) puts 3 in-flight micro-batches of
    # two blocks' activations on stage 0. With room for only one block there, stage 0 takes one block.
    cost = np.ones(6)
    static = np.full(6, 1.0)
    act = np.full(6, 1.0)
    free = partition_layers(cost, static, act, 3, 100.0)
    assert [last - first + 1 for first, last in free.boundaries] == [2, 2, 2]
    assert free.solver == "dp" and free.max_cost_s == 2.0
    assert cp_sat_calls == []  # memory does not bind: CP-SAT never runs
    # By hand: stage s holding k units needs (1 + (3 - s)) k bytes (4k, 3k, 2k); a capacity of 6 admits stage sizes
    # <= 1, <= 2, <= 3, so of the ten splits only (1, 2, 3) fits, at a bottleneck of 3 units.
    fitting = [sizes for sizes in SIX_UNITS_THREE_STAGES
               if all((4 - s) * k <= 6.0 for s, k in enumerate(sizes))]
    assert fitting == [(1, 2, 3)]
    tight = partition_layers(cost, static, act, 3, 6.0)
    assert tight.feasible and tight.optimal
    assert [last - first + 1 for first, last in tight.boundaries] == [1, 2, 3]
    assert tight.max_cost_s == 3.0
    assert tight.stage_bytes == [4.0, 6.0, 6.0]
    # Memory binds, so CP-SAT ran as a check and proved the same split; the split returned is the DP's (CP-SAT can
    # only tie the exact DP), and the label says so.
    assert cp_sat_calls == [([0, 1, 3], True)]
    assert tight.solver == "dp+cp-sat"
    dp_only = partition_layers(cost, static, act, 3, 6.0, method="dp")
    assert dp_only.boundaries == tight.boundaries and dp_only.solver == "dp"


def test_a_split_labelled_cp_sat_is_the_one_cp_sat_returned(cp_sat_calls, monkeypatch):
    """method="cp-sat": the split comes from the CP-SAT solver (the DP is made unusable), and its bottleneck
    equals a brute force over every contiguous split, written out here."""
    def no_dp(*args, **kwargs):
        raise AssertionError("the DP must not run for method='cp-sat' on a feasible request")

    monkeypatch.setattr(partition, "_bottleneck_dp", no_dp)
    cost, static, act = random_units(0, 8)
    n, num_stages = 8, 3
    candidates = []  # (bottleneck, peak stage bytes, stage starts) of every split
    for first_cut in range(1, n - 1):
        for second_cut in range(first_cut + 1, n):
            stages = [(0, first_cut), (first_cut, second_cut), (second_cut, n)]
            bottleneck = max(float(cost[a:b].sum()) for a, b in stages)
            peak = max(float(static[a:b].sum() + (num_stages - s) * act[a:b].sum()) for s, (a, b) in enumerate(stages))
            candidates.append((bottleneck, peak, [0, first_cut, second_cut]))
    assert len(candidates) == 21  # C(7, 2) splits of 8 units into 3 stages
    unconstrained = min(bottleneck for bottleneck, _, _ in candidates)
    capacity = 1.3 * min(peak for _, peak, _ in candidates)
    expected = min(bottleneck for bottleneck, peak, _ in candidates if peak <= capacity)
    assert expected > unconstrained  # memory decides here
    result = partition_layers(cost, static, act, num_stages, capacity, method="cp-sat")
    assert result.solver == "cp-sat" and result.optimal and result.feasible
    assert len(cp_sat_calls) == 1 and cp_sat_calls[0][1]  # one CP-SAT solve, proven optimal
    assert starts_of(result.boundaries) == cp_sat_calls[0][0]
    # Costs are integers at 1e-8 of the total inside CP-SAT: its optimum is the float optimum to that resolution.
    assert result.max_cost_s == pytest.approx(expected, rel=1e-7)
    assert max(result.stage_bytes) <= capacity


def test_auto_labels_cp_sat_only_when_it_returns_cp_sat_s_split(cp_sat_calls, monkeypatch):
    """The DP is exact, so CP-SAT cannot beat it; a DP made to return a worse (feasible) split shows that the branch
    returning CP-SAT's own, cheaper split labels it "cp-sat" and the split is CP-SAT's."""
    cost, static, act = random_units(0, 8)
    free_cost, _, min_capacity = brute_force(cost, static, act, 3, np.inf)
    capacity = 1.3 * min_capacity
    expected, _, _ = brute_force(cost, static, act, 3, capacity)
    fitting = [evaluate_partition([(a, b - 1) for a, b in itertools.pairwise((0, *cuts, 8))], cost, static, act,
                                  capacity) for cuts in itertools.combinations(range(1, 8), 2)]
    worse_eval = max((r for r in fitting if r.feasible), key=lambda r: r.max_cost_s)  # the worst split that fits
    worse = starts_of(worse_eval.boundaries)
    assert worse_eval.max_cost_s > expected * 1.1
    real_dp = partition._bottleneck_dp

    def worse_constrained_dp(stage_values, n, p):
        if isinstance(stage_values, list):  # the memory-constrained cost DP of partition_layers
            return worse_eval.max_cost_s, list(worse)
        return real_dp(stage_values, n, p)

    monkeypatch.setattr(partition, "_bottleneck_dp", worse_constrained_dp)
    result = partition_layers(cost, static, act, 3, capacity)
    assert len(cp_sat_calls) == 1 and cp_sat_calls[0][0] != worse
    assert result.solver == "cp-sat" and starts_of(result.boundaries) == cp_sat_calls[0][0]
    assert result.max_cost_s == pytest.approx(expected, rel=1e-7) and result.max_cost_s > free_cost


def test_infeasible_reports_the_smallest_capacity_that_fits():
    cost, static, act = random_units(7, 8)
    _, _, min_capacity = brute_force(cost, static, act, 3, np.inf)
    result = partition_layers(cost, static, act, 3, 0.9 * min_capacity)
    assert not result.feasible and not result.optimal
    assert result.min_feasible_capacity_bytes == pytest.approx(min_capacity)
    assert max(result.stage_bytes) == pytest.approx(min_capacity)  # the returned split is that one
    check_partition_shape(result, 8, 3)
    assert partition_layers(cost, static, act, 3, min_capacity * (1 + 1e-9)).feasible
    assert not partition_layers(cost, static, act, 3, 0.9 * min_capacity, method="cp-sat").feasible


def test_uniform_costs_give_the_uniform_split():
    result = partition_layers(np.ones(12), np.ones(12), np.zeros(12), 4, 1e9)
    assert result.boundaries == uniform_partition(12, 4) == [(0, 2), (3, 5), (6, 8), (9, 11)]
    assert result.stage_cost_s == [3.0] * 4


def test_uniform_partition_puts_the_remainder_on_the_last_stages():
    assert uniform_partition(10, 4) == [(0, 1), (2, 3), (4, 6), (7, 9)]
    assert uniform_partition(5, 1) == [(0, 4)]
    with pytest.raises(ValueError):
        uniform_partition(3, 4)


def test_single_stage_and_one_unit_per_stage_need_no_solver():
    cost, static, act = random_units(3, 5)
    one = partition_layers(cost, static, act, 1, 1e15)
    assert one.boundaries == [(0, 4)] and one.solver == "trivial"
    assert one.max_cost_s == pytest.approx(cost.sum())
    each = partition_layers(cost, static, act, 5, 1e15)
    assert each.boundaries == [(i, i) for i in range(5)]
    assert each.stage_bytes == pytest.approx(list(static + np.arange(5, 0, -1) * act))
    too_small = partition_layers(cost, static, act, 1, 1.0)
    assert not too_small.feasible
    assert too_small.min_feasible_capacity_bytes == pytest.approx(static.sum() + act.sum())


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        partition_layers(np.ones(3), np.ones(3), np.ones(3), 4, 1e9)
    with pytest.raises(ValueError):
        partition_layers(np.ones(3), np.ones(2), np.ones(3), 2, 1e9)
    with pytest.raises(ValueError):
        partition_layers(np.ones(3), np.ones(3), -np.ones(3), 2, 1e9)


def gpt_1t_units():
    """GPT 1T-like: embedding, 128 blocks, head; hidden 25600, tp=8, 16 bytes/param, micro-batch 1."""
    hidden, vocab, seq, tp, blocks = 25600, 51200, 2048, 8, 128
    block_params, embedding_params = 12 * hidden**2 / tp, vocab * hidden / tp
    rng = np.random.default_rng(0)
    cost = np.r_[0.005, np.full(blocks, 0.1), 0.13] * rng.uniform(0.8, 1.2, blocks + 2)
    static = np.r_[embedding_params, np.full(blocks, block_params), embedding_params] * 16
    act = np.r_[2 * seq * hidden / tp, np.full(blocks, 34 * seq * hidden / tp), 4 * seq * vocab / tp]
    return cost, static, act


def test_130_units_on_64_stages_with_binding_memory():
    cost, static, act = gpt_1t_units()
    free = partition_layers(cost, static, act, 64, 1e15)
    capacity = 60e9  # the unconstrained split does not fit here; stage 0 holds 64 micro-batches
    assert max(free.stage_bytes) > capacity
    result = partition_layers(cost, static, act, 64, capacity)
    assert result.feasible and result.solver in ("dp+cp-sat", "dp+cp-sat-unproven")  # the DP's split, checked
    check_partition_shape(result, 130, 64)
    assert max(result.stage_bytes) <= capacity
    assert result.max_cost_s > free.max_cost_s
    uniform = evaluate_partition(uniform_partition(130, 64), cost, static, act, capacity)
    assert result.max_cost_s <= uniform.max_cost_s or not uniform.feasible


def test_cp_sat_time_limit_still_returns_the_exact_split():
    cost, static, act = gpt_1t_units()
    exact = partition_layers(cost, static, act, 64, 60e9, method="dp")
    rushed = partition_layers(cost, static, act, 64, 60e9, time_limit_s=0.001)
    assert rushed.feasible and rushed.optimal
    assert rushed.boundaries == exact.boundaries
    assert rushed.solver.startswith("dp+cp-sat")  # the DP's split, whatever CP-SAT managed in 1 ms


def test_interleaved_chunks_count_the_embedding_and_head_as_a_block_each_where_the_blocks_do_not_divide():
    """Megatron-Core's split of Llama 3.1 405B (126 blocks) over pp 8 x VP 4 and pp 16 x VP 8, by hand: 128
    positions, 4 (or 1) a chunk, so the first chunk gives up a block to the embedding and the last to the head;
    80 blocks over 20 chunks divide, and keep 4 blocks a chunk with the embedding and head on top."""
    from zplan.planner.family import family_summary
    from zplan.planner.search import interleaved_partition

    summary = family_summary("llama:layers=126,hidden=256,heads=8,seq=64,vocab=512,ffn=512,kv_heads=2")
    kinds = [unit.kind for unit in summary.layers]
    first = kinds.index("block")
    n = len(kinds)
    time_s = np.ones(n)
    def blocks_in(a: int, b: int) -> int:
        return kinds[a:b + 1].count("block")

    part = interleaved_partition(summary, time_s, 32)
    assert [blocks_in(a, b) for a, b in part.boundaries] == [3] + [4] * 30 + [3]
    assert part.boundaries[0][0] == 0 and part.boundaries[-1][1] == n - 1
    assert kinds[part.boundaries[1][0]] == "block"
    part = interleaved_partition(summary, time_s, 128)
    assert [blocks_in(a, b) for a, b in part.boundaries] == [0] + [1] * 126 + [0]
    assert part.boundaries[0] == (0, first - 1)  # the embedding alone
    even = family_summary("llama:layers=80,hidden=256,heads=8,seq=64,vocab=512,ffn=512,kv_heads=2")
    kinds = [unit.kind for unit in even.layers]
    part = interleaved_partition(even, np.ones(len(kinds)), 20)
    assert [kinds[a:b + 1].count("block") for a, b in part.boundaries] == [4] * 20
    assert part.boundaries[0][0] == 0 and part.boundaries[-1][1] == len(kinds) - 1
