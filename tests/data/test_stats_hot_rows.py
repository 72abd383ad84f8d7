"""`tpurec data stats` writes each table's hot-row curve (tpurec/planner/hot_rows.py) beside its limits."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq

from tpurec.cli import main
from tpurec.planner.hot_rows import load_hot_rows


def test_data_stats_writes_each_tables_curve(synth_dir, tmp_path):
    out = tmp_path / "limits.json"
    args = ["data", "stats", str(synth_dir), "--model", "dlrm-tiny", "--topology", "cpu-1", "--out", str(out)]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    curves = load_hot_rows(doc)
    assert len(curves) == 26
    column = pq.read_table(synth_dir).column("C1").to_numpy()  # t_C1's feature: one id per row
    counts = np.sort(np.bincount(column))[::-1]
    c = curves["t_C1"]
    assert c.ids == 5000 and c.ids_per_sample == 1.0 and c.rows_seen == int((counts > 0).sum())
    assert c.top_k[-1] == c.rows_seen and c.covered[-1] == 1.0
    assert c.covered[0] == round(counts[0] / 5000, 6) and c.covered[3] == round(counts[:8].sum() / 5000, 6)
