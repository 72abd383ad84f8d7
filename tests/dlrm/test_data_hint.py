"""`tpurec train --data` given what is not a converted directory: one line with the convert command."""

from __future__ import annotations

import pytest

from tpurec import cli


def _train_error(capsys, data) -> str:
    assert cli.main(["train", "--data", str(data), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_csv_file_is_named_with_its_convert_command(tmp_path, capsys):
    csv = tmp_path / "day.csv"
    csv.write_text("label,I1\n0,1\n")
    err = _train_error(capsys, csv)
    assert f"tpurec data convert {csv} --format csv --out {tmp_path / 'day_parquet'} --table-set dlrm-tiny" in err


def test_a_missing_path_says_what_to_convert_into_it(tmp_path, capsys):
    err = _train_error(capsys, tmp_path / "nope")
    assert "no such directory" in err and f"tpurec data convert INPUT... --out {tmp_path / 'nope'}" in err


def test_a_directory_of_csv_files(tmp_path, capsys):
    for i in range(2):
        (tmp_path / f"day_{i}.csv").write_text("label,I1\n0,1\n")
    err = _train_error(capsys, tmp_path)
    assert "no .parquet files (2 other file(s))" in err
    assert f"tpurec data convert {tmp_path}/*.csv --format csv --out {tmp_path}_parquet" in err


@pytest.mark.parametrize("model,table_set", [("criteo-kaggle", "criteo-kaggle"), ("mlperf-dcnv2", "mlperf-dcnv2")])
def test_the_table_set_is_the_models(tmp_path, capsys, model, table_set):
    txt = tmp_path / "day_0"
    txt.write_text("0\t1\n")
    assert cli.main(["train", "--data", str(txt), "--model", model]) == 2
    assert f"--out {tmp_path / 'day_0_parquet'} --table-set {table_set}`" in capsys.readouterr().err


def test_a_parquet_file_is_read_and_a_damaged_one_named(tmp_path, capsys):
    f = tmp_path / "part-00000.parquet"
    f.write_bytes(b"PAR1")
    assert f"{f}: not a readable Parquet file" in _train_error(capsys, f)


def test_parquet_named_otherwise_in_partitions_is_taken(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tpurec.dlrm.data_hint import data_problem

    (tmp_path / "day=1").mkdir()
    pq.write_table(pa.table({"label": [0, 1]}), tmp_path / "day=1" / "000000_0")
    assert data_problem(str(tmp_path), "dlrm-tiny") is None
