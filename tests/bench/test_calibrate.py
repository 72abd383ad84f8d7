"""`tpurec bench plan --calibrate`: the plans it measures, its statistics, and (slow) one short run."""

from __future__ import annotations

import pytest

from tpurec.bench import calibrate


def test_spearman_against_hand_computed_values():
    assert calibrate.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert calibrate.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # one swapped pair of four: 1 - 6 * (1 + 1) / (4 * 15) = 0.8
    assert calibrate.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ties take the average rank: ranks (0.5, 0.5, 2) against (0, 1, 2)
    assert calibrate.spearman([5, 5, 9], [1, 2, 3]) == pytest.approx(0.8660254, rel=1e-6)


def test_at_least_eight_distinct_plans_each_covering_every_table():
    plans = calibrate.candidate_plans()
    assert len(plans) >= 8
    layouts = set()
    for name, plan in plans.items():
        (module_plan,) = plan.plan.values()
        assert len(module_plan) == 26, name
        assert {ps.compute_kernel for ps in module_plan.values()} == {"customized_kernel"}
        layouts.add(tuple(sorted((n, ps.sharding_type, tuple(ps.ranks or ())) for n, ps in module_plan.items())))
    # every hand-made placement differs (the planner's two may coincide with one of them)
    assert len(layouts) >= 8
    est = {name: calibrate.estimated_ms(plan) for name, plan in plans.items()}
    # all tables on one rank: that rank does all the work of the round-robin plan's two
    assert est["table_wise all on rank 0"] == pytest.approx(2 * est["table_wise round-robin"], rel=0.02)


@pytest.mark.slow
def test_short_calibration_run_reports_both_statistics():
    r = calibrate.run(steps=5, warmup=2, only=2)
    assert [p["plan"] for p in r["plans"]] == ["table_wise round-robin", "table_wise all on rank 0"]
    assert all(p["measured_ms"] > 0 and p["estimated_ms"] > 0 for p in r["plans"])
    assert -1.0 <= r["spearman"] <= 1.0 and r["max_rel_error"] == max(p["rel_error"] for p in r["plans"])
