"""`tpurec data inspect`: what a dataset holds, read one row group at a time.

Distinct ids are estimated over all rows with a k-minimum-values sketch (error about 1/sqrt(k), 3%
for k = 1024); id frequency skew (share of lookups that hit the most frequent 1% of ids) is computed
exactly on the first ``sample_rows`` rows.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from tpurec.data import validate
from tpurec.data.schema import EMPTY_ID, DataError, dataset_metadata
from tpurec.data.shards import list_parquet_files, scan

if TYPE_CHECKING:
    import pyarrow as pa

    from tpurec.data.schema import DataSchema
    from tpurec.data.shards import Unit

KMV_K = 1024


def _hash(x: np.ndarray) -> np.ndarray:
    from tpurec.data.synth import _splitmix64

    with np.errstate(over="ignore"):
        return _splitmix64(x.astype(np.uint64))


class _KMV:
    def __init__(self) -> None:
        self.smallest = np.empty(0, np.uint64)

    def add(self, ids: np.ndarray) -> None:
        h = np.unique(_hash(ids))[:KMV_K]
        self.smallest = np.unique(np.concatenate([self.smallest, h]))[:KMV_K]

    def estimate(self) -> int:
        if len(self.smallest) < KMV_K:
            return len(self.smallest)  # exact: fewer distinct hashes than the sketch holds
        return int(round((KMV_K - 1) / (float(self.smallest[-1]) / 2.0**64)))


def inspect_dataset(path: str | os.PathLike, sample_rows: int = 1_000_000) -> dict:
    """The report of a dataset. What the reader refuses, inspect refuses too, in the same one line
    naming file, row group, column and row (tpurec/data/validate.py): damaged pages (CRCs verified
    where the writer stored them), missing columns, columns of another type, labels other than 0/1,
    non-finite dense values, ids outside their table. Nulls are counted, not refused."""
    schema, units = scan(path)
    if not units:  # files of tpurec's schema holding no rows: no row group, no rate, no range to report
        raise DataError(f"{path}: 0 rows in {len(list_parquet_files(path))} Parquet file(s): nothing to inspect")
    meta = dataset_metadata(path)
    rows = sum(u.rows for u in units)
    files = sorted({u.path for u in units})
    nulls = {c: 0 for c in [schema.label, *schema.dense, *schema.sparse_names]}
    sketches = {f.name: _KMV() for f in schema.sparse}
    samples: dict[str, list[np.ndarray]] = {f.name: [] for f in schema.sparse}
    dense_sum = {n: 0.0 for n in schema.dense}
    dense_min = {n: np.inf for n in schema.dense}
    dense_max = {n: -np.inf for n in schema.dense}
    empties = {f.name: 0 for f in schema.sparse}  # EMPTY_ID occurrences: blank in the source text
    id_counts = {f.name: 0 for f in schema.sparse}
    positives, sampled = 0, 0
    handles = {}
    for u in units:
        if u.path not in handles:
            handles[u.path] = validate.open_parquet(u.path, list(nulls))
        t = validate.read_row_group(handles[u.path], u.path, u.row_group, list(nulls))
        _check_values(t, schema, u)
        for c in nulls:
            nulls[c] += t.column(c).null_count
        positives += int(np.asarray(t.column(schema.label).to_numpy(zero_copy_only=False), np.float64).sum())
        for n in schema.dense:
            x = t.column(n).to_numpy(zero_copy_only=False).astype(np.float64)
            dense_sum[n] += float(np.nansum(x))
            if len(x):
                dense_min[n] = min(dense_min[n], float(np.nanmin(x)))
                dense_max[n] = max(dense_max[n], float(np.nanmax(x)))
        take = max(0, min(t.num_rows, sample_rows - sampled))
        for f in schema.sparse:
            col = t.column(f.name)
            if f.multi_hot:
                col = col.combine_chunks().flatten()
            ids = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.int64)
            sketches[f.name].add(ids)
            empties[f.name] += int(np.count_nonzero(ids == EMPTY_ID))
            id_counts[f.name] += len(ids)
            if take:
                head = t.column(f.name).slice(0, take)
                if f.multi_hot:
                    head = head.combine_chunks().flatten()
                samples[f.name].append(np.asarray(head.to_numpy(zero_copy_only=False), dtype=np.int64))
        sampled += take
    columns = {}
    for f in schema.sparse:
        s = np.concatenate(samples[f.name]) if samples[f.name] else np.empty(0, np.int64)
        _, counts = np.unique(s, return_counts=True)
        counts = np.sort(counts)[::-1]
        top = max(1, int(np.ceil(0.01 * len(counts))))
        columns[f.name] = {
            "kind": "multi-hot" if f.multi_hot else "categorical",
            "num_embeddings": f.num_embeddings,
            "null_share": nulls[f.name] / max(rows, 1),
            "empty_id_share": round(empties[f.name] / max(id_counts[f.name], 1), 4),  # of all ids
            "distinct_ids_estimate": sketches[f.name].estimate(),
            "top1pct_ids_share": round(float(counts[:top].sum() / max(counts.sum(), 1)), 4),
            "most_frequent_id_share": round(float(counts[0] / counts.sum()), 4) if len(counts) else 0.0,
        }
    for n in schema.dense:
        columns[n] = {
            "kind": "dense",
            "null_share": nulls[n] / max(rows, 1),
            "mean": round(dense_sum[n] / max(rows, 1), 4),
            "min": dense_min[n] if rows else None,
            "max": dense_max[n] if rows else None,
        }
    return {
        "path": str(path),
        "files": len(files),
        "rows": rows,
        "row_groups": len(units),
        "row_group_rows": {"min": min(u.rows for u in units), "max": max(u.rows for u in units)},
        "label": schema.label,
        "label_rate": round(positives / max(rows, 1), 6),
        "label_null_share": nulls[schema.label] / max(rows, 1),
        "dense_transform": schema.dense_transform,
        "categorical": schema.categorical,
        "oracle_auc": meta.get("oracle_auc"),
        "skew_sample_rows": sampled,
        "columns": columns,
    }


def _check_values(t: pa.Table, schema: DataSchema, u: Unit) -> None:
    """The reader's checks of one row group (validate.py), on the columns without nulls."""
    where = f"{u.path}: row group {u.row_group}"
    kinds = {schema.label: "int", **dict.fromkeys(schema.dense, "number")}
    kinds.update({f.name: "int_list" if f.multi_hot else "int" for f in schema.sparse})
    for name, kind in kinds.items():
        validate.check_column(u.path, u.row_group, name, t.column(name), kind, nulls_ok=True)
    clean = {name for name in kinds if not t.column(name).null_count}
    if schema.label in clean:
        validate.check_labels(where, schema.label, t.column(schema.label).to_numpy(), u.start)
    for n in schema.dense:
        if n in clean:
            validate.check_dense(where, [n], t.column(n).to_numpy()[:, None], u.start)
    for f in schema.sparse:
        if f.name in clean:
            col = t.column(f.name).combine_chunks()
            offsets = col.offsets.to_numpy() if f.multi_hot else None
            ids = (col.flatten() if f.multi_hot else col).to_numpy(zero_copy_only=False)
            validate.check_ids(where, f.name, ids, f.num_embeddings, u.start, offsets)  # as stored, as the reader


def format_report(r: dict) -> str:
    lines = [
        f"{r['path']}: {r['rows']:,} rows in {r['files']} file(s), {r['row_groups']} row groups "
        f"({r['row_group_rows']['min']:,}-{r['row_group_rows']['max']:,} rows each)",
        f"label {r['label']!r}: positive rate {r['label_rate']:.4f}"
        + (f", oracle_auc {r['oracle_auc']}" if r.get("oracle_auc") is not None else ""),
        f"dense transform {r['dense_transform']}, categorical {r['categorical']}",
        f"{'column':<10} {'kind':<11} {'nulls':>6} {'empty':>6} {'num_emb':>10} {'distinct~':>10} "
        f"{'top1%ids':>9} {'top id':>7}"
        f"   dense mean [min, max]",
    ]
    for name, c in r["columns"].items():
        if c["kind"] == "dense":
            lines.append(
                f"{name:<10} {'dense':<11} {c['null_share']:>6.1%} {'':>6} {'':>10} {'':>10} {'':>9} {'':>7}"
                f"   {c['mean']:.3f} [{c['min']:.3g}, {c['max']:.3g}]"
            )
        else:
            ne = "raw" if c["num_embeddings"] is None else f"{c['num_embeddings']:,}"
            lines.append(
                f"{name:<10} {c['kind']:<11} {c['null_share']:>6.1%} {c['empty_id_share']:>6.1%} {ne:>10} "
                f"{c['distinct_ids_estimate']:>10,} {c['top1pct_ids_share']:>9.1%} "
                f"{c['most_frequent_id_share']:>7.1%}"
            )
    empty = r.get("empty_note") or f"empty: share of id {EMPTY_ID}, which blank categoricals become"
    lines.append(
        f"({empty}; distinct ids: KMV sketch over all "
        f"rows; frequency shares from the first "
        f"{r['skew_sample_rows']:,} rows)"
    )
    return "\n".join(lines)
