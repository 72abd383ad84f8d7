"""The id limits of a kernel's stacks before any batch (tpurec/embedding/stack_limits.py): the bound its
tables' measured limits give, worked out by hand."""

from __future__ import annotations

from tpurec.embedding.kernel_table import KernelTable
from tpurec.embedding.layout import StackLayout, TableInStack
from tpurec.embedding.settings import TableLimits
from tpurec.embedding.stack_limits import stack_bound


def test_a_stack_partition_overlaps_ceil_c_over_c_t_plus_one_of_a_tables_partitions():
    # 4 partitions; a: 64 rows (16 per own partition), b: 256 rows (64 per own partition); the stack's
    # 320 rows give C = 80 per partition. a: min(4, ceil(80/16) + 1 = 6) = 4; b: min(4, ceil(80/64) + 1) = 3
    lay = StackLayout("s", 8, 4, (TableInStack("a", 64, 0, 64), TableInStack("b", 256, 64, 256)))
    tables = {n: KernelTable(n, r, 8, (f"f_{n}",)) for n, r in (("a", 64), ("b", 256))}
    limits = {"a": TableLimits(8, 2), "b": TableLimits(8, 8)}
    # ids: 8 * 4 + 8 * 3 = 56; unique: 2 * 4 + 8 * 3 = 32
    assert stack_bound(lay, tables, limits, 4) == (56, 32)
    # each table's slice bounds its share: a's 20 ids of a slice under its 32
    sliced = {**limits, "a": TableLimits(8, 2, 20, 5)}
    assert stack_bound(lay, tables, sliced, 4) == (48, 32)  # 20 + 24 = 44 -> 48; 5 + 24 = 29 -> 32
    # a table alone: its own figures, 8-aligned
    alone = StackLayout("t", 8, 4, (TableInStack("b", 256, 0, 256),))
    assert stack_bound(alone, tables, {"b": TableLimits(9, 3)}, 4) == (16, 8)
    assert stack_bound(lay, tables, {"a": limits["a"]}, 4) is None  # b not measured
