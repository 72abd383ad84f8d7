"""Data mistakes that used to pass in silence (#61 item 5): a second label-named column fed to the model
as a feature, a damaged ``*.parquet`` skipped as "not Parquet", uint64 ids near 2^64 hashed as negative
numbers."""

from __future__ import annotations

import json

import pytest

from tpurec import cli
from tpurec.data.mapped import open_source
from tpurec.data.mapping import ColumnSpec
from tpurec.data.reader import ParquetReader


def _two_labels(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"label": [0, 1, 1, 0], "clicked": [0, 1, 1, 0], "x": [0.5, 1.5, 2.5, 3.5], "c": [3, 4, 5, 6]})
    pq.write_table(table, path)
    return path


def test_another_label_named_column_is_left_out_of_the_features_and_named(tmp_path, capsys):
    src = open_source(_two_labels(tmp_path / "t.parquet"), None)
    m = src.mapping
    assert (m.label, m.dense, [f.name for f in m.sparse]) == ("label", ["x"], ["c"])
    assert m.skipped == ("clicked",) and m.label_like == ("clicked",)
    note = (
        "label 'label' chosen; also label-named and left out of the features: clicked "
        "(name one with --label, or as a feature with --dense/--sparse)"
    )
    assert src.metadata()["mapping_label_note"] == note
    assert cli.main(["data", "inspect", str(tmp_path / "t.parquet"), "--mapping"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ["# left out: clicked", f"# {note}"]


def test_a_label_named_column_given_as_a_feature_is_a_feature(tmp_path):
    m = open_source(_two_labels(tmp_path / "t.parquet"), ColumnSpec(dense="x,clicked")).mapping
    assert (m.label, m.dense, [f.name for f in m.sparse], m.label_like) == ("label", ["x", "clicked"], ["c"], ())


def test_uint64_ids_near_2_64_are_reduced_as_unsigned_numbers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    big = [2**64 - 1, 2**63, 2**63 + 7, 12]
    pq.write_table(pa.table({"label": [0, 1, 0, 1], "u": pa.array(big, pa.uint64())}), tmp_path / "u.parquet")
    src = open_source(tmp_path / "u.parquet", ColumnSpec(sparse="u:1000"))
    (batch,) = list(ParquetReader(None, 4, source=src, prefetch=0))
    # 2^64 - 1 = 18446744073709551615 -> 615 (read as -1 it was 999); 2^63 -> 808, 2^63 + 7 -> 815
    assert batch.sparse_features.to_dict()["u"].values().tolist() == [615, 808, 815, 12]


def test_a_truncated_parquet_file_in_a_directory_is_an_error_naming_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tpurec.data.schema import DataError

    table = pa.table({"label": [0, 1] * 50, "x": [0.5] * 100})
    pq.write_table(table, tmp_path / "part-0.parquet")
    blob = (tmp_path / "part-0.parquet").read_bytes()
    (tmp_path / "part-1.parquet").write_bytes(blob[: len(blob) // 2])  # cut short
    (tmp_path / "README").write_text("not Parquet, and not named so: skipped")
    (tmp_path / "_SUCCESS").write_bytes(b"")
    with pytest.raises(DataError, match=r"part-1\.parquet: not a readable Parquet file") as e:
        open_source(tmp_path, None)
    assert str(e.value).startswith(f"{tmp_path / 'part-1.parquet'}: not a readable Parquet file (")
    (tmp_path / "part-1.parquet").unlink()
    assert open_source(tmp_path, None).rows == 100  # the README and _SUCCESS left out by name


def test_uint64_ids_near_2_64_in_tpurecs_own_data_are_refused_as_themselves(tmp_path, capsys):
    """tpurec's own data (ids already in their table's rows, not hashed at read time) with a uint64
    column: 2^64 - 1 is refused by its own value, naming the column and the table's rows. Before: it
    was cast to int64 first and refused as 'id -1', a number the file does not hold."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tpurec.data.schema import DataError
    from tpurec.data.synth import synthesize

    d = tmp_path / "d"
    synthesize(300, str(d), seed=0, show_progress=False)
    [part] = d.glob("*.parquet")
    t = pq.read_table(part)
    ids = t.column("C1").to_numpy().astype(np.uint64)
    ids[5] = 2**64 - 1
    t = t.set_column(t.schema.get_field_index("C1"), pa.field("C1", pa.uint64()), pa.array(ids))
    pq.write_table(t.replace_schema_metadata(pq.read_schema(part).metadata), part)
    says = (
        f"{part}: row group 0: column 'C1': id 18446744073709551615 out of range [0, 1000) at row 5 "
        "(the table has 1000 rows: were the files written for other table sizes?)"
    )
    with pytest.raises(DataError) as e:
        list(ParquetReader(str(d), 300, shuffle=False, prefetch=0))
    assert str(e.value) == says
    assert cli.main(["data", "inspect", str(d)]) == 2
    assert capsys.readouterr().err.strip() == f"tpurec data: error: {says}"


def test_files_a_mapped_dataset_skips_are_named_once(tmp_path, capsys):
    """pyarrow's discovery skips a file that is not Parquet: a count and an example, on stderr (the
    report on stdout stays clean); a Parquet file named otherwise (no suffix) is read, `_SUCCESS` unsaid."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"label": [0, 1] * 50, "x": [0.5] * 100, "c": [3] * 100}), tmp_path / "part-0.parquet")
    (tmp_path / "part-1").write_bytes((tmp_path / "part-0.parquet").read_bytes())
    (tmp_path / "README").write_text("about the data")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("not Parquet either")
    (tmp_path / "_SUCCESS").write_bytes(b"")
    assert open_source(tmp_path, None).rows == 200
    assert cli.main(["data", "inspect", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["rows"] == 200
    assert err.splitlines() == [f"notice: {tmp_path}: 2 file(s) not read, not Parquet (e.g. README)"]


def test_files_not_named_parquet_in_tpurecs_own_data_are_named_once_by_train(tmp_path, capsys, monkeypatch):
    """Before: a part renamed `.snappy` (a third of the data) and a README were left out without a word."""
    import shutil

    from tests.reliability.inproc import run_cli
    from tpurec.data.synth import synthesize

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "d"
    synthesize(300, str(d), seed=0, show_progress=False)
    [part] = d.glob("*.parquet")
    shutil.copy(part, d / "part-00001.snappy")
    (d / "notes.txt").write_text("how the data was made")
    (d / "_SUCCESS").write_bytes(b"")
    argv = [
        "train",
        "--quiet",
        "--data",
        d,
        "--steps",
        1,
        "--batch-size",
        64,
        "--eval-every",
        0,
        "--curves-out",
        "none",
    ]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    says = (
        f"notice: {d}: 2 file(s) not read, not named *.parquet (tpurec's data is read from those only) (e.g. notes.txt)"
    )
    assert [line for line in err.splitlines() if "not read" in line] == [says]
