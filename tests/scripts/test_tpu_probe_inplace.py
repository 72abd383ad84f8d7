"""scripts/tpu_probe_inplace.py (chip probe 12) on the CPU with its jax_op stand-in: every route's update
equals the host's, the views follow or not as each route says, and the rows-only program's padding
slots write the first real row's values (every index in range, repeats equal)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tests.helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]


def _script():
    return load_script("tpu_probe_inplace")


def test_cpu_smoke_run_checks_every_route(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    doc = _script().main(["--cpu", "--rows", "8000", "--distinct", "1200", "--reps", "2"])
    assert json.loads(capsys.readouterr().out) == json.loads((tmp_path / "probe12_inplace.json").read_text())
    routes = doc["routes"]
    assert list(routes) == ["copy", "rows", "rows_quarter", "donate_set"]
    assert all("error" not in r and r["ms"] > 0 for r in routes.values()), routes
    for name in ("copy", "rows", "donate_set"):
        assert routes[name]["max_abs_err"] < 1e-5, name
    # in place (copy_, index_copy_): the view taken before sees the update; set_ gives the stack
    # other storage (on the CPU, where nothing is donated, the view keeps the old rows) until re-pointed
    assert routes["copy"]["view_follows"] is True and routes["rows"]["view_follows"] is True
    assert routes["donate_set"]["view_follows"] is False and routes["donate_set"]["view_repointed"] is True


def test_rows_only_keeps_every_index_in_range_and_repeats_the_first_real_row():
    probe = _script()
    gen = np.random.default_rng(3)
    table = jnp.asarray(gen.standard_normal((10, 4), dtype=np.float32))
    acc = jnp.asarray(gen.random(10, dtype=np.float32))
    grads = jnp.asarray(gen.standard_normal((4, 4), dtype=np.float32))
    lr, eps = jnp.float32(0.1), jnp.float32(1e-8)
    rows = jnp.asarray([10, 3, 7, 10], jnp.int32)  # padding (10: past the table) around two real rows
    idx, new_rows, new_acc = probe.rows_only(table, acc, rows, grads, lr, eps)
    want_rows, want_acc = probe.rowwise_adagrad_rows(table, acc, rows, grads, lr, eps)
    assert np.asarray(idx).tolist() == [3, 3, 7, 3]
    np.testing.assert_array_equal(np.asarray(new_rows)[[0, 3]], np.asarray(want_rows)[[1, 1]])
    np.testing.assert_array_equal(np.asarray(new_rows)[1:3], np.asarray(want_rows)[1:3])
    np.testing.assert_array_equal(np.asarray(new_acc), np.asarray(want_acc)[[1, 1, 2, 1]])
    # no real row: row 0 written as it is
    idx, new_rows, new_acc = probe.rows_only(table, acc, jnp.full(4, 10, jnp.int32), grads, lr, eps)
    assert np.asarray(idx).tolist() == [0, 0, 0, 0]
    np.testing.assert_array_equal(np.asarray(new_rows), np.repeat(np.asarray(table)[:1], 4, axis=0))
    np.testing.assert_array_equal(np.asarray(new_acc), np.full(4, np.asarray(acc)[0]))
