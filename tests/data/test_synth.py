import itertools
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tpurec.data.schema import dataset_metadata, list_parquet_files
from tpurec.data.synth import auc, synthesize, zipf_ids


def test_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 60).astype(float)  # many ties
    y = rng.integers(0, 2, 60)
    pos, neg = s[y == 1], s[y == 0]
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p, n in itertools.product(pos, neg)]
    assert auc(s, y) == pytest.approx(np.mean(pairs))
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75


def test_zipf_ids_are_skewed_and_in_range():
    ids = zipf_ids(np.random.default_rng(0), 1000, 100_000)
    assert ids.min() >= 0 and ids.max() < 1000
    counts = np.bincount(ids, minlength=1000)
    assert counts[0] > 50 * np.median(counts)  # the head dominates


def test_deterministic_for_a_seed(tmp_path):
    a = synthesize(3000, str(tmp_path / "a"), seed=7, row_group_size=1000, show_progress=False)
    b = synthesize(3000, str(tmp_path / "b"), seed=7, row_group_size=1000, show_progress=False)
    c = synthesize(3000, str(tmp_path / "c"), seed=8, row_group_size=1000, show_progress=False)
    ta, tb, tc = (pq.read_table(list_parquet_files(tmp_path / x)[0]) for x in "abc")
    assert ta.equals(tb) and not ta.equals(tc)
    assert a["oracle_auc"] == b["oracle_auc"] != c["oracle_auc"]
    meta = dataset_metadata(tmp_path / "a")
    assert meta["oracle_auc"] == a["oracle_auc"] and meta["synthetic"] is True
    assert meta["table_set"] == "dlrm-tiny" and meta["seed"] == 7
    # The labels follow the hidden model, so the label rate is Criteo-like and the oracle is informative.
    assert 0.15 < a["label_rate"] < 0.4 and 0.7 < a["oracle_auc"] < 0.95
    for f in meta["sparse"]:
        col = ta.column(f["name"]).to_numpy()
        assert col.min() >= 0 and col.max() < f["num_embeddings"]


def test_multi_hot_table_set(tmp_path):
    synthesize(300, str(tmp_path), seed=0, table_set="mlperf-dcnv2", show_progress=False)
    t = pq.read_table(list_parquet_files(tmp_path)[0])
    assert t.schema.field("C21").type.value_type.bit_width == 64
    assert {len(x) for x in t.column("C21").to_pylist()} == {100}  # MLPerf multi-hot size of C21
    assert t.column("C3").type.bit_width == 64  # one-hot
    from tpurec.data.reader import ParquetReader

    b = next(iter(ParquetReader(tmp_path, 64)))
    assert b.sparse_features["C21"].lengths().eq(100).all()
    assert b.sparse_features["C21"].values().max() < 40_000_000


def test_cli_synth_prints_oracle_auc(tmp_path, capsys):
    from tpurec.cli import main

    assert main(["data", "synth", "--rows", "2000", "--out", str(tmp_path / "s"), "--quiet", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == 2000 and out["oracle_auc"] == dataset_metadata(tmp_path / "s")["oracle_auc"]
    with pytest.raises(SystemExit) as e:  # argparse: the names are choices
        main(["data", "synth", "--rows", "10", "--out", str(tmp_path / "t"), "--tables", "nope"])
    assert e.value.code == 2 and "--table-set/--tables: invalid choice: 'nope'" in capsys.readouterr().err
