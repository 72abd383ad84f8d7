"""Hand-edited plan files (issue #29 item 5): any JSON value in any field of a plan file is refused in
one line naming the file and the field by its JSON path, before anything is built from it; before,
`"ranks": "0"`, a placement that is not `rank:N/DEVICE`, a meta table that is a number or a deeply
nested file gave TypeError, AttributeError, RuntimeError or RecursionError tracebacks.

Values of the right kind that do not fit the model or the world size (rank 9 of 4, shards not
covering a table, `bogus_wise`) are test_bad_inputs.py's and tests/planner/test_plan_check.py's.
"""

from __future__ import annotations

import json

import pytest

from tests.reliability.inproc import assert_refused, run_cli
from tpurec.cli import main


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """A real `tpurec plan` report of dlrm-tiny on 4 devices."""
    path = tmp_path_factory.mktemp("plans") / "dlrm-tiny.json"
    assert main(["plan", "--model", "dlrm-tiny", "--topology", "v6e-4", "--format", "json", "--out", str(path)]) == 0
    return path


def _t_c1(doc):
    return doc["plan"]["modules"][""]["t_C1"]


def _shard(doc):
    return _t_c1(doc)["shards"][0]


T_C1 = '$.plan.modules[""].t_C1'
# (case, edit of a good report, the field named, what the line says of it)
EDITS = [
    ("placement gpu0", lambda d: _shard(d).update(placement="gpu0"), f"{T_C1}.shards[0].placement", "'gpu0' is not"),
    ("placement rank:x", lambda d: _shard(d).update(placement="rank:x/tpu:0"), f"{T_C1}.shards[0].placement", ""),
    ("placement device", lambda d: _shard(d).update(placement="rank:0/foo:0"), f"{T_C1}.shards[0].placement", ""),
    ("placement number", lambda d: _shard(d).update(placement=7), f"{T_C1}.shards[0].placement", "7 is not"),
    ('ranks "0"', lambda d: _t_c1(d).update(ranks="0"), f"{T_C1}.ranks", "'0' is not a list"),
    ('ranks ["0"]', lambda d: _t_c1(d).update(ranks=["0"]), f"{T_C1}.ranks[0]", "'0' is not a whole number"),
    ("ranks [true]", lambda d: _t_c1(d).update(ranks=[True]), f"{T_C1}.ranks[0]", "True is not a whole number"),
    ("sizes fraction", lambda d: _shard(d).update(sizes=[999.5, 16]), f"{T_C1}.shards[0].sizes[0]", "999.5"),
    (
        "sizes 3-D",
        lambda d: _shard(d).update(sizes=[1000, 16, 1]),
        f"{T_C1}.shards[0].sizes",
        "[1000, 16, 1] is not [rows",
    ),
    ("offsets string", lambda d: _shard(d).update(offsets="00"), f"{T_C1}.shards[0].offsets", "'00' is not a list"),
    ("shards object", lambda d: _t_c1(d).update(shards={"a": 1}), f"{T_C1}.shards", "dict is not a list"),
    ("shard list", lambda d: _t_c1(d).update(shards=[[1, 2]]), f"{T_C1}.shards[0]", "[1, 2] is not an object"),
    ("table number", lambda d: d["plan"]["modules"][""].update(t_C1=5), T_C1, "5 is not an object"),
    ("module list", lambda d: d["plan"]["modules"].update({"": [1]}), '$.plan.modules[""]', "[1] is not an object"),
    ("plan list", lambda d: d.update(plan=[1]), "$.plan", "[1] is not an object"),
    ("sharding_type number", lambda d: _t_c1(d).update(sharding_type=5), f"{T_C1}.sharding_type", "5 is not a string"),
    (
        "enforce_hbm string",
        lambda d: _t_c1(d).update(enforce_hbm="yes"),
        f"{T_C1}.enforce_hbm",
        "'yes' is not true or false",
    ),
    (
        "bounds_check_mode",
        lambda d: _t_c1(d).update(bounds_check_mode="BOGUS"),
        f"{T_C1}.bounds_check_mode",
        "'BOGUS' is not one of",
    ),
    ("unknown field", lambda d: _t_c1(d).update(enforce_hmb=True), f"{T_C1}.enforce_hmb", "unknown field"),
    ("missing field", lambda d: _t_c1(d).pop("compute_kernel"), f"{T_C1}.compute_kernel", "missing"),
    ("deep shards", lambda d: _t_c1(d).update(shards=json.loads("[" * 500 + "]" * 500)), f"{T_C1}.shards[0]", ""),
    ("meta list", lambda d: d.update(meta=[1]), "$.meta", "[1] is not an object"),
    ("meta tables string", lambda d: d["meta"].update(tables="x"), "$.meta.tables", "'x' is not a list"),
    ("meta table number", lambda d: d["meta"].update(tables=[5]), "$.meta.tables[0]", "5 is not an object"),
    (
        "meta table rows",
        lambda d: d["meta"]["tables"][0].update(num_embeddings="9"),
        "$.meta.tables[0].num_embeddings",
        "",
    ),
    ("meta batch_size", lambda d: d["meta"].update(batch_size="x"), "$.meta.batch_size", "'x' is not a whole number"),
    ("meta topology", lambda d: d["meta"].update(topology=5), "$.meta.topology", "5 is not a string"),
]


@pytest.mark.parametrize("case,edit,field,says", EDITS, ids=[e[0] for e in EDITS])
def test_a_field_of_the_wrong_kind_is_named_by_its_json_path(plan_file, tmp_path, capsys, case, edit, field, says):
    doc = json.loads(plan_file.read_text())
    edit(doc)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    code, _, err = run_cli(["plan", "show", path], capsys)
    assert_refused(code, err, f"tpurec plan: {path}: {field}: {says}")


def test_a_file_nested_deeper_than_the_json_parser_reads_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text(
        '{"format": "tpurec-sharding-plan", "version": 1, "modules": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    code, _, err = run_cli(["plan", "show", path], capsys)
    assert_refused(code, err, f"tpurec plan: {path}: not a tpurec plan (JSON nested deeper than")


def test_train_and_library_loads_refuse_the_same_way(plan_file, tmp_path):
    """`tpurec train --plan` and library users load plans with plan_io.load_plan: the same one line."""
    from tpurec.planner.plan_io import load_plan

    doc = json.loads(plan_file.read_text())
    _t_c1(doc)["ranks"] = "0"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=rf"^{path}: \$\.plan\.modules\[\"\"\]\.t_C1\.ranks: '0' is not a list$"):
        load_plan(path)


def test_the_unedited_plan_still_shows(plan_file, capsys):
    code, out, err = run_cli(["plan", "show", plan_file], capsys)
    assert code == 0 and "t_C1" in out, err
