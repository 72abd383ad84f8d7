"""The Pallas pooling kernel (interpreted on CPU) against XLA's segment sum, and when the TPU lookup takes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from tpurec.embedding.tensorcore import lookup_jax, pallas_pool, torch_ops, tpu_bridge  # noqa: E402

from .inputs import Case, csr_input, head, table, tail  # noqa: E402


@pytest.mark.parametrize("pad_values", [True, False])
def test_segment_sum_is_xlas_bit_for_bit_dropping_the_invalid_marker(pad_values):
    """Entries over several chunks and a ragged last one (read past the rows' end where they are not
    padded); samples in any order, repeated, and the invalid marker (== num_segments) dropped; each
    sample's rows summed in entry order, as XLA's."""
    rng = np.random.default_rng(3)
    n, segments, width = 300, 37, 128
    values = jnp.asarray(rng.standard_normal((n, width)).astype(np.float32))
    samples = jnp.asarray(rng.integers(0, segments + 1, n).astype(np.int32))
    got = pallas_pool.segment_sum(
        values, samples, num_segments=segments, chunk=128, interpret=True, pad_values=pad_values
    )
    want = jnp.zeros((segments + 1, width), jnp.float32).at[samples].add(values)[:segments]
    assert got.shape == (segments, width)
    assert bool((samples == segments).any()) and bool(jnp.abs(want).max() > 0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_segment_sum_of_fewer_rows_than_a_chunk_pads_them():
    """Under one chunk of rows the kernel pads them (no block past them all), pad_values or not."""
    rng = np.random.default_rng(4)
    values = jnp.asarray(rng.standard_normal((50, 128)).astype(np.float32))
    samples = jnp.asarray(rng.integers(0, 6, 50).astype(np.int32))
    got = pallas_pool.segment_sum(values, samples, num_segments=5, chunk=128, interpret=True)
    want = jnp.zeros((6, 128), jnp.float32).at[samples].add(values)[:5]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("accumulators", [2, 4, 8])
def test_segment_sum_over_several_accumulators_is_xlas_up_to_the_order(accumulators):
    """Entries added into 2 or 4 copies of the output in turn, folded at the end: XLA's sums up to
    float32 reordering; exact where every sample has at most one entry a copy (the test's first half)."""
    rng = np.random.default_rng(5)
    n, segments, width = 300, 37, 128
    values = jnp.asarray(rng.standard_normal((n, width)).astype(np.float32))
    samples = jnp.asarray(rng.integers(0, segments + 1, n).astype(np.int32))
    kw = {"num_segments": segments, "chunk": 128, "interpret": True, "accumulators": accumulators}
    got = pallas_pool.segment_sum(values, samples, **kw)
    want = jnp.zeros((segments + 1, width), jnp.float32).at[samples].add(values)[:segments]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(got - want).max()) < 1e-4 and float(jnp.abs(want).max()) > 1
    # integers: every order sums them exactly, so the fold must equal XLA's bit for bit
    ints = jnp.asarray(rng.integers(-8, 8, (n, width)).astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(pallas_pool.segment_sum(ints, samples, **kw)),
        np.asarray(jnp.zeros((segments + 1, width), jnp.float32).at[samples].add(ints)[:segments]),
    )
    assert pallas_pool.vmem_bytes(segments, width, 128, accumulators) > pallas_pool.vmem_bytes(segments, width, 128)


@pytest.mark.parametrize("accumulators", [1, 4])
def test_segment_sum_with_gains_scales_each_row_as_it_adds_it(accumulators):
    """gains given: the sums of row x gain, as XLA's segment sum of the scaled rows (the same products
    added in the same order with one accumulator; a fused multiply-add on CPU may round once less)."""
    rng = np.random.default_rng(7)
    n, segments, width = 300, 37, 128
    values = jnp.asarray(rng.standard_normal((n, width)).astype(np.float32))
    samples = jnp.asarray(rng.integers(0, segments + 1, n).astype(np.int32))
    gains = jnp.asarray(rng.standard_normal(n).astype(np.float32))
    kw = {"num_segments": segments, "chunk": 128, "interpret": True, "accumulators": accumulators}
    got = pallas_pool.segment_sum(values, samples, gains, **kw)
    want = jnp.zeros((segments + 1, width), jnp.float32).at[samples].add(values * gains[:, None])[:segments]
    unscaled = pallas_pool.segment_sum(values, samples, **kw)
    assert float(jnp.abs(got - unscaled).max()) > 0.1  # the gains were applied
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_segment_sum_refuses_accumulators_it_does_not_take():
    with pytest.raises(ValueError, match="accumulators 3"):
        pallas_pool.segment_sum(jnp.zeros((8, 128)), jnp.zeros(8, jnp.int32), num_segments=2, accumulators=3)


@pytest.mark.parametrize("case", [Case(num_sc=1, pooling="weighted", width=128), Case(num_sc=1, devices=3)], ids=str)
def test_the_lookup_with_the_pallas_pooling_equals_the_xla_one(case):
    gen = torch.Generator().manual_seed(11)
    csr = csr_input(case, gen)
    t = torch_ops.to_jax(table(case, gen))
    args = [torch_ops.to_jax(x) for x in head(csr)]
    batch, num_sc, parts = tail(csr)[:3]
    kw = {"device_batch_size": batch, "num_sc": num_sc, "num_partitions": parts}
    want = lookup_jax.lookup(*args, t, **kw)
    got = lookup_jax.lookup(*args, t, **kw, pallas_pool=True, interpret=True)
    assert float(jnp.abs(want).max()) > 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the gains applied inside the kernel: the same products and sums, up to XLA on CPU contracting
    # the kernel's `out + row * gain` into one fused multiply-add (a rounding fewer)
    scaled_in_pool = lookup_jax.lookup(*args, t, **kw, pallas_pool=True, interpret=True, pool_gains=True)
    np.testing.assert_allclose(np.asarray(scaled_in_pool), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_the_pallas_pooling_serves_what_fits_in_vmem_and_only_on_a_tpu():
    v5e = 128 << 20  # JAX's table for v5e
    assert pallas_pool.fits(16384, 128, v5e)
    assert pallas_pool.fits(16384, 512, v5e)  # two 32 MiB output buffers: within three quarters
    assert not pallas_pool.fits(16384, 1024, v5e)  # two 64 MiB ones: not
    assert not pallas_pool.fits(16384, 128, 16 << 20)  # v4's 16 MiB a core
    # a narrow row takes a whole lane tile in VMEM: dlrm-tiny's width-16 stack at batch 4,096 x 26
    # features failed to compile on v5e ("scoped allocation 53.00M, limit 29.13M") when it counted 16
    assert not pallas_pool.fits(106496, 16, v5e)
    assert pallas_pool.vmem_bytes(106496, 16) == pallas_pool.vmem_bytes(106496, 128)
    assert not pallas_pool.fits(8, 128, None)
    # no TPU in this process (CI, the emulated device's stand-in): the lookup keeps XLA's pooling
    assert tpu_bridge._vmem_capacity() is None


def test_a_tpu_seen_by_jax_takes_the_pallas_pooling_unless_turned_off(monkeypatch):
    from types import SimpleNamespace

    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setattr(pltpu, "get_tpu_info", lambda: SimpleNamespace(vmem_capacity_bytes=128 << 20))
    tpu_bridge._vmem_capacity.cache_clear()
    try:
        assert tpu_bridge._vmem_capacity() == 128 << 20
        tpu_bridge._vmem_capacity.cache_clear()
        monkeypatch.setenv("TPUREC_NO_PALLAS", "1")
        assert tpu_bridge._vmem_capacity() is None
    finally:
        tpu_bridge._vmem_capacity.cache_clear()


def test_the_lookups_pooling_defaults_and_its_environment_overrides(monkeypatch):
    from tpurec.errors import UserError

    monkeypatch.setattr(tpu_bridge, "_vmem_capacity", lambda: 128 << 20)
    for k in ("TPUREC_POOL_GAINS", "TPUREC_POOL_ACCUMULATORS"):
        monkeypatch.delenv(k, raising=False)
    # the measured defaults: gains inside the kernel, four output copies where they fit VMEM
    assert tpu_bridge.pool_options(16384, 128) == {"pallas_pool": True, "pool_gains": True, "pool_accumulators": 4}
    # three times the samples: four copies do not fit 96 of the 128 MiB, two do
    assert tpu_bridge.pool_options(49152, 128)["pool_accumulators"] == 2
    # not even one copy of 131,072 x 128: XLA's pooling, no options
    assert tpu_bridge.pool_options(131072, 128) == {"pallas_pool": False, "pool_gains": False, "pool_accumulators": 1}
    monkeypatch.setenv("TPUREC_POOL_GAINS", "0")
    monkeypatch.setenv("TPUREC_POOL_ACCUMULATORS", "1")
    assert tpu_bridge.pool_options(16384, 128) == {"pallas_pool": True, "pool_gains": False, "pool_accumulators": 1}
    monkeypatch.setenv("TPUREC_POOL_ACCUMULATORS", "8")
    assert tpu_bridge.pool_options(16384, 128)["pool_accumulators"] == 8
    monkeypatch.setenv("TPUREC_POOL_ACCUMULATORS", "3")
    with pytest.raises(UserError, match=r"TPUREC_POOL_ACCUMULATORS='3': expected one of \(1, 2, 4, 8\)"):
        tpu_bridge.pool_options(16384, 128)
