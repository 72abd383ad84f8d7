"""`tpurec data inspect` on damaged or foreign datasets (issue #29 item 8): what the reader refuses,
inspect refuses too, in one line naming the file and where (row group, column, row, or the field's
JSON path in `_dataset.json`), exit 2, no traceback.

Before: a flipped byte in a checksummed page and a label 5 were reported as if fine (exit 0), a
missing column was a KeyError traceback and a deeply nested `_dataset.json` a RecursionError; a
`_dataset.json` field of the wrong kind (`"multi_hot": "yes"`, `"dense": "I1"`) passed unseen.
The reader's own cases are test_data_faults.py's.
"""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.reliability.inproc import assert_refused, run_cli

ROW_GROUP = 1000


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """3,000 dlrm-tiny rows written by tpurec (checksummed pages, 3 row groups) and _dataset.json."""
    from tpurec.data.synth import synthesize

    out = tmp_path_factory.mktemp("good")
    synthesize(3000, str(out), seed=5, row_group_size=ROW_GROUP, show_progress=False)
    return out


def _copy(dataset, tmp_path):
    d = tmp_path / "ds"
    shutil.copytree(dataset, d)
    return d, d / "part-00000.parquet"


def _rewrite(part, edit) -> None:
    """The file rewritten by another tool (pyarrow defaults: no page checksums), `edit` applied."""
    t = edit(pq.read_table(part))
    pq.write_table(t, part, row_group_size=ROW_GROUP)


def _label_5(t: pa.Table) -> pa.Table:
    labels = t.column("label").to_numpy().copy()
    labels[1500] = 5
    return t.set_column(0, t.schema.field("label"), pa.array(labels))


def _flip_in_dense_page(part) -> None:
    meta = pq.read_metadata(part)
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    chunk = meta.row_group(1).column(names.index("I5"))
    start = chunk.dictionary_page_offset if chunk.dictionary_page_offset is not None else chunk.data_page_offset
    data = bytearray(part.read_bytes())
    data[start + chunk.total_compressed_size - 10] ^= 0x01
    part.write_bytes(bytes(data))


def _edit_json(d, edit) -> None:
    doc = json.loads((d / "_dataset.json").read_text())
    (d / "_dataset.json").write_text(edit(doc) or json.dumps(doc))


FILES = [
    ("flipped byte", _flip_in_dense_page, r"row group 1: column 'I5': page checksum mismatch"),
    ("label 5", lambda p: _rewrite(p, _label_5), "row group 1: column 'label': row 500: label 5, expected 0 or 1"),
    ("missing column", lambda p: _rewrite(p, lambda t: t.drop(["C3"])), "missing column(s) 'C3'"),
    ("label as float", lambda p: _rewrite(p, lambda t: t.set_column(0, "label", t.column("label").cast(pa.float64()))),
     "row group 0: column 'label' has type double, expected int"),
    ("id out of range", lambda p: _rewrite(p, lambda t: t.set_column(t.schema.get_field_index("C9"), "C9",
     pa.array([7] * t.num_rows))), "row group 0: column 'C9': id 7 out of range [0, 3) at row 0"),
]  # fmt: skip


@pytest.mark.parametrize("case,damage,says", FILES, ids=[c[0] for c in FILES])
def test_damaged_or_foreign_files_are_one_line(dataset, tmp_path, capsys, case, damage, says):
    d, part = _copy(dataset, tmp_path)
    damage(part)
    code, out, err = run_cli(["data", "inspect", d], capsys)
    assert_refused(code, err, f"tpurec data: error: {part}: {says}")
    assert out == ""


DATASET_JSON = [
    ("nested 100,000 deep", lambda doc: "[" * 100_000 + "]" * 100_000, "not JSON (nested deeper than"),
    ("multi_hot a string", lambda doc: doc["sparse"][0].update(multi_hot="yes"), "$.sparse[0].multi_hot: 'yes' is not"),
    ("dense a string", lambda doc: doc.update(dense="I1"), "$.dense: 'I1' is not a list"),
    ("label a number", lambda doc: doc.update(label=5), "$.label: 5 is not a string"),
    ("label missing", lambda doc: doc.pop("label") and None, "$.label: missing"),
    ("sparse nested", lambda doc: doc.update(sparse=json.loads("[" * 500 + "]" * 500)), "$.sparse[0]: list is not"),
    ("not an object", lambda doc: "[1, 2]", "$: [1, 2] is not an object"),
    ("unknown transform", lambda doc: doc.update(categorical="md5"), "$.categorical: 'md5' is not one of"),
]


@pytest.mark.parametrize("case,edit,says", DATASET_JSON, ids=[c[0] for c in DATASET_JSON])
def test_a_malformed_dataset_json_names_the_file_and_field(dataset, tmp_path, capsys, case, edit, says):
    d, _ = _copy(dataset, tmp_path)
    _edit_json(d, edit)
    code, _, err = run_cli(["data", "inspect", d], capsys)
    assert_refused(code, err, f"tpurec data: error: {d / '_dataset.json'}: {says}")


def test_the_intact_dataset_still_inspects(dataset, capsys):
    code, out, err = run_cli(["data", "inspect", dataset], capsys)
    assert code == 0 and "3,000 rows" in out, err
