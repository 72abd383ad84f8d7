"""Compiled CPU loops that read the SparseCore CSR input and order its entries (`reference.py` calls them).

The reference pools with torch's `embedding_bag` (FBGEMM's prefetching gather kernel inside):
forward with one bag per output row, backward with one bag per touched table row over the
activation gradient. These loops give it its bags straight from the CSR. In torch ops that took a
decode into (row, sample) per entry (`nonzero`, `searchsorted`) and a full sort for each direction,
several passes over up to a million entries per step. Here the forward's bags come from one counting
sort by output row (two passes, stable, so each bag keeps CSR order), and the backward's from a merge:
inside a (SparseCore, partition) segment the entries are sorted by id, so each partition's rows are
a merge of num_sc sorted runs. Both orders are the ones the stable torch sorts gave, so the sums are
bit for bit those of the torch reference.

Why numba: a pip wheel (no compiler or build step at install), compiled on first use and cached on
disk (`cache=True`), imported only when a CPU kernel first runs. A C++ torch extension would need a
build at install against the pinned torch and a compiler on every machine.

Output rows: SparseCore c's local sample k * per + i (per = padded / num_sc samples of each feature
per SparseCore, `kernel_input.stacked_samples`) is feature k's sample j = c * per + i; its bag is
k * nj + j (with nk = 1, the op's [device_batch_size, width] layout) or, batch-major, j * nk + k, so
that the bags of `embedding_bag` are already the kernel's [batch, features * dim] output, with no
reshape copy forward or backward. Single-threaded, like FBGEMM's CPU fused backward.

`add_rows` is the float32 table update every optimizer's reference ends with (`add_to_rows`).
"""

from __future__ import annotations

import numba
import numpy as np

_PADDING_ID = 2**31 - 1


@numba.njit(cache=True, nogil=True)
def _bag(sc: int, sample: int, per: int, nk: int, nj: int, batch_major: bool) -> int:
    """Output row of an entry, or -1 for a sample past the output's nj samples per feature."""
    k = sample // per
    j = sc * per + sample - k * per
    if k >= nk or j >= nj:
        return -1
    return j * nk + k if batch_major else k * nj + j


@numba.njit(cache=True, nogil=True)
def bag_order(
    rp: np.ndarray,
    emb: np.ndarray,
    smp: np.ndarray,
    gns: np.ndarray,
    rows_per_partition: int,
    num_rows: int,
    num_sc: int,
    parts: int,
    padded: int,
    nk: int,
    nj: int,
    batch_major: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, weights, offsets): every entry's physical row and gain, grouped by output row
    (bag b is rows[offsets[b]:offsets[b + 1]]), each bag in CSR order."""
    rpw = rp.size // num_sc
    slots = emb.size // num_sc
    per = padded // num_sc
    counts = np.zeros(nk * nj + 1, np.int64)
    for phase in range(2):
        if phase == 1:
            for b in range(nk * nj):  # exclusive prefix sums: counts[b + 1] = where bag b starts
                counts[b + 1] += counts[b]
            rows = np.empty(counts[nk * nj], np.int64)
            weights = np.empty(counts[nk * nj], np.float32)
            fill = counts[:-1].copy()
        for sc in range(num_sc):
            lo = sc * slots
            for p in range(parts):
                hi = sc * slots + rp[sc * rpw + p]
                for pos in range(lo, hi):
                    c = emb[pos]
                    if c == _PADDING_ID:
                        continue
                    b = _bag(sc, smp[pos], per, nk, nj, batch_major)
                    if b < 0:
                        continue
                    if phase == 0:
                        counts[b + 1] += 1
                    else:
                        r = p * rows_per_partition + c
                        if c < 0 or r >= num_rows:
                            raise ValueError("SparseCore input: an embedding id is outside its partition's rows")
                        q = fill[b]
                        rows[q] = r
                        weights[q] = gns[pos]
                        fill[b] = q + 1
                lo = hi
    return rows, weights, counts


@numba.njit(cache=True, nogil=True)
def first_bad_sample(emb: np.ndarray, smp: np.ndarray, per: int) -> int:
    """The first entry (embedding id not padding) whose sample is outside [0, per), or -1: the ops'
    input check (input_checks.py). Counted first without branches (vectorised: 0.7 ns per slot; an
    early-exit loop took 7 ns on shuffled entries), searched for only when some are bad."""
    pad = np.int32(_PADDING_ID)
    limit = np.uint32(per)
    bad = 0
    for i in range(emb.size):
        bad += (emb[i] != pad) & (np.uint32(smp[i]) >= limit)  # unsigned: a negative sample is huge
    if bad == 0:
        return -1
    for i in range(emb.size):
        if emb[i] != pad and np.uint32(smp[i]) >= limit:
            return i
    return -1


@numba.njit(cache=True, nogil=True)
def row_runs(
    rp: np.ndarray, emb: np.ndarray, rows_per_partition: int, num_sc: int, parts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, offsets, order): the touched physical rows in increasing order, and for row u the CSR
    positions order[offsets[u]:offsets[u + 1]] of its entries, SparseCore by SparseCore.

    Inside one (SparseCore, partition) segment entries are sorted by id, so each partition's row
    list is a merge of num_sc sorted runs; an unsorted segment is refused (its rows would repeat)."""
    rpw = rp.size // num_sc
    slots = emb.size // num_sc
    order = np.empty(emb.size, np.int64)
    rows = np.empty(emb.size, np.int64)
    offsets = np.empty(emb.size + 1, np.int64)
    cur = np.empty(num_sc, np.int64)
    end = np.empty(num_sc, np.int64)
    last = np.empty(num_sc, np.int64)
    u = 0
    q = 0
    offsets[0] = 0
    for p in range(parts):
        for sc in range(num_sc):
            # A segment's entries start after the previous segment's padding (8-alignment) and run
            # without padding to its row pointer, so padding is skipped once, here.
            i = sc * slots + (rp[sc * rpw + p - 1] if p > 0 else 0)
            end[sc] = sc * slots + rp[sc * rpw + p]
            while i < end[sc] and emb[i] == _PADDING_ID:
                i += 1
            cur[sc] = i
            last[sc] = -1
        while True:
            best = -1
            for sc in range(num_sc):
                i = cur[sc]
                if i < end[sc]:
                    c = emb[i]
                    if c < last[sc] or c == _PADDING_ID:
                        raise ValueError("SparseCore input: a partition's ids are not sorted")
                    if best < 0 or c < best:
                        best = c
            if best < 0:
                break
            for sc in range(num_sc):
                i = cur[sc]
                e = end[sc]
                while i < e and emb[i] == best:
                    order[q] = i
                    q += 1
                    i += 1
                cur[sc] = i
                last[sc] = best
            rows[u] = p * rows_per_partition + best
            u += 1
            offsets[u] = q
    return rows[:u], offsets[: u + 1], order[:q]


@numba.njit(cache=True, nogil=True)
def entry_bags(
    order: np.ndarray,
    smp: np.ndarray,
    gns: np.ndarray,
    num_sc: int,
    slots: int,
    padded: int,
    nk: int,
    nj: int,
    batch_major: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """(activation-gradient row, gain) of each entry in `order`; row 0 with gain 0 for a sample past
    the gradient's nj samples per feature (none arise from preprocessing)."""
    per = padded // num_sc
    idx = np.empty(order.size, np.int64)
    weights = np.empty(order.size, np.float32)
    for q in range(order.size):
        pos = order[q]
        b = _bag(pos // slots, smp[pos], per, nk, nj, batch_major)
        idx[q] = max(b, 0)
        weights[q] = gns[pos] if b >= 0 else 0.0
    return idx, weights


@numba.njit(cache=True, nogil=True)
def add_rows(table: np.ndarray, rows: np.ndarray, step: np.ndarray) -> None:
    """table[rows[u]] += step[u], row by row (torch's index_add_ on CPU goes through an element-wise
    scatter over an expanded index, several times slower for [rows, 64] float32 steps)."""
    nrows = table.shape[0]
    for u in range(rows.size):
        r = rows[u]
        if r < 0 or r >= nrows:
            raise ValueError("add_rows: row index out of range")
        dst = table[r]
        src = step[u]
        for d in range(src.size):
            dst[d] += src[d]
