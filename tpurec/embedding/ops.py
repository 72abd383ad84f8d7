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

from collections import OrderedDict

import torch
from torch import Tensor

from tpurec.embedding import reference

# The forward and the fused backward of one step decode the same SparseCore input; keep the last
# few decodes, keyed by the identity of the (immutable once built) input tensors. The cache holds
# those tensors, so an id cannot be reused by a different tensor while its entry lives.
_DECODED: OrderedDict[tuple, tuple] = OrderedDict()
_DECODED_MAX = 8


def _decode(row_pointers, embedding_ids, sample_ids, gains, table, device_batch_size, num_sc, parts):
    key = (
        id(row_pointers),
        id(embedding_ids),
        id(sample_ids),
        id(gains),
        embedding_ids._version,
        gains._version,
        table.shape[0],
        device_batch_size,
        num_sc,
        parts,
    )
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
    d = _decode(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        embedding_table,
        device_batch_size,
        num_sc_per_device,
        num_partitions,
    )
    return reference.lookup(d, embedding_table, device_batch_size)


@sparse_dense_matmul.register_fake
def _(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size, *_):
    return embedding_table.new_empty((device_batch_size, embedding_table.shape[1]), dtype=torch.float32)


def row_gradients(row_pointers, embedding_ids, sample_ids, gains, table, grad, device_batch_size, num_sc, parts):
    """(unique physical rows, summed gradient per row) of one SparseCore input: what every fused
    update op of `tpurec.embedding.optimizers` starts from (shares the forward's decode)."""
    d = _decode(row_pointers, embedding_ids, sample_ids, gains, table, device_batch_size, num_sc, parts)
    return reference.row_gradients(d, grad)
