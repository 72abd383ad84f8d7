"""`tpurec data convert` of Parquet, CSV and TSV through a column mapping (#39): the output, read by
tpurec's own fast path, gives exactly the batches the mapped source gives with the same mapping."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.user_parquet import DENSE, FLAGS, INTS, ROWS, STRINGS, user_frame
from tpurec import cli
from tpurec.data.catalog import get_table_set
from tpurec.data.mapped import open_source
from tpurec.data.mapping import ColumnSpec
from tpurec.data.reader import ParquetReader
from tpurec.data.schema import CAT_MOD, DENSE_RAW, dataset_metadata
from tpurec.data.shards import split_train_eval
from tpurec.data.string_ids import reference

TEXT_FLAGS = ["--label", "clicked", "--dense", "num_*", "--sparse", "id_*:700,name_*:900"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The frame of test_any_parquet as one file, a directory, Hive partitions, CSV and TSV (no list column)."""
    root = tmp_path_factory.mktemp("convsrc")
    df = user_frame()
    flat = df.drop(columns=["day"])
    flat.to_parquet(root / "one.parquet", row_group_size=700)
    (root / "dir").mkdir()
    for k in range(3):
        flat.iloc[k * 1000 : (k + 1) * 1000].to_parquet(root / "dir" / f"part-{k}.parquet")
    df.to_parquet(root / "hive", partition_cols=["day"])
    flat.drop(columns=["history"]).to_csv(root / "one.csv", index=False)
    flat.drop(columns=["history"]).to_csv(root / "one.tsv", index=False, sep="\t")
    return {"file": root / "one.parquet", "dir": root / "dir", "hive": root / "hive", "root": root, "frame": df}


def _convert(inputs, out, *flags) -> dict:
    args = ["data", "convert", *map(str, inputs), "--out", str(out), "--quiet", "--json", *flags]
    assert cli.main(args) == 0
    return dataset_metadata(out)


def _batches(data, source, table_sizes=None):
    """Every batch `tpurec train` would read (its split, shuffle and drop_last), and the eval batches."""
    train, evals = split_train_eval(data, 0.1, source=source)
    common = dict(source=source, table_sizes=table_sizes, prefetch=0)
    out = []
    for units, kw in ((train, dict(shuffle=True, seed=5, drop_last=True)), (evals, dict(pad_last=True))):
        out += list(ParquetReader(units, 256, shuffle_buffer=1000, **kw, **common))
    return out


def _assert_same(a, b):
    assert len(a) == len(b) > 3
    for x, y in zip(a, b):
        assert np.array_equal(x.labels.numpy(), y.labels.numpy())
        assert np.array_equal(x.dense_features.numpy(), y.dense_features.numpy())
        kx, ky = x.sparse_features.to_dict(), y.sparse_features.to_dict()
        assert list(kx) == list(ky)
        for k in kx:
            assert np.array_equal(kx[k].lengths().numpy(), ky[k].lengths().numpy()), k
            assert np.array_equal(kx[k].values().numpy(), ky[k].values().numpy()), k


@pytest.mark.parametrize("layout", ["file", "dir", "hive"])
def test_the_converted_parquet_gives_the_sources_batches(sources, tmp_path, layout):
    meta = _convert([sources[layout]], tmp_path / "out", *FLAGS)
    assert meta["rows"] == ROWS and meta["dense_transform"] == DENSE_RAW and meta["categorical"] == CAT_MOD
    assert open_source(tmp_path / "out", None) is None  # tpurec's own format: the fast path
    kinds = {f["name"]: f["multi_hot"] for f in meta["sparse"]}
    assert kinds["history"] and kinds["id_3"] and kinds["name_0"]  # lists; nulls in id_3 and name_0
    assert not kinds["id_0"] and not kinds["name_1"]
    # one output row group per source row group: the same units, so the same split and shuffle
    src = open_source(sources[layout], ColumnSpec(*FLAGS[1::2]))
    files = [pq.ParquetFile(f).metadata for f in sorted((tmp_path / "out").glob("*.parquet"))]
    got = [m.row_group(i).num_rows for m in files for i in range(m.num_row_groups)]
    assert [u.rows for u in src.units] == [n for n in got if n]
    _assert_same(_batches(None, src), _batches(tmp_path / "out", None))


def test_an_inferred_mapping_with_the_models_table_sizes(sources, tmp_path, capsys):
    """Without ROWS, `train` hashes into the model's sizes by position; `convert --table-set` does the same."""
    args = ["data", "convert", str(sources["hive"]), "--out", str(tmp_path / "o"), "--quiet"]
    assert cli.main([*args, "--table-set", "dlrm-tiny"]) == 0
    out = capsys.readouterr().out
    assert "column mapping (inferred: label, dense, sparse):" in out and '"history": null  # int_list' in out
    sizes = [t.num_embeddings for t in get_table_set("dlrm-tiny").tables]
    assert [f["num_embeddings"] for f in dataset_metadata(tmp_path / "o")["sparse"]] == sizes
    src = open_source(sources["hive"], None)
    _assert_same(_batches(None, src, table_sizes=sizes), _batches(tmp_path / "o", None))


def test_convert_needs_a_table_size_for_every_column(sources, tmp_path, capsys):
    assert cli.main(["data", "convert", str(sources["file"]), "--out", str(tmp_path / "o"), "--sparse", "id_*"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no table size for sparse column(s) 'id_0', 'id_1'" in err, err


@pytest.mark.parametrize("name", ["one.csv", "one.tsv"])
def test_csv_and_tsv_convert_to_what_the_parquet_does(sources, tmp_path, name, capsys):
    ids = ["--ids", "decimal,name_*=string"]
    meta = _convert([sources["root"] / name], tmp_path / "t", *TEXT_FLAGS, *ids)
    assert "convert: id_3, name_0 lack an id in some rows" in capsys.readouterr().err  # found while writing
    assert meta["extra"]["ids"] == {**dict.fromkeys(INTS, "decimal"), **dict.fromkeys(STRINGS, "string")}
    _convert([sources["file"]], tmp_path / "p", *TEXT_FLAGS, "--row-group-size", "65536")
    text, parquet = (pq.read_table(tmp_path / d / "part-00000.parquet") for d in ("t", "p"))
    assert text.schema.names == ["clicked", *DENSE, *INTS, *STRINGS] and text.num_rows == ROWS
    assert text.equals(parquet)
    df = sources["frame"]
    assert text.column("id_7").to_pylist() == (df["id_7"] % 700).tolist()
    assert text.column("name_2")[5].as_py() == reference(df["name_2"][5]) % 900
    assert text.column("id_3")[10].as_py() == [] and text.column("name_0")[11].as_py() == []


def test_hex_ids_in_text(tmp_path):
    (tmp_path / "h.csv").write_text("y,x,c\n1,0.5,ff\n0,,\n1,2,FFFFFFFFFFFFFFFF\n")
    _convert([tmp_path / "h.csv"], tmp_path / "o", "--label", "y", "--sparse", "c:1000", "--ids", "hex")
    t = pq.read_table(tmp_path / "o" / "part-00000.parquet")
    assert t.column("c").to_pylist() == [[255], [], [(2**64 - 1) % 1000]]
    assert t.column("x").to_pylist() == [0.5, 0.0, 2.0] and t.column("y").to_pylist() == [1, 0, 1]


@pytest.mark.parametrize(
    "case,flags,message",
    [
        ("parquet", ["--dense", "num_*,nope"], "one.parquet: --dense: unknown column 'nope'"),
        ("parquet", ["--dense", "name_0"], "one.parquet: --dense: column 'name_0' holds strings, not numbers"),
        ("parquet", ["--ids", "hex"], "--ids is for text input"),
        ("csv", ["--dense", "name_0", "--ids", "decimal"], "one.csv: --dense: column 'name_0' holds strings, not"),
        ("csv", [], "text ids are never guessed: say how they are written, --ids decimal"),
        ("csv", ["--ids", "decimal"], "one.csv:2: column 'name_0': 'user-251' is not a decimal id"),
        ("csv", ["--ids", "decimal,nam*=octal"], "'octal' is not one of decimal, hex, string"),
        ("fields", ["--ids", "decimal,name_*=string"], "malformed line {path}:4: expected 39 fields, got 3: '1,2,3'"),
        ("dense", ["--ids", "decimal,name_*=string"], "malformed line {path}:3: column 'num_4': 'inf' is not a"),
        ("label", ["--ids", "decimal,name_*=string"], "malformed line {path}:2: column 'clicked': '2' is not a label"),
    ],
)
def test_a_problem_is_one_line_naming_file_column_and_line(sources, tmp_path, capsys, case, flags, message):
    path = sources["file"] if case == "parquet" else sources["root"] / "one.csv"
    base = FLAGS if case == "parquet" else TEXT_FLAGS
    if case in ("fields", "dense", "label"):
        lines = (sources["root"] / "one.csv").read_text().splitlines()[:6]
        cells = lines[1].split(",")
        if case == "fields":
            lines[3] = "1,2,3"
        elif case == "dense":
            lines[2] = ",".join([*lines[2].split(",")[:5], "inf", *lines[2].split(",")[6:]])
        else:
            lines[1] = ",".join(["2", *cells[1:]])
        path = tmp_path / "bad.csv"
        path.write_text("\n".join(lines) + "\n")
    assert cli.main(["data", "convert", str(path), "--out", str(tmp_path / "o"), *base, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.format(path=path) in err, err
    assert not list((tmp_path / "o").glob("*.parquet*"))  # nothing left behind


def test_skip_bad_lines_drops_and_counts_them(sources, tmp_path, capsys):
    lines = (sources["root"] / "one.csv").read_text().splitlines()
    lines[3] = "1,2,3"
    (tmp_path / "b.csv").write_text("\n".join(lines) + "\n")
    args = ["data", "convert", str(tmp_path / "b.csv"), "--out", str(tmp_path / "o"), "--json", "--quiet"]
    assert cli.main([*args, *TEXT_FLAGS, "--ids", "decimal,name_*=string", "--skip-bad-lines"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == ROWS - 1 and summary["bad_lines"] == 1
    assert summary["bad_examples"][0].endswith("b.csv:4: expected 39 fields, got 3: '1,2,3'")


def test_criteo_text_with_decimal_ids(criteo_sample, tmp_path, capsys):
    """`--ids decimal` reads Criteo-shaped text's categoricals as decimal: the same ids as hex of the same values."""
    import csv

    with open(criteo_sample, newline="") as f:
        rows = list(csv.reader(f))[1:]
    (tmp_path / "dec.csv").write_text(
        "".join(",".join([*r[:14], *(str(int(v, 16)) if v else "" for v in r[14:])]) + "\n" for r in rows)
    )
    assert cli.main(["data", "convert", str(criteo_sample), "--out", str(tmp_path / "hex"), "--quiet"]) == 0
    assert "notice" not in capsys.readouterr().err  # Criteo's own hex ids: no notice
    for out, ids in (("as_hex", []), ("d", ["--ids", "decimal"])):
        assert cli.main(["data", "convert", str(tmp_path / "dec.csv"), "--out", str(tmp_path / out), *ids]) == 0
        notice = "dec.csv hold no hex letter: they were read as hex (Criteo's ids); if they are decimal numbers"
        assert (notice in capsys.readouterr().err) == (not ids)
    assert cli.main(["data", "convert", str(criteo_sample), "--out", str(tmp_path / "h2"), "--ids", "hex"]) == 0
    assert "notice" not in capsys.readouterr().err
    a, b, c = (pq.read_table(tmp_path / d / "part-00000.parquet") for d in ("hex", "d", "as_hex"))
    assert a.equals(b) and len(rows) == 200
    assert a.column("C1") != c.column("C1")  # without --ids, Criteo text is hex, as before
    assert dataset_metadata(tmp_path / "d")["extra"] == {"ids": "decimal"}


@pytest.mark.slow
def test_train_on_the_converted_data_gives_the_sources_numbers(sources, tmp_path):
    from tests.dlrm.helpers import train

    _convert([sources["hive"]], tmp_path / "conv", *FLAGS)
    runs = []
    for data, flags in ((sources["hive"], FLAGS), (tmp_path / "conv", [])):
        metrics = tmp_path / f"m{len(runs)}.jsonl"
        common = ["--steps", "4", "--batch-size", "256", "--device", "cpu", "--metrics-out", metrics]
        result, _ = train("--data", data, *common, *flags, "--curves-out", "none", cache=tmp_path)
        lines = [json.loads(x) for x in metrics.read_text().splitlines()]
        runs.append((result, [x for x in lines if "loss" in x]))
    (a, la), (b, lb) = runs
    assert [x["loss"] for x in la] == [x["loss"] for x in lb] and len(la) >= 4
    assert (a["auc"], a["ne"], a["logloss"], a["eval_rows"]) == (b["auc"], b["ne"], b["logloss"], b["eval_rows"])


def test_pyarrow_reads_the_output(sources, tmp_path):
    _convert([sources["dir"]], tmp_path / "o", *FLAGS, "--compression", "zstd")
    t = pa.dataset.dataset(tmp_path / "o", format="parquet").to_table()
    assert t.num_rows == ROWS and t.column("history").type.value_type == pa.int64()


def test_nulls_without_parquet_statistics_are_found_while_writing(tmp_path, capsys):
    t = pa.table({"y": [0, 1, 1], "x": [0.5, 1.5, None], "c": pa.array([7, None, 9], pa.int64())})
    pq.write_table(t, tmp_path / "s.parquet", write_statistics=False)
    meta = _convert([tmp_path / "s.parquet"], tmp_path / "o", "--label", "y", "--sparse", "c:5")
    assert "convert: c lack an id in some rows" in capsys.readouterr().err
    assert meta["sparse"][0]["multi_hot"] is True
    out = pq.read_table(tmp_path / "o")
    assert out.column("c").to_pylist() == [[2], [], [4]] and out.column("x").to_pylist() == [0.5, 1.5, 0.0]
