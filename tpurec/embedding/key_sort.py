"""Sorting the SparseCore keys: numpy's sort, or a radix sort where this CPU runs that faster.

Two sorts give the same array. numpy's `sort` is x86-simd-sort's AVX-512 quicksort where numpy
dispatches to it (the earlier sessions' hosts sorted the direct step's keys at about 2 ns a key; the one
docs/results.md names is an Intel Xeon with AVX-512), and a scalar
or AVX2 quicksort elsewhere: 17-42 ns a key on an AMD EPYC host with AVX-512 (its sort took 28 of a
61 ms SGD step at pooling 100, `tpurec bench kernels --matrix`). `sort_segments` is an LSD radix sort
of 11-bit digits, 3.5-4 ns a key for two digits on that host. Where a segment's keys are at least a
sixth as many as the buckets of all its bits (`one_pass`: 12-16 bits; the direct step's tables of a few
thousand to 65k rows at pooling 20-100), one counting pass over them all replaces the two digits: on
session 39's AMD EPYC host 2.7-4.6 ns a key against 4-8 (13-15 row bits, 8k-128k keys a segment);
the SGD step's sort at pooling 100 over 64 tables of 20k rows (1.6M keys) 16.1 -> 9.4 ms.

Its callers: the direct step's backward (direct.py) sorts each table's keys, (row << key_bits) | low,
by the row bits alone: within a table's keys `low` never decreases in input order
(direct_kernels.bags: the batch-major bag, the feature-major bag or the input position), and the
radix sort is stable, so rows that tie keep it and the array is the fully sorted one. The layout
path's CSR build (csr_build.py) sorts whole keys: every bit.

Which sort runs is measured once per process (`use_radix`): both sort the same 32k keys of 15 row
bits (the radix side in one counting pass there), the faster wins. The results are the same either way.
"""

from __future__ import annotations

import time

import numba
import numpy as np

DIGIT_BITS = 11  # at most 2,048 buckets a pass: the counts stay in L1
ONE_PASS_BITS = 16  # a counting pass's 65,536 int32 counts (256 KiB) stay in L2


@numba.njit(cache=True, nogil=True)
def one_pass(n: int, bits: int) -> bool:
    """Whether n keys sort faster by one counting pass over all `bits` than by radix digits: more than
    one digit's bits, at most ONE_PASS_BITS, and the keys at least a sixth of the buckets (fewer keys leave
    the counts' zeroing and prefix sum the larger part: measured slower below that)."""
    return DIGIT_BITS < bits <= ONE_PASS_BITS and (1 << bits) <= 6 * n


_choice: bool | None = None


@numba.njit(cache=True, nogil=True, error_model="numpy")
def sort_segments(keys: np.ndarray, segments: np.ndarray, shift: int, bits: int) -> None:
    """keys[lo:hi] sorted in place for each segment row (lo, hi, ...) by their bits shift ..
    shift + bits: an LSD radix sort (one counting pass over all the bits where `one_pass`), stable, so
    keys that tie on those bits keep their order."""
    most, whole = 0, False
    for s in range(segments.shape[0]):
        most = max(most, segments[s, 1] - segments[s, 0])
        whole = whole or one_pass(segments[s, 1] - segments[s, 0], bits)
    size = 1 << (bits if whole else DIGIT_BITS)
    scratch = np.empty(most, keys.dtype)
    if most < 1 << 31:  # int32 counts: half the cache lines of the one pass's 65k buckets
        _sort(keys, segments, shift, bits, np.empty(size, np.int32), scratch)
    else:
        _sort(keys, segments, shift, bits, np.empty(size, np.int64), scratch)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _sort(
    keys: np.ndarray, segments: np.ndarray, shift: int, bits: int, counts: np.ndarray, scratch: np.ndarray
) -> None:
    for s in range(segments.shape[0]):
        lo, hi = segments[s, 0], segments[s, 1]
        n = hi - lo
        if n < 2:
            continue
        src, dst = keys[lo:hi], scratch[:n]
        passes = 1 if one_pass(n, bits) else max(1, -(-bits // DIGIT_BITS))
        digit = -(-bits // passes)
        mask = (1 << digit) - 1
        at = shift
        for _ in range(passes):
            counts[: mask + 1] = 0
            for i in range(n):
                counts[(np.int64(src[i]) >> at) & mask] += 1
            total = 0
            for b in range(mask + 1):
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
