"""A batch's demand on table shards' SparseCore buffers, counted as preprocessing counts it.

What `tpurec data stats` measures over a dataset. Preprocessing (preprocess.py) puts every id of the
device batch in one (SparseCore slice, partition) segment: the slice of its sample (the padded batch
cut into P contiguous slices) and the partition of its row (natural row r of a table of R rows lies in
partition r div C, C = padded_rows(R, P) / P: layout.py's renaming). In a segment, repeats of an id
in one sample (and feature) merge into one entry. The limits bound, per segment, the entries
(`max_ids_per_partition`) and the distinct ids (`max_unique_ids_per_partition`).

Counted for the table alone (stack_tables=False), and per SparseCore slice over all partitions. In
a stack the tables lie end to end and a stack partition can hold a whole small table, so the kernel
bounds a stack's segment by each table's per-partition figure times the table partitions a stack
partition can overlap, and never more than its per-slice figure (SparseCoreKernel, id_limits).

`ShardsDemand` counts many tables and row-wise shards of one batch at once: compiled
(demand_kernels, with numba: one pass over the ids, no sort, no array per id), or with numpy one key
per id and one sort for them all (a sort per table and shard costs numpy's per-call overhead
hundreds of times a batch, and a shard mask per shard makes row-wise tables cost O(ids x shards)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tpurec.embedding.constraints import padded_rows, round_up
from tpurec.errors import UserError

# (entries, distinct ids) of the fullest segment, the same of the fullest SparseCore slice
Demand = tuple[int, int, int, int]

# The compiled route (demand_kernels) stamps a shard whose padded rows fit STAMP_CELLS_PER_SHARD int64
# cells, while a counter's stamps stay within STAMP_CELLS (2 MiB, about a core's L2: a stamp read that
# misses the cache costs more than a probe of the small set the other shards use); larger shards go
# through that set.
STAMP_CELLS_PER_SHARD = 1 << 16
STAMP_CELLS = 1 << 18
# the compiled route's set starts with this many slots (grown as a group needs, kept across batches)
SET_SLOTS = 1 << 12


def _bits(n: int) -> int:
    """Bits that hold every value in [0, n)."""
    return max(int(n) - 1, 0).bit_length()


def segment_counts(
    shard: np.ndarray,
    local: np.ndarray,
    partition: np.ndarray,
    sample: np.ndarray,
    slot: np.ndarray | None,
    *,
    num_shards: int,
    num_partitions: int,
    per_slice: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Entries and distinct ids per (shard, SparseCore slice, partition), each [num_shards, P, P].

    shard, local, partition: each id's shard, row in the shard and partition of that row; sample:
    its sample in the batch; slot: its feature within the table, or None when no bag holds two ids
    (then every id is its own entry and only distinct ids need the sort).
    """
    p = num_partitions
    seg_bits = _bits(num_shards) + 2 * _bits(p)
    # (shard * P + slice) * P + partition, in place: these arrays hold every id of the batch
    segment = shard.astype(np.int64) * p
    segment += sample // per_slice
    segment *= p
    segment += partition
    if slot is None:
        fields: list[tuple[np.ndarray, int]] = [(local, int(local.max()) + 1)]
    else:
        fields = [(local, int(local.max()) + 1), (slot, int(slot.max()) + 1), (sample, int(sample.max()) + 1)]
    widths = [_bits(n) for _, n in fields]
    size = num_shards * p * p
    if seg_bits + sum(widths) <= 63:
        # One packed int64 per id, (segment, local[, slot, sample]), and one numpy sort.
        key = segment
        for (x, _), w in zip(fields, widths):
            key <<= w
            key |= x
        key.sort()
        low = sum(widths[1:])
        prefix = key >> low if low else key
        seg_sorted = key >> (low + widths[0])
        new_id = np.empty(key.size, dtype=bool)
        new_id[0] = True
        np.not_equal(prefix[1:], prefix[:-1], out=new_id[1:])
        if slot is None:
            new_entry = None
        else:
            new_entry = np.empty(key.size, dtype=bool)
            new_entry[0] = True
            np.not_equal(key[1:], key[:-1], out=new_entry[1:])
    else:
        cols = [x for x, _ in fields]
        order = np.lexsort(tuple(reversed([segment, *cols])))
        seg_sorted = segment[order]
        cols = [c[order] for c in cols]
        new_id = np.empty(order.size, dtype=bool)
        new_id[0] = True
        new_id[1:] = (seg_sorted[1:] != seg_sorted[:-1]) | (cols[0][1:] != cols[0][:-1])
        new_entry = None
        if slot is not None:
            new_entry = new_id.copy()
            for c in cols[1:]:
                new_entry[1:] |= c[1:] != c[:-1]
    if new_entry is None:
        entries = np.bincount(seg_sorted, minlength=size)
    else:
        entries = np.bincount(seg_sorted[new_entry], minlength=size)
    distinct = np.bincount(seg_sorted[new_id], minlength=size)
    return entries.reshape(num_shards, p, p), distinct.reshape(num_shards, p, p)


def partition_demand(
    ids: np.ndarray, samples: np.ndarray, features: np.ndarray, *, rows: int, num_partitions: int, batch: int
) -> Demand:
    """(entries, distinct ids) of the fullest segment of a table shard of `rows` rows, then the same
    of the fullest SparseCore slice (all partitions together).

    ids: local row ids in [0, rows); samples: each id's sample in [0, batch); features: each id's
    feature slot (a table can serve several features; each has its own bag per sample).
    """
    if ids.size == 0:
        return 0, 0, 0, 0
    p = num_partitions
    per_slice = round_up(max(batch, 1), p) // p
    ids = ids.astype(np.int64, copy=False)
    entries, distinct = segment_counts(
        np.zeros(ids.size, np.int64),
        ids,
        ids // (padded_rows(rows, p) // p),
        samples.astype(np.int64, copy=False),
        features.astype(np.int64, copy=False),
        num_shards=1,
        num_partitions=p,
        per_slice=per_slice,
    )
    return _fullest(entries[0], distinct[0])


def _fullest(entries: np.ndarray, distinct: np.ndarray) -> Demand:
    # partitions hold disjoint ids: a slice's figures are its segments' sums
    return int(entries.max()), int(distinct.max()), int(entries.sum(1).max()), int(distinct.sum(1).max())


@dataclass(frozen=True)
class TableShards:
    """A table as `ShardsDemand` counts it: its features and the distinct row ranges of its shards
    (first row, rows), disjoint and covering the table. `sequence`: an EmbeddingCollection's table,
    whose most ids per feature are counted per shard (a row-wise shard's kernel sees only its rows'
    ids, and sizes its capacity from them)."""

    name: str
    features: tuple[str, ...]
    rows: int
    shards: tuple[tuple[int, int], ...]
    sequence: bool = False


class ShardsDemand:
    """Per table, the demand of a batch on its fullest shard (partition_demand's four figures),
    plus the most ids of one sample and of one feature; every table and shard counted in one sort.

    Built once for a batch's feature order; `count` takes the batch's flattened KJT arrays.
    """

    def __init__(self, tables: list[TableShards], keys: list[str], *, num_partitions: int, batch: int) -> None:
        self.tables, self.p, self.batch = tables, num_partitions, batch
        self.per_slice = round_up(max(batch, 1), num_partitions) // num_partitions
        index = {k: i for i, k in enumerate(keys)}
        # the batch's columns each table reads, grouped by table in table order
        self.features = np.array([index[f] for t in tables for f in t.features], dtype=np.int64)
        self.every_feature_in_order = bool(np.array_equal(self.features, np.arange(len(keys))))
        self.feature_table = np.repeat(np.arange(len(tables)), [len(t.features) for t in tables])
        self.feature_slot = np.concatenate([np.arange(len(t.features)) for t in tables]) if tables else np.zeros(0)
        self.table_first_feature = np.cumsum([0] + [len(t.features) for t in tables])[:-1]
        self.table_rows = np.array([t.rows for t in tables], dtype=np.int64)
        starts: list[int] = []
        sizes: list[int] = []
        first_shard: list[int] = []
        for t in tables:
            first_shard.append(len(starts))
            covered = 0
            for first, rows in sorted(t.shards):
                if rows == 0:  # a row-wise shard of a table smaller than the devices: no ids land there
                    continue
                if first != covered or rows < 0:
                    raise ValueError(
                        f"table {t.name!r}: shard row ranges {sorted(t.shards)} do not tile its {t.rows} rows"
                    )
                starts.append(first)
                sizes.append(rows)
                covered += rows
            if covered != t.rows:
                raise ValueError(f"table {t.name!r}: shard row ranges {sorted(t.shards)} do not tile its {t.rows} rows")
        first_shard.append(len(starts))
        self.table_first_shard = np.array(first_shard, dtype=np.int64)
        self.shard_start = np.array(starts, dtype=np.int64)  # each shard's first row in its table
        self.shard_chunk = np.array([padded_rows(r, num_partitions) // num_partitions for r in sizes], dtype=np.int64)
        self.num_shards = len(starts)
        # per feature (grouped by table): its table's first shard, rows, and partition size
        ft = self.feature_table
        self.feature_rows = self.table_rows[ft]
        self.feature_shard = self.table_first_shard[ft]
        self.feature_chunk = self.shard_chunk[self.feature_shard] if len(ft) else np.zeros(0, np.int64)
        shards_of = np.diff(self.table_first_shard)
        self.row_wise_features = [j for j in range(len(ft)) if shards_of[ft[j]] > 1]
        self.row_wise_sequence = [j for j in self.row_wise_features if tables[ft[j]].sequence]
        self.one_feature_per_table = all(len(t.features) == 1 for t in tables)
        self.one_hot_cache: dict[int, np.ndarray] = {}
        # The compiled route (demand_kernels): shards small enough are counted by stamps, the rest in a set.
        padded = np.array([padded_rows(r, num_partitions) for r in sizes], dtype=np.int64)
        self.shard_stamp_at = np.full(len(sizes), -1, dtype=np.int64)
        cells = 0
        for s in np.argsort(padded, kind="stable"):  # smallest first: the most shards stamped
            need = int(padded[s])
            if need > STAMP_CELLS_PER_SHARD or cells + need > STAMP_CELLS:
                break
            self.shard_stamp_at[s] = cells
            cells += need
        self.stamp_cells = cells
        # a row-wise table whose shards are all P whole partitions of one size (padded_rows adds none):
        # an id's shard and partition from its row by a division (demand_kernels._multi_hot_bits)
        self.table_uniform = np.array(
            [
                int(
                    self.table_first_shard[t + 1] - self.table_first_shard[t] > 1
                    and len({sizes[s] for s in range(self.table_first_shard[t], self.table_first_shard[t + 1])}) == 1
                    and padded[self.table_first_shard[t]] == sizes[self.table_first_shard[t]]
                )
                for t in range(len(tables))
            ],
            dtype=np.int64,
        )
        self._segment_lookup(tables, sizes)
        self.table_first_feature_all = np.cumsum([0] + [len(t.features) for t in tables]).astype(np.int64)
        self.multi_feature_tables = [i for i, t in enumerate(tables) if len(t.features) > 1]
        self._stamps: np.ndarray | None = None
        self._set: np.ndarray | None = None
        self._flags: np.ndarray | None = None
        self._oneset: np.ndarray | None = None
        self._bitmap: np.ndarray | None = None
        self._bagset: np.ndarray | None = None
        self._bag_base = 0

    def count(self, values: np.ndarray, lengths: np.ndarray, stride: int) -> list[tuple[int, ...]]:
        """Per table: (entries, distinct ids) of its fullest segment and fullest slice over its
        shards, the most ids of one sample, the most ids of one of its features in the batch."""
        from tpurec.embedding import csr_build

        if csr_build.available() and self.num_shards and stride:
            return self._compiled_count(values, lengths, stride)
        lens = lengths.reshape(-1, stride)[self.features]  # [features, batch], grouped by table
        per_feature = lens.sum(1)
        if self.one_feature_per_table:
            most_sample, most_feature = lens.max(1) if stride else per_feature, per_feature
        else:
            most_sample = np.add.reduceat(lens, self.table_first_feature, axis=0).max(1) if stride else per_feature
            most_feature = np.maximum.reduceat(per_feature, self.table_first_feature)
        total = int(per_feature.sum())
        if total == 0:
            return [(0, 0, 0, 0, int(a), int(b)) for a, b in zip(most_sample, most_feature)]
        if self.row_wise_sequence:
            most_feature = most_feature.copy()
        if self.every_feature_in_order:
            ids = values.astype(np.int64, copy=False)
        else:
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            starts = offsets[self.features * stride]
            ids = np.concatenate([values[s : s + n] for s, n in zip(starts, per_feature)]).astype(np.int64, copy=False)
        first = np.concatenate([[0], np.cumsum(per_feature)])
        self._check_range(ids, first, per_feature)
        self._per_shard_features(lambda j: ids[first[j] : first[j + 1]], most_feature)
        # Per id: its shard, row in the shard and partition. Ids come grouped by feature, so a table of
        # one shard takes its figures from per-feature constants; only row-wise tables look theirs up.
        shard = np.repeat(self.feature_shard, per_feature)
        chunk = np.repeat(self.feature_chunk, per_feature)
        local = ids
        for j in self.row_wise_features:
            lo, hi = first[j], first[j + 1]
            if lo == hi:
                continue
            if local is ids:
                local = ids.copy()
            t = self.feature_table[j]
            starts = self.shard_start[self.table_first_shard[t] : self.table_first_shard[t + 1]]
            k = np.searchsorted(starts, ids[lo:hi], side="right") - 1
            local[lo:hi] -= starts[k]
            shard[lo:hi] += k
            chunk[lo:hi] = self.shard_chunk[self.table_first_shard[t] + k]
        if self.one_hot_cache.get(stride) is None:
            self.one_hot_cache[stride] = np.tile(np.arange(stride, dtype=np.int64), len(self.features))
        tiled = self.one_hot_cache[stride]
        if int(lens.min()) == 1 == int(lens.max()):  # every bag one id: no entries to merge
            sample, slot = tiled, None
        else:
            sample = np.repeat(tiled, lens.reshape(-1))
            slot = np.repeat(self.feature_slot, per_feature) if int(lens.max()) > 1 else None
        entries, distinct = segment_counts(
            shard,
            local,
            local // chunk,
            sample,
            slot,
            num_shards=self.num_shards,
            num_partitions=self.p,
            per_slice=self.per_slice,
        )
        return self._figures(entries, distinct, most_sample, most_feature)

    def _per_shard_features(self, feature_ids: Callable[[int], np.ndarray], most_feature: np.ndarray) -> None:
        """A row-wise sequence table's most ids per feature: the most of one feature in one of its
        shards (`feature_ids(j)`: the ids of feature j in table order), in place of the whole feature's."""
        seen: dict[int, int] = {}
        for j in self.row_wise_sequence:
            t = int(self.feature_table[j])
            starts = self.shard_start[self.table_first_shard[t] : self.table_first_shard[t + 1]]
            k = np.searchsorted(starts, feature_ids(j), side="right") - 1
            seen[t] = max(seen.get(t, 0), int(np.bincount(k, minlength=1).max()))
        for t, n in seen.items():
            most_feature[t] = n

    def _figures(
        self, entries: np.ndarray, distinct: np.ndarray, most_sample: np.ndarray, most_feature: np.ndarray
    ) -> list[tuple[int, ...]]:
        """Per table, from per-(shard, slice, partition) counts: the fullest shard's figures."""
        figures = np.stack(
            [entries.max((1, 2)), distinct.max((1, 2)), entries.sum(2).max(1), distinct.sum(2).max(1)], axis=1
        )
        per_table = np.maximum.reduceat(figures, self.table_first_shard[:-1], axis=0)
        return [(*map(int, f), int(a), int(b)) for f, a, b in zip(per_table, most_sample, most_feature)]

    def _segment_lookup(self, tables: list[TableShards], sizes: list[int]) -> None:
        """Per table, its (shard, partition) row ranges in row order (each table's list closed by its
        row count) and, per block of 2^shift rows, the range of the block's first row: an id's segment
        without a division (demand_kernels)."""
        p = self.p
        seg_row: list[int] = []
        seg_shard: list[int] = []
        seg_part: list[int] = []
        block_seg: list[int] = []
        shifts, first_block = [], []
        for t, table in enumerate(tables):
            mine = len(seg_row)
            for s in range(int(self.table_first_shard[t]), int(self.table_first_shard[t + 1])):
                start, chunk = int(self.shard_start[s]), int(self.shard_chunk[s])
                for q in range(p):
                    if q * chunk < sizes[s]:  # a partition past the shard's rows holds none of them
                        seg_row.append(start + q * chunk)
                        seg_shard.append(s)
                        seg_part.append(q)
            seg_row.append(max(table.rows, 1))  # closes the table's list
            seg_shard.append(0)
            seg_part.append(0)
            rows = max(table.rows, 1)
            shortest = (
                min(b - a for a, b in zip(seg_row[mine:-1], seg_row[mine + 1 :])) if len(seg_row) > mine + 1 else rows
            )
            # blocks no longer than the shortest range (one boundary each at most), but 1024 at most
            shift = max(shortest.bit_length() - 1, (rows - 1).bit_length() - 10, 0)
            shifts.append(shift)
            first_block.append(len(block_seg))
            ranges = np.array(seg_row[mine:], dtype=np.int64)
            blocks = np.arange(((rows - 1) >> shift) + 1, dtype=np.int64) << shift
            block_seg.extend((mine + np.searchsorted(ranges, blocks, side="right") - 1).tolist())
        self.seg_row, self.seg_shard, self.seg_part = (
            np.array(a, dtype=np.int64) for a in (seg_row, seg_shard, seg_part)
        )
        self.block_seg = np.array(block_seg, dtype=np.int64)
        self.table_block_shift = np.array(shifts, dtype=np.int64)
        self.table_first_block = np.array(first_block, dtype=np.int64)

    def count_columns(self, columns: list[np.ndarray], lengths: np.ndarray, stride: int) -> list[tuple[int, ...]]:
        """`count` of a batch whose keys' ids are separate arrays (columns[k]: key k's ids, as
        `ParquetReader.id_columns` reads them), counted where they lie with numba (no concatenation:
        on MLPerf DCNv2's batches a quarter of the counting's time), else concatenated."""
        from tpurec.embedding import csr_build

        if csr_build.available() and self.num_shards and stride:
            return self._compiled_count(None, lengths, stride, columns)
        return self.count(np.concatenate(columns) if columns else np.zeros(0, np.int64), lengths, stride)

    def _compiled_count(
        self, values: np.ndarray | None, lengths: np.ndarray, stride: int, columns: list[np.ndarray] | None = None
    ) -> list[tuple[int, ...]]:
        """`count` by demand_kernels: no sort, no per-id temporaries; the ids one array (`values`,
        key by key) or one per key (`columns`). Not thread-safe: one counter per thread (its stamps
        and set)."""
        from tpurec.embedding.demand_kernels import (  # numba: lazily
            BAG_SLOTS,
            BAG_SLOTS_PER_ID,
            BITMAP_ROWS,
            FLAG_CELLS,
            LANES,
            MIN_SET_BITS,
            count_groups,
            key_lengths,
            most_per_sample,
        )

        p, nkeys = self.p, lengths.size // stride
        nslices = -(-stride // self.per_slice)
        if nslices > p:
            raise ValueError(f"a batch of {stride} samples is over the layout's batch of {self.batch}")
        key_sum, key_max = np.empty(nkeys, np.int64), np.empty(nkeys, np.int64)
        slice_start = np.empty((nkeys, nslices + 1), np.int64)
        key_lengths(lengths, stride, self.per_slice, key_sum, key_max, slice_start)
        # each key's ids as an address (the kernels view them in place: demand_kernels._key), held here
        # as int64 arrays until counted
        if columns is None:
            assert values is not None
            held = [np.ascontiguousarray(values, dtype=np.int64)]
            if held[0].size != int(key_sum.sum()):
                raise ValueError(f"{held[0].size} ids for lengths that sum to {int(key_sum.sum())}")
            key_at = np.zeros(nkeys, np.int64)
            np.cumsum(key_sum[:-1] * 8, out=key_at[1:])
            key_at += held[0].ctypes.data
        else:
            held = [np.ascontiguousarray(c, dtype=np.int64) for c in columns]
            sizes = [c.size for c in held]
            if sizes != key_sum.tolist():
                raise ValueError(f"columns of {sizes} ids for lengths that sum to {key_sum.tolist()} per key")
            key_at = np.array([c.ctypes.data for c in held], dtype=np.int64)
        bad_id = np.zeros(1, np.int64)
        if self._bitmap is None:  # (all made together)
            self._stamps = np.full(max(self.stamp_cells, 1), -1, dtype=np.int64)
            self._set = np.full(2 * SET_SLOTS, -1, dtype=np.int64)
            self._flags = np.zeros(FLAG_CELLS, np.uint8)
            # a one-hot group's set of rows: two to four slots per id of the largest such group (its
            # features x a SparseCore slice's samples), cleared by the group itself
            most = self.per_slice * max((len(t.features) for t in self.tables), default=1)
            self._oneset = np.full(1 << (max(2 * most, 1 << MIN_SET_BITS) - 1).bit_length(), -1, dtype=np.int64)
            # a bit per row of the largest table within BITMAP_ROWS (its groups' distinct ids)
            fits = [t.rows for t in self.tables if t.rows <= BITMAP_ROWS]
            self._bitmap = np.zeros((max(fits, default=0) + 63) // 64, np.int64)
        # a bag's rows (multi-hot groups counted by the bitmap): BAG_SLOTS_PER_ID slots per id of the
        # longest bag, BAG_SLOTS at most
        longest = int(key_max.max(initial=0))
        slots = min(1 << (max(BAG_SLOTS_PER_ID * longest, 1024) - 1).bit_length(), BAG_SLOTS)
        if self._bagset is None or self._bagset.size < 2 * slots:
            self._bagset = np.full(2 * slots, -1, dtype=np.int64)
        stamps, table, flags, oneset, bitmap = self._stamps, self._set, self._flags, self._oneset, self._bitmap
        bagset = self._bagset
        assert stamps is not None and table is not None and flags is not None and oneset is not None  # (made above)
        size = self.num_shards * p * p
        entries, distinct = np.zeros(size, np.int64), np.zeros(size, np.int64)
        lanes = np.empty(2 * LANES * p * int(np.diff(self.table_first_shard).max()), np.int64)
        group = 0
        while True:
            bad, where, self._bag_base = count_groups(
                key_at, lengths, stride, key_sum, slice_start, self.features, self.table_first_feature_all,
                self.table_rows, self.table_first_shard, self.table_block_shift, self.table_first_block,
                self.table_uniform, self.block_seg, self.seg_row, self.seg_shard, self.seg_part, self.shard_start,
                self.shard_chunk, self.shard_stamp_at,
                stamps, table, self._bag_base, group, self.per_slice, p, entries, distinct, lanes, key_max, flags,
                oneset, bitmap, bagset, bad_id,
            )  # fmt: skip
            if bad != -2:
                break
            # a group filled half the set (its counts undone): twice the set, counted on from that
            # group (the bags counted so far are older than its new ones: their slots read as empty)
            self._set = table = np.full(2 * table.size, -1, dtype=np.int64)
            group = where
        if bad >= 0:
            t = self.tables[where]
            raise UserError(f"table {t.name!r}: id {int(bad_id[0])} outside its {t.rows} rows")
        per_feature = key_sum[self.features]
        most_feature = np.maximum.reduceat(per_feature, self.table_first_feature)
        if columns is None:
            key_first = np.concatenate([[0], np.cumsum(key_sum)])
            self._per_shard_features(
                lambda j: held[0][key_first[self.features[j]] : key_first[self.features[j] + 1]], most_feature
            )
        else:
            self._per_shard_features(lambda j: held[self.features[j]], most_feature)
        most_sample = np.maximum.reduceat(key_max[self.features], self.table_first_feature)
        if self.multi_feature_tables:
            scratch = np.empty(stride, np.int64)
            for i in self.multi_feature_tables:
                j0, j1 = self.table_first_feature_all[i], self.table_first_feature_all[i + 1]
                most_sample[i] = most_per_sample(lengths, stride, self.features, j0, j1, scratch)
        return self._figures(entries.reshape(-1, p, p), distinct.reshape(-1, p, p), most_sample, most_feature)

    def _check_range(self, ids: np.ndarray, first: np.ndarray, per_feature: np.ndarray) -> None:
        """Every id inside its table (one pass: each feature's smallest and largest id)."""
        nonempty = np.flatnonzero(per_feature)
        at = first[nonempty]
        low, high = np.minimum.reduceat(ids, at), np.maximum.reduceat(ids, at)
        bad = (low < 0) | (high >= self.feature_rows[nonempty])
        if bad.any():
            j = int(nonempty[np.argmax(bad)])
            t = self.tables[int(self.feature_table[j])]
            seg = ids[first[j] : first[j + 1]]
            wrong = seg[(seg < 0) | (seg >= t.rows)][0]
            raise UserError(f"table {t.name!r}: id {int(wrong)} outside its {t.rows} rows")
