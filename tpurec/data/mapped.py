"""Any Parquet: files, directories and Hive-partitioned datasets that tpurec did not write, read through
a column mapping (tpurec/data/mapping.py) into the reader's windows (tpurec/data/reader.py).

pyarrow.dataset finds the files (recursively, skipping ``_*`` and ``.*`` names, and files of other
names that are not Parquet; a ``*.parquet`` that does not open is an error naming it) and the partition
columns of ``key=value`` directories; the reader's units are the files' row groups, as for tpurec's own
data, so sharding, shuffling and resuming work unchanged.

Decoding rules (docs/data.md, "Your own Parquet"):
  * label: one number per row, 0 or 1 (bool, integer or float); a null label is an error.
  * dense: cast to float32 as stored (no transform; `tpurec train --dense-transform log1p`: log(1 + max(x,
    0)), checked first); null -> 0.0; NaN/inf are errors.
  * sparse: integer ids -> ``id mod ROWS`` (uint64 ids as unsigned numbers; ids already in [0, ROWS) are
    kept as they are); string ids -> ``splitmix64(fnv1a64(utf-8 bytes)) mod ROWS``
    (tpurec/data/string_ids.py); ``list<...>`` columns are multi-hot (the list's length is the row's id
    count). A null (row or list element) is no id: a null or empty list, or a null scalar, gives the row
    length 0.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from tpurec.data import validate
from tpurec.data.mapping import INT, STRING, STRING_LIST, ColumnSpec, _kind, resolve
from tpurec.data.reader import _Feature, _Window
from tpurec.data.schema import (
    DENSE_RAW,
    METADATA_KEY,
    DataError,
    DataSchema,
    SparseFeature,
    dataset_json,
)
from tpurec.data.shards import Unit, footers
from tpurec.data.string_ids import string_hash
from tpurec.runtime import storage

if TYPE_CHECKING:
    import pyarrow as pa

    from tpurec.data.mapping import ColumnMapping, SparseColumn

CAT_MAPPED = "mapped"  # DataSchema.categorical of mapped data: ids made by the rules above


def has_tpurec_metadata(path: str | os.PathLike) -> bool:
    """A dataset tpurec wrote: a directory with ``_dataset.json``, or whose (first) top-level Parquet
    file carries tpurec's footer metadata; or such a file."""
    import pyarrow.parquet as pq

    p = storage.path(path)
    if p.is_dir():
        if dataset_json(p) is not None:
            return True
        files = sorted(p.glob("*.parquet"))
        if not files:
            return False
        p = files[0]
    fs, where = storage.arrow(p)
    try:
        meta = pq.read_metadata(where, filesystem=fs)
    except Exception:  # not Parquet: the mapped reader names the problem
        return False
    return METADATA_KEY in (meta.metadata or {})


def open_source(path: str | os.PathLike, spec: ColumnSpec | None) -> MappedSource | None:
    """The mapped source of `path`, or None for tpurec's own data read without a mapping (fast path)."""
    if (spec is None or not spec.given()) and has_tpurec_metadata(path):
        return None
    return MappedSource(path, spec or ColumnSpec())


PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")  # a file named so must be Parquet: damage is an error


def _refuse_damaged(root: Any, found: set[str], local: bool) -> list[str]:
    """DataError naming the first file under directory `root` named as Parquet (PARQUET_SUFFIXES, not
    under a ``_``/``.`` name) that pyarrow's discovery left out of `found`: it skips a file that does not
    open as Parquet, so a truncated part was dropped and half the data trained without a word. Files
    named otherwise (``README``) are still skipped when they are not Parquet: returned (paths under
    `root`) for one notice; ``_``/``.`` names (``_SUCCESS``) are left out unsaid, as pyarrow does."""
    from tpurec.data.schema import read_footer

    norm = (lambda p: os.path.normpath(p)) if local else (lambda p: p)
    have = {norm(p) for p in found}
    skipped = []
    for f in sorted(root.rglob("*"), key=str):
        rel = f.relative_to(root).parts
        if any(x.startswith(("_", ".")) for x in rel) or norm(str(f)) in have or not f.is_file():
            continue
        if not f.name.lower().endswith(PARQUET_SUFFIXES):
            skipped.append("/".join(rel))
            continue
        read_footer(str(f))  # raises, naming the file and pyarrow's reason
        raise DataError(f"{f}: named as Parquet but not read as part of the dataset {root}")
    return skipped


class MappedSource:
    """A Parquet dataset and its column mapping: ``schema`` (a DataSchema), ``units``, ``decoder()``."""

    def __init__(self, path: str | os.PathLike, spec: ColumnSpec) -> None:
        import pyarrow.dataset as ds

        self.path = str(path)
        here = storage.path(path)
        if not here.exists():
            raise DataError(f"{path}: {here.missing_reason() if storage.is_uri(path) else 'no such file or directory'}")
        fs, where = storage.arrow(path)
        # A bucket's fragments are named "bucket/key" by its filesystem: units carry the URI again.
        named = (lambda p: p) if fs is None else (lambda p: f"{here.scheme}://{p}")
        try:
            dataset = ds.dataset(
                where, format="parquet", partitioning="hive", exclude_invalid_files=True, filesystem=fs
            )
            fragments = sorted(dataset.get_fragments(), key=lambda f: f.path)
        except Exception as e:  # unreadable directory, conflicting partition values, ...
            raise DataError(f"{path}: cannot open as a Parquet dataset ({str(e).splitlines()[0]})") from None
        self.unread: list[str] = []  # files pyarrow's discovery skipped as not Parquet (named otherwise)
        if here.is_dir():
            self.unread = _refuse_damaged(here, {named(f.path) for f in fragments}, local=fs is None)
        if not fragments:
            what = "not a readable Parquet file" if here.is_file() else "no readable Parquet files"
            raise DataError(f"{path}: {what}")
        self.arrow_schema = dataset.schema
        physical = set(fragments[0].physical_schema.names)
        self.partition_columns = tuple(n for n in dataset.schema.names if n not in physical)
        self.mapping: ColumnMapping = resolve(spec, dataset.schema, self.partition_columns)
        self.partition_keys = {named(f.path): ds.get_partition_keys(f.partition_expression) for f in fragments}
        self.units = []
        by_name = {named(f.path): f for f in fragments}
        metas = footers(list(by_name), lambda p: by_name[p].metadata)  # a bucket's on threads
        # each dense column's largest magnitude in the files' statistics (none written: not known)
        self.dense_max_abs: dict[str, float] = {}
        for f, meta in zip(fragments, metas):
            _dense_extremes(meta, self.mapping.dense, self.dense_max_abs)
            for rg in range(meta.num_row_groups):
                n = meta.row_group(rg).num_rows
                if n:
                    self.units.append(Unit(named(f.path), rg, 0, n))
        self.files = len(fragments)
        self.rows = sum(u.rows for u in self.units)
        if not self.rows:
            raise DataError(f"{path}: {self.files} Parquet file(s) without rows")
        m = self.mapping
        self.schema = DataSchema(
            label=m.label,
            dense=list(m.dense),
            sparse=[SparseFeature(f.name, f.rows, f.multi_hot) for f in m.sparse],
            dense_transform=DENSE_RAW,
            categorical=CAT_MAPPED,
            extra={"mapping": m.to_doc()},
        )

    def metadata(self) -> dict:
        """What ``schema.dataset_metadata`` gives for tpurec's data: the schema, rows, files, table sizes."""
        d = self.schema.to_json()
        d.update(rows=self.rows, files=self.files, table_sizes={f.name: f.rows for f in self.mapping.sparse})
        d["mapping"] = self.mapping.to_doc()
        d["mapping_inferred"] = list(self.mapping.inferred)
        d["mapping_label_note"] = self.mapping.label_like_note()
        d["sparse_kinds"] = {f.name: f.kind for f in self.mapping.sparse}
        d["dense_max_abs"] = self.dense_max_abs
        d["unread_files"] = self.unread
        return d

    def sizes(self, table_sizes: Any) -> list[int | None]:
        """Each feature's table size: its ROWS, else the model's (`table_sizes`: list or {name: rows})."""
        out: list[int | None] = []
        for i, f in enumerate(self.mapping.sparse):
            if f.rows is not None or table_sizes is None:
                out.append(f.rows)
            elif isinstance(table_sizes, dict):
                out.append(int(table_sizes[f.name]) if f.name in table_sizes else None)
            else:
                out.append(int(table_sizes[i]) if i < len(table_sizes) else None)
        return out

    def decoder(self, sizes: list[int | None], dense_log1p: bool = False) -> MappedDecoder:
        return MappedDecoder(self, sizes, dense_log1p)


def _dense_extremes(meta: Any, dense: list[str], out: dict[str, float]) -> None:
    """Fold into `out` the largest |value| of each dense column in one file's row-group statistics."""
    where = {meta.schema.column(j).path: j for j in range(meta.num_columns)}
    for name in dense:
        j = where.get(name)
        for rg in range(meta.num_row_groups) if j is not None else ():
            st = meta.row_group(rg).column(j).statistics
            if st is not None and st.has_min_max:
                try:
                    top = max(abs(float(st.min)), abs(float(st.max)))
                except (TypeError, ValueError):  # not a number (a type the mapping refuses anyway)
                    continue
                out[name] = max(out.get(name, 0.0), top)


LARGE_DENSE = 100.0  # beyond this a dense value saturates a fresh MLP's units (measured: first loss ~4, not 0.7)


def large_dense_note(meta: dict) -> str | None:
    """The line naming the dense columns of a mapped dataset whose values reach past LARGE_DENSE: they
    go to the model as stored (no transform), where values in the thousands give first losses of 4
    instead of 0.7 and slow training; None when none does (or the files record no statistics)."""
    big = {c: v for c, v in (meta.get("dense_max_abs") or {}).items() if v > LARGE_DENSE}
    if "mapping" not in meta or not big:
        return None
    cols = sorted(big, key=lambda c: -big[c])
    shown = ", ".join(f"{c} (up to {big[c]:,.0f})" for c in cols[:6]) + (
        f" and {len(cols) - 6} more" if len(cols) > 6 else ""
    )
    return (
        f"notice: dense column(s) {shown} go to the model as stored: values this large make the first losses "
        "large and training slow; give --dense-transform log1p (log(1 + x) of counts, as Criteo's are "
        "converted), or scale them when writing the Parquet (docs/data.md#your-own-parquet)"
    )


def unread_files_note(path: str | os.PathLike, meta: dict) -> str | None:
    """The notice naming the files in dataset directory `path` that are not read (a count and an
    example), for tpurec's own data (`meta` its dataset_metadata) or mapped Parquet (`metadata()`)."""
    from tpurec.data.schema import unread_files, unread_note

    if "mapping" in meta:
        return unread_note(path, meta.get("unread_files") or [], "not Parquet")
    return unread_note(path, unread_files(path), "not named *.parquet (tpurec's data is read from those only)")


class MappedDecoder:
    """Reads a unit's mapped columns and decodes them into a reader window (the module's rules)."""

    def __init__(self, source: MappedSource, sizes: list[int | None], dense_log1p: bool = False) -> None:
        self.source, self.mapping, self.sizes = source, source.mapping, sizes
        self.dense_log1p = dense_log1p  # log(1 + max(x, 0)) of every dense value (--dense-transform log1p)
        m = self.mapping
        self.columns = [m.label, *m.dense, *(f.name for f in m.sparse)]
        self.physical = [c for c in self.columns if c not in source.partition_columns]
        numbers = ("float", "bool", INT)
        self.kinds = {m.label: numbers, **dict.fromkeys(m.dense, numbers), **{f.name: (f.kind,) for f in m.sparse}}
        self.files = validate.OpenFiles(self.physical)  # windows are decoded on several threads

    def read(self, u: Unit) -> pa.Table:
        """The unit's mapped columns (partition columns filled in from the directory names), type-checked."""
        import pyarrow as pa

        t = validate.read_row_group(self.files.get(u.path), u.path, u.row_group, self.physical)
        if u.start or u.stop != t.num_rows:
            t = t.slice(u.start, u.rows)
        keys = self.source.partition_keys.get(u.path, {})
        for name in self.columns:
            if name in self.source.partition_columns:
                typ = self.source.arrow_schema.field(name).type
                one = pa.array([keys.get(name)], type=typ)
                t = t.append_column(name, one.take(pa.array(np.zeros(t.num_rows, np.int64))))
        for name, kinds in self.kinds.items():  # another file may hold a column of another type
            if _kind(t.column(name).type) not in kinds:
                raise DataError(
                    f"{u.path}: row group {u.row_group}: column {name!r} has type {t.column(name).type}, "
                    f"but the dataset's is {self.source.arrow_schema.field(name).type}"
                )
        return t

    def window(self, u: Unit) -> _Window:
        return self.decode(self.read(u), u)

    def decode(self, t: pa.Table, u: Unit) -> _Window:
        where = f"{u.path}: row group {u.row_group}"
        m, n = self.mapping, t.num_rows
        labels = _labels(where, m.label, t.column(m.label), u.start)
        dense = np.stack([_dense(t.column(c)) for c in m.dense], axis=1) if m.dense else np.zeros((n, 0), np.float32)
        validate.check_dense(where, m.dense, dense, u.start)  # before log1p, which would hide -inf
        if self.dense_log1p:
            np.log1p(np.maximum(dense, 0.0, out=dense), out=dense)
        feats = [_sparse(f, t.column(f.name), size, n) for f, size in zip(m.sparse, self.sizes)]
        return _Window(n, labels, dense, None, feats)


def _labels(where: str, name: str, col: Any, first_row: int) -> np.ndarray:
    if col.null_count:
        raise DataError(f"{where}: column {name!r}: {col.null_count} null label(s); every row needs a 0/1 label")
    x = np.asarray(col.to_numpy(zero_copy_only=False)).astype(np.float64)
    bad = (x != 0) & (x != 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{where}: column {name!r}: row {first_row + i}: label {x[i]:g}, expected 0 or 1 "
            "(clicks; convert other targets to 0/1 first)"
        )
    return x.astype(np.float32)


def _dense(col: Any) -> np.ndarray:
    """One dense column as float32, nulls as 0.0."""
    import pyarrow as pa
    import pyarrow.compute as pc

    x = pc.fill_null(col.cast(pa.float64()), 0.0)
    return np.asarray(x.to_numpy()).astype(np.float32)


def _sparse(f: SparseColumn, col: Any, size: int | None, n: int) -> _Feature:
    """One sparse column: ids (hashed into `size`), a length per row (nulls: none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if f.multi_hot:
        parents = np.asarray(pc.list_parent_indices(arr).to_numpy(zero_copy_only=False), np.int64)
        vals = pc.list_flatten(arr)
    else:
        parents, vals = np.arange(n, dtype=np.int64), arr
    if pa.types.is_dictionary(vals.type):
        vals = vals.dictionary_decode()
    if vals.null_count:
        keep = np.asarray(vals.is_valid().to_numpy(zero_copy_only=False), bool)
        vals, parents = vals.filter(pa.array(keep)), parents[keep]
    ids = _ids(vals, f.kind, size)
    lengths = np.bincount(parents, minlength=n).astype(np.int32)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return _Feature(ids, lengths, offsets, None)


def _ids(vals: Any, kind: str, size: int | None) -> np.ndarray:
    """int64 ids in [0, size): integers mod size, strings' string_hash mod size (size None: unhashed,
    strings' hash >> 1, for `data inspect` of features without ROWS)."""
    if kind in (STRING, STRING_LIST):
        h = string_hash(vals)
        return (h % np.uint64(size)).astype(np.int64) if size else (h >> np.uint64(1)).astype(np.int64)
    assert kind in (INT, "int_list"), kind
    x = np.asarray(vals.to_numpy(zero_copy_only=False))
    if x.dtype == np.uint64 and size:
        # mod in uint64: cast to int64 first, 2^64 - 1 read as -1 and hashed to size - 1
        return (x % np.uint64(size)).astype(np.int64)
    x = x.astype(np.int64, copy=False)  # unhashed uint64 ids keep their bits: distinct ids stay distinct
    if size and size >= 2**63:  # a managed-collision remap's whole int64 range: negative ids as unsigned
        return (x.view(np.uint64) % np.uint64(size)).astype(np.int64)
    return np.mod(x, size) if size else x


def mapping_summary(meta: dict) -> str:
    """One line about a mapped dataset's columns (from ``MappedSource.metadata()``)."""
    from collections import Counter

    kinds = Counter((meta.get("sparse_kinds") or {}).values())
    sparse = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in kinds.items())
    inferred = meta.get("mapping_inferred") or []
    how = f"; inferred: {', '.join(inferred)} (`tpurec data inspect` prints the mapping)" if inferred else ""
    note = meta.get("mapping_label_note")
    return (
        f"label {meta.get('label')!r}, {len(meta.get('dense') or [])} dense, "
        f"{len(meta.get('sparse') or [])} sparse ({sparse}){how}" + (f"; {note}" if note else "")
    )


def unsized_note(meta: dict, sizes: list[int], table_set: str) -> str | None:
    """The line saying which mapped features hash into the model's table sizes (no ``:ROWS`` given)."""
    unsized = [i for i, f in enumerate(meta.get("sparse") or []) if f.get("num_embeddings") is None]
    if "mapping" not in meta or not unsized:
        return None
    rows = [sizes[i] for i in unsized]
    return (
        f"tables: {len(unsized)} sparse column(s) without :ROWS hash their ids into the {table_set} table sizes "
        f"({min(rows):,} to {max(rows):,} rows); give --sparse NAME:ROWS to choose"
    )
