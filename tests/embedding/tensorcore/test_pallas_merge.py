"""The Pallas merge of duplicate rows' gradients (interpreted on CPU) against XLA's merge in slot
order, and the updates that take its unsorted rows against the reference ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from tpurec.embedding.optimizers import adagrad, sgd  # noqa: E402
from tpurec.embedding.tensorcore import pallas_merge, torch_ops, update_jax  # noqa: E402

from .compare import assert_close_f32, assert_close_table  # noqa: E402
from .inputs import Case, csr_input, head, table, tail  # noqa: E402


def _row_gradients(case: Case, csr, t: torch.Tensor, grad: torch.Tensor, merge_kernel: bool):
    batch, num_sc, parts = tail(csr)[:3]
    rp, emb, smp, gns = (torch_ops.to_jax(x) for x in head(csr))
    return update_jax.row_gradients(
        rp,
        emb,
        smp,
        gns,
        torch_ops.to_jax(grad),
        num_rows=t.shape[0],
        width=t.shape[1],
        device_batch_size=batch,
        num_sc=num_sc,
        num_partitions=parts,
        merge_kernel=merge_kernel,
        interpret=merge_kernel,
    )


def test_running_sums_restart_at_each_start_and_skip_invalid_slots():
    rng = np.random.default_rng(1)
    batch, width, n = 6, 128, 300  # three chunks of 128, the last ragged
    grad = rng.standard_normal((batch, width)).astype(np.float32)
    samples = rng.integers(0, batch, n).astype(np.int32)
    # gains whose products are exact: XLA on CPU contracts the add into an FMA (module docstring)
    gains = rng.choice(np.array([0.25, 0.5, 1.0, -1.0, 2.0], np.float32), n)
    valid = rng.random(n) < 0.8
    start = rng.random(n) < 0.2
    flags = np.where(valid, pallas_merge.VALID, 0) | np.where(start, pallas_merge.START, 0)
    got = np.asarray(
        pallas_merge.running_sums(
            jnp.asarray(grad), jnp.asarray(samples), jnp.asarray(gains), jnp.asarray(flags), chunk=128, interpret=True
        )
    )
    acc, want = np.zeros(width, np.float32), np.zeros((n, width), np.float32)
    for k in range(n):
        if valid[k]:
            acc = (np.zeros(width, np.float32) if start[k] else acc) + grad[samples[k]] * gains[k]
        want[k] = acc
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", [Case(num_sc=1, pooling="weighted"), Case(num_sc=1, devices=3)], ids=str)
@pytest.mark.parametrize("inf_row", [None, 0], ids=["finite", "inf-in-sample-0"])
def test_each_row_gets_xlas_merged_gradient_bit_for_bit_at_one_slot(case, inf_row):
    gen = torch.Generator().manual_seed(2)
    csr = csr_input(case, gen)
    t = table(case, gen)
    grad = torch.randn(case.device_batch_size, case.width, generator=gen)
    if inf_row is not None:
        grad[inf_row] = float("inf")
    want_rows, want_grads = (torch.from_dlpack(x) for x in _row_gradients(case, csr, t, grad, merge_kernel=False))
    rows, grads = (torch.from_dlpack(x) for x in _row_gradients(case, csr, t, grad, merge_kernel=True))
    kept = rows != t.shape[0]
    order = torch.argsort(rows[kept])
    n = int((want_rows != t.shape[0]).sum())
    assert n > 1 and int(kept.sum()) == n
    assert torch.equal(rows[kept][order], want_rows[:n])
    if case.pooling == "weighted":  # gains of any value: an FMA on CPU may round the last bit apart
        assert torch.equal(grads[kept][order].isnan(), want_grads[:n].isnan())
        assert_close_f32(grads[kept][order].nan_to_num(), want_grads[:n].nan_to_num())
    else:
        assert torch.equal(grads[kept][order], want_grads[:n])  # inf and nan where XLA's has them


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
def test_an_update_on_the_unsorted_rows_equals_the_reference_op(name):
    case = Case(num_sc=1, devices=3, pooling="weighted")
    gen = torch.Generator().manual_seed(7)
    csr = csr_input(case, gen)
    t0 = table(case, gen)
    grad = torch.randn(case.device_batch_size, case.width, generator=gen)
    rows, grads = _row_gradients(case, csr, t0, grad, merge_kernel=True)
    want = t0.clone()
    if name == "sgd":
        sgd.op(*head(csr), want, grad, 0.1, *tail(csr))
        got = torch.from_dlpack(update_jax.sgd(torch_ops.to_jax(t0.clone()), rows, grads, 0.1, rows_sorted=False))
    else:
        acc0 = torch.rand(t0.shape[0], generator=gen)
        want_acc = acc0.clone()
        adagrad.op(*head(csr), want, want_acc, grad, 0.1, 1e-6, *tail(csr))
        new, acc = update_jax.adagrad(
            torch_ops.to_jax(t0.clone()), torch_ops.to_jax(acc0), rows, grads, 0.1, 1e-6, rows_sorted=False
        )
        got = torch.from_dlpack(new)
        assert_close_f32(torch.from_dlpack(acc), want_acc)
    assert not torch.equal(want, t0)
    assert_close_table(got, want)


def test_the_merge_serves_what_fits_in_vmem():
    v5e = 128 << 20  # JAX's table for v5e
    assert pallas_merge.fits(16384, 128, v5e)  # two 8 MiB gradient buffers
    assert pallas_merge.fits(16384, 16, v5e) and pallas_merge.vmem_bytes(16384, 16) == pallas_merge.vmem_bytes(
        16384, 128
    )
    assert not pallas_merge.fits(16384 * 8, 256, v5e)  # two 128 MiB ones
    assert not pallas_merge.fits(8, 128, None)


def test_the_merge_is_taken_on_a_tpu_only_when_asked_for(monkeypatch):
    from tpurec.embedding.tensorcore import tpu_bridge

    monkeypatch.setattr(tpu_bridge, "_vmem_capacity", lambda: 128 << 20)  # a v5e, as JAX reports it
    monkeypatch.delenv("TPUREC_PALLAS_MERGE", raising=False)
    assert not tpu_bridge.merge_chosen(16384, 128, num_sc=1)  # off by default (docs/tensorcore.md)
    monkeypatch.setenv("TPUREC_PALLAS_MERGE", "1")
    assert tpu_bridge.merge_chosen(16384, 128, num_sc=1)
    assert not tpu_bridge.merge_chosen(16384, 128, num_sc=4)  # rows not adjacent: XLA's sorted merge
    assert not tpu_bridge.merge_chosen(16384 * 8, 256, num_sc=1)  # gradient past VMEM
    monkeypatch.setattr(tpu_bridge, "_vmem_capacity", lambda: None)  # CPU
    assert not tpu_bridge.merge_chosen(64, 128, num_sc=1)
