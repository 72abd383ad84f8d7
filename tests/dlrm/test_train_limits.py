"""`tpurec train --limits` (measured id limits, fixed) and `--limits-out` (the run's own demand)."""

from __future__ import annotations

import json

import pytest

from tests.dlrm.helpers import train_here
from tpurec.cli import main
from tpurec.planner.id_limits import load_limits


@pytest.fixture(scope="module")
def data_and_limits(tmp_path_factory):
    from tpurec.data.synth import synthesize

    root = tmp_path_factory.mktemp("limits_run")
    synthesize(6000, str(root / "data"), seed=5, show_progress=False)
    limits = root / "limits.json"
    args = ["data", "stats", str(root / "data"), "--model", "dlrm-tiny", "--topology", "cpu-1", "--batch-size", "64"]
    assert main([*args, "--out", str(limits)]) == 0
    return root, limits


def test_training_takes_measured_limits_and_writes_its_own(data_and_limits, tmp_path, capsys):
    root, limits = data_and_limits
    out, metrics = tmp_path / "seen.json", tmp_path / "m.jsonl"
    result, _, _ = train_here(
        capsys, "--data", root / "data", "--batch-size", 64, "--steps", 12, "--limits", limits, "--limits-out", out,
        "--metrics-out", metrics, cache=tmp_path,
    )  # fmt: skip
    assert result["id_limits"]["limits"] == str(limits) and result["id_limits"]["dropped_ids"] == 0
    # every run reports each table's demand in its metrics; the result line stays short without them
    assert "tables" not in result["id_limits"] and len(json.dumps(result)) < 1500
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    tables = {r["table"]: r for r in rows if r["kind"] == "id_demand"}
    assert len(tables) == 26 and all(t["batches"] >= 12 and t["max_ids"] > 0 for t in tables.values())
    assert all(t["multipass_batches"] == 0 == t["dropped_ids"] for t in tables.values())  # measured: they fit
    seen = json.loads(out.read_text())
    assert seen["layout"]["batch_size_per_device"] == 64 and seen["layout"]["world_size"] == 1
    back = load_limits(str(out), {"world_size": 1, "sparsecores_per_device": 4, "batch_size_per_device": 64})
    assert len(back) == 26
    measured = json.loads(limits.read_text())["tables"]
    for name, t in seen["tables"].items():
        assert t["observed"]["batches"] >= 12
        # the same data, other batches (training shuffles): the same order of magnitude
        assert t["observed"]["max_ids"] <= 2 * measured[name]["observed"]["max_ids"] + 8


def test_limits_for_another_layout_are_refused_naming_both(data_and_limits, tmp_path, capsys):
    root, limits = data_and_limits
    args = ("--data", root / "data", "--batch-size", 32, "--steps", 2, "--limits", limits)
    _, code, err = train_here(capsys, *args, cache=tmp_path, check=False)
    assert code != 0
    assert "batch 64 per device" in err and "batch 32 per device" in err
