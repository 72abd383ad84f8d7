"""TorchRec's binary Criteo day files -> tpurec Parquet.

Two layouts, both one day per ``day_{i}`` prefix:

- TorchRec's ``BinaryCriteoUtils.tsv_to_npys``: ``day_{i}_dense.npy`` float32 ``[N, 13]`` (already
  ``log(x - m + 2)``, ``m`` the smallest dense value of the day file), ``day_{i}_sparse.npy`` int64
  ``[N, 26]`` (``int(hex, 16)``, empty -> 0; or contiguous ids after ``sparse_to_contiguous``, which
  the MLPerf preprocessing renames to the same name), ``day_{i}_labels.npy`` int32 ``[N, 1]``.
- MLPerf DLRM-DCNv2's multi-hot ``day_{i}_sparse_multi_hot.npz`` (``materialize_synthetic_multihot_
  dataset.py``: ``np.savez`` of 26 int32 arrays named ``"0"`` .. ``"25"``, ``[N, k_f]`` each, ids
  already ``mod num_embeddings``), beside the same dense and labels files.

Arrays are memory-mapped (``np.load(mmap_mode="r")``; an uncompressed ``.npz`` member by its offset
in the zip) and written one row group at a time, so memory stays at one row group.
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tpurec.data import parse
from tpurec.data.schema import CAT_MOD, CAT_RAW, DENSE_LOG1P, DENSE_TORCHREC, DataError, DataSchema, parquet_writer

_ROLE = re.compile(r"^(?P<prefix>.+)_(?P<role>dense|labels|sparse|sparse_contig_freq|sparse_multi_hot)\.(npy|npz)$")
MULTI_HOT_SUFFIX = "_sparse_multi_hot.npz"


@dataclass(frozen=True)
class NpyDay:
    """The three files of one day; ``sparse`` is a ``.npy`` (one id per feature) or a multi-hot ``.npz``."""

    dense: str
    sparse: str
    labels: str
    dense_min: int | None = None  # the day's smallest raw dense value: undo TorchRec's log when given

    @property
    def multi_hot(self) -> bool:
        return self.sparse.endswith(".npz")

    @property
    def files(self) -> tuple[str, str, str]:
        return (self.dense, self.sparse, self.labels)

    @property
    def nbytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.files)


def is_npy_input(path: str) -> bool:
    """A .npy/.npz file, or a directory holding ``*_dense.npy`` day files."""
    p = Path(path)
    if p.is_dir():
        return any(p.glob("*_dense.npy"))
    return p.suffix.lower() in (".npy", ".npz")


def _day_key(prefix: str) -> tuple[int, str]:
    m = re.search(r"(\d+)$", prefix)
    return (int(m.group(1)) if m else -1, prefix)


def find_days(inputs: list[str], dense_min: list[int] | None = None) -> list[NpyDay]:
    """Group the inputs (day files of any role, or directories of them) into days, in day order.

    A day's missing companion is an error naming the file looked for. A sparse file given explicitly
    wins; otherwise a directory's multi-hot ``.npz`` is taken over its ``_sparse.npy`` only when it
    is the only one (both present: the error asks for the file)."""
    given: dict[str, dict[str, str]] = {}
    for raw in inputs:
        p = Path(raw)
        if p.is_dir():
            for f in sorted(p.glob("*_dense.npy")):
                given.setdefault(str(f)[: -len("_dense.npy")], {})
            continue
        m = _ROLE.match(p.name)
        if not m:
            raise DataError(
                f"{raw}: not a TorchRec day file (expected day_N_dense.npy, day_N_sparse.npy, day_N_labels.npy "
                f"or day_N{MULTI_HOT_SUFFIX})"
            )
        if not p.is_file():
            raise DataError(f"{raw}: no such input file")
        role = "sparse" if m["role"].startswith("sparse") else m["role"]
        given.setdefault(str(p.parent / m["prefix"]), {})[role] = str(p)
    days = []
    for prefix in sorted(given, key=lambda q: _day_key(Path(q).name)):
        roles = given[prefix]
        dense = roles.get("dense", prefix + "_dense.npy")
        labels = roles.get("labels", prefix + "_labels.npy")
        sparse = roles.get("sparse") or _find_sparse(prefix)
        for name in (dense, labels):
            if not os.path.isfile(name):
                raise DataError(f"{name}: missing (a day is {prefix}_dense.npy, _sparse.npy and _labels.npy)")
        days.append(NpyDay(dense, sparse, labels))
    if not days:
        raise DataError(f"no day_N_dense.npy files in {', '.join(inputs)}")
    if dense_min is not None:
        if len(dense_min) not in (1, len(days)):
            raise DataError(f"{len(dense_min)} dense minimums for {len(days)} day(s): give one, or one per day")
        mins = dense_min * len(days) if len(dense_min) == 1 else dense_min
        days = [NpyDay(d.dense, d.sparse, d.labels, int(m)) for d, m in zip(days, mins)]
    return days


def _find_sparse(prefix: str) -> str:
    one, multi = prefix + "_sparse.npy", prefix + MULTI_HOT_SUFFIX
    have = [f for f in (one, multi) if os.path.isfile(f)]
    if len(have) == 2:
        raise DataError(f"{prefix}: both {Path(one).name} and {Path(multi).name}; pass the one to convert")
    if not have:
        raise DataError(f"{one}: missing (and no {Path(multi).name}): a day needs its sparse ids")
    return have[0]


def _load_npy(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npy array ({e})") from None


def _npz_member(path: str, zf: zipfile.ZipFile, name: str) -> np.ndarray:
    """One array of an .npz: memory-mapped when stored uncompressed (np.savez), else read whole."""
    info = zf.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:  # np.savez_compressed: no offset to map
        with zf.open(name) as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)  # the local header: its name and extra lengths may differ from the central one
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        offset = f.tell()
    if not shape or int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape, order="F" if fortran else "C", offset=offset)


def _load_multi_hot(path: str, num_features: int) -> list[np.ndarray]:
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise DataError(f"{path}: not a readable .npz ({e})") from None
    with zf:
        want = [f"{j}.npy" for j in range(num_features)]
        missing = [w[:-4] for w in want if w not in zf.NameToInfo]
        if missing:
            raise DataError(
                f"{path}: no array(s) {', '.join(missing[:5])}: expected {num_features} arrays named "
                f"'0'..'{num_features - 1}' (MLPerf's materialize_synthetic_multihot_dataset.py), "
                f"found {sorted(n[:-4] for n in zf.namelist())[:5]}"
            )
        try:
            return [_npz_member(path, zf, w) for w in want]
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"{path}: cannot read an array ({e})") from None


def _check(arr: np.ndarray, path: str, what: str, kinds: str, cols: int | None) -> np.ndarray:
    kind_names = {"f": "float", "iu": "integer", "iub": "integer"}
    if arr.dtype.kind not in kinds:
        raise DataError(f"{path}: {what} has dtype {arr.dtype}, expected {kind_names.get(kinds, kinds)}")
    if arr.ndim == 1 and cols in (None, 1):
        return arr.reshape(-1, 1)
    if arr.ndim != 2 or (cols is not None and arr.shape[1] != cols):
        expect = f"[N, {cols}]" if cols is not None else "[N, k]"
        raise DataError(f"{path}: {what} has shape {list(arr.shape)}, expected {expect}")
    return arr


def open_day(day: NpyDay, schema: DataSchema) -> tuple[np.ndarray, np.ndarray, Any]:  # sparse: see below
    """(dense [N, 13], labels [N, 1], sparse [N, 26] or a list of 26 [N, k] arrays), checked."""
    nd, ns = len(schema.dense), len(schema.sparse)
    dense = _check(_load_npy(day.dense), day.dense, "dense", "f", nd)
    labels = _check(_load_npy(day.labels), day.labels, "labels", "iub", 1)
    sparse: list[np.ndarray] | np.ndarray
    if day.multi_hot:
        sparse = [
            _check(a, f"{day.sparse}[{j}]", "ids", "iu", None) for j, a in enumerate(_load_multi_hot(day.sparse, ns))
        ]
        counts = [(f"{day.sparse}[{j}]", a.shape[0]) for j, a in enumerate(sparse)]
    else:
        sparse = _check(_load_npy(day.sparse), day.sparse, "sparse", "iu", ns)
        counts = [(day.sparse, sparse.shape[0])]
    for path, n in [(day.labels, labels.shape[0])] + counts:
        if n != dense.shape[0]:
            raise DataError(f"{path}: {n} rows, but {day.dense} has {dense.shape[0]}")
    return dense, labels, sparse


def multi_hot_sizes(day: NpyDay, num_features: int) -> list[int]:
    """Ids per sample of each feature of a multi-hot day (1 for a .npy day)."""
    if not day.multi_hot:
        return [1] * num_features
    return [a.shape[1] if a.ndim == 2 else 1 for a in _load_multi_hot(day.sparse, num_features)]


def _dense_block(d: np.ndarray, day: NpyDay, schema: DataSchema, start: int) -> np.ndarray:
    bad = ~np.isfinite(d)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise DataError(f"{day.dense}: row {start + r}: column {schema.dense[c]}: {d[r, c]} is not finite")
    if schema.dense_transform == DENSE_TORCHREC:
        return np.asarray(d, dtype=np.float32)
    if day.dense_min is None:
        raise DataError(f"{day.dense}: pass --npy-dense-min to undo TorchRec's log(x - min + 2)")
    x = np.rint(np.exp(d.astype(np.float64))) - 2 + day.dense_min  # TorchRec's log(x - m + 2), undone
    return parse.dense_log1p(x) if schema.dense_transform == DENSE_LOG1P else x.astype(np.float32)


def _ids(v: np.ndarray, path: str, start: int, schema: DataSchema, j: int) -> np.ndarray:
    feat = schema.sparse[j]
    v = np.asarray(v)
    if v.dtype.kind == "i" and v.size and v.min() < 0:
        r = int(np.argwhere(v < 0)[0][0])
        raise DataError(f"{path}: row {start + r}: column {feat.name}: negative id")
    if schema.categorical == CAT_RAW:
        return v.astype(np.int64)
    if schema.categorical == CAT_MOD:
        return (v.astype(np.uint64) % np.uint64(feat.rows)).astype(np.int64)
    u = v.astype(np.uint64)  # CAT_HASH: 0 is what TorchRec wrote for an empty field
    return parse.hash_ids(u, u == 0, feat.rows)


def convert_day(
    day: NpyDay,
    out_path: str,
    schema: DataSchema,
    row_group_size: int,
    compression: str,
    progress: Callable[[int], object] | None = None,
) -> tuple[int, int, int]:
    """Write one day to one Parquet file; returns (rows, bytes_in, bytes_out)."""
    import pyarrow as pa

    dense, labels, sparse = open_day(day, schema)
    n = dense.shape[0]
    arrow_schema = schema.arrow_schema()
    total = day.nbytes
    done = 0
    with parquet_writer(out_path, arrow_schema, compression) as writer:
        for start in range(0, n, row_group_size):
            stop = min(n, start + row_group_size)
            lab = np.asarray(labels[start:stop, 0])
            bad = (lab != 0) & (lab != 1)
            if bad.any():
                r = int(np.flatnonzero(bad)[0])
                hint = " (-1: the Kaggle test set has no labels)" if lab[r] == -1 else ""
                raise DataError(f"{day.labels}: row {start + r}: label {lab[r]}, expected 0 or 1{hint}")
            cols = {schema.label: pa.array(lab.astype(np.int8))}
            d = _dense_block(np.asarray(dense[start:stop]), day, schema, start)
            for c, name in enumerate(schema.dense):
                cols[name] = pa.array(np.ascontiguousarray(d[:, c]))
            for j, feat in enumerate(schema.sparse):
                if day.multi_hot:
                    block = np.asarray(sparse[j][start:stop])
                    ids = _ids(block, f"{day.sparse}[{j}]", start, schema, j)
                else:
                    ids = _ids(sparse[start:stop, j], day.sparse, start, schema, j).reshape(-1, 1)
                if not feat.multi_hot and ids.shape[1] != 1:
                    raise DataError(f"{day.sparse}[{j}]: {ids.shape[1]} ids per row, the first day's {feat.name} has 1")
                if feat.multi_hot:
                    k = ids.shape[1]
                    offsets = pa.array(np.arange(0, ids.size + 1, k, dtype=np.int32))
                    cols[feat.name] = pa.ListArray.from_arrays(offsets, pa.array(ids.reshape(-1)))
                else:
                    cols[feat.name] = pa.array(ids[:, 0])
            writer.write_table(pa.table([cols[f.name] for f in arrow_schema], schema=arrow_schema))
            if progress is not None:
                pos = total * stop // max(n, 1)
                progress(pos - done)
                done = pos
    if progress is not None and total > done:
        progress(total - done)
    return n, total, os.path.getsize(out_path)
