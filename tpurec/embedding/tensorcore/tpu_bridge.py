"""The TensorCore kernel on a TPU: the JAX programs run on torch's device tensors through TorchTPU.

The one module that touches TorchTPU's private JAX bridge, `torch_tpu._internal.pallas.jax_op`
(read from the torch_tpu 0.2.0 wheel, `torch_tpu/_internal/pallas/pallas.py`; marked experimental
there). `jax_op(name)(fn)` registers a `torch.library.custom_op` whose TPU kernel runs `fn` (lowered
with `jax.export`) on the tensors' device buffers. Every argument must be annotated: `jax.Array`
arguments are runtime inputs, every other argument is static (part of the compiled program). So
the learning rate and the other hyper-parameters travel as 0-dim device tensors (`tpu_scalar`):
a schedule or Adam's bias correction compiles nothing new; the layout counts are static ints.

The updates return new tables and state, copied back into the module's storage (`copy_`): the
tables' per-table views (state_dict() aliases them) keep pointing at the live storage. Donating the
old buffers and swapping storage (`set_`) measured 3.4 ms against 5.0 ms for a 1M x 128 f32 SGD step
on v5e (docs/results.md), but would leave those views on a freed buffer; see docs/tensorcore.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch import Tensor

from tpurec.embedding import ops, pool_vmem
from tpurec.embedding.optimizers import adagrad, adam, sgd
from tpurec.embedding.optimizers.base import recorded
from tpurec.embedding.step_scalars import tpu_scalar
from tpurec.embedding.tensorcore import lookup_jax, pallas_merge, pallas_stream, update_jax
from tpurec.embedding.tensorcore.csr_jax import decode
from tpurec.embedding.tensorcore.gather_count import fast_gather_count
from tpurec.errors import UserError
from tpurec.runtime import env_flags

# torch_tpu's version the bridge was read from; `tpurec env` reports the installed one.
BRIDGE_READ_FROM = "torch_tpu 0.2.0, torch_tpu/_internal/pallas/pallas.py (jax_op)"


def _row_gradients(
    rp: jax.Array, emb: jax.Array, smp: jax.Array, gns: jax.Array, table: jax.Array, grad: jax.Array, layout: tuple
) -> tuple[jax.Array, jax.Array, bool]:
    """(rows, gradients, whether the rows are sorted): duplicates merged by the Pallas kernel where
    asked for and it serves (one SparseCore, the gradient within VMEM), else by XLA, their rows then
    as many as the unique-id limit allows (layout: batch, SparseCores, partitions, that limit).

    Opt-in (TPUREC_PALLAS_MERGE=1): on v5e it took SGD's update from 7.4 to 6.2 ms through torch,
    bit-equal, but the one `tpurec train` run with it (batch 256, 200 steps) took 71.7 s against 32.3
    without it, same AUC, cause not yet known (docs/results.md, session 29)."""
    merge = merge_chosen(layout[0], table.shape[1], layout[1])
    rows, g = update_jax.layout_row_gradients((rp, emb, smp, gns), grad, table.shape, layout, merge_kernel=merge)
    if env_flags.is_on("TPUREC_UPDATE_PAD"):
        rows, g = _padded_rows(rows, g, table.shape[0], table.shape[1])
    return rows, g, not merge


def _padded_rows(rows: jax.Array, g: jax.Array, num_rows: int, width: int) -> tuple[jax.Array, jax.Array]:
    """The update's rows with padding rows (num_rows: every gather reads zeros, every scatter drops
    them; the rows route lands them on the first real row's value, update_jax.in_range) appended up
    to a count v5e's row gather runs fast at (gather_count). Opt-in, TPUREC_UPDATE_PAD=1: whether
    the update's scatters follow the gather's count rule is not measured yet (chip step
    `scatter-rule`). Padding rows sort after every real row, so sorted rows stay sorted."""
    k = rows.shape[0]
    extra = fast_gather_count(k, width) - k
    if not extra:
        return rows, g
    return jnp.pad(rows, (0, extra), constant_values=num_rows), jnp.pad(g, ((0, extra), (0, 0)))


def merge_chosen(device_batch_size: int, width: int, num_sc: int) -> bool:
    """Whether the update's rows are merged by `pallas_merge` (see `_row_gradients`)."""
    asked = os.environ.get("TPUREC_PALLAS_MERGE", "") not in ("", "0")
    return asked and num_sc == 1 and pallas_merge.fits(device_batch_size, width, _vmem_capacity())


# The functions jax_op wraps: annotated as it requires (jax.Array = runtime input, int = static).
def tc_lookup(
    rp: jax.Array,
    emb: jax.Array,
    smp: jax.Array,
    gns: jax.Array,
    table: jax.Array,
    device_batch_size: int,
    num_sc: int,
    num_partitions: int,
) -> jax.Array:
    return lookup_jax.lookup(
        rp,
        emb,
        smp,
        gns,
        table,
        device_batch_size=device_batch_size,
        num_sc=num_sc,
        num_partitions=num_partitions,
        **pool_options(device_batch_size, table.shape[1]),
        pad_gather=os.environ.get("TPUREC_GATHER_PAD", "1") not in ("", "0"),  # A/B: 0 keeps the count
    )


def pool_options(device_batch_size: int, width: int) -> dict:
    """The lookup's pooling: the Pallas kernel where its output fits VMEM, with the gains applied
    inside it and `pool_vmem.ACCUMULATORS` output copies (fewer where they do not fit VMEM): both
    faster in every cell of probe 15 on v5e (docs/results.md, sessions 40-41). A/B overrides:
    TPUREC_POOL_GAINS=0 (a pass over the gathered rows instead), TPUREC_POOL_ACCUMULATORS=1|2|4|8."""
    gains = os.environ.get("TPUREC_POOL_GAINS", "1") not in ("", "0")
    raw = os.environ.get("TPUREC_POOL_ACCUMULATORS", "") or str(pool_vmem.ACCUMULATORS)
    if raw not in {str(a) for a in pool_vmem.ACCUMULATOR_CHOICES}:
        raise UserError(f"TPUREC_POOL_ACCUMULATORS={raw!r}: expected one of {pool_vmem.ACCUMULATOR_CHOICES}")
    acc = pool_vmem.accumulators_that_fit(device_batch_size, width, _vmem_capacity(), int(raw))
    return {"pallas_pool": acc > 0, "pool_gains": gains and acc > 0, "pool_accumulators": max(acc, 1)}


@functools.cache
def _vmem_capacity() -> int | None:
    """VMEM bytes of the chip JAX lowers for in this process (JAX's table, jax/_src/pallas/mosaic/
    tpu_info.py: 128 MiB on v5e), or None where JAX has no TPU (the emulated device's stand-in runs
    these programs on CPU, where a Pallas kernel cannot run) or TPUREC_NO_PALLAS=1: the pooling and
    the update's merge are then XLA's."""
    from jax.experimental.pallas import tpu as pltpu

    if os.environ.get("TPUREC_NO_PALLAS", "") not in ("", "0"):  # XLA's programs only (a fallback, A/B runs)
        return None
    try:
        return int(pltpu.get_tpu_info().vmem_capacity_bytes)
    except (ValueError, RuntimeError):  # "Unsupported TPU device kind: cpu"
        return None


def stream_chosen(table: jax.Array, slots: int, device_batch_size: int, num_sc: int) -> bool:
    """Whether the update streams the table (`pallas_stream`): opt-in (TPUREC_PALLAS_STREAM=1) until
    a chip run measures it; one SparseCore, a float32 table, within VMEM, worth a pass over the table."""
    num_rows, width = table.shape
    return (
        os.environ.get("TPUREC_PALLAS_STREAM", "") not in ("", "0")
        and num_sc == 1
        and table.dtype == jnp.float32
        and pallas_stream.fits(num_rows, device_batch_size, width, _vmem_capacity())
        and pallas_stream.worth_streaming(num_rows, slots, width * 4)
    )


def _streamed(
    csr: tuple[jax.Array, ...],
    table: jax.Array,
    acc: jax.Array | None,
    grad: jax.Array,
    lr: jax.Array,
    eps: Any,
    layout: tuple,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """The update by `pallas_stream` (interpret: on CPU, tests)."""
    batch, num_sc, parts = layout[:3]
    e = decode(*csr, num_rows=table.shape[0], device_batch_size=batch, num_sc=num_sc, num_partitions=parts)
    grad = grad.astype(jnp.float32)
    if grad.shape[1] < table.shape[1]:  # storage columns past the gradient's: zero gradients
        grad = jnp.pad(grad, ((0, 0), (0, table.shape[1] - grad.shape[1])))
    optimizer = "sgd" if acc is None else "rowwise_adagrad"
    return pallas_stream.update(table, acc, e, grad, lr, eps, optimizer=optimizer, interpret=interpret)


def tc_sgd(
    rp: jax.Array,
    emb: jax.Array,
    smp: jax.Array,
    gns: jax.Array,
    table: jax.Array,
    grad: jax.Array,
    lr: jax.Array,
    device_batch_size: int,
    num_sc: int,
    num_partitions: int,
    max_unique_ids_per_partition: int,
) -> jax.Array:
    layout = (device_batch_size, num_sc, num_partitions, max_unique_ids_per_partition)
    if stream_chosen(table, emb.shape[0], device_batch_size, num_sc):
        return _streamed((rp, emb, smp, gns), table, None, grad, lr, None, layout)[0]
    rows, g, rows_sorted = _row_gradients(rp, emb, smp, gns, table, grad, layout)
    return update_jax.sgd(table, rows, g, lr, rows_sorted=rows_sorted)


def tc_adagrad(
    rp: jax.Array,
    emb: jax.Array,
    smp: jax.Array,
    gns: jax.Array,
    table: jax.Array,
    accumulator: jax.Array,
    grad: jax.Array,
    lr: jax.Array,
    eps: jax.Array,
    device_batch_size: int,
    num_sc: int,
    num_partitions: int,
    max_unique_ids_per_partition: int,
) -> tuple[jax.Array, jax.Array]:
    layout = (device_batch_size, num_sc, num_partitions, max_unique_ids_per_partition)
    if accumulator.ndim == 1 and stream_chosen(table, emb.shape[0], device_batch_size, num_sc):
        new_table, new_acc = _streamed((rp, emb, smp, gns), table, accumulator, grad, lr, eps, layout)
        assert new_acc is not None
        return new_table, new_acc
    rows, g, rows_sorted = _row_gradients(rp, emb, smp, gns, table, grad, layout)
    return update_jax.adagrad(table, accumulator, rows, g, lr, eps, rows_sorted=rows_sorted)


def tc_adam(
    rp: jax.Array,
    emb: jax.Array,
    smp: jax.Array,
    gns: jax.Array,
    table: jax.Array,
    momentum: jax.Array,
    velocity: jax.Array,
    grad: jax.Array,
    alpha_t: jax.Array,
    beta_1: jax.Array,
    beta_2: jax.Array,
    epsilon: jax.Array,
    one_minus_beta_1: jax.Array,
    one_minus_beta_2: jax.Array,
    device_batch_size: int,
    num_sc: int,
    num_partitions: int,
    max_unique_ids_per_partition: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    layout = (device_batch_size, num_sc, num_partitions, max_unique_ids_per_partition)
    rows, g, rows_sorted = _row_gradients(rp, emb, smp, gns, table, grad, layout)
    scalars = (alpha_t, beta_1, beta_2, epsilon, one_minus_beta_1, one_minus_beta_2)
    return update_jax.adam(table, momentum, velocity, rows, g, *scalars, rows_sorted=rows_sorted)


# The same updates returning only the rows they change (`rows_route`): (indices, new rows, new state
# rows), every index in range (update_jax.in_range), for an in-place `index_copy_` into the storage.
def tc_sgd_rows(
    rp: jax.Array,
    emb: jax.Array,
    smp: jax.Array,
    gns: jax.Array,
    table: jax.Array,
    grad: jax.Array,
    lr: jax.Array,
    device_batch_size: int,
    num_sc: int,
    num_partitions: int,
    max_unique_ids_per_partition: int,
) -> tuple[jax.Array, jax.Array]:
    layout = (device_batch_size, num_sc, num_partitions, max_unique_ids_per_partition)
    rows, g, rows_sorted = _row_gradients(rp, emb, smp, gns, table, grad, layout)
    new = update_jax.sgd_rows(table, rows, g, lr, rows_sorted=rows_sorted)
    idx, new = update_jax.in_range(rows, [table], [new])
    return idx, new


def tc_adagrad_rows(
    rp: jax.Array,
    emb: jax.Array,
    smp: jax.Array,
    gns: jax.Array,
    table: jax.Array,
    accumulator: jax.Array,
    grad: jax.Array,
    lr: jax.Array,
    eps: jax.Array,
    device_batch_size: int,
    num_sc: int,
    num_partitions: int,
    max_unique_ids_per_partition: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    layout = (device_batch_size, num_sc, num_partitions, max_unique_ids_per_partition)
    rows, g, rows_sorted = _row_gradients(rp, emb, smp, gns, table, grad, layout)
    new = update_jax.adagrad_rows(table, accumulator, rows, g, lr, eps, rows_sorted=rows_sorted)
    idx, new_rows, new_acc = update_jax.in_range(rows, [table, accumulator], new)
    return idx, new_rows, new_acc


def tc_adam_rows(
    rp: jax.Array,
    emb: jax.Array,
    smp: jax.Array,
    gns: jax.Array,
    table: jax.Array,
    momentum: jax.Array,
    velocity: jax.Array,
    grad: jax.Array,
    alpha_t: jax.Array,
    beta_1: jax.Array,
    beta_2: jax.Array,
    epsilon: jax.Array,
    one_minus_beta_1: jax.Array,
    one_minus_beta_2: jax.Array,
    device_batch_size: int,
    num_sc: int,
    num_partitions: int,
    max_unique_ids_per_partition: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    layout = (device_batch_size, num_sc, num_partitions, max_unique_ids_per_partition)
    rows, g, rows_sorted = _row_gradients(rp, emb, smp, gns, table, grad, layout)
    scalars = (alpha_t, beta_1, beta_2, epsilon, one_minus_beta_1, one_minus_beta_2)
    new = update_jax.adam_rows(table, momentum, velocity, rows, g, *scalars, rows_sorted=rows_sorted)
    idx, new_rows, m, v = update_jax.in_range(rows, [table, momentum, velocity], new)
    return idx, new_rows, m, v


ROWS_ENV = "TPUREC_TC_UPDATE"


def rows_route() -> bool:
    """Whether the updates land by `index_copy_` of their rows (the default) instead of the new
    table's `copy_` (TPUREC_TC_UPDATE=copy: a table-sized copy inside the program and another in the
    `copy_`). On v5e the rows route took the MLPerf step's update from 162.7 to 132.0 ms and the most
    HBM in use with compiled arches from 15.2 to 12.8 GB (docs/results.md, session 36). Those programs
    never stream the table: TPUREC_PALLAS_STREAM=1 (a whole new table) takes the copy route unless
    TPUREC_TC_UPDATE says otherwise."""
    value = env_flags.get(ROWS_ENV)
    if value not in (None, "", "rows", "copy"):
        raise UserError(f"{ROWS_ENV}={value!r}: expected 'rows' (the default) or 'copy'")
    if not value:
        return not env_flags.is_on("TPUREC_PALLAS_STREAM")
    return value == "rows"


def _land(idx: Tensor, pairs: list[tuple[Tensor, Tensor]]) -> None:
    """The rows into each storage tensor, in place (its views, state_dict()'s, stay live)."""
    index = idx.to(torch.int64)
    for storage, rows in pairs:
        storage.index_copy_(0, index, rows)


# A stand-in for TorchTPU's jax_op (the emulated device's, tpurec/emulation/jax_bridge.py), or None.
_JAX_OP: Callable[[str], Callable[[Callable[..., Any]], Any]] | None = None


def use_jax_op(jax_op: Callable[[str], Callable[[Callable[..., Any]], Any]] | None) -> None:
    """Register the programs through `jax_op` instead of TorchTPU's (None: TorchTPU's again)."""
    global _JAX_OP
    _JAX_OP = jax_op
    _registered.cache_clear()


@functools.cache
def _registered() -> SimpleNamespace:
    """The JAX programs registered as torch ops on TorchTPU's device (once per process)."""
    jax_op: Any = _JAX_OP
    if jax_op is None:
        from torch_tpu._internal.pallas import jax_op as torchtpu_jax_op  # private: this module alone calls it

        jax_op = torchtpu_jax_op

    fns = {"lookup": tc_lookup, "sgd": tc_sgd, "adagrad": tc_adagrad, "adam": tc_adam}
    fns.update({"sgd_rows": tc_sgd_rows, "adagrad_rows": tc_adagrad_rows, "adam_rows": tc_adam_rows})
    return SimpleNamespace(**{name: jax_op(f"tpurec_tensorcore::{name}")(fn) for name, fn in fns.items()})


def device_ops() -> Any:
    """The registered ops; under `record_tpu_calls()` each call's compile key is recorded
    (`tpurec selftest --device tpu` counts the programs a few steps need)."""
    return recorded(_registered())


def _grad(grad: Tensor, table: Tensor, layout: tuple[int, ...]) -> Tensor:
    from tpurec.embedding.tensorcore.torch_ops import device_layout_grad

    if grad.dim() == 3:  # the CPU reference's batch-major view; the op's own layout is [batch, width]
        grad = device_layout_grad(grad, layout[0], layout[1], table.shape[1])
    return grad.to(torch.float32).contiguous()


def lookup(
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    embedding_table: Tensor,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
) -> Tensor:
    """`torch.ops.tpurec.sparse_dense_matmul`'s TPU kernel on a TensorCore-only chip."""
    return device_ops().lookup(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        embedding_table,
        device_batch_size,
        num_sc_per_device,
        num_partitions,
    )


def sgd_update(
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    embedding_table: Tensor,
    activations_grad: Tensor,
    learning_rate: float,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    computation_name: str = "tpurec_sgd",
) -> None:
    layout = (device_batch_size, num_sc_per_device, num_partitions, max_unique_ids_per_partition)
    csr = (row_pointers, embedding_ids, sample_ids, gains)
    grad = _grad(activations_grad, embedding_table, layout)
    lr = tpu_scalar(learning_rate, embedding_table, "lr")
    if rows_route():
        idx, new_rows = device_ops().sgd_rows(*csr, embedding_table, grad, lr, *layout)
        _land(idx, [(embedding_table, new_rows)])
        return
    embedding_table.copy_(device_ops().sgd(*csr, embedding_table, grad, lr, *layout))


def adagrad_update(
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    embedding_table: Tensor,
    accumulator: Tensor,
    activations_grad: Tensor,
    learning_rate: float,
    epsilon: float,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    computation_name: str = "tpurec_adagrad",
) -> None:
    layout = (device_batch_size, num_sc_per_device, num_partitions, max_unique_ids_per_partition)
    csr = (row_pointers, embedding_ids, sample_ids, gains)
    grad = _grad(activations_grad, embedding_table, layout)
    lr, eps = tpu_scalar(learning_rate, embedding_table, "lr"), tpu_scalar(epsilon, embedding_table, "eps")
    if rows_route():
        idx, new_rows, new_acc = device_ops().adagrad_rows(*csr, embedding_table, accumulator, grad, lr, eps, *layout)
        _land(idx, [(embedding_table, new_rows), (accumulator, new_acc)])
        return
    new_table, new_acc = device_ops().adagrad(*csr, embedding_table, accumulator, grad, lr, eps, *layout)
    embedding_table.copy_(new_table)
    accumulator.copy_(new_acc)


def adam_update(
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    embedding_table: Tensor,
    momentum: Tensor,
    velocity: Tensor,
    activations_grad: Tensor,
    alpha_t: float,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    computation_name: str = "tpurec_adam",
) -> None:
    layout = (device_batch_size, num_sc_per_device, num_partitions, max_unique_ids_per_partition)
    csr = (row_pointers, embedding_ids, sample_ids, gains)
    grad = _grad(activations_grad, embedding_table, layout)
    # 1 - beta in float64, rounded once, as the reference does (torch_ops.adam_scalars)
    values = (alpha_t, beta_1, beta_2, epsilon, 1.0 - beta_1, 1.0 - beta_2)
    scalars = [tpu_scalar(v, embedding_table, name) for v, name in zip(values, adam.DEVICE_SCALARS)]
    if rows_route():  # (Adam never streams)
        idx, *new = device_ops().adam_rows(*csr, embedding_table, momentum, velocity, grad, *scalars, *layout)
        _land(idx, list(zip((embedding_table, momentum, velocity), new)))
        return
    new_table, new_m, new_v = device_ops().adam(*csr, embedding_table, momentum, velocity, grad, *scalars, *layout)
    embedding_table.copy_(new_table)
    momentum.copy_(new_m)
    velocity.copy_(new_v)


def kernels() -> dict[Any, Callable[..., Any]]:
    """{tpurec op: its TensorCore TPU kernel} (`tpu.sparsecore_kernels()`: the SparseCore ones)."""
    return {ops.sparse_dense_matmul: lookup, sgd.op: sgd_update, adagrad.op: adagrad_update, adam.op: adam_update}
