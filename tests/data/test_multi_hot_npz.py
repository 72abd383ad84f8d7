"""MLPerf DLRM-DCNv2's multi-hot Criteo (day_N_sparse_multi_hot.npz) -> Parquet with list<int64> columns.

The fixture is written here in the on-disk format of MLPerf's materialize_synthetic_multihot_dataset.py:
``np.savez(day_{i}_sparse_multi_hot.npz, **{"0": ids_0, ..., "25": ids_25})``, each int32 ``[N, k_f]``
whose first column is the one-hot id mod num_embeddings and the rest drawn from a per-id lookup table,
beside TorchRec's ``day_{i}_dense.npy`` float32 ``[N, 13]`` and ``day_{i}_labels.npy`` int32 ``[N, 1]``.
"""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tpurec.data.catalog import MLPERF_DCNV2_MULTI_HOT, MLPERF_DCNV2_ROWS
from tpurec.data.convert import ConvertOptions, convert
from tpurec.data.reader import ParquetReader
from tpurec.data.schema import CAT_MOD, DENSE_TORCHREC, DataError, criteo_schema, dataset_metadata

ROWS = (30, 12)


def write_mlperf_day(out, day: int, rows: int, seed: int, savez=np.savez):
    """One MLPerf multi-hot day: returns (dense, labels, [26 id arrays]) as written."""
    rng = np.random.default_rng(seed)
    dense = np.log(rng.integers(2, 5000, (rows, 13))).astype(np.float32)
    labels = rng.integers(0, 2, (rows, 1)).astype(np.int32)
    one_hot = rng.integers(0, 2**31 - 1, (rows, 26))
    ids = []
    for j, (n, k) in enumerate(zip(MLPERF_DCNV2_ROWS, MLPERF_DCNV2_MULTI_HOT)):
        lookup_rng = np.random.default_rng(1000 + j)  # the id -> extra ids table, fixed per feature
        first = one_hot[:, j] % n
        extra = lookup_rng.integers(0, n, (rows, k - 1)) if k > 1 else np.zeros((rows, 0), np.int64)
        ids.append(np.concatenate([first[:, None], extra], axis=1).astype(np.int32))
    np.save(out / f"day_{day}_dense.npy", dense)
    np.save(out / f"day_{day}_labels.npy", labels)
    savez(out / f"day_{day}_sparse_multi_hot.npz", **{str(j): a for j, a in enumerate(ids)})
    return dense, labels, ids


@pytest.fixture(scope="module")
def mlperf(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlperf")
    return d, [write_mlperf_day(d, i, n, seed=i) for i, n in enumerate(ROWS)]


def _schema(hots=MLPERF_DCNV2_MULTI_HOT, sizes=MLPERF_DCNV2_ROWS):
    return criteo_schema(sizes, multi_hot=[h > 1 for h in hots], dense_transform=DENSE_TORCHREC, categorical=CAT_MOD)


def test_multi_hot_days_become_list_columns(mlperf, tmp_path):
    d, days = mlperf
    summary = convert(
        [str(d)], str(tmp_path / "o"), ConvertOptions(_schema(), row_group_size=16), show_progress=False, jobs=1
    )
    assert summary["rows"] == sum(ROWS) and summary["files"] == 2
    t = pq.read_table(tmp_path / "o" / "part-00000.parquet")
    ids = pa.list_(pa.field("element", pa.int64(), nullable=False))  # non-null elements: no per-id levels
    assert t.schema.field("C1").type == ids and t.schema.field("C3").type == pa.int64()
    assert pq.ParquetFile(tmp_path / "o" / "part-00000.parquet").metadata.num_row_groups == 2  # 16 + 14 rows
    dense, labels, ids = days[0]
    np.testing.assert_array_equal(t.column("label").to_numpy(), labels[:, 0])
    np.testing.assert_array_equal(np.stack([t.column(f"I{j}").to_numpy() for j in range(1, 14)], 1), dense)
    for j, k in enumerate(MLPERF_DCNV2_MULTI_HOT):
        col = t.column(f"C{j + 1}")
        got = np.array(col.to_pylist()) if k > 1 else col.to_numpy()[:, None]
        np.testing.assert_array_equal(got, ids[j], err_msg=f"C{j + 1}")
    meta = dataset_metadata(tmp_path / "o")
    assert meta["categorical"] == "mod" and meta["table_sizes"]["C1"] == MLPERF_DCNV2_ROWS[0]
    # the reader hands them out as a KJT with k ids per sample of each feature
    batch = next(iter(ParquetReader(tmp_path / "o", batch_size=8)))
    kjt = batch.sparse_features
    assert [int(kjt[f"C{j + 1}"].lengths()[0]) for j in range(26)] == MLPERF_DCNV2_MULTI_HOT
    assert kjt["C21"].values()[:100].tolist() == ids[20][0].tolist()


def test_smaller_tables_take_ids_mod_size_like_mlperf_loader(mlperf, tmp_path):
    d, days = mlperf
    sizes = [97] * 26
    convert([str(d / "day_1_sparse_multi_hot.npz")], str(tmp_path / "o"), ConvertOptions(_schema(sizes=sizes)), jobs=1)
    t = pq.read_table(tmp_path / "o")
    np.testing.assert_array_equal(np.array(t.column("C21").to_pylist()), days[1][2][20] % 97)


def test_compressed_npz_reads_the_same(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_mlperf_day(a, 0, 10, seed=5)
    write_mlperf_day(b, 0, 10, seed=5, savez=np.savez_compressed)
    convert([str(a)], str(tmp_path / "oa"), ConvertOptions(_schema()), show_progress=False, jobs=1)
    convert([str(b)], str(tmp_path / "ob"), ConvertOptions(_schema()), show_progress=False, jobs=1)
    assert pq.read_table(tmp_path / "oa").equals(pq.read_table(tmp_path / "ob"))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda z: z.pop("7"), r": no array\(s\) 7: expected 26 arrays named '0'..'25'"),
        (lambda z: z.update({"3": z["3"].astype(np.float32)}), r"\[3\]: ids has dtype float32, expected integer"),
        (lambda z: z.update({"4": z["4"][:5]}), r"\[4\]: 5 rows, but .*day_0_dense.npy has 10"),
        (lambda z: z.update({"0": -z["0"] - 1}), r"\[0\]: row 0: column C1: negative id"),
    ],
)
def test_bad_multi_hot_named(tmp_path, change, message):
    write_mlperf_day(tmp_path, 0, 10, seed=2)
    path = tmp_path / "day_0_sparse_multi_hot.npz"
    z = dict(np.load(path))
    change(z)
    np.savez(path, **z)
    with pytest.raises(DataError, match=r"day_0_sparse_multi_hot.npz" + message):
        convert([str(tmp_path)], str(tmp_path / "o"), ConvertOptions(_schema()), show_progress=False, jobs=1)


def test_cli_picks_mlperf_tables_and_mod_for_npz(mlperf, tmp_path):
    d, days = mlperf
    cmd = [sys.executable, "-m", "tpurec.cli", "data", "convert", str(d), "--out", str(tmp_path / "o"), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rows"] == sum(ROWS)
    meta = dataset_metadata(tmp_path / "o")
    assert [f["multi_hot"] for f in meta["sparse"]] == [h > 1 for h in MLPERF_DCNV2_MULTI_HOT]
    assert list(meta["table_sizes"].values()) == MLPERF_DCNV2_ROWS
    assert meta["categorical"] == "mod" and meta["dense_transform"] == "torchrec_log"


def test_cli_says_the_dense_values_are_torchrecs(mlperf, tmp_path):
    d, _ = mlperf
    cmd = [sys.executable, "-m", "tpurec.cli", "data", "convert", str(d / "day_1_dense.npy"), "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"converted {ROWS[1]} rows from 1 file(s)")
    assert "dense values kept as TorchRec wrote them" in r.stdout and "--npy-dense-min" in r.stdout
