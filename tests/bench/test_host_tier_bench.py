"""`tpurec bench host-tier --quick`: the smoke run CI does (the figures: docs/results.md)."""

from __future__ import annotations

import json

from tpurec.cli import main


def test_the_quick_run_trains_every_contender_to_the_resident_losses(capsys):
    assert (
        main(["bench", "host-tier", "--quick", "--seed", "2", "--load-factors", "0.05,0.5", "--dists", "uniform"]) == 0
    )
    doc = json.loads(capsys.readouterr().out)
    (result,) = doc["results"]
    assert result["dist"] == "uniform" and doc["seed"] == 2 and doc["shape"]["rounds"] == 3
    contenders = result["contenders"]
    assert list(contenders) == ["resident", "host-0.05", "host-0.5"]
    assert all(c["losses_equal_resident"] for c in contenders.values())  # the tier is exact
    assert contenders["resident"]["cache"] is None
    small, large = contenders["host-0.05"]["cache"], contenders["host-0.5"]["cache"]
    # uniform ids over 10,000 rows: a 500-row cache keeps about 5% of a batch's rows, a 5,000-row one
    # never evicts and keeps every row an earlier batch loaded
    assert small["evictions"] > 0 and large["evictions"] == 0
    assert small["hit_rate_after_round_1"] < large["hit_rate_after_round_1"]
    assert 0.02 < small["hit_rate_after_round_1"] < 0.10
    for c in contenders.values():
        assert c["samples_per_s"] > 0 and len(c["vs_resident"]["round_ratios"]) == 3


def test_load_factors_outside_zero_one_are_one_line(capsys):
    assert main(["bench", "host-tier", "--quick", "--load-factors", "0.1,1.5"]) == 2
    assert "--load-factors: shares of the rows in (0, 1)" in capsys.readouterr().err
