"""`tpurec data inspect` of Parquet read through a column mapping (tpurec/data/mapped.py): the report of
tpurec/data/inspect.py (same fields, same text), computed from the decoded windows, plus the mapping.

Ids are counted as the reader makes them: integer ids as they are (or mod ROWS), string ids hashed
(mod ROWS, else to 63 bits); "empty" is the share of rows with no id (a null, or an empty list).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tpurec.data.inspect import _KMV

if TYPE_CHECKING:
    from tpurec.data.mapped import MappedSource


def inspect_mapped(source: MappedSource, sample_rows: int = 1_000_000) -> dict:
    """The `inspect_dataset` report of a mapped source, with ``mapping`` (the --columns document)."""
    m = source.mapping
    decoder = source.decoder([f.rows for f in m.sparse])
    names = [f.name for f in m.sparse]
    nulls = dict.fromkeys([m.label, *m.dense, *names], 0)
    sketches = {n: _KMV() for n in names}
    samples: dict[str, list[np.ndarray]] = {n: [] for n in names}
    empty_rows, id_counts = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    dense_sum = np.zeros(len(m.dense))
    dense_min, dense_max = np.full(len(m.dense), np.inf), np.full(len(m.dense), -np.inf)
    positives, sampled = 0.0, 0
    for u in source.units:
        t = decoder.read(u)
        for c in nulls:
            nulls[c] += t.column(c).null_count
        w = decoder.decode(t, u)
        positives += float(w.labels.sum())
        if w.rows and m.dense:
            dense_sum += w.dense.sum(axis=0, dtype=np.float64)
            dense_min = np.minimum(dense_min, w.dense.min(axis=0))
            dense_max = np.maximum(dense_max, w.dense.max(axis=0))
        take = max(0, min(w.rows, sample_rows - sampled))
        assert w.features is not None  # mapped windows always carry per-feature lengths
        for n, feat in zip(names, w.features):
            sketches[n].add(feat.values)
            empty_rows[n] += int(np.count_nonzero(feat.lengths == 0))
            id_counts[n] += len(feat.values)
            if take and feat.offsets is not None:
                samples[n].append(feat.values[: int(feat.offsets[take])])
        sampled += take
    rows = source.rows
    columns: dict[str, dict] = {}
    for f in m.sparse:
        s = np.concatenate(samples[f.name]) if samples[f.name] else np.empty(0, np.int64)
        _, counts = np.unique(s, return_counts=True)
        counts = np.sort(counts)[::-1]
        top = max(1, int(np.ceil(0.01 * len(counts))))
        columns[f.name] = {
            "kind": f.kind.replace("_", " "),
            "num_embeddings": f.rows,
            "null_share": nulls[f.name] / max(rows, 1),
            "empty_id_share": round(empty_rows[f.name] / max(rows, 1), 4),  # here: of rows, rows without ids
            "distinct_ids_estimate": sketches[f.name].estimate(),
            "top1pct_ids_share": round(float(counts[:top].sum() / max(counts.sum(), 1)), 4),
            "most_frequent_id_share": round(float(counts[0] / counts.sum()), 4) if len(counts) else 0.0,
            "ids_per_row": round(id_counts[f.name] / max(rows, 1), 3),
        }
    for i, n in enumerate(m.dense):
        columns[n] = {
            "kind": "dense",
            "null_share": nulls[n] / max(rows, 1),
            "mean": round(float(dense_sum[i]) / max(rows, 1), 4),
            "min": float(dense_min[i]) if rows else None,
            "max": float(dense_max[i]) if rows else None,
        }
    units = source.units
    return {
        "path": source.path,
        "files": source.files,
        "rows": rows,
        "row_groups": len(units),
        "row_group_rows": {"min": min(u.rows for u in units), "max": max(u.rows for u in units)},
        "label": m.label,
        "label_rate": round(positives / max(rows, 1), 6),
        "label_null_share": nulls[m.label] / max(rows, 1),
        "dense_transform": "raw (nulls as 0.0)",
        "categorical": "mapped (ints mod ROWS, strings splitmix64(fnv1a64) mod ROWS; docs/data.md)",
        "oracle_auc": None,
        "skew_sample_rows": sampled,
        "columns": columns,
        "partition_columns": list(source.partition_columns),
        "mapping": m.to_doc(),
        "mapping_inferred": list(m.inferred),
        "mapping_label_like_left_out": list(m.label_like),
        "empty_note": "empty: share of rows without ids (null or empty list)",
    }
