"""`tpurec bench balance`: the partition balance trade-off of natural-order storage, as documented."""

from tpurec.bench import balance


def test_natural_storage_balances_hashed_ids_and_not_frequency_sorted_ones():
    rows = {(r["tables"], r["partitions"], r["ids"]): r for r in balance.run(batch=512)["rows"]}
    hashed = rows[("one 1M-row table", 4, "hashed")]
    hot_low = rows[("one 1M-row table", 4, "frequency-sorted")]
    assert abs(hashed["max_over_mean_natural"] - hashed["max_over_mean_mod"]) < 0.15
    assert hot_low["max_over_mean_natural"] > 2 * hot_low["max_over_mean_mod"]
    assert all(r["max_over_mean_natural"] >= 1.0 and r["max_over_mean_mod"] >= 1.0 for r in rows.values())
