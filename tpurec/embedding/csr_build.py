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

import os
import threading
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from tpurec.embedding.constraints import PADDING_ID, SEGMENT_ALIGN

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
    return os.environ.get("TPUREC_NO_NUMBA", "") in ("", "0") and _kernels() is not None


def _kernels() -> tuple[Any, ...] | None:
    global _KERNELS
    if _KERNELS is None:
        try:
            from tpurec.embedding import csr_build_kernels as k  # numba, loaded on first use
        except ImportError:
            _KERNELS = False
        else:
            _KERNELS = (k.keys_pass, k.merge_pass, k.place_pass, k.merge_place_pass)
    return _KERNELS if isinstance(_KERNELS, tuple) else None


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
    keys.sort()
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
        if merge_place_pass(keys, gains, ibits, sbits, seg_shift, cbits, num_sc, parts, slots, mi, mu, counts,
                            ucounts, emb, smp, gns, row_pointers, rpw, PADDING_ID) < 0:  # fmt: skip
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
