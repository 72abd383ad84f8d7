"""The JAX programs behind the torch ops' kernel signatures, and `on_cpu()` to run them for CPU tensors.

Each function here takes exactly the arguments of its op's kernel (`ops.sparse_dense_matmul`, each
optimizer module's `op`), hands the tensors to JAX without copying (DLPack: a CPU tensor and the
JAX array share memory), runs the jitted program (`programs.py`) and writes the results back in
place, as the reference kernels mutate the table and state. The inputs are only read: the new table
and state are fresh arrays, copied into torch's tensors once the program has finished.

`on_cpu()` makes these the ops' CPU kernels for a `with` block. The reference is then no longer
the CPU kernel (`ops.reference_is_cpu_kernel()` is False), so the kernel's direct CPU step and its
batch-major shortcut (which call the reference without the op, `cpu_path.writes_final_layout`) are
skipped and every lookup and update goes through the ops, so through JAX.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import torch
from torch import Tensor

from tpurec.embedding import ops
from tpurec.embedding.input_checks import check_csr, check_distinct_ids
from tpurec.embedding.optimizers import adagrad, adam, sgd
from tpurec.embedding.tensorcore import programs


def to_jax(t: Tensor) -> jax.Array:
    """The tensor as a JAX array sharing its memory (a contiguous copy first if it is not)."""
    return jax.dlpack.from_dlpack(t.detach().contiguous())


def to_torch(a: jax.Array) -> Tensor:
    """The array as a tensor sharing its memory, once the program writing it has finished (JAX
    dispatches asynchronously; the copies into torch's tensors must read the finished values)."""
    return torch.utils.dlpack.from_dlpack(a.block_until_ready())


def _scalar(value: float) -> jax.Array:
    # a runtime argument, not a constant of the program: a new value never recompiles
    return jax.numpy.asarray(np.float32(value))


def device_layout_grad(grad: Tensor, device_batch_size: int, num_sc: int, width: int) -> Tensor:
    """The op's [device_batch_size, width] gradient from `reference.batch_major_grad`'s
    [features, batch, dim] view (which the reference takes on CPU): samples interleaved per
    SparseCore (`kernel_input.stacked_samples`), padded samples and storage columns zero."""
    features, batch, dim = grad.shape
    padded = device_batch_size // max(features, 1)
    out = grad.new_zeros(features, padded, width, dtype=torch.float32)
    out[:, :batch, :dim] = grad
    return out.view(features, num_sc, padded // num_sc, width).transpose(0, 1).reshape(device_batch_size, width)


def _head(
    op: str,
    tensors: tuple[Tensor, Tensor, Tensor, Tensor],
    table: Tensor,
    grad: Tensor,
    device_batch_size: int,
    num_sc: int,
    parts: int,
) -> tuple[programs.Csr, jax.Array]:
    """The checked CSR buffers and the gradient as JAX arrays (the gradient in the op's layout)."""
    check_csr(op, *tensors, device_batch_size, num_sc, parts)
    if grad.dim() == 3:
        grad = device_layout_grad(grad, device_batch_size, num_sc, table.shape[1])
    rp, emb, smp, gns = (to_jax(t) for t in tensors)
    return (rp, emb, smp, gns), to_jax(grad.to(torch.float32))


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
    """`torch.ops.tpurec.sparse_dense_matmul`: [device_batch_size, width] float32."""
    csr = (row_pointers, embedding_ids, sample_ids, gains)
    check_csr("sparse_dense_matmul", *csr, device_batch_size, num_sc_per_device, num_partitions)
    run = programs.program("lookup", device_batch_size, num_sc_per_device, num_partitions)
    return to_torch(run(*(to_jax(t) for t in csr), to_jax(embedding_table)))


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
    """`torch.ops.tpurec.sparse_dense_matmul_grad_with_sgd`, in place."""
    layout = (device_batch_size, num_sc_per_device, num_partitions)
    csr, grad = _head(
        "update", (row_pointers, embedding_ids, sample_ids, gains), embedding_table, activations_grad, *layout
    )
    check_distinct_ids(embedding_ids, row_pointers, *layout[1:], max_unique_ids_per_partition)
    new_table = programs.program("sgd", *layout, max_unique_ids_per_partition)(
        csr, to_jax(embedding_table), grad, _scalar(learning_rate)
    )
    embedding_table.copy_(to_torch(new_table))


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
    """`torch.ops.tpurec.sparse_dense_matmul_grad_with_adagrad` (row-wise for a 1-D accumulator), in place."""
    layout = (device_batch_size, num_sc_per_device, num_partitions)
    csr, grad = _head(
        "update", (row_pointers, embedding_ids, sample_ids, gains), embedding_table, activations_grad, *layout
    )
    check_distinct_ids(embedding_ids, row_pointers, *layout[1:], max_unique_ids_per_partition)
    new_table, new_acc = programs.program("adagrad", *layout, max_unique_ids_per_partition)(
        csr, to_jax(embedding_table), to_jax(accumulator), grad, _scalar(learning_rate), _scalar(epsilon)
    )
    embedding_table.copy_(to_torch(new_table))
    accumulator.copy_(to_torch(new_acc))


def adam_scalars(alpha_t: float, beta_1: float, beta_2: float, epsilon: float) -> tuple[jax.Array, ...]:
    """Adam's runtime scalars, with 1 - beta formed in float64 and rounded once, as the reference's
    `add_(grad, alpha=1 - beta1)` does (1 - float32(beta) may be an ulp away)."""
    values = (alpha_t, beta_1, beta_2, epsilon, 1.0 - beta_1, 1.0 - beta_2)
    return tuple(_scalar(v) for v in values)


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
    """`torch.ops.tpurec.sparse_dense_matmul_grad_with_adam`, in place."""
    layout = (device_batch_size, num_sc_per_device, num_partitions)
    csr, grad = _head(
        "update", (row_pointers, embedding_ids, sample_ids, gains), embedding_table, activations_grad, *layout
    )
    check_distinct_ids(embedding_ids, row_pointers, *layout[1:], max_unique_ids_per_partition)
    new_table, new_m, new_v = programs.program("adam", *layout, max_unique_ids_per_partition)(
        csr,
        to_jax(embedding_table),
        to_jax(momentum),
        to_jax(velocity),
        grad,
        adam_scalars(alpha_t, beta_1, beta_2, epsilon),
    )
    embedding_table.copy_(to_torch(new_table))
    momentum.copy_(to_torch(new_m))
    velocity.copy_(to_torch(new_v))


def kernels() -> dict[Any, Callable[..., Any]]:
    """{tpurec op: its JAX kernel}, as `tpurec.embedding.tpu.sparsecore_kernels()` maps the ops to TorchTPU's."""
    return {
        ops.sparse_dense_matmul: lookup,
        sgd.op: sgd_update,
        adagrad.op: adagrad_update,
        adam.op: adam_update,
    }


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """These kernels as the ops' CPU kernels inside the block; the previous ones restored after."""
    saved = {}
    for op, kernel in kernels().items():
        saved[op] = op._backend_fns.get("cpu")
        op.register_kernel("cpu")(kernel)
    try:
        yield
    finally:
        for op, fn in saved.items():
            # the saved kernel itself, not registered again (register_kernel would wrap it once more):
            # `ops.reference_is_cpu_kernel` recognises the reference by identity
            if fn is not None:
                op._backend_fns["cpu"] = fn
