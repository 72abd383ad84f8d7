"""Where each table goes inside a stack, so that the SparseCore partitions share the ids evenly.

In natural-order storage (layout.py) partition p holds the stack's rows [p*C, (p+1)*C), and every
table is one contiguous slice, so a table smaller than a partition lies in one or two partitions and
brings all its ids there. In table order, the MLPerf DCNv2 stack (26 tables, 204 M rows, P = 4)
puts 11%, 23%, 35% and 31% of a step's ids on the four partitions (measured on `tpurec bench
pipeline`'s data): the fullest partition sizes every CSR buffer, and on a TPU it is the busiest
SparseCore.

Given each table's expected ids per sample (TorchRec's `ParameterConstraints.pooling_factors`, which
the planner reads too), `balanced_order` places the tables so that the expected ids per partition
are as even as a local search finds (ids spread over a table's rows, as hashed ids are): moving one
table at a time to another place while the fullest partition gets lighter. Deterministic: every
rank computes the same order from the same tables. Only the placement changes: each table stays
contiguous (its state_dict view is unchanged), and features keep their order in the stacked batch.
"""

from __future__ import annotations

from collections.abc import Sequence


def partition_loads(order: Sequence[int], rows: Sequence[int], padded: Sequence[int], ids: Sequence[float],
                    num_partitions: int) -> list[float]:  # fmt: skip
    """Expected ids per partition with the tables laid end to end in `order` (table i: `rows[i]`
    rows holding ids, `padded[i]` rows of storage, `ids[i]` ids per sample spread over its rows)."""
    per = sum(padded) // num_partitions
    out = [0.0] * num_partitions
    offset = 0
    for i in order:
        lo, hi = offset, offset + rows[i]
        p = lo // per if per else 0
        while rows[i] and p < num_partitions and p * per < hi:
            overlap = min(hi, (p + 1) * per) - max(lo, p * per)
            if overlap > 0:
                out[p] += ids[i] * overlap / rows[i]
            p += 1
        offset += padded[i]
    return out


# Table visits the search may spend (a move's score walks every table): about a second of Python, so a
# stack of hundreds of tables is placed as far as that goes instead of taking minutes at kernel
# construction. A count, not a clock, so every rank stops at the same order.
SEARCH_BUDGET = 2_000_000


def balanced_order(rows: Sequence[int], padded: Sequence[int], ids: Sequence[float], num_partitions: int,
                   max_passes: int = 20, budget: int = SEARCH_BUDGET) -> list[int]:  # fmt: skip
    """A placement order of the tables (indices) minimising the fullest partition's expected ids
    (then the sum of squares), by moving single tables; the given order when nothing improves it."""
    n = len(rows)
    order = list(range(n))
    if n < 2 or num_partitions < 2:
        return order
    evaluations = max(1, budget // (n + num_partitions))

    def score(o: list[int]) -> tuple[float, float]:
        loads = partition_loads(o, rows, padded, ids, num_partitions)
        return (round(max(loads), 9), round(sum(x * x for x in loads), 9))

    best = score(order)
    for _ in range(max_passes):
        improved = False
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                evaluations -= 1
                if evaluations < 0:
                    return order
                cand = order[:]
                cand.insert(j, cand.pop(i))
                s = score(cand)
                if s < best:
                    best, order, improved = s, cand, True
        if not improved:
            break
    return order
