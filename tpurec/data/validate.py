"""Checks of decoded row groups: nothing a file says about its values is trusted.

Footer statistics can be wrong (a damaged dictionary page decodes to ids like 4.6e18 while the
footer's min/max still look fine) and files written by other tools may hold any label or float.
So the reader checks the decoded columns themselves, each with one vectorised pass that does not
allocate (a min/max), and only on failure looks for the first bad row to name it. Every error is a
one-line ``DataError`` naming file, row group, column, row and value.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import numpy as np

from tpurec.data.schema import DataError
from tpurec.errors import UserError
from tpurec.runtime import storage

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq


def open_parquet(path: str | os.PathLike, columns: list[str]) -> pq.ParquetFile:
    """A ParquetFile that verifies page CRCs where the writer stored them (tpurec does since 2026-12;
    older files read as before), refused unless it is Parquet holding every one of `columns`."""
    import pyarrow.parquet as pq

    fs, where = storage.arrow(path)  # a bucket's file through its pyarrow filesystem
    try:
        # memory_map: ~10% faster decode from the page cache (local files only).
        pf = pq.ParquetFile(where, memory_map=fs is None, page_checksum_verification=True, filesystem=fs)
    except UserError:  # the bucket refused: its own line
        raise
    except Exception as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    missing = [c for c in columns if c not in pf.schema_arrow.names]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(map(repr, missing))}")
    return pf


class OpenFiles:
    """ParquetFiles opened on first use, one handle per file per thread: a ParquetFile is not safe to
    read from two threads at once (each read pre-buffers into the handle's one cache, which the other
    thread's read replaces: "ReadRangeCache did not find matching cache entry", seen in CI with two
    decoding threads on one file)."""

    def __init__(self, columns: list[str]) -> None:
        self.columns = columns
        self._local = threading.local()

    def get(self, path: str | os.PathLike) -> pq.ParquetFile:
        files = self._local.__dict__.setdefault("files", {})
        if path not in files:
            files[path] = open_parquet(path, self.columns)
        return files[path]


def read_row_group(pf: pq.ParquetFile, path: str | os.PathLike, rg: int, columns: list[str]) -> pa.Table:
    """Row group `rg` of `columns`; a damaged page (checksum), truncated page or bad compression is
    a DataError naming the column (`undecodable`)."""
    try:
        return pf.read_row_group(rg, columns=columns, use_threads=False)
    except Exception as e:
        raise undecodable(pf, path, rg, columns, e) from None


def check_column(
    path: str | os.PathLike,
    rg: int,
    name: str,
    arr: pa.Array | pa.ChunkedArray,
    want: pa.DataType,
    nulls_ok: bool = False,
) -> None:
    """Arrow type and (unless `nulls_ok`: `data inspect` counts them) nulls of one decoded column."""
    import pyarrow as pa

    t = arr.type
    ok = {
        "int": pa.types.is_integer(t),
        "number": pa.types.is_integer(t) or pa.types.is_floating(t),
        "int_list": (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type),
        "float_list": (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_floating(t.value_type),
    }[want]
    if not ok:
        raise DataError(f"{path}: row group {rg}: column {name!r} has type {t}, expected {want.replace('_', ' ')}")
    if arr.null_count and not nulls_ok:
        raise DataError(f"{path}: row group {rg}: column {name!r} has {arr.null_count} nulls")


def _unsigned(a: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned integers: a negative value becomes larger than any valid one, so
    one max() checks both ends of [0, n)."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def check_labels(where: str, name: str, labels: np.ndarray, first_row: int) -> None:
    """Labels are clicks, 0 or 1 (5 or -3 from another tool would train on nonsense)."""
    if len(labels) and _unsigned(labels).max() > 1:
        i = int(np.flatnonzero((labels != 0) & (labels != 1))[0])
        raise DataError(
            f"{where}: column {name!r}: row {first_row + i}: label {labels[i]}, expected 0 or 1 "
            "(clicks; convert other targets to 0/1 first)"
        )


def check_dense(where: str, names: list[str], dense: np.ndarray, first_row: int) -> None:
    """Dense features are finite (NaN propagates through min/max, inf shows at either end)."""
    if dense.size == 0:
        return
    if np.isfinite(dense.min()) and np.isfinite(dense.max()):
        return
    r, c = (int(x[0]) for x in np.nonzero(~np.isfinite(dense)))
    raise DataError(
        f"{where}: column {names[c]!r}: row {first_row + r}: value {dense[r, c]}, dense values must be finite "
        "(fill missing values with 0 when writing the file)"
    )


def check_ids(
    where: str, name: str, ids: np.ndarray, size: int | None, first_row: int, offsets: np.ndarray | None = None
) -> None:
    """Ids in [0, size) (size None: raw ids, only >= 0). ``offsets`` (multi-hot) map an id to its row."""
    if not len(ids):
        return
    limit = size if size is not None else 2**63  # int64 ids: negatives are >= 2^63 as unsigned
    if int(_unsigned(ids).max()) < limit:
        return
    bad = (ids < 0) | (ids >= limit)
    i = int(np.flatnonzero(bad)[0])
    row = i if offsets is None else int(np.searchsorted(offsets, i, side="right")) - 1
    table = (
        f"the table has {size} rows: were the files written for other table sizes?"
        if size is not None
        else "ids are never negative"
    )
    raise DataError(
        f"{where}: column {name!r}: id {int(ids[i])} out of range [0, {size if size is not None else '2^63'}) "
        f"at row {first_row + row} ({table})"
    )


def undecodable(
    pf: pq.ParquetFile, path: str | os.PathLike, rg: int, columns: list[str], error: Exception
) -> DataError:
    """The error for a row group pyarrow could not read, naming the column: re-reads the columns
    one at a time (only on this failure path) to find the first that fails."""
    bad = None
    for c in columns:
        try:
            pf.read_row_group(rg, columns=[c], use_threads=False)
        except Exception as e:
            bad, error = c, e
            break
    where = f"{path}: row group {rg}" + (f": column {bad!r}" if bad else "")
    if "CRC checksum" in str(error):
        return DataError(f"{where}: page checksum mismatch: the file is damaged (copy it again, or convert it again)")
    return DataError(f"{where}: cannot decode ({error})")
