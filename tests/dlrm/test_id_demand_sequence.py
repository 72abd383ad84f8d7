"""A run's id demand (`id_demand` metrics rows, `--limits-out`) of an EmbeddingCollection's tables
(issue 63 item 7): counted on the batch as it came, as `tpurec data stats` counts a sequence table,
and written with its capacity (`max_ids_per_feature`), so the next run takes the file."""

from __future__ import annotations

import json

from tests.reliability.inproc import run_cli

from .helpers import REPO

HISTORY_RANKER = f"{REPO / 'examples' / 'history_ranker.py'}:build"
HISTORY = 8  # examples/history_ranker.py's recent items per sample (what `data synth` writes)


def _train(capsys, *args) -> dict:
    code, out, err = run_cli(["train", "--quiet", "--model-module", HISTORY_RANKER, *args], capsys)
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_an_embedding_collections_table_has_its_demand_row_and_limits(tmp_path, capsys, monkeypatch):
    """Was: rows and limits for the two EBC tables only; the limits file then refused by the next run
    (`no limits for the model's table(s) t_history`)."""
    from tpurec.cli import main

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    data = str(tmp_path / "data")
    assert main(["data", "synth", "--model-module", HISTORY_RANKER, "--rows", "3000", "--out", data]) == 0
    metrics, limits = tmp_path / "m.jsonl", tmp_path / "limits.json"
    common = ["--data", data, "--batch-size", 64, "--steps", 4, "--eval-every", 0, "--keep", 0]
    _train(capsys, *common, "--metrics-out", metrics, "--limits-out", limits)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    demand = {r["table"]: r for r in rows if r["kind"] == "id_demand"}
    assert sorted(demand) == ["t_history", "t_items", "t_users"]
    history = demand["t_history"]
    # the batch's own samples (not the sequence kernel's one-id bags, which hold one id each)
    assert history["max_ids_per_sample"] == HISTORY and history["batches"] == 4
    assert history["max_ids_per_feature"] == 64 * HISTORY  # every sample's 8 items, one batch of 64
    assert 0 < history["max_unique_ids"] <= history["max_ids"] <= 64 * HISTORY
    written = json.loads(limits.read_text())["tables"]["t_history"]
    assert written["observed"]["max_ids_per_feature"] == 512 and written["max_ids_per_feature"] == 568  # +10%, 8s
    assert written["max_ids_per_partition"] >= history["max_ids"]
    # the file is the next run's limits: every batch in the compiled graph (the EC's capacity from the file)
    again = _train(capsys, *common, "--limits", limits, "--step", "compiled")
    assert again["eager_steps"] == 0 and again["id_limits"]["dropped_ids"] == 0
