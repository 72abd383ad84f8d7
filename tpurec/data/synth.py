"""Synthetic Criteo-shaped data whose best achievable AUC is known.

Ids are Zipf-distributed per table (hot ids scattered over the table by an affine bijection), dense
features are log1p of log-normal counts, and each label is drawn from a hidden logistic model:
``logit = bias + sum_f mean_j w_f(id_fj) + dense . v``, where ``w_f(id)`` is a pseudo-random weight
computed by hashing (seed, feature, id), so even 40M-row tables need no weight table in memory.
Because labels are drawn from the true probabilities, scoring the rows with those probabilities
gives the best AUC any model can reach on them; it is measured on the generated rows and recorded
as ``oracle_auc``. With ``raw_ids`` the ids are not table rows but raw ids as `tpurec data convert
--raw-ids` keeps them: the same Zipf law over a larger id space (``id_space`` distinct ids per feature,
default 2**32 as Criteo's 8-digit hex ids), scattered over it and shifted by 1 (0 stays "empty"),
so a model hashes (or remaps, `tpurec train --zch`) a few hot ids and a long tail into its tables.
Rows are generated in chunks seeded by (seed, chunk), so the output depends only
on the seed and the sizes, not on timing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tpurec.data.schema import (
    CAT_HASH,
    CAT_RAW,
    DENSE_LOG1P,
    DataError,
    DataSchema,
    SparseFeature,
    parquet_writer,
    remove_stale_parts,
    write_dataset_json,
)
from tpurec.errors import UserError
from tpurec.runtime.interrupts import Interrupted
from tpurec.runtime.terminate import Terminated, unwinding_on_sigterm

if TYPE_CHECKING:
    import pyarrow as pa

ZIPF_EXPONENT = 1.1
SPARSE_SCALE = 0.25  # spread of each feature's hidden weights
DENSE_SCALE = 0.25
BIAS = -1.6  # gives a positive rate near Criteo's ~25%
RAW_ID_SPACE = 2**32  # distinct raw ids per feature of --raw-ids data (Criteo's hex ids are 32-bit)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
    return x ^ (x >> np.uint64(31))


def hidden_weight(seed: int, feature: int, ids: np.ndarray) -> np.ndarray:
    """The hidden model's weight of each id of one feature: uniform with unit variance."""
    key = np.uint64((seed * 1_000_003 + feature * 7919 + 1) & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        h = _splitmix64(ids.astype(np.uint64) ^ _splitmix64(np.array([key], np.uint64))[0])
    u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return (u - 0.5) * np.sqrt(12.0)


def zipf_ids(rng: np.random.Generator, n: int, size: int | tuple[int, ...], a: float = ZIPF_EXPONENT) -> np.ndarray:
    """Ids in [0, n) whose popularity ranks follow a (continuous-approximation) Zipf law."""
    u = rng.random(size)
    top = (n + 1.0) ** (1.0 - a)
    ranks = np.floor(((top - 1.0) * u + 1.0) ** (1.0 / (1.0 - a))).astype(np.int64) - 1
    return np.clip(ranks, 0, n - 1)


def _scatter(ranks: np.ndarray, n: int, feature: int) -> np.ndarray:
    """An affine bijection of [0, n), so the hot ids are not simply 0, 1, 2, ..."""
    mult = 2_654_435_761 % n or 1
    while np.gcd(mult, n) != 1:
        mult += 1
    return (ranks * mult + 17 * feature + 1) % n


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC (tied scores count half), by torchmetrics' exact `binary_auroc`; nan for a single class.

    torchmetrics builds the ROC curve in float32, so the value agrees with the exact rank-sum
    formula to about 1e-7. Scores outside [0, 1] (logits) go through a sigmoid first, which keeps
    their order (float64 saturates only beyond |logit| ~ 37).
    """
    import torch
    from torchmetrics.functional.classification import binary_auroc

    labels = np.asarray(labels).astype(bool)
    if labels.all() or not labels.any():  # torchmetrics would warn and return 0
        return float("nan")
    t_scores = torch.from_numpy(np.ascontiguousarray(scores, dtype=np.float64))
    # validate_args=False: the labels are 0/1 by construction, and validation costs a sort.
    return float(binary_auroc(t_scores, torch.from_numpy(labels).long(), validate_args=False))


def synth_schema(
    table_set: str, multi_hot_sizes: list[int] | None = None, raw_ids: bool = False
) -> tuple[DataSchema, list[int]]:
    """The schema for a named table set (tpurec/data/catalog.py) and its ids per sample (the table set's
    pooling factors, or ``multi_hot_sizes``); with ``raw_ids`` the features have no table size."""
    from tpurec.data.catalog import get_table_set

    ts = get_table_set(table_set)
    hots = [max(1, int(round(t.pooling_factor))) for t in ts.tables]
    if multi_hot_sizes is not None:
        if len(multi_hot_sizes) != len(hots) or min(multi_hot_sizes) < 1:
            raise UserError(f"{len(hots)} multi-hot sizes >= 1 needed, got {list(multi_hot_sizes)}")
        hots = [int(h) for h in multi_hot_sizes]
    sparse = [SparseFeature(t.feature, None if raw_ids else t.num_embeddings, h > 1) for t, h in zip(ts.tables, hots)]
    schema = DataSchema(
        sparse=sparse,
        dense_transform=DENSE_LOG1P,
        categorical=CAT_RAW if raw_ids else CAT_HASH,
        extra={"synthetic": True, "table_set": table_set},
    )
    return schema, hots


def features_schema(
    num_dense: int, features: list[tuple[str, int, int]], **extra: object
) -> tuple[DataSchema, list[int]]:
    """The schema of synthetic data for any model's features, as TorchRec's RandomRecDataset takes them:
    ``num_dense`` dense columns (I1, I2, ...) and per feature (name, table rows, ids per sample); a
    feature of more than one id per sample is a list column. ``extra``: facts recorded with it."""
    if num_dense < 0:
        raise UserError(f"{num_dense} dense features: must be >= 0")
    bad = next(((n, r) for n, r, _ in features if r < 2), None)
    if bad:  # id 0 is "empty" in tpurec's hashed ids; a 1-row table has no other
        raise UserError(f"feature {bad[0]!r}: a table of {bad[1]} row(s); synthetic ids need >= 2")
    sparse = [SparseFeature(name, int(rows), hots > 1) for name, rows, hots in features]
    schema = DataSchema(
        dense=[f"I{i}" for i in range(1, num_dense + 1)],
        sparse=sparse,
        dense_transform=DENSE_LOG1P,
        categorical=CAT_HASH,
        extra={"synthetic": True, **extra},
    )
    return schema, [max(1, int(h)) for _, _, h in features]


def raw_ids(ranks: np.ndarray, n: int, feature: int) -> np.ndarray:
    """Popularity ranks in [0, n) as raw ids in [1, n]: scattered by an odd multiplier modulo n (in
    uint64, exact for n a power of 2, the default), shifted by 1 so that 0 keeps meaning "empty"."""
    mult = np.uint64((2_654_435_761 + 2 * feature) % n or 1)
    with np.errstate(over="ignore"):
        scattered = (ranks.astype(np.uint64) * mult + np.uint64(17 * feature + 1)) % np.uint64(n)
    return scattered.astype(np.int64) + 1


def generate_chunk(
    seed: int, chunk: int, rows: int, schema: DataSchema, hots: list[int], id_space: int | None = None
) -> tuple[dict[str, pa.Array], np.ndarray, np.ndarray]:
    """One chunk of rows: (pyarrow columns dict, true probabilities, labels). ``id_space``: raw ids
    (a schema without table sizes), that many per feature."""
    import pyarrow as pa

    rng = np.random.default_rng([seed, chunk])
    drng = np.random.default_rng([seed, 2**31 - 1])  # per-dataset constants, not per chunk
    mu = drng.uniform(0.0, 4.0, len(schema.dense))
    sigma = drng.uniform(0.5, 2.0, len(schema.dense))
    v = drng.normal(0.0, 1.0, len(schema.dense)) * DENSE_SCALE
    raw = np.floor(np.exp(rng.normal(mu, sigma, (rows, len(schema.dense)))))
    dense = np.log1p(raw).astype(np.float32)
    # Standardise with the known log-normal moments, so the dense part has a stable scale.
    logit = BIAS + ((dense - mu) / sigma) @ v
    cols: dict[str, pa.Array] = {}
    for j, (f, h) in enumerate(zip(schema.sparse, hots)):
        if f.num_embeddings is None:
            n = id_space or RAW_ID_SPACE
            ids = raw_ids(zipf_ids(rng, n, (rows, h)), n, j)
        else:
            ids = _scatter(zipf_ids(rng, f.rows, (rows, h)), f.rows, j)
        logit = logit + SPARSE_SCALE * hidden_weight(seed, j, ids).mean(axis=1)
        if f.multi_hot:
            offsets = pa.array(np.arange(0, rows * h + 1, h, dtype=np.int32))
            cols[f.name] = pa.ListArray.from_arrays(offsets, pa.array(ids.reshape(-1)))
        else:
            cols[f.name] = pa.array(ids[:, 0])
    p = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(rows) < p).astype(np.int8)
    cols[schema.label] = pa.array(labels)
    for j, name in enumerate(schema.dense):
        cols[name] = pa.array(dense[:, j])
    return cols, p, labels


def synthesize(
    rows: int,
    out_dir: str,
    *,
    seed: int = 0,
    table_set: str | None = "dlrm-tiny",  # None with own_schema: a model's features, no table set
    rows_per_file: int = 1_000_000,
    row_group_size: int = 65536,
    compression: str = "none",
    show_progress: bool = True,
    overwrite: bool = False,
    multi_hot_sizes: list[int] | None = None,
    raw_ids: bool = False,
    id_space: int = RAW_ID_SPACE,
    own_schema: tuple[DataSchema, list[int]] | None = None,
) -> dict:
    """Write ``rows`` synthetic rows to ``out_dir`` and return the dataset summary with oracle_auc.
    ``multi_hot_sizes`` replaces the table set's ids per sample (one per feature); ``raw_ids``: raw
    ids (unhashed, ``id_space`` of them per feature, Zipf-skewed) instead of table rows. ``own_schema``: a
    model's own features (``features_schema``) instead of the table set's.

    Uncompressed by default: dictionary encoding already makes Zipf ids small, and uncompressed
    files (~18% bigger than snappy) decode about 1.7x faster, which is what training loops want.
    """
    from tpurec.data.out_lock import locked_output

    if rows < 1:
        raise DataError("--rows must be >= 1")
    if raw_ids and id_space < 2:
        raise DataError("--id-space must be >= 2")
    schema, hots = own_schema or synth_schema(table_set or "dlrm-tiny", multi_hot_sizes, raw_ids)
    space = id_space if raw_ids else None
    # unwinding_on_sigterm: SIGTERM, too, ends in _synthesize_into's cleanup (no temporary part left)
    with unwinding_on_sigterm("tpurec data synth"), locked_output(out_dir, overwrite, "tpurec data synth") as out:
        return _synthesize_into(
            out, rows, schema, hots, seed, table_set, rows_per_file, row_group_size, compression, show_progress, space
        )


def _synthesize_into(
    out: Path,
    rows: int,
    schema: DataSchema,
    hots: list[int],
    seed: int,
    table_set: str | None,
    rows_per_file: int,
    row_group_size: int,
    compression: str,
    show_progress: bool,
    id_space: int | None = None,
) -> dict:
    """`synthesize` into the prepared, locked directory `out` (``id_space``: raw ids, that many)."""
    import pyarrow as pa
    from tqdm import tqdm

    arrow_schema = schema.arrow_schema()
    rows_per_file = max(row_group_size, (rows_per_file // row_group_size) * row_group_size)
    t0 = time.perf_counter()
    probs, labels_all, files, tmps = [], [], [], []
    bar = tqdm(total=rows, unit="rows", unit_scale=True, desc="synth", disable=not show_progress)
    chunk = 0
    try:
        for fi, start in enumerate(range(0, rows, rows_per_file)):
            final = out / f"part-{fi:05d}.parquet"
            tmp = final.with_suffix(f".parquet.tmp-{os.getpid()}")  # per process: two runs never share a file
            tmps.append((tmp, final))
            with parquet_writer(tmp, arrow_schema, compression) as w:
                for s in range(start, min(rows, start + rows_per_file), row_group_size):
                    n = min(row_group_size, rows - s, start + rows_per_file - s)
                    cols, p, y = generate_chunk(seed, chunk, n, schema, hots, id_space)
                    chunk += 1
                    w.write_table(
                        pa.Table.from_arrays([cols[f.name] for f in arrow_schema], schema=arrow_schema),
                        row_group_size=row_group_size,
                    )
                    probs.append(p)
                    labels_all.append(y)
                    bar.update(n)
            files.append(final.name)
    except BaseException as e:
        for tmp, _ in tmps:
            tmp.unlink(missing_ok=True)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"nothing written to {out}") from None
        if isinstance(e, Terminated):
            raise Terminated(f"nothing written to {out}, its {len(tmps)} temporary part(s) removed") from None
        raise
    finally:
        bar.close()
    for tmp, final in tmps:
        tmp.replace(final)
    remove_stale_parts(out, files)  # only now: a failed run leaves the old dataset whole
    p, y = np.concatenate(probs), np.concatenate(labels_all)
    summary = {
        "rows": rows,
        "files": len(files),
        "seed": seed,
        "table_set": table_set,
        "oracle_auc": round(auc(p, y), 6),
        "label_rate": round(float(y.mean()), 6),
        "bytes_out": sum(os.path.getsize(out / f) for f in files),
        "seconds": round(time.perf_counter() - t0, 3),
        "out_dir": str(out),
    }
    write_dataset_json(
        out,
        schema,
        rows=rows,
        files=files,
        seed=seed,
        table_set=table_set,
        synthetic=True,
        oracle_auc=summary["oracle_auc"],
        label_rate=summary["label_rate"],
        zipf_exponent=ZIPF_EXPONENT,
        multi_hot_sizes=hots,
        **({"raw_id_space": id_space} if id_space else {}),
    )
    if id_space:
        summary["raw_id_space"] = id_space
    return summary
