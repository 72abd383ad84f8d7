"""The streamed update (Pallas, interpreted on CPU) against the XLA update it replaces: SGD and
row-wise Adagrad over a table of several blocks, slots over several SMEM chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from tpurec.embedding.tensorcore import pallas_stream, torch_ops, update_jax  # noqa: E402
from tpurec.embedding.tensorcore.csr_jax import decode  # noqa: E402

from .compare import assert_close_f32  # noqa: E402
from .inputs import Case, csr_input, head, table, tail  # noqa: E402


def _entries(case: Case, csr, rows: int):
    batch, num_sc, parts = tail(csr)[:3]
    rp, emb, smp, gns = (torch_ops.to_jax(x) for x in head(csr))
    e = decode(rp, emb, smp, gns, num_rows=rows, device_batch_size=batch, num_sc=num_sc, num_partitions=parts)
    return e, (rp, emb, smp, gns), dict(num_rows=rows, device_batch_size=batch, num_sc=num_sc, num_partitions=parts)


# row-wise Adagrad's SMEM state: ~20 s interpreted, in make test-all; SGD's pass keeps the kernel's walk here
@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("rowwise_adagrad", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "case", [Case(num_sc=1, pooling="weighted", rows=2560, batch=40, features=4, width=128)], ids=str
)
def test_the_streamed_update_equals_xlas(monkeypatch, optimizer, case):
    monkeypatch.setattr(pallas_stream, "CHUNK", 64)  # the slots over several chunks
    gen = torch.Generator().manual_seed(3)
    csr = csr_input(case, gen)
    t0 = table(case, gen)
    rows = t0.shape[0]
    grad = torch.randn(case.device_batch_size, case.width, generator=gen)
    e, head_j, kw = _entries(case, csr, rows)
    assert int(e.valid.sum()) > 64 and rows > 2 * pallas_stream.BLOCK and rows % pallas_stream.BLOCK  # a partial block
    g = torch_ops.to_jax(grad)
    lr, eps = jnp.float32(0.1), jnp.float32(1e-6)
    r, gr = update_jax.row_gradients(*head_j, g, width=case.width, **kw)
    acc0 = jnp.asarray(np.random.default_rng(1).random(rows).astype(np.float32))
    if optimizer == "sgd":
        want = np.asarray(update_jax.sgd(torch_ops.to_jax(t0.clone()), r, gr, lr))
        got, acc = pallas_stream.update(torch_ops.to_jax(t0.clone()), None, e, g, lr, optimizer="sgd", interpret=True)
        assert acc is None
    else:
        want, want_acc = (np.asarray(x) for x in update_jax.adagrad(torch_ops.to_jax(t0.clone()), acc0, r, gr, lr, eps))
        got, acc = pallas_stream.update(
            torch_ops.to_jax(t0.clone()), jnp.array(acc0), e, g, lr, eps, optimizer=optimizer, interpret=True
        )
        assert_close_f32(torch.from_numpy(np.array(acc)), torch.from_numpy(want_acc))
        assert int((np.asarray(acc) != np.asarray(acc0)).sum()) == int((np.asarray(r) < rows).sum())
    touched = np.asarray(t0.numpy() != want).any(axis=1)
    assert touched.sum() > 100 and (~touched).sum() > 100  # rows in several blocks moved, others kept
    assert_close_f32(torch.from_numpy(np.array(got)), torch.from_numpy(want))  # FMAs on CPU: compare.py
    np.testing.assert_array_equal(np.asarray(got)[~touched], t0.numpy()[~touched])


def test_streaming_serves_tables_near_the_rows_a_batch_touches():
    v5e = 128 << 20
    assert pallas_stream.fits(1_000_000, 16384, 128, v5e)  # a partial last block too
    assert not pallas_stream.fits(1 << 20, pallas_stream.MAX_SAMPLES + 1, 16, v5e)
    assert not pallas_stream.fits(1 << 20, 16384, 128, None)
    # 1M x 128 f32 (1 GB read and written, ~1.25 ms) against 131,072 slots x 20 ns (2.6 ms): stream
    assert pallas_stream.worth_streaming(1_000_000, 131_072, 512)
    assert not pallas_stream.worth_streaming(40_000_000, 131_072, 512)


def test_the_stream_is_taken_on_a_tpu_only_when_asked_for(monkeypatch):
    import jax

    from tpurec.embedding.tensorcore import tpu_bridge

    t = jax.ShapeDtypeStruct((1_000_000, 128), jnp.float32)
    monkeypatch.setattr(tpu_bridge, "_vmem_capacity", lambda: 128 << 20)  # a v5e, as JAX reports it
    monkeypatch.delenv("TPUREC_PALLAS_STREAM", raising=False)
    assert not tpu_bridge.stream_chosen(t, 131_072, 16384, num_sc=1)  # off by default (docs/tensorcore.md)
    monkeypatch.setenv("TPUREC_PALLAS_STREAM", "1")
    assert tpu_bridge.stream_chosen(t, 131_072, 16384, num_sc=1)
    assert not tpu_bridge.stream_chosen(t, 131_072, 16384, num_sc=4)  # rows not adjacent
    assert not tpu_bridge.stream_chosen(t, 1_000, 16384, num_sc=1)  # a pass over 1M rows for 1,000 ids
    bf16 = jax.ShapeDtypeStruct((1_000_000, 128), jnp.bfloat16)
    assert not tpu_bridge.stream_chosen(bf16, 131_072, 16384, num_sc=1)  # FBGEMM's bf16 rounding: XLA's path


def test_the_bridge_streams_a_narrower_gradient_as_the_xla_update_takes_it():
    """The gradient may be narrower than the table's storage (columns padded past a table's dim): those
    columns get zero gradients on both paths."""
    from tpurec.embedding.tensorcore import tpu_bridge

    case = Case(num_sc=1, pooling="sum", rows=1200, batch=16, features=3, width=16)
    gen = torch.Generator().manual_seed(8)
    csr = csr_input(case, gen)
    t0 = table(case, gen)
    grad = torch.randn(case.device_batch_size, 8, generator=gen)  # dim 8 of a 16-wide storage row
    e, head_j, kw = _entries(case, csr, t0.shape[0])
    layout = (kw["device_batch_size"], kw["num_sc"], kw["num_partitions"])
    lr = jnp.float32(0.1)
    got, _ = tpu_bridge._streamed(
        head_j, torch_ops.to_jax(t0.clone()), None, torch_ops.to_jax(grad), lr, None, layout, interpret=True
    )
    r, gr = update_jax.row_gradients(*head_j, torch_ops.to_jax(grad), width=case.width, **kw)
    want = update_jax.sgd(torch_ops.to_jax(t0.clone()), r, gr, lr)
    got_t, want_t = torch.from_numpy(np.array(got)), torch.from_numpy(np.array(want))
    assert not torch.equal(want_t, t0) and torch.equal(got_t[:, 8:], t0[:, 8:])
    assert_close_f32(got_t, want_t)
