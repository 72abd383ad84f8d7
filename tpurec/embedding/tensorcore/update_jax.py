"""The fused backward-with-update ops in JAX: row gradients, then one optimizer step per touched row.

`row_gradients` is `reference.row_gradients_csr`'s: the touched physical rows in increasing order
and each row's float32 gradient, the sum over its entries of gain * activations_grad[sample]. Sizes
are static: the entries are sorted by row with an argsort over every COO slot, duplicates merged by
a sorted segment sum, and the unique rows padded with `num_rows`, an index past the table that
every scatter below drops (mode="drop"), so no dense table-sized gradient is formed. The rows are
`max_unique` long where given (the input's bound on distinct rows, `distinct_rows_bound`), else as
long as the slots: the optimizer then gathers and scatters that many rows, not one per slot (on
v5e the apply over every slot was two thirds of the update: docs/results.md, probe 10).
A stable sort keeps a row's entries in slot order (SparseCore by SparseCore, then by sample), the
reference's summation order.

The optimizer steps (`sgd`, `adagrad`, `adam`) are functional: they return the new table and state,
with only the touched rows changed, and follow each spec's `reference_update` operation by
operation (docs/kernels.md). A FP16/BF16 table rounds as `optimizers.base.add_to_rows`:
round_step=True (SGD, element-wise Adagrad) rounds the float32 step to the table's dtype first,
then the sum once; otherwise the sum is formed in float32 and rounded once.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from tpurec.embedding.tensorcore.csr_jax import Entries, decode

Scalar = jax.Array | float


def row_gradients(
    row_pointers: jax.Array,
    embedding_ids: jax.Array,
    sample_ids: jax.Array,
    gains: jax.Array,
    activations_grad: jax.Array,
    *,
    num_rows: int,
    width: int,
    device_batch_size: int,
    num_sc: int,
    num_partitions: int,
    max_unique: int | None = None,
    merge_kernel: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(rows int32 [k], grads float32 [k, width]): unique touched rows in increasing order, then
    num_rows padding (their gradients are zero); k = min(slots, max_unique), max_unique a bound on
    the distinct rows the input can hold (`distinct_rows_bound`; more would be lost: the host's
    limits guarantee it); activations_grad: [device_batch_size, <= width] (columns past its width,
    a table's storage padding, get zero gradients).

    merge_kernel (one SparseCore only; on CPU only with `interpret`): the rows merged by
    `pallas_merge`: each row's gradient at its last slot, num_rows at every other slot (with a
    partial sum there, which the optimizers' drop-padding gather and scatter ignore); the rows are
    then not sorted (pass rows_sorted=False to the optimizers) and [slots] long whatever max_unique."""
    e = decode(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        num_rows=num_rows,
        device_batch_size=device_batch_size,
        num_sc=num_sc,
        num_partitions=num_partitions,
    )
    n = e.rows.shape[0]
    k = n if max_unique is None else max(0, min(n, max_unique))
    grad = activations_grad.astype(jnp.float32)
    if grad.shape[1] < width:
        grad = jnp.pad(grad, ((0, 0), (0, width - grad.shape[1])))
    if num_sc == 1 and merge_kernel:
        return _merge_with_kernel(e, grad, num_rows, interpret)
    if num_sc == 1:
        return _merge_in_slot_order(e, grad, num_rows, k)
    order = jnp.argsort(e.rows, stable=True)  # invalid entries (row num_rows) sort last
    rows_sorted = e.rows[order]
    samples = jnp.where(e.valid, e.samples, 0)[order]  # invalid: sample 0 with gain 0
    contributions = jnp.where(e.valid[order][:, None], grad[samples] * e.gains[order][:, None], 0.0)
    starts = jnp.concatenate([jnp.ones(1, bool), rows_sorted[1:] != rows_sorted[:-1]]) if n else jnp.zeros(0, bool)
    segment = jnp.cumsum(starts.astype(jnp.int32)) - 1
    return _distinct(rows_sorted, starts, segment, contributions, num_rows, k)


def layout_row_gradients(
    csr: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    grad: jax.Array,
    table_shape: tuple[int, ...],
    layout: tuple[int, int, int, int],
    merge_kernel: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`row_gradients` for a table of `table_shape` and an update program's static layout (device
    batch, SparseCores, partitions, max_unique_ids_per_partition): rows as many as that limit allows."""
    batch, num_sc, parts, max_unique = layout
    return row_gradients(
        *csr,
        grad,
        num_rows=table_shape[0],
        width=table_shape[1],
        device_batch_size=batch,
        num_sc=num_sc,
        num_partitions=parts,
        max_unique=distinct_rows_bound(num_sc, parts, max_unique),
        merge_kernel=merge_kernel,
    )


def distinct_rows_bound(num_sc: int, num_partitions: int, max_unique_ids_per_partition: int) -> int:
    """The most distinct rows an input within `max_unique_ids_per_partition` can touch: each
    (SparseCore, partition) segment holds at most that many distinct ids, each one row."""
    return num_sc * num_partitions * max_unique_ids_per_partition


def _distinct(
    rows: jax.Array, starts: jax.Array, segment: jax.Array, contributions: jax.Array, num_rows: int, k: int
) -> tuple[jax.Array, jax.Array]:
    """The first k distinct rows (segment i's row at i, num_rows after the last) and their summed
    contributions; segments from k on are dropped (none, within the bound)."""
    grads = jax.ops.segment_sum(contributions, segment, num_segments=k, indices_are_sorted=True)
    out = jnp.full(k, num_rows, jnp.int32).at[jnp.where(starts, segment, k)].set(rows, mode="drop")
    return out, grads


def _merge_in_slot_order(e: Entries, grad: jax.Array, num_rows: int, k: int) -> tuple[jax.Array, jax.Array]:
    """`row_gradients` for one SparseCore's buffer, without a sort: there the valid entries' rows
    increase in slot order (partition p's segment holds rows p * rows_per_partition + id, sorted by
    id), so a row's entries are adjacent and a row starts where the slot before holds another row;
    the invalid slots between segments add exactly zero to the row before them. Same sums in the same
    order as the sorted path (a TPU sort of every slot was half the update's time: docs/results.md)."""
    n = e.rows.shape[0]
    before = jnp.concatenate([jnp.full(1, -1, jnp.int32), e.rows[:-1]]) if n else e.rows
    starts = e.valid & (e.rows != before)
    segment = jnp.cumsum(starts.astype(jnp.int32)) - 1  # invalid slots before the first row: -1, dropped
    samples = jnp.where(e.valid, e.samples, 0)
    contributions = jnp.where(e.valid[:, None], grad[samples] * e.gains[:, None], 0.0)
    return _distinct(e.rows, starts, segment, contributions, num_rows, k)


def _merge_with_kernel(e: Entries, grad: jax.Array, num_rows: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """`_merge_in_slot_order`'s sums by `pallas_merge.running_sums`, left at each row's last slot."""
    from tpurec.embedding.tensorcore import pallas_merge  # Pallas: only when asked for

    n = e.rows.shape[0]
    before = jnp.concatenate([jnp.full(1, -1, jnp.int32), e.rows[:-1]]) if n else e.rows
    after = jnp.concatenate([e.rows[1:], jnp.full(1, -1, jnp.int32)]) if n else e.rows
    starts, last = e.valid & (e.rows != before), e.valid & (e.rows != after)
    flags = jnp.where(e.valid, pallas_merge.VALID, 0) | jnp.where(starts, pallas_merge.START, 0)
    samples = jnp.where(e.valid, e.samples, 0)
    sums = pallas_merge.running_sums(grad, samples, e.gains, flags, interpret=interpret)
    return jnp.where(last, e.rows, num_rows), sums


def _gather(values: jax.Array, rows: jax.Array, rows_sorted: bool = True) -> jax.Array:
    """values[rows]; the padding rows (past the end) read zeros."""
    return values.at[rows].get(mode="fill", fill_value=0, indices_are_sorted=rows_sorted)


def _scatter(values: jax.Array, rows: jax.Array, new: jax.Array, rows_sorted: bool = True) -> jax.Array:
    """values with values[rows] = new; the padding rows (past the end) dropped."""
    return values.at[rows].set(new.astype(values.dtype), mode="drop", indices_are_sorted=rows_sorted)


def _new_rows(table: jax.Array, rows: jax.Array, step: jax.Array, round_step: bool, rows_sorted: bool) -> jax.Array:
    """The rows of `optimizers.base.add_to_rows` (float32 step), in the table's dtype."""
    old = _gather(table, rows, rows_sorted)
    if table.dtype != jnp.float32 and round_step:
        step = step.astype(table.dtype)  # FBGEMM's `w -= step` on a Half: the step rounded first
    return (old.astype(jnp.float32) + step.astype(jnp.float32)).astype(table.dtype)


def in_range(rows: jax.Array, tables: Sequence[jax.Array], values: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """(indices, *values) for an in-place `index_copy_` of the updated rows into `tables` (their
    first dimension): every index in range, a padding slot (a row past the tables) given the first
    real slot's row and values, so repeated indices write equal values; with no real slot, row 0
    with the tables' own row 0 (a write of what is there)."""
    valid = (rows >= 0) & (rows < tables[0].shape[0])
    first = jnp.argmax(valid)
    any_real = valid[first]
    out = [jnp.where(valid, rows, jnp.where(any_real, rows[first], 0))]
    for table, new in zip(tables, values, strict=True):
        fill = jnp.where(any_real, new[first], table[0].astype(new.dtype))
        mask = valid.reshape(valid.shape + (1,) * (new.ndim - 1))
        out.append(jnp.where(mask, new, fill))
    return tuple(out)


def _add_to_rows(table: jax.Array, rows: jax.Array, step: jax.Array, round_step: bool, rows_sorted: bool) -> jax.Array:
    """`optimizers.base.add_to_rows` (float32 step; rows unique apart from the padding)."""
    return _scatter(table, rows, _new_rows(table, rows, step, round_step, rows_sorted), rows_sorted)


def _f32(value: Scalar) -> jax.Array:
    return jnp.asarray(value, jnp.float32)


def sgd_rows(table: jax.Array, rows: jax.Array, grads: jax.Array, lr: Scalar, *, rows_sorted: bool = True) -> jax.Array:
    """The new rows: w -= lr * g (`sgd.reference_update`)."""
    return _new_rows(table, rows, grads * -_f32(lr), round_step=True, rows_sorted=rows_sorted)


def sgd(table: jax.Array, rows: jax.Array, grads: jax.Array, lr: Scalar, *, rows_sorted: bool = True) -> jax.Array:
    """The new table: w -= lr * g on the given rows (`sgd.reference_update`)."""
    return _scatter(table, rows, sgd_rows(table, rows, grads, lr, rows_sorted=rows_sorted), rows_sorted)


def adagrad_rows(
    table: jax.Array,
    accumulator: jax.Array,
    rows: jax.Array,
    grads: jax.Array,
    lr: Scalar,
    eps: Scalar,
    *,
    rows_sorted: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """(new rows, their new accumulator entries): element-wise Adagrad for a 2-D accumulator, row-wise
    for a 1-D one (`adagrad.reference_update`)."""
    lr, eps = _f32(lr), _f32(eps)
    if accumulator.ndim == 1:
        # the reference's mean(g*g) is a squared norm over the row: sqrt, square, / dim, as there
        norm_sq = jnp.square(jnp.sqrt(jnp.sum(grads * grads, axis=1)))
        acc = _gather(accumulator, rows, rows_sorted) + norm_sq / jnp.float32(grads.shape[1])
        step = grads * (-lr / (jnp.sqrt(acc) + eps))[:, None]
    else:
        acc = _gather(accumulator, rows, rows_sorted) + grads * grads
        step = (grads * -lr) / (jnp.sqrt(acc) + eps)
    new = _new_rows(table, rows, step, round_step=accumulator.ndim != 1, rows_sorted=rows_sorted)
    return new, acc.astype(accumulator.dtype)


def adagrad(
    table: jax.Array,
    accumulator: jax.Array,
    rows: jax.Array,
    grads: jax.Array,
    lr: Scalar,
    eps: Scalar,
    *,
    rows_sorted: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """(new table, new accumulator): `adagrad_rows` scattered."""
    new, acc = adagrad_rows(table, accumulator, rows, grads, lr, eps, rows_sorted=rows_sorted)
    return _scatter(table, rows, new, rows_sorted), _scatter(accumulator, rows, acc, rows_sorted)


def adam_rows(
    table: jax.Array,
    momentum: jax.Array,
    velocity: jax.Array,
    rows: jax.Array,
    grads: jax.Array,
    alpha_t: Scalar,
    beta_1: Scalar,
    beta_2: Scalar,
    epsilon: Scalar,
    one_minus_beta_1: Scalar | None = None,
    one_minus_beta_2: Scalar | None = None,
    *,
    rows_sorted: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(new rows, momentum rows, velocity rows): lazy Adam with the bias correction in alpha_t
    (`adam.reference_update`). one_minus_beta_*: 1 - beta as the reference rounds it (from the
    float64 beta, `torch_ops.adam_scalars`); by default 1 - beta in float32, which may differ by an ulp."""
    b1, b2 = _f32(beta_1), _f32(beta_2)
    c1 = 1 - b1 if one_minus_beta_1 is None else _f32(one_minus_beta_1)
    c2 = 1 - b2 if one_minus_beta_2 is None else _f32(one_minus_beta_2)
    m = _gather(momentum, rows, rows_sorted) * b1 + grads * c1
    v = _gather(velocity, rows, rows_sorted) * b2 + c2 * grads * grads
    step = (m * _f32(alpha_t)) / (jnp.sqrt(v) + _f32(epsilon))
    new = _new_rows(table, rows, -step, round_step=False, rows_sorted=rows_sorted)
    return new, m.astype(momentum.dtype), v.astype(velocity.dtype)


def adam(
    table: jax.Array,
    momentum: jax.Array,
    velocity: jax.Array,
    rows: jax.Array,
    grads: jax.Array,
    alpha_t: Scalar,
    beta_1: Scalar,
    beta_2: Scalar,
    epsilon: Scalar,
    one_minus_beta_1: Scalar | None = None,
    one_minus_beta_2: Scalar | None = None,
    *,
    rows_sorted: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(new table, momentum, velocity): `adam_rows` scattered."""
    scalars = (alpha_t, beta_1, beta_2, epsilon, one_minus_beta_1, one_minus_beta_2)
    new, m, v = adam_rows(table, momentum, velocity, rows, grads, *scalars, rows_sorted=rows_sorted)
    return (
        _scatter(table, rows, new, rows_sorted),
        _scatter(momentum, rows, m, rows_sorted),
        _scatter(velocity, rows, v, rows_sorted),
    )
