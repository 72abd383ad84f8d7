"""Criteo text (raw TSV day files, plain or .gz, or CSV with a header) -> tpurec Parquet.

TorchRec's binary day files (``.npy``, MLPerf's multi-hot ``.npz``) take the same road from
``convert()`` on: one Parquet file per day, read by tpurec/data/npy.py.

Streams each input in blocks (bounded memory: one text block plus one row group), validates and
transforms the columns with vectorised numpy (tpurec/data/parse.py), and writes one Parquet file per
input, converting several inputs in parallel processes. Outputs are written under a temporary name
and renamed only when every input converted, so a failed run never leaves a half-written dataset.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tpurec.data import parse
from tpurec.data.schema import (
    CAT_HASH,
    DENSE_LOG1P,
    DataError,
    DataSchema,
    list_parquet_files,
    parquet_writer,
    remove_stale_parts,
    write_dataset_json,
)
from tpurec.runtime.interrupts import Interrupted, deferred

NUM_COLUMNS = 40  # label + 13 dense + 26 categorical, the raw Criteo layout
_MAX_EXAMPLES = 5  # bad lines quoted in the report


@dataclass
class ConvertOptions:
    schema: DataSchema
    input_format: str = "auto"  # "tsv" (no header), "csv" (header line), "npy" (TorchRec days), or by name
    row_group_size: int = 65536
    skip_bad_lines: bool = False
    compression: str = "snappy"
    block_size: int = 16 << 20  # bytes of text parsed at a time
    npy_dense_min: list[int] | None = None  # per day (or one for all): undo TorchRec's dense log
    ids: str = "hex"  # how Criteo text's categorical fields are written: "hex" (Criteo's) or "decimal"
    ids_stated: bool = False  # --ids given: no notice about fields that are digits only


@dataclass
class FileResult:
    input: str
    output: str
    rows: int = 0
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)
    digits_only: bool = False  # read as hex, but no categorical field of the first block has a hex letter
    bytes_in: int = 0
    bytes_out: int = 0


def detect_format(path: str) -> str:
    name = Path(path).name.lower().removesuffix(".gz")
    return "csv" if name.endswith(".csv") else "tsv"


class _LineMap:
    """Maps a data row's index (among rows pyarrow kept) to its 1-based line number in the file."""

    def __init__(self, header_lines: int) -> None:
        self.header = header_lines
        self.dropped: list[int] = []  # line numbers pyarrow's invalid-row handler dropped, ascending

    def line(self, row_index: int) -> int:
        line = self.header + row_index + 1
        for d in self.dropped:  # few (bad lines only), so a linear pass is fine
            if d <= line:
                line += 1
        return line


class _RetryAsText(Exception):
    """A dense value the typed fast path could not parse: redo the file in the slower string mode,
    which names the line (or skips it)."""


def _open_text(path: str, fmt: str, opts: ConvertOptions, on_invalid, typed: bool, header: bool):
    import pyarrow as pa
    import pyarrow.csv as pcsv

    raw = pa.OSFile(path, "rb")
    stream = pa.CompressedInputStream(raw, "gzip") if path.endswith(".gz") else raw
    names = [f"c{i}" for i in range(NUM_COLUMNS)]
    read = pcsv.ReadOptions(
        column_names=names,
        skip_rows=1 if header else 0,
        block_size=opts.block_size,
        use_threads=False,
    )
    parse_opts = pcsv.ParseOptions(
        delimiter="," if fmt == "csv" else "\t",
        quote_char=False,
        ignore_empty_lines=False,
        invalid_row_handler=on_invalid,
    )
    types = {n: pa.string() for n in names}
    if typed:  # dense parsed to float64 by pyarrow directly; blanks become nulls, filled with 0 later
        types.update({names[1 + j]: pa.float64() for j in range(13)})
    conv = pcsv.ConvertOptions(column_types=types, strings_can_be_null=False, null_values=[""])
    try:
        return raw, pcsv.open_csv(stream, read_options=read, parse_options=parse_opts, convert_options=conv)
    except BaseException:
        # Closed here, not left to the error's traceback (see tpurec/cli.py main).
        stream.close()
        raw.close()
        raise


def _sniff(path: str, fmt: str) -> bool:
    """Check the first line before pyarrow reads the file; True when it is a CSV header to skip.

    Turns the usual mistakes into one line each: a Parquet file given as text, a comma-separated
    file named like a TSV, bytes that are not UTF-8, a CSV header of the wrong width. A CSV whose
    first line is already data (a 0/1 label first) has no header, and that line is kept."""
    import gzip

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PAR1":
        raise DataError(
            f"{path}: is a Parquet file, not Criteo text: `tpurec data convert` converts Parquet through a column "
            "mapping (--label/--dense/--sparse, --columns, or inferred; tpurec/data/convert_mapped.py), and "
            "tpurec train --data, data inspect and data stats read it directly"
        )
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            first = f.readline(1 << 20).rstrip(b"\r\n")
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e}); a truncated or non-gzip .gz?") from None
    try:
        line = first.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:1: not UTF-8 text (byte {e.start}); is this a Criteo text file?") from None
    if fmt == "tsv":
        if "\t" not in line and line.count(",") == NUM_COLUMNS - 1:
            raise DataError(
                f"{path}:1: no tabs but {NUM_COLUMNS} comma-separated fields: a CSV file? pass --format csv"
            )
        return False
    fields = line.split(",")
    if len(fields) != NUM_COLUMNS:
        hint = " (tab-separated? pass --format tsv)" if "\t" in line else ""
        raise DataError(
            f"{path}:1: CSV line has {len(fields)} columns, expected {NUM_COLUMNS} (label, 13 dense, 26 categorical)"
            + hint
        )
    return fields[0].strip() not in ("0", "1")  # a label first: data, no header


def _transform_block(batch, schema: DataSchema, ids: str = "hex"):
    """One text block -> (dict of numpy columns, bad mask, first bad reason per row index)."""
    n = batch.num_rows
    bad = np.zeros(n, dtype=bool)
    reasons: dict[int, str] = {}

    def note(mask, column, what) -> None:
        nonlocal bad
        new = mask & ~bad
        if new.any():
            for i in np.flatnonzero(new)[:_MAX_EXAMPLES]:
                reasons[int(i)] = f"column {column}: {what}"
        bad |= mask

    out: dict[str, np.ndarray] = {}
    labels, lbad = parse.parse_labels(batch.column(0))
    note(lbad, schema.label, "label must be 0 or 1")
    out[schema.label] = labels
    for j, name in enumerate(schema.dense):
        x, dbad = parse.parse_numbers(batch.column(1 + j))
        note(dbad, name, "not a number")
        out[name] = parse.dense_log1p(x) if schema.dense_transform == DENSE_LOG1P else x.astype(np.float32)
    for j, feat in enumerate(schema.sparse):
        if ids == "decimal":
            raw, empty, cbad = parse.parse_decimal(batch.column(14 + j))
            note(cbad, feat.name, "not a decimal id of at most 19 digits (--ids decimal)")
        else:
            raw, empty, cbad = parse.parse_hex(batch.column(14 + j))
            note(cbad, feat.name, "not a hex string of at most 16 digits (decimal ids: --ids decimal)")
        if schema.categorical == CAT_HASH:
            out[feat.name] = parse.hash_ids(raw, empty, feat.rows)
        else:
            # raw hex values (empty is 0 already); int64 ids, so 2^63 and above would wrap negative
            note(
                raw >= np.uint64(2**63),
                feat.name,
                "raw id >= 2^63 does not fit an int64 id (hash it: leave out --raw-ids)",
            )
            out[feat.name] = raw.astype(np.int64)
    return out, bad, reasons


def convert_file(
    in_path: str, out_path: str, opts: ConvertOptions, progress: Callable[[int], object] | None = None
) -> FileResult:
    """Convert one text file to one Parquet file at ``out_path`` (the caller renames it).

    ``progress(n)`` is called with the input bytes consumed since the last call.
    """
    done = 0

    def advance(pos: int) -> None:  # byte position -> deltas; a retry does not count bytes twice
        nonlocal done
        if progress is not None and pos > done:
            progress(pos - done)
            done = pos

    try:
        return _convert_file(in_path, out_path, opts, advance, typed=True)
    except _RetryAsText:
        return _convert_file(in_path, out_path, opts, advance, typed=False)


def _convert_file(in_path: str, out_path: str, opts: ConvertOptions, advance, typed: bool) -> FileResult:
    import pyarrow as pa

    schema = opts.schema
    fmt = opts.input_format if opts.input_format != "auto" else detect_format(in_path)
    header = _sniff(in_path, fmt)
    res = FileResult(in_path, out_path, bytes_in=os.path.getsize(in_path))
    lines = _LineMap(1 if header else 0)
    first_invalid: list[str] = []

    def on_invalid(row) -> str:
        # Wrong column count (or an unparsable line): pyarrow's handler sees it before we do.
        msg = (
            f"{in_path}:{row.number}: expected {row.expected_columns} columns, "
            f"got {row.actual_columns}: {row.text[:80]!r}"
        )
        if not opts.skip_bad_lines:
            first_invalid.append(msg)
            return "error"
        lines.dropped.append(row.number)
        res.bad_lines += 1
        if len(res.bad_examples) < _MAX_EXAMPLES:
            res.bad_examples.append(msg)
        return "skip"

    def parse_error(e):
        if first_invalid:
            return DataError(f"malformed line {first_invalid[0]}")
        if "Empty CSV file" in str(e):
            return DataError(f"{in_path}: no lines (empty file)")
        if isinstance(e, OSError):  # the input stream itself: a .gz cut short or damaged
            past = f" past line {lines.line(seen - 1)}" if seen else ""
            return DataError(
                f"{in_path}: cannot read it{past} ({e}): the file is truncated or damaged; copy or download it again"
            )
        if "invalid UTF8" in str(e):  # pyarrow names the block's row, not the line
            return DataError(f"{in_path}: {_column_of(e, schema)}not UTF-8 text ({e}); is this a Criteo text file?")
        if typed:
            return _RetryAsText()
        return DataError(f"{in_path}: cannot parse: {e}")

    arrow_schema = schema.arrow_schema()
    err = None
    seen = 0  # rows pyarrow kept so far (line mapping)
    try:  # open_csv already parses the first block
        raw, reader = _open_text(in_path, fmt, opts, on_invalid, typed, header)
    except (pa.ArrowInvalid, OSError) as e:
        err = parse_error(e)
    if err is not None:  # raised here, not in the except block: see _raise_clean
        _raise_clean(err)
    writer = parquet_writer(out_path, arrow_schema, opts.compression)
    pending: list[pa.Table] = []
    pending_rows = 0
    try:
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError) as e:
                err = parse_error(e)
            if err is not None:
                _raise_clean(err)
            if seen == 0 and opts.ids == "hex" and not opts.ids_stated:
                res.digits_only = _digits_only(batch)
            cols, bad, reasons = _transform_block(batch, schema, opts.ids)
            if bad.any():
                idx = np.flatnonzero(bad)
                if not opts.skip_bad_lines:
                    first = int(idx[0])
                    raise DataError(f"malformed line {in_path}:{lines.line(seen + first)}: {reasons[first]}")
                for i in idx:
                    if len(res.bad_examples) < _MAX_EXAMPLES:
                        res.bad_examples.append(
                            f"{in_path}:{lines.line(seen + int(i))}: {reasons.get(int(i), 'bad value')}"
                        )
                res.bad_lines += len(idx)
                keep = ~bad
                cols = {k: v[keep] for k, v in cols.items()}
            seen += batch.num_rows
            table = pa.Table.from_arrays([pa.array(cols[f.name]) for f in arrow_schema], schema=arrow_schema)
            pending.append(table)
            pending_rows += table.num_rows
            res.rows += table.num_rows
            if pending_rows >= opts.row_group_size:
                pending, pending_rows = _flush(writer, pending, opts.row_group_size, final=False)
            advance(raw.tell())
        _flush(writer, pending, opts.row_group_size, final=True)
    finally:
        writer.close()
        raw.close()
    advance(res.bytes_in)
    res.bytes_out = os.path.getsize(out_path)
    return res


def _digits_only(batch) -> bool:
    """No categorical field of this block holds a letter a-f: decimal ids read as hex? Criteo's are 8 random
    hex digits, of which 2% have no letter, so a block of them always has some."""
    import pyarrow.compute as pc

    cols = [batch.column(14 + j) for j in range(NUM_COLUMNS - 14)]
    digits = [pc.any(pc.match_substring_regex(c, "[0-9]")).as_py() for c in cols]
    letters = [pc.any(pc.match_substring_regex(c, "[a-fA-F]")).as_py() for c in cols]
    return any(digits) and not any(letters)


def _column_of(e: Exception, schema: DataSchema) -> str:
    """'column I13: ' for pyarrow's 'In CSV column #13' (0-based: label, dense, categorical)."""
    import re

    m = re.search(r"column #(\d+)", str(e))
    names = [schema.label, *schema.dense, *schema.sparse_names]
    return f"column {names[int(m.group(1))]}: " if m and int(m.group(1)) < len(names) else ""


def _raise_clean(err: Exception):
    """Raise ``err`` with no pyarrow error behind it. pyarrow's failed CSV read (its state and our
    invalid-row callback) stays reachable from that error's traceback; freed only at interpreter
    exit, it aborts the process (std::terminate, exit 134) in about half of the runs. Collected now,
    before anyone holds the new error, it cannot."""
    import gc

    gc.collect()
    raise err


def _flush(writer, pending, rg: int, final: bool):
    """Write whole row groups of exactly ``rg`` rows (and the rest when ``final``); return the rest."""
    import pyarrow as pa

    if not pending:
        return [], 0
    table = pa.concat_tables(pending)
    full = table.num_rows if final else (table.num_rows // rg) * rg
    if full:
        writer.write_table(table.slice(0, full), row_group_size=rg)
    rest = table.slice(full)
    return ([rest] if rest.num_rows else []), rest.num_rows


def _convert_source(src, tmp_path: str, opts: ConvertOptions, progress=None) -> FileResult:
    """One input (a text file, or a TorchRec day) -> one Parquet file."""
    from tpurec.data import npy

    if isinstance(src, npy.NpyDay):
        res = FileResult(src.sparse, tmp_path)
        res.rows, res.bytes_in, res.bytes_out = npy.convert_day(
            src, tmp_path, opts.schema, opts.row_group_size, opts.compression, progress
        )
        return res
    return convert_file(src, tmp_path, opts, progress=progress)


def _convert_one(args):
    src, tmp_path, opts = args
    return _convert_source(src, tmp_path, opts)


def _worker_init(parent: int) -> None:
    """A conversion worker dies with the converter, and leaves Ctrl-C to it: a terminal's Ctrl-C
    reaches every worker too, which would print a KeyboardInterrupt traceback each; the converter
    stops them itself (`_stop_workers`)."""
    import signal

    from tpurec.runtime.lifecycle import die_with_parent

    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop_workers(ex: ProcessPoolExecutor) -> None:
    """End the pool's workers now (they ignore Ctrl-C), not after the inputs they are converting."""
    workers = dict(getattr(ex, "_processes", None) or {})  # the pool has no public handle on them
    ex.shutdown(wait=False, cancel_futures=True)
    for proc in workers.values():
        proc.terminate()
    for proc in workers.values():
        proc.join(timeout=30)


def resolve_inputs(inputs: list, opts: ConvertOptions) -> list:
    """Text files as given, or TorchRec days (``npy.NpyDay``) grouped from their files/directories."""
    from tpurec.data import npy

    if inputs and all(isinstance(p, npy.NpyDay) for p in inputs):
        return list(inputs)
    is_npy = [npy.is_npy_input(p) for p in inputs]
    if opts.input_format == "npy" or (opts.input_format == "auto" and inputs and all(is_npy)):
        return npy.find_days(inputs, opts.npy_dense_min)
    if opts.input_format == "auto" and any(is_npy):
        first = inputs[is_npy.index(True)]
        raise DataError(f"{first}: TorchRec .npy/.npz days and text files cannot be converted together")
    for p in inputs:
        if not os.path.isfile(p):
            raise DataError(f"{p}: no such input file")
    return list(inputs)


def _size(src) -> int:
    return src.nbytes if hasattr(src, "nbytes") else os.path.getsize(src)


def _names(src) -> list[str]:
    return [os.path.basename(f) for f in src.files] if hasattr(src, "files") else [os.path.basename(src)]


def convert(
    inputs: list[str],
    out_dir: str,
    opts: ConvertOptions,
    jobs: int | None = None,
    show_progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Convert every input (text file or TorchRec day) to ``out_dir/part-NNNNN.parquet`` and write
    ``_dataset.json``.

    Returns the summary (rows, files, bytes in/out, seconds, MB/s, bad lines). Another run
    writing ``out_dir`` at the same time is refused (DataError naming it).
    """
    from tpurec.data.out_lock import locked_output

    inputs = resolve_inputs(inputs, opts)
    with locked_output(out_dir, overwrite, "tpurec data convert") as out:
        return _convert_into(out, inputs, opts, jobs, show_progress)


def publish(out: Path, tmps: list[Path], finals: list[Path], schema: DataSchema, **facts) -> None:
    """Rename the finished parts into place, remove the old dataset's other parts, write _dataset.json:
    one step a Ctrl-C waits for (a failed or stopped conversion leaves the old dataset whole)."""
    try:
        with deferred():
            for t, f in zip(tmps, finals):
                t.replace(f)
            remove_stale_parts(out, finals)
            write_dataset_json(out, schema, files=[f.name for f in finals], **facts)
    except KeyboardInterrupt:
        raise Interrupted(f"the dataset in {out} was already complete and is kept") from None


def _convert_into(out: Path, inputs: list, opts: ConvertOptions, jobs: int | None, show_progress: bool) -> dict:
    """`convert` into the prepared, locked directory `out`."""
    from tqdm import tqdm

    finals = [out / f"part-{i:05d}.parquet" for i in range(len(inputs))]
    tmps = [f.with_suffix(f".parquet.tmp-{os.getpid()}") for f in finals]  # per run: two never share a file
    total_bytes = sum(_size(p) for p in inputs)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(inputs)))
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="convert", disable=not show_progress)
    t0 = time.perf_counter()
    results: list[FileResult] = []
    try:
        if jobs == 1:
            for p, t in zip(inputs, tmps):
                results.append(_convert_source(p, str(t), opts, progress=bar.update))
        else:
            import multiprocessing as mp

            from tpurec.runtime import safe_path

            # Workers die with this process, so a killed `data convert` leaves none waiting forever;
            # they start without the working directory on sys.path (`spawning`).
            ctx = mp.get_context("spawn")
            with (
                safe_path.spawning(),
                ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(),)) as ex,
            ):
                try:
                    futs = [ex.submit(_convert_one, (p, str(t), opts)) for p, t in zip(inputs, tmps)]
                    for fut in as_completed(futs):
                        r = fut.result()
                        bar.update(r.bytes_in)
                        results.append(r)
                except KeyboardInterrupt:
                    _stop_workers(ex)
                    raise
    except BaseException as e:
        for t in tmps:
            t.unlink(missing_ok=True)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"nothing written to {out}") from None
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    results.sort(key=lambda r: r.input)
    summary = {
        "rows": sum(r.rows for r in results),
        "files": len(results),
        "bytes_in": total_bytes,
        "bytes_out": sum(r.bytes_out for r in results),
        "seconds": round(seconds, 3),
        "mb_per_s": round(total_bytes / 1e6 / max(seconds, 1e-9), 2),
        "bad_lines": sum(r.bad_lines for r in results),
        "bad_examples": [e for r in results for e in r.bad_examples][:_MAX_EXAMPLES],
        "digits_only_inputs": [r.input for r in results if r.digits_only],
        "out_dir": str(out),
    }
    publish(
        out,
        tmps,
        finals,
        opts.schema,
        rows=summary["rows"],
        source=[n for p in inputs for n in _names(p)],
        bad_lines=summary["bad_lines"],
    )
    list_parquet_files(out)  # sanity: the outputs are there
    return summary
