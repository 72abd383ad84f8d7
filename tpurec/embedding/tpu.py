"""TPU adapter: registers the PrivateUse1 ("tpu") kernels of `torch.ops.tpurec.*` onto TorchTPU's ops.

Imported only by `tpurec.embedding.backend.load_tpu_backend()`, after `tpurec.device` has seen
torch_tpu, libtpu and TPU device nodes; never imported on a CPU-only run. Each kernel is a thin
call of the matching `torch.ops.tpu._sparse_dense_matmul*` op (TorchTPU 0.2.0 schemas, listed in
docs/kernels.md) plus a copy of the returned tensors back into the module's storage.

NOT YET RUN ON TPU HARDWARE. `tpurec selftest --device tpu` compares these kernels with the CPU
reference on a TPU host; the schemas are checked with meta tensors where torch_tpu is installed.
"""
from __future__ import annotations

import torch

from tpurec.embedding import ops

_DISPATCH_KEY = "privateuseone"


def _tpu_ops():
    return torch.ops.tpu


def lookup(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size,
           num_sc_per_device, num_partitions, max_ids_per_partition, max_unique_ids_per_partition):
    return _tpu_ops()._sparse_dense_matmul(
        row_pointers, embedding_ids, sample_ids, gains, embedding_table,
        device_batch_size, max_ids_per_partition, max_unique_ids_per_partition,
    )


def _lr(value: float, like: torch.Tensor) -> torch.Tensor:
    # TorchTPU takes learning rates (and Adam's alpha_t) as device tensors, so they can change per step
    # without recompiling.
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def sgd(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad, learning_rate,
        device_batch_size, num_sc_per_device, num_partitions, max_ids_per_partition, max_unique_ids_per_partition):
    new_table = _tpu_ops()._sparse_dense_matmul_grad_with_sgd(
        row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad.contiguous(),
        _lr(learning_rate, embedding_table), device_batch_size, max_ids_per_partition,
        max_unique_ids_per_partition, "tpurec_sgd",
    )
    embedding_table.copy_(new_table)


def adagrad(row_pointers, embedding_ids, sample_ids, gains, embedding_table, accumulator, activations_grad,
            learning_rate, epsilon, device_batch_size, num_sc_per_device, num_partitions,
            max_ids_per_partition, max_unique_ids_per_partition):
    new_table, new_acc = _tpu_ops()._sparse_dense_matmul_grad_with_adagrad(
        row_pointers, embedding_ids, sample_ids, gains, embedding_table, accumulator,
        activations_grad.contiguous(), _lr(learning_rate, embedding_table), epsilon, device_batch_size,
        max_ids_per_partition, max_unique_ids_per_partition, "tpurec_adagrad",
    )
    embedding_table.copy_(new_table)
    accumulator.copy_(new_acc)


def adam(row_pointers, embedding_ids, sample_ids, gains, embedding_table, momentum, velocity, activations_grad,
         alpha_t, beta_1, beta_2, epsilon_hat, device_batch_size, num_sc_per_device, num_partitions,
         max_ids_per_partition, max_unique_ids_per_partition):
    new_table, new_m, new_v = _tpu_ops()._sparse_dense_matmul_grad_with_adam(
        row_pointers, embedding_ids, sample_ids, gains, embedding_table, momentum, velocity,
        activations_grad.contiguous(), _lr(alpha_t, embedding_table), beta_1, beta_2, epsilon_hat,
        device_batch_size, max_ids_per_partition, max_unique_ids_per_partition, "tpurec_adam",
    )
    embedding_table.copy_(new_table)
    momentum.copy_(new_m)
    velocity.copy_(new_v)


def preprocess_with_torch_tpu(ids_int32, offsets_int32, *, max_ids_per_partition, max_unique_ids_per_partition,
                              batch_size, combiner, num_sc_per_device, allow_id_dropping, table_name):
    """TorchTPU's C++ preprocessing (runs on the host CPU); returns its dict of tensors."""
    return torch.ops.tpu.preprocess_sparse_dense_matmul_input(
        ids_int32, offsets_int32, max_ids_per_partition, max_unique_ids_per_partition, 0, batch_size,
        combiner, 1, 1, num_sc_per_device, allow_id_dropping, table_name,
    )


KERNELS = {
    ops.sparse_dense_matmul: lookup,
    ops.sparse_dense_matmul_grad_with_sgd: sgd,
    ops.sparse_dense_matmul_grad_with_adagrad: adagrad,
    ops.sparse_dense_matmul_grad_with_adam: adam,
}


def register() -> None:
    for op, kernel in KERNELS.items():
        op.register_kernel(_DISPATCH_KEY)(kernel)
