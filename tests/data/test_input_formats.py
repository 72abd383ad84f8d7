"""Input mistakes get one line with the fix, and a converted dataset opens in other tools."""

from __future__ import annotations

import csv
import json

import pyarrow.parquet as pq
import pytest

from tpurec.data.convert import ConvertOptions, convert
from tpurec.data.schema import DataError, criteo_schema, dataset_metadata


def _rows(sample, n=20):
    with open(sample, newline="") as f:
        r = csv.reader(f)
        next(r)  # the sample's header
        return [row for _, row in zip(range(n), r)]


def _convert(path, out, **kw):
    return convert([str(path)], str(out), ConvertOptions(criteo_schema(), **kw), show_progress=False)


def test_headerless_csv_keeps_its_first_row(criteo_sample, tmp_path):
    rows = _rows(criteo_sample)
    path = tmp_path / "no_header.csv"
    path.write_text("".join(",".join(r) + "\n" for r in rows))
    assert _convert(path, tmp_path / "a")["rows"] == 20
    with_header = tmp_path / "header.csv"
    with_header.write_text(criteo_sample.read_text().split("\n", 1)[0] + "\n" + path.read_text())
    assert _convert(with_header, tmp_path / "b")["rows"] == 20
    a = pq.read_table(tmp_path / "a" / "part-00000.parquet")
    b = pq.read_table(tmp_path / "b" / "part-00000.parquet")
    assert a.equals(b)


@pytest.mark.parametrize(
    "kind,message",
    [
        ("comma-separated .txt", r"no tabs but 40 comma-separated fields: a CSV file\? pass --format csv"),
        ("parquet", r"is a Parquet file, not Criteo text: `tpurec data convert` converts Parquet through a column"),
        ("latin-1", r":1: not UTF-8 text"),
        ("not gzip", r"cannot read .*a truncated or non-gzip \.gz\?"),
    ],
)
def test_wrong_kind_of_input_is_named_with_the_fix(criteo_sample, tmp_path, kind, message):
    rows = _rows(criteo_sample, 5)
    if kind == "comma-separated .txt":
        path = tmp_path / "day.txt"
        path.write_text("".join(",".join(r) + "\n" for r in rows))
    elif kind == "parquet":
        _convert(criteo_sample, tmp_path / "done")
        path = tmp_path / "done" / "part-00000.parquet"
    elif kind == "latin-1":
        path = tmp_path / "day_0"
        path.write_bytes("\t".join(rows[0]).encode() + b"\xe9\n")
    else:
        path = tmp_path / "day_0.gz"
        path.write_text("\t".join(rows[0]) + "\n")
    with pytest.raises(DataError, match=message):
        _convert(path, tmp_path / "out")


def test_converted_directory_opens_in_pyarrow_and_pandas(criteo_sample, tmp_path):
    import pandas as pd

    out = tmp_path / "ds"
    _convert(criteo_sample, out)
    assert (out / "_dataset.json").exists() and not (out / "dataset.json").exists()
    assert pq.read_table(out).num_rows == 200
    assert len(pd.read_parquet(out)) == 200
    assert dataset_metadata(out)["rows"] == 200


def test_a_dataset_written_before_the_rename_still_reads(criteo_sample, tmp_path):
    out = tmp_path / "old"
    _convert(criteo_sample, out)
    (out / "_dataset.json").rename(out / "dataset.json")
    assert dataset_metadata(out)["rows"] == 200
    assert json.loads((out / "dataset.json").read_text())["files"] == ["part-00000.parquet"]


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("bad_line", [1, 6])
def test_unlabelled_kaggle_test_file_is_one_line_and_exit_2(criteo_sample, tmp_path, gz, bad_line):
    """Kaggle's test.txt has no label column (39 fields): one line naming file and line, exit 2, and
    the process ends cleanly. pyarrow's reader state, left to the interpreter's exit, aborted about
    half of such runs (exit 134 after the line), so each case runs 4 times."""
    import gzip
    import subprocess
    import sys

    rows = ["\t".join(r) for r in _rows(criteo_sample, bad_line - 1)] + [
        "\t".join(r[1:]) for r in _rows(criteo_sample, 3)
    ]
    text = "".join(line + "\n" for line in rows)
    path = tmp_path / ("test.txt.gz" if gz else "test.txt")
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    for _ in range(4):
        p = subprocess.run(
            [sys.executable, "-m", "tpurec.cli", "data", "convert", str(path), "--out", str(tmp_path / "o")],
            capture_output=True,
            text=True,
        )
        assert p.returncode == 2, p.stderr
        assert p.stderr.startswith(f"tpurec data: error: malformed line {path}:{bad_line}: expected 40 columns, got 39")
        assert p.stderr.count("\n") == 1 and "terminate" not in p.stderr


def test_a_script_that_catches_the_error_exits_cleanly(criteo_sample, tmp_path):
    """The library path of the test above: a program that catches DataError and ends normally."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    rows = ["\t".join(r) for r in _rows(criteo_sample, 5)] + ["\t".join(_rows(criteo_sample, 1)[0][1:])]
    (tmp_path / "day.txt").write_text("".join(line + "\n" for line in rows))
    script = (
        "from tpurec.data.convert import ConvertOptions, convert\n"
        "from tpurec.data.schema import DataError, criteo_schema\n"
        "try:\n"
        "    convert(['day.txt'], 'o', ConvertOptions(criteo_schema()), show_progress=False)\n"
        "except DataError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))  # this checkout's tpurec
    for _ in range(4):
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
        assert p.returncode == 0 and "terminate" not in p.stderr, p.stderr
        assert p.stdout.startswith("malformed line day.txt:6: expected 40 columns, got 39")
