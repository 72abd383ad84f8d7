"""The SparseCore ops as torch.library custom ops: `torch.ops.tpurec.*`.

One interface, two backends. The CPU kernels registered here are the exact reference
(`tpurec.embedding.reference`); `tpurec.embedding.tpu` registers PrivateUse1 ("tpu") kernels that
call TorchTPU's `torch.ops.tpu._sparse_dense_matmul*` and is imported only on a TPU host. Fake
(meta) implementations let modules trace under FakeTensorMode and on the meta device.

Signatures mirror TorchTPU 0.2.0's ops, with two additions the reference needs and a SparseCore
knows from its hardware: `num_sc_per_device` and `num_partitions`. The update ops mutate the table
and optimizer state in place (TorchTPU's return updated copies; the adapter copies them back).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from tpurec.embedding import reference


# The forward and the fused backward of one step decode the same SparseCore input; keep the last
# few decodes, keyed by the identity of the (immutable once built) input tensors. The cache holds
# those tensors, so an id cannot be reused by a different tensor while its entry lives.
_DECODED: "OrderedDict[tuple, tuple]" = OrderedDict()
_DECODED_MAX = 8


def _decode(row_pointers, embedding_ids, sample_ids, gains, table, device_batch_size, num_sc, parts):
    key = (id(row_pointers), id(embedding_ids), id(sample_ids), id(gains), embedding_ids._version, gains._version,
           table.shape[0], device_batch_size, num_sc, parts)
    hit = _DECODED.get(key)
    if hit is not None and hit[0][1] is embedding_ids:
        _DECODED.move_to_end(key)
        return hit[1]
    decoded = reference.decode(
        row_pointers, embedding_ids, sample_ids, gains, table.shape[0] // parts, device_batch_size, num_sc, parts
    )
    _DECODED[key] = ((row_pointers, embedding_ids, sample_ids, gains), decoded)
    while len(_DECODED) > _DECODED_MAX:
        _DECODED.popitem(last=False)
    return decoded


@torch.library.custom_op("tpurec::sparse_dense_matmul", mutates_args=(), device_types="cpu")
def sparse_dense_matmul(
    row_pointers: Tensor, embedding_ids: Tensor, sample_ids: Tensor, gains: Tensor, embedding_table: Tensor,
    device_batch_size: int, num_sc_per_device: int, num_partitions: int,
    max_ids_per_partition: int, max_unique_ids_per_partition: int,
) -> Tensor:
    d = _decode(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size,
                num_sc_per_device, num_partitions)
    return reference.lookup(d, embedding_table, device_batch_size)


@sparse_dense_matmul.register_fake
def _(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size, *_):
    return embedding_table.new_empty((device_batch_size, embedding_table.shape[1]), dtype=torch.float32)


def _row_grads(row_pointers, embedding_ids, sample_ids, gains, table, grad, device_batch_size, num_sc, parts):
    d = _decode(row_pointers, embedding_ids, sample_ids, gains, table, device_batch_size, num_sc, parts)
    return reference.row_gradients(d, grad)


@torch.library.custom_op(
    "tpurec::sparse_dense_matmul_grad_with_sgd", mutates_args=("embedding_table",), device_types="cpu"
)
def sparse_dense_matmul_grad_with_sgd(
    row_pointers: Tensor, embedding_ids: Tensor, sample_ids: Tensor, gains: Tensor, embedding_table: Tensor,
    activations_grad: Tensor, learning_rate: float,
    device_batch_size: int, num_sc_per_device: int, num_partitions: int,
    max_ids_per_partition: int, max_unique_ids_per_partition: int,
) -> None:
    rows, g = _row_grads(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                         device_batch_size, num_sc_per_device, num_partitions)
    reference.sgd_update(embedding_table, rows, g, learning_rate)


@torch.library.custom_op(
    "tpurec::sparse_dense_matmul_grad_with_adagrad",
    mutates_args=("embedding_table", "accumulator"), device_types="cpu",
)
def sparse_dense_matmul_grad_with_adagrad(
    row_pointers: Tensor, embedding_ids: Tensor, sample_ids: Tensor, gains: Tensor, embedding_table: Tensor,
    accumulator: Tensor, activations_grad: Tensor, learning_rate: float, epsilon: float,
    device_batch_size: int, num_sc_per_device: int, num_partitions: int,
    max_ids_per_partition: int, max_unique_ids_per_partition: int,
) -> None:
    """Element-wise Adagrad for a 2-D accumulator, row-wise Adagrad for a 1-D one."""
    rows, g = _row_grads(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                         device_batch_size, num_sc_per_device, num_partitions)
    reference.adagrad_update(embedding_table, accumulator, rows, g, learning_rate, epsilon)


@torch.library.custom_op(
    "tpurec::sparse_dense_matmul_grad_with_adam",
    mutates_args=("embedding_table", "momentum", "velocity"), device_types="cpu",
)
def sparse_dense_matmul_grad_with_adam(
    row_pointers: Tensor, embedding_ids: Tensor, sample_ids: Tensor, gains: Tensor, embedding_table: Tensor,
    momentum: Tensor, velocity: Tensor, activations_grad: Tensor,
    alpha_t: float, beta_1: float, beta_2: float, epsilon_hat: float,
    device_batch_size: int, num_sc_per_device: int, num_partitions: int,
    max_ids_per_partition: int, max_unique_ids_per_partition: int,
) -> None:
    rows, g = _row_grads(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                         device_batch_size, num_sc_per_device, num_partitions)
    reference.adam_update(embedding_table, momentum, velocity, rows, g, alpha_t, beta_1, beta_2, epsilon_hat)


# In-place updates have nothing to compute under fake tensors.
for _op in (sparse_dense_matmul_grad_with_sgd, sparse_dense_matmul_grad_with_adagrad, sparse_dense_matmul_grad_with_adam):
    _op.register_fake(lambda *args, **kwargs: None)
