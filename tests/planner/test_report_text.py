"""The text report at scale: memory in units that fit the figure, identical devices in one row, the
slowest devices named with their tables (text and PNG), and `diff` naming the inputs that changed."""

from __future__ import annotations

import pytest

from tests.helpers.plans import TABLES, two_table_plan
from tpurec.data.catalog import TableSpec
from tpurec.planner import report as I
from tpurec.planner import report_png
from tpurec.planner.report_text import rank_ranges
from tpurec.planner.topology import GiB, format_bytes, parse_slice


@pytest.mark.parametrize(
    "n,text",
    [
        (0, "0 B"),
        (832, "832 B"),
        (1536, "1.50 KiB"),
        (64_512, "63.00 KiB"),
        (3 * 2**20, "3.00 MiB"),
        (95 * GiB, "95.00 GiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_rank_ranges():
    assert rank_ranges([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert rank_ranges(list(range(0, 40, 2)), most=3) == "0,2,4,+17 more"


@pytest.fixture
def report():
    # a: 1000 x 16 table-wise on rank 0; b: 400 x 16 row-wise, 100 rows on each of ranks 0-3
    return I.build_report(two_table_plan(), TABLES, parse_slice("v6e-4"), batch_size=8, optimizer="sgd")


def test_small_tables_read_in_small_units_and_equal_devices_share_a_row(report):
    text = I.format_text(report)
    assert "0.00 GiB" not in text and "0.00 MiB" not in text
    # table a: 133,952 bytes (hand-checked in docs/planner.md, "Storage model")
    assert report["tables"][0]["bytes"] == 133_952 and "130.81 KiB" in text
    rows = text.split("devices (memory;")[1].split("\n\n")[0].splitlines()[2:]
    # rank 0 holds a and a shard of b; ranks 1-3 hold one shard of b each: identical, one row
    assert [(r.split()[0], r.split()[-1]) for r in rows] == [("1", "0"), ("3", "1-3")]


def test_slowest_devices_are_named_with_their_tables(report):
    d0 = report["devices"][0]
    shard_ms = {t["name"]: sum(s["time_ms"] for s in t["shards"] if s["rank"] == 0) for t in report["tables"]}
    assert [t["name"] for t in d0["top_tables"]] == sorted(shard_ms, key=lambda n: -shard_ms[n])
    assert [t["time_ms"] for t in d0["top_tables"]] == pytest.approx(sorted(shard_ms.values(), reverse=True))
    text = I.format_text(report)
    names = ", ".join(f"{t['name']} {t['time_ms']:.3f} ms" for t in d0["top_tables"])
    assert f"  rank 0         {d0['estimated_time_ms']:8.3f} ms: {names}" in text
    # ranks 1-3 are alike (one shard of b each): named once, as a range
    assert f"  ranks 1-3      {report['devices'][1]['estimated_time_ms']:8.3f} ms: b " in text
    # the PNG draws the same names above the slowest devices' time bars
    fig = report_png.figure(report)
    labels = {t.get_text() for t in fig.axes[1].texts}
    assert "\n".join(t["name"] for t in d0["top_tables"]) in labels


def test_diff_lists_the_inputs_that_changed(report):
    assert "inputs: the same" in I.diff_reports(report, report)
    changed = [TABLES[0], TableSpec("b", "fb", 400, 16, 3.0), TableSpec("c", "fc", 10, 8, 1.0)]
    plan = two_table_plan()
    from torchrec.distributed.types import ParameterSharding

    plan.plan[""]["c"] = ParameterSharding("table_wise", "customized_kernel", [1], None)
    other = I.build_report(plan, changed, parse_slice("v6e-4"), batch_size=16, optimizer="adam")
    d = I.diff_reports(report, other)
    assert "inputs: 4 change(s)" in d
    assert "  batch size per device: 8 -> 16" in d and "  optimizer: 'sgd' -> 'adam'" in d
    assert "  table b: pooling_factor 2.0 -> 3.0" in d and "  table c: added in B" in d
