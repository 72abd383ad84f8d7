"""`preprocess_tables`'s compiled route (csr_build.tables_csr) against its numpy route, bit for bit.

The numpy route is itself checked against jax-tpu-embedding's preprocessing and a per-id reference
(test_preprocess_oracle.py, test_csr_reference.py); here every buffer and figure of the compiled
route must equal it: row pointers, ids, samples, gains (float32 sums in input order), limits, stats.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpurec.embedding import csr_build
from tpurec.embedding.preprocess import preprocess_tables
from tpurec.errors import UserError

pytestmark = pytest.mark.skipif(not csr_build.available(), reason="numba not installed")


def _inputs(rng, tables: int, batch: int, pooling: int, rows: int, gains: str) -> list:
    out = []
    for t in range(tables):
        n = 0 if (t == 1 and tables > 2) else batch * pooling  # an empty table among others
        ids = torch.from_numpy(rng.zipf(1.2, n).astype(np.int64) % rows)
        sample = torch.from_numpy(rng.integers(0, batch, n))
        if gains == "ones":
            g = torch.ones(n)
        elif gains == "halves":
            g = torch.full((n,), 0.5)
        else:  # per-id weights: their float32 sums depend on the order they are added in
            g = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        out.append((ids, sample, g))
    return out


def _both(monkeypatch, inputs, **kw) -> tuple[list, list]:
    compiled = preprocess_tables(inputs, **kw)
    monkeypatch.setenv("TPUREC_NO_NUMBA", "1")
    try:
        numpy_route = preprocess_tables(inputs, **kw)
    finally:
        monkeypatch.delenv("TPUREC_NO_NUMBA")
    return compiled, numpy_route


def _assert_equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (csr_a, st_a), (csr_b, st_b) in zip(a, b):
        for f in ("row_pointers", "embedding_ids", "sample_ids"):
            assert torch.equal(getattr(csr_a, f), getattr(csr_b, f)), f
        assert torch.equal(csr_a.gains.view(torch.int32), csr_b.gains.view(torch.int32))  # bits: NaN padding too
        assert (csr_a.max_ids_per_partition, csr_a.max_unique_ids_per_partition) == (
            csr_b.max_ids_per_partition,
            csr_b.max_unique_ids_per_partition,
        )
        assert torch.equal(st_a.ids_per_partition, st_b.ids_per_partition)
        assert torch.equal(st_a.unique_ids_per_partition, st_b.unique_ids_per_partition)
        assert st_a.required_buffer_size_per_sc == st_b.required_buffer_size_per_sc
        assert st_a.dropped_id_count == st_b.dropped_id_count


@pytest.mark.parametrize("gains", ["ones", "halves", "weights"])
@pytest.mark.parametrize("pooling", [1, 7])
@pytest.mark.parametrize("devices", [1, 3])  # 3: 12 partitions, not a power of two
@pytest.mark.parametrize("limits", [None, "fixed"])
def test_compiled_route_equals_numpy_route(monkeypatch, gains, pooling, devices, limits):
    rng = np.random.default_rng([pooling, devices, len(gains)])
    inputs = _inputs(rng, tables=5, batch=64, pooling=pooling, rows=5000, gains=gains)
    kw = dict(device_batch_size=64, num_sc_per_device=4, global_device_count=devices, num_threads=1)
    if limits == "fixed":  # above anything the batch needs: the buffers take the given shape
        kw.update(max_ids_per_partition=[40, 48, 56, 64, 72], max_unique_ids_per_partition=[40, 40, 48, 48, 64])
    compiled, numpy_route = _both(monkeypatch, inputs, **kw)
    _assert_equal(compiled, numpy_route)
    if limits == "fixed":
        assert compiled[4][0].max_ids_per_partition == 72
        assert compiled[4][0].embedding_ids.numel() == 4 * 72 * 4 * devices  # SCs x limit x partitions


def test_compiled_route_is_taken(monkeypatch):
    calls = []
    real = csr_build.tables_csr
    monkeypatch.setattr(csr_build, "tables_csr", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(0)
    preprocess_tables(_inputs(rng, 3, 32, 2, 100, "ones"), device_batch_size=32, num_sc_per_device=4, num_threads=1)
    assert calls == [1]


def test_over_a_limit_the_numpy_route_raises_or_drops(monkeypatch):
    rng = np.random.default_rng(1)
    inputs = _inputs(rng, tables=2, batch=64, pooling=8, rows=50, gains="weights")
    kw = dict(device_batch_size=64, num_sc_per_device=4, num_threads=1, max_ids_per_partition=8)
    with pytest.raises(UserError, match="max_ids_per_partition"):
        preprocess_tables(inputs, **kw)
    compiled, numpy_route = _both(monkeypatch, inputs, allow_id_dropping=True, **kw)
    _assert_equal(compiled, numpy_route)
    assert sum(st.dropped_id_count for _, st in compiled) > 0
