"""The lookup asks XLA's row gather for a count v5e serves at its fast speed (gather_count): the rule
against every count measured on the chip, and the lookup's sums unchanged by the appended entries."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpurec.bench import tpu_kernels
from tpurec.embedding.tensorcore import lookup_jax
from tpurec.embedding.tensorcore.gather_count import fast_gather_count

# probe 14 on v5e, 1M x 128 f32 (docs/results.md, sessions 40-41): ~0.58 ms against ~1.36 at ~131k ids
SLOW = [65536, 126976, 129024, 130048, 130945, 130976, 131000, 131064, 131068, 131070, 131071, 131072]
SLOW += [132096, 262143, 262144, 1048500, 2097152, 2127792, 2127799, 2127800]
FAST = [65664, 130396, 130560, 130943, 130944, 131073, 131076, 131080, 131088, 131200, 262272, 1048577]
FAST += [2000000, 2127873]


def test_slow_counts_get_up_to_128_more_and_fast_ones_keep_theirs():
    for n in FAST:
        assert fast_gather_count(n, 128) == n, n
    for n in SLOW:
        m = fast_gather_count(n, 128)
        assert n < m <= n + 128 and (-m) % 1024 >= 128, n  # the fast side of the rule
    assert fast_gather_count(131072, 128) == 131073 and fast_gather_count(2127792, 128) == 2127873
    # measured at width 128 only: other widths keep their count
    assert fast_gather_count(131072, 16) == fast_gather_count(131072, 256) == 131072


# the Pallas pooling interpreted: 14 s, slow (its dropping of invalid entries: test_pallas_pool.py)
@pytest.mark.parametrize("pallas", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["xla-pool", "pallas-pool"])
def test_the_padded_gather_looks_up_the_same_sums(pallas):
    # 1,016 ids: the bench's CSR holds 1,024 slots, a count the chip gathers slowly: 1,025 are gathered
    g = np.random.default_rng(3)
    bags, pooling, rows = 127, 8, 5000
    inp = tpu_kernels.inputs_for(g.integers(0, rows, bags * pooling), np.repeat(np.arange(bags), pooling), bags)
    assert inp["csr"][1].shape[0] == 1024
    table = jax.random.normal(jax.random.key(0), (rows, 128), jnp.float32)
    batch, num_sc, parts = inp["layout"][:3]
    kw = {"device_batch_size": batch, "num_sc": num_sc, "num_partitions": parts, "pallas_pool": pallas}
    kw |= {"interpret": pallas, "pool_gains": pallas, "pool_accumulators": 4 if pallas else 1}
    padded = jax.jit(functools.partial(lookup_jax.lookup, **kw))
    plain = jax.jit(functools.partial(lookup_jax.lookup, **kw, pad_gather=False))
    got, want = padded(*inp["csr"], table), plain(*inp["csr"], table)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    xla = jax.ops.segment_sum(table[inp["ids"]], inp["samples"], num_segments=bags)
    np.testing.assert_allclose(np.asarray(got)[:bags], np.asarray(xla), rtol=1e-5, atol=1e-5)
    # the gather the program asks for: 1,025 rows of 128 with the padding, 1,024 without
    assert "tensor<1025x128xf32>" in padded.lower(*inp["csr"], table).as_text()
    assert "tensor<1025x128xf32>" not in plain.lower(*inp["csr"], table).as_text()


def test_the_updates_padded_rows_change_nothing(monkeypatch):
    # TPUREC_UPDATE_PAD=1: the update's 1,024 distinct-row slots become 1,025 (a padding row past the
    # table): the same new table by the copy route, the same landed rows by the rows route
    from tpurec.embedding.tensorcore import tpu_bridge

    g = np.random.default_rng(5)
    bags, pooling, rows = 127, 8, 5000
    inp = tpu_kernels.inputs_for(g.integers(0, rows, bags * pooling), np.repeat(np.arange(bags), pooling), bags)
    table = jax.random.normal(jax.random.key(1), (rows, 128), jnp.float32)
    acc = jnp.abs(jax.random.normal(jax.random.key(2), (rows,), jnp.float32))
    grad = jax.random.normal(jax.random.key(3), (bags, 128), jnp.float32)
    lr, eps = jnp.float32(0.05), jnp.float32(1e-8)
    rp, emb, smp, gns = inp["csr"]
    layout: dict[str, Any] = dict(
        zip(["device_batch_size", "num_sc", "num_partitions", "max_unique_ids_per_partition"], inp["layout"])
    )

    def run(pad: bool) -> tuple[np.ndarray, ...]:
        monkeypatch.setenv("TPUREC_UPDATE_PAD", "1" if pad else "0")
        sgd = jax.jit(lambda t: tpu_bridge.tc_sgd(rp, emb, smp, gns, t, grad, lr, **layout))(table)
        rowwise = jax.jit(lambda t, a: tpu_bridge.tc_adagrad_rows(rp, emb, smp, gns, t, a, grad, lr, eps, **layout))
        idx, new_rows, _ = rowwise(table, acc)
        landed = np.asarray(table).copy()
        landed[np.asarray(idx)] = np.asarray(new_rows)
        return np.asarray(sgd), landed, np.asarray(idx)

    (sgd, landed, idx), (sgd_p, landed_p, idx_p) = run(False), run(True)
    assert idx.shape == (1024,) and idx_p.shape == (1025,)
    np.testing.assert_array_equal(sgd_p, sgd)
    np.testing.assert_array_equal(landed_p, landed)
    assert not np.array_equal(sgd, np.asarray(table))  # the update did change rows
