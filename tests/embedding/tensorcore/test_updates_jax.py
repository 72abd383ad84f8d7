"""The JAX row gradients and fused updates against the CPU reference ops: every optimizer over three
successive steps that carry their table and state, float32 and BF16 tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

pytest.importorskip("jax")

from tpurec.embedding import ops  # noqa: E402
from tpurec.embedding import reference as R  # noqa: E402
from tpurec.embedding.optimizers import adagrad, adam, sgd  # noqa: E402
from tpurec.embedding.tensorcore import torch_ops, update_jax  # noqa: E402
from tpurec.errors import UserError  # noqa: E402

from .compare import assert_close_f32, assert_close_table  # noqa: E402
from .inputs import Case, csr_input, head, table, tail  # noqa: E402

LR, EPS, BETAS = 0.1, 1e-6, (0.9, 0.999)


def _states(name: str, rows: int, width: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(9)  # nonzero starting state: the update reads it
    return {
        "sgd": [],
        "adagrad": [torch.rand(rows, width, generator=gen)],
        "rowwise_adagrad": [torch.rand(rows, generator=gen)],
        "adam": [torch.randn(rows, width, generator=gen) * 0.1, torch.rand(rows, width, generator=gen) * 0.01],
    }[name]


def _step(name: str, kernels: tuple[Callable, ...], csr, tensors: list[torch.Tensor], grad: torch.Tensor, t: int):
    sgd_k, adagrad_k, adam_k = kernels
    if name == "sgd":
        sgd_k(*head(csr), *tensors, grad, LR, *tail(csr))
    elif name in ("adagrad", "rowwise_adagrad"):
        adagrad_k(*head(csr), *tensors, grad, LR, EPS, *tail(csr))
    else:
        adam_k(*head(csr), *tensors, grad, adam.alpha_t(LR, *BETAS, t), *BETAS, EPS, *tail(csr))


REFERENCE = (sgd.op, adagrad.op, adam.op)
JAX = (torch_ops.sgd_update, torch_ops.adagrad_update, torch_ops.adam_update)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize(
    "case",
    [
        Case(num_sc=1, pooling="weighted"),
        Case(num_sc=1, devices=3, pooling="sum"),  # one SparseCore, padding between partitions: no sort
        Case(num_sc=4, pooling="mean", batch=13),
        Case(num_sc=2, devices=2, pooling="sum"),
        Case(num_sc=2, pooling="weighted", dtype=torch.bfloat16),
    ],
    ids=str,
)
def test_three_steps_equal_the_reference_op(name, case):
    gen = torch.Generator().manual_seed(5)
    t0 = table(case, gen)
    states = _states(name, *t0.shape)
    want = [t0.clone(), *(s.clone() for s in states)]
    got = [t0.clone(), *(s.clone() for s in states)]
    for t in (1, 2, 3):
        csr = csr_input(case, gen)
        grad = torch.randn(case.device_batch_size, case.width, generator=gen)
        _step(name, REFERENCE, csr, want, grad, t)
        _step(name, JAX, csr, got, grad, t)
        assert not torch.equal(want[0], t0), "the step should have moved the table"
        assert_close_table(got[0], want[0])
        for g, w in zip(got[1:], want[1:]):
            assert_close_f32(g, w)


def _jax_row_gradients(case: Case, csr, t: torch.Tensor, grad: torch.Tensor, max_unique: int | None = None):
    rp, emb, smp, gns = (torch_ops.to_jax(x) for x in head(csr))
    return update_jax.row_gradients(
        rp,
        emb,
        smp,
        gns,
        torch_ops.to_jax(grad),
        num_rows=t.shape[0],
        width=t.shape[1],
        device_batch_size=case.device_batch_size,
        num_sc=case.num_sc,
        num_partitions=case.partitions,
        max_unique=max_unique,
    )


@pytest.mark.parametrize(
    "case", [Case(num_sc=1), Case(num_sc=1, devices=3), Case(num_sc=4, pooling="weighted", batch=13)], ids=str
)
@pytest.mark.parametrize("inf_row", [None, 0], ids=["finite", "inf-in-sample-0"])
def test_row_gradients_equal_the_reference(case, inf_row):
    """An infinite gradient reaches only the rows its sample touched (the padding slots read sample 0
    and must add nothing to the row before them)."""
    gen = torch.Generator().manual_seed(2)
    csr = csr_input(case, gen)
    t = table(case, gen)
    grad = torch.randn(case.device_batch_size, case.width, generator=gen)
    if inf_row is not None:
        grad[inf_row] = float("inf")
    want_rows, want_grads = ops.row_gradients(*head(csr), t, grad, *tail(csr)[:3])
    rows, grads = _jax_row_gradients(case, csr, t, grad)
    rows_t, grads_t = torch.from_dlpack(rows).long(), torch.from_dlpack(grads)
    n = want_rows.numel()
    assert torch.equal(rows_t[:n], want_rows)
    assert bool((rows_t[n:] == t.shape[0]).all()) and bool((grads_t[n:] == 0).all())
    assert torch.equal(grads_t[:n].isnan(), want_grads.isnan())
    assert_close_f32(grads_t[:n].nan_to_num(), want_grads.nan_to_num())


def test_the_kernel_layout_gradient_view_is_taken_as_the_reference_takes_it():
    """On CPU the update ops may get `reference.batch_major_grad`'s [features, batch, dim] view."""
    case = Case(num_sc=4, pooling="weighted", batch=13, features=2, width=16)
    gen = torch.Generator().manual_seed(4)
    csr = csr_input(case, gen)
    t0 = table(case, gen)
    view = R.batch_major_grad(torch.randn(case.batch, case.features * 8, generator=gen), case.features)  # dim 8 < 16
    want, got = t0.clone(), t0.clone()
    sgd.op(*head(csr), want, view, LR, *tail(csr))
    torch_ops.sgd_update(*head(csr), got, view, LR, *tail(csr))
    assert_close_table(got, want)
    assert torch.equal(got[:, 8:], t0[:, 8:])  # storage columns past dim: zero gradients


def _tightest_unique_limit(csr) -> int:
    """The least max_unique_ids_per_partition this input is within (the check refuses one less)."""
    from tpurec.embedding.input_checks import check_distinct_ids

    for m in range(1, csr.max_ids_per_partition + 1):
        try:
            check_distinct_ids(csr.embedding_ids, csr.row_pointers, csr.num_sc_per_device, csr.num_partitions, m)
            return m
        except UserError:
            continue
    raise AssertionError("no limit up to max_ids_per_partition holds the input")


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("case", [Case(num_sc=1, devices=3), Case(num_sc=4, pooling="weighted", batch=13)], ids=str)
def test_updates_at_the_tightest_unique_limit_equal_the_reference(name, case):
    """The optimizer touches only as many rows as the unique-id limit allows (far fewer than the slots
    here): at the least limit the input is within, every touched row still takes its whole step."""
    gen = torch.Generator().manual_seed(8)
    t0 = table(case, gen)
    states = _states(name, *t0.shape)
    want = [t0.clone(), *(s.clone() for s in states)]
    got = [t0.clone(), *(s.clone() for s in states)]
    for t in (1, 2):
        csr = csr_input(case, gen)
        tight = replace(csr, max_unique_ids_per_partition=_tightest_unique_limit(csr))
        bound = update_jax.distinct_rows_bound(case.num_sc, case.partitions, tight.max_unique_ids_per_partition)
        assert bound * 3 < csr.embedding_ids.numel(), "the limit should cut the rows well below the slots"
        grad = torch.randn(case.device_batch_size, case.width, generator=gen)
        _step(name, REFERENCE, csr, want, grad, t)
        _step(name, JAX, tight, got, grad, t)
        assert_close_table(got[0], want[0])
        for g, w in zip(got[1:], want[1:]):
            assert_close_f32(g, w)
    over = replace(tight, max_unique_ids_per_partition=tight.max_unique_ids_per_partition - 1)
    with pytest.raises(UserError, match=r"partition \d+ holds \d+ distinct ids > max_unique_ids_per_partition"):
        _step(name, JAX, over, got, grad, 3)


def test_row_gradients_cut_to_the_distinct_rows_bound():
    """rows/grads are max_unique long: the distinct rows in order, then padding; the sums unchanged."""
    case = Case(num_sc=4, pooling="weighted", batch=13)
    gen = torch.Generator().manual_seed(3)
    csr = csr_input(case, gen)
    t = table(case, gen)
    grad = torch.randn(case.device_batch_size, case.width, generator=gen)
    want_rows, want_grads = ops.row_gradients(*head(csr), t, grad, *tail(csr)[:3])
    n = want_rows.numel()
    for k in (n, n + 5):
        rows, grads = _jax_row_gradients(case, csr, t, grad, max_unique=k)
        rows_t, grads_t = torch.from_dlpack(rows).long(), torch.from_dlpack(grads)
        assert rows_t.shape == (k,) and grads_t.shape == (k, case.width)
        assert torch.equal(rows_t[:n], want_rows) and bool((rows_t[n:] == t.shape[0]).all())
        assert_close_f32(grads_t[:n], want_grads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_in_range_land_as_the_scatter_does(dtype):
    """update_jax.in_range: the rows an update changed, with their padding slots (rows past the table,
    here interleaved as the Pallas merge leaves them) given the first real slot's row and values, so
    `index_copy_`/`.at[idx].set` with repeats writes what the dropping scatter writes."""
    import jax.numpy as jnp
    import numpy as np

    gen = np.random.default_rng(4)
    table = jnp.asarray(gen.standard_normal((12, 8), dtype=np.float32)).astype(dtype)
    acc = jnp.asarray(gen.random(12, dtype=np.float32))
    rows = jnp.asarray([12, 5, 12, 2, 9, 12], jnp.int32)
    grads = jnp.asarray(gen.standard_normal((6, 8), dtype=np.float32))
    lr, eps = jnp.float32(0.1), jnp.float32(1e-6)
    want = update_jax.adagrad(table, acc, rows, grads, lr, eps, rows_sorted=False)
    new = update_jax.adagrad_rows(table, acc, rows, grads, lr, eps, rows_sorted=False)
    idx, new_rows, new_acc = update_jax.in_range(rows, [table, acc], new)
    assert np.asarray(idx).tolist() == [5, 5, 5, 2, 9, 5] and new_rows.dtype == table.dtype
    got = (table.at[idx].set(new_rows), acc.at[idx].set(new_acc))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    # no real row: row 0 written as it is
    idx, none_rows, none_acc = update_jax.in_range(jnp.full(3, 12, jnp.int32), [table, acc], [new[0][:3], new[1][:3]])
    assert np.asarray(idx).tolist() == [0, 0, 0]
    as_f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(as_f32(table.at[idx].set(none_rows)), as_f32(table))
    np.testing.assert_array_equal(as_f32(acc.at[idx].set(none_acc)), as_f32(acc))
