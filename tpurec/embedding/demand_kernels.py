"""Compiled counting for `ShardsDemand` (the `tpurec data stats` pass): a batch's entries and
distinct ids per (shard, SparseCore slice, partition), with no sort.

The numpy route (demand.segment_counts) builds a packed key per id in about a dozen full-length
passes and sorts them all. Here (numba, as csr_build: no build step, GIL released, so
`count_stream`'s threads run side by side) one pass over the lengths finds each feature's slices,
then one pass over the ids counts them table by table and, in a table, SparseCore slice by slice:
a segment's ids are those of one (table, slice) group, so a group's distinct ids are known once its
bags are walked, and a set the size of one group is all the memory the count needs.

* Each id's segment: its shard (row-wise tables: guessed as row div the first shard's rows, then
  stepped to the last shard starting at or before the row), its
  row in the shard, and its partition, row div C (C = padded rows / P), taken as a multiply by a
  float reciprocal corrected by one step (exact for rows below 2^52; an int64 division costs several
  times the rest of the id's work), or in the bitmap and stamped loops (tables below 2^27 rows) as
  an integer multiply and shift (`_divider`: a sixth less time an id there than the float's).
* A **stamped** shard (its padded rows fit a small array) keeps, per row, the last bag that touched
  it: an id is a new distinct id of its segment when its stamp predates this group, and a new entry
  when its stamp is not this bag (repeats in one bag merge). One array per shard serves every slice.
  A one-shard table's groups run a loop of their own (`_stamped_group`: the shared loop's tests of
  shard and route per id cost MLPerf DCNv2's small multi-hot tables 40% more time).
* Any other shard's ids go through an open-addressing set (multiplicative hash, linear probing) of
  (table row, last bag) pairs with the same two tests; its slots whose bag predates the group read as
  empty, so it is never cleared. A group uses twice its ids' slots, at most the whole set; a group
  that fills half the set is undone, and the caller doubles the set and counts on from that group,
  so the set ends at most four slots per distinct id of the largest group (the memory bound: no
  array per id).
* A group's counts go to a few interleaved copies (by the id's position) summed at its end:
  consecutive ids of one segment do not wait on each other's store, and a group to be redone has
  nothing to undo.
* A **one-hot** group (a one-shard table whose bags in the slice all hold one id: Criteo's tables,
  MLPerf's pooling-1 ones) needs no bag numbers: every id is an entry, so a partition's entries are
  counted by comparisons with its first row (passes that vectorize), and only distinct ids need a
  test: a table of few rows (padded rows within 8 per id of the group, at most 64 Ki) marks its rows
  in a byte array (a store per id: a hot row's repeats do not wait on each other) counted and
  cleared per partition at the group's end; a table of up to BITMAP_ROWS rows tests and sets its
  rows' bits in a bitmap (a load and a store per id, no branch), keeps each id whose bit was clear,
  counts those per partition with the same comparisons and zeroes the words it touched
  (`_one_hot_bits`); larger ones insert rows into a set of their own, two to four slots per id of the
  largest one-hot group, cleared per group (`_one_hot_group`). The passes over ids index by unsigned
  ints (numba then skips its negative-index check, and the comparisons vectorize). Criteo-kaggle's
  tables: about 3 ns per id on this host (batches out of cache).

Bags are numbered by a counter that runs on across batches (the caller keeps it), so stamps and set
slots from earlier groups and batches never need resetting. Same figures as the numpy route, checked
equal in tests/data/test_data_stats.py and tests/embedding/test_demand_kernels.py. Imported lazily,
only once `csr_build.available()` says numba is there; without numba (or TPUREC_NO_NUMBA=1)
`ShardsDemand` keeps the numpy route.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.extending import intrinsic

# Fibonacci hashing's multiplier (2^64 / golden ratio, as a signed int64): consecutive rows spread
# over the whole set, so a skewed table's hot low rows do not collide
_HASH_MUL = -7046029254386353131
MIN_SET_BITS = 4
# ids ahead whose set slot is prefetched: a set larger than the cache (a multi-hot table of millions of
# rows) makes every probe a memory access, and a prefetch lets these overlap (MLPerf DCNv2's
# tables: a third less time per id)
AHEAD = 16
# a set of at least this many (row, bag) slots (16 bytes each: 1 MiB, half a core's L2 here) is prefetched
PREFETCH_SLOTS = 1 << 16
LANES = 4  # interleaved copies of a group's counts (a power of two)
# a one-hot group marks rows in a byte array when its table has at most this many padded rows per id
# (the marks are counted and cleared per group: a pass over the table's rows)
FLAG_ROWS_PER_ID = 8
FLAG_CELLS = 1 << 16  # the marks' bytes (a quarter of a core's L2 here)
# a group's table of at most this many rows (a bitmap of 16 MiB) may mark its rows in a bitmap,
# test-and-set per id with no branch: a larger one-hot group's table of at most SPARSE_BITS_ROWS rows
# (2 MiB: a core's L2 here), and any group whose table holds at most BITS_WORDS_PER_ID words of rows
# per id of the group (`_multi_hot_bits` for multi-hot ones); sparser groups, their bits scattered
# over more cache lines than their ids, go through a set
ROW_BITS = 27
BITMAP_ROWS = 1 << ROW_BITS
SPARSE_BITS_ROWS = 1 << 24
BITS_WORDS_PER_ID = 16
# `_multi_hot_bits`' slots per id of a table's longest bag (collisions then take 1-3% of ids), and the
# slots at most (a table of longer bags goes through the set)
BAG_SLOTS_PER_ID = 32
BAG_SLOTS = 1 << 16


def _prefetch_typing(typingctx: object, arr: types.Array, index: types.Integer) -> tuple:
    """Hints the cache to fetch arr[index] for writing (LLVM's prefetch: never faults, no result)."""
    sig = types.void(arr, index)

    def codegen(context: object, builder: object, signature: object, args: tuple) -> object:
        ary = context.make_array(signature.args[0])(context, builder, args[0])  # type: ignore[attr-defined]
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")  # type: ignore[attr-defined]
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)  # type: ignore[attr-defined]
        # (write, keep in all cache levels, data cache)
        builder.call(fn, [ptr, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])  # type: ignore[attr-defined]
        return context.get_dummy_value()  # type: ignore[attr-defined]

    return sig, codegen


_prefetch: Any = intrinsic(_prefetch_typing)  # Any: called from compiled code with (array, index) only


def _pointer_typing(typingctx: object, address: types.Integer) -> tuple:
    """An int64 address as a pointer to int64 (numba.carray makes it an array)."""
    sig = types.CPointer(types.int64)(address)

    def codegen(context: object, builder: object, signature: object, args: tuple) -> object:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))  # type: ignore[attr-defined]

    return sig, codegen


_pointer: Any = intrinsic(_pointer_typing)


@numba.njit(cache=True, nogil=True, inline="always")
def _divider(d: int) -> tuple[int, int]:
    """(m, s) with (r * m) >> s == r // d for every 0 <= r < 2^ROW_BITS (Granlund and Montgomery,
    "Division by invariant integers using multiplication", PLDI 1994, theorem 4.2: m * d lies in
    (2^s, 2^s + 2^l] for l = ceil(log2 d)); r * m stays below 2^55: one multiply and a shift an id,
    where the float reciprocal takes two conversions, a multiply and a correction."""
    lg = 0
    while (1 << lg) < d:
        lg += 1
    s = ROW_BITS + lg
    return (1 << s) // d + 1, s


@numba.njit(cache=True, nogil=True, inline="always")
def _key(key_at: np.ndarray, key_sum: np.ndarray, f: int) -> np.ndarray:
    """Key f's ids (int64, contiguous, at address key_at[f]): a batch's keys need not be one array
    (count from the columns as read, no concatenation), the caller holding them while counted."""
    return numba.carray(_pointer(key_at[f]), key_sum[f])


@numba.njit(cache=True, nogil=True)
def key_lengths(
    lengths: np.ndarray, stride: int, per_slice: int, key_sum: np.ndarray, key_max: np.ndarray, slice_start: np.ndarray
) -> None:
    """Per key (feature column of the batch): its ids (key_sum), its longest bag (key_max), and for
    each SparseCore slice the ids of the key before the slice's first bag (slice_start[key, slice];
    the last column is the key's ids)."""
    nslices = slice_start.shape[1] - 1
    for k in range(key_sum.shape[0]):
        base = k * stride
        total = np.int64(0)
        most = np.int64(0)
        for sl in range(nslices):
            slice_start[k, sl] = total
            # a slice's bags as a view, summed and maxed by numpy's reductions (vectorized; an indexed
            # loop checks each index for wrapping and does not)
            bags = lengths[base + min(sl * per_slice, stride) : base + min((sl + 1) * per_slice, stride)]
            if bags.size:
                total += np.int64(bags.sum())
                top = np.int64(bags.max())
                most = top if top > most else most
        slice_start[k, nslices] = total
        key_sum[k] = total
        key_max[k] = most


@numba.njit(cache=True, nogil=True)
def most_per_sample(
    lengths: np.ndarray, stride: int, features: np.ndarray, first: int, last: int, scratch: np.ndarray
) -> int:
    """The most ids one sample has over the features features[first:last] (one table's)."""
    for b in range(stride):
        scratch[b] = 0
    for j in range(first, last):
        base = features[j] * stride
        for b in range(stride):
            scratch[b] += lengths[base + b]
    most = 0
    for b in range(stride):
        if scratch[b] > most:
            most = scratch[b]
    return most


@numba.njit(cache=True, nogil=True)
def _at_or_past(ids: np.ndarray, lo: int, hi: int, p: int, chunk: int, lanes: np.ndarray, column: int) -> None:
    """Adds each partition's count of ids[lo:hi] (ids of one partition, or -1: none) to
    lanes[2 * q * LANES + column]: the ids at or past its first row less those past the next's. Indexed
    by unsigned ints: numba then drops its check for negative indices and the loop vectorizes (a
    third of the time of iterating a view, which does not)."""
    for q in range(p):
        first = q * chunk
        at_or_past = np.int64(0)
        for i in range(np.uint64(lo), np.uint64(hi)):
            at_or_past += ids[i] >= first
        lanes[2 * q * LANES + column] += at_or_past
        if q:
            lanes[2 * (q - 1) * LANES + column] -= at_or_past


@numba.njit(cache=True, nogil=True)
def _one_hot_bits(
    key_at: np.ndarray,
    key_sum: np.ndarray,
    slice_start: np.ndarray,
    features: np.ndarray,
    j0: int,
    j1: int,
    sl: int,
    chunk: int,
    n: int,
    bitmap: np.ndarray,
    fresh: np.ndarray,
    lanes: np.ndarray,
) -> int:
    """_one_hot_group's ids (checked inside the table) by a bitmap of the table's rows: per id one
    word read and written back with its bit set, and the id kept in `fresh` when its bit was clear
    (else -1), no branch and no partition worked out per id; then each partition's entries and distinct
    ids are counted by comparisons over the ids and over `fresh` (passes that vectorize), and the
    words touched are zeroed (the bitmap is left clear for the next group)."""
    p = lanes.shape[0] // (2 * LANES)
    k = 0
    for j in range(j0, j1):
        f = features[j]
        values = _key(key_at, key_sum, f)
        lo = slice_start[f, sl]
        hi = slice_start[f, sl + 1]
        for i in range(np.uint64(lo), np.uint64(hi)):  # (unsigned: no index checks, as _at_or_past)
            r = np.int64(values[i])
            word = np.uint64(r >> 6)
            bit = np.int64(1) << (r & 63)
            old = bitmap[word]
            bitmap[word] = old | bit
            fresh[np.uint64(k)] = r if (old & bit) == 0 else np.int64(-1)
            k += 1
        _at_or_past(values, lo, hi, p, chunk, lanes, 1)
    _at_or_past(fresh, 0, n, p, chunk, lanes, 0)
    for j in range(j0, j1):
        f = features[j]
        values = _key(key_at, key_sum, f)
        for i in range(np.uint64(slice_start[f, sl]), np.uint64(slice_start[f, sl + 1])):
            bitmap[np.uint64(values[i] >> 6)] = 0
    return -1


@numba.njit(cache=True, nogil=True)
def _one_hot_group(
    key_at: np.ndarray,
    key_sum: np.ndarray,
    slice_start: np.ndarray,
    features: np.ndarray,
    j0: int,
    j1: int,
    sl: int,
    rows: int,
    chunk: int,
    n: int,
    flags: np.ndarray,
    oneset: np.ndarray,
    bitmap: np.ndarray,
    lanes: np.ndarray,
    bad_id: np.ndarray,
) -> int:
    """One group of a one-shard table whose bags all hold one id: every id is an entry of its own,
    so only distinct ids need a test, against nothing but this group (no bag numbers). Each
    partition's entries are the ids at or past its first row less those past the next's (branch-free
    passes that vectorize). A table of few rows marks them in `flags` (a store per id, no load: repeats
    of a hot row do not wait on each other), then counts each partition's marks; the others go through
    `oneset`, a set of rows cleared for the group. Counts into `lanes` as count_groups does. Returns
    0 for an id outside the table (its value in bad_id[0]), or -1."""
    p = lanes.shape[0] // (2 * LANES)
    padded = chunk * p
    use_flags = padded <= flags.shape[0] and padded <= FLAG_ROWS_PER_ID * n
    dense = n * BITS_WORDS_PER_ID >= (rows + 63) >> 6
    use_bits = not use_flags and rows <= 64 * bitmap.shape[0] and (rows <= SPARSE_BITS_ROWS or dense)
    bits = MIN_SET_BITS
    while (1 << bits) < 2 * n and (2 << bits) <= oneset.shape[0]:
        bits += 1
    mask = (1 << bits) - 1
    shift = 64 - bits
    for j in range(j0, j1):  # every id in the table before any is marked (no marks left behind)
        f = features[j]
        values = _key(key_at, key_sum, f)
        lo = slice_start[f, sl]
        hi = slice_start[f, sl + 1]
        # views, iterated or reduced by numpy: no index to check for wrapping, so the passes vectorize
        ids = values[lo:hi]
        if lo < hi and (np.int64(ids.min()) < 0 or np.int64(ids.max()) >= rows):
            for pos in range(lo, hi):
                if values[pos] < 0 or values[pos] >= rows:
                    bad_id[0] = values[pos]
                    return 0
    if use_bits:
        return _one_hot_bits(key_at, key_sum, slice_start, features, j0, j1, sl, chunk, n, bitmap, oneset, lanes)
    if not use_flags:
        for slot in range(mask + 1):
            oneset[slot] = -1
    for j in range(j0, j1):
        f = features[j]
        values = _key(key_at, key_sum, f)
        lo = slice_start[f, sl]
        hi = slice_start[f, sl + 1]
        if use_flags:
            _at_or_past(values, lo, hi, p, chunk, lanes, 1)
            for i in range(np.uint64(lo), np.uint64(hi)):
                flags[values[i]] = 1
            continue
        chunk_inv = 1.0 / chunk
        for pos in range(lo, hi):
            r = np.int64(values[pos])
            part = np.int64(r * chunk_inv)  # as count_groups: off by one at most
            if part * chunk > r:
                part -= 1
            elif (part + 1) * chunk <= r:
                part += 1
            li = 2 * (part * LANES + (pos & (LANES - 1)))
            h = ((r * _HASH_MUL) >> shift) & mask
            while oneset[h] >= 0 and oneset[h] != r:
                h = (h + 1) & mask
            lanes[li] += oneset[h] < 0
            lanes[li + 1] += 1
            oneset[h] = r
    if use_flags:
        for q in range(p):
            marks = flags[q * chunk : min((q + 1) * chunk, rows)]
            if marks.size:
                lanes[2 * q * LANES] += np.int64(marks.sum())
                marks[:] = 0
    return -1


@numba.njit(cache=True, nogil=True, inline="always")
def _bag_id(
    r: int | np.integer,
    seg: int | np.integer,
    pos: int,
    start: int,
    values: np.ndarray,
    bitmap: np.ndarray,
    bagset: np.ndarray,
    lanes: np.ndarray,
    bag: int,
    bshift: int,
    bmask: int,
) -> None:
    """_multi_hot_bits' work on one id of row `r` in segment `seg`, at `pos` of a bag that starts at
    `start`: a new distinct id when its row's bit was clear, a new entry unless the row is already
    in the bag."""
    one = np.uint64(1)
    li = np.uint64(2 * (seg * LANES + (pos & (LANES - 1))))  # (unsigned: no index checks)
    word = np.uint64(r >> 6)
    bit = np.int64(1) << (r & 63)
    old = bitmap[word]
    bitmap[word] = old | bit
    lanes[li] += (old & bit) == 0
    # a new entry unless the row's slot holds it for this bag; a slot this bag filled with
    # another row (a collision, rare with BAG_SLOTS_PER_ID) is settled by the bag's ids
    h = np.uint64(((r * _HASH_MUL) >> bshift) & bmask)
    held_by = bagset[h + h + one]
    # zero only when the slot is this bag's and holds another row (a collision): one
    # rare branch (a test of `held` alone would be taken on every repeat in a bag)
    if ((held_by ^ bag) | np.int64(bagset[h + h] == r)) == 0:
        new = 1
        for i in range(np.uint64(start), np.uint64(pos)):
            if values[i] == r:
                new = 0
                break
        lanes[li + one] += new
    else:
        lanes[li + one] += held_by != bag
    bagset[h + h] = r
    bagset[h + h + one] = bag


@numba.njit(cache=True, nogil=True)
def _multi_hot_bits(
    key_at: np.ndarray,
    lengths: np.ndarray,
    stride: int,
    key_sum: np.ndarray,
    slice_start: np.ndarray,
    features: np.ndarray,
    j0: int,
    j1: int,
    sl: int,
    b0: int,
    b1: int,
    rows: int,
    s0: int,
    single: bool,
    uniform: bool,
    chunk: int,
    block_shift: int,
    first_block: int,
    block_seg: np.ndarray,
    seg_row: np.ndarray,
    seg_shard: np.ndarray,
    seg_part: np.ndarray,
    p: int,
    bag: int,
    bitmap: np.ndarray,
    bagset: np.ndarray,
    lanes: np.ndarray,
    bad_id: np.ndarray,
) -> int:
    """One group of a table of at most BITMAP_ROWS rows, any bags: an id is a new distinct id of
    its segment when its row's bit in `bitmap` was clear (a load and a store per id, no branch: the
    partitions hold disjoint rows, so one bitmap of the table's rows serves them all), and a new
    entry when its row is not yet in its bag: `bagset` holds (row, bag) slots, one per hash of a row,
    stamped by the bag number (never cleared), at least BAG_SLOTS_PER_ID per id of the longest bag
    (a few KiB, in L1): no probing, and a slot this bag filled with another row is settled by
    comparing the bag's earlier ids (a third the time of a probed set), behind one branch taken only
    then (a branch on the slot's bag alone, taken at every repeat in a bag, cost MLPerf DCNv2's
    pooling-100 table a sixth of its time). A row-wise table whose shards are P whole partitions each
    (`uniform`) takes an id's segment as a one-shard table does, its row div the partition size by a
    multiply (_divider; shard k holds the table's partitions kP on), not by its block's ranges. Counts
    into `lanes` as count_groups does; the bits set are cleared before returning. Returns 0 for an
    id outside the table (its value in bad_id[0]), or -1."""
    bmask = (bagset.shape[0] >> 1) - 1
    bshift = 64
    while (1 << (64 - bshift)) <= bmask:
        bshift -= 1
    div_m, div_s = _divider(chunk)
    urows = np.uint64(rows)
    n = 0
    bad = -1
    # a set beyond the core's cache: each id's bitmap word fetched AHEAD ids early (a fifth less time)
    ahead_of_bits = rows >= 64 * PREFETCH_SLOTS
    # Two copies of the loop, one per way of finding an id's segment: in one loop, the row-wise way's
    # arrays kept the divided way short of registers (a dozen stack loads and stores per id).
    for j in range(j0, j1):
        f = features[j]
        values = _key(key_at, key_sum, f)
        last_ahead = values.shape[0] - AHEAD if ahead_of_bits else 0
        pos = slice_start[f, sl]
        if single or uniform:
            for b in range(b0, b1):
                length = lengths[f * stride + b]
                start = pos
                for _ in range(length):
                    if pos < last_ahead:
                        _prefetch(bitmap, np.uint64(values[np.uint64(pos + AHEAD)] >> 6))
                    r = np.int64(values[np.uint64(pos)])
                    if np.uint64(r) >= urows:  # (unsigned: a negative id is past every row)
                        bad_id[0] = r
                        bad = 0
                        break
                    # the table's partition, row div the partition size (_divider; shards of P whole
                    # partitions each: shard k holds k * P on), which is the segment's place in
                    # `lanes`, (shard - s0) * P + partition
                    seg = (r * div_m) >> div_s
                    _bag_id(r, seg, pos, start, values, bitmap, bagset, lanes, bag, bshift, bmask)
                    pos += 1
                if bad >= 0:
                    break
                bag += 1
                n += length
        else:
            for b in range(b0, b1):
                length = lengths[f * stride + b]
                start = pos
                for _ in range(length):
                    if pos < last_ahead:
                        _prefetch(bitmap, np.uint64(values[np.uint64(pos + AHEAD)] >> 6))
                    r = np.int64(values[np.uint64(pos)])
                    if np.uint64(r) >= urows:
                        bad_id[0] = r
                        bad = 0
                        break
                    g = block_seg[first_block + (r >> block_shift)]  # row-wise: as count_groups
                    g += seg_row[g + 1] <= r
                    while seg_row[g + 1] <= r:
                        g += 1
                    seg = (seg_shard[g] - s0) * p + seg_part[g]
                    _bag_id(r, seg, pos, start, values, bitmap, bagset, lanes, bag, bshift, bmask)
                    pos += 1
                if bad >= 0:
                    break
                bag += 1
                n += length
        if bad >= 0:
            break
    words = (rows + 63) >> 6
    if bad >= 0 or n * 4 >= words:  # (clearing every word costs less than finding the touched ones)
        bitmap[:words] = 0
        return bad
    for j in range(j0, j1):
        f = features[j]
        values = _key(key_at, key_sum, f)
        lo = slice_start[f, sl]
        hi = slice_start[f, sl + 1]
        for i in range(np.uint64(lo), np.uint64(hi)):
            bitmap[np.uint64(values[i] >> 6)] = 0
    return -1


@numba.njit(cache=True, nogil=True)
def _stamped_group(
    key_at: np.ndarray,
    lengths: np.ndarray,
    stride: int,
    key_sum: np.ndarray,
    slice_start: np.ndarray,
    features: np.ndarray,
    j0: int,
    j1: int,
    sl: int,
    b0: int,
    b1: int,
    rows: int,
    chunk: int,
    at: int,
    group_base: int,
    bag: int,
    stamps: np.ndarray,
    lanes: np.ndarray,
    bad_id: np.ndarray,
) -> int:
    """One group of a one-shard stamped table (count_groups' stamps, its loop with nothing else in
    it): per id one stamp read and written, the partition by a multiply (_divider). Counts into `lanes`
    as count_groups does. Returns 0 for an id outside the table (its value in bad_id[0]), or -1."""
    div_m, div_s = _divider(chunk)
    urows = np.uint64(rows)
    one = np.uint64(1)
    for j in range(j0, j1):
        f = features[j]
        values = _key(key_at, key_sum, f)
        pos = slice_start[f, sl]
        for b in range(b0, b1):
            for _ in range(lengths[f * stride + b]):
                r = np.int64(values[np.uint64(pos)])
                if np.uint64(r) >= urows:  # (unsigned: a negative id is past every row)
                    bad_id[0] = r
                    return 0
                part = (r * div_m) >> div_s
                li = np.uint64(2 * (part * LANES + (pos & (LANES - 1))))
                cell = np.uint64(at + r)
                seen = stamps[cell]
                lanes[li] += seen < group_base  # not yet in this group: a new id
                lanes[li + one] += seen != bag  # not yet in this bag: a new entry
                stamps[cell] = bag
                pos += 1
            bag += 1
    return -1


@numba.njit(cache=True, nogil=True, inline="always")
def _fold_lanes(
    lanes: np.ndarray, entries: np.ndarray, distinct: np.ndarray, s0: int, s1: int, p: int, sl: int
) -> None:
    """A done group's LANES interleaved copies of its counts added to entries / distinct (shards
    s0..s1, SparseCore slice sl)."""
    for s in range(s0, s1):
        for q in range(p):
            li = 2 * ((s - s0) * p + q) * LANES
            seg = (s * p + sl) * p + q
            for lane in range(LANES):
                distinct[seg] += lanes[li + 2 * lane]
                entries[seg] += lanes[li + 2 * lane + 1]


@numba.njit(cache=True, nogil=True, inline="always")
def _group_shape(
    slice_start: np.ndarray,
    features: np.ndarray,
    key_max: np.ndarray,
    shard_stamp_at: np.ndarray,
    j0: int,
    j1: int,
    s0: int,
    s1: int,
    sl: int,
) -> tuple[int, int, bool]:
    """A group's ids (its features' on SparseCore slice sl), its longest bag, and whether a shard of
    its table has no stamps (its ids go to the set)."""
    n = 0
    longest = 0
    for j in range(j0, j1):
        f = features[j]
        n += slice_start[f, sl + 1] - slice_start[f, sl]
        longest = max(longest, key_max[f])
    hashed = False
    for s in range(s0, s1):
        hashed |= shard_stamp_at[s] < 0
    return n, longest, hashed


@numba.njit(cache=True, nogil=True)
def _routed_group(
    key_at: np.ndarray,
    lengths: np.ndarray,
    stride: int,
    key_sum: np.ndarray,
    slice_start: np.ndarray,
    features: np.ndarray,
    j0: int,
    j1: int,
    sl: int,
    b0: int,
    b1: int,
    rows: int,
    s0: int,
    s1: int,
    uniform: bool,
    chunk: int,
    block_shift: int,
    first_block: int,
    block_seg: np.ndarray,
    seg_row: np.ndarray,
    seg_shard: np.ndarray,
    seg_part: np.ndarray,
    shard_stamp_at: np.ndarray,
    stamps: np.ndarray,
    p: int,
    n: int,
    longest: int,
    hashed: bool,
    bag: int,
    flags: np.ndarray,
    oneset: np.ndarray,
    bitmap: np.ndarray,
    bagset: np.ndarray,
    lanes: np.ndarray,
    bad_id: np.ndarray,
) -> int:
    """A group counted by the first of count_groups' own routes that fits it: one-hot
    (_one_hot_group), one stamped shard (_stamped_group), the bitmap (_multi_hot_bits). Returns -3
    when none fits (count_groups' own loop counts it), else the route's status (-1 counted, 0 an id
    outside the table)."""
    if s1 - s0 == 1 and n == (j1 - j0) * (b1 - b0) and longest <= 1:
        return _one_hot_group(
            key_at, key_sum, slice_start, features, j0, j1, sl, rows, chunk, n, flags, oneset, bitmap,
            lanes[: 2 * LANES * p], bad_id,
        )  # fmt: skip
    if s1 - s0 == 1 and shard_stamp_at[s0] >= 0:
        return _stamped_group(
            key_at, lengths, stride, key_sum, slice_start, features, j0, j1, sl, b0, b1, rows, chunk,
            shard_stamp_at[s0], bag, bag, stamps, lanes[: 2 * LANES * p], bad_id,
        )  # fmt: skip
    if (
        hashed
        and rows <= 64 * bitmap.shape[0]
        and n * BITS_WORDS_PER_ID >= (rows + 63) >> 6
        and longest * BAG_SLOTS_PER_ID <= bagset.shape[0] // 2
    ):
        return _multi_hot_bits(
            key_at, lengths, stride, key_sum, slice_start, features, j0, j1, sl, b0, b1, rows, s0, s1 - s0 == 1,
            uniform, chunk, block_shift, first_block, block_seg, seg_row, seg_shard, seg_part, p, bag, bitmap,
            bagset, lanes[: 2 * LANES * p * (s1 - s0)], bad_id,
        )  # fmt: skip
    return -3


@numba.njit(cache=True, nogil=True, inline="always")
def _set_bits(n: int, table: np.ndarray) -> int:
    """The bits of a group's part of the set: twice its ids (every id may be distinct), at most the
    set: a small group's probes stay in a few cache lines."""
    bits = MIN_SET_BITS
    while (1 << bits) < 2 * n and (2 << bits) <= table.shape[0] // 2:
        bits += 1
    return bits


@numba.njit(cache=True, nogil=True)
def count_groups(
    key_at: np.ndarray, lengths: np.ndarray, stride: int, key_sum: np.ndarray, slice_start: np.ndarray,
    features: np.ndarray, table_first_feature: np.ndarray, table_rows: np.ndarray, table_first_shard: np.ndarray,
    table_block_shift: np.ndarray, table_first_block: np.ndarray, table_uniform: np.ndarray, block_seg: np.ndarray,
    seg_row: np.ndarray, seg_shard: np.ndarray, seg_part: np.ndarray, shard_start: np.ndarray, shard_chunk: np.ndarray,
    shard_stamp_at: np.ndarray, stamps: np.ndarray, table: np.ndarray, bag_base: int, first_group: int, per_slice: int,
    p: int, entries: np.ndarray, distinct: np.ndarray, lanes: np.ndarray, key_max: np.ndarray, flags: np.ndarray,
    oneset: np.ndarray, bitmap: np.ndarray, bagset: np.ndarray, bad_id: np.ndarray,
) -> tuple[int, int, int]:  # fmt: skip
    """Counts every table's ids into entries / distinct ([shards * P * P]); key f's ids are
    key_sum[f] int64 at address key_at[f] (`_key`); `table`, the set, holds 2^k (row, bag) pairs.
    Counts the groups (table x nslices + slice) from `first_group` on, each by the first route that
    fits it (_routed_group), else by its own loop: stamps where the table's shards have them,
    else the set. Returns (status, where, the
    next bag number): status -1 when counted; 0 for an id outside its table (where: the table; the
    id in bad_id[0]); or -2 when a group had more distinct ids than half the set (where: that
    group, its counts undone: count on from it with a set twice the size). saved: 2 x P x the most
    shards of a table, scratch."""
    nslices = slice_start.shape[1] - 1
    bag = bag_base
    for t in range(first_group // nslices, table_rows.shape[0]):
        rows = table_rows[t]
        s0 = table_first_shard[t]
        s1 = table_first_shard[t + 1]
        j0 = table_first_feature[t]
        j1 = table_first_feature[t + 1]
        block_shift = table_block_shift[t]
        first_block = table_first_block[t]
        chunk = shard_chunk[s0]
        chunk_inv = 1.0 / chunk
        for sl in range(first_group % nslices if t == first_group // nslices else 0, nslices):
            b0 = sl * per_slice
            b1 = min(b0 + per_slice, stride)
            if b0 >= b1:
                break
            group_base = bag
            # the group's counts go to LANES interleaved copies (an id's lane: its position), added to
            # entries / distinct once the group is done (_fold_lanes): consecutive ids of one segment
            # then do not wait on each other's store, and a group to be redone has nothing to undo
            for k in range(2 * LANES * p * (s1 - s0)):
                lanes[k] = 0
            n, longest, hashed = _group_shape(slice_start, features, key_max, shard_stamp_at, j0, j1, s0, s1, sl)
            bad = _routed_group(
                key_at, lengths, stride, key_sum, slice_start, features, j0, j1, sl, b0, b1, rows, s0, s1,
                table_uniform[t] != 0, chunk, block_shift, first_block, block_seg, seg_row, seg_shard, seg_part,
                shard_stamp_at, stamps, p, n, longest, hashed, bag, flags, oneset, bitmap, bagset, lanes, bad_id,
            )  # fmt: skip
            if bad >= 0:
                return bad, t, bag
            if bad == -1:
                bag += (j1 - j0) * (b1 - b0)  # a bag per feature and sample, as counted
                _fold_lanes(lanes, entries, distinct, s0, s1, p, sl)
                continue
            bits = _set_bits(n, table)
            mask = (1 << bits) - 1
            umask, one = np.uint64(mask), np.uint64(1)  # unsigned indices: no negative-index checks
            shift = 64 - bits
            held = 0
            # prefetching pays only for a set beyond the core's cache (below it, the look-ahead is pure cost)
            ahead_of_set = hashed and mask >= PREFETCH_SLOTS
            for j in range(j0, j1):
                f = features[j]
                values = _key(key_at, key_sum, f)
                last_ahead = values.shape[0] - AHEAD if ahead_of_set else 0
                pos = slice_start[f, sl]
                for b in range(b0, b1):
                    length = lengths[f * stride + b]
                    for _ in range(length):
                        if pos < last_ahead:
                            ahead = np.int64(values[np.uint64(pos + AHEAD)])
                            _prefetch(table, 2 * (((ahead * _HASH_MUL) >> shift) & mask))
                        r = np.int64(values[np.uint64(pos)])
                        if r < 0 or r >= rows:
                            bad_id[0] = r
                            return 0, t, bag
                        if s1 - s0 == 1:  # one shard: the partition by a float reciprocal, off by one at most
                            s = s0
                            local = r
                            part = np.int64(local * chunk_inv)
                            if part * chunk > local:
                                part -= 1
                            elif (part + 1) * chunk <= local:
                                part += 1
                        else:  # row-wise: the (shard, partition) range of the row's block, stepped over
                            # the boundary inside the block (blocks are at most a range long unless the
                            # table has over 1024 ranges' worth of blocks)
                            g = block_seg[first_block + (r >> block_shift)]
                            g += seg_row[g + 1] <= r  # branch-free: which side of a boundary is data
                            while seg_row[g + 1] <= r:
                                g += 1
                            s = seg_shard[g]
                            local = r - shard_start[s]
                            part = seg_part[g]
                        li = np.uint64(2 * (((s - s0) * p + part) * LANES + (pos & (LANES - 1))))
                        at = shard_stamp_at[s]
                        # branch-free: whether an id is new to its group or to its bag is data, not a
                        # pattern a branch predictor learns (a miss costs more than the rest of the id)
                        if at >= 0:
                            cell = np.uint64(at + local)
                            seen = stamps[cell]
                            lanes[li] += seen < group_base  # not yet in this group: a new id
                            lanes[li + one] += seen != bag  # not yet in this bag: a new entry
                            stamps[cell] = bag
                        else:
                            h = np.uint64(((r * _HASH_MUL) >> shift) & mask)
                            while table[h + h + one] >= group_base and table[h + h] != r:
                                h = (h + one) & umask  # a slot of this group holding another row
                            seen = table[h + h + one]
                            fresh = seen < group_base  # an empty slot (or a stale one): r is new
                            lanes[li] += fresh
                            lanes[li + one] += seen != bag
                            table[h + h] = r
                            table[h + h + one] = bag
                            held += fresh
                            if 2 * held > mask + 1:  # (a grown array here costs every access: numba
                                return -2, t * nslices + sl, bag  # then reloads it each time, a third slower)
                        pos += 1
                    bag += 1
            _fold_lanes(lanes, entries, distinct, s0, s1, p, sl)
    return -1, -1, bag
