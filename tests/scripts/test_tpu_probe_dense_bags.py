"""scripts/tpu_probe_dense_bags.py: bag-major ids from CSR lengths (pads read row 0 with gain 0), and
its smoke run (--cpu): every contender timed, the bag-major lookup equal to the XLA contender's."""

from __future__ import annotations

import json

import numpy as np

from tests.helpers.scripts import load_script


def _script():
    return load_script("tpu_probe_dense_bags")


def test_bag_major_pads_each_bag_to_the_longest_with_zero_gains():
    ids, gains = _script().bag_major(np.array([2, 0, 3]), np.array([7, 8, 4, 5, 6]))
    assert ids.tolist() == [[7, 8, 0], [0, 0, 0], [4, 5, 6]]
    assert gains.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    ids, gains = _script().bag_major(np.array([0, 0]), np.array([], np.int64))  # no ids at all
    assert ids.tolist() == [[0], [0]] and gains.tolist() == [[0], [0]]


def test_cpu_smoke_run_times_every_contender_against_the_xla_lookup(tmp_path):
    out = tmp_path / "db.json"
    doc = _script().main(["--cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["device"] and doc["jax"] and len(doc["cells"]) == 1
    (c,) = doc["cells"]  # variable bags, lengths 0..8: padded to the longest
    assert "var" in c["cell"] and c["ids"] < c["padded_slots"] <= 32 * 8
    assert set(c["ms"]) == {"xla", "tpurec", "gather", "dense_bags"} and min(c["ms"].values()) > 0
    assert set(c["vs_xla"]) == {"tpurec", "gather", "dense_bags"}
    assert c["max_error_vs_xla"]["dense_bags"] <= 1e-4 and c["max_error_vs_xla"]["tpurec"] <= 1e-4
