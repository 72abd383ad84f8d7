"""The id limits of a kernel's stacks before any batch: the given ones, or those the stack's tables'
measured limits (`tpurec data stats`, KernelSettings.id_limits) bound; None where the first
batch decides (fixed limits) or each batch does."""

from __future__ import annotations

from typing import Mapping

from tpurec.embedding.constraints import SEGMENT_ALIGN, padded_rows, round_up
from tpurec.embedding.kernel_table import KernelTable
from tpurec.embedding.layout import StackLayout
from tpurec.embedding.settings import KernelSettings, TableLimits


def initial_limits(
    layouts: list[StackLayout], tables: Mapping[str, KernelTable], settings: KernelSettings, num_sc: int
) -> list[tuple[int, int] | None]:
    """Per stack: the given limits (8-aligned), or those its tables' measured limits bound
    (`stack_bound`), or None (set by the first batch when limits are fixed)."""
    max_ids, max_uniq = settings.max_ids_per_partition, settings.max_unique_ids_per_partition
    given = None
    if max_ids is not None:
        given = (round_up(max_ids, SEGMENT_ALIGN), round_up(max_uniq or max_ids, SEGMENT_ALIGN))
    limits: list[tuple[int, int] | None] = [given] * len(layouts)
    if settings.id_limits:
        for i, lay in enumerate(layouts):
            bound = stack_bound(lay, tables, settings.id_limits, num_sc)
            if bound is not None:
                limits[i] = bound
    return limits


def stack_bound(
    lay: StackLayout, tables: Mapping[str, KernelTable], id_limits: Mapping[str, TableLimits], num_sc: int
) -> tuple[int, int] | None:
    """Fixed limits for a stack from its tables' measured ones, or None if a table has none.

    Measured per partition of a table alone (C_t rows each); in the stack the tables lie end to end
    and a stack partition (C rows) overlaps at most min(P, ceil(C / C_t) + 1) of a table's own
    partitions, and holds at most the table's whole slice: per table the smaller of the two, summed.
    Exact for a table alone, an upper bound in any stack (a batch over it would still run, in passes).
    A stack of 0-row shards alone gets the smallest limits (8, 8).
    """
    ids = uniq = 0
    for ts in lay.tables:
        t = tables[ts.name]
        if t.num_embeddings == 0:
            # A 0-row shard (a row-wise table with fewer rows than ranks) receives no id: nothing to
            # bound, measured or not (its own partitions would be 0 rows, a division by zero).
            continue
        m = id_limits.get(t.source or t.name)
        if m is None:
            return None
        own = padded_rows(t.num_embeddings, num_sc) // num_sc
        overlap = 1 if len(lay.tables) == 1 else min(num_sc, -(-lay.rows_per_partition // own) + 1)
        big = 2**31
        slice_ids = big if m.max_ids_per_slice is None else m.max_ids_per_slice
        slice_uniq = big if m.max_unique_ids_per_slice is None else m.max_unique_ids_per_slice
        ids += min(m.max_ids_per_partition * overlap, slice_ids)
        uniq += min(m.max_unique_ids_per_partition * overlap, slice_uniq)
    ids = round_up(max(ids, 1), SEGMENT_ALIGN)
    return ids, min(round_up(max(uniq, 1), SEGMENT_ALIGN), ids)
