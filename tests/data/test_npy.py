"""TorchRec's .npy day files -> Parquet: fixtures written by TorchRec's own tsv_to_npys."""

import csv
import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import CRITEO_SAMPLE
from tpurec.data.convert import ConvertOptions, convert
from tpurec.data.schema import CAT_MOD, DENSE_RAW, DENSE_TORCHREC, DataError, criteo_schema, dataset_metadata

DAYS = (25, 15)  # rows of day_0 and day_1, from the head of the Criteo sample


def _tsv_rows(criteo_sample):
    """The sample's first rows as raw Criteo TSV fields (dense as integers, which tsv_to_npys needs)."""
    with open(criteo_sample, newline="") as f:
        r = csv.reader(f)
        next(r)
        rows = [next(r) for _ in range(sum(DAYS))]
    return [[row[0]] + [str(int(float(v))) if v else "" for v in row[1:14]] + row[14:] for row in rows]


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """(dir of day_{0,1}_{dense,sparse,labels}.npy by TorchRec, [TSV day paths], per-day raw dense minimum)."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    if not CRITEO_SAMPLE.exists():
        pytest.skip(f"{CRITEO_SAMPLE} not found")
    criteo_sample = CRITEO_SAMPLE
    root = tmp_path_factory.mktemp("npy")
    rows = _tsv_rows(criteo_sample)
    tsvs, mins, start = [], [], 0
    for i, n in enumerate(DAYS):
        day = rows[start : start + n]
        start += n
        tsv = root / f"day_{i}"
        tsv.write_text("".join("\t".join(r) + "\n" for r in day))
        tsvs.append(str(tsv))
        mins.append(min(int(v or 0) for r in day for v in r[1:14]))
        npy = root / "npy"
        npy.mkdir(exist_ok=True)
        BinaryCriteoUtils.tsv_to_npys(
            str(tsv), *(str(npy / f"day_{i}_{part}.npy") for part in ("dense", "sparse", "labels"))
        )
    assert mins[0] == -1  # the sample's second row has I2 = -1: TorchRec shifts by it
    return root / "npy", tsvs, mins


def _table(d):
    return pq.read_table(d).to_pandas()


def _parts(d):
    return sorted(p.name for p in d.glob("*.parquet"))


def test_torchrec_npy_days_equal_the_text_conversion(days, tmp_path):
    npy_dir, tsvs, mins = days
    opts = ConvertOptions(criteo_schema(), row_group_size=8)
    convert(tsvs, str(tmp_path / "tsv"), opts, show_progress=False, jobs=1)
    opts.npy_dense_min = mins
    summary = convert([str(npy_dir)], str(tmp_path / "npy"), opts, show_progress=False, jobs=1)
    assert summary["rows"] == sum(DAYS) and summary["files"] == 2
    assert _parts(tmp_path / "npy") == _parts(tmp_path / "tsv") == ["part-00000.parquet", "part-00001.parquet"]
    a, b = _table(tmp_path / "npy"), _table(tmp_path / "tsv")
    assert list(a.columns) == list(b.columns)
    for c in ["label"] + [f"C{j}" for j in range(1, 27)]:
        assert (a[c].to_numpy() == b[c].to_numpy()).all(), c
    dense = [f"I{j}" for j in range(1, 14)]
    np.testing.assert_allclose(a[dense].to_numpy(), b[dense].to_numpy(), rtol=1e-6, atol=1e-7)
    assert (a["C20"] == 0).sum() > 0  # blanks in the sample: empty -> id 0 from both routes
    for i in range(2):  # same row groups (8 rows) in every part
        m1 = pq.ParquetFile(tmp_path / "npy" / f"part-0000{i}.parquet").metadata
        m2 = pq.ParquetFile(tmp_path / "tsv" / f"part-0000{i}.parquet").metadata
        assert [m1.row_group(g).num_rows for g in range(m1.num_row_groups)] == [
            m2.row_group(g).num_rows for g in range(m2.num_row_groups)
        ]
    meta, meta_tsv = dataset_metadata(tmp_path / "npy"), dataset_metadata(tmp_path / "tsv")
    assert meta["rows"] == meta_tsv["rows"] == sum(DAYS)
    assert meta["table_sizes"] == meta_tsv["table_sizes"] and meta["dense_transform"] == "log1p_clamp0"
    assert meta["source"][:3] == ["day_0_dense.npy", "day_0_sparse.npy", "day_0_labels.npy"]


def test_torchrec_dense_kept_as_written_without_the_minimum(days, tmp_path):
    npy_dir, _, _ = days
    schema = criteo_schema(dense_transform=DENSE_TORCHREC, categorical=CAT_MOD)
    convert([str(npy_dir / "day_1_sparse.npy")], str(tmp_path / "o"), ConvertOptions(schema), show_progress=False)
    t = _table(tmp_path / "o")
    dense = np.load(npy_dir / "day_1_dense.npy")
    np.testing.assert_array_equal(t[[f"I{j}" for j in range(1, 14)]].to_numpy(), dense)
    raw = np.load(npy_dir / "day_1_sparse.npy")
    sizes = [f.num_embeddings for f in schema.sparse]
    np.testing.assert_array_equal(t[[f"C{j}" for j in range(1, 27)]].to_numpy(), raw % np.array(sizes))
    assert dataset_metadata(tmp_path / "o")["dense_transform"] == "torchrec_log"


def _copy_day(src, dst, **override):
    dst.mkdir()
    for part in ("dense", "sparse", "labels"):
        arr = override.get(part, np.load(src / f"day_0_{part}.npy"))
        np.save(dst / f"day_0_{part}.npy", arr)
    return dst


@pytest.mark.parametrize(
    "part,make,message",
    [
        ("dense", lambda a: a[:, :12], "day_0_dense.npy: dense has shape [25, 12], expected [N, 13]"),
        ("dense", lambda a: a.astype(np.int32), "day_0_dense.npy: dense has dtype int32, expected float"),
        ("sparse", lambda a: a[:20], "day_0_sparse.npy: 20 rows, but"),
        ("sparse", lambda a: a.astype(np.float32), "day_0_sparse.npy: sparse has dtype float32, expected integer"),
        ("labels", lambda a: np.full_like(a, -1), "day_0_labels.npy: row 0: label -1, expected 0 or 1 (-1: the Kaggle"),
    ],
)
def test_bad_npy_day_named(days, tmp_path, part, make, message):
    npy_dir, _, mins = days
    bad = _copy_day(npy_dir, tmp_path / "bad", **{part: make(np.load(npy_dir / f"day_0_{part}.npy"))})
    opts = ConvertOptions(criteo_schema(), npy_dense_min=mins[:1])
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("(", r"\(")):
        convert([str(bad)], str(tmp_path / "o"), opts, show_progress=False)
    assert not list((tmp_path / "o").glob("*.parquet*"))


def test_missing_companion_named(days, tmp_path):
    npy_dir, _, _ = days
    d = _copy_day(npy_dir, tmp_path / "d")
    (d / "day_0_labels.npy").unlink()
    with pytest.raises(DataError, match=r"day_0_labels.npy: missing"):
        convert([str(d / "day_0_dense.npy")], str(tmp_path / "o"), ConvertOptions(criteo_schema()), show_progress=False)


def test_cli_converts_npy_with_raw_dense(days, tmp_path):
    npy_dir, tsvs, mins = days
    cmd = [sys.executable, "-m", "tpurec.cli", "data", "convert", str(npy_dir / "day_0_dense.npy"), "--json"]
    r = subprocess.run(
        cmd + ["--out", str(tmp_path / "o"), "--raw-dense", "--npy-dense-min", str(mins[0])],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rows"] == DAYS[0]
    t = _table(tmp_path / "o")
    raw = [[float(v or 0) for v in line.split("\t")[1:14]] for line in open(tsvs[0]).read().splitlines()]
    np.testing.assert_allclose(t[[f"I{j}" for j in range(1, 14)]].to_numpy(), np.array(raw), rtol=1e-6)
    assert dataset_metadata(tmp_path / "o")["dense_transform"] == DENSE_RAW
    # without the minimum, --raw-dense cannot be honoured: one line, exit 2
    r = subprocess.run(cmd + ["--out", str(tmp_path / "p"), "--raw-dense"], capture_output=True, text=True)
    assert r.returncode == 2 and "--npy-dense-min" in r.stderr and "Traceback" not in r.stderr
