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

Everything is vectorised torch (one sort/unique per call); no Python loop over ids or samples.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    ids = ids.to(torch.int64)
    sample_index = sample_index.to(torch.int64)
    gains = gains.to(torch.float32)

    # One key orders everything as the SparseCore wants it: (slice, partition, local id, sample).
    sc = sample_index // per_sc
    local_col = ids // parts
    span = int(local_col.max()) + 1 if ids.numel() else 1
    seg_of_id = sc * parts + ids % parts
    key = (seg_of_id * span + local_col) * per_sc + (sample_index - sc * per_sc)
    ukey, inverse = torch.unique(key, sorted=True, return_inverse=True)
    ugain = torch.zeros(ukey.numel(), dtype=torch.float32, device=dev).index_add_(0, inverse, gains)

    sample = ukey % per_sc
    seg_col = ukey // per_sc  # (segment, local id) pair, for counting unique ids
    col = seg_col % span
    seg = seg_col // span
    nseg = num_sc * parts
    counts = torch.bincount(seg, minlength=nseg)
    new_col = torch.ones_like(seg, dtype=torch.bool)
    new_col[1:] = seg_col[1:] != seg_col[:-1]
    ucounts = torch.bincount(seg[new_col], minlength=nseg)

    max_ids = max_ids_per_partition if max_ids_per_partition is not None else max(int(counts.max()) if nseg else 0, 1)
    max_uniq = max_unique_ids_per_partition if max_unique_ids_per_partition is not None else max_ids
    observed = counts.view(num_sc, parts)  # demand before any dropping, for tuning limits
    observed_aligned = (counts + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN
    observed_need = int(observed_aligned.view(num_sc, parts).sum(1).max()) if nseg else 0
    over = (counts > max_ids) | (ucounts > max_uniq)
    dropped = 0
    if bool(over.any()):
        if not allow_id_dropping:
            _raise_limit_error(table_name, over, counts, ucounts, max_ids, max_uniq, num_sc, parts, per_sc)
        # Keep, per segment, the first max_ids entries whose id is among the first max_uniq ids.
        rank = torch.arange(seg.numel(), device=dev) - _exclusive_cumsum(counts)[seg]
        col_rank = torch.cumsum(new_col, 0) - 1 - _exclusive_cumsum(ucounts)[seg]
        keep = (rank < max_ids) & (col_rank < max_uniq)
        dropped = int((~keep).sum())
        seg, col, sample, ugain = seg[keep], col[keep], sample[keep], ugain[keep]
        counts = torch.bincount(seg, minlength=nseg)

    # Place entries: segment p of SparseCore s starts at the 8-aligned sum of earlier segments.
    aligned = (counts + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN
    starts = _segment_starts(aligned, num_sc, parts)
    ends = starts + counts.view(num_sc, parts)
    need_per_sc = int(aligned.view(num_sc, parts).sum(1).max()) if nseg else 0
    slots = round_up(max_ids, SEGMENT_ALIGN) * parts
    slots = max(slots, need_per_sc)  # only grows when limits were left to the batch
    rank = torch.arange(seg.numel(), device=dev) - _exclusive_cumsum(counts)[seg]
    pos = (seg // parts) * slots + starts.reshape(-1)[seg] + rank

    emb = torch.full((num_sc * slots,), PADDING_ID, dtype=torch.int32, device=dev)
    smp = torch.full((num_sc * slots,), PADDING_ID, dtype=torch.int32, device=dev)
    gns = torch.full((num_sc * slots,), float("nan"), dtype=torch.float32, device=dev)
    emb[pos] = col.to(torch.int32)
    smp[pos] = sample.to(torch.int32)
    gns[pos] = ugain

    rp_width = max(parts, SEGMENT_ALIGN)
    row_pointers = torch.empty((num_sc, rp_width), dtype=torch.int32, device=dev)
    row_pointers[:, :parts] = ends.to(torch.int32)
    if rp_width > parts:
        row_pointers[:, parts:] = aligned.view(num_sc, parts).sum(1, keepdim=True).to(torch.int32)

    csr = SparseCoreInput(
        row_pointers.reshape(-1), emb, smp, gns, device_batch_size, num_sc, parts, max_ids, max_uniq
    )
    stats = PreprocessStats(
        ids_per_partition=observed,
        unique_ids_per_partition=ucounts.view(num_sc, parts),
        required_buffer_size_per_sc=observed_need,  # before dropping, like ids_per_partition
        dropped_id_count=dropped,
    )
    return csr, stats


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _segment_starts(aligned: torch.Tensor, num_sc: int, parts: int) -> torch.Tensor:
    a = aligned.view(num_sc, parts)
    return torch.cumsum(a, 1) - a


def _raise_limit_error(table, over, counts, ucounts, max_ids, max_uniq, num_sc, parts, per_sc):
    first = int(over.nonzero()[0])
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
