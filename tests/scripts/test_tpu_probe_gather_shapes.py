"""scripts/tpu_probe_gather_shapes.py's smoke run (--cpu): every gather form timed at each size, the
forms that keep the ids' order equal to `jnp.take`'s (checked inside the run)."""

from __future__ import annotations

import json

from tests.helpers.scripts import load_script


def test_cpu_smoke_run_times_every_gather_form_at_each_size(tmp_path):
    out = tmp_path / "g.json"
    doc = load_script("tpu_probe_gather_shapes").main(["--cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert [c["ids"] for c in doc["cells"]] == [96, 128]
    for c in doc["cells"]:
        assert set(c["ms"]) == {"take_fill", "index_clip", "take_inbounds", "halves", "sorted"}
        assert min(c["ms"].values()) > 0
        # the bytes of rows a second follow from the time: ids x width x 4 bytes
        got = c["GBps_rows"]["take_fill"] * c["ms"]["take_fill"] * 1e6
        assert abs(got - c["ids"] * 128 * 4) < 1e-6 * c["ids"] * 128 * 4


def test_a_sweep_times_the_given_sizes_and_forms_only(tmp_path):
    args = ["--cpu", "--sizes", "40,56", "--forms", "index_clip,sorted", "--out", str(tmp_path / "g.json")]
    doc = load_script("tpu_probe_gather_shapes").main(args)
    assert [(c["table"], c["ids"]) for c in doc["cells"]] == [("2000x128 float32", 40), ("2000x128 float32", 56)]
    assert all(set(c["ms"]) == {"index_clip", "sorted"} for c in doc["cells"])


def test_placements_time_each_size_with_the_table_placed_k_ways_on_the_same_ids(tmp_path):
    args = ["--cpu", "--sizes", "40", "--forms", "index_clip", "--placements", "2", "--out", str(tmp_path / "g.json")]
    doc = load_script("tpu_probe_gather_shapes").main(args)
    assert [(c["ids"], c["placement"]) for c in doc["cells"]] == [(40, 0), (40, 1)]
    assert all(c["table_address"] is None or c["table_address"] > 0 for c in doc["cells"])


def test_the_scatter_form_runs_only_when_named_and_chains_its_donated_table(tmp_path):
    script = load_script("tpu_probe_gather_shapes")
    args = ["--cpu", "--sizes", "40", "--forms", "index_clip,scatter_add", "--out", str(tmp_path / "g.json")]
    (c,) = script.main(args)["cells"]
    assert set(c["ms"]) == {"index_clip", "scatter_add"} and min(c["ms"].values()) > 0

    import jax.numpy as jnp

    table, ids = jnp.zeros((10, 128), jnp.float32), jnp.array([1, 1, 3], jnp.int32)
    call = script.contenders(table, ids, ["scatter_add"])["scatter_add"]
    call()
    out = call()  # the second call adds onto the first's table
    assert float(out[1, 0]) == float(jnp.float32(4e-3)) and float(out[3, 0]) == float(jnp.float32(2e-3))
    assert float(jnp.abs(table).max()) == 0.0  # the gathers' table untouched
