"""A refused plan still writes its report (`fits: false`) and names the smallest slice per TPU
generation that fits; such a report can be shown but not applied."""

from __future__ import annotations

import json

import pytest

from tests.helpers.plans import run_plan
from tpurec.data.catalog import TableSpec
from tpurec.planner import plan_io, sizing
from tpurec.planner import report as I

# Ten 40M x 128 fp32 tables with SGD: 19.07 GiB of weights each, twice on a TPU (the update's
# transient new table) = 381.5 GiB. v5p-8 has 4 x 90.25 GiB free (361 GiB): refused, v5p-16 fits;
# a v6e device has 28.3 GiB free, so 16 of them (453 GiB) are the first v6e slice above 381.5 GiB
# (v6e-8: 226 GiB); one v7x-4 (8 devices x 91.2 GiB) is the smallest v7x slice and holds them.
BIG = [TableSpec(f"t{i}", f"f{i}", 40_000_000, 128, 1.0) for i in range(10)]
EXPECTED = {"v5p": "v5p-16", "v6e": "v6e-16", "v7x": "v7x-4"}


@pytest.fixture(scope="module")
def refused():
    return I.plan_tables(BIG, "v5p-8", batch_size=256, optimizer="sgd")


def test_refused_plan_has_a_report_with_the_smallest_fitting_slices(refused):
    assert refused["fits"] is False
    assert refused["smallest_fitting_topology"] == EXPECTED
    assert "plan does not fit on v5p-8" in refused["refusal"]
    # the report shows the placement planned without a memory bound: some device is over capacity
    over = [d for d in refused["devices"] if d["hbm_used_bytes"] > d["hbm_capacity_bytes"]]
    assert over and len(refused["tables"]) == 10
    assert sum(d["weights_bytes"] for d in refused["devices"]) == 10 * 40_000_000 * 128 * 4


def test_the_named_slices_fit_and_the_next_smaller_ones_do_not():
    ebc = I.tables_module(BIG)
    bound = sizing.memory_lower_bound(ebc, "sgd")
    assert bound == 2 * 10 * 40_000_000 * 128 * 4
    for name in EXPECTED.values():
        assert I.plan_tables(BIG, name, batch_size=256, optimizer="sgd")["fits"]
    assert I.plan_tables(BIG, "v6e-8", batch_size=256, optimizer="sgd")["fits"] is False


def test_cli_writes_the_refused_report_and_exits_2(tmp_path, capsys):
    tables = tmp_path / "t.json"
    tables.write_text(json.dumps([{"name": t.name, "rows": t.num_embeddings, "dim": 128} for t in BIG]))
    out = tmp_path / "r.json"
    args = ("--tables", str(tables), "--topology", "v5p-8", "--optimizer", "sgd", "--host-tier", "off")
    assert run_plan(*args, "--format", "json", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert "plan does not fit on v5p-8" in err and "smallest fitting slice: v5p-16, v6e-16, v7x-4" in err
    report = json.loads(out.read_text())
    assert report["fits"] is False and report["smallest_fitting_topology"] == EXPECTED
    # `show` re-reports it identically; applying it is refused with the reason
    assert I.report_from_file(out) == report
    with pytest.raises(ValueError, match="does not fit its slice, so it cannot be applied"):
        plan_io.load_plan(out)
    assert run_plan(*args) == 2
    text = capsys.readouterr().out
    assert "fits: NO" in text and "smallest fitting slice: v5p-16, v6e-16, v7x-4" in text
