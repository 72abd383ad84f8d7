"""Any Parquet (#39): a dataset pandas wrote with the user's own column names (13 float dense, 20 int64 and
5 string categoricals, a list<int64> history), as one file, a directory of files and a Hive-partitioned
dataset, read through a column mapping given as flags, as a file, or inferred."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.user_parquet import DENSE, FLAGS, INTS, ROWS, STRINGS, user_frame
from tpurec import cli
from tpurec.data.mapped import MappedSource, open_source
from tpurec.data.mapping import ColumnSpec, MappingError
from tpurec.data.reader import ParquetReader
from tpurec.data.schema import DataError
from tpurec.data.string_ids import reference, string_hash


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """{"file", "dir", "hive"}: the same rows as one file, three files, and day=N partitions."""
    root = tmp_path_factory.mktemp("anyparquet")
    df = user_frame()
    flat = df.drop(columns=["day"])
    flat.to_parquet(root / "one.parquet", row_group_size=1000)
    (root / "dir").mkdir()
    for k in range(3):
        flat.iloc[k * 1000 : (k + 1) * 1000].to_parquet(root / "dir" / f"part-{k}.parquet")
    df.to_parquet(root / "hive", partition_cols=["day"])
    return {"file": root / "one.parquet", "dir": root / "dir", "hive": root / "hive", "frame": df}


@pytest.mark.parametrize("layout", ["file", "dir", "hive"])
def test_the_inferred_mapping_finds_label_dense_and_sparse(layouts, layout):
    src = open_source(layouts[layout], None)
    assert isinstance(src, MappedSource)
    m = src.mapping
    assert m.label == "clicked" and m.dense == DENSE
    assert [f.name for f in m.sparse] == INTS + STRINGS + ["history"]
    assert {f.kind for f in m.sparse} == {"int", "string", "int_list"}
    assert m.skipped == (("day",) if layout == "hive" else ())
    assert src.rows == ROWS


@pytest.mark.parametrize("layout", ["file", "dir", "hive"])
def test_every_row_is_read_with_nulls_and_empty_lists_as_no_ids(layouts, layout):
    src = open_source(layouts[layout], ColumnSpec(*FLAGS[1::2]))
    reader = ParquetReader(None, 4096, source=src, prefetch=0)
    (batch,) = list(reader)
    assert batch.labels.shape == (ROWS,) and batch.dense_features.shape == (ROWS, 13)
    kjt = batch.sparse_features.to_dict()
    df = layouts["frame"]
    if layout != "hive":  # partitions reorder the rows
        assert kjt["history"].lengths()[13:15].tolist() == [0, 0]  # empty list, null list
        assert kjt["id_3"].lengths()[10] == 0 and kjt["name_0"].lengths()[11] == 0
        assert batch.dense_features[12, 0] == 0.0  # null dense -> 0.0
        ids = kjt["id_0"].values().numpy()
        assert np.array_equal(ids, df["id_0"].to_numpy() % 700)  # ids mod ROWS
    lengths = {k: int(v.lengths().sum()) for k, v in kjt.items()}
    assert lengths["history"] == sum(len(h) for h in df["history"] if h is not None)
    assert lengths["id_3"] == ROWS - 1 and lengths["name_0"] == ROWS - 1
    for name, size in [("id_5", 700), ("name_2", 900), ("history", 1200)]:
        v = kjt[name].values().numpy()
        assert v.min() >= 0 and v.max() < size


def test_string_ids_are_splitmix64_of_fnv1a64():
    import pyarrow as pa

    assert reference("user-1") == 0xF16D8D440FBB25D5  # fixed forever: a trained model's rows depend on it
    words = ["", "a", "user-1", "héllo", "x" * 300, "user-1", "ab"]
    for arr in (
        pa.array(words),
        pa.array(["z", *words], pa.large_string()).slice(1),
        pa.array(words).cast(pa.binary()),
    ):
        assert string_hash(arr).tolist() == [reference(w) for w in words]
    assert len(string_hash(pa.array([], pa.string()))) == 0


def test_ids_already_in_the_table_are_kept_as_they_are(layouts):
    src = open_source(layouts["file"], ColumnSpec(sparse="id_*:5000,name_*:64,history:10000", dense="num_*"))
    (batch,) = list(ParquetReader(None, ROWS, source=src, prefetch=0))
    assert np.array_equal(batch.sparse_features["id_1"].values().numpy(), layouts["frame"]["id_1"].to_numpy())


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_the_printed_mapping_is_a_columns_file(layouts, tmp_path, suffix, capsys):
    assert cli.main(["data", "inspect", str(layouts["hive"]), "--mapping", *FLAGS]) == 0
    text = capsys.readouterr().out
    f = tmp_path / f"m{suffix}"
    if suffix == ".json":
        import yaml

        f.write_text(json.dumps(yaml.safe_load(text)))
    else:
        f.write_text(text)
    again = open_source(layouts["hive"], ColumnSpec(file=str(f))).mapping
    given = open_source(layouts["hive"], ColumnSpec(*FLAGS[1::2])).mapping
    assert again.to_doc() == given.to_doc() and again.sparse[0].rows == 700


def test_inspect_reports_and_prints_the_inferred_mapping(layouts, capsys):
    assert cli.main(["data", "inspect", str(layouts["hive"])]) == 0
    out = capsys.readouterr().out
    assert "3,000 rows in 3 file(s)" in out and "label 'clicked'" in out
    assert "history    int list" in out and "name_0     string" in out
    assert "# inferred: label, dense, sparse" in out and '"history": null  # int_list' in out
    assert "# left out: day" in out


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--dense", "num_*,nope"], "--dense: unknown column 'nope'"),
        (["--dense", "name_0"], "--dense: column 'name_0' holds strings, not numbers; give it as --sparse"),
        (["--label", "history"], "--label history: the column holds lists of ints"),
        (["--sparse", "num_1"], "--sparse: column 'num_1' holds double, not integer or string ids"),
        (["--sparse", "zz_*"], "--sparse 'zz_*' matches no column"),
        (["--sparse", "id_1:lots"], "ROWS 'lots' is not a whole number"),
        (["--sparse", "id_1,id_1"], "column 'id_1' is mapped twice"),
    ],
)
def test_a_wrong_mapping_is_one_line_naming_the_column(layouts, capsys, flags, message):
    assert cli.main(["data", "inspect", str(layouts["dir"]), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("flags,column", [(["--dense", "num_*,nope"], "'nope'"), (["--dense", "name_3"], "'name_3'")])
def test_train_refuses_a_wrong_mapping_before_starting(layouts, capsys, flags, column):
    assert cli.main(["train", "--data", str(layouts["hive"]), "--steps", "3", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and column in err, err


def test_the_dlrm_takes_the_datas_shape():
    from tpurec.dlrm.configs import get_config
    from tpurec.dlrm.model import build_model

    names = [f"c{i}" for i in range(28)]
    model = build_model(
        get_config("dlrm-tiny"), table_sizes=[10 + i for i in range(28)], feature_names=names, num_dense=5
    )
    configs = model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    assert [c.feature_names for c in configs] == [[n] for n in names]
    assert [c.num_embeddings for c in configs] == [10 + i for i in range(28)]
    assert [c.name for c in configs[25:]] == ["t_C26", "t_c26", "t_c27"]  # past the table set's 26
    assert model.model.dense_arch.model._mlp[0]._linear.in_features == 5


@pytest.mark.slow
def test_data_of_another_shape_trains_a_dlrm_of_its_shape(tmp_path, capsys):
    """5 dense and 7 sparse columns: the built-in DLRM takes 5 dense features and has 7 tables."""
    import pandas as pd

    rng = np.random.default_rng(1)
    d: dict = {"label": rng.integers(0, 2, 1500), **{f"f{i}": rng.random(1500) for i in range(5)}}
    d |= {f"c{i}": rng.integers(0, 1000, 1500) for i in range(7)}
    pd.DataFrame(d).to_parquet(tmp_path / "small.parquet")
    err = _train(capsys, tmp_path / "small.parquet", "--sparse", "c*:1000", cache=tmp_path)
    assert "label 'label', 5 dense, 7 sparse (7 int)" in err


def test_a_feature_past_the_models_tables_needs_its_rows(layouts, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"label": [0, 1] * 10, "x": [1.0] * 20, **{f"c{i}": list(range(20)) for i in range(27)}}),
        tmp_path / "w.parquet",
    )
    assert cli.main(["train", "--data", str(tmp_path / "w.parquet"), "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sparse column 'c26' (number 27) has no table size and the model's table set has 26 tables" in err, err


def test_a_bad_columns_file_is_one_line(layouts, tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("label: [unclosed\n")
    with pytest.raises(MappingError, match=r"--columns .*m.yaml: not valid YAML"):
        open_source(layouts["dir"], ColumnSpec(file=str(bad)))
    bad.write_text("lable: clicked\n")
    with pytest.raises(MappingError, match="expected a mapping with label, dense and sparse"):
        open_source(layouts["dir"], ColumnSpec(file=str(bad)))


def test_tpurecs_own_data_keeps_the_fast_path(synth_dir):
    assert open_source(synth_dir, None) is None
    assert isinstance(open_source(synth_dir, ColumnSpec(label="label")), MappedSource)


def _train(capsys, data, *flags, cache) -> str:
    """Three steps of `tpurec train` on `data` in this process: its stderr."""
    from tests.dlrm.helpers import train_here

    result, _, err = train_here(
        capsys, "--data", data, "--steps", 3, "--batch-size", 256, "--device", "cpu", *flags, cache=cache
    )
    assert result is not None and result["steps"] == 3, err[-2000:]
    return err


def test_trains_on_a_hive_dataset_with_flags(layouts, tmp_path, capsys):
    err = _train(capsys, layouts["hive"], *FLAGS, cache=tmp_path)
    assert "read through a column mapping: label 'clicked', 13 dense, 26 sparse" in err


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["file", "dir"])
def test_trains_with_flags(layouts, tmp_path, layout, capsys):
    _train(capsys, layouts[layout], *FLAGS, cache=tmp_path)


@pytest.mark.parametrize(
    "layout",
    # every layout slow: the default suite trains the Hive set with flags, and reads each layout inferred
    [pytest.param(x, marks=pytest.mark.slow) for x in ("file", "dir", "hive")],
)
def test_trains_with_the_inferred_mapping(layouts, tmp_path, layout, capsys):
    err = _train(capsys, layouts[layout], cache=tmp_path)
    assert "26 sparse column(s) without :ROWS hash their ids into the dlrm-tiny table sizes" in err


def test_data_stats_reads_it(layouts, tmp_path):
    import subprocess
    import sys

    from tests.dlrm.helpers import REPO

    out = tmp_path / "limits.json"
    args = ["data", "stats", str(layouts["hive"]), "--model", "dlrm-tiny", "--topology", "v5p-8", "--quiet"]
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *args, "--out", str(out), *FLAGS],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["rows"] == ROWS and len(doc["tables"]) == 26


# 28 columns in make test-all (default suite time: 4-5 s here): 7 keeps data stats' path, and
# test_the_dlrm_takes_the_datas_shape above names the tables past the table set's 26
@pytest.mark.parametrize("sparse", [7, pytest.param(28, marks=pytest.mark.slow)])
def test_data_stats_measures_the_tables_train_builds_for_data_of_another_shape(tmp_path, sparse):
    """5 dense and 7 (or 28) sparse columns: `data stats --model` measures the tables `tpurec train`'s model
    of the data's shape has (the table set's first ones, then `t_<column>`), with the data's rows."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.dlrm.helpers import REPO
    from tpurec.dlrm.configs import get_config
    from tpurec.dlrm.model import build_model

    rng = np.random.default_rng(3)
    rows = 512
    cols = {"label": rng.integers(0, 2, rows), **{f"f{i}": rng.random(rows) for i in range(5)}}
    cols |= {f"c{i}": rng.integers(0, 100 + i, rows) for i in range(sparse)}
    pq.write_table(pa.table(cols), tmp_path / "d.parquet")
    out = tmp_path / "limits.json"
    mapping = ",".join(f"c{i}:{100 + i}" for i in range(sparse))
    args = ["data", "stats", str(tmp_path / "d.parquet"), "--model", "dlrm-tiny", "--topology", "v5p-8", "--quiet"]
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *args, "--out", str(out), "--label", "label", "--dense", "f*"]
        + ["--sparse", mapping],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    model = build_model(
        get_config("dlrm-tiny"),
        table_sizes=[100 + i for i in range(sparse)],
        feature_names=[f"c{i}" for i in range(sparse)],
        num_dense=5,
    )
    built = model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    assert sorted(doc["tables"]) == sorted(c.name for c in built)
    assert doc["rows"] == rows


def test_a_partition_column_can_be_a_feature(layouts):
    src = open_source(layouts["hive"], ColumnSpec(dense="num_*", sparse="id_*,name_*,history,day:10"))
    assert src.mapping.sparse[-1].name == "day" and src.partition_columns == ("day",)
    (batch,) = list(ParquetReader(None, ROWS, source=src, prefetch=0, table_sizes={}))
    days = batch.sparse_features["day"].values().numpy()
    assert sorted(np.unique(days).tolist()) == [1, 2, 3] and len(days) == ROWS


def test_a_file_with_a_column_of_another_type_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"label": [0, 1], "x": [1.0, 2.0], "c": [1, 2]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"label": [0, 1], "x": [1.0, 2.0], "c": ["p", "q"]}), tmp_path / "b.parquet")
    reader = ParquetReader(None, 4, source=open_source(tmp_path, None), prefetch=0, table_sizes=[10])
    with pytest.raises(
        DataError, match=r"b.parquet: row group 0: column 'c' has type string, but the dataset's is int64"
    ):
        list(reader)


def test_bool_labels_categorical_strings_and_lists_of_strings(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "target": pa.array([True, False, True]),
            "age": pa.array([30, None, 41], pa.int32()),
            "city": pa.array(["paris", "rome", None]).dictionary_encode(),
            "tags": pa.array([["a", None, "b"], None, []], pa.list_(pa.string())),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    src = open_source(tmp_path / "t.parquet", ColumnSpec(dense="age", sparse="city:1000,tags:50"))
    assert [f.kind for f in src.mapping.sparse] == ["string", "string_list"]
    (batch,) = list(ParquetReader(None, 3, source=src, prefetch=0))
    assert batch.labels.tolist() == [1.0, 0.0, 1.0] and batch.dense_features[:, 0].tolist() == [30.0, 0.0, 41.0]
    kjt = batch.sparse_features.to_dict()
    assert kjt["tags"].lengths().tolist() == [2, 0, 0]  # the null element dropped; null and empty lists: none
    assert kjt["tags"].values().tolist() == [reference("a") % 50, reference("b") % 50]
    assert kjt["city"].lengths().tolist() == [1, 1, 0]
    assert kjt["city"].values().tolist() == [reference("paris") % 1000, reference("rome") % 1000]


def test_the_label_is_inferred_whatever_its_case():
    import pyarrow as pa

    from tpurec.data.mapping import resolve

    schema = pa.schema([("f", pa.float32()), ("Click", pa.int64()), ("uid", pa.int64())])
    m = resolve(ColumnSpec(), schema)
    assert (m.label, m.dense, [f.name for f in m.sparse]) == ("Click", ["f"], ["uid"])
    assert m.inferred == ("label", "dense", "sparse")


def test_negative_integer_ids_are_taken_mod_the_table_size():
    import pyarrow as pa

    from tpurec.data.mapped import _ids
    from tpurec.data.mapping import INT

    ids = _ids(pa.array([-1, -7, 5, -8, 0], pa.int64()), INT, 4)
    assert ids.dtype == np.int64 and ids.tolist() == [3, 1, 1, 0, 0]  # Python's mod: never negative


def test_a_label_neither_0_nor_1_is_refused_naming_its_row():
    import pyarrow as pa

    from tpurec.data.mapped import _labels

    ok = _labels("f.parquet", "y", pa.chunked_array([[0.0, 1.0, 1.0]]), 0)
    assert ok.dtype == np.float32 and ok.tolist() == [0.0, 1.0, 1.0]
    for bad, shown in ((0.5, "0.5"), (2.0, "2"), (-1.0, "-1")):
        with pytest.raises(DataError, match=rf"f.parquet: column 'y': row 11: label {shown}, expected 0 or 1"):
            _labels("f.parquet", "y", pa.chunked_array([[1.0, bad, 0.0]]), 10)
