"""The contenders of `tpurec bench tpu-kernels`, per op: tpurec's TensorCore programs and plain JAX.

Each `*_pair(cell, inputs, interpret)` returns {"tpurec": call, "xla": call}; an update's call carries
its donated table (and state) from one call to the next, so no table is copied per step. Both start
from the same table, so their first results compare (`equal_work`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tpurec.bench.tpu_kernel_cells import Cell
from tpurec.embedding import pool_vmem
from tpurec.embedding.tensorcore import lookup_jax

LR, EPS = 0.01, 1e-8


def _table(cell: Cell) -> jax.Array:
    return jax.random.normal(jax.random.key(0), (cell.rows, cell.width), jnp.float32).astype(cell.dtype)


def _grad(cell: Cell) -> jax.Array:
    return jax.random.normal(jax.random.key(1), (cell.batch, cell.width), jnp.float32)


def _bridge() -> Any:
    """The chip's own programs (tpu_bridge: the Pallas merge where it serves; XLA's without a TPU)."""
    from tpurec.embedding.tensorcore import tpu_bridge

    return tpu_bridge


def _pool_options(cell: Cell, interpret: bool) -> dict[str, Any]:
    """The pooling the train step's lookup gets on this chip (tpu_bridge.pool_options), or on CPU the
    interpreted kernel with the same default options."""
    if interpret:
        return {"pallas_pool": True, "pool_gains": True, "pool_accumulators": pool_vmem.ACCUMULATORS}
    from tpurec.embedding.tensorcore import tpu_bridge

    return tpu_bridge.pool_options(cell.batch, cell.width)


def lookup_pair(cell: Cell, inp: dict[str, Any], interpret: bool) -> dict[str, Callable[[], Any]]:
    batch, num_sc, parts = inp["layout"][:3]
    table = _table(cell)
    ours = jax.jit(
        functools.partial(
            lookup_jax.lookup,
            device_batch_size=batch,
            num_sc=num_sc,
            num_partitions=parts,
            **_pool_options(cell, interpret),
            interpret=interpret,
        )
    )

    @jax.jit
    def xla(ids: jax.Array, samples: jax.Array, t: jax.Array) -> jax.Array:
        return jax.ops.segment_sum(jnp.take(t, ids, axis=0).astype(jnp.float32), samples, num_segments=cell.batch)

    return {"tpurec": lambda: ours(*inp["csr"], table), "xla": lambda: xla(inp["ids"], inp["samples"], table)}


def sgd_pair(cell: Cell, inp: dict[str, Any], interpret: bool) -> dict[str, Callable[[], Any]]:
    grad, lr = _grad(cell), jnp.float32(LR)
    ours = jax.jit(lambda csr, t, g, lr: _bridge().tc_sgd(*csr, t, g, lr, *inp["layout"]), donate_argnums=1)

    @functools.partial(jax.jit, donate_argnums=0)
    def xla(t: jax.Array, ids: jax.Array, samples: jax.Array) -> jax.Array:
        return t.at[ids].add((grad[samples] * -lr).astype(t.dtype))

    state = {"tpurec": _table(cell), "xla": _table(cell)}

    def step_ours() -> jax.Array:
        state["tpurec"] = ours(inp["csr"], state["tpurec"], grad, lr)
        return state["tpurec"]

    def step_xla() -> jax.Array:
        state["xla"] = xla(state["xla"], inp["ids"], inp["samples"])
        return state["xla"]

    return {"tpurec": step_ours, "xla": step_xla}


def rowwise_adagrad_pair(cell: Cell, inp: dict[str, Any], interpret: bool) -> dict[str, Callable[[], Any]]:
    """Plain JAX's row-wise Adagrad: the gradient summed into a dense [rows, width] array (what merges
    duplicate ids without a sort), the accumulator and table updated everywhere (zero steps elsewhere)."""
    grad, lr, eps = _grad(cell), jnp.float32(LR), jnp.float32(EPS)
    ours = jax.jit(
        lambda csr, t, acc, g, lr, eps: _bridge().tc_adagrad(*csr, t, acc, g, lr, eps, *inp["layout"]),
        donate_argnums=(1, 2),
    )

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def xla(t: jax.Array, acc: jax.Array, ids: jax.Array, samples: jax.Array) -> tuple[jax.Array, jax.Array]:
        g = jax.ops.segment_sum(grad[samples], ids, num_segments=cell.rows)
        acc = acc + jnp.mean(g * g, axis=1)
        new = t.astype(jnp.float32) + g * (-lr / (jnp.sqrt(acc) + eps))[:, None]
        return new.astype(t.dtype), acc

    zeros = functools.partial(jnp.zeros, (cell.rows,), jnp.float32)
    state = {"tpurec": (_table(cell), zeros()), "xla": (_table(cell), zeros())}

    def step_ours() -> jax.Array:
        state["tpurec"] = ours(inp["csr"], *state["tpurec"], grad, lr, eps)
        return state["tpurec"][0]

    def step_xla() -> jax.Array:
        state["xla"] = xla(*state["xla"], inp["ids"], inp["samples"])
        return state["xla"][0]

    return {"tpurec": step_ours, "xla": step_xla}


def equal_work(op: str, calls: dict[str, Callable[[], Any]]) -> float:
    """Max |tpurec - xla| of the first call's results (both from the same table): float32 rounding
    apart (sums in another order; bf16 tables an ulp), the two did the same work."""
    ours, theirs = calls["tpurec"](), calls["xla"]()
    return float(jnp.max(jnp.abs(ours.astype(jnp.float32) - theirs.astype(jnp.float32))))
