"""Compiled loops of the direct CPU step (`direct.py`): the stacked KJT slice of one stack put into
batch-major bags for torch's `embedding_bag`, and the fused backward + update over the entries
sorted by row.

Input: the KJT slice as it lays out feature slot k's bags one after another (lengths[k * batch + j]
ids for sample j); stacked row = offsets[k] + id. A bag's gain per id is its weight (1 unweighted),
divided by the bag's length when the slot mean-pools, in float32 as the layout path computes it.

Bags are renumbered batch-major, b = j * slots + k, so that `embedding_bag`'s [bags, dim] result IS
the kernel's [batch, slots * dim] output (feature k's sample j at row j, columns k * dim ..), and its
gradient is read as [bags, dim] in place. The backward sorts one int64 key per entry,
(row << bits) | bag (or | position when ids carry their own weights), with numpy's sort or a radix
sort (`key_sort.py`), so every touched row's entries are adjacent: its gradient is summed once and the optimizer
applied once, rows in increasing order (the table and its state are walked front to back).

Why numba: see `csr_kernels.py` (a wheel, no compiler at install, cached on disk, GIL released).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


@intrinsic
def _fma_intrinsic(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """a * b + c rounded once (llvm.fma.f32, one instruction where the CPU has FMA): FBGEMM's CPU
    kernels are compiled with floating-point contraction, so their `acc += w * x` and `w -= lr * g`
    round once; numba rounds the product and the sum apart unless told."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)

    return sig, codegen


_fma = cast(Callable[[Any, Any, Any], np.float32], _fma_intrinsic)  # as jitted code calls it


@intrinsic
def _prefetch_intrinsic(typingctx, arr, index):  # type: ignore[no-untyped-def]
    """Hints the cache to fetch arr's flat element `index` for writing (llvm.prefetch: no result, never
    faults, so an index past a row's end is harmless)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
        # (write, keep in all cache levels, data cache)
        builder.call(fn, [ptr, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, index), codegen


_prefetch = cast(Callable[[np.ndarray, Any], None], _prefetch_intrinsic)
# Keys ahead whose rows (table and optimizer state) are prefetched. Rows are visited in increasing
# order but far apart (a few hundred ids of a 20k-row table): the hardware prefetcher does not follow
# them, so each row was a cache miss waited for in turn; 16 keys ahead overlaps them (the matrix's
# small and large shapes: SGD's step 1.15-1.3x faster at pooling 20, Adagrad's and row-wise
# Adagrad's 1.1-1.35x at pooling 1; 8 keys ahead gained less at pooling 20).
AHEAD = 16
LINE_FLOATS = 16  # float32 per 64-byte cache line


def _lane_sums(context, builder, g_type, g_value, decay=None):  # type: ignore[no-untyped-def]
    """IR of sum(g * g) as fbgemm's SparseAdaGrad AVX2 loop sums it: eight float32 lanes, lane d mod 8
    adding its squares in turn (each product rounded, then added: no fast-math flag, no fma), then
    ((0+1)+(2+3))+((4+5)+(6+7)). Written as <8 x float> IR because LLVM leaves eight scalar
    accumulators scalar (measured: the row-wise Adagrad update 2x slower at dim 128). The tail's
    squares go into their lanes through a vector of zeros (x + 0 = x for these sums).
    decay = (w's type, w, l2): first g = fma(l2, w, g), stored back (L2 weight decay in the same pass)."""
    garr = context.make_array(g_type)(context, builder, g_value)
    n = builder.extract_value(garr.shape, 0)
    f = ir.FloatType()
    v8 = ir.VectorType(f, 8)
    eight = ir.Constant(n.type, 8)
    wdata = l2v = fma8 = None
    if decay is not None:
        wdata = context.make_array(decay[0])(context, builder, decay[1]).data
        l2v = ir.Constant(v8, None)
        for k in range(8):
            l2v = builder.insert_element(l2v, decay[2], ir.Constant(ir.IntType(32), k))
        # (declare_intrinsic cannot name a vector overload: llvmlite's types lack intrinsic_name)
        fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]), "llvm.fma.v8f32")

    def block(at):  # type: ignore[no-untyped-def]  # the 8 floats of g at element `at`, decayed
        gp = builder.bitcast(builder.gep(garr.data, [at]), v8.as_pointer())
        x = builder.load(gp, align=4)
        if decay is not None:
            wv = builder.load(builder.bitcast(builder.gep(wdata, [at]), v8.as_pointer()), align=4)
            x = builder.call(fma8, [l2v, wv, x])
            builder.store(x, gp, align=4)
        return x

    full = builder.udiv(n, eight)
    acc = cgutils.alloca_once_value(builder, ir.Constant(v8, None))  # zeros
    with cgutils.for_range(builder, full) as loop:
        x = block(builder.mul(loop.index, eight))
        builder.store(builder.fadd(builder.load(acc), builder.fmul(x, x)), acc)
    start = builder.mul(full, eight)
    rest = builder.sub(n, start)
    with builder.if_then(builder.icmp_unsigned("!=", rest, ir.Constant(n.type, 0)), likely=False):
        tail = cgutils.alloca_once_value(builder, ir.Constant(v8, None))
        with cgutils.for_range(builder, rest) as loop:
            at = builder.add(start, loop.index)
            gp = builder.gep(garr.data, [at])
            x = builder.load(gp)
            if decay is not None:
                wx = builder.load(builder.gep(wdata, [at]))
                fma1 = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
                x = builder.call(fma1, [decay[2], wx, x])
                builder.store(x, gp)
            builder.store(builder.insert_element(builder.load(tail), builder.fmul(x, x), loop.index), tail)
        builder.store(builder.fadd(builder.load(acc), builder.load(tail)), acc)
    v = builder.load(acc)
    e = [builder.extract_element(v, ir.Constant(ir.IntType(32), k)) for k in range(8)]
    lo = builder.fadd(builder.fadd(e[0], e[1]), builder.fadd(e[2], e[3]))
    hi = builder.fadd(builder.fadd(e[4], e[5]), builder.fadd(e[6], e[7]))
    return builder.fadd(lo, hi)


@intrinsic
def _sum_squares8_intrinsic(typingctx, g):  # type: ignore[no-untyped-def]
    """sum(g * g) in fbgemm's eight lanes (`_lane_sums`)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return _lane_sums(context, builder, signature.args[0], args[0])

    return types.float32(g), codegen


@intrinsic
def _decay_sum_squares8_intrinsic(typingctx, g, w, l2):  # type: ignore[no-untyped-def]
    """g = fma(l2, w, g) in place, then sum(g * g) in fbgemm's eight lanes, in one pass (`_lane_sums`)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return _lane_sums(context, builder, signature.args[0], args[0], (signature.args[1], args[1], args[2]))

    return types.float32(g, w, types.float32), codegen


_sum_squares8 = cast(Callable[[np.ndarray], np.float32], _sum_squares8_intrinsic)
_decay_sum_squares8 = cast(Callable[[np.ndarray, np.ndarray, Any], np.float32], _decay_sum_squares8_intrinsic)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def slot_ends(lengths: np.ndarray, batch: int, ends: np.ndarray) -> int:
    """ends[k + 1] = the ids of feature slots 0..k (ends[0] = 0), for ends.size - 1 slots of `batch`
    bags; returns the smallest length or 0, whichever is smaller: the KJT checks' sum and sign in one pass, with
    no torch reduction (each costs ~10 us of dispatch in a step whose caches its kernels just evicted)."""
    low = 0
    total = 0
    ends[0] = 0
    for k in range(ends.size - 1):
        for j in range(k * batch, (k + 1) * batch):
            length = lengths[j]
            low = min(low, length)
            total += length
        ends[k + 1] = total
    return low


@numba.njit(cache=True, nogil=True, error_model="numpy")
def bags(
    values: np.ndarray,
    lengths: np.ndarray,
    weights: np.ndarray,
    has_w: bool,
    mean: np.ndarray,
    shared: np.ndarray,
    offsets: np.ndarray,
    rows: np.ndarray,
    batch: int,
    want_gains: bool,
    backward: bool,
    key_bits: int,
    keys: np.ndarray,
    batch_major: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(ids, bag_offsets, weights, scale, bag_of, gains, bad): the slice's stacked rows in the forward's
    bag order and the bags' offsets (include_last_offset); the ids' own weights in that order (has_w,
    else empty); each bag's scale after its sum, 1 / length where the slot mean-pools (has a mean
    slot, else empty); -1 or the input position of the first id outside its slot's table (then
    nothing else is meaningful). The forward's bag order: batch-major (b = j * slots + k, the ids
    moved), or the input's feature-major one (k * batch + j, the ids where they are: see `lookup`).

    Backward (keys [ids] in input order, uint32 or int64, or empty: none wanted): (id << key_bits) |
    low, the id's row within its table and, as FBGEMM's CPU backward walks a row's entries (feature
    of the table, then sample, then position: its csr2csc's stable sort), low = the batch-major bag
    j * slots + k (a table read by one slot: sample order), the bag's feature-major number
    k * batch + j (`shared`: a table several slots read, bag_of[low] its batch-major bag), or with
    want_gains (weights or mean pooling: each entry has its own gain) the input position (bag_of[low]
    its bag, gains[low] its gain: the weight, divided by the bag's length when the slot mean-pools)."""
    ns = offsets.size
    n = values.size
    nb = batch * ns
    boff = np.empty(nb + 1, np.int64)
    boff[0] = 0
    if batch_major:
        for j in range(batch):
            for k in range(ns):
                b = j * ns + k
                boff[b + 1] = boff[b] + lengths[k * batch + j]
    else:
        for b in range(nb):
            boff[b + 1] = boff[b] + lengths[b]
    ids = np.empty(n, np.int64)
    fwd_w = np.empty(n if has_w else 0, np.float32)
    any_mean = False
    for k in range(ns):
        any_mean = any_mean or mean[k]
    scale = np.empty(nb if any_mean else 0, np.float32)
    with_keys = keys.size > 0
    gains = np.empty(n if want_gains and with_keys else 0, np.float32)
    bag_of = np.empty((n if want_gains else nb) if with_keys else 0, np.int32)
    pos = 0
    for k in range(ns):
        off = offsets[k]
        hi = rows[k]
        mk = mean[k]
        for j in range(batch):
            length = lengths[k * batch + j]
            b = j * ns + k
            fb = b if batch_major else k * batch + j  # the bag in the forward's order
            if any_mean:
                # FBGEMM's forward scales the bag's sum by 1 / length (float32), as these do
                scale[fb] = np.float32(1.0) / np.float32(length) if mk and length > 0 else np.float32(1.0)
            if with_keys and not want_gains and shared[k]:
                bag_of[k * batch + j] = b
            dst = boff[fb]
            for e in range(length):
                r = values[pos]
                if r < 0 or r >= hi:
                    return ids, boff, fwd_w, scale, bag_of, gains, pos
                ids[dst + e] = r + off
                if has_w:
                    fwd_w[dst + e] = weights[pos]
                if with_keys:
                    if want_gains:
                        g = weights[pos] if has_w else np.float32(1.0)
                        # g / length, not g * (1 / length): the layout path's float32 division
                        gains[pos] = g / np.float32(max(length, 1)) if mk else g
                        bag_of[pos] = b
                        keys[pos] = (r << key_bits) | pos
                    else:
                        keys[pos] = (r << key_bits) | ((k * batch + j) if shared[k] else b)
                pos += 1
    return ids, boff, fwd_w, scale, bag_of, gains, -1


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
    mapped: bool,
) -> int:
    """g[:] = the summed gradient of table row `row`, whose sorted keys start at i; returns the
    index past them. FBGEMM's CPU order and rounding: entries in key order, the first assigned
    (0 + w * x, one rounding), each next added, weighted ones as fma(w, x, g).
    Inlined into each update loop (numba IR inlining): called, its caller's loops stopped
    vectorising (measured 1.5-2x slower), as the compiler could no longer tell g from the table."""
    n = keys.size
    mask = (np.int64(1) << key_bits) - 1
    weighted = gains.size > 0
    mapped = mapped or weighted  # the key's low part is no bag number: bag_of maps it
    low = np.int64(keys[i]) & mask
    gain = gains[low] if weighted else np.float32(1.0)
    src = grad[bag_of[low] if mapped else low]
    for d in range(g.size):
        g[d] = gain * src[d]
    i += 1
    while i < n and (keys[i] >> key_bits) == row:
        low = np.int64(keys[i]) & mask
        gain = gains[low] if weighted else np.float32(1.0)
        src = grad[bag_of[low] if mapped else low]
        for d in range(g.size):
            g[d] = _fma(gain, src[d], g[d])  # with gain 1: g + x, one rounding either way
        i += 1
    return i


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _sum_squares(g: np.ndarray, lanes8: bool) -> np.float32:
    """sum(g * g) in FBGEMM's CPU order. lanes8: its SparseAdaGrad kernel's (a table with one
    feature), eight float32 lanes (d mod 8, AVX2) each summing its squares in turn, then
    ((0+1)+(2+3))+((4+5)+(6+7)); else its generic loop's (a table shared by several features),
    one running sum."""
    n = g.size
    if not lanes8:
        s = np.float32(0.0)
        for d in range(n):
            s += g[d] * g[d]
        return s
    return _sum_squares8(g)


# One loop per optimizer over the sorted keys of each table: every touched row once, with its
# summed gradient g, the same float32 expressions as the optimizer's reference update
# (optimizers/*.py). segments: int64 [tables, 4], a table's keys keys[lo:hi] (each table sorted on
# its own), its first stack row and 1 if several feature slots share it (FBGEMM's CPU kernels take
# another loop for those: `_sum_squares`); grad is [bags, dim] (bag b = j * slots + k); gains / bag_of
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
    """w = fma(-lr, g, w) (FBGEMM's `w -= lr * g`, contracted)."""
    g = np.empty(table.shape[1], np.float32)
    for seg in range(segments.shape[0]):
        lo, hi, base = segments[seg, 0], segments[seg, 1], segments[seg, 2]
        shared = segments[seg, 3] != 0
        part = keys[lo:hi]
        i = 0
        while i < part.size:
            if i + AHEAD < part.size:  # the row AHEAD keys on: its lines on their way (AHEAD)
                ahead = base + (np.int64(part[i + AHEAD]) >> key_bits)
                for d in range(0, g.size, LINE_FLOATS):
                    _prefetch(table, ahead * g.size + d)
            local = np.int64(part[i]) >> key_bits
            i = _gather(part, i, local, key_bits, gains, bag_of, grad, g, shared)
            row = base + local
            w = table[row]
            for d in range(g.size):
                w[d] = _fma(neg_lr, g[d], w[d])


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
    eps: np.float64,
) -> None:
    """a += g*g; w += (-lr * g) / (sqrt(a) + eps), element-wise, in FBGEMM's CPU precisions: its
    `w -= learning_rate * g / (sqrt(m) + eps)` takes lr * g in float32 (a float lr), the square root,
    eps (a double) and the division and subtraction in float64, then rounds to float32 once."""
    g = np.empty(table.shape[1], np.float32)
    for seg in range(segments.shape[0]):
        lo, hi, base = segments[seg, 0], segments[seg, 1], segments[seg, 2]
        shared = segments[seg, 3] != 0
        part = keys[lo:hi]
        i = 0
        while i < part.size:
            if i + AHEAD < part.size:  # the row AHEAD keys on: its lines on their way (AHEAD)
                ahead = base + (np.int64(part[i + AHEAD]) >> key_bits)
                for d in range(0, g.size, LINE_FLOATS):
                    _prefetch(table, ahead * g.size + d)
                    _prefetch(acc, ahead * g.size + d)
            local = np.int64(part[i]) >> key_bits
            i = _gather(part, i, local, key_bits, gains, bag_of, grad, g, shared)
            row = base + local
            w = table[row]
            a = acc[row]
            for d in range(g.size):
                a[d] = _fma(g[d], g[d], a[d])
                step = np.float64(neg_lr * g[d]) / (np.sqrt(np.float64(a[d])) + eps)
                w[d] = np.float32(np.float64(w[d]) + step)


@numba.njit(cache=True, nogil=True, error_model="numpy")
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
    """a += mean(g*g) (one float per row); w = fma(g, -lr / (sqrt(a) + eps), w), FBGEMM's CPU
    arithmetic (`_sum_squares`). Weight decay of the touched rows (optimizers/weight_decay.py): L2
    adds l2 * w to g (0: none); decoupled scales w by `scale` = 1 - lr * weight_decay (1: none)
    before the update."""
    g = np.empty(table.shape[1], np.float32)
    for seg in range(segments.shape[0]):
        lo, hi, base = segments[seg, 0], segments[seg, 1], segments[seg, 2]
        shared = segments[seg, 3] != 0
        part = keys[lo:hi]
        i = 0
        while i < part.size:
            if i + AHEAD < part.size:  # the row AHEAD keys on: its lines on their way (AHEAD)
                ahead = base + (np.int64(part[i + AHEAD]) >> key_bits)
                _prefetch(acc, ahead)
                for d in range(0, g.size, LINE_FLOATS):
                    _prefetch(table, ahead * g.size + d)
            local = np.int64(part[i]) >> key_bits
            i = _gather(part, i, local, key_bits, gains, bag_of, grad, g, shared)
            row = base + local
            w = table[row]
            if l2 == np.float32(0.0):
                sq = _sum_squares(g, not shared)
            elif shared:
                for d in range(g.size):
                    g[d] = _fma(l2, w[d], g[d])
                sq = _sum_squares(g, False)
            else:  # the decay fused into the eight lanes' pass over g
                sq = _decay_sum_squares8(g, w, l2)
            a = acc[row] + sq / np.float32(g.size)
            acc[row] = a
            mult = neg_lr / (np.sqrt(a) + eps)
            if scale != np.float32(1.0):
                for d in range(g.size):
                    w[d] = _fma(g[d], mult, w[d] * scale)
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
        shared = segments[seg, 3] != 0
        part = keys[lo:hi]
        i = 0
        while i < part.size:
            if i + AHEAD < part.size:  # the row AHEAD keys on: its lines on their way (AHEAD)
                ahead = base + (np.int64(part[i + AHEAD]) >> key_bits)
                for d in range(0, g.size, LINE_FLOATS):
                    _prefetch(table, ahead * g.size + d)
                    _prefetch(m, ahead * g.size + d)
                    _prefetch(v, ahead * g.size + d)
            local = np.int64(part[i]) >> key_bits
            i = _gather(part, i, local, key_bits, gains, bag_of, grad, g, shared)
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
