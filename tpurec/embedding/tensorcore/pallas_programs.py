"""The TensorCore ops with their row traffic in Pallas kernels: the same results as programs.py's XLA
programs (same decode, same row gradients, same float32 arithmetic), different data movement.

Lookup: decode, then `pallas_lookup.pooled_lookup` (row DMAs summed in VMEM). Updates: the row
gradients as update_jax computes them, then the optimizer's step added to the table in place by
`pallas_rows.add_rows`; a row-wise accumulator (one float per row) stays an XLA gather/scatter.
Float32 tables only (`supports`): a bf16 row is half a sublane, and the XLA programs serve it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpurec.embedding.tensorcore import pallas_lookup, pallas_rows, update_jax
from tpurec.embedding.tensorcore.csr_jax import decode

Layout = tuple[int, int, int]  # (device_batch_size, num_sc, num_partitions)
Csr = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # (row_pointers, embedding_ids, sample_ids, gains)


def supports(table_dtype: jnp.dtype, width: int) -> bool:
    """Whether these programs take a table: float32 rows of whole lanes (width a multiple of 128 is
    not required: a narrower row is one DMA of its width)."""
    return jnp.dtype(table_dtype) == jnp.float32 and width > 0


def lookup(layout: Layout, csr: Csr, table: jax.Array, *, interpret: bool = False, chunk: int = 512) -> jax.Array:
    batch, num_sc, parts = layout
    e = decode(*csr, num_rows=table.shape[0], device_batch_size=batch, num_sc=num_sc, num_partitions=parts)
    rows = jnp.where(e.valid, e.rows, 0)
    return pallas_lookup.pooled_lookup(
        rows, e.samples, e.gains, table, device_batch_size=batch, chunk=chunk, interpret=interpret
    )


def _row_gradients(layout: Layout, csr: Csr, table: jax.Array, grad: jax.Array) -> tuple[jax.Array, jax.Array]:
    batch, num_sc, parts = layout
    return update_jax.row_gradients(
        *csr,
        grad,
        num_rows=table.shape[0],
        width=table.shape[1],
        device_batch_size=batch,
        num_sc=num_sc,
        num_partitions=parts,
    )


def sgd(
    layout: Layout, csr: Csr, table: jax.Array, grad: jax.Array, lr: jax.Array, *, interpret: bool = False
) -> jax.Array:
    rows, g = _row_gradients(layout, csr, table, grad)
    return pallas_rows.add_rows(table, rows, g * -jnp.asarray(lr, jnp.float32), interpret=interpret)


def adagrad(
    layout: Layout,
    csr: Csr,
    table: jax.Array,
    accumulator: jax.Array,
    grad: jax.Array,
    lr: jax.Array,
    eps: jax.Array,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Row-wise (1-D accumulator) or element-wise Adagrad: update_jax.adagrad's arithmetic."""
    rows, g = _row_gradients(layout, csr, table, grad)
    lr, eps = jnp.asarray(lr, jnp.float32), jnp.asarray(eps, jnp.float32)
    if accumulator.ndim == 1:
        norm_sq = jnp.square(jnp.sqrt(jnp.sum(g * g, axis=1)))
        acc = update_jax._gather(accumulator, rows) + norm_sq / jnp.float32(g.shape[1])
        step = g * (-lr / (jnp.sqrt(acc) + eps))[:, None]
    else:
        acc = pallas_rows.gather_rows(accumulator, rows, interpret=interpret) + g * g
        step = (g * -lr) / (jnp.sqrt(acc) + eps)
    table = pallas_rows.add_rows(table, rows, step, interpret=interpret)
    return table, update_jax._scatter(accumulator, rows, acc)
