"""Compiled counting for `ShardsDemand` (the `tpurec data stats` pass): a batch's entries and
distinct ids per (shard, SparseCore slice, partition) in one pass over the ids, plus one sort for
the shards too large to stamp.

The numpy route (demand.segment_counts) builds a packed key per id in about a dozen full-length
passes and sorts them all. Here one compiled pass (numba, as csr_build: no build step, GIL released,
so `count_stream`'s threads run side by side) walks the batch bag by bag:

* a **stamped** shard (P x its rows fit a small array) keeps, per (slice, row), the last bag that
  touched it: an id is a new distinct id of its segment when its stamp predates this batch, and a
  new entry when its stamp is not this bag (repeats in one bag merge). No sort.
* any other shard's ids get the packed key (segment, row, feature, sample) of the numpy route; those
  keys alone are sorted (numpy's sort, GIL released) and a second pass counts the new keys and the
  new (segment, row) prefixes.

Same figures as the numpy route, checked equal in tests/data/test_data_stats.py. Imported lazily,
only once `csr_build.available()` says numba is there; without numba (or TPUREC_NO_NUMBA=1)
`ShardsDemand` keeps the numpy route.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def walk(
    values: np.ndarray,
    lengths: np.ndarray,
    offsets: np.ndarray,
    stride: int,
    features: np.ndarray,
    feature_table: np.ndarray,
    feature_slot: np.ndarray,
    table_rows: np.ndarray,
    table_first_shard: np.ndarray,
    shard_start: np.ndarray,
    shard_chunk: np.ndarray,
    shard_stamp_at: np.ndarray,
    shard_padded: np.ndarray,
    stamps: np.ndarray,
    bag_base: int,
    per_slice: int,
    p: int,
    pbits: int,
    lbits: int,
    fbits: int,
    sbits: int,
    entries: np.ndarray,
    distinct: np.ndarray,
    keys: np.ndarray,
) -> tuple[int, int]:
    """Counts stamped shards into entries / distinct ([shards * P * P]) and writes the other ids'
    packed keys; returns (number of keys, -1) or (0, position of an id outside its table)."""
    n = 0
    for j in range(features.shape[0]):
        f = features[j]
        t = feature_table[j]
        slot = feature_slot[j]
        rows = table_rows[t]
        s0 = table_first_shard[t]
        s1 = table_first_shard[t + 1]
        pos = offsets[f * stride]
        for b in range(stride):
            length = lengths[f * stride + b]
            bag = bag_base + j * stride + b
            sl = b // per_slice
            for _ in range(length):
                r = np.int64(values[pos])
                if r < 0 or r >= rows:
                    return 0, pos
                s = s0
                if s1 - s0 > 1:  # row-wise: the last shard starting at or before r
                    lo, hi = s0, s1 - 1
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        if shard_start[mid] <= r:
                            lo = mid
                        else:
                            hi = mid - 1
                    s = lo
                local = r - shard_start[s]
                part = local // shard_chunk[s]
                seg = (s * p + sl) * p + part
                at = shard_stamp_at[s]
                if at >= 0:
                    cell = at + sl * shard_padded[s] + local
                    seen = stamps[cell]
                    if seen < bag_base:  # not yet in this batch: a new id of its segment
                        distinct[seg] += 1
                        entries[seg] += 1
                        stamps[cell] = bag
                    elif seen != bag:  # in this batch, not in this bag: a new entry
                        entries[seg] += 1
                        stamps[cell] = bag
                else:
                    seg_key = ((s << pbits) | sl) << pbits | part
                    keys[n] = (((seg_key << lbits) | local) << fbits | slot) << sbits | b
                    n += 1
                pos += 1
    return n, -1


@numba.njit(cache=True, nogil=True)
def count_sorted(
    keys: np.ndarray, low: int, lbits: int, p: int, pbits: int, entries: np.ndarray, distinct: np.ndarray
) -> None:
    """Adds the sorted keys' new entries and new (segment, row) prefixes to the counts."""
    prev_key = np.int64(-1)
    prev_prefix = np.int64(-1)
    mask = (1 << pbits) - 1
    for i in range(keys.shape[0]):
        k = keys[i]
        prefix = k >> low
        packed = prefix >> lbits  # (shard, slice, partition) in bit fields
        seg = ((packed >> (2 * pbits)) * p + ((packed >> pbits) & mask)) * p + (packed & mask)
        if k != prev_key:
            entries[seg] += 1
        if prefix != prev_prefix:
            distinct[seg] += 1
        prev_key = k
        prev_prefix = prefix
