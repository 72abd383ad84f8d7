"""Compiled CSR build of one stack: a KJT slice -> the SparseCore input, in three passes over the ids.

The same result as `kernel_input.KernelInput.stack_input`'s torch + numpy route (ids checked, shifted into the stack,
renamed for MOD partitioning, then `preprocess.preprocess`), bit for bit, but without its ~20
full-length temporaries: one compiled pass builds the sort keys (and gains), numpy sorts them
(AVX-512 sort, GIL released), one pass merges repeats and counts the segments, one pass writes the
padded buffers; with fixed limits (a TPU's case: the buffer shape is known before the batch) the
last two are one pass that writes each segment's merged entries in place. Numba
(`@numba.njit(cache=True, nogil=True)`) because the work is tight loops that numpy can only express as
many passes, it needs no build step (a C++ extension would need a compiler
at install), compiles once per machine into numba's cache, and releases the GIL so pipeline workers
run in parallel on threads. The loops live in `csr_build_kernels.py`, imported lazily: without numba
(or with TPUREC_NO_NUMBA=1) the kernel keeps its numpy route.

Anything unusual (an id out of range, keys over 62 bits, a limit exceeded, empty input) returns None
and the caller takes the numpy route, which raises or drops exactly as documented.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from tpurec.embedding.constraints import PADDING_ID, SEGMENT_ALIGN
from tpurec.runtime import env_flags

_KERNELS: tuple[Any, ...] | bool | None = None  # the loops once loaded; False: numba missing


class _BufferPool:
    """Output buffers recycled once the tensors viewing them are gone. A step's CSR buffers are tens
    of MB (the MLPerf stack: 24 MB); fresh ones are fresh pages, which the kernel zeroes and maps on
    first touch, about a third of the build's time (measured on the bench pipeline workload). A
    buffer is handed out as a view; when the view dies, a finalizer puts the base back."""

    def __init__(self, per_key: int = 8) -> None:
        self.per_key = per_key
        self.free: dict[tuple, list[np.ndarray]] = {}
        self.lock = threading.Lock()

    def get(self, size: int, dtype: npt.DTypeLike) -> np.ndarray:
        key = (size, np.dtype(dtype).str)
        with self.lock:
            stack = self.free.get(key)
            base = stack.pop() if stack else None
        if base is None:
            base = np.empty(size, dtype)
        view = base[:]
        weakref.finalize(view, self._put, key, base)
        return view

    def _put(self, key: tuple[int, str], base: np.ndarray) -> None:
        with self.lock:
            stack = self.free.setdefault(key, [])
            if len(stack) < self.per_key:
                stack.append(base)


_POOL = _BufferPool()


def available() -> bool:
    """True when numba is importable and not switched off (TPUREC_NO_NUMBA=1)."""
    return not env_flags.is_on("TPUREC_NO_NUMBA") and _kernels() is not None


def prepare() -> None:
    """What every build shares, decided now in the calling thread: the sort this CPU runs faster
    (key_sort.use_radix, timed once), which builds side by side on threads would time amid each other."""
    if _kernels() is not None:
        from tpurec.embedding import key_sort

        key_sort.use_radix()


def _kernels() -> tuple[Any, ...] | None:
    global _KERNELS
    if _KERNELS is None:
        try:
            from tpurec.embedding import csr_build_kernels as k  # numba, loaded on first use
        except ImportError:
            _KERNELS = False
        else:
            _KERNELS = (k.keys_pass, k.merge_pass, k.place_pass, k.tables_merge_place_pass)
    return _KERNELS if isinstance(_KERNELS, tuple) else None


def tables_csr(
    ids: np.ndarray,
    samples: np.ndarray,
    gains: np.ndarray | None,
    uniform_gain: float,
    starts: np.ndarray,
    *,
    device_batch_size: int,
    num_sc: int,
    parts: int,
    max_ids: list[int | None],
    max_uniq: list[int | None],
    row_keys: Any,
) -> tuple[np.ndarray, ...] | None:
    """`preprocess_tables`'s work for a group of tables (natural ids, MOD partitioning), compiled:
    one pass builds every table's sort keys, numpy sorts each table's, one pass merges repeats and
    writes the padded buffers (a count pass before it when a limit is left to the batch). The same
    buffers as the numpy route, bit for bit. ids/samples/gains: the tables' end to end (int64,
    int64, float32; gains None when all equal `uniform_gain`), table t at starts[t]:starts[t + 1];
    ids and samples already range-checked. row_keys(seg_shift): the key bits of each sample.
    Returns (row_pointers [T, num_sc * rpw], emb, smp, gns, slots per table, counts, ucounts
    [T, num_sc, parts], max_ids, max_uniq), or None (a limit exceeded, keys over 62 bits, no ids):
    then the numpy route raises or drops as documented."""
    if _kernels() is None or ids.size == 0:
        return None
    from tpurec.embedding import csr_build_kernels as k

    num_tables = starts.size - 1
    per_sc = device_batch_size // num_sc
    tseg = num_sc * parts
    pshift = parts.bit_length() - 1 if parts & (parts - 1) == 0 else -1
    cbits = (int(ids.max()) // parts).bit_length()
    sbits = (per_sc - 1).bit_length()
    seg_shift = cbits + sbits
    ibits = 0 if gains is None else max(int(np.diff(starts).max()) - 1, 1).bit_length()
    key_bits = (tseg - 1).bit_length() + seg_shift + ibits
    if key_bits > 62:
        return None
    keys = np.empty(ids.size, np.uint32 if key_bits <= 32 else np.int64)
    rk = row_keys(seg_shift)
    k.tables_keys_pass(ids, samples, starts, rk, parts, pshift, cbits, sbits, ibits, keys)
    from tpurec.embedding import key_sort

    tables = np.zeros((num_tables, 2), np.int64)
    tables[:, 0], tables[:, 1] = starts[:-1], starts[1:]
    key_sort.sort_keys(keys, tables, 0, key_bits)  # each table's keys (numpy's sort or a radix sort)
    counts = np.zeros(num_tables * tseg, np.int64)
    ucounts = np.zeros(num_tables * tseg, np.int64)
    if any(m is None for m in max_ids) or any(u is None for u in max_uniq):
        k.tables_count_pass(keys, starts, ibits, sbits, seg_shift, tseg, counts, ucounts)
        per_table = counts.reshape(num_tables, tseg).max(1) if tseg else np.zeros(num_tables, np.int64)
        mi = np.array([m if m is not None else max(int(c), 1) for m, c in zip(max_ids, per_table)], np.int64)
    else:
        mi = np.array(max_ids, np.int64)
    mu = np.array([u if u is not None else m for u, m in zip(max_uniq, mi.tolist())], np.int64)
    # slots per SparseCore: round_up(max_ids, 8) x P; the limits hold every segment (else the pass
    # stops), so no segment needs more
    slots = (mi + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN * parts
    size = num_sc * slots
    out_start = np.zeros(num_tables, np.int64)
    np.cumsum(size[:-1], out=out_start[1:])
    total = int(size.sum())
    emb, smp, gns = np.empty(total, np.int32), np.empty(total, np.int32), np.empty(total, np.float32)
    rpw = max(parts, SEGMENT_ALIGN)
    row_pointers = np.empty(num_tables * num_sc * rpw, np.int32)
    g = gains if gains is not None else np.empty(1, np.float32)
    over = k.tables_merge_place_pass(keys, g, np.float32(uniform_gain), starts, ibits, sbits, seg_shift, cbits,
                                     num_sc, parts, slots, out_start, mi, mu, counts, ucounts, emb, smp, gns,
                                     row_pointers, rpw, PADDING_ID)  # fmt: skip
    if over >= 0:
        return None
    shape = (num_tables, num_sc, parts)
    return (row_pointers.reshape(num_tables, -1), emb, smp, gns, size, counts.reshape(shape),
            ucounts.reshape(shape), mi, mu)  # fmt: skip


def stack_csr(
    values: np.ndarray,
    lengths: np.ndarray,
    weights: np.ndarray | None,
    *,
    batch: int,
    padded: int,
    offsets: np.ndarray,
    rows: np.ndarray,
    mean: np.ndarray,
    rows_per_partition: int,
    num_sc: int,
    num_partitions: int,
    max_ids: int | None,
    max_uniq: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int, tuple[np.ndarray, np.ndarray, int]] | None:
    """One stack's (row_pointers, embedding_ids, sample_ids, gains, max_ids, max_uniq, stats) as numpy,
    or None (then the numpy route decides). values/lengths/weights: numpy views of the stacked KJT
    slice; offsets/rows/mean: per feature slot. max_ids / max_uniq None: sized to this batch."""
    kern = _kernels()
    n = int(values.shape[0])
    if kern is None or n == 0 or batch == 0:
        return None
    keys_pass, merge_pass, place_pass, merge_place_pass = kern
    parts, nslots = num_partitions, len(offsets)
    per_sc = nslots * padded // num_sc
    uniform = weights is None and not bool(mean.any())
    cbits = max(int(rows_per_partition - 1).bit_length(), 1)
    sbits = (per_sc - 1).bit_length()
    ibits = 0 if uniform else max((n - 1).bit_length(), 1)  # ibits > 0 means "gains not uniform"
    seg_shift = cbits + sbits
    nseg = num_sc * parts
    total_bits = (nseg - 1).bit_length() + seg_shift + ibits
    if total_bits > 62:
        return None
    keys = np.empty(n, np.uint32 if total_bits <= 32 else np.int64)
    gains = np.empty(n if ibits else 1, np.float32)
    w = weights if weights is not None else np.empty(1, np.float32)
    bad = keys_pass(values, lengths, batch, padded // num_sc, offsets, rows, mean, w, weights is not None,
                    rows_per_partition, parts, cbits, sbits, ibits, keys, gains)  # fmt: skip
    if bad >= 0:
        return None
    from tpurec.embedding import key_sort

    # Below the segment and local id, the keys' bits (sample in slice, input position) never decrease
    # in input order within a segment (keys_pass: bags feature-major, samples in order in each
    # SparseCore's slice), so a stable sort by the bits above them gives the fully sorted keys: the
    # radix sort's passes over the sample bits (14 of MLPerf's 35) are skipped.
    low = sbits + ibits
    key_sort.sort_keys(keys, np.array([[0, n]], np.int64), low, total_bits - low)
    counts = np.zeros(nseg, np.int64)
    ucounts = np.zeros(nseg, np.int64)
    rpw = max(parts, SEGMENT_ALIGN)
    if max_ids is not None:  # the buffer shape is known before the merge: merge and place in one pass
        mi, mu = int(max_ids), int(max_uniq if max_uniq is not None else max_ids)
        slots = (mi + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN * parts
        emb = _POOL.get(num_sc * slots, np.int32)
        smp = _POOL.get(num_sc * slots, np.int32)
        gns = _POOL.get(num_sc * slots, np.float32)
        row_pointers = np.empty(num_sc * rpw, np.int32)
        one = np.array([0, n], np.int64)  # the stack as a group of one table
        if merge_place_pass(keys, gains, np.float32(1.0), one, ibits, sbits, seg_shift, cbits, num_sc, parts,
                            np.array([slots], np.int64), one[:1], np.array([mi], np.int64), np.array([mu], np.int64),
                            counts, ucounts, emb, smp, gns, row_pointers, rpw, PADDING_ID) >= 0:  # fmt: skip
            return None  # over a limit: the numpy route raises or drops
        aligned = (counts + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN
        need = int(aligned.reshape(num_sc, parts).sum(1).max())
        return (
            row_pointers,
            emb,
            smp,
            gns,
            mi,
            mu,
            (counts.reshape(num_sc, parts), ucounts.reshape(num_sc, parts), need),
        )
    ugain = np.empty(n, np.float32)
    m = merge_pass(keys, gains, ibits, sbits, seg_shift, counts, ucounts, ugain)
    mi = max_ids if max_ids is not None else max(int(counts.max()), 1)
    mu = max_uniq if max_uniq is not None else mi
    if int(counts.max()) > mi or int(ucounts.max()) > mu:
        return None  # over a limit: the numpy route raises or drops
    aligned = (counts + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN
    need = int(aligned.reshape(num_sc, parts).sum(1).max())
    slots = max((mi + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN * parts, need)
    emb = _POOL.get(num_sc * slots, np.int32)
    smp = _POOL.get(num_sc * slots, np.int32)
    gns = _POOL.get(num_sc * slots, np.float32)
    row_pointers = np.empty(num_sc * rpw, np.int32)
    place_pass(keys[:m], ugain[:m], counts, num_sc, parts, slots, cbits, sbits, emb, smp, gns, row_pointers, rpw,
               PADDING_ID)  # fmt: skip
    stats = (counts.reshape(num_sc, parts), ucounts.reshape(num_sc, parts), need)
    return row_pointers, emb, smp, gns, int(mi), int(mu), stats
