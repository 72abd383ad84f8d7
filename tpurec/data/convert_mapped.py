"""`tpurec data convert` of Parquet, CSV and TSV through a column mapping, into tpurec's own format.

The mapping is the one `train`, `data inspect` and `data stats` take (tpurec/data/mapping.py: flags,
a ``--columns`` file, or inferred), and Parquet is decoded by their code (tpurec/data/mapped.py), so
`tpurec train` on the output reads the batches `tpurec train` reads from the source with that
mapping: the same labels, dense values (as stored, nulls 0.0), ids (integers ``mod ROWS``, strings'
stable hash ``mod ROWS``) and lengths. Each source file becomes one output file and, unless
``--row-group-size`` is given, each of its row groups one row group, so the reader's units (row
groups), and with them the train/eval split, shuffling and sharding, are the source's.

The output is ``dense_transform = raw`` and ``categorical = mod`` (ids in ``[0, ROWS)``). A scalar id
column whose rows may lack an id (nulls) is written as a ``list<int64>`` column of length 0 or 1, as
the reader gives it; the Parquet statistics tell which columns hold nulls, and a column found to hold
one anyway makes the conversion start over with it as a list column (text has no statistics).

Text (CSV with a header line, TSV) is streamed with pyarrow.csv; its ids are read as ``--ids``
states (decimal, hex or strings to hash, per column if needed), never guessed. An empty field is a
null: dense 0.0, no id; an empty label is refused.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tpurec.data import parse
from tpurec.data.mapped import MappedSource, _sparse
from tpurec.data.mapping import INT, STRING, ColumnSpec, MappingError, SparseColumn, resolve
from tpurec.data.reader import _Window
from tpurec.data.schema import CAT_MOD, DENSE_RAW, DataError, DataSchema, SparseFeature, parquet_writer
from tpurec.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa

    from tpurec.data.mapping import ColumnMapping

ID_KINDS = ("decimal", "hex", "string")  # how a text column's ids are written (--ids)
TEXT_ROW_GROUP = 65536  # text's row group size when --row-group-size is not given
_MAX_EXAMPLES = 5


@dataclass
class MappedOptions:
    spec: ColumnSpec = field(default_factory=ColumnSpec)
    ids: str | None = None  # text: "KIND" or "KIND,GLOB=KIND,..." (KIND in ID_KINDS)
    input_format: str = "auto"  # "parquet", "csv", "tsv", or by name
    row_group_size: int | None = None  # None: Parquet keeps its row groups, text TEXT_ROW_GROUP
    compression: str = "snappy"
    skip_bad_lines: bool = False  # text: drop malformed lines, count them
    table_sizes: list[int] | None = None  # by position, for sparse columns given without :ROWS
    block_size: int = 16 << 20  # bytes of text parsed at a time


def is_parquet(path: str | os.PathLike) -> bool:
    """A Parquet file (by its magic bytes), or a directory holding ``*.parquet`` files at any depth."""
    p = Path(path)
    if p.is_dir():
        return any(f.suffix == ".parquet" for f in p.rglob("*.parquet"))
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"PAR1"
    except OSError:
        return False


def wants_mapping(inputs: list[str], spec: ColumnSpec, input_format: str) -> bool:
    """Whether `convert` takes this route: Parquet input, or a column mapping given for text."""
    return input_format == "parquet" or spec.given() or any(is_parquet(p) for p in inputs)


class _NeedsLists(Exception):
    """Scalar id columns found to lack an id in some row: convert again with them as list columns."""

    def __init__(self, names: set[str]) -> None:
        super().__init__(", ".join(sorted(names)))
        self.names = names


@dataclass
class _Part:
    """One output file: where its rows come from, and its windows (decoded rows) in order."""

    source: str
    total: int  # progress units: rows of Parquet, bytes of text
    keep_row_groups: bool  # Parquet without --row-group-size: one output row group per source row group
    windows: Callable[[Callable[[int], object]], Iterator[_Window]]  # progress(n) -> windows
    rows: int = 0
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)


def convert_mapped(
    inputs: list[str], out_dir: str, opts: MappedOptions, show_progress: bool = True, overwrite: bool = False
) -> dict:
    """Convert `inputs` (one Parquet file or directory, or text files) into ``out_dir``; the summary
    as `tpurec.data.convert.convert` gives it, plus the mapping (``mapping``, ``mapping_yaml``)."""
    from tpurec.data.out_lock import locked_output

    for p in inputs:
        if not os.path.exists(p):
            raise DataError(f"{p}: no such file or directory")
    parquet = [p for p in inputs if opts.input_format == "parquet" or is_parquet(p)]
    if parquet and len(inputs) > 1:
        raise UserError(
            f"{parquet[0]}: convert one Parquet file or directory at a time "
            f"(a directory, Hive-partitioned or not, holds any number of files); {len(inputs)} inputs given"
        )
    if parquet:
        if opts.ids is not None:
            raise UserError(f"{parquet[0]}: --ids is for text input; Parquet's column types say what its ids are")
        with _naming(parquet[0]):
            mapping, parts, unit = _parquet_parts(parquet[0], opts)
        facts: dict[str, Any] = {"source_format": "parquet"}
    else:
        with _naming(inputs[0]):
            mapping, parts, id_kinds = _text_parts(inputs, opts)
        unit = "B"
        facts = {"source_format": "text", "ids": id_kinds}
    sizes = table_sizes(mapping, opts.table_sizes)
    listy = {f.name for f in mapping.sparse if f.multi_hot} | parts.nullable
    with locked_output(out_dir, overwrite, "tpurec data convert") as out:
        summary = _write(out, parts.items, mapping, sizes, listy, opts, unit, facts, show_progress)
    summary["mapping"] = mapping.to_doc()
    summary["mapping_inferred"] = list(mapping.inferred)
    summary["mapping_yaml"] = mapping.to_yaml()
    return summary


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """A mapping problem names the input it was resolved against (train/inspect name it themselves)."""
    try:
        yield
    except MappingError as e:
        raise MappingError(f"{path}: {e}") from None


def table_sizes(mapping: ColumnMapping, by_position: list[int] | None) -> list[int]:
    """Each sparse column's table size: its ROWS, else the one at its position in `by_position`."""
    sizes: list[int | None] = [
        f.rows if f.rows is not None else (by_position[i] if by_position and i < len(by_position) else None)
        for i, f in enumerate(mapping.sparse)
    ]
    missing = [f.name for f, n in zip(mapping.sparse, sizes) if n is None]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise MappingError(
            f"convert: no table size for sparse column(s) {shown}: give --sparse NAME:ROWS (or rows in the --columns "
            "file), or --table-set/--table-sizes for the columns without ROWS, by position"
        )
    return [int(n) for n in sizes if n is not None]


class _Parts:
    def __init__(self, items: list[_Part], nullable: set[str] | None = None) -> None:
        self.items, self.nullable = items, nullable or set()


# ---- Parquet -----------------------------------------------------------------------------------


def _parquet_parts(path: str, opts: MappedOptions) -> tuple[ColumnMapping, _Parts, str]:
    src = MappedSource(path, opts.spec)
    sizes = table_sizes(src.mapping, opts.table_sizes)
    by_file: dict[str, list] = {}
    for u in src.units:
        by_file.setdefault(u.path, []).append(u)

    def windows_of(units: list) -> Callable[[Callable[[int], object]], Iterator[_Window]]:
        def gen(progress: Callable[[int], object]) -> Iterator[_Window]:
            decoder = src.decoder(list(sizes))
            for u in units:
                yield decoder.window(u)
                progress(u.rows)

        return gen

    keep = opts.row_group_size is None
    items = [_Part(f, sum(u.rows for u in us), keep, windows_of(us)) for f, us in by_file.items()]
    return src.mapping, _Parts(items, _nulls_in_statistics(src)), "rows"


def _nulls_in_statistics(src: MappedSource) -> set[str]:
    """Scalar sparse columns whose Parquet statistics count nulls (or that have none): lists from the start."""
    import pyarrow.parquet as pq

    scalar = {f.name for f in src.mapping.sparse if not f.multi_hot and f.name not in src.partition_columns}
    found: set[str] = set()
    for path in dict.fromkeys(u.path for u in src.units):
        meta = pq.read_metadata(path)
        index = {meta.schema.column(i).path: i for i in range(meta.num_columns)}
        for rg in range(meta.num_row_groups):
            for name in scalar - found:
                if name not in index:
                    continue
                stats = meta.row_group(rg).column(index[name]).statistics
                if stats is not None and stats.has_null_count and stats.null_count:
                    found.add(name)
    return found


# ---- text --------------------------------------------------------------------------------------


def _delimiter(path: str, input_format: str) -> str:
    if input_format in ("csv", "tsv"):
        return "," if input_format == "csv" else "\t"
    name = Path(path).name.lower().removesuffix(".gz")
    return "," if name.endswith(".csv") else "\t"


def _open(path: str, delimiter: str, opts: MappedOptions, *, columns=None, types=None, on_invalid=None) -> Any:
    """(raw file, pyarrow streaming CSV reader) of a text file with a header line."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    raw = pa.OSFile(path, "rb")
    stream = pa.CompressedInputStream(raw, "gzip") if path.endswith(".gz") else raw
    read = pcsv.ReadOptions(block_size=opts.block_size, use_threads=False)
    parse_opts = pcsv.ParseOptions(delimiter=delimiter, invalid_row_handler=on_invalid)
    conv = pcsv.ConvertOptions(
        include_columns=columns,
        column_types=types,
        strings_can_be_null=True,
        null_values=[""],
        quoted_strings_can_be_null=False,
    )
    try:
        return raw, pcsv.open_csv(stream, read_options=read, parse_options=parse_opts, convert_options=conv)
    except BaseException:
        stream.close()
        raw.close()
        raise


def _header_schema(path: str, delimiter: str, opts: MappedOptions) -> pa.Schema:
    """The columns of a text file's header, typed as pyarrow infers them from its first block (for
    the inferred mapping and its checks; the values are then read as text and parsed here)."""
    import pyarrow as pa

    with open(path, "rb") as f:
        if f.read(4) == b"PAR1":
            raise DataError(f"{path}: a Parquet file among text inputs: convert it on its own")
    try:  # lines of another width are named when the file is read, not here
        raw, reader = _open(path, delimiter, opts, on_invalid=lambda row: "skip")
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: cannot read its header line ({str(e).splitlines()[0]})") from None
    try:
        schema = reader.schema
    finally:
        raw.close()
    # An all-empty first block gives a null type: numbers are the likelier meaning (dense or integer ids).
    return pa.schema([pa.field(f.name, pa.int64()) if pa.types.is_null(f.type) else f for f in schema])


def id_kinds(text: str | None, mapping: ColumnMapping, where: str) -> dict[str, str]:
    """Each sparse column's id kind from ``--ids KIND[,GLOB=KIND...]``; required when there are ids."""
    names = [f.name for f in mapping.sparse]
    if not names:
        return {}
    if text is None:
        raise UserError(
            f"{where}: text ids are never guessed: say how they are written, --ids decimal, --ids hex or --ids string "
            "(hashed), or per column (--ids 'decimal,name_*=string')"
        )
    default, rules = None, []
    for entry in [x.strip() for x in text.split(",") if x.strip()]:
        pattern, sep, kind = entry.rpartition("=")
        if kind not in ID_KINDS:
            raise UserError(f"--ids {text!r}: {kind!r} is not one of {', '.join(ID_KINDS)}")
        if not sep:
            default = kind
            continue
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise UserError(f"--ids {text!r}: {pattern!r} names no sparse column (they are: {', '.join(names[:12])})")
        rules.append((pattern, kind))
    out = {}
    for n in names:
        chosen = next((k for p, k in reversed(rules) if fnmatch.fnmatchcase(n, p)), default)
        if chosen is None:
            raise UserError(f"--ids {text!r}: no kind for sparse column {n!r} (give a default: --ids decimal,...)")
        out[n] = chosen
    return out


def _text_parts(inputs: list[str], opts: MappedOptions) -> tuple[ColumnMapping, _Parts, dict[str, str]]:
    first = inputs[0]
    header = _header_schema(first, _delimiter(first, opts.input_format), opts)
    mapping = resolve(opts.spec, header)
    kinds = id_kinds(opts.ids, mapping, first)
    sizes = table_sizes(mapping, opts.table_sizes)
    items = []
    for path in inputs:
        part = _Part(path, os.path.getsize(path), False, lambda progress: iter(()))
        part.windows = _text_windows(part, _delimiter(path, opts.input_format), mapping, kinds, sizes, opts)
        items.append(part)
    return mapping, _Parts(items), kinds


def _text_windows(part: _Part, delimiter: str, mapping: ColumnMapping, kinds: dict[str, str], sizes, opts):
    def gen(progress: Callable[[int], object]) -> Iterator[_Window]:
        yield from _read_text(part, delimiter, mapping, kinds, sizes, opts, progress)

    return gen


def _read_text(part, delimiter, mapping, kinds, sizes, opts, progress) -> Iterator[_Window]:
    import pyarrow as pa

    from tpurec.data.convert import _LineMap, _raise_clean

    path = part.source
    columns = [mapping.label, *mapping.dense, *(f.name for f in mapping.sparse)]
    lines = _LineMap(1)
    invalid: list[str] = []

    def on_invalid(row) -> str:
        got = f"expected {row.expected_columns} fields, got {row.actual_columns}"
        msg = f"{path}:{row.number}: {got}: {row.text[:80]!r}"
        if not opts.skip_bad_lines:
            invalid.append(msg)
            return "error"
        lines.dropped.append(row.number)
        _bad(part, msg)
        return "skip"

    def failure(e: Exception) -> Exception:
        if invalid:
            return DataError(f"malformed line {invalid[0]}")
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "not found" in text or "include_columns" in text:
            missing = [c for c in columns if c not in _header_names(path, delimiter)]
            return DataError(f"{path}: no column {', '.join(map(repr, missing))} in its header line")
        return DataError(f"{path}: cannot read it ({text})")

    err = None
    try:
        raw, reader = _open(
            path, delimiter, opts, columns=columns, types=dict.fromkeys(columns, pa.string()), on_invalid=on_invalid
        )
    except (pa.ArrowInvalid, pa.ArrowKeyError, OSError) as e:
        err = failure(e)
    if err is not None:
        _raise_clean(err)
    seen, done = 0, 0
    try:
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError) as e:
                err = failure(e)
            if err is not None:
                _raise_clean(err)
            n = batch.num_rows
            bad, reason = _bad_rows(batch, mapping, kinds)
            if bad.any():
                rows = np.flatnonzero(bad)
                if not opts.skip_bad_lines:
                    first = int(rows[0])
                    raise DataError(f"malformed line {path}:{lines.line(seen + first)}: {reason[first]}")
                for r in rows.tolist():
                    _bad(part, f"{path}:{lines.line(seen + r)}: {reason.get(r, 'bad value')}")
                keep = batch.filter(pa.array(~bad))
            else:
                keep = batch
            seen += n
            if keep.num_rows:
                yield _decode_text(keep, mapping, kinds, sizes, path)
            pos = raw.tell()
            if pos > done:
                progress(pos - done)
                done = pos
    finally:
        raw.close()
    if part.total > done:
        progress(part.total - done)


def _bad(part: _Part, msg: str) -> None:
    part.bad_lines += 1
    if len(part.bad_examples) < _MAX_EXAMPLES:
        part.bad_examples.append(msg)


def _header_names(path: str, delimiter: str) -> list[str]:
    import csv
    import gzip

    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        return next(csv.reader(f, delimiter=delimiter), [])


def _bad_rows(batch, mapping: ColumnMapping, kinds: dict[str, str]) -> tuple[np.ndarray, dict[int, str]]:
    """The rows of a text block a column refuses, and the first reason for each (column and value)."""
    n = batch.num_rows
    bad = np.zeros(n, bool)
    reason: dict[int, str] = {}

    def note(mask: np.ndarray, name: str, what: str) -> None:
        nonlocal bad
        new = mask & ~bad
        for i in np.flatnonzero(new)[:_MAX_EXAMPLES]:
            v = batch.column(name)[int(i)].as_py()
            reason[int(i)] = f"column {name!r}: {'empty' if v is None else repr(v[:40])} {what}"
        bad |= mask

    col = batch.column(mapping.label)
    x, lbad = parse.parse_numbers(col)
    empty = np.asarray(col.is_null().to_numpy(zero_copy_only=False), bool)
    note(lbad | empty | ((x != 0) & (x != 1)), mapping.label, "is not a label (0 or 1)")
    for name in mapping.dense:
        _, dbad = parse.parse_numbers(batch.column(name))
        note(dbad, name, "is not a (finite) number")
    for f in mapping.sparse:
        kind = kinds[f.name]
        if kind == "decimal":
            note(
                parse.parse_decimal(batch.column(f.name))[2],
                f.name,
                f"is not a decimal id of at most 19 digits (strings to hash: --ids 'decimal,{f.name}=string')",
            )
        elif kind == "hex":
            note(parse.parse_hex(batch.column(f.name))[2], f.name, "is not a hex id of at most 16 digits")
    return bad, reason


def _decode_text(batch, mapping: ColumnMapping, kinds: dict[str, str], sizes: list[int], path: str) -> _Window:
    """A checked text block -> the window the mapped Parquet reader would give for the same values."""
    import pyarrow as pa

    n = batch.num_rows
    labels, _ = parse.parse_numbers(batch.column(mapping.label))
    dense = (
        np.stack([parse.parse_numbers(batch.column(c))[0].astype(np.float32) for c in mapping.dense], axis=1)
        if mapping.dense
        else np.zeros((n, 0), np.float32)
    )
    feats = []
    for f, size in zip(mapping.sparse, sizes):
        col = batch.column(f.name)
        kind = kinds[f.name]
        if kind == "string":
            feats.append(_sparse(SparseColumn(f.name, size, STRING), col, size, n))
            continue
        values, empty, _ = (parse.parse_decimal if kind == "decimal" else parse.parse_hex)(col)
        # reduced in uint64 (hex ids reach 2^64), then the Parquet rule: int64 ids mod ROWS
        ids = pa.array((values % np.uint64(size)).astype(np.int64), mask=empty)
        feats.append(_sparse(SparseColumn(f.name, size, INT), ids, size, n))
    return _Window(n, labels.astype(np.float32), dense, None, feats)


# ---- writing -----------------------------------------------------------------------------------


def output_schema(mapping: ColumnMapping, sizes: list[int], listy: set[str], facts: dict) -> DataSchema:
    return DataSchema(
        label=mapping.label,
        dense=list(mapping.dense),
        sparse=[SparseFeature(f.name, n, f.name in listy) for f, n in zip(mapping.sparse, sizes)],
        dense_transform=DENSE_RAW,
        categorical=CAT_MOD,
        extra={"mapping": mapping.to_doc(), **facts},
    )


def _table(w: _Window, schema: DataSchema, arrow_schema: pa.Schema) -> pa.Table:
    import pyarrow as pa

    arrays = [pa.array(w.labels.astype(np.int8))]
    arrays += [pa.array(np.ascontiguousarray(w.dense[:, j])) for j in range(len(schema.dense))]
    assert w.features is not None
    for f, feat, typ in zip(schema.sparse, w.features, arrow_schema.types[1 + len(schema.dense) :]):
        if f.multi_hot:
            assert feat.offsets is not None and int(feat.offsets[-1]) < 2**31, f.name
            arrays.append(pa.ListArray.from_arrays(pa.array(feat.offsets.astype(np.int32)), feat.values, type=typ))
        else:
            arrays.append(pa.array(feat.values))
    return pa.Table.from_arrays(arrays, schema=arrow_schema)


def _check_scalars(w: _Window, schema: DataSchema) -> None:
    assert w.features is not None
    empty = {
        f.name
        for f, feat in zip(schema.sparse, w.features)
        if not f.multi_hot and feat.lengths is not None and bool(np.any(feat.lengths != 1))
    }
    if empty:
        raise _NeedsLists(empty)


def _write(out: Path, parts: list[_Part], mapping, sizes, listy: set[str], opts, unit: str, facts, show) -> dict:
    from tqdm import tqdm

    from tpurec.data.convert import _flush, publish
    from tpurec.runtime.interrupts import Interrupted

    finals = [out / f"part-{i:05d}.parquet" for i in range(len(parts))]
    tmps = [f.with_suffix(f".parquet.tmp-{os.getpid()}") for f in finals]
    total = sum(p.total for p in parts)
    bar = tqdm(total=total, unit=unit, unit_scale=True, desc="convert", disable=not show)
    t0 = time.perf_counter()
    try:
        while True:
            schema = output_schema(mapping, sizes, listy, facts)
            try:
                _write_parts(parts, tmps, schema, opts, bar.update, _flush)
                break
            except _NeedsLists as e:
                # Text has no statistics: the first empty id of a scalar column is seen while writing.
                listy |= e.names
                msg = f"convert: {e} lack an id in some rows: written as list columns (0 or 1 id); starting over"
                bar.write(msg, file=sys.stderr)
                bar.reset()
                for p in parts:
                    p.rows, p.bad_lines, p.bad_examples = 0, 0, []
    except BaseException as e:
        for t in tmps:
            t.unlink(missing_ok=True)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"nothing written to {out}") from None
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    rows = sum(p.rows for p in parts)
    bad = sum(p.bad_lines for p in parts)
    publish(out, tmps, finals, schema, rows=rows, source=[p.source for p in parts], bad_lines=bad)
    bytes_in = sum(os.path.getsize(p.source) if os.path.isfile(p.source) else 0 for p in parts)
    return {
        "rows": rows,
        "files": len(parts),
        "bytes_in": bytes_in,
        "bytes_out": sum(os.path.getsize(f) for f in finals),
        "seconds": round(seconds, 3),
        "mb_per_s": round(bytes_in / 1e6 / max(seconds, 1e-9), 2),
        "bad_lines": bad,
        "bad_examples": [e for p in parts for e in p.bad_examples][:_MAX_EXAMPLES],
        "out_dir": str(out),
        "multi_hot_for_nulls": sorted(listy - {f.name for f in mapping.sparse if f.multi_hot}),
    }


def _write_parts(parts: list[_Part], tmps: list[Path], schema: DataSchema, opts, progress, flush) -> None:
    arrow_schema = schema.arrow_schema()
    for part, tmp in zip(parts, tmps):
        writer = parquet_writer(tmp, arrow_schema, opts.compression)
        pending: list = []
        pending_rows = 0
        try:
            for w in part.windows(progress):
                _check_scalars(w, schema)
                table = _table(w, schema, arrow_schema)
                part.rows += table.num_rows
                if part.keep_row_groups:
                    writer.write_table(table, row_group_size=max(1, table.num_rows))  # the source's row group
                    continue
                pending.append(table)
                pending_rows += table.num_rows
                rg = opts.row_group_size or TEXT_ROW_GROUP
                if pending_rows >= rg:
                    pending, pending_rows = flush(writer, pending, rg, final=False)
            flush(writer, pending, opts.row_group_size or TEXT_ROW_GROUP, final=True)
        finally:
            writer.close()
