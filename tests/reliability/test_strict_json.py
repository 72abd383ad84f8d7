"""Every JSON document tpurec writes is strict JSON (no NaN, Infinity or -Infinity), at any input
size: each writer run on the smallest input it accepts (a 1- or 2-row dataset, 1 step, a 1-row
table), its output parsed by a parser that refuses the non-standard constants. A 1-row dataset's
oracle AUC, an AUC over one class, a rate over no time are undefined: null, not NaN (Python's json
writes NaN by default; JavaScript's JSON.parse, jq and Go refuse it). All writers go through
tpurec/strict_json.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.inproc import run_cli


def _refuse(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def strict(text: str):
    """`text` parsed as strict JSON (NaN, Infinity, -Infinity refused)."""
    return json.loads(text, parse_constant=_refuse)


def strict_lines(text: str) -> list:
    return [strict(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """1- and 2-row synthetic datasets (2 rows: the least that holds out an eval row for training)."""
    root = tmp_path_factory.mktemp("strict")
    from tpurec.data.synth import synthesize

    for rows in (1, 2):
        synthesize(rows, str(root / f"d{rows}"), seed=0, show_progress=False)
    return root


def test_data_commands_write_strict_json_for_a_one_row_dataset(tiny, tmp_path, capsys):
    code, out, err = run_cli(["data", "synth", "--rows", 1, "--out", tmp_path / "s1", "--quiet", "--json"], capsys)
    assert code == 0, err
    summary = strict(out)
    assert summary["rows"] == 1 and summary["oracle_auc"] is None  # one row, one class: no AUC (was NaN)
    strict((tmp_path / "s1" / "_dataset.json").read_text())
    code, out, err = run_cli(["data", "inspect", tiny / "d1", "--json"], capsys)
    assert code == 0, err
    strict(out)
    limits = tmp_path / "l.json"
    stats = ["data", "stats", tiny / "d1", "--model", "dlrm-tiny", "--topology", "cpu-1", "--batch-size", 1]
    code, _, err = run_cli([*stats, "--out", limits, "--quiet"], capsys)
    assert code == 0, err
    assert strict(limits.read_text())["rows"] == 1


def test_data_convert_writes_strict_json_for_a_one_line_file(tmp_path, capsys):
    from tpurec.bench.data import write_criteo_tsv

    tsv = tmp_path / "day_0"
    write_criteo_tsv(str(tmp_path), str(tsv), 1, seed=0)
    code, out, err = run_cli(["data", "convert", tsv, "--out", tmp_path / "c", "--quiet", "--json"], capsys)
    assert code == 0, err
    strict(out)
    strict((tmp_path / "c" / "_dataset.json").read_text())


def test_plans_of_a_one_row_table_are_strict_json(tmp_path, capsys):
    tables = tmp_path / "t.json"
    tables.write_text(json.dumps([{"name": "t", "rows": 1, "dim": 8}]))
    plan = tmp_path / "p.json"
    code, _, err = run_cli(
        ["plan", "--tables", tables, "--topology", "cpu-1", "--format", "json", "--out", plan], capsys
    )
    assert code == 0, err
    strict(plan.read_text())
    code, out, err = run_cli(["plan", "show", plan, "--format", "json"], capsys)
    assert code == 0, err
    strict(out)


def test_a_one_step_training_run_writes_strict_json_everywhere(tiny, tmp_path, capsys):
    """1 step of batch 1 on 2 rows, 1 eval row of one class: the AUC and NE are undefined."""
    ck, metrics, seen = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "seen.json"
    argv = ["train", "--data", tiny / "d2", "--steps", 1, "--batch-size", 1, "--quiet", "--curves-out", "none"]
    argv += ["--metrics-out", metrics, "--limits-out", seen, "--checkpoint-dir", ck, "--checkpoint-every", 1]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    result = strict(out.strip().splitlines()[-1])
    assert result["steps"] == 1 and result["auc"] is None
    assert any(r.get("kind") == "eval" and r["auc"] is None for r in strict_lines(metrics.read_text()))
    strict(seen.read_text())
    written = sorted(ck.rglob("*.json"))
    assert {p.name for p in written} == {"meta.json", "rank-0.json", "CHECKSUMS.json"}
    for p in written:
        strict(p.read_text())


def test_the_helper_writes_null_for_non_finite_values_and_refuses_nothing_else():
    from tpurec import strict_json

    doc = {"auc": float("nan"), "rate": float("inf"), "x": [1.5, float("-inf"), (2, float("nan"))], "n": 3}
    assert strict(strict_json.dumps(doc)) == {"auc": None, "rate": None, "x": [1.5, None, [2, None]], "n": 3}


def test_no_module_writes_json_but_through_the_strict_helper():
    """A new `json.dump(s)` in tpurec would write NaN again on the first undefined value: every
    writer calls tpurec/strict_json.py (messages that quote a user's value use `json_fields`)."""
    import re

    package = Path(__file__).resolve().parents[2] / "tpurec"
    allowed = {
        "strict_json.py",
        "json_fields.py",  # quoting a key in a message
        "dlrm/ckpt/meta.py",  # quoting a user's value in a message
        "dlrm/ckpt/integrity.py",  # same
        "dlrm/ckpt/config.py",  # a round trip to compare a config as JSON reads it, never written
        "launch/hosts.py",  # the source of a child printing environment strings
    }
    found = [
        f"{p.relative_to(package)}:{i}"
        for p in sorted(package.rglob("*.py"))
        if str(p.relative_to(package)) not in allowed
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"(?<![\w.])json\.dumps?\(", line)
    ]
    assert found == [], found
