"""Compiled loops of the CSR build (`csr_build.py` calls them): sort keys, merge of repeats, placement.

Why numba: see `csr_kernels.py` (a wheel, no compiler at install, cached on disk, GIL released).
Imported only by `csr_build._kernels`, lazily: importing the kernel never loads numba.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def keys_pass(
    values: np.ndarray,
    lengths: np.ndarray,
    batch: int,
    per: int,
    offsets: np.ndarray,
    rows: np.ndarray,
    mean: np.ndarray,
    weights: np.ndarray,
    has_w: bool,
    rpp: int,
    parts: int,
    cbits: int,
    sbits: int,
    ibits: int,
    keys: np.ndarray,
    gains: np.ndarray,
) -> int:
    """Sort keys [segment | local id | sample in slice | input position]; gains when not uniform.
    Returns -1, or the position of the first id out of its table's range."""
    pos = 0
    nbags = lengths.shape[0]
    inv_rpp = 1.0 / rpp
    for j in range(nbags):
        k = j // batch
        b = j - k * batch
        length = lengths[j]
        # SparseCore sl gets samples sl*per..(sl+1)*per-1 of every feature (kernel_input.stacked_samples)
        sl = b // per
        sin = k * per + (b - sl * per)
        hi = rows[k]
        off = offsets[k]
        for _ in range(length):
            r = np.int64(values[pos])
            if r < 0 or r >= hi:
                return pos
            s = r + off
            # s // rpp without a 64-bit division per id (the pass's cost): a float estimate,
            # corrected by one step either way.
            part = np.int64(s * inv_rpp)
            if part * rpp > s:
                part -= 1
            elif (part + 1) * rpp <= s:
                part += 1
            local = s - part * rpp
            seg = sl * parts + part
            key = (((seg << cbits) | local) << sbits) | sin
            if ibits:
                key = (key << ibits) | pos
                g = np.float32(weights[pos]) if has_w else np.float32(1.0)
                if mean[k]:
                    g = g / np.float32(max(length, 1))
                gains[pos] = g
            keys[pos] = key
            pos += 1
    return -1


@numba.njit(cache=True, nogil=True)
def merge_pass(
    keys: np.ndarray,
    gains: np.ndarray,
    ibits: int,
    sbits: int,
    seg_shift: int,
    counts: np.ndarray,
    ucounts: np.ndarray,
    out_gain: np.ndarray,
) -> int:
    """Merges repeats of (segment, local id, sample) in place: keys[:m] become the entries
    (without position bits), out_gain[:m] their float32 gain sums in input order. Returns m."""
    n = keys.shape[0]
    m = 0
    mask = (np.int64(1) << ibits) - 1
    prev = np.int64(-1)
    for i in range(n):
        raw = np.int64(keys[i])
        k = raw >> ibits
        g = gains[raw & mask] if ibits else np.float32(1.0)
        if k != prev:
            seg = k >> seg_shift
            if m == 0 or (k >> sbits) != (prev >> sbits):
                ucounts[seg] += 1
            counts[seg] += 1
            keys[m] = k
            out_gain[m] = g + np.float32(0.0)  # 0 + g, as the numpy route's float32 sum
            m += 1
            prev = k
        else:
            out_gain[m - 1] = out_gain[m - 1] + g
    return m


@numba.njit(cache=True, nogil=True)
def place_pass(
    keys: np.ndarray,
    ugain: np.ndarray,
    counts: np.ndarray,
    num_sc: int,
    parts: int,
    slots: int,
    cbits: int,
    sbits: int,
    emb: np.ndarray,
    smp: np.ndarray,
    gns: np.ndarray,
    row_pointers: np.ndarray,
    rpw: int,
    pad: int,
) -> None:
    """Segment p of SparseCore s starts at the 8-aligned sum of earlier segments; the rest is padding."""
    src = 0
    cmask = (np.int64(1) << cbits) - 1
    smask = (np.int64(1) << sbits) - 1
    for s in range(num_sc):
        base = s * slots
        at = 0
        for p in range(parts):
            c = counts[s * parts + p]
            for e in range(c):
                k = np.int64(keys[src + e])
                emb[base + at + e] = (k >> sbits) & cmask
                smp[base + at + e] = k & smask
                gns[base + at + e] = ugain[src + e]
            src += c
            end = at + c
            row_pointers[s * rpw + p] = end
            aligned = (c + 7) // 8 * 8
            for e in range(end, at + aligned):
                emb[base + e] = pad
                smp[base + e] = pad
                gns[base + e] = np.nan
            at += aligned
        for p in range(parts, rpw):
            row_pointers[s * rpw + p] = at
        for e in range(at, slots):
            emb[base + e] = pad
            smp[base + e] = pad
            gns[base + e] = np.nan


# ---- `preprocess_tables`'s compiled route: natural ids of several tables, MOD partitioning ----------


@numba.njit(cache=True, nogil=True)
def tables_keys_pass(
    ids: np.ndarray,
    samples: np.ndarray,
    starts: np.ndarray,
    row_keys: np.ndarray,
    parts: int,
    pshift: int,
    cbits: int,
    sbits: int,
    ibits: int,
    keys: np.ndarray,
) -> None:
    """Table t's sort keys in keys[starts[t]:starts[t + 1]]: [segment | local id | sample in slice]
    (`row_keys[sample]` holds the sample's slice and its index in it) and, when ibits, the id's
    position in its table below them. MOD partitioning: partition id % parts, local id id // parts
    (a shift and a mask when parts is a power of two, pshift >= 0)."""
    pmask = parts - 1
    for t in range(starts.shape[0] - 1):
        a = starts[t]
        for i in range(a, starts[t + 1]):
            r = np.int64(ids[i])
            if pshift >= 0:
                part = r & pmask
                local = r >> pshift
            else:
                part = r % parts
                local = r // parts
            key = (((part << cbits) | local) << sbits) + row_keys[samples[i]]
            if ibits:
                key = (key << ibits) | (i - a)
            keys[i] = key


@numba.njit(cache=True, nogil=True)
def tables_count_pass(
    keys: np.ndarray, starts: np.ndarray, ibits: int, sbits: int, seg_shift: int, tseg: int, counts: np.ndarray,
    ucounts: np.ndarray,
) -> None:  # fmt: skip
    """Entries (distinct (id, sample)) and distinct ids per (table, segment) of the sorted keys."""
    for t in range(starts.shape[0] - 1):
        prev = np.int64(-1)
        for i in range(starts[t], starts[t + 1]):
            k = np.int64(keys[i]) >> ibits
            if k != prev:
                seg = t * tseg + (k >> seg_shift)
                if (k >> sbits) != (prev >> sbits):
                    ucounts[seg] += 1
                counts[seg] += 1
                prev = k


@numba.njit(cache=True, nogil=True)
def tables_merge_place_pass(
    keys: np.ndarray,
    gains: np.ndarray,
    uniform_gain: np.float32,
    starts: np.ndarray,
    ibits: int,
    sbits: int,
    seg_shift: int,
    cbits: int,
    num_sc: int,
    parts: int,
    slots: np.ndarray,
    out_start: np.ndarray,
    max_ids: np.ndarray,
    max_uniq: np.ndarray,
    counts: np.ndarray,
    ucounts: np.ndarray,
    emb: np.ndarray,
    smp: np.ndarray,
    gns: np.ndarray,
    row_pointers: np.ndarray,
    rpw: int,
    pad: int,
) -> int:
    """merge_pass and place_pass in one pass over the sorted keys, for limits known in advance (fixed
    limits: the buffer shapes do not depend on the batch; or counted first): each segment's merged
    entries are written straight into its place. For each table of a group (a stack is one table),
    each with its own limits, slots and place in the shared buffers; the gains of table t are
    gains[starts[t] + position] (or all `uniform_gain`). Returns the first table over a limit (the
    caller then takes the numpy route), else -1. Same entries, gains (float32 sums in input order)
    and padding as the two passes."""
    mask = (np.int64(1) << ibits) - 1
    cmask = (np.int64(1) << cbits) - 1
    smask = (np.int64(1) << sbits) - 1
    tseg = num_sc * parts
    for t in range(starts.shape[0] - 1):
        i = starts[t]
        n = starts[t + 1]
        for sc in range(num_sc):
            base = out_start[t] + sc * slots[t]
            at = 0
            for p in range(parts):
                seg = sc * parts + p
                start = base + at
                c = 0
                u = 0
                prev = np.int64(-1)
                while i < n:
                    raw = np.int64(keys[i])
                    k = raw >> ibits
                    if (k >> seg_shift) != seg:
                        break
                    g = gains[starts[t] + (raw & mask)] if ibits else uniform_gain
                    if k != prev:
                        if c == max_ids[t]:
                            return t
                        if c == 0 or (k >> sbits) != (prev >> sbits):
                            u += 1
                        emb[start + c] = (k >> sbits) & cmask
                        smp[start + c] = k & smask
                        gns[start + c] = g + np.float32(0.0)  # 0 + g, as the numpy route's float32 sum
                        c += 1
                        prev = k
                    else:
                        gns[start + c - 1] = gns[start + c - 1] + g
                    i += 1
                if u > max_uniq[t]:
                    return t
                counts[t * tseg + seg] = c
                ucounts[t * tseg + seg] = u
                row_pointers[(t * num_sc + sc) * rpw + p] = at + c
                aligned = (c + 7) // 8 * 8
                for e in range(start + c, start + aligned):
                    emb[e] = pad
                    smp[e] = pad
                    gns[e] = np.nan
                at += aligned
            for p in range(parts, rpw):
                row_pointers[(t * num_sc + sc) * rpw + p] = at
            for e in range(base + at, base + slots[t]):
                emb[e] = pad
                smp[e] = pad
                gns[e] = np.nan
    return -1
