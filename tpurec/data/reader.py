"""ParquetReader: streaming, rank-sharded, shuffled, resumable batches of torchrec ``Batch``.

Pipeline: this rank's units (shards.assign) -> epoch-seeded unit order -> windows of units holding at
least ``shuffle_buffer`` rows, each decoded by pyarrow and permuted in memory -> batches cut from the
stream of windows. Windows are decoded in a background thread (pyarrow and numpy release the GIL),
so decoding overlaps with the training step.

Everything is deterministic in (seed, epoch, rank, world_size), and the position is the number of
rows of this rank's epoch stream already returned; ``load_state_dict`` finds the window holding that
row without decoding the ones before it, so a resumed run sees exactly the rows it had not seen.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tpurec.data import shards, validate
from tpurec.data.schema import CAT_RAW, DENSE_LOG1P, DENSE_RAW, EMPTY_ID, DataError, DataSchema
from tpurec.errors import UserError

if TYPE_CHECKING:
    import torch  # imported where batches are built: a reader of numpy windows needs no torch
    from torchrec.datasets.utils import Batch


@dataclass
class _Feature:
    """One categorical feature of a window: flat ids, per-row lengths/offsets, optional weights."""

    values: np.ndarray  # int64
    lengths: np.ndarray | None  # int32 per row; None = one id per row
    offsets: np.ndarray | None  # int64, len rows + 1; None = one id per row
    weights: np.ndarray | None  # float32, aligned with values


@dataclass
class _Window:
    rows: int
    labels: np.ndarray  # float32 [rows]
    dense: np.ndarray  # float32 [rows, num_dense], row-major
    ids: list[np.ndarray] | None  # int64 [rows] per feature when every feature is one-hot (fast path)
    features: list[_Feature] | None  # otherwise, per feature


DECODE_THREADS_ENV = "TPUREC_DECODE_THREADS"


def default_decode_threads(env: Any = None) -> int:
    """A training reader's decoding threads per rank: TPUREC_DECODE_THREADS, else an eighth of this
    rank's share of the cores it may run on (os.sched_getaffinity over LOCAL_WORLD_SIZE), 1 to 4. A
    TPU VM's dozens of cores per rank decode side by side while the chips run the step; a small CPU
    host keeps its cores for the step (1 on this 2-core host)."""
    env = os.environ if env is None else env
    text = env.get(DECODE_THREADS_ENV, "")
    if text:
        if not text.isdigit() or int(text) < 1:
            raise UserError(f"{DECODE_THREADS_ENV} must be a whole number >= 1, got {text!r}")
        return int(text)
    local = env.get("LOCAL_WORLD_SIZE", "")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores // ranks // 8))


def _list_parts(arr):
    """A (chunked) list array -> (flat values, int64 offsets starting at 0)."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):  # (a row group's column is one chunk: combining it would copy)
        arr = arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()
    off = arr.offsets.to_numpy().astype(np.int64)
    vals = arr.values.slice(off[0], off[-1] - off[0]).to_numpy(zero_copy_only=False)
    return vals, off - off[0]


class _Decoder:
    """Reads units into windows, validating as it goes; owns the open ParquetFile handles."""

    def __init__(
        self,
        schema: DataSchema,
        dense_log1p: bool = False,
        rehash: list[int] | None = None,
        ids_only: bool = False,
        remapped: frozenset[int] = frozenset(),
    ) -> None:
        self.schema = schema
        self.dense_log1p = dense_log1p  # apply log1p_clamp0 here (the files hold raw dense)
        self.rehash = rehash  # apply mod_reserve0 into these sizes here (the files hold raw ids)
        # of rehash, the features a managed-collision remap takes: raw ids kept, only bounded by its range
        self.remapped = remapped
        # ids_only: the label and dense columns are neither read nor checked (a pass over the ids alone)
        self.ids_only = ids_only
        self.columns = [] if ids_only else [schema.label, *schema.dense]
        for f in schema.sparse:
            self.columns.append(f.name)
            if f.weights:
                self.columns.append(f.weights)
        self.one_hot = all(not f.multi_hot for f in schema.sparse) and not any(f.weights for f in schema.sparse)
        self.files = validate.OpenFiles(self.columns)  # windows are decoded on several threads

    def read_unit(self, u: shards.Unit):
        t = validate.read_row_group(self.files.get(u.path), u.path, u.row_group, self.columns)
        if u.start or u.stop != t.num_rows:
            t = t.slice(u.start, u.rows)
        s = self.schema
        if not self.ids_only:
            validate.check_column(u.path, u.row_group, s.label, t.column(s.label), "int")
            for n in s.dense:
                validate.check_column(u.path, u.row_group, n, t.column(n), "number")
        for f in s.sparse:
            kind = "int_list" if f.multi_hot else "int"
            validate.check_column(u.path, u.row_group, f.name, t.column(f.name), kind)
            if f.weights:
                validate.check_column(u.path, u.row_group, f.weights, t.column(f.weights), "float_list")
        return t

    def window(self, u: shards.Unit) -> _Window:
        """One unit decoded and validated."""
        t = self.read_unit(u)
        n = t.num_rows
        s = self.schema
        where = f"{u.path}: row group {u.row_group}"
        if self.ids_only:  # batches of ids: no dense features, labels 0 (np.zeros maps pages lazily)
            labels, dense = np.zeros(n, np.float32), np.zeros((n, 0), np.float32)
        else:
            labels = t.column(s.label).to_numpy()
            validate.check_labels(where, s.label, labels, u.start)
            labels = labels.astype(np.float32)
            # np.stack writes the row-major block in one pass (3x faster than filling column by column).
            dense = (
                np.stack([t.column(name).to_numpy().astype(np.float32, copy=False) for name in s.dense], axis=1)
                if s.dense
                else np.zeros((n, 0), np.float32)
            )
            validate.check_dense(where, s.dense, dense, u.start)  # before log1p, which would hide -inf
            if self.dense_log1p:
                np.log1p(np.maximum(dense, 0.0, out=dense), out=dense)
        if self.one_hot:
            # One 1-D array per feature, zero-copy from Arrow.
            # checked as stored: a uint64 2^64 - 1 is refused as itself, not as the -1 int64 makes of it
            stored = [t.column(f.name).to_numpy() for f in s.sparse]
            for f, col in zip(s.sparse, stored):
                validate.check_ids(where, f.name, col, f.num_embeddings, u.start)
            ids = [col.astype(np.int64, copy=False) for col in stored]
            if self.rehash:
                ids = [self._rehash(i, col) for i, col in enumerate(ids)]
            return _Window(n, labels, dense, ids, None)
        feats: list[_Feature] = []
        for f in s.sparse:
            col = t.column(f.name)
            if f.multi_hot:
                vals, off = _list_parts(col)
                lengths = np.diff(off).astype(np.int32)
            else:
                vals, off, lengths = col.to_numpy(), None, None
            validate.check_ids(where, f.name, vals, f.num_embeddings, u.start, off)  # as stored (above)
            vals = vals.astype(np.int64, copy=False)
            if self.rehash:
                vals = self._rehash(len(feats), vals)
            w = None
            if f.weights:
                w, woff = _list_parts(t.column(f.weights))
                if not np.array_equal(woff, off if off is not None else np.arange(n + 1)):
                    raise DataError(f"{where}: column {f.weights!r} does not have one weight per id of {f.name!r}")
                w = w.astype(np.float32, copy=False)
            feats.append(_Feature(vals, lengths, off, w))
        return _Window(n, labels, dense, None, feats)

    def _rehash(self, i: int, raw: np.ndarray) -> np.ndarray:
        assert self.rehash is not None
        if i in self.remapped:  # the remap's input: the id as stored, below the remap's input range
            return raw if self.rehash[i] >= 2**63 else raw % self.rehash[i]
        return _hash(raw, self.rehash[i])


def _hash(raw: np.ndarray, num_embeddings: int) -> np.ndarray:
    """mod_reserve0 at read time, for files converted with raw ids: 0 stays 0 (empty)."""
    from tpurec.data.parse import hash_ids

    return hash_ids(raw.astype(np.uint64), raw == EMPTY_ID, num_embeddings)


def _concat(ws: list[_Window]) -> _Window:
    """Several units' windows as one (the rows of a shuffle window)."""
    if len(ws) == 1:
        return ws[0]
    labels = np.concatenate([w.labels for w in ws])
    dense = np.concatenate([w.dense for w in ws])
    rows = len(labels)
    if ws[0].ids is not None:
        return _Window(rows, labels, dense, [np.concatenate(c) for c in zip(*(w.ids for w in ws))], None)
    feats = []
    for parts in zip(*(w.features for w in ws)):
        vals = np.concatenate([f.values for f in parts])
        wts = None if parts[0].weights is None else np.concatenate([f.weights for f in parts])
        if parts[0].offsets is None:
            feats.append(_Feature(vals, None, None, wts))
            continue
        lengths = np.concatenate([f.lengths for f in parts])
        off = np.zeros(rows + 1, np.int64)
        np.cumsum(lengths, out=off[1:])
        feats.append(_Feature(vals, lengths, off, wts))
    return _Window(rows, labels, dense, None, feats)


def _permute(w: _Window, perm: np.ndarray) -> _Window:
    if w.ids is not None:
        return _Window(w.rows, w.labels[perm], w.dense[perm], [c[perm] for c in w.ids], None)
    assert w.features is not None  # a window holds ids or features
    feats = []
    for f in w.features:
        if f.offsets is None or f.lengths is None:  # both None or both set
            feats.append(_Feature(f.values[perm], None, None, None if f.weights is None else f.weights[perm]))
            continue
        lengths = f.lengths[perm]
        off = np.zeros(len(perm) + 1, dtype=np.int64)
        np.cumsum(lengths, out=off[1:])
        # Gather each row's id range: source start of row i, repeated, plus position within row.
        idx = np.repeat(f.offsets[:-1][perm] - off[:-1], lengths) + np.arange(off[-1])
        feats.append(_Feature(f.values[idx], lengths, off, None if f.weights is None else f.weights[idx]))
    return _Window(w.rows, w.labels[perm], w.dense[perm], None, feats)


@dataclass
class IdColumns:
    """One batch's ids alone (`ParquetReader.id_columns`): per key its ids (int64, the column as
    decoded where the batch lies in one window), and every key's bag lengths, key-major as a
    KeyedJaggedTensor's ([keys x stride])."""

    keys: list[str]
    stride: int
    columns: list[np.ndarray]
    lengths: np.ndarray


class ParquetReader:
    """Batches of ``torchrec.datasets.utils.Batch`` from tpurec Parquet files.

    Args:
        paths: a dataset directory, a list of files/directories, or a list of ``shards.Unit``
            (e.g. one side of ``split_train_eval``).
        source: Parquet without tpurec's metadata, read through a column mapping
            (``tpurec.data.mapped.open_source``); ``paths`` may then be None (all of its units).
        batch_size: rows per batch.
        rank, world_size: this rank takes a disjoint, row-balanced share of the row groups.
        shuffle: epoch-seeded shuffle of row-group order and of rows within a window of at least
            ``shuffle_buffer`` rows. Off: rows come in file order.
        seed: shuffle seed (the epoch is mixed in, so each epoch has its own order).
        drop_last: drop the last partial batch. Otherwise it is returned short, or, with
            ``pad_last``, padded to ``batch_size`` with rows having no ids, zero dense and label 0
            (``last_padding`` tells how many rows of the last batch are padding).
        prefetch: windows decoded ahead in a background thread (0: decode inline).
        decode_threads: threads decoding windows side by side (in order, at least this many
            ahead): a window's Parquet decode releases the GIL, so on a host whose cores outnumber
            what the step uses (a TPU VM) the reader keeps up with a faster step (1: the one
            background thread of ``prefetch``; with ``prefetch=0`` ignored).
        equal_rows: every rank reads as many rows per epoch as the smallest rank has (the rest of
            its last window is left out), so all ranks run the same number of steps, as collective
            training needs; which rows are left out changes with the epoch when shuffling.
        dense_transform: ``"log1p_clamp0"`` applies log(max(x, 0) + 1) at read time to files
            converted with raw dense values, and to a mapped ``source``'s dense columns (None: as stored).
        table_sizes: for files converted with raw ids, hash them at read time (``mod_reserve0``)
            into these sizes (list, or dict by feature name); ``table_sizes`` attribute: the sizes
            the batches' ids index into.
        remap_ranges: {feature: range} of features whose table is behind a managed-collision remap
            (a ``--model-module``'s MC tables): their raw ids are not hashed into ``table_sizes`` but
            handed on as read, reduced modulo the remap's input range (``table_sizes`` gives that range).
        ids_only: read the categorical columns alone (`tpurec data stats`): batches with no dense
            features and labels 0, the label and dense columns neither read nor checked; a mapped
            ``source`` reads all of its columns regardless.
        cache: keep decoded row groups in memory after the first epoch (like torchrec's in-memory
            loader: only for data that fits in RAM); later epochs then skip Parquet decoding.

    Iterating runs the rest of the current epoch; a full pass moves to the next epoch. Stopping
    mid-epoch and iterating again continues where it stopped, and ``state_dict``/``load_state_dict``
    carry that position to a new process.
    """

    def __init__(
        self,
        paths: Any,  # a directory, Parquet files, or shards.Units (split_train_eval)
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        pad_last: bool = False,
        shuffle_buffer: int = 262_144,
        prefetch: int = 2,
        decode_threads: int = 1,
        cache: bool = False,
        equal_rows: bool = False,
        dense_transform: str | None = None,
        table_sizes: Sequence[int] | dict[str, int] | None = None,
        source: Any = None,  # a tpurec.data.mapped.MappedSource: Parquet read through a column mapping
        ids_only: bool = False,
        remap_ranges: dict[str, int] | None = None,
    ) -> None:
        if batch_size < 1:
            raise UserError("batch_size must be >= 1")
        given_units = bool(paths) and isinstance(paths, (list, tuple)) and isinstance(paths[0], shards.Unit)
        if source is not None:
            self.schema = source.schema
            all_units = list(paths) if given_units else list(source.units)
        elif given_units:
            files = sorted({u.path for u in paths})
            self.schema, _ = shards.scan(files)
            all_units = list(paths)
        else:
            self.schema, all_units = shards.scan(paths)
        self.units = shards.assign(all_units, rank, world_size)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.drop_last, self.pad_last = drop_last, pad_last
        self.shuffle_buffer, self.prefetch = shuffle_buffer, prefetch
        if decode_threads < 1:
            raise UserError(f"decode_threads must be >= 1, got {decode_threads}")
        self.decode_threads = decode_threads
        self.cache = cache
        self._cache: dict[shards.Unit, _Window] = {}  # decoded units kept across epochs (cache=True)
        self.num_rows = sum(u.rows for u in self.units)  # this rank's rows per epoch
        if equal_rows:  # every rank stops at the smallest rank's row count (same step count)
            self.num_rows = min(sum(u.rows for u in shards.assign(all_units, r, world_size)) for r in range(world_size))
        self.epoch = 0
        self._consumed = 0  # rows of this epoch's stream already returned
        self.last_padding = 0
        self._decoder: Any
        self.table_sizes: Sequence[int | None]  # what the batches' ids index into
        if source is None:
            self._decoder = self._make_decoder(dense_transform, table_sizes, ids_only, remap_ranges or {})
        else:  # ids hashed into each feature's ROWS, else into the table sizes given (the model's, a remap's range)
            sizes = source.sizes(table_sizes)
            self.table_sizes = sizes
            if dense_transform not in (None, DENSE_LOG1P):  # mapped columns are raw: log1p is the one transform
                raise UserError(f"cannot turn mapped dense columns into {dense_transform!r}")
            self._decoder = source.decoder(sizes, dense_log1p=dense_transform == DENSE_LOG1P)
        self.keys = self.schema.sparse_names
        self._ones: torch.Tensor | None = None
        self._ones_np: np.ndarray | None = None

    def _make_decoder(self, dense_transform, table_sizes, ids_only: bool = False, remap_ranges=None) -> _Decoder:
        """Apply at read time the transforms the files do not hold yet (recorded in their metadata)."""
        s = self.schema
        log1p = False
        if dense_transform not in (None, s.dense_transform):
            if (s.dense_transform, dense_transform) != (DENSE_RAW, DENSE_LOG1P):
                raise UserError(f"cannot turn dense {s.dense_transform!r} into {dense_transform!r}")
            log1p = True
        rehash = None
        # what the batches' ids index into
        self.table_sizes = [f.num_embeddings for f in s.sparse]
        if table_sizes is not None:
            sizes = (
                [int(table_sizes[f.name]) for f in s.sparse]
                if isinstance(table_sizes, dict)
                else [int(x) for x in table_sizes]
            )
            if len(sizes) != len(s.sparse):
                raise UserError(f"{len(sizes)} table sizes for {len(s.sparse)} categorical features")
            if s.categorical == CAT_RAW:
                if min(sizes) < 2:
                    raise UserError("hashed tables need num_embeddings >= 2 (id 0 is reserved for empty)")
                rehash = sizes
                self.table_sizes = sizes
            elif sizes != self.table_sizes:
                f, want = next((f, n) for f, n in zip(s.sparse, sizes) if n != f.num_embeddings)
                raise UserError(
                    f"feature {f.name!r}: the files' ids are already hashed ({s.categorical}) into "
                    f"{f.num_embeddings} rows, not {want}; convert with --raw-ids to choose sizes at read time"
                )
        remapped = frozenset(i for i, f in enumerate(s.sparse) if rehash and f.name in (remap_ranges or {}))
        return _Decoder(s, log1p, rehash, ids_only, remapped)

    # ----- position -----------------------------------------------------------------------------
    def __len__(self) -> int:
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _epoch_rows(self) -> int:
        return (self.num_rows // self.batch_size) * self.batch_size if self.drop_last else self.num_rows

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._consumed = int(epoch), 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "rows_consumed": self._consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state: dict) -> None:
        keys = ("seed", "shuffle", "rank", "world_size", "num_rows") + (("shuffle_buffer",) if self.shuffle else ())
        for k in keys:  # anything that changes which rows come in which order
            if state[k] != getattr(self, k):
                raise UserError(f"cannot resume: reader state has {k}={state[k]!r}, this reader {getattr(self, k)!r}")
        self.epoch, self._consumed = int(state["epoch"]), int(state["rows_consumed"])

    # ----- windows ------------------------------------------------------------------------------
    def _windows_plan(self, epoch: int) -> list[list[shards.Unit]]:
        units = list(self.units)
        if not self.shuffle:
            return [[u] for u in units]
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        units = [units[i] for i in rng.permutation(len(units))]
        plan, cur, rows = [], [], 0
        for u in units:
            cur.append(u)
            rows += u.rows
            if rows >= self.shuffle_buffer:
                plan.append(cur)
                cur, rows = [], 0
        if cur:
            plan.append(cur)
        return plan

    def _load(self, epoch: int, index: int, units) -> _Window:
        parts = []
        for u in units:
            w = self._cache.get(u) if self.cache else None
            if w is None:
                w = self._decoder.window(u)
                if self.cache:
                    self._cache[u] = w
            parts.append(w)
        w = _concat(parts)
        if self.shuffle:
            w = _permute(w, np.random.default_rng([self.seed, epoch, self.rank, index, 1]).permutation(w.rows))
        return w

    def _window_stream(self, epoch, plan, first, pool: Executor | None = None, ahead: int = 2):
        """Yields windows plan[first:], decoded ``prefetch`` ahead in a background thread, or with
        `pool` as tasks on it, `ahead` at a time."""
        if pool is not None:
            futures: deque[Future] = deque()
            nxt = first
            try:
                while nxt < len(plan) or futures:
                    while nxt < len(plan) and len(futures) < max(ahead, 1):
                        futures.append(pool.submit(self._load, epoch, nxt, plan[nxt]))
                        nxt += 1
                    yield futures.popleft().result()
            finally:  # (closed early: windows not started are dropped; running ones end in the pool)
                for f in futures:
                    f.cancel()
            return
        if self.prefetch > 0 and self.decode_threads > 1:
            # several windows decoded at once, handed out in order (`pool`'s path)
            with ThreadPoolExecutor(self.decode_threads, thread_name_prefix="tpurec-data-decode") as own:
                yield from self._window_stream(epoch, plan, first, own, max(self.prefetch, self.decode_threads))
            return
        if self.prefetch <= 0:
            for i in range(first, len(plan)):
                yield self._load(epoch, i, plan[i])
            return
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item) -> bool:
            """Hand over one item unless the consumer has gone away (then never block)."""
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for i in range(first, len(plan)):
                    if not put(self._load(epoch, i, plan[i])):
                        return
                put(None)
            except BaseException as e:  # handed to the consumer, raised there
                put(e)

        th = threading.Thread(target=produce, daemon=True, name="tpurec-data-prefetch")
        th.start()
        try:
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            th.join()

    # ----- batches ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        pieces = self._batch_pieces()
        try:  # (closed with this generator: the decoding thread stops at once, as before)
            for done, n in pieces:
                yield self._build(done, n)
        finally:
            pieces.close()

    def id_columns(self, pool: Executor | None = None, ahead: int = 2) -> Iterator[IdColumns]:
        """The batches `__iter__` gives (same rows, order and position), each as its keys' ids and
        lengths alone, the ids of a key a view of the decoded column where the batch lies in one
        window (no concatenation of every key's ids into one array, as a KeyedJaggedTensor needs):
        what `tpurec data stats` counts (`DemandTally.count_stream`). Padding as `__iter__` pads.
        With `pool`, the windows are decoded as tasks on it, `ahead` in flight, instead of on the
        reader's own thread: a caller that counts on the same pool shares its threads between
        decoding and counting."""
        pieces = self._batch_pieces(pool, ahead)
        try:
            for done, n in pieces:
                yield self._columns(done, n)
        finally:
            pieces.close()

    def _batch_pieces(
        self, pool: Executor | None = None, ahead: int = 2
    ) -> Generator[tuple[list[tuple[_Window, int, int]], int], None, None]:
        """Each batch of the rest of the epoch as its (window, first row, end row) pieces and rows."""
        epoch = self.epoch
        end = self._epoch_rows()
        plan = self._windows_plan(epoch)
        # Skip whole windows before the resume position without decoding them.
        first, skip = 0, self._consumed
        while first < len(plan) and skip >= sum(u.rows for u in plan[first]):
            skip -= sum(u.rows for u in plan[first])
            first += 1
        pieces: list[tuple[_Window, int, int]] = []
        have = 0
        self.last_padding = 0
        for w in self._window_stream(epoch, plan, first, pool, ahead):
            pos = skip
            skip = 0
            while pos < w.rows and self._consumed + have < end:
                want = min(self.batch_size - have, w.rows - pos, end - self._consumed - have)
                pieces.append((w, pos, pos + want))
                pos += want
                have += want
                if have == self.batch_size or self._consumed + have == end:
                    done = (pieces, have)
                    self._consumed += have
                    pieces, have = [], 0
                    yield done
            if self._consumed + have >= end:
                break
        if pieces:  # only if the plan ran out early; cannot happen with consistent units
            raise DataError("internal: rows left over at the end of an epoch")
        self.epoch, self._consumed = epoch + 1, 0

    def _columns(self, pieces, n) -> IdColumns:
        pad = self.batch_size - n if (self.pad_last and n < self.batch_size) else 0
        self.last_padding = pad
        nf = len(self.keys)
        columns: list[np.ndarray] = []
        lens: list[np.ndarray] = []
        if not pad and all(w.ids is not None for w, _, _ in pieces):  # one-hot: every bag one id
            for j in range(nf):
                cols = [w.ids[j][s:e] for w, s, e in pieces]
                columns.append(cols[0] if len(cols) == 1 else np.concatenate(cols))
            if self._ones_np is None or self._ones_np.size < nf * n:  # (read only: one array serves all)
                self._ones_np = np.ones(nf * max(n, self.batch_size), np.int32)
            return IdColumns(self.keys, n, columns, self._ones_np[: nf * n])
        for j in range(nf):
            vals = []
            for w, s, e in pieces:
                if w.ids is not None:
                    vals.append(w.ids[j][s:e])
                    lens.append(np.ones(e - s, np.int32))
                    continue
                f = w.features[j]
                if f.offsets is None:
                    vals.append(f.values[s:e])
                    lens.append(np.ones(e - s, np.int32))
                else:
                    vals.append(f.values[int(f.offsets[s]) : int(f.offsets[e])])
                    lens.append(f.lengths[s:e])
            columns.append(vals[0] if len(vals) == 1 else np.concatenate(vals))
            if pad:
                lens.append(np.zeros(pad, np.int32))
        return IdColumns(self.keys, n + pad, columns, np.concatenate(lens) if lens else np.zeros(0, np.int32))

    def _build(self, pieces, n):
        import torch
        from torchrec.datasets.utils import Batch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        pad = self.batch_size - n if (self.pad_last and n < self.batch_size) else 0
        self.last_padding = pad
        total = n + pad

        def cat(arrs, axis: int = 0):
            return arrs[0] if len(arrs) == 1 else np.concatenate(arrs, axis=axis)

        labels = cat([w.labels[s:e] for w, s, e in pieces])
        dense = cat([w.dense[s:e] for w, s, e in pieces])
        if pad:
            labels = np.concatenate([labels, np.zeros(pad, np.float32)])
            dense = np.concatenate([dense, np.zeros((pad, dense.shape[1]), np.float32)])
        nf = len(self.keys)
        w0 = pieces[0][0]
        weights: torch.Tensor | None = None
        lengths: torch.Tensor
        if w0.ids is not None:
            # Feature-major, as KJT wants: all of C1's ids for the batch, then C2's, ...
            values = np.concatenate([w.ids[j][s:e] for j in range(nf) for w, s, e in pieces])
            if pad:
                ones = np.zeros((nf, total), np.int32)
                ones[:, :n] = 1
                lengths = torch.from_numpy(ones.reshape(-1))
            else:
                if self._ones is None or len(self._ones) < nf * n:
                    self._ones = torch.ones(nf * max(n, self.batch_size), dtype=torch.int32)
                lengths = self._ones[: nf * n]
            length_per_key = [n] * nf
        else:
            vals, lens, wts, length_per_key = [], [], [], []
            weighted = any(f.weights is not None for f in w0.features)
            for j in range(nf):
                count = 0
                for w, s, e in pieces:
                    f = w.features[j]
                    if f.offsets is None:
                        lo, hi = s, e
                        lens.append(np.ones(e - s, np.int32))
                    else:
                        lo, hi = int(f.offsets[s]), int(f.offsets[e])
                        lens.append(f.lengths[s:e])
                    vals.append(f.values[lo:hi])
                    if weighted:  # ones for the unweighted features only when some feature has weights
                        wts.append(f.weights[lo:hi] if f.weights is not None else np.ones(hi - lo, np.float32))
                    count += hi - lo
                if pad:
                    lens.append(np.zeros(pad, np.int32))
                length_per_key.append(count)
            values = np.concatenate(vals)
            lengths = torch.from_numpy(np.concatenate(lens))
            if weighted:
                weights = torch.from_numpy(np.concatenate(wts))
        offset_per_key = np.concatenate([[0], np.cumsum(length_per_key)]).tolist()
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=torch.from_numpy(values),
            lengths=lengths,
            weights=weights,
            stride=total,
            length_per_key=length_per_key,
            offset_per_key=offset_per_key,
        )
        return Batch(dense_features=torch.from_numpy(dense), sparse_features=kjt, labels=torch.from_numpy(labels))
