"""The jitted programs the torch kernels run: one per op and static configuration, cached.

Static: the counts the layout is read with (device batch, SparseCores, partitions), for the updates
the unique-id limit (it sizes the rows the optimizer touches) and, through the argument shapes, the
buffer sizes and table shape. Runtime: the buffers, table, state and every
hyper-parameter (learning rate, eps, Adam's alpha_t and betas), so a learning-rate schedule or
Adam's bias correction never recompiles. `trace_counts` counts each program's traces (a Python side
effect runs only while tracing): what the no-recompile test reads.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax

from tpurec.embedding.tensorcore import lookup_jax, update_jax

# program name -> times traced (a trace is a compile for a new shape or static configuration)
trace_counts: Counter[str] = Counter()

# (device_batch_size, num_sc, num_partitions, max_unique_ids_per_partition; 0 for the lookup)
Layout = tuple[int, int, int, int]
Csr = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # (row_pointers, embedding_ids, sample_ids, gains)


def _lookup(
    layout: Layout, rp: jax.Array, emb: jax.Array, smp: jax.Array, gns: jax.Array, table: jax.Array
) -> jax.Array:
    trace_counts["lookup"] += 1
    batch, num_sc, parts, _ = layout
    return lookup_jax.lookup(rp, emb, smp, gns, table, device_batch_size=batch, num_sc=num_sc, num_partitions=parts)


def _row_gradients(layout: Layout, csr: Csr, table: jax.Array, grad: jax.Array) -> tuple[jax.Array, jax.Array]:
    return update_jax.layout_row_gradients(csr, grad, table.shape, layout)


def _sgd(layout: Layout, csr: Csr, table: jax.Array, grad: jax.Array, lr: jax.Array) -> jax.Array:
    trace_counts["sgd"] += 1
    rows, g = _row_gradients(layout, csr, table, grad)
    return update_jax.sgd(table, rows, g, lr)


def _adagrad(
    layout: Layout,
    csr: Csr,
    table: jax.Array,
    accumulator: jax.Array,
    grad: jax.Array,
    lr: jax.Array,
    eps: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    trace_counts["adagrad"] += 1
    rows, g = _row_gradients(layout, csr, table, grad)
    return update_jax.adagrad(table, accumulator, rows, g, lr, eps)


def _adam(
    layout: Layout,
    csr: Csr,
    table: jax.Array,
    momentum: jax.Array,
    velocity: jax.Array,
    grad: jax.Array,
    scalars: tuple[jax.Array, ...],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """scalars: (alpha_t, beta_1, beta_2, epsilon, 1 - beta_1, 1 - beta_2)."""
    trace_counts["adam"] += 1
    rows, g = _row_gradients(layout, csr, table, grad)
    return update_jax.adam(table, momentum, velocity, rows, g, *scalars)


_PROGRAMS: dict[str, Callable[..., Any]] = {"lookup": _lookup, "sgd": _sgd, "adagrad": _adagrad, "adam": _adam}


@functools.cache
def program(
    name: str, device_batch_size: int, num_sc: int, num_partitions: int, max_unique_ids_per_partition: int = 0
) -> Callable[..., Any]:
    """The jitted program `name` for one layout (the updates' with their unique-id limit); jax.jit's
    own cache then keys it on shapes and dtypes. No buffer is donated: on CPU the inputs alias
    torch's tensors (torch_ops.py)."""
    layout = (device_batch_size, num_sc, num_partitions, max_unique_ids_per_partition)
    return jax.jit(functools.partial(_PROGRAMS[name], layout))
