import csv
import gzip
import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tpurec.data.catalog import CRITEO_KAGGLE_ROWS
from tpurec.data.convert import ConvertOptions, convert
from tpurec.data.schema import CAT_RAW, DENSE_RAW, DataError, criteo_schema, dataset_metadata


def _sample_rows(path):
    with open(path, newline="") as f:
        r = csv.reader(f)
        next(r)
        return list(r)


def _expected(row, sizes=CRITEO_KAGGLE_ROWS):
    """Hand-parsed reading of one raw Criteo row with the documented default transforms."""
    label = int(row[0])
    dense = [math.log1p(max(float(v), 0.0)) if v else 0.0 for v in row[1:14]]
    ids = [0 if not v else 1 + int(v, 16) % (n - 1) for v, n in zip(row[14:40], sizes)]
    return label, dense, ids


def _check_rows(table, rows, picks):
    for i in picks:
        label, dense, ids = _expected(rows[i])
        assert table.column("label")[i].as_py() == label
        got_dense = [table.column(f"I{j}")[i].as_py() for j in range(1, 14)]
        np.testing.assert_allclose(got_dense, dense, rtol=1e-6, atol=1e-7)
        assert [table.column(f"C{j}")[i].as_py() for j in range(1, 27)] == ids


def _write_tsv(rows, path, gz=False):
    text = "".join("\t".join(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        Path(path).write_text(text)


def test_convert_real_sample_csv(criteo_sample, tmp_path):
    rows = _sample_rows(criteo_sample)
    summary = convert([str(criteo_sample)], str(tmp_path / "out"), ConvertOptions(criteo_schema()), show_progress=False)
    assert summary["rows"] == len(rows) == 200 and summary["files"] == 1 and summary["bad_lines"] == 0
    t = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    # Row 1 has a negative dense value (-1) and blank categoricals; check it and a spread of others.
    assert rows[1][2] == "-1" and rows[0][32] == ""
    _check_rows(t, rows, [0, 1, 2, 57, 199])
    for f in criteo_schema().sparse:  # never null, always in range
        col = t.column(f.name).to_numpy()
        assert t.column(f.name).null_count == 0 and col.min() >= 0 and col.max() < f.num_embeddings
    meta = dataset_metadata(tmp_path / "out")
    assert meta["rows"] == 200 and meta["dense_transform"] == "log1p_clamp0"
    assert meta["categorical"] == "mod_reserve0" and meta["empty_id"] == 0
    assert meta["table_sizes"]["C3"] == CRITEO_KAGGLE_ROWS[2]


@pytest.mark.parametrize("gz", [False, True])
def test_tsv_rendition_matches_csv(criteo_sample, tmp_path, gz):
    rows = _sample_rows(criteo_sample)
    tsv = tmp_path / ("day_0.gz" if gz else "day_0")
    _write_tsv(rows, tsv, gz)
    opts = ConvertOptions(criteo_schema(), row_group_size=64)
    convert([str(tsv)], str(tmp_path / "tsv"), opts, show_progress=False)
    convert([str(criteo_sample)], str(tmp_path / "csv"), opts, show_progress=False)
    a = pq.read_table(tmp_path / "tsv" / "part-00000.parquet")
    b = pq.read_table(tmp_path / "csv" / "part-00000.parquet")
    assert a.equals(b)
    assert pq.ParquetFile(tmp_path / "tsv" / "part-00000.parquet").metadata.num_row_groups == 4  # 64,64,64,8
    _check_rows(a, rows, [3, 100, 150])


def test_parallel_convert_of_several_files(criteo_sample, tmp_path):
    rows = _sample_rows(criteo_sample)
    for i in range(3):
        _write_tsv(rows[i * 50 : (i + 1) * 50], tmp_path / f"day_{i}")
    s = convert(
        [str(tmp_path / f"day_{i}") for i in range(3)],
        str(tmp_path / "out"),
        ConvertOptions(criteo_schema()),
        jobs=2,
        show_progress=False,
    )
    assert s["rows"] == 150 and s["files"] == 3
    t = pq.read_table(tmp_path / "out" / "part-00002.parquet")
    _check_rows(t, rows[100:150], [0, 49])


def test_raw_modes_and_torchrec_names(criteo_sample, tmp_path):
    rows = _sample_rows(criteo_sample)
    schema = criteo_schema(
        dense_names=[f"int_{i}" for i in range(13)],
        sparse_names=[f"cat_{i}" for i in range(26)],
        dense_transform=DENSE_RAW,
        categorical=CAT_RAW,
    )
    convert([str(criteo_sample)], str(tmp_path / "o"), ConvertOptions(schema), show_progress=False)
    t = pq.read_table(tmp_path / "o" / "part-00000.parquet")
    assert t.column("int_1")[1].as_py() == -1.0  # raw dense keeps negatives
    assert t.column("int_0")[0].as_py() == 0.0  # blank -> 0
    assert t.column("cat_0")[0].as_py() == int(rows[0][14], 16)
    assert t.column("cat_18")[0].as_py() == 0  # blank -> 0


def test_malformed_line_names_file_and_line_and_writes_nothing(criteo_sample, tmp_path):
    rows = _sample_rows(criteo_sample)
    bad = [list(r) for r in rows[:10]]
    bad[6][20] = "zzzz"  # line 7: a categorical that is not hex
    tsv = tmp_path / "day_0"
    _write_tsv(bad, tsv)
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"day_0:7: column C7: not a hex"):
        convert([str(tsv)], str(out), ConvertOptions(criteo_schema()), show_progress=False)
    assert not list(out.glob("*"))  # no part file, no temp file, no _dataset.json


def test_short_line_names_line_and_skip_bad_lines_counts(criteo_sample, tmp_path):
    rows = _sample_rows(criteo_sample)[:20]
    lines = ["\t".join(r) for r in rows]
    lines[4] = "\t".join(rows[4][:30])  # line 5 truncated to 30 columns
    lines[11] = "\t".join(rows[11][:3] + ["1.2.3"] + rows[11][4:])  # line 12: I3 not a number
    tsv = tmp_path / "day_0"
    tsv.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"day_0:5: expected 40 columns, got 30"):
        convert([str(tsv)], str(tmp_path / "a"), ConvertOptions(criteo_schema()), show_progress=False)
    s = convert(
        [str(tsv)], str(tmp_path / "b"), ConvertOptions(criteo_schema(), skip_bad_lines=True), show_progress=False
    )
    assert s["bad_lines"] == 2 and s["rows"] == 18
    assert any("day_0:5:" in e for e in s["bad_examples"]) and any("day_0:12:" in e for e in s["bad_examples"])
    t = pq.read_table(tmp_path / "b" / "part-00000.parquet")
    keep = [r for i, r in enumerate(rows) if i not in (4, 11)]
    _check_rows(t, keep, [3, 4, 10, 17])  # rows after each skipped line line up


def test_cli_convert_error_is_one_line_exit_2(criteo_sample, tmp_path, capsys):
    from tpurec.cli import main

    tsv = tmp_path / "day_0"
    tsv.write_text("1\t2\n")
    assert main(["data", "convert", str(tsv), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "day_0:1" in err[0]
    assert main(["data", "convert", str(criteo_sample), "--out", str(tmp_path / "p"), "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 200
    # A second run into the same directory refuses instead of mixing datasets.
    assert main(["data", "convert", str(criteo_sample), "--out", str(tmp_path / "p"), "--quiet"]) == 2


def test_bad_dense_value_names_line_and_column(criteo_sample, tmp_path):
    rows = [list(r) for r in _sample_rows(criteo_sample)[:5]]
    rows[2][2] = "12x"  # line 3, column I2
    tsv = tmp_path / "day_1.gz"
    _write_tsv(rows, tsv, gz=True)
    with pytest.raises(DataError, match=r"day_1\.gz:3: column I2: not a number"):
        convert([str(tsv)], str(tmp_path / "o"), ConvertOptions(criteo_schema()), show_progress=False)
    assert not list((tmp_path / "o").glob("*"))


def test_empty_input_is_an_error(tmp_path):
    (tmp_path / "day_0").write_text("")
    with pytest.raises(DataError, match=r"day_0: no lines \(empty file\)"):
        convert([str(tmp_path / "day_0")], str(tmp_path / "o"), ConvertOptions(criteo_schema()), show_progress=False)


def test_progress_counts_each_input_byte_once_even_after_a_retry(criteo_sample, tmp_path):
    from tpurec.data.convert import convert_file

    rows = [list(r) for r in _sample_rows(criteo_sample)]
    rows[150][3] = "n/a"  # forces the typed fast path to redo the file in string mode
    tsv = tmp_path / "day_0"
    _write_tsv(rows, tsv)
    ticks = []
    res = convert_file(
        str(tsv),
        str(tmp_path / "o.parquet"),
        ConvertOptions(criteo_schema(), skip_bad_lines=True, block_size=4096),
        progress=ticks.append,
    )
    assert res.rows == 199 and res.bad_lines == 1 and "day_0:151: column I3" in res.bad_examples[0]
    assert sum(ticks) == tsv.stat().st_size  # not twice, though the file was read twice


def test_failed_overwrite_leaves_the_previous_dataset_whole(criteo_sample, tmp_path):
    """--overwrite replaces the old dataset only once the new one is written."""
    rows = _sample_rows(criteo_sample)
    good, bad = tmp_path / "day_0", tmp_path / "day_1"
    _write_tsv(rows[:50], good)
    broken = [list(r) for r in rows[:10]]
    broken[3][20] = "zzzz"
    _write_tsv(broken, bad)
    out = tmp_path / "out"
    convert([str(good)], str(out), ConvertOptions(criteo_schema()), show_progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DataError, match=r"day_1:4: column C7"):
        convert([str(bad)], str(out), ConvertOptions(criteo_schema()), show_progress=False, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # parts and _dataset.json untouched
    assert pq.read_table(out / "part-00000.parquet").num_rows == 50
    # a successful overwrite with fewer inputs removes the parts it no longer writes
    convert([str(good), str(good)], str(tmp_path / "two"), ConvertOptions(criteo_schema()), show_progress=False)
    convert([str(good)], str(tmp_path / "two"), ConvertOptions(criteo_schema()), show_progress=False, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "two").glob("*.parquet")) == ["part-00000.parquet"]
    assert json.loads((tmp_path / "two" / "_dataset.json").read_text())["files"] == ["part-00000.parquet"]


@pytest.mark.parametrize("value", ["nan", "inf", "-Infinity", "1e400"])
def test_non_finite_dense_value_stops_the_conversion(criteo_sample, tmp_path, value):
    rows = [list(r) for r in _sample_rows(criteo_sample)[:5]]
    rows[1][3] = value  # line 2, column I3
    tsv = tmp_path / "day_2"
    _write_tsv(rows, tsv)
    with pytest.raises(DataError, match=r"day_2:2: column I3: not a number"):
        convert([str(tsv)], str(tmp_path / "o"), ConvertOptions(criteo_schema()), show_progress=False)


def test_raw_ids_at_or_above_2_63_are_refused_not_wrapped(criteo_sample, tmp_path):
    rows = [list(r) for r in _sample_rows(criteo_sample)[:5]]
    rows[2][16] = "8000000000000000"  # line 3, C3: 2^63
    rows[1][16] = "7fffffffffffffff"  # line 2: the largest id that fits
    tsv = tmp_path / "day_3"
    _write_tsv(rows, tsv)
    schema = criteo_schema(categorical=CAT_RAW)
    with pytest.raises(DataError, match=r"day_3:3: column C3: raw id >= 2\^63 does not fit an int64 id"):
        convert([str(tsv)], str(tmp_path / "o"), ConvertOptions(schema), show_progress=False)
    del rows[2]
    _write_tsv(rows, tsv)
    convert([str(tsv)], str(tmp_path / "o"), ConvertOptions(schema), show_progress=False)
    assert pq.read_table(tmp_path / "o" / "part-00000.parquet").column("C3")[1].as_py() == 2**63 - 1
