"""`tpurec bench plan --calibrate`: the plans it measures, its statistics, its fit, and (slow) one short run."""

from __future__ import annotations

import pytest

from tpurec.bench import calibrate
from tpurec.sharding.cpu_cost import DEFAULT_CPU_COSTS


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
    parts = {n: calibrate.estimate(p) for n, p in plans.items()}
    rest = {n: e["step_ms"] - e["step_fixed_ms"] - e["group_fixed_ms"] for n, e in parts.items()}
    measured = {n: rest[n] + 17.0 + 2.5 * len(parts[n]["groups"]) for n in plans}
    assert calibrate.fit_fixed_terms(parts, measured) == {"step_fixed_ms": pytest.approx(17.0), "group_fixed_ms": 2.5}


def test_score_of_measurements_the_model_predicts(plans):
    costs = DEFAULT_CPU_COSTS.with_measured(step_fixed_ms=15.0, group_fixed_ms=1.5)
    truth = {n: calibrate.estimated_ms(p, costs) for n, p in plans.items()}
    # three rounds: the truth, 10% slower, 10% faster on every plan; the medians are the truth
    rounds = [truth, {n: 1.1 * t for n, t in truth.items()}, {n: 0.9 * t for n, t in truth.items()}]
    r = calibrate.score(plans, rounds, DEFAULT_CPU_COSTS)
    assert r["spearman"] == pytest.approx(1.0) and r["max_rel_error"] == pytest.approx(0.0, abs=1e-3)
    assert r["held_out"]["plans"] == len(plans) - len(calibrate.FIT_PLANS)
    assert r["held_out"]["spearman"] == pytest.approx(1.0)
    assert r["spearman_per_round"] == [pytest.approx(1.0)] * 3
    assert r["costs"]["step_fixed_ms"] == pytest.approx(15.0, abs=1e-3)
    assert r["planner_s"] == pytest.approx(truth[calibrate.PLANNER] / 1e3, rel=1e-3)
    assert r["round_robin_tw_s"] == pytest.approx(truth[calibrate.ROUND_ROBIN] / 1e3, rel=1e-3)
    assert r["planner_vs_round_robin_tw_per_round"] == [r["planner_vs_round_robin_tw"]] * 3
    assert r["planner_not_slower"] and not r["planner_slower_beyond_noise"]
    by_plan = {p["plan"]: p for p in r["plans"]}
    assert by_plan[calibrate.ROUND_ROBIN]["measured_rounds_ms"] == [round(x[calibrate.ROUND_ROBIN], 3) for x in rounds]
    # a measurement ranked backwards scores -1
    backwards = {n: 1000.0 / t for n, t in truth.items()}
    assert calibrate.score(plans, [backwards], DEFAULT_CPU_COSTS)["spearman"] < 0


@pytest.mark.slow
def test_short_calibration_run_reports_both_statistics():
    names = [calibrate.ROUND_ROBIN, calibrate.PLANNER, *calibrate.FIT_PLANS[1:]]
    r = calibrate.run(steps=5, warmup=2, rounds=1, only=names)
    assert [p["plan"] for p in r["plans"]] == names
    assert all(p["measured_ms"] > 0 and p["estimated_ms"] > 0 for p in r["plans"])
    assert -1.0 <= r["spearman"] <= 1.0 and r["max_rel_error"] == max(p["rel_error"] for p in r["plans"])
    assert r["planner_s"] > 0 and r["round_robin_tw_s"] > 0
    assert r["micro"]["kernel"]["per_id_us"] > 0 and r["micro"]["collective"]["collective_latency_ms"] > 0
    assert 1.0 <= r["micro"]["parallel"]["parallel_ranks"] <= 2.0
