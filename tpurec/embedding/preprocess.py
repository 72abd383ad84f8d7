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
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tpurec.embedding import csr_build
from tpurec.embedding.constraints import PADDING_ID, SEGMENT_ALIGN
from tpurec.embedding.input_checks import check_batch, check_ranges, whole
from tpurec.errors import UserError
from tpurec.runtime.device import DeviceKind


class IdLimitExceededError(UserError):
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

    def to(self, device: torch.device) -> SparseCoreInput:
        """The same input with its tensors on `device`."""
        return replace(
            self,
            row_pointers=self.row_pointers.to(device),
            embedding_ids=self.embedding_ids.to(device),
            sample_ids=self.sample_ids.to(device),
            gains=self.gains.to(device),
        )


@dataclass
class PreprocessStats:
    """Observed per-batch figures, for tuning the id limits from real data."""

    ids_per_partition: torch.Tensor  # int64 [num_sc_per_device, P], after merging duplicates
    unique_ids_per_partition: torch.Tensor  # int64 [num_sc_per_device, P]
    required_buffer_size_per_sc: int  # COO slots the fullest SparseCore needs (8-aligned), before dropping
    dropped_id_count: int
    passes: int = 1  # > 1: the batch was over its limits and ran in that many passes (multipass.py)

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
    Ids must be integers in [0, 2^31) (the SparseCore takes int32 ids) and sample indices integers
    in [0, device_batch_size): out of range is refused (input_checks.py), never wrapped or clamped.
    """
    return preprocess_tables(
        [(ids, sample_index, gains)],
        device_batch_size=device_batch_size,
        num_sc_per_device=num_sc_per_device,
        global_device_count=global_device_count,
        max_ids_per_partition=[max_ids_per_partition],
        max_unique_ids_per_partition=[max_unique_ids_per_partition],
        allow_id_dropping=allow_id_dropping,
        table_names=[table_name],
        num_threads=1,
    )[0]


def preprocess_tables(
    inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    device_batch_size: int,
    num_sc_per_device: int,
    global_device_count: int = 1,
    max_ids_per_partition: int | None | Sequence[int | None] = None,
    max_unique_ids_per_partition: int | None | Sequence[int | None] = None,
    allow_id_dropping: bool = False,
    table_names: Sequence[str] | None = None,
    num_threads: int | None = None,
) -> list[tuple[SparseCoreInput, PreprocessStats]]:
    """`preprocess` for several tables (or stacks) of one device batch at once.

    inputs: one (ids, sample_index, gains) per table. Limits: one value for all tables or one per
    table. Each result is exactly what `preprocess` returns for that table alone. The tables share
    one sort per group, and groups run on `num_threads` threads (default torch.get_num_threads());
    numpy drops the GIL in its loops, so the groups overlap. A table's buffers may be views of one
    allocation shared with the other tables of its group.
    """
    num_tables = len(inputs)
    names = list(table_names) if table_names is not None else [f"table_{t}" for t in range(num_tables)]
    whole("device_batch_size", device_batch_size)
    whole("num_sc_per_device", num_sc_per_device)
    whole("global_device_count", global_device_count)
    for name, (ids, samples, gains) in zip(names, inputs):
        check_batch(name, ids, samples, gains, device_batch_size)
    lim_ids = _per_table(max_ids_per_partition, num_tables, "max_ids_per_partition")
    lim_uniq = _per_table(max_unique_ids_per_partition, num_tables, "max_unique_ids_per_partition")
    num_sc = num_sc_per_device
    if device_batch_size % num_sc:
        raise UserError(
            f"table {names[0]!r}: device_batch_size={device_batch_size} is not a multiple of "
            f"num_sc_per_device={num_sc}; pad the batch (SparseCoreEmbeddingBagCollection does this)"
        )
    kw: dict[str, Any] = dict(
        device_batch_size=device_batch_size,
        num_sc=num_sc,
        parts=num_sc * global_device_count,
        allow_id_dropping=allow_id_dropping,
    )
    sizes = [int(x[0].numel()) for x in inputs]
    threads = max(1, min(num_threads or torch.get_num_threads(), num_tables))
    # Groups of tables small enough for the caches, and at least one per thread.
    # Groups of about _GROUP_IDS ids (their arrays stay in cache), one per thread at least; on the
    # compiled route a second thread only from _THREAD_MIN_IDS ids, below which its handoff costs
    # more than it saves (bench preprocess, pooling 1).
    min_groups = threads if not csr_build.available() or sum(sizes) >= _THREAD_MIN_IDS else 1
    group_ids = _GROUP_IDS if threads == 1 else _GROUP_IDS_THREADED
    groups = _split_by_size(sizes, max(min_groups, -(-sum(sizes) // group_ids)))
    if threads == 1 or len(groups) == 1:
        return [
            r for a, b in groups for r in _preprocess_group(inputs[a:b], names[a:b], lim_ids[a:b], lim_uniq[a:b], **kw)
        ]
    futures = [
        _pool(threads).submit(_preprocess_group, inputs[a:b], names[a:b], lim_ids[a:b], lim_uniq[a:b], **kw)
        for a, b in groups
    ]
    return [r for f in futures for r in f.result()]


# Ids per group of tables sorted together: beyond this the arrays outgrow the caches and one
# sort per group costs more than it saves (measured on the benchmark, docs/kernels_preprocess.md).
_GROUP_IDS = 1 << 16
# On several threads: each group's Python glue holds the GIL (~0.3 ms a group), so fewer, larger
# groups overlap better (26 tables at pooling 20, 2 threads: 15.7 -> 12.5 ms a batch with groups of
# 64k -> 256k ids; one thread 21.2 -> 20.4 ms, within noise; docs/results.md, session 19).
_GROUP_IDS_THREADED = 1 << 18
# Ids from which the compiled route splits the tables over threads.
_THREAD_MIN_IDS = 1 << 18
# Average entries per segment from which per-segment slice copies beat one scatter.
_SLICE_COPY_MIN = 256


def _preprocess_group(
    inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    names: list[str],
    lim_ids: Sequence[int | None],
    lim_uniq: Sequence[int | None],
    *,
    device_batch_size: int,
    num_sc: int,
    parts: int,
    allow_id_dropping: bool,
) -> list[tuple[SparseCoreInput, PreprocessStats]]:
    """The work: tables t = 0..T-1 get disjoint key ranges, so one sort serves them all and every
    per-segment step below runs over the T x num_sc x P (table, slice, partition) segments."""
    num_tables = len(inputs)
    per_sc = device_batch_size // num_sc
    tseg = num_sc * parts  # segments per table
    nseg = num_tables * tseg
    # Host-side work: numpy on (zero-copy) views of the CPU tensors; its per-op cost and its sort
    # are several times cheaper than torch's at these sizes (docs/kernels_preprocess.md).
    # Big temporaries live in per-thread workspace buffers: fresh arrays of this size are new pages,
    # and page faults were half the time (docs/kernels_preprocess.md).
    ws = _workspace()
    ids_np, smp_np, gains_np, lengths = _group_arrays(inputs, ws)
    check_ranges(names, lengths, ids_np, smp_np, device_batch_size)  # never wrapped, clamped or dropped below
    if csr_build.available():
        compiled = _compiled_group(inputs, ids_np, smp_np, gains_np, lengths, lim_ids, lim_uniq, device_batch_size,
                                   num_sc, parts)  # fmt: skip
        if compiled is not None:
            return compiled
    key, scratch, cbits, sbits = _segment_keys(ids_np, smp_np, lengths, ws, device_batch_size, per_sc, parts, tseg)
    seg_shift = cbits + sbits
    ukey, ugain = _merged_entries(key, scratch, gains_np, ws, (nseg - 1).bit_length() + seg_shift)

    # Entries are sorted by segment: segment g is ukey[bounds[g]:bounds[g + 1]].
    bounds = np.empty(nseg + 1, dtype=np.int64)
    bounds[:-1] = np.searchsorted(ukey, (np.arange(nseg, dtype=np.int64) << seg_shift).astype(ukey.dtype))
    bounds[-1] = ukey.size
    counts = np.diff(bounds)
    seg_col = np.right_shift(ukey, sbits, out=ws.get("seg_col", ukey.size, ukey.dtype))  # (segment, local id)
    col_starts = _run_starts(seg_col)
    ucounts = np.diff(np.searchsorted(col_starts, bounds))

    counts_t, ucounts_t = counts.reshape(num_tables, tseg), ucounts.reshape(num_tables, tseg)
    max_ids = np.array(
        [m if m is not None else max(int(c.max()) if tseg else 0, 1) for m, c in zip(lim_ids, counts_t)], dtype=np.int64
    )
    max_uniq = np.array([u if u is not None else m for u, m in zip(lim_uniq, max_ids)], dtype=np.int64)
    observed = counts_t.reshape(num_tables, num_sc, parts)  # demand before any dropping, for tuning
    observed_aligned = (observed + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN
    observed_need = observed_aligned.sum(2).max(1) if tseg else np.zeros(num_tables, np.int64)
    over = (counts_t > max_ids[:, None]) | (ucounts_t > max_uniq[:, None])
    dropped = np.zeros(num_tables, dtype=np.int64)
    if over.any():
        if not allow_id_dropping:
            t = int(np.flatnonzero(over.any(1))[0])
            _raise_limit_error(
                names[t], over[t], counts_t[t], ucounts_t[t], int(max_ids[t]), int(max_uniq[t]), num_sc, parts, per_sc
            )
        ukey, ugain, counts, dropped = _drop_over_limits(ukey, ugain, bounds, col_starts, max_ids, max_uniq, tseg)
        seg_col = ukey >> sbits

    placed = _place(ukey, ugain, seg_col, counts, max_ids, cbits, sbits, num_tables, num_sc, parts)
    row_pointers, table_size = placed[3], placed[4]
    sizes = table_size.tolist()
    rp_t = torch.from_numpy(row_pointers.reshape(num_tables, -1))
    emb_t, smp_t, gns_t = (torch.from_numpy(x).split(sizes) for x in placed[:3])
    ids_t = torch.from_numpy(observed)
    uniq_t = torch.from_numpy(ucounts_t.reshape(num_tables, num_sc, parts))
    results = []
    for t, (ids, mi, mu, need, drop) in enumerate(
        zip((x[0] for x in inputs), max_ids.tolist(), max_uniq.tolist(), observed_need.tolist(), dropped.tolist())
    ):
        out = [rp_t[t], emb_t[t], smp_t[t], gns_t[t]]
        if ids.device.type != DeviceKind.CPU:
            out = [x.to(ids.device) for x in out]
        rp, emb, smp, gns = out
        csr = SparseCoreInput(rp, emb, smp, gns, device_batch_size, num_sc, parts, mi, mu)
        # required_buffer_size_per_sc: before dropping, like ids_per_partition.
        results.append((csr, PreprocessStats(ids_t[t], uniq_t[t], need, drop)))
    return results


def _compiled_group(
    inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ids_np: np.ndarray,
    smp_np: np.ndarray,
    gains_np: np.ndarray,
    lengths: list[int],
    lim_ids: Sequence[int | None],
    lim_uniq: Sequence[int | None],
    device_batch_size: int,
    num_sc: int,
    parts: int,
) -> list[tuple[SparseCoreInput, PreprocessStats]] | None:
    """The group by `csr_build.tables_csr` (compiled passes, a sort per table), or None when the numpy
    route must decide (a limit exceeded: it raises or drops; keys too wide)."""
    n = ids_np.size
    uniform = n == 0 or _all_equal(gains_np)
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    per_sc = device_batch_size // num_sc
    out = csr_build.tables_csr(
        ids_np,
        smp_np,
        None if uniform else gains_np,
        float(gains_np[0]) if n else 0.0,
        starts,
        device_batch_size=device_batch_size,
        num_sc=num_sc,
        parts=parts,
        max_ids=list(lim_ids),
        max_uniq=list(lim_uniq),
        row_keys=functools.partial(_row_keys, device_batch_size, per_sc, parts),
    )
    if out is None:
        return None
    row_pointers, emb, smp, gns, size, counts, ucounts, max_ids, max_uniq = out
    aligned = (counts + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN
    need = aligned.sum(2).max(1) if counts.size else np.zeros(len(lengths), np.int64)
    sizes = size.tolist()
    rp_t = torch.from_numpy(row_pointers)
    emb_t, smp_t, gns_t = (torch.from_numpy(x).split(sizes) for x in (emb, smp, gns))
    ids_t, uniq_t = torch.from_numpy(counts), torch.from_numpy(ucounts)
    results = []
    for t, (ids, mi, mu, nd) in enumerate(
        zip((x[0] for x in inputs), max_ids.tolist(), max_uniq.tolist(), need.tolist())
    ):
        parts_t = [rp_t[t], emb_t[t], smp_t[t], gns_t[t]]
        if ids.device.type != DeviceKind.CPU:
            parts_t = [x.to(ids.device) for x in parts_t]
        rp, e, s, g = parts_t
        csr = SparseCoreInput(rp, e, s, g, device_batch_size, num_sc, parts, mi, mu)
        results.append((csr, PreprocessStats(ids_t[t], uniq_t[t], nd, 0)))
    return results


def _group_arrays(
    inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], ws: _Workspace
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """(ids, samples, gains) of the group's tables end to end as numpy, and each table's id count."""
    arrays = [(_as_numpy(i, np.int64), _as_numpy(s, np.int64), _as_numpy(g, np.float32)) for i, s, g in inputs]
    lengths = [a[0].size for a in arrays]
    n = sum(lengths)
    if len(arrays) == 1:
        return (*arrays[0], lengths)
    ids_np = np.concatenate([a[0] for a in arrays], out=ws.get("ids", n, np.int64))
    smp_np = np.concatenate([a[1] for a in arrays], out=ws.get("smp", n, np.int64))
    gains_np = np.concatenate([a[2] for a in arrays], out=ws.get("gains", n, np.float32))
    return ids_np, smp_np, gains_np, lengths


def _segment_keys(
    ids_np: np.ndarray,
    smp_np: np.ndarray,
    lengths: list[int],
    ws: _Workspace,
    device_batch_size: int,
    per_sc: int,
    parts: int,
    tseg: int,
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(keys, a scratch array of the same length, cbits, sbits). One key orders everything as the
    SparseCore wants it: (table, slice, partition, local id, sample), as bit fields
    [segment | local id (cbits) | sample in slice (sbits)] so that taking it apart is shifts."""
    n = ids_np.size
    local_col, key = ws.get("col", n, np.int64), ws.get("key", n, np.int64)
    if parts & (parts - 1) == 0:
        np.right_shift(ids_np, parts.bit_length() - 1, out=local_col)
        np.bitwise_and(ids_np, parts - 1, out=key)
    else:
        np.divmod(ids_np, parts, out=(local_col, key))
    cbits = int(local_col.max()).bit_length() if n else 0
    sbits = (per_sc - 1).bit_length()
    seg_shift = cbits + sbits
    key <<= cbits  # partition | local id | sample
    key |= local_col
    key <<= sbits
    key += np.take(_row_keys(device_batch_size, per_sc, parts, seg_shift), smp_np, out=local_col, mode="clip")
    if len(lengths) > 1:  # table t's keys from segment t x tseg on
        start = 0
        for t, length in enumerate(lengths):
            key[start : start + length] += (t * tseg) << seg_shift
            start += length
    return key, local_col, cbits, sbits


def _merged_entries(
    key: np.ndarray, scratch: np.ndarray, gains_np: np.ndarray, ws: _Workspace, key_bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys in order, their float32 gain sums). Sorts once. With non-uniform gains the
    input position is packed into the low key bits, which makes the sort stable: duplicates of an
    (id, sample) pair keep input order, so their gains sum in input order, as the float32
    accumulation always did. With all gains equal, the order of duplicates cannot matter and the
    bare key is sorted (as uint32 when it fits). `scratch` (as long as `key`) takes the order."""
    n = key.size
    uniform = n == 0 or _all_equal(gains_np)
    ibits = 0 if uniform else max(n - 1, 0).bit_length()
    if uniform:
        if key_bits <= 32:
            k32 = ws.get("key32", n, np.uint32)
            np.copyto(k32, key, casting="unsafe")
            key = k32
        key.sort()
    elif key_bits + ibits <= 62:
        key <<= ibits
        key |= _arange(n)
        key.sort()
        order = np.bitwise_and(key, (1 << ibits) - 1, out=scratch)
        key >>= ibits
    else:
        order = np.argsort(key, kind="stable")
        key = np.take(key, order)
    first_mask = ws.get("first", n, np.bool_)
    if n:
        first_mask[0] = True
        np.not_equal(key[1:], key[:-1], out=first_mask[1:])
    m = int(np.count_nonzero(first_mask))  # distinct (segment, id, sample)
    ukey = key[first_mask]  # uint32 or int64; boolean indexing beats np.compress(out=) ~3x
    ugain = ws.get("ugain", m, np.float32)
    if uniform:
        ugain.fill(gains_np[0] if n else 0)
        gsorted = None
    else:
        gsorted = np.take(gains_np, order, out=ws.get("gsorted", n, np.float32), mode="clip")
        ugain[...] = gsorted[first_mask]
    with np.errstate(invalid="ignore"):
        ugain += np.float32(0)  # 0 + g, as the float32 accumulation always did
    if m < n:  # merge duplicates: float32 sums in input order
        dup = np.flatnonzero(~first_mask)
        target = dup - _arange(dup.size) - 1  # the k-th duplicate follows k earlier ones
        with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN gains pass through
            if uniform:
                np.add.at(ugain, target, np.full(dup.size, gains_np[0], np.float32))
            else:
                assert gsorted is not None  # sorted above whenever the gains are not uniform
                np.add.at(ugain, target, np.take(gsorted, dup))
    return ukey, ugain


def _drop_over_limits(
    ukey: np.ndarray,
    ugain: np.ndarray,
    bounds: np.ndarray,
    col_starts: np.ndarray,
    max_ids: np.ndarray,
    max_uniq: np.ndarray,
    tseg: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(kept keys, their gains, entries per segment, ids dropped per table): per segment, the first
    max_ids entries whose id is among the first max_uniq ids are kept."""
    nseg = bounds.size - 1
    counts = np.diff(bounds)
    seg = np.repeat(np.arange(nseg), counts)
    rank = np.arange(seg.size) - bounds[:-1][seg]
    col_rank = np.searchsorted(col_starts, np.arange(seg.size), side="right") - 1
    col_rank -= np.searchsorted(col_starts, bounds[:-1])[seg]
    table = seg // tseg
    keep = (rank < max_ids[table]) & (col_rank < max_uniq[table])
    dropped = np.bincount(table[~keep], minlength=max_ids.size)
    return ukey[keep], ugain[keep], np.bincount(seg[keep], minlength=nseg), dropped


def _place(
    ukey: np.ndarray,
    ugain: np.ndarray,
    seg_col: np.ndarray,
    counts: np.ndarray,
    max_ids: np.ndarray,
    cbits: int,
    sbits: int,
    num_tables: int,
    num_sc: int,
    parts: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(embedding ids, sample ids, gains, row pointers [tables, SparseCores, max(P, 8)], slots per
    table): segment p of SparseCore s starts at the 8-aligned sum of earlier segments; the group's
    tables lie end to end in the three buffers. `ukey` and `seg_col` are overwritten."""
    tseg = num_sc * parts
    aligned = ((counts + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN).reshape(num_tables, num_sc, parts)
    starts = np.cumsum(aligned, 2) - aligned
    ends = starts + counts.reshape(num_tables, num_sc, parts)
    need_per_sc = aligned.sum(2).max(1) if tseg else np.zeros(num_tables, np.int64)
    # round_up(max_ids, 8) x P slots per SparseCore; only grows when limits were left to the batch.
    slots = np.maximum((max_ids + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN * parts, need_per_sc)
    table_size = num_sc * slots
    table_start = np.cumsum(table_size) - table_size
    # Entry j (counted over all entries) of segment g goes to base[g] + j.
    base = table_start[:, None, None] + np.arange(num_sc)[None, :, None] * slots[:, None, None] + starts
    src = np.cumsum(counts) - counts  # where segment g's entries start in ukey
    base = base.reshape(-1) - src

    total = int(table_size.sum())
    emb = np.full(total, PADDING_ID, dtype=np.int32)
    smp = np.full(total, PADDING_ID, dtype=np.int32)
    gns = np.full(total, np.nan, dtype=np.float32)
    cols = np.bitwise_and(seg_col, (1 << cbits) - 1, out=seg_col)
    samples = np.bitwise_and(ukey, (1 << sbits) - 1, out=ukey)
    if counts.size * _SLICE_COPY_MIN <= ukey.size:  # long segments: one slice copy each
        for g, a, c in zip(np.flatnonzero(counts).tolist(), src[counts > 0].tolist(), counts[counts > 0].tolist()):
            d = int(base[g]) + a
            emb[d : d + c] = cols[a : a + c]
            smp[d : d + c] = samples[a : a + c]
            gns[d : d + c] = ugain[a : a + c]
    else:  # many short segments: one scatter
        pos = np.repeat(base, counts)
        pos += _arange(pos.size)
        emb[pos] = cols
        smp[pos] = samples
        gns[pos] = ugain

    rp_width = max(parts, SEGMENT_ALIGN)
    row_pointers = np.empty((num_tables, num_sc, rp_width), dtype=np.int32)
    row_pointers[:, :, :parts] = ends
    if rp_width > parts:
        row_pointers[:, :, parts:] = aligned.sum(2, keepdims=True)
    return emb, smp, gns, row_pointers, table_size


def _per_table(value: int | None | Sequence[int | None], num_tables: int, what: str) -> list:
    if value is None or isinstance(value, (int, np.integer)):
        return [value] * num_tables
    value = list(value)
    if len(value) != num_tables:
        raise UserError(f"{what}: {len(value)} values for {num_tables} tables")
    return value


def _split_by_size(sizes: list[int], groups: int) -> list[tuple[int, int]]:
    """Contiguous ranges of tables with about equal total ids, at most `groups` of them."""
    total = sum(sizes) or 1
    bounds: list[tuple[int, int]] = []
    acc = start = 0
    for t, size in enumerate(sizes):
        acc += size
        if acc * groups >= total * (len(bounds) + 1) and t + 1 < len(sizes):
            bounds.append((start, t + 1))
            start = t + 1
    bounds.append((start, len(sizes)))
    return bounds


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="tpurec-preprocess")
    return _POOLS[threads]


class _Workspace(threading.local):
    """Per-thread scratch arrays, grown on demand and reused across calls (up to _WORKSPACE_MAX
    elements each; larger requests get fresh arrays). Nothing in them outlives a call's result."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, size: int, dtype: npt.DTypeLike) -> np.ndarray:
        if size > _WORKSPACE_MAX:
            return np.empty(size, dtype=dtype)
        a = self.arrays.get(name)
        if a is None or a.size < size or a.dtype != dtype:
            a = np.empty(min(max(size + size // 4, 4096), _WORKSPACE_MAX), dtype=dtype)
            self.arrays[name] = a
        return a[:size]


_WORKSPACE_MAX = 1 << 22
_WS = None
_ARANGE = np.arange(0, dtype=np.int64)


def _workspace() -> _Workspace:
    global _WS
    if _WS is None:
        _WS = _Workspace()
    return _WS


def _arange(n: int) -> np.ndarray:
    """A read-only view of 0..n-1 (cached)."""
    global _ARANGE
    a = _ARANGE
    if a.size < n:
        a = np.arange(max(n, 2 * a.size), dtype=np.int64)
        a.flags.writeable = False
        _ARANGE = a
    return a[:n]


def _as_numpy(t: torch.Tensor, dtype: npt.DTypeLike) -> np.ndarray:
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


def _raise_limit_error(
    table: str,
    over: np.ndarray,
    counts: np.ndarray,
    ucounts: np.ndarray,
    max_ids: int,
    max_uniq: int,
    num_sc: int,
    parts: int,
    per_sc: int,
) -> None:
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
