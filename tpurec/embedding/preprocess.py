"""Host-side input preprocessing: ids of a batch -> the SparseCore CSR-wrapped COO layout.

Semantics follow jax-tpu-embedding 0.1.0's reference (`sparsecore/lib/core/input_preprocessing.py`),
which is also what TorchTPU's `preprocess_sparse_dense_matmul_input` produces:

* the device batch is split into `num_sc_per_device` contiguous sample slices, one per local
  SparseCore; sample ids are local to the slice;
* id r goes to partition r mod P (P = num_sc_per_device x global_device_count) as local id r div P;
* inside a (slice, partition) the same (id, sample) pair is merged (gains summed) and entries are
  sorted by (id, sample);
* each SparseCore owns a buffer of round_up(max_ids_per_partition, 8) x P slots; every partition's
  segment starts 8-aligned; `row_pointers` holds each segment's end, padded to 8 entries per
  SparseCore when P < 8; empty slots carry id/sample 2**31-1 and gain NaN.

Everything is vectorised (one sort per call, numpy on views of the CPU tensors); no Python loop
over ids or samples.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from tpurec.embedding.constraints import PADDING_ID, SEGMENT_ALIGN, round_up


class IdLimitExceededError(ValueError):
    """A partition received more ids (or unique ids) than its buffer allows."""


@dataclass
class SparseCoreInput:
    """What the SparseCore lookup/update ops consume for one table (or stack) on one device."""

    row_pointers: torch.Tensor  # int32 [num_sc_per_device * max(P, 8)]
    embedding_ids: torch.Tensor  # int32 [num_sc_per_device * coo_slots_per_sc], local ids
    sample_ids: torch.Tensor  # int32, same shape, sample index inside the SparseCore's slice
    gains: torch.Tensor  # float32, same shape, NaN in padded slots
    device_batch_size: int
    num_sc_per_device: int
    num_partitions: int
    max_ids_per_partition: int
    max_unique_ids_per_partition: int


@dataclass
class PreprocessStats:
    """Observed per-batch figures, for tuning the id limits from real data."""

    ids_per_partition: torch.Tensor  # int64 [num_sc_per_device, P], after merging duplicates
    unique_ids_per_partition: torch.Tensor  # int64 [num_sc_per_device, P]
    required_buffer_size_per_sc: int  # COO slots the fullest SparseCore needs (8-aligned), before dropping
    dropped_id_count: int

    @property
    def max_ids_per_partition(self) -> int:
        return int(self.ids_per_partition.max()) if self.ids_per_partition.numel() else 0

    @property
    def max_unique_ids_per_partition(self) -> int:
        return int(self.unique_ids_per_partition.max()) if self.unique_ids_per_partition.numel() else 0


def preprocess(
    ids: torch.Tensor,
    sample_index: torch.Tensor,
    gains: torch.Tensor,
    *,
    device_batch_size: int,
    num_sc_per_device: int,
    global_device_count: int = 1,
    max_ids_per_partition: int | None = None,
    max_unique_ids_per_partition: int | None = None,
    allow_id_dropping: bool = False,
    table_name: str = "table",
) -> tuple[SparseCoreInput, PreprocessStats]:
    """Build the SparseCore input of one table (or stack) for one device.

    ids: natural row ids (int), sample_index: the sample (0..device_batch_size-1) each id belongs to,
    gains: the weight of each id (1, a per-id weight, or 1/bag_length for mean pooling).
    Limits left as None are sized to this batch (fine on CPU; a TPU wants fixed limits).
    """
    num_sc = num_sc_per_device
    parts = num_sc_per_device * global_device_count
    if device_batch_size % num_sc:
        raise ValueError(
            f"table {table_name!r}: device_batch_size={device_batch_size} is not a multiple of "
            f"num_sc_per_device={num_sc}; pad the batch (SparseCoreEmbeddingBagCollection does this)"
        )
    per_sc = device_batch_size // num_sc
    dev = ids.device
    nseg = num_sc * parts
    # Host-side work: numpy on (zero-copy) views of the CPU tensors; its per-op cost and its sort
    # are several times cheaper than torch's at these sizes (docs/kernels_preprocess.md).
    ids_np = _as_numpy(ids, np.int64)
    smp_np = _as_numpy(sample_index, np.int64)
    gains_np = _as_numpy(gains, np.float32)
    n = ids_np.size

    # One key orders everything as the SparseCore wants it: (slice, partition, local id, sample),
    # as bit fields [segment | local id | sample in slice] so that taking it apart is shifts.
    if parts & (parts - 1) == 0:
        shift = parts.bit_length() - 1
        local_col, part = ids_np >> shift, ids_np & (parts - 1)
    else:
        local_col, part = np.divmod(ids_np, parts)
    cbits = int(local_col.max()).bit_length() if n else 0
    sbits = (per_sc - 1).bit_length()
    seg_shift = cbits + sbits
    part <<= cbits
    part |= local_col
    part <<= sbits
    key = np.take(_row_keys(device_batch_size, per_sc, parts, seg_shift), smp_np)
    key += part

    # Sort once. With non-uniform gains the input position is packed into the low key bits, which
    # makes the sort stable: duplicates of an (id, sample) pair keep input order, so their gains
    # sum in input order, as the float32 accumulation always did. With all gains equal, the order
    # of duplicates cannot matter and the bare key is sorted (as uint32 when it fits).
    key_bits = (nseg - 1).bit_length() + seg_shift
    uniform = n == 0 or _all_equal(gains_np)
    ibits = 0 if uniform else max(n - 1, 0).bit_length()
    if uniform:
        if key_bits <= 32:
            key = key.astype(np.uint32)
        key.sort()
    elif key_bits + ibits <= 62:
        key <<= ibits
        key |= np.arange(n, dtype=np.int64)
        key.sort()
        order = key & ((1 << ibits) - 1)
        key >>= ibits
    else:
        order = np.argsort(key, kind="stable")
        key = np.take(key, order)
    first_mask = _run_start_mask(key)
    first = np.flatnonzero(first_mask)  # the first of each distinct (segment, id, sample)
    ukey = np.take(key, first)
    if uniform:
        gsorted = None
        ugain = np.full(ukey.size, gains_np[0] if n else 0, dtype=np.float32)
    else:
        gsorted = np.take(gains_np, order)
        ugain = np.take(gsorted, first)
    with np.errstate(invalid="ignore"):
        ugain += np.float32(0)  # 0 + g, as the float32 accumulation always did
    if ukey.size < n:  # merge duplicates: float32 sums in input order
        dup = np.flatnonzero(~first_mask)
        target = np.searchsorted(first, dup, side="right") - 1
        with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN gains pass through
            np.add.at(ugain, target, np.full(dup.size, gains_np[0], np.float32) if uniform else np.take(gsorted, dup))
    ukey = ukey.astype(np.int64, copy=False)

    # Entries are sorted by segment: segment g is ukey[bounds[g]:bounds[g + 1]].
    bounds = np.searchsorted(ukey, np.arange(nseg + 1, dtype=np.int64) << seg_shift)
    counts = np.diff(bounds)
    seg_col = ukey >> sbits  # (segment, local id) pair, for counting unique ids
    col_starts = _run_starts(seg_col)
    ucounts = np.diff(np.searchsorted(col_starts, bounds))

    max_ids = max_ids_per_partition if max_ids_per_partition is not None else max(int(counts.max()) if nseg else 0, 1)
    max_uniq = max_unique_ids_per_partition if max_unique_ids_per_partition is not None else max_ids
    observed = counts.reshape(num_sc, parts)  # demand before any dropping, for tuning limits
    observed_aligned = (counts + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN
    observed_need = int(observed_aligned.reshape(num_sc, parts).sum(1).max()) if nseg else 0
    over = (counts > max_ids) | (ucounts > max_uniq)
    dropped = 0
    if over.any():
        if not allow_id_dropping:
            _raise_limit_error(table_name, over, counts, ucounts, max_ids, max_uniq, num_sc, parts, per_sc)
        # Keep, per segment, the first max_ids entries whose id is among the first max_uniq ids.
        seg = np.repeat(np.arange(nseg), counts)
        rank = np.arange(seg.size) - bounds[:-1][seg]
        col_rank = np.searchsorted(col_starts, np.arange(seg.size), side="right") - 1
        col_rank -= np.searchsorted(col_starts, bounds[:-1])[seg]
        keep = (rank < max_ids) & (col_rank < max_uniq)
        dropped = int(keep.size - np.count_nonzero(keep))
        ukey, ugain = ukey[keep], ugain[keep]
        seg_col = ukey >> sbits
        counts = np.bincount(seg[keep], minlength=nseg)

    # Place entries: segment p of SparseCore s starts at the 8-aligned sum of earlier segments.
    aligned = ((counts + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN).reshape(num_sc, parts)
    starts = np.cumsum(aligned, 1) - aligned
    ends = starts + counts.reshape(num_sc, parts)
    need_per_sc = int(aligned.sum(1).max()) if nseg else 0
    slots = round_up(max_ids, SEGMENT_ALIGN) * parts
    slots = max(slots, need_per_sc)  # only grows when limits were left to the batch
    # Entry j of segment g goes to base[g] + j (j counted over all entries).
    base = np.arange(nseg) // parts * slots + starts.reshape(-1) - (np.cumsum(counts) - counts)
    pos = np.repeat(base, counts)
    pos += np.arange(pos.size)

    emb = np.full(num_sc * slots, PADDING_ID, dtype=np.int32)
    smp = np.full(num_sc * slots, PADDING_ID, dtype=np.int32)
    gns = np.full(num_sc * slots, np.nan, dtype=np.float32)
    emb[pos] = seg_col & ((1 << cbits) - 1)
    smp[pos] = ukey & ((1 << sbits) - 1)
    gns[pos] = ugain

    rp_width = max(parts, SEGMENT_ALIGN)
    row_pointers = np.empty((num_sc, rp_width), dtype=np.int32)
    row_pointers[:, :parts] = ends
    if rp_width > parts:
        row_pointers[:, parts:] = aligned.sum(1, keepdims=True)

    out = [torch.from_numpy(a) for a in (row_pointers.reshape(-1), emb, smp, gns)]
    if dev.type != "cpu":
        out = [t.to(dev) for t in out]
    csr = SparseCoreInput(*out, device_batch_size, num_sc, parts, max_ids, max_uniq)
    stats = PreprocessStats(
        ids_per_partition=torch.from_numpy(observed),
        unique_ids_per_partition=torch.from_numpy(ucounts.reshape(num_sc, parts)),
        required_buffer_size_per_sc=observed_need,  # before dropping, like ids_per_partition
        dropped_id_count=dropped,
    )
    return csr, stats


def _as_numpy(t: torch.Tensor, dtype) -> np.ndarray:
    a = t.detach().cpu().numpy()
    return a if a.dtype == dtype else a.astype(dtype)


@functools.lru_cache(maxsize=64)
def _row_keys_cached(device_batch_size: int, per_sc: int, parts: int, seg_shift: int) -> np.ndarray:
    row = np.arange(device_batch_size, dtype=np.int64)
    keys = ((row // per_sc * parts) << seg_shift) | (row % per_sc)
    keys.flags.writeable = False
    return keys


def _row_keys(device_batch_size: int, per_sc: int, parts: int, seg_shift: int) -> np.ndarray:
    """Key bits a sample contributes: its SparseCore's first segment, and its index in the slice."""
    return _row_keys_cached(device_batch_size, per_sc, parts, seg_shift)


def _run_start_mask(sorted_keys: np.ndarray) -> np.ndarray:
    """True where a run of equal values starts in a sorted array."""
    new = np.empty(sorted_keys.size, dtype=bool)
    if sorted_keys.size:
        new[0] = True
        np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=new[1:])
    return new


def _run_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """Positions where a run of equal values starts in a sorted array."""
    return np.flatnonzero(_run_start_mask(sorted_keys))


def _all_equal(x: np.ndarray) -> bool:
    """Every element bit-for-bit the same value (NaN != NaN and -0.0 == 0.0 rule this out)."""
    return bool(x[0] == x[-1]) and bool((x == x[0]).all()) and not np.signbit(x[0])


def _raise_limit_error(table, over, counts, ucounts, max_ids, max_uniq, num_sc, parts, per_sc):
    first = int(np.flatnonzero(over)[0])
    sc, part = divmod(first, parts)
    where = (
        f"table {table!r}, partition {part} of {parts} (rows r with r mod {parts} == {part}), "
        f"SparseCore {sc} of {num_sc} (samples {sc * per_sc}-{(sc + 1) * per_sc - 1} of the device batch)"
    )
    if int(counts[first]) > max_ids:
        what = f"{int(counts[first])} ids > max_ids_per_partition={max_ids}"
    else:
        what = f"{int(ucounts[first])} unique ids > max_unique_ids_per_partition={max_uniq}"
    worst_ids, worst_uniq = int(counts.max()), int(ucounts.max())
    raise IdLimitExceededError(
        f"{where}: {what}. Largest in this batch: {worst_ids} ids, {worst_uniq} unique ids per partition. "
        "Raise the limits (see PreprocessStats / docs/kernels.md) or pass allow_id_dropping=True."
    )
