"""A batch's demand on one table shard's SparseCore buffers, counted as preprocessing counts it.

What `tpurec data stats` measures over a dataset. Preprocessing (preprocess.py) puts every id of the
device batch in one (SparseCore slice, partition) segment: the slice of its sample (the padded batch
cut into P contiguous slices) and the partition of its row (natural row r of a table of R rows lies in
partition r div C, C = padded_rows(R, P) / P: layout.py's renaming). In a segment, repeats of an id
in one sample (and feature) merge into one entry. The limits bound, per segment, the entries
(`max_ids_per_partition`) and the distinct ids (`max_unique_ids_per_partition`).

Counted for the table alone (stack_tables=False), and per SparseCore slice over all partitions. In
a stack the tables lie end to end and a stack partition can hold a whole small table, so the kernel
bounds a stack's segment by each table's per-partition figure times the table partitions a stack
partition can overlap, and never more than its per-slice figure (SparseCoreKernel, table_limits).
"""

from __future__ import annotations

import numpy as np

from tpurec.embedding.constraints import padded_rows, round_up


def partition_demand(
    ids: np.ndarray, samples: np.ndarray, features: np.ndarray, *, rows: int, num_partitions: int, batch: int
) -> tuple[int, int, int, int]:
    """(entries, distinct ids) of the fullest segment of a table shard of `rows` rows, then the same
    of the fullest SparseCore slice (all partitions together).

    ids: local row ids in [0, rows); samples: each id's sample in [0, batch); features: each id's
    feature slot (a table can serve several features; each has its own bag per sample).
    """
    if ids.size == 0:
        return 0, 0, 0, 0
    p = num_partitions
    per_slice = round_up(max(batch, 1), p) // p
    segment = (samples // per_slice) * p + ids // (padded_rows(rows, p) // p)
    # One sort by (segment, id, feature, sample): entries are the distinct keys, distinct ids the
    # distinct (segment, id) prefixes. Packed into one int64 when the fields fit (one numpy sort).
    widths = [int(max(int(x.max()), 0)).bit_length() for x in (ids, features, samples)]
    seg_bits = int(segment.max()).bit_length()
    if seg_bits + sum(widths) <= 63:
        key = segment.astype(np.int64)
        for x, w in zip((ids, features, samples), widths):
            key = (key << w) | x.astype(np.int64)
        key.sort()
        low = widths[1] + widths[2]
        new_entry = np.empty(key.size, dtype=bool)
        new_entry[0] = True
        np.not_equal(key[1:], key[:-1], out=new_entry[1:])
        prefix = key >> low
        new_id = np.empty(key.size, dtype=bool)
        new_id[0] = True
        np.not_equal(prefix[1:], prefix[:-1], out=new_id[1:])
        seg_sorted = key >> (low + widths[0])
    else:
        order = np.lexsort((samples, features, ids, segment))
        seg_sorted, cols = segment[order], (ids[order], features[order], samples[order])
        new_id = np.empty(ids.size, dtype=bool)
        new_id[0] = True
        new_id[1:] = (seg_sorted[1:] != seg_sorted[:-1]) | (cols[0][1:] != cols[0][:-1])
        new_entry = new_id.copy()
        for c in cols[1:]:
            new_entry[1:] |= c[1:] != c[:-1]
    slices = -(-round_up(max(batch, 1), p) // per_slice)
    entries = np.bincount(seg_sorted[new_entry], minlength=slices * p).reshape(slices, p)
    distinct = np.bincount(seg_sorted[new_id], minlength=slices * p).reshape(slices, p)
    # partitions hold disjoint ids: a slice's figures are its segments' sums
    return int(entries.max()), int(distinct.max()), int(entries.sum(1).max()), int(distinct.sum(1).max())
