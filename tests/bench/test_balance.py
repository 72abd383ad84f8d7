"""`tpurec bench balance`: the partition balance trade-off of natural-order storage, as documented."""

import pytest

from tpurec.bench import balance


@pytest.fixture(scope="module")
def rows():
    return {(r["tables"], r["partitions"], r["ids"]): r for r in balance.run(batch=512)["rows"]}


def test_natural_storage_balances_hashed_ids_and_not_frequency_sorted_ones(rows):
    hashed = rows[("one 1M-row table", 4, "hashed")]
    hot_low = rows[("one 1M-row table", 4, "frequency-sorted")]
    assert abs(hashed["max_over_mean_natural"] - hashed["max_over_mean_mod"]) < 0.15
    assert hot_low["max_over_mean_natural"] > 2 * hot_low["max_over_mean_mod"]
    assert all(r["max_over_mean_natural"] >= 1.0 and r["max_over_mean_mod"] >= 1.0 for r in rows.values())


def test_placing_a_stack_by_pooling_factors_evens_hashed_ids_out(rows):
    mlperf = rows[("MLPerf DCNv2 stack, multi-hot", 4, "hashed")]
    assert mlperf["max_over_mean_natural"] > 1.4 and mlperf["max_over_mean_natural_placed"] < 1.25
    tiny = rows[("26 dlrm-tiny tables, stacked", 8, "hashed")]
    assert tiny["max_over_mean_natural_placed"] < tiny["max_over_mean_natural"] - 0.2
    single = rows[("one 1M-row table", 4, "hashed")]  # nothing to place
    assert single["max_over_mean_natural_placed"] == single["max_over_mean_natural"]
