"""Fault injection, data side (issue #16): every bad input is refused in one line naming the file
and where in it, never clamped, wrapped, hung on or crashed on.

Table-driven by category: bad values in Parquet files other tools wrote, corruption of files tpurec
wrote (flipped bytes, with and without page checksums), bad inputs to `data convert`, and
concurrent runs. Cases already held by tests/data (a truncated Parquet file, a string dense column,
a missing column, nulls, an id equal to the table size, a non-gzip `.gz` read as a library) are not
repeated here. Library cases call the reader; CLI cases call `tpurec.cli.main(argv)` in-process,
and a few run the real command to check the exit code and stderr a user sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.reliability.racers import WAIT, race
from tpurec.data.reader import ParquetReader
from tpurec.data.schema import DataError, dataset_metadata

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 30  # any refusal here takes well under a second of work; this only catches a hang
ROW_GROUP = 1000


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """3,000 dlrm-tiny rows written by tpurec (checksummed pages), as a pyarrow Table."""
    from tpurec.data.synth import synthesize

    out = tmp_path_factory.mktemp("good")
    synthesize(3000, str(out), seed=5, row_group_size=ROW_GROUP, show_progress=False)
    return pq.read_table(out / "part-00000.parquet")


def _write(t: pa.Table, path: Path, **columns) -> Path:
    """``t`` with some columns replaced (values or whole arrays), written as another tool would:
    pyarrow defaults, no page checksums; the tpurec footer metadata is kept."""
    for name, values in columns.items():
        arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values)
        t = t.set_column(t.schema.get_field_index(name), pa.field(name, arr.type), arr)
    pq.write_table(t, path, row_group_size=ROW_GROUP)
    return path


def _with(t: pa.Table, name: str, row: int, value, dtype=None):
    col = t.column(name).to_numpy().astype(dtype or t.schema.field(name).type.to_pandas_dtype())
    col[row] = value
    return col


def _read_all(path) -> None:
    for _ in ParquetReader(path, 256, prefetch=0):
        pass


def _refused(fn, *, exc=DataError, match: str) -> str:
    t0 = time.monotonic()
    with pytest.raises(exc) as e:
        fn()
    assert time.monotonic() - t0 < BOUND_S
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    import re

    assert re.search(match, msg), msg
    return msg


# ----- bad values in files other tools wrote --------------------------------------------------------
# (case id, columns to replace: name -> (row, value[, dtype]), message; row 1500 = row group 1, row 500)
BAD_VALUES = [
    ("label 5", {"label": (1500, 5)}, r"row group 1: column 'label': row 500: label 5, expected 0 or 1"),
    ("label -3", {"label": (1500, -3)}, r"row group 1: column 'label': row 500: label -3, expected 0 or 1"),
    ("dense nan", {"I2": (1500, np.nan)}, r"row group 1: column 'I2': row 500: value nan, dense values must be finite"),
    ("dense inf", {"I7": (20, np.inf)}, r"row group 0: column 'I7': row 20: value inf, dense values must be finite"),
    ("dense -inf", {"I13": (2999, -np.inf)}, r"row group 2: column 'I13': row 999: value -inf"),
    (
        "id 4.6e18",  # what a damaged dictionary page decoded to
        {"C7": (1500, 4611686018427396838)},
        r"row group 1: column 'C7': id 4611686018427396838 out of range \[0, \d+\) at row 500 \(the table has",
    ),
    ("negative id", {"C3": (2100, -1)}, r"row group 2: column 'C3': id -1 out of range \[0, \d+\) at row 100"),
    ("label as float", {"label": (0, 0, np.float64)}, r"row group 0: column 'label' has type double, expected int"),
    ("id as float", {"C2": (0, 1, np.float64)}, r"row group 0: column 'C2' has type double, expected int"),
]


@pytest.mark.parametrize("case,columns,message", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_values_are_refused_naming_file_row_group_column(table, tmp_path, case, columns, message):
    arrays = {name: _with(table, name, *spec) for name, spec in columns.items()}
    _write(table, tmp_path / "foreign.parquet", **arrays)
    _refused(lambda: _read_all(tmp_path), match=r"foreign\.parquet: " + message)


def test_a_multi_hot_id_is_located_by_its_row(tmp_path):
    from tpurec.data.schema import DataSchema, SparseFeature

    schema = DataSchema(dense=["I1"], sparse=[SparseFeature("C1", 10, multi_hot=True)])
    ids = [[1, 2], [3], [4, 5, 6], [7, 10], [8]]  # row 3 holds 10, outside the 10-row table
    t = pa.Table.from_arrays(
        [pa.array([0, 1, 0, 1, 0], pa.int8()), pa.array([0.5] * 5, pa.float32()), pa.array(ids, pa.list_(pa.int64()))],
        schema=schema.arrow_schema(),
    )
    pq.write_table(t, tmp_path / "mh.parquet")
    _refused(
        lambda: _read_all(tmp_path),
        match=r"mh\.parquet: row group 0: column 'C1': id 10 out of range \[0, 10\) at row 3",
    )


# ----- metadata that disagrees with the data ----------------------------------------------------------
def _dataset_with(table, tmp_path, edit) -> Path:
    from tpurec.data.schema import read_file_schema, write_dataset_json

    d = tmp_path / "ds"
    d.mkdir()
    pq.write_table(table, d / "part-00000.parquet", row_group_size=ROW_GROUP)
    write_dataset_json(d, read_file_schema(str(d / "part-00000.parquet")), rows=table.num_rows)
    doc = json.loads((d / "_dataset.json").read_text())
    text = edit(doc)
    (d / "_dataset.json").write_text(text if isinstance(text, str) else json.dumps(doc))
    return d


def _resize(doc, feature, size):
    next(f for f in doc["sparse"] if f["name"] == feature)["num_embeddings"] = size
    doc["table_sizes"][feature] = size


METADATA = [
    (
        "_dataset.json smaller than the data's tables",
        lambda doc: _resize(doc, "C4", 2),
        r"_dataset\.json: feature 'C4': table size 2, but .*part-00000\.parquet was written for \d+",
    ),
    (
        "table_sizes disagrees with sparse",
        lambda doc: doc["table_sizes"].update(C9=7),
        r"_dataset\.json: feature 'C9': table_sizes says 7, its sparse list says 3",
    ),
    ("truncated _dataset.json", lambda doc: json.dumps(doc)[:200], r"_dataset\.json: not JSON"),
    (
        "table size 0",
        lambda doc: _resize(doc, "C1", 0),
        r"_dataset\.json: feature 'C1': num_embeddings 0 is not a table size",
    ),
    (
        "table size not a number",
        lambda doc: _resize(doc, "C1", "big"),
        r"_dataset\.json: feature 'C1': num_embeddings 'big' is not a table size",
    ),
]


@pytest.mark.parametrize("case,edit,message", METADATA, ids=[c[0] for c in METADATA])
def test_dataset_json_disagreeing_with_the_files_is_one_line(table, tmp_path, case, edit, message):
    d = _dataset_with(table, tmp_path, edit)
    _refused(lambda: dataset_metadata(d), match=message)


def test_table_sizes_other_than_the_files_are_named_by_feature(table, tmp_path):
    _write(table, tmp_path / "p.parquet")
    sizes = ParquetReader(tmp_path, 10).table_sizes
    wrong = list(sizes)
    wrong[5] = sizes[5] // 2
    _refused(
        lambda: ParquetReader(tmp_path, 10, table_sizes=wrong),
        exc=ValueError,
        match=rf"feature 'C6': the files' ids are already hashed \(mod_reserve0\) into {sizes[5]} rows, not {wrong[5]}",
    )


# ----- corruption ----------------------------------------------------------------------------------
def _flip_near_chunk_end(path: Path, row_group: int, column: str, back: int, bit: int) -> None:
    """Flip one bit ``back`` bytes before the end of a column chunk: inside its last data page."""
    meta = pq.read_metadata(path)
    chunk = meta.row_group(row_group).column(
        [meta.schema.column(i).path for i in range(meta.num_columns)].index(column)
    )
    start = chunk.dictionary_page_offset if chunk.dictionary_page_offset is not None else chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + chunk.total_compressed_size - back] ^= bit
    path.write_bytes(bytes(data))


def _flip_dictionary_value(path: Path, row_group: int, column: str, first_value: int) -> None:
    """Set bit 62 of the first dictionary entry of a column chunk: the id becomes ~4.6e18, as a
    damaged dictionary page decoded in the bug report."""
    meta = pq.read_metadata(path)
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    chunk = meta.row_group(row_group).column(names.index(column))
    assert chunk.dictionary_page_offset is not None and chunk.compression == "UNCOMPRESSED"
    data = bytearray(path.read_bytes())
    start = chunk.dictionary_page_offset
    at = data.index(int(first_value).to_bytes(8, "little", signed=True), start, start + chunk.total_compressed_size)
    data[at + 7] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("checksums", [True, False], ids=["checksummed (tpurec)", "no checksums (older files)"])
def test_a_damaged_dictionary_page_is_named_never_decoded_into_the_model(table, tmp_path, checksums):
    path = tmp_path / "part-00000.parquet"
    pq.write_table(table, path, row_group_size=ROW_GROUP, compression="none", write_page_checksum=checksums)
    first = table.column("C7").to_numpy()[ROW_GROUP]
    _flip_dictionary_value(path, 1, "C7", first)
    if checksums:
        match = r"part-00000\.parquet: row group 1: column 'C7': page checksum mismatch: the file is damaged"
    else:  # what only the decoded-id check can catch (the footer's min/max are intact)
        match = r"part-00000\.parquet: row group 1: column 'C7': id 46\d{17} out of range \[0, \d+\) at row \d+"
    _refused(lambda: _read_all(tmp_path), match=match)


def test_a_flipped_byte_in_a_dense_data_page_is_a_checksum_error(table, tmp_path):
    path = tmp_path / "part-00000.parquet"
    pq.write_table(table, path, row_group_size=ROW_GROUP, compression="snappy", write_page_checksum=True)
    _flip_near_chunk_end(path, 2, "I5", back=10, bit=0x01)
    _refused(lambda: _read_all(tmp_path), match=r"row group 2: column 'I5': page checksum mismatch")


def test_files_without_checksums_still_read(table, tmp_path):
    """Datasets written before checksums (pyarrow's default: none) read as before, row for row."""
    pq.write_table(table, tmp_path / "old.parquet", row_group_size=ROW_GROUP)
    labels = np.concatenate([b.labels.numpy() for b in ParquetReader(tmp_path, 512)])
    np.testing.assert_array_equal(labels, table.column("label").to_numpy().astype(np.float32))


@pytest.mark.parametrize("writer", ["convert", "synth"])
def test_tpurec_writes_page_checksums(tmp_path, criteo_sample, writer):
    """tpurec's writers store a CRC per page: one flipped bit in a dense page of what they wrote
    is named (without checksums it would decode as another float, unseen)."""
    from tpurec.data.convert import ConvertOptions, convert
    from tpurec.data.schema import criteo_schema
    from tpurec.data.synth import synthesize

    if writer == "convert":
        opts = ConvertOptions(criteo_schema(), compression="none")
        convert([str(criteo_sample)], str(tmp_path), opts, show_progress=False)
    else:
        synthesize(2000, str(tmp_path), row_group_size=ROW_GROUP, show_progress=False)
    path = tmp_path / "part-00000.parquet"
    _flip_near_chunk_end(path, 0, "I1", back=3, bit=0x10)
    _refused(lambda: _read_all(tmp_path), match=r"row group 0: column 'I1': page checksum mismatch")


# ----- `data convert` inputs (in-process main(argv), plus one real process) ----------------------------
def _gz_truncated(sample: Path, d: Path) -> Path:
    import gzip

    z = gzip.compress(sample.read_bytes())
    (d / "day.csv.gz").write_bytes(z[: len(z) // 2])
    return d / "day.csv.gz"


def _latin1_header(sample: Path, d: Path) -> Path:
    head, rest = sample.read_text().split("\n", 1)
    (d / "h.csv").write_bytes(head.replace("I1", "I\xe91").encode("latin-1") + b"\n" + rest.encode())
    return d / "h.csv"


def _latin1_field(sample: Path, d: Path) -> Path:
    lines = sample.read_text().split("\n")
    fields = lines[30].split(",")
    fields[20] = "caf\xe9"
    lines[30] = ",".join(fields)
    (d / "f.csv").write_bytes("\n".join(lines).encode("latin-1"))
    return d / "f.csv"


def _not_gzip(sample: Path, d: Path) -> Path:
    (d / "day_0.gz").write_bytes(sample.read_bytes())
    return d / "day_0.gz"


CONVERT = [
    ("truncated .gz", _gz_truncated, r"day\.csv\.gz: cannot read it .*truncated or damaged; copy or download it again"),
    ("non-gzip .gz", _not_gzip, r"day_0\.gz: cannot read .*a truncated or non-gzip \.gz\?"),
    ("latin-1 header", _latin1_header, r"h\.csv:1: not UTF-8 text \(byte \d+\)"),
    ("latin-1 field", _latin1_field, r"f\.csv: column C7: not UTF-8 text"),
]


@pytest.mark.parametrize("case,make,message", CONVERT, ids=[c[0] for c in CONVERT])
def test_bad_convert_input_is_one_line_and_exit_2(criteo_sample, tmp_path, capsys, case, make, message):
    import re

    from tpurec.cli import main

    path = make(criteo_sample, tmp_path)
    t0 = time.monotonic()
    rc = main(["data", "convert", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    assert time.monotonic() - t0 < BOUND_S
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("tpurec data: error: "), err
    assert re.search(message, err), err
    assert not list((tmp_path / "out").glob("*.parquet*"))  # nothing half-written left behind


def _cli(*args, env=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout
    )
    return p, time.monotonic() - t0


def test_real_process_truncated_gz_exits_2_without_traceback(criteo_sample, tmp_path):
    path = _gz_truncated(criteo_sample, tmp_path)
    p, seconds = _cli("data", "convert", path, "--out", tmp_path / "out")
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr and "terminate" not in p.stderr, p.stderr
    assert f"{path}: cannot read it" in p.stderr
    assert seconds < 120


def test_real_train_on_foreign_labels_exits_2_naming_the_file(table, tmp_path):
    """`tpurec train --data` on a file holding a label 5: exit 2, one error line naming the file,
    row group and column, and no traceback."""
    from tpurec.data.schema import read_file_schema, write_dataset_json

    d = tmp_path / "ds"
    d.mkdir()
    f = _write(table, d / "part-00000.parquet", label=_with(table, "label", 10, 5))
    write_dataset_json(d, read_file_schema(str(f)), rows=table.num_rows)
    p, _ = _cli("train", "--quiet", "--data", d, "--steps", 2, "--eval-every", 0, env={"TPUREC_CACHE": str(tmp_path)})
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and f"{f}: row group 0: column 'label': row 10: label 5, expected 0 or 1" in errors[0]


# ----- concurrency ---------------------------------------------------------------------------------
RACER = (
    """
import json
import pyarrow.parquet as pq
from tpurec.dlrm.data import ensure_synth
import torchmetrics  # what synthesize loads last (for oracle_auc): imported before the start line
"""
    + WAIT
    + """
out = ensure_synth("dlrm-tiny", int(sys.argv[3]), 7, say=lambda m: None)
labels = float(pq.read_table(out, columns=["label"]).column("label").to_numpy().sum())  # every file whole
print(json.dumps({"dir": str(out), "labels": labels}))
"""
)


def test_two_fresh_runs_racing_on_the_synthetic_cache_both_get_the_whole_dataset(tmp_path):
    """Two real processes make the same cached dataset at the same moment: both succeed, read
    every row, and what is left in the cache is one complete dataset (no temporary directories)."""
    from tpurec.data.synth import synthesize

    rows = 20_000  # ~0.2 s of writing: before the fix, 3 runs of 3 failed (a part renamed away)
    procs = race(RACER, [rows], tmp_path, env={"TPUREC_CACHE": str(tmp_path / "cache")})
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    want = tmp_path / "reference"
    synthesize(rows, str(want), seed=7, row_group_size=16384, show_progress=False)
    want_labels = float(pq.read_table(want, columns=["label"]).column("label").to_numpy().sum())
    assert [r["labels"] for r in results] == [want_labels, want_labels]
    cache = Path(results[0]["dir"])
    assert sorted(os.listdir(cache.parent)) == [cache.name]  # no temporary directory left over
    assert pq.read_table(cache).equals(pq.read_table(want))


@pytest.mark.slow
def test_two_fresh_tpurec_train_runs_racing_on_the_cache_both_finish(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), TPUREC_CACHE=str(tmp_path))
    args = ["train", "--quiet", "--synth-rows", "30000", "--steps", "3", "--eval-every", "0", "--seed", "11"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tpurec.cli", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["steps"] == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_partial_cache_entry_left_by_an_interrupted_run_is_replaced(tmp_path, monkeypatch):
    """A cache directory without _dataset.json (written in place and interrupted, as tpurec did
    before 2026-12) is replaced whole by the complete dataset, not mixed with it."""
    from tpurec.dlrm.data import ensure_synth, synth_dir

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path))
    partial = synth_dir("dlrm-tiny", 3000, 2)
    partial.mkdir()
    (partial / "part-00007.parquet").write_bytes(b"PAR1 half-written")
    out = ensure_synth("dlrm-tiny", 3000, 2, say=lambda m: None)
    assert out == partial and sorted(p.name for p in out.iterdir()) == ["_dataset.json", "part-00000.parquet"]
    assert pq.read_table(out).num_rows == 3000
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
