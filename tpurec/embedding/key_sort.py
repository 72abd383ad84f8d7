"""Sorting the SparseCore keys: numpy's sort, or a radix sort where this CPU runs that faster.

Two sorts give the same array. numpy's `sort` is x86-simd-sort's AVX-512 quicksort where numpy
dispatches to it (the earlier sessions' hosts sorted the direct step's keys at about 2 ns a key; the one
docs/results.md names is an Intel Xeon with AVX-512), and a scalar
or AVX2 quicksort elsewhere: 17-42 ns a key on an AMD EPYC host with AVX-512 (its sort took 28 of a
61 ms SGD step at pooling 100, `tpurec bench kernels --matrix`). `sort_segments` is an LSD radix sort
of 11-bit digits, 3.5-4 ns a key for two digits on that host.

Its callers: the direct step's backward (direct.py) sorts each table's keys, (row << key_bits) | low,
by the row bits alone: within a table's keys `low` never decreases in input order
(direct_kernels.bags: the batch-major bag, the feature-major bag or the input position), and the
radix sort is stable, so rows that tie keep it and the array is the fully sorted one. The layout
path's CSR build (csr_build.py) sorts whole keys: every bit.

Which sort runs is measured once per process (`use_radix`): both sort the same 32k keys of two
digits, the faster wins. The results are the same either way.
"""

from __future__ import annotations

import time

import numba
import numpy as np

DIGIT_BITS = 11  # at most 2,048 buckets a pass: the counts stay in L1

_choice: bool | None = None


@numba.njit(cache=True, nogil=True, error_model="numpy")
def sort_segments(keys: np.ndarray, segments: np.ndarray, shift: int, bits: int) -> None:
    """keys[lo:hi] sorted in place for each segment row (lo, hi, ...) by their bits shift ..
    shift + bits: an LSD radix sort, stable, so keys that tie on those bits keep their order."""
    passes = max(1, -(-bits // DIGIT_BITS))
    digit = -(-bits // passes)
    mask = (1 << digit) - 1
    counts = np.empty(1 << digit, np.int64)
    most = 0
    for s in range(segments.shape[0]):
        most = max(most, segments[s, 1] - segments[s, 0])
    scratch = np.empty(most, keys.dtype)
    for s in range(segments.shape[0]):
        lo, hi = segments[s, 0], segments[s, 1]
        n = hi - lo
        if n < 2:
            continue
        src, dst = keys[lo:hi], scratch[:n]
        at = shift
        for _ in range(passes):
            counts[:] = 0
            for i in range(n):
                counts[(np.int64(src[i]) >> at) & mask] += 1
            total = 0
            for b in range(counts.size):
                c = counts[b]
                counts[b] = total
                total += c
            for i in range(n):
                v = src[i]
                d = (np.int64(v) >> at) & mask
                dst[counts[d]] = v
                counts[d] += 1
            src, dst = dst, src
            at += digit
        if passes % 2 == 1:  # the sorted keys are in the scratch
            keys[lo:hi] = src


def numpy_sort_segments(keys: np.ndarray, segments: np.ndarray) -> None:
    for lo, hi in segments[:, :2].tolist():  # (a list: iterating numpy rows costs ~0.5 us each)
        keys[lo:hi].sort()


def use_radix() -> bool:
    """Whether `sort_segments` beats numpy's sort on this CPU (timed once: the best of 3 runs each on
    32,768 keys of 15 row bits)."""
    global _choice
    if _choice is None:
        rng = np.random.default_rng(0)
        n, key_bits, row_bits = 1 << 15, 15, 15
        keys = (rng.integers(0, 1 << row_bits, n) << key_bits | np.sort(rng.integers(0, n, n))).astype(np.uint32)
        segments = np.array([[0, n, 0, 0]], np.int64)
        sort_segments(keys.copy(), segments, key_bits, row_bits)  # compiled (or loaded) before timing
        best = [float("inf"), float("inf")]
        for _ in range(3):
            for k, run in enumerate(
                (lambda a: sort_segments(a, segments, key_bits, row_bits), lambda a: numpy_sort_segments(a, segments))
            ):
                a = keys.copy()
                t = time.perf_counter()
                run(a)
                best[k] = min(best[k], time.perf_counter() - t)
        _choice = best[0] < best[1]
    return _choice


def sort_keys(keys: np.ndarray, segments: np.ndarray, shift: int, bits: int) -> None:
    """Each segment's keys in increasing order, by whichever sort this CPU runs faster. The keys'
    bits below `shift` must already be in order within every run of equal higher bits (else shift
    0), and none is set above shift + bits."""
    if use_radix():
        sort_segments(keys, segments, shift, bits)
    else:
        numpy_sort_segments(keys, segments)
