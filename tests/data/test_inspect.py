import json

import numpy as np

from tpurec.data.inspect import inspect_dataset


def test_inspect_reports_real_figures(synth_dir, synth_table):
    r = inspect_dataset(synth_dir)
    assert r["rows"] == 5000 and r["files"] == 2 and r["row_groups"] == 5
    assert r["label_rate"] == round(float(synth_table.column("label").to_numpy().mean()), 6)
    for name in ("C1", "C9", "C20"):
        exact = len(np.unique(synth_table.column(name).to_numpy()))
        est = r["columns"][name]["distinct_ids_estimate"]
        assert abs(est - exact) <= max(2, 0.1 * exact)
        assert r["columns"][name]["null_share"] == 0
    # Zipf ids: the top 1% of ids take far more than 1% of lookups.
    assert r["columns"]["C1"]["top1pct_ids_share"] > 0.2
    assert r["columns"]["I1"]["kind"] == "dense" and r["oracle_auc"] > 0.6


def test_inspect_cli_on_converted_sample(criteo_sample, tmp_path, capsys):
    from tpurec.cli import main

    assert main(["data", "convert", str(criteo_sample), "--out", str(tmp_path), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["rows"] == 200 and r["label_rate"] == 0.245
    assert r["columns"]["C6"]["distinct_ids_estimate"] < 20
    import csv

    with open(criteo_sample, newline="") as f:
        blanks = sum(1 for row in csv.DictReader(f) if row["C26"] == "")
    assert r["columns"]["C26"]["empty_id_share"] == round(blanks / 200, 4) and blanks > 0
    assert main(["data", "inspect", str(tmp_path)]) == 0
    assert "200 rows" in capsys.readouterr().out


def test_inspect_into_a_closed_pipe_is_quiet(synth_dir):
    """`tpurec data inspect DIR | head -1`: once the reader has gone, no error and exit 0 (here the
    pipe's read end is closed before anything is written, so the write always fails)."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "data", "inspect", str(synth_dir)],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)
    assert p.stderr == "" and p.returncode == 0, p.stderr
