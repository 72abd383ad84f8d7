"""A warehouse's Parquet (its own column names: 13 float dense, 20 int64 and 5 string categoricals, a
list<int64> history, Hive-partitioned by day) in an s3:// bucket of a real S3 server (moto): inspect,
stats and train read it through a column mapping with the numbers of the same files on local disk."""

from __future__ import annotations

import json

import numpy as np

from tests.reliability.inproc import run_cli

ROWS = 1500
FLAGS = ["--label", "clicked", "--dense", "num_*", "--sparse", "id_*:700,name_*:900,history:1200"]


def _hive(root) -> None:
    import pandas as pd

    rng = np.random.default_rng(3)
    d: dict = {"clicked": rng.integers(0, 2, ROWS)}
    d |= {f"num_{i}": rng.random(ROWS) for i in range(13)}
    d |= {f"id_{i}": rng.integers(0, 5000, ROWS) for i in range(20)}
    d |= {f"name_{i}": [f"user-{j}" for j in rng.integers(0, 400, ROWS)] for i in range(5)}
    d["history"] = [list(rng.integers(0, 10_000, rng.integers(1, 6))) for _ in range(ROWS)]
    d["day"] = np.repeat([1, 2, 3], ROWS // 3)
    pd.DataFrame(d).to_parquet(root, partition_cols=["day"])


def _upload(local, uri: str) -> None:
    from pyarrow import fs as pafs

    from tpurec.runtime import storage

    fs, key = storage.arrow(uri)
    pafs.copy_files(str(local), key, destination_filesystem=fs)


def test_a_hive_dataset_in_s3_inspects_stats_and_trains_as_on_local_disk(s3_bucket, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    local, uri = tmp_path / "events", f"{s3_bucket}/warehouse/events"
    _hive(local)
    _upload(local, uri)

    code, remote, err = run_cli(["data", "inspect", uri, "--json", *FLAGS], capsys)
    assert code == 0, err
    code, here, err = run_cli(["data", "inspect", local, "--json", *FLAGS], capsys)
    assert code == 0, err
    assert json.loads(remote.replace(uri, "DATA")) == json.loads(here.replace(str(local), "DATA"))
    assert json.loads(remote)["rows"] == ROWS

    out = tmp_path / "limits.json"
    stats = ["data", "stats", uri, "--model", "dlrm-tiny", "--topology", "v5p-8", "--quiet", "--out", out, *FLAGS]
    code, _, err = run_cli(stats, capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["rows"] == ROWS and len(doc["tables"]) == 26 and doc["data"] == uri

    run = ["train", "--quiet", "--steps", 3, "--batch-size", 256, "--eval-every", 0, "--curves-out", "none", *FLAGS]
    results = []
    for data in (uri, local):
        code, stdout, err = run_cli([*run, "--data", data], capsys)
        assert code == 0, err
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    assert results[0]["steps"] == 3
    for k in ("auc", "ne", "logloss"):
        assert results[0][k] == results[1][k], k
