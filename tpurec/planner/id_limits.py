"""Id limits measured from the data, for the layout a plan gives: `tpurec data stats`, and reading them back.

For every table of a plan (a `tpurec plan --format json` report), each of its shards serves the
global batch (batch per device x devices: TorchRec's input all-to-all brings every rank's ids for a
table to the shard's device), with the slice generation's SparseCores as partitions, and row-wise
shards only their own rows. One streaming pass over a Parquet dataset, in global batches, counts
each batch's fullest segment per table (tpurec.embedding.demand: the kernel's own counting) and keeps
the maximum over shards and batches, and high quantiles. The recommended limit is the observed
maximum plus `HEADROOM`, 8-aligned, and never above what a segment can hold (a SparseCore slice's
samples x the most ids a sample had): a later batch over it is not lost, it runs in several passes
(tpurec.embedding.multipass), so the headroom only trades buffer bytes against extra passes.

The JSON (`FORMAT`): `layout` (what the figures are for) and `tables`, each table with at least
`max_ids_per_partition` and `max_unique_ids_per_partition`. Limits for another layout are refused,
naming both. `zch` (absent: none) says the ids were counted after `tpurec train --zch`'s remap
(`{"eviction": ..., "eviction_interval": ...}`): such limits fit only a run with that remap, and
limits of raw ids only a run without one (`remap_problem`).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterable, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from tpurec.embedding.constraints import SEGMENT_ALIGN, round_up
from tpurec.embedding.demand import ShardsDemand, TableShards
from tpurec.embedding.settings import TableLimits
from tpurec.errors import UserError
from tpurec.planner.hot_rows import HotRows, HotRowTally, load_hot_rows

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.data.reader import IdColumns

FORMAT = "tpurec-id-limits"
HEADROOM = 0.10  # over the observed maximum: batches heavier than any seen stay in one pass
QUANTILES = (0.5, 0.99, 0.999)


class IdLimitsError(UserError):
    """A limits file that cannot be used here (malformed, or measured for another layout)."""


def table_layouts(report: dict) -> list[TableShards]:
    out = []
    for t in report["tables"]:
        ranges = sorted({(int(s["offsets"][0]), int(s["sizes"][0])) for s in t["shards"]})
        sequence = t.get("pooling") == "none"  # an EmbeddingCollection's table (report._table_row)
        out.append(TableShards(t["name"], tuple(t["features"]), int(t["rows"]), tuple(ranges), sequence))
    return out


def layout_of(report: dict) -> dict:
    """What measured limits depend on, from a plan report."""
    return plan_layout(report["topology"], int(report["batch_size_per_device"]))


# ids counted in one sort at most by the numpy route (about 70 bytes of temporaries each): bounds the
# pass's memory on large global batches (an MLPerf DCNv2 batch on v5p-128 holds 112 M ids); the
# compiled route keeps no array per id (a set of a few slots per distinct id of one table's slice)
IDS_PER_GROUP = 8_000_000


class DemandTally:
    """Per table: the fullest segment of every batch seen (entries, distinct ids)."""

    def __init__(self, tables: list[TableShards], layout: dict) -> None:
        self.tables = tables
        self.partitions = layout["sparsecores_per_device"]
        self.batch = layout["batch_size_per_device"] * layout["world_size"]
        self.per_slice = round_up(self.batch, self.partitions) // self.partitions  # samples per SparseCore
        # per batch: (entries, distinct ids) of the fullest segment and of the fullest SparseCore slice,
        # the ids of the fullest sample and of the fullest feature
        self.per_batch: dict[str, list[tuple[int, ...]]] = {t.name: [] for t in tables}
        # every id of every table once more, for its hot-row curve (hot_rows.py: the host tier's cache)
        self.hot = HotRowTally({t.name: t.rows for t in tables})
        self._counters: dict[tuple[tuple[str, ...], int], list[ShardsDemand]] = {}
        self._lock = threading.Lock()

    def _groups(self, keys: tuple[str, ...], ids: int) -> list[ShardsDemand]:
        """All tables in one counter; with the numpy route (one sort), in groups of about equal
        features when a batch holds more ids than IDS_PER_GROUP (the pass's memory; the compiled
        route keeps no array per id, and a group's counter would hold a set of its own). A counter
        per thread: its stamps are its own."""
        from tpurec.embedding import csr_build

        key = (keys, threading.get_ident())
        if key not in self._counters:
            n = 1 if csr_build.available() else min(len(self.tables), max(1, -(-ids // IDS_PER_GROUP))) or 1
            load = [0] * n
            groups: list[list[TableShards]] = [[] for _ in range(n)]
            for t in sorted(self.tables, key=lambda t: -len(t.features)):
                i = load.index(min(load))
                groups[i].append(t)
                load[i] += len(t.features)
            self._counters[key] = [
                ShardsDemand(g, list(keys), num_partitions=self.partitions, batch=self.batch) for g in groups if g
            ]
        return self._counters[key]

    def figures(self, kjt: KeyedJaggedTensor | IdColumns) -> list[tuple[str, tuple[int, ...]]]:
        """One global batch's figures per table (a KeyedJaggedTensor, or a reader's IdColumns, whose
        keys include every table's features). Safe to call from several threads at once, on
        different batches."""
        from tpurec.data.reader import IdColumns  # (the reader's modules: only once counting)

        if isinstance(kjt, IdColumns):
            keys, stride, lengths = tuple(kjt.keys), kjt.stride, kjt.lengths
            ids = sum(c.size for c in kjt.columns)
        else:
            keys, stride, lengths = tuple(kjt.keys()), kjt.stride(), kjt.lengths().numpy()
            values = kjt.values().numpy()
            ids = values.size
        missing = sorted({f for t in self.tables for f in t.features} - set(keys))
        if missing:
            raise IdLimitsError(f"the data has no column(s) {missing} (it has {list(keys)})")
        with self._lock:
            counters = self._groups(keys, ids)
        try:
            if isinstance(kjt, IdColumns):
                counted = [c.count_columns(kjt.columns, lengths, stride) for c in counters]
                by_key = dict(zip(keys, kjt.columns))
            else:
                counted = [c.count(values, lengths, stride) for c in counters]
                ends = np.cumsum(np.asarray(lengths).reshape(len(keys), stride).sum(1))
                by_key = dict(zip(keys, np.split(values, ends[:-1])))
            # (after the counters: they refuse an id outside its table first)
            for t in self.tables:
                self.hot.add(t.name, np.concatenate([by_key[f] for f in t.features]), stride)
            return [(t.name, f) for c, figs in zip(counters, counted) for t, f in zip(c.tables, figs)]
        except UserError as e:  # an id outside its table
            raise IdLimitsError(str(e)) from None

    def record(self, figures: list[tuple[str, tuple[int, ...]]]) -> None:
        for name, f in figures:
            self.per_batch[name].append(f)

    def add(self, kjt: KeyedJaggedTensor) -> None:
        self.record(self.figures(kjt))

    def count_stream(
        self,
        batches: Iterable[Any],
        threads: int = 1,
        on_batch: Callable[[], object] | None = None,
        max_held: int | None = None,
    ) -> int:
        """Counts every batch of `batches` (objects with `.sparse_features`; a ParquetReader's batches
        are taken as its `id_columns`, the ids counted where decoded) with `threads` threads in
        all, and returns the rows seen; figures are recorded in batch order. At most `max_held`
        batches wait for their counts at once (None: `threads`; `batches_in_memory` bounds it by the
        host's memory), the decoding pausing meanwhile.

        * A ParquetReader of multi-hot data, threads >= 2: one pool of `threads` threads decodes its
          windows (two ahead) and counts its batches, task by task, the caller only handing them
          over. Counting a multi-hot batch costs nearly what decoding it does (MLPerf DCNv2: ~4.1
          and ~5.3 ns an id), so neither a decoding thread nor a counting one may sit idle waiting
          for the other: 10-15% less wall time than the split below (`tpurec bench stats`, 2 cores).
        * Otherwise two of the threads are the reader's (ParquetReader decodes on a thread of its
          own while the caller builds batches) and threads - 2 batches are counted at a time on
          threads of their own while the next are read; at most two threads: each batch counted by
          the caller in turn (the decoding goes on beside it; a reader's last two batches side by
          side). One-hot ids count in a third of their decoding time, and the reader's one
          decoding thread beside the counting caller measured faster than the shared pool
          (criteo-kaggle 0.19 against 0.22 s a pass). (Counting on one or two threads more made
          the pass 5-25% slower on this 2-core host: criteo-kaggle 1.21-1.23x the reader counting
          in turn, 1.06-1.19x on one thread more, 0.93-1.08x on two.)"""
        from collections import deque

        from tpurec.data.reader import IdColumns, ParquetReader

        rows = 0
        if isinstance(batches, Sized):  # the hot-row curves sample the pass's batches by its length
            self.hot.batches = len(batches)
        # batches waiting for their counts once the next is handed over: `threads`, fewer where
        # the host's memory holds fewer (`max_held` batches at once, the one being read included)
        waiting = threads if max_held is None else max(0, min(threads, max_held - 1))
        if isinstance(batches, ParquetReader) and threads >= 2 and any(f.multi_hot for f in batches.schema.sparse):
            return self._count_on_one_pool(batches, threads, on_batch, waiting)
        stream: Iterable[Any] = (
            batches.id_columns() if isinstance(batches, ParquetReader) else (b.sparse_features for b in batches)
        )
        workers = threads - 2
        if workers <= 0:
            # with two threads, a reader's last two batches are counted side by side: its decoding
            # thread has then (but for windows shorter than a batch) nothing left to decode, and
            # the pass would otherwise end on one thread counting the last window's batches in turn
            last_two = -1
            if threads == 2 and waiting >= 1 and isinstance(batches, ParquetReader):
                last_two = len(batches) - 2
            held = None
            for i, ids in enumerate(stream):
                rows += ids.stride if isinstance(ids, IdColumns) else ids.stride()
                if i == last_two:
                    held = ids
                    continue
                if held is not None:
                    with ThreadPoolExecutor(1) as pool:
                        first = pool.submit(self.figures, held)
                        figures = self.figures(ids)
                        self.record(first.result())
                    held = None
                    if on_batch:
                        on_batch()
                else:
                    figures = self.figures(ids)
                self.record(figures)
                if on_batch:
                    on_batch()
            if held is not None:  # (the reader gave fewer batches than it said)
                self.record(self.figures(held))
                if on_batch:
                    on_batch()
            return rows
        pending: deque = deque()
        with ThreadPoolExecutor(workers) as pool:
            for ids in stream:
                pending.append(pool.submit(self.figures, ids))
                rows += ids.stride if isinstance(ids, IdColumns) else ids.stride()
                if len(pending) > min(workers, waiting):  # (batches held: one per counting thread, and the next)
                    self._record_first(pending, on_batch)
            while pending:
                self._record_first(pending, on_batch)
        return rows

    def _record_first(self, pending: Any, on_batch: Callable[[], object] | None) -> None:
        """The oldest pending batch's figures, waited for and recorded (batch order)."""
        self.record(pending.popleft().result())
        if on_batch:
            on_batch()

    def _count_on_one_pool(self, reader: Any, threads: int, on_batch: Callable[[], object] | None, waiting: int) -> int:
        """count_stream's shared pool: `threads` threads decode the reader's windows and count its
        batches; at most `waiting` batches wait for their counts while the next is read (memory: the
        windows they view)."""
        from collections import deque

        rows = 0
        pending: deque = deque()
        with ThreadPoolExecutor(threads, thread_name_prefix="tpurec-stats") as pool:
            batches = reader.id_columns(pool, ahead=2)
            try:
                for ids in batches:
                    rows += ids.stride
                    pending.append(pool.submit(self.figures, ids))
                    while pending and (len(pending) > waiting or pending[0].done()):
                        self._record_first(pending, on_batch)
                while pending:
                    self._record_first(pending, on_batch)
            finally:  # (an error: the reader's windows not started are dropped before the pool joins)
                batches.close()
                for f in pending:
                    f.cancel()
        return rows

    def result(self) -> dict:
        tables = {}
        curves = self.hot.result()
        for name, seen in self.per_batch.items():
            a = np.array(seen, dtype=np.int64).reshape(-1, 6)
            top = a.max(0) if a.size else np.zeros(6, np.int64)
            entry = table_entry(*(int(x) for x in top[:5]), per_slice=self.per_slice, per_feature=int(top[5]))
            ids, uniq = a[:, 0], a[:, 1]
            entry["observed"].update(
                {f"p{_pct(q)}_ids": _quantile(ids, q) for q in QUANTILES}
                | {f"p{_pct(q)}_unique_ids": _quantile(uniq, q) for q in QUANTILES}
            )
            if name in curves:
                entry["hot_rows"] = curves[name].to_json()
            tables[name] = entry
        return tables


def table_entry(
    ids: int, uniq: int, slice_ids: int, slice_uniq: int, most: int, *, per_slice: int, per_feature: int | None = None
) -> dict:
    """A table's limits from its observed maxima: per partition (the table alone) and per SparseCore
    slice (what a stack partition holding all of the table would get); never above what a segment
    can hold, a slice's samples x the most ids a sample had. `per_feature`: the most ids one feature
    had in a batch, a sequence table's capacity (`max_ids_per_feature`)."""
    ceiling = round_up(max(1, per_slice * max(most, 1)), SEGMENT_ALIGN)
    rec_ids = min(recommended(ids), ceiling)
    rec_slice = min(recommended(slice_ids), ceiling)
    return {
        "max_ids_per_partition": rec_ids,
        "max_unique_ids_per_partition": min(recommended(uniq), rec_ids),
        "max_ids_per_slice": rec_slice,
        "max_unique_ids_per_slice": min(recommended(slice_uniq), rec_slice),
        **({"max_ids_per_feature": recommended(per_feature)} if per_feature is not None else {}),
        "observed": {
            "max_ids": ids,
            "max_unique_ids": uniq,
            "max_ids_per_slice": slice_ids,
            "max_unique_ids_per_slice": slice_uniq,
            "max_ids_per_sample": most,
            **({"max_ids_per_feature": per_feature} if per_feature is not None else {}),
        },
    }


def recommended(observed_max: int) -> int:
    return round_up(max(SEGMENT_ALIGN, math.ceil(observed_max * (1 + HEADROOM))), SEGMENT_ALIGN)


def _pct(q: float) -> str:
    return f"{q * 100:g}".replace(".", "")


def _quantile(a: np.ndarray, q: float) -> int:
    return int(np.quantile(a, q, method="higher")) if a.size else 0


@dataclass
class IdLimits:
    """Measured limits for the planner and inspector: each table's max ids per partition for the
    layout measured, and for any other layout the same fraction of that layout's worst case (every
    id of a SparseCore's sample slice in one partition) — how `smallest_fitting_topology` tries
    other slices with them."""

    tables: dict[str, TableLimits]
    layout: dict
    source: str = ""
    # each table's hot-row curve where the file has one (hot_rows.py): the host tier's cache sizes
    hot_rows: dict[str, HotRows] = field(default_factory=dict)

    def max_ids(
        self, table: str, samples: int, pooling_factor: float, sparsecores: int, pooled: bool = True, features: int = 1
    ) -> int | None:
        """The buffers' max ids per partition for `table` served `samples` samples (None: not measured).
        A sequence table (`pooled` False) with a measured capacity gets what its kernel takes: a SparseCore
        slice's share of the capacity per feature (`SparseCoreSequenceKernel._limits_of_the_capacity`)."""
        from tpurec.embedding.constraints import worst_case_max_ids_per_partition

        if table not in self.tables:
            return None
        capacity = self.tables[table].max_ids_per_feature
        if not pooled and capacity is not None:
            per_slice = -(-round_up(capacity, max(SEGMENT_ALIGN, sparsecores)) // sparsecores)
            return round_up(max(features, 1) * per_slice, SEGMENT_ALIGN)
        measured = self.tables[table].max_ids_per_partition
        worst = worst_case_max_ids_per_partition(samples, pooling_factor, sparsecores)
        here = self.layout["batch_size_per_device"] * self.layout["world_size"]
        if samples == here and sparsecores == self.layout["sparsecores_per_device"]:
            return min(measured, worst)
        then = worst_case_max_ids_per_partition(here, pooling_factor, self.layout["sparsecores_per_device"])
        return min(worst, round_up(max(1, math.ceil(worst * measured / then)), SEGMENT_ALIGN))

    def to_json(self) -> dict:
        # a plan file stores each table's limits in their positional form (plan_schema reads lists)
        return {
            "layout": self.layout,
            "source": self.source,
            "tables": {k: list(v.positions()) for k, v in self.tables.items()},
            **({"hot_rows": {k: v.to_json() for k, v in self.hot_rows.items()}} if self.hot_rows else {}),
        }

    @classmethod
    def from_json(cls, doc: dict) -> IdLimits:
        tables = {k: TableLimits.from_positions([int(x) for x in v]) for k, v in doc["tables"].items()}
        hot = {k: HotRows.from_json(v) for k, v in (doc.get("hot_rows") or {}).items()}
        return cls(tables, doc["layout"], doc.get("source", ""), hot)


def read_limits(path: str, layout: dict, tables: Mapping[str, Mapping[str, object]] | None = None) -> IdLimits:
    """A limits file as IdLimits (with the tables' hot-row curves), refused unless measured for
    `layout` (and, with `tables`, for those tables: `load_limits`)."""
    with open(path) as f:  # (load_limits read it whole already: a malformed file never gets here)
        hot = load_hot_rows(json.load(f)) if (limits := load_limits(path, layout, tables)) is not None else {}
    return IdLimits(limits, layout, str(path), hot)


def plan_layout(topology: str, batch_size_per_device: int) -> dict:
    """The layout a plan of `topology` at this batch has (what `layout_of` reads from its report)."""
    from tpurec.embedding.constraints import DEFAULT_NUM_SPARSECORES
    from tpurec.planner.topology import parse_slice

    if topology.lower().startswith("cpu-"):
        # a CPU plan runs the kernel with its default SparseCore count (tpurec.embedding.sparsecores)
        world, sparsecores = int(topology.split("-", 1)[1]), DEFAULT_NUM_SPARSECORES
    else:
        spec = parse_slice(topology)
        # the TensorCore kernel (no SparseCores: v5e, v4) is given a layout of one per device
        world, sparsecores = spec.world_size, max(1, spec.generation.sparsecores)
    return {
        "topology": topology,
        "world_size": world,
        "sparsecores_per_device": int(sparsecores),
        "batch_size_per_device": int(batch_size_per_device),
    }


# The most ids a partition's limit can name: the kernel's buffers index ids and entries as int32 on the
# SparseCore (and a host buffer of 2^31 entries is already 8 GiB); 10^12 was accepted and failed at
# the first forward with a MemoryError.
MAX_ID_LIMIT = 2**31 - 1
# the fields of a limits entry, in their positions (docs/id_limits.md): TableLimits' own
LIMIT_FIELDS = tuple(f.name for f in fields(TableLimits))


def _limit(where: str, value: object) -> int:
    """One limit: a whole number in [1, MAX_ID_LIMIT] (not a bool, a float, a string, NaN or inf)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ID_LIMIT:
        raise IdLimitsError(f"{where}: {value!r} is not a whole number in [1, {MAX_ID_LIMIT:,}]")
    return value


def check_id_limits(limits: object, source: str = "id_limits") -> dict[str, TableLimits]:
    """`{table: TableLimits}` from `{table: TableLimits or (max ids, max unique ids per partition[,
    per slice (2)[, per feature]])}` as given to DistributedModelParallel(id_limits=...), checked
    like a flag: each limit a whole number in [1, MAX_ID_LIMIT], the table and the field named
    (IdLimitsError, a UserError)."""
    if not isinstance(limits, dict):
        raise IdLimitsError(f"{source}: {type(limits).__name__} is not a dict {{table: (max ids, max unique ids)}}")
    out = {}
    for name, values in limits.items():
        if not isinstance(name, str):
            raise IdLimitsError(f"{source}: table name {name!r} is not a string")
        if isinstance(values, TableLimits):  # checked like the positional form, field by field
            values = values.positions()
        if not isinstance(values, (tuple, list)) or len(values) not in (2, 4, 5):
            raise IdLimitsError(
                f"{source}[{name!r}]: {values!r} is not (max ids, max unique ids per partition"
                "[, max ids, max unique ids per slice[, max ids per feature]])"
            )
        out[name] = TableLimits.from_positions(
            [_limit(f"{source}[{name!r}] {LIMIT_FIELDS[i]}", v) for i, v in enumerate(values)]
        )
    return out


def load_limits(
    path: str, layout: dict | None = None, tables: Mapping[str, Mapping[str, object]] | None = None
) -> dict[str, TableLimits]:
    """{table: TableLimits} from a limits file (per partition; per slice and per feature when
    given); with `tables` (a model's, as plan_check.embedding_tables gives), refused unless it names
    exactly them (`check_limits_tables`); with `layout`, refused unless the file was measured for it
    (the tables first: limits for another model are the likelier mistake, and the clearer message).
    Every limit present must be a whole number in [1, MAX_ID_LIMIT] (NaN, Infinity, 1.5, "8", 10^12
    refused, the table and field named); nesting deeper than Python's JSON parser reads is refused too."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise IdLimitsError(f"--limits {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise IdLimitsError(f"--limits {path}: not JSON ({e.msg}, line {e.lineno})") from None
    except RecursionError:  # Python's parser recurses once per level: [[[[... a million deep
        raise IdLimitsError(
            f"--limits {path}: not a limits file (JSON nested deeper than Python's parser reads)"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tables"), dict):
        raise IdLimitsError(f"--limits {path}: not a limits file (write one with `tpurec data stats`)")
    if tables is not None:
        check_limits_tables(doc["tables"], tables, f"--limits {path}")
    if layout is not None and not same_layout(doc.get("layout"), layout):
        raise IdLimitsError(f"--limits {path} was measured for {_describe(doc.get('layout'))}, not {_describe(layout)}")
    out = {}
    for name, t in doc["tables"].items():
        if not isinstance(t, dict) or any(k not in t for k in LIMIT_FIELDS[:2]):
            raise IdLimitsError(
                f"--limits {path}: table {name!r} needs integer max_ids_per_partition and max_unique_ids_per_partition"
            )
        # every value present is checked, used or not; the per-slice pair is used when both are
        # given, and the per-feature figure only with them (as a limits file has always been read)
        given = {f: _limit(f"--limits {path}: table {name!r} {f}", t[f]) for f in LIMIT_FIELDS if t.get(f) is not None}
        sliced = all(f in given for f in LIMIT_FIELDS[2:4])
        out[str(name)] = TableLimits(
            given["max_ids_per_partition"],
            given["max_unique_ids_per_partition"],
            **({f: given.get(f) for f in LIMIT_FIELDS[2:]} if sliced else {}),
        )
    return out


def check_limits_tables(
    limits: Mapping[str, object], tables: Mapping[str, Mapping[str, object]], source: str = "id_limits"
) -> None:
    """Refuse limits whose tables are not the model's (`tables`: {module path: {table: ...}}, as
    plan_check.embedding_tables gives), naming the missing and the extra tables: limits measured for
    another model would otherwise bound none of its tables without a word."""
    model = {name for own in tables.values() for name in own}
    missing, extra = sorted(model - set(limits)), sorted(set(limits) - model)
    if missing or extra:
        parts = [f"no limits for the model's table(s) {_names(missing)}"] if missing else []
        parts += [f"table(s) {_names(extra)} are not the model's"] if extra else []
        raise IdLimitsError(
            f"{source}: measured for other tables: {'; '.join(parts)} "
            "(measure this model's: tpurec data stats --model/--plan)"
        )


def _names(names: list[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def remap_problem(path: str, zch: Mapping[str, object] | None) -> str | None:
    """Why the limits file at `path` does not fit a run with the remap `zch` (its record, as `data
    stats --zch` writes it) or without one (None): one line, or None. A file that is no limits file is
    left to `load_limits` to name."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None
    theirs = doc.get("zch")
    if theirs == (dict(zch) if zch is not None else None):
        return None
    if theirs is None or zch is None:
        said = "with" if theirs is not None else "without"
        return (
            f"--limits {path} was measured {said} --zch, but this run is {'with' if zch else 'without'} it "
            f"(the remap changes which rows the ids are): measure with `tpurec data stats"
            f"{' --zch' if zch else ''}`, or {'leave out' if theirs is None else 'give'} --zch"
        )
    return f"--limits {path} was measured for the --zch remap {_remap(theirs)}, not {_remap(zch)}: measure this one"


def _remap(record: object) -> str:
    if not isinstance(record, Mapping):
        return repr(record)
    return f"--zch-eviction {record.get('eviction')} --zch-eviction-interval {record.get('eviction_interval')}"


# What the figures depend on; the topology's name only tells where they were measured (a v5p-8
# layout and 4 CPU ranks with 4 SparseCores each and the same batch are one layout).
LAYOUT_KEYS = ("world_size", "sparsecores_per_device", "batch_size_per_device")


def same_layout(a: object, b: object) -> bool:
    return isinstance(a, dict) and isinstance(b, dict) and all(a.get(k) == b.get(k) for k in LAYOUT_KEYS)


def _describe(layout: object) -> str:
    if not isinstance(layout, dict):
        return "an unknown layout"
    said = [  # a field the file does not give is left out (was: "None SparseCores each")
        text.format(layout[key])
        for key, text in (
            ("world_size", "{} device(s)"),
            ("sparsecores_per_device", "{} SparseCores each"),
            ("batch_size_per_device", "batch {} per device"),
        )
        if layout.get(key) is not None
    ]
    figures = ", ".join(said) or "an unknown layout"
    return f"{layout['topology']} ({figures})" if layout.get("topology") else figures
