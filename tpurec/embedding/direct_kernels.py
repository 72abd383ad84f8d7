"""Compiled loops of the direct CPU step (`direct.py`): the stacked KJT slice of one stack put into
batch-major bags for torch's `embedding_bag`, and the fused backward + update over the entries
sorted by row.

Input: the KJT slice as it lays out feature slot k's bags one after another (lengths[k * batch + j]
ids for sample j); stacked row = offsets[k] + id. A bag's gain per id is its weight (1 unweighted),
divided by the bag's length when the slot mean-pools, in float32 as the layout path computes it.

Bags are renumbered batch-major, b = j * slots + k, so that `embedding_bag`'s [bags, dim] result IS
the kernel's [batch, slots * dim] output (feature k's sample j at row j, columns k * dim ..), and its
gradient is read as [bags, dim] in place. The backward sorts one int64 key per entry,
(row << bits) | bag (or | position when ids carry their own weights), with numpy's sort (AVX-512
on x86), so every touched row's entries are adjacent: its gradient is summed once and the optimizer
applied once, rows in increasing order (the table and its state are walked front to back).

Why numba: see `csr_kernels.py` (a wheel, no compiler at install, cached on disk, GIL released).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True, error_model="numpy")
def bags(
    values: np.ndarray,
    lengths: np.ndarray,
    weights: np.ndarray,
    has_w: bool,
    mean: np.ndarray,
    offsets: np.ndarray,
    rows: np.ndarray,
    batch: int,
    want_gains: bool,
    backward: bool,
    key_bits: int,
    keys: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(ids, bag_offsets, gains, bag_of, bad): the slice's stacked rows in batch-major bag order,
    the bags' offsets (include_last_offset), per-id gains when want_gains (else empty), and -1 or the
    input position of the first id outside its slot's table (then nothing else is meaningful).

    keys ([ids] in input order, uint32 or int64, or empty: none wanted): (id << key_bits) | bag, the
    id's row within its table, or with want_gains (weights or mean pooling: each entry has its own
    gain) | batch-major position, whose bag is bag_of[pos] (filled when `backward`)."""
    ns = offsets.size
    n = values.size
    nb = batch * ns
    boff = np.empty(nb + 1, np.int64)
    boff[0] = 0
    for j in range(batch):
        for k in range(ns):
            b = j * ns + k
            boff[b + 1] = boff[b] + lengths[k * batch + j]
    ids = np.empty(n, np.int64)
    gains = np.empty(n if want_gains else 0, np.float32)
    with_keys = keys.size > 0
    bag_of = np.empty(n if want_gains and backward else 0, np.int32)
    pos = 0
    for k in range(ns):
        off = offsets[k]
        hi = rows[k]
        mk = mean[k]
        for j in range(batch):
            length = lengths[k * batch + j]
            b = j * ns + k
            dst = boff[b]
            for e in range(length):
                r = values[pos]
                if r < 0 or r >= hi:
                    return ids, boff, gains, bag_of, pos
                s = r + off
                ids[dst + e] = s
                if want_gains:
                    g = weights[pos] if has_w else np.float32(1.0)
                    # g / length, not g * (1 / length): the layout path's float32 division
                    gains[dst + e] = g / np.float32(max(length, 1)) if mk else g
                    if backward:
                        bag_of[dst + e] = b
                    if with_keys:
                        keys[pos] = (r << key_bits) | (dst + e)
                elif with_keys:
                    keys[pos] = (r << key_bits) | b
                pos += 1
    return ids, boff, gains, bag_of, -1


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _gather(
    keys: np.ndarray,
    i: int,
    row: int | np.int64,  # a key's row (numba's int64)
    key_bits: int,
    gains: np.ndarray,
    bag_of: np.ndarray,
    grad: np.ndarray,
    g: np.ndarray,
) -> int:
    """g[:] = the summed gradient of table row `row`, whose sorted keys start at i; returns the
    index past them. The first entry is assigned rather than added to zeros (the same sum, half the stores).
    Inlined into each update loop (numba IR inlining): called, its caller's loops stopped
    vectorising (measured 1.5-2x slower), as the compiler could no longer tell g from the table."""
    n = keys.size
    mask = (np.int64(1) << key_bits) - 1
    weighted = gains.size > 0
    low = np.int64(keys[i]) & mask
    gain = gains[low] if weighted else np.float32(1.0)
    src = grad[bag_of[low] if weighted else low]
    for d in range(g.size):
        g[d] = gain * src[d]
    i += 1
    while i < n and (keys[i] >> key_bits) == row:
        low = np.int64(keys[i]) & mask
        gain = gains[low] if weighted else np.float32(1.0)
        src = grad[bag_of[low] if weighted else low]
        for d in range(g.size):
            g[d] += gain * src[d]
        i += 1
    return i


# One loop per optimizer over the sorted keys of each table: every touched row once, with its
# summed gradient g, the same float32 expressions as the optimizer's reference update
# (optimizers/*.py). segments: int64 [tables, 3], a table's keys keys[lo:hi] (each table sorted on
# its own) and its first stack row; grad is [bags, dim] (bag b = j * slots + k); gains / bag_of
# empty unless entries carry their own gains. One call per stack: a call per table cost more than
# the work at pooling 1 (numba's dispatch, ~20 us).
# (Measured, numba 0.68: one loop branching on the optimizer, or an update split into several loops
# over d, ran 2-5x slower; error_model="numpy" drops the division-by-zero check that kept sqrt and
# division scalar.)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def update_sgd(
    keys: np.ndarray,
    key_bits: int,
    segments: np.ndarray,
    gains: np.ndarray,
    bag_of: np.ndarray,
    grad: np.ndarray,
    table: np.ndarray,
    neg_lr: np.float32,
) -> None:
    """w += -lr * g."""
    g = np.empty(table.shape[1], np.float32)
    for seg in range(segments.shape[0]):
        lo, hi, base = segments[seg, 0], segments[seg, 1], segments[seg, 2]
        part = keys[lo:hi]
        i = 0
        while i < part.size:
            local = np.int64(part[i]) >> key_bits
            i = _gather(part, i, local, key_bits, gains, bag_of, grad, g)
            row = base + local
            w = table[row]
            for d in range(g.size):
                w[d] += neg_lr * g[d]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def update_adagrad(
    keys: np.ndarray,
    key_bits: int,
    segments: np.ndarray,
    gains: np.ndarray,
    bag_of: np.ndarray,
    grad: np.ndarray,
    table: np.ndarray,
    acc: np.ndarray,
    neg_lr: np.float32,
    eps: np.float32,
) -> None:
    """a += g*g; w += (-lr * g) / (sqrt(a) + eps), element-wise."""
    g = np.empty(table.shape[1], np.float32)
    for seg in range(segments.shape[0]):
        lo, hi, base = segments[seg, 0], segments[seg, 1], segments[seg, 2]
        part = keys[lo:hi]
        i = 0
        while i < part.size:
            local = np.int64(part[i]) >> key_bits
            i = _gather(part, i, local, key_bits, gains, bag_of, grad, g)
            row = base + local
            w = table[row]
            a = acc[row]
            for d in range(g.size):
                a[d] += g[d] * g[d]
                w[d] += (neg_lr * g[d]) / (np.sqrt(a[d]) + eps)


# reassoc: lets the sum of g*g vectorise (3x faster at dim 128); it changes that sum's order only,
# as torch's vector_norm in the reference has its own
@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def update_rowwise_adagrad(
    keys: np.ndarray,
    key_bits: int,
    segments: np.ndarray,
    gains: np.ndarray,
    bag_of: np.ndarray,
    grad: np.ndarray,
    table: np.ndarray,
    acc: np.ndarray,
    neg_lr: np.float32,
    eps: np.float32,
    l2: np.float32,
    scale: np.float32,
) -> None:
    """a += mean(g*g) (one float per row); w += g * (-lr / (sqrt(a) + eps)). Weight decay of the
    touched rows (optimizers/weight_decay.py): L2 adds l2 * w to g (0: none); decoupled scales w by
    `scale` = 1 - lr * weight_decay (1: none) before the update."""
    g = np.empty(table.shape[1], np.float32)
    for seg in range(segments.shape[0]):
        lo, hi, base = segments[seg, 0], segments[seg, 1], segments[seg, 2]
        part = keys[lo:hi]
        i = 0
        while i < part.size:
            local = np.int64(part[i]) >> key_bits
            i = _gather(part, i, local, key_bits, gains, bag_of, grad, g)
            row = base + local
            w = table[row]
            # the decay fused into the row's two passes (one pass each over g and w, as without it):
            # L2 adds l2 * w to g as the squares are summed; decoupled scales w as it is updated,
            # (w * scale) + g * mult rounded as the layout path's scale, then update
            sq = np.float32(0.0)
            if l2 != np.float32(0.0):
                for d in range(g.size):
                    g[d] += l2 * w[d]
                    sq += g[d] * g[d]
            else:
                for d in range(g.size):
                    sq += g[d] * g[d]
            a = acc[row] + sq / np.float32(g.size)
            acc[row] = a
            mult = neg_lr / (np.sqrt(a) + eps)
            if scale != np.float32(1.0):
                for d in range(g.size):
                    w[d] = w[d] * scale + g[d] * mult
            else:
                for d in range(g.size):
                    w[d] += g[d] * mult


@numba.njit(cache=True, nogil=True, error_model="numpy")
def update_adam(
    keys: np.ndarray,
    key_bits: int,
    segments: np.ndarray,
    gains: np.ndarray,
    bag_of: np.ndarray,
    grad: np.ndarray,
    table: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    neg_alpha: np.float32,
    b1: np.float32,
    c1: np.float32,
    b2: np.float32,
    c2: np.float32,
    eps: np.float32,
    l2: np.float32,
    scale: np.float32,
) -> None:
    """m = b1 m + c1 g; v = b2 v + c2 g*g; w += -alpha_t m / (sqrt(v) + eps) (lazy: touched rows
    only), with c1 = 1 - b1 and c2 = 1 - b2 rounded from double as the torch ops round them. Weight
    decay of the touched rows as in `update_rowwise_adagrad` (Adam's is decoupled), in the same pass."""
    g = np.empty(table.shape[1], np.float32)
    for seg in range(segments.shape[0]):
        lo, hi, base = segments[seg, 0], segments[seg, 1], segments[seg, 2]
        part = keys[lo:hi]
        i = 0
        while i < part.size:
            local = np.int64(part[i]) >> key_bits
            i = _gather(part, i, local, key_bits, gains, bag_of, grad, g)
            row = base + local
            w = table[row]
            mr = m[row]
            vr = v[row]
            for d in range(g.size):
                gd = g[d] + l2 * w[d]  # L2 (l2 = 0: none); Adam's own decay is decoupled
                mr[d] = b1 * mr[d] + c1 * gd
                vr[d] = b2 * vr[d] + c2 * (gd * gd)
                # decoupled: w scaled (scale = 1: none) as the layout path scales it, then the step
                w[d] = w[d] * scale + neg_alpha * mr[d] / (np.sqrt(vr[d]) + eps)
