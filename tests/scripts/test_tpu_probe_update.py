"""scripts/tpu_probe_update.py's smoke run (--cpu): a tiny stack on CPU JAX, every program timed, the
update and lookup equal to the pure-JAX contender's, the pieces chained equal to the update program."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
PIECES = ("decode", "grad_rows", "segment_ids", "segment_sum", "distinct_rows", "apply")


def _script():
    return load_script("tpu_probe_update")


def test_cpu_smoke_run_times_every_program_and_checks_equal_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    out = tmp_path / "upd.json"
    doc = _script().main(["--cpu", "--limits", "1.1,2", "--out", str(out)])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) == json.loads((tmp_path / "upd_partial.json").read_text())
    assert printed == json.loads(json.dumps(doc))
    assert doc["platform"] == "cpu" and doc["jax"] and doc["device"]
    assert doc["shape"]["tables"] == ["t_C21", "t_C22", "t_C20"] and doc["shape"]["num_partitions"] == 1
    assert (
        doc["shape"]["hots"] == [10, 2, 1]
        and doc["ids"] == 64 * 13
        and 0 < doc["distinct_rows"] <= doc["entries_after_merge"] <= doc["ids"]
    )

    eq = doc["equal_work"]
    assert eq["passed"] is True, eq
    assert eq["rows_changed_tpurec"] == eq["rows_changed_jax"] == doc["distinct_rows"]

    assert [c["limit_factor"] for c in doc["cells"]] == [1.1, 2.0]
    small, large = doc["cells"]
    assert doc["entries_after_merge"] <= small["slots"] < large["slots"]
    for c in doc["cells"]:
        progs = c["programs"]
        want = {"update_program", "update_program_donated", "update_program_rows", *PIECES, "row_gradients"}
        want.add("lookup_program")
        assert set(progs) == want
        for name, rec in progs.items():
            assert "error" not in rec and "skipped" not in rec, (name, rec)
            assert rec["ms"] > 0 and rec["slots"] == c["slots"] and rec["distinct_rows"] == doc["distinct_rows"]
        assert progs["update_program"]["donated"] is False and progs["update_program_donated"]["donated"] is True
        assert progs["update_program"]["GBps_rows"] > 0
        rows = c["rows_route_vs_program"]  # the rows route lands the copy route's numbers
        assert rows["table_max_abs_diff"] == rows["accumulator_max_abs_diff"] == 0.0
        assert doc["distinct_rows"] <= rows["rows_returned"]
        assert c["pieces_sum_ms"] > 0
        assert c["pieces_vs_program"]["table"]["max_abs_diff"] == 0.0
        assert c["pieces_vs_program"]["accumulator"]["max_abs_diff"] == 0.0
    jc = doc["jax_contender"]
    assert set(jc) == {"jax_update", "jax_take_sum", "jax_unique", "jax_segment_sum", "jax_apply", "table_copy"}
    assert all(rec["ms"] > 0 for rec in jc.values()) and jc["jax_update"]["donated"] is True
    assert doc["jax_pieces_sum_ms"] > 0


def test_a_program_past_the_budget_is_skipped_and_the_document_still_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    doc = _script().main(["--cpu", "--limits", "1.1", "--no-pieces", "--budget-s", "0"])
    progs = doc["cells"][0]["programs"]
    assert set(progs) == {"update_program", "update_program_donated", "update_program_rows", "lookup_program"}
    assert all("skipped" in rec and "ms" not in rec for rec in progs.values())
    assert doc["equal_work"]["passed"] is True  # checked whatever the budget
    assert all("skipped" in rec for rec in doc["jax_contender"].values())
    assert json.loads(capsys.readouterr().out)["cells"][0]["limit_factor"] == 1.1
