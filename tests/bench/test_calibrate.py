"""`tpurec bench plan --calibrate`: the plans it measures, its statistics, its fit, and (slow) one short run."""

from __future__ import annotations

import pytest

from tpurec.bench import calibrate
from tpurec.planner.cpu_cost import DEFAULT_CPU_COSTS


@pytest.fixture(scope="module")
def plans():
    return calibrate.candidate_plans()


def test_spearman_against_hand_computed_values():
    assert calibrate.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert calibrate.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # one swapped pair of four: 1 - 6 * (1 + 1) / (4 * 15) = 0.8
    assert calibrate.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ties take the average rank: ranks (0.5, 0.5, 2) against (0, 1, 2)
    assert calibrate.spearman([5, 5, 9], [1, 2, 3]) == pytest.approx(0.8660254, rel=1e-6)


def test_at_least_eight_distinct_plans_each_covering_every_table(plans):
    assert len(plans) >= 8
    # the two plans the "never slower than round-robin table-wise" check compares are measured
    assert calibrate.PLANNER in plans and calibrate.ROUND_ROBIN in plans
    assert set(calibrate.FIT_PLANS) < set(plans)
    layouts = set()
    for name, plan in plans.items():
        (module_plan,) = plan.plan.values()
        assert len(module_plan) == 26, name
        assert {ps.compute_kernel for ps in module_plan.values()} == {"customized_kernel"}
        layouts.add(tuple(sorted((n, ps.sharding_type, tuple(ps.ranks or ())) for n, ps in module_plan.items())))
    # every hand-made placement differs (the planner's two may coincide with one of them)
    assert len(layouts) >= 10
    (planner,) = calibrate.candidate_plans()[calibrate.PLANNER].plan.values()
    assert {ps.sharding_type for ps in planner.values()} <= {"table_wise", "row_wise"}  # what CPU training runs


def test_model_charges_imbalance_kernels_and_groups(plans):
    est = {name: calibrate.estimate(plan) for name, plan in plans.items()}
    rr, all0 = est[calibrate.ROUND_ROBIN], est["table_wise all on rank 0"]
    # all tables on one rank: that rank does both ranks' per-id work, and the other rank none
    assert all0["embedding_ms"] == pytest.approx(2 * rr["embedding_ms"], rel=0.02)
    assert all0["kernels_per_rank"] == [1, 0] and rr["kernels_per_rank"] == [1, 1]
    assert all0["step_ms"] > rr["step_ms"]
    # four sharding groups pay four groups' collectives and fixed costs
    four = est["four sharding types"]
    assert len(four["groups"]) == 4
    extra = 3 * (DEFAULT_CPU_COSTS.group_fixed_ms + 4 * DEFAULT_CPU_COSTS.collective_latency_ms)
    assert four["group_fixed_ms"] + four["collective_latency_ms"] == pytest.approx(
        rr["group_fixed_ms"] + rr["collective_latency_ms"] + extra
    )
    # the planner's CPU choice is, in the model, as fast as round-robin table-wise or faster
    assert est[calibrate.PLANNER]["step_ms"] <= rr["step_ms"] + 1e-9


def test_fit_recovers_the_fixed_terms_it_was_made_with(plans):
    from tpurec.planner import cpu_cost

    parts = {n: calibrate.estimate(p) for n, p in plans.items()}
    made = DEFAULT_CPU_COSTS.with_measured(step_fixed_ms=17.0, group_fixed_ms=2.5)
    measured = {
        n: cpu_cost.combine(e["embedding_ms_per_rank"], len(e["groups"]), e["collective_latency_ms"], made)
        for n, e in parts.items()
    }
    fit = calibrate.fit_fixed_terms(parts, measured, DEFAULT_CPU_COSTS)
    # a grid search: to within its fine step (1/2000 of the largest step time)
    assert fit == {"step_fixed_ms": pytest.approx(17.0, abs=0.05), "group_fixed_ms": pytest.approx(2.5, abs=0.05)}


def test_median_interval_against_binomial_tables():
    # n = 20: P(X <= 5) = 0.021 <= 0.025 < P(X <= 6), so the 6th smallest to the 6th largest
    assert calibrate.median_interval(list(range(1, 21))) == (6, 15)
    # n = 5 cannot reach 95% (P(X = 0) = 1/32 > 0.025): the whole range
    assert calibrate.median_interval([3, 1, 2, 5, 4]) == (1, 5)


def test_score_of_measurements_the_model_predicts(plans):
    costs = DEFAULT_CPU_COSTS.with_measured(step_fixed_ms=15.0, group_fixed_ms=1.5)
    truth = {n: calibrate.estimated_ms(p, costs) for n, p in plans.items()}
    # three turns: the truth, 10% slower, 10% faster on every plan; the medians are the truth
    turns = [truth, {n: 1.1 * t for n, t in truth.items()}, {n: 0.9 * t for n, t in truth.items()}]
    r = calibrate.score(plans, turns, DEFAULT_CPU_COSTS)
    assert r["spearman"] == pytest.approx(1.0) and r["max_rel_error"] == pytest.approx(0.0, abs=2e-3)
    assert r["held_out"]["plans"] == len(plans) - len(calibrate.FIT_PLANS)
    assert r["held_out"]["spearman"] == pytest.approx(1.0)
    assert r["spearman_per_round"] == [pytest.approx(1.0)] * 3
    assert r["costs"]["step_fixed_ms"] == pytest.approx(15.0, abs=0.05)
    assert r["planner_s"] == pytest.approx(truth[calibrate.PLANNER] / 1e3, rel=1e-3)
    assert r["round_robin_tw_s"] == pytest.approx(truth[calibrate.ROUND_ROBIN] / 1e3, rel=1e-3)
    assert r["planner_vs_round_robin_tw_per_round"] == [pytest.approx(r["planner_vs_round_robin_tw"], abs=1e-3)] * 3
    assert r["paired_turns"] == 3
    assert r["planner_not_slower"] and not r["planner_slower_beyond_noise"]
    by_plan = {p["plan"]: p for p in r["plans"]}
    assert by_plan[calibrate.ROUND_ROBIN]["measured_rounds_ms"] == [round(x[calibrate.ROUND_ROBIN], 3) for x in turns]
    # a measurement ranked backwards scores -1
    backwards = {n: 1000.0 / t for n, t in truth.items()}
    assert calibrate.score(plans, [backwards], DEFAULT_CPU_COSTS)["spearman"] < 0


def test_planner_slower_in_every_turn_is_slower_beyond_noise(plans):
    # 20 turns, the planner's block 5-15% slower than round-robin's in each (the host's speed drifts)
    turns = []
    for t in range(20):
        base = {n: 30.0 * (1 + 0.02 * t) for n in plans}
        base[calibrate.PLANNER] = base[calibrate.ROUND_ROBIN] * (1.05 + 0.005 * t)
        turns.append(base)
    r = calibrate.score(plans, turns, DEFAULT_CPU_COSTS)
    low, high = r["planner_vs_round_robin_tw_ci95"]
    assert high < 1 and r["planner_slower_beyond_noise"] and not r["planner_not_slower"]
    # alternating 3% faster / 3% slower: the interval straddles 1, and reaches below 1 - margin
    for t, turn in enumerate(turns):
        turn[calibrate.PLANNER] = turn[calibrate.ROUND_ROBIN] * (0.97 if t % 2 else 1.03)
    r = calibrate.score(plans, turns, DEFAULT_CPU_COSTS)
    assert not r["planner_slower_beyond_noise"] and not r["planner_not_slower"]
    # within 1% either way: not slower
    for t, turn in enumerate(turns):
        turn[calibrate.PLANNER] = turn[calibrate.ROUND_ROBIN] * (0.99 if t % 2 else 1.01)
    assert calibrate.score(plans, turns, DEFAULT_CPU_COSTS)["planner_not_slower"]


def test_turns_rotate_and_reverse_so_every_plan_takes_every_place():
    from tpurec.bench.calibrate_worker import turn_order

    assert turn_order(4, 0) == [0, 1, 2, 3]
    assert turn_order(4, 1) == [3, 2, 1, 0]  # the same rotation reversed
    assert turn_order(4, 2) == [1, 2, 3, 0]
    orders = [turn_order(12, t) for t in range(24)]
    assert all(sorted(o) == list(range(12)) for o in orders)
    assert all({o[place] for o in orders} == set(range(12)) for place in range(12))
    # round-robin (0) and the planner (1) are neighbours in all but the turns that wrap them apart
    assert sum(abs(o.index(0) - o.index(1)) == 1 for o in orders) >= 20


@pytest.mark.slow
def test_short_calibration_run_reports_both_statistics():
    names = [calibrate.ROUND_ROBIN, calibrate.PLANNER, *calibrate.FIT_PLANS[1:]]
    r = calibrate.run(steps=4, warmup=2, block=2, rounds=1, paired_steps=4, only=names)
    assert [p["plan"] for p in r["plans"]] == names
    assert all(p["measured_ms"] > 0 and p["estimated_ms"] > 0 for p in r["plans"])
    assert -1.0 <= r["spearman"] <= 1.0 and r["max_rel_error"] == max(p["rel_error"] for p in r["plans"])
    assert r["planner_s"] > 0 and r["round_robin_tw_s"] > 0
    assert r["micro"]["kernel"]["per_id_us"] > 0 and r["micro"]["collective"]["collective_latency_ms"] > 0
    assert 1.0 <= r["micro"]["parallel"]["parallel_ranks"] <= 2.0
    assert r["turns"] == 2 and len(r["measured_turns_ms"][calibrate.PLANNER]) == 2
    c = r["micro"]["collective"]
    assert c["reduce_scatter_bytes_per_s"] > 0 and c["all_gather_bytes_per_s"] > 0
