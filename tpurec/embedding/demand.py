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
    per_slice = round_up(max(batch, 1), num_partitions) // num_partitions
    whole = _fullest(ids, samples, features, samples // per_slice)
    return _fullest(ids, samples, features, _segments(ids, samples, rows, num_partitions, batch)) + whole


def _segments(ids, samples, rows: int, num_partitions: int, batch: int) -> np.ndarray:
    p = num_partitions
    per_slice = round_up(max(batch, 1), p) // p
    return (samples // per_slice) * p + ids // (padded_rows(rows, p) // p)


def _fullest(ids, samples, features, segment) -> tuple[int, int]:
    # entries: distinct (segment, feature, sample, id); distinct ids: distinct (segment, id)
    order = np.lexsort((ids, samples, features, segment))
    seg_sorted, cols = segment[order], (features[order], samples[order], ids[order])
    new = np.empty(ids.size, dtype=bool)
    new[0] = True
    new[1:] = seg_sorted[1:] != seg_sorted[:-1]
    for c in cols:
        new[1:] |= c[1:] != c[:-1]
    entries = np.bincount(seg_sorted[new]).max()
    order = np.lexsort((ids, segment))
    seg_sorted, id_sorted = segment[order], ids[order]
    new[0] = True
    new[1:] = (seg_sorted[1:] != seg_sorted[:-1]) | (id_sorted[1:] != id_sorted[:-1])
    distinct = np.bincount(seg_sorted[new]).max()
    return int(entries), int(distinct)
