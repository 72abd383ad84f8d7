"""The SparseCore lookup as a torch.library custom op: `torch.ops.tpurec.sparse_dense_matmul`.

One interface, two backends. The CPU kernel registered here is the exact reference
(`tpurec.embedding.reference`); `tpurec.embedding.tpu` registers PrivateUse1 ("tpu") kernels that
call TorchTPU's `torch.ops.tpu._sparse_dense_matmul*` and is imported only on a TPU host. Fake
(meta) implementations let modules trace under FakeTensorMode and on the meta device.

Each fused backward-with-update op (`torch.ops.tpurec.sparse_dense_matmul_grad_with_<optimizer>`)
is registered by its optimizer's module in `tpurec.embedding.optimizers`, from `row_gradients` here,
so that an optimizer is self-contained.

Signatures mirror TorchTPU 0.2.0's ops, with two additions the reference needs and a SparseCore
knows from its hardware: `num_sc_per_device` and `num_partitions`. The update ops mutate the table
and optimizer state in place (TorchTPU's return updated copies; the adapter copies them back).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tpurec.embedding import reference
from tpurec.embedding.input_checks import check_csr


@torch.library.custom_op("tpurec::sparse_dense_matmul", mutates_args=(), device_types="cpu")
def sparse_dense_matmul(
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
    check_csr(
        "sparse_dense_matmul",
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        device_batch_size,
        num_sc_per_device,
        num_partitions,
    )
    return reference.lookup_csr(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        embedding_table,
        device_batch_size,
        num_sc_per_device,
        num_partitions,
    )


@sparse_dense_matmul.register_fake
def _(
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    embedding_table: torch.Tensor,
    device_batch_size: int,
    *_: Any,
) -> torch.Tensor:
    return embedding_table.new_empty((device_batch_size, embedding_table.shape[1]), dtype=torch.float32)


# The CPU kernel registered above. Tests replace the CPU kernels of every tpurec op with the TPU
# adapter's (tpurec/emulation/torchtpu_ops.py, adapter_on_cpu); `reference_is_cpu_kernel` tells callers when the
# reference is what CPU tensors reach (`_backend_fns` is torch's private table: without it, say no).
_REFERENCE_CPU_KERNEL = getattr(sparse_dense_matmul, "_backend_fns", {}).get("cpu")


def reference_is_cpu_kernel() -> bool:
    """Whether the ops' CPU kernel is this reference (so a caller may call the reference directly)."""
    current = getattr(sparse_dense_matmul, "_backend_fns", {}).get("cpu")
    return current is not None and current is _REFERENCE_CPU_KERNEL


def row_gradients(
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    table: torch.Tensor,
    grad: torch.Tensor,
    device_batch_size: int,
    num_sc: int,
    parts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique physical rows, summed gradient per row) of one SparseCore input: what every fused
    update op of `tpurec.embedding.optimizers` starts from. On CPU `grad` may also be a
    [features, samples, dim] view (`reference.row_gradients_csr`): the kernel's own output layout."""
    check_csr("update", row_pointers, embedding_ids, sample_ids, gains, device_batch_size, num_sc, parts)
    return reference.row_gradients_csr(
        row_pointers, embedding_ids, sample_ids, gains, table, grad, device_batch_size, num_sc, parts
    )
